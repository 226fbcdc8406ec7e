"""Spec vs serial replay audit of the verify forward.

§2.1 ("Batched verify vs stock decode") and the native audits of §4.7 ("for
each of 140 target verification windows, it clones the pre-forward cache and
replays the same IDs through serial M1 forwards ... all projected logit rows
have identical values, and all cache offsets agree"). For every verify window
of a speculative run this module clones the incoming target caches, replays
the window's tokens one at a time through the same model, and compares, byte
for byte, (a) every vocabulary-logit row of the batched verify with the serial
step's row and (b) every live cache array after the window (before the
round's rollback); then, after the rollback, (c) the rolled-back caches
against a clone of the incoming state fed only the kept positions
``window[:k + 1]`` one at a time — what the caches would hold had the rejected
tokens never been seen. A difference is reported with its largest ulp and absolute
error and where it is; it is batched-vs-serial arithmetic (different kernels
over the same inputs), never by itself a logic bug — the token-level checks
decide that.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from traces.digest import live_state


def clone_caches(caches: list[Any]) -> list[Any]:
    """Independent copies of mlx-lm caches (arrays copied, not shared)."""
    out = []
    for c in caches:
        n = copy.copy(c)
        if hasattr(c, "keys") and hasattr(c, "offset") and not callable(c.keys):
            if c.keys is not None:
                n.keys = mx.array(c.keys)
                n.values = mx.array(c.values)
        elif hasattr(c, "cache") and isinstance(c.cache, list):
            n.cache = [None if a is None else mx.array(a) for a in c.cache]
        out.append(n)
    return out


@dataclass
class Diff:
    """Largest difference between two arrays of the same shape."""

    equal: bool
    max_abs: float = 0.0
    max_ulp: int = 0
    where: tuple[int, ...] = ()
    shape_mismatch: str = ""

    def describe(self) -> str:
        if self.shape_mismatch:
            return self.shape_mismatch
        if self.equal:
            return "equal"
        return f"max |Δ| {self.max_abs:.3g} ({self.max_ulp} ulp) at {list(self.where)}"


def _ordered_ints(a: np.ndarray) -> np.ndarray:
    """Map floats to integers whose order and distance count ulps."""
    width = {2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
    i = a.view(width).astype(np.int64)
    sign_bit = 1 << (8 * a.dtype.itemsize - 1)
    return np.where(i < 0, -(i + sign_bit), i)


def compare_arrays(a: Any, b: Any) -> Diff:
    x, y = np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a), np.array(
        b.astype(mx.float32) if b.dtype == mx.bfloat16 else b
    )
    if x.shape != y.shape:
        return Diff(False, shape_mismatch=f"shape {list(x.shape)} vs {list(y.shape)}")
    if x.tobytes() == y.tobytes():
        return Diff(True)
    if not np.issubdtype(x.dtype, np.floating):
        idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(x != y)), x.shape))
        return Diff(False, float(np.max(np.abs(x.astype(np.int64) - y.astype(np.int64)))), 0, idx)
    absd = np.abs(x.astype(np.float64) - y.astype(np.float64))
    ulp = np.abs(_ordered_ints(x) - _ordered_ints(y))
    where = tuple(int(i) for i in np.unravel_index(int(np.argmax(ulp)), x.shape))
    return Diff(False, float(np.nanmax(absd)), int(ulp[where]), where)


@dataclass
class WindowAudit:
    round: int
    window: list[int]
    logits: list[Diff] = field(default_factory=list)  # one per window position
    caches: list[tuple[int, str, Diff]] = field(default_factory=list)  # (layer, array, diff)
    k_accept: int | None = None
    rollback: list[tuple[int, str, Diff]] = field(default_factory=list)  # after rollback

    @property
    def logits_equal(self) -> bool:
        return all(d.equal for d in self.logits)

    @property
    def caches_equal(self) -> bool:
        return all(d.equal for _, _, d in self.caches)

    @property
    def rollback_equal(self) -> bool:
        return all(d.equal for _, _, d in self.rollback)

    @property
    def equal(self) -> bool:
        return self.logits_equal and self.caches_equal and self.rollback_equal

    def worst_logits(self) -> str:
        bad = [(i, d) for i, d in enumerate(self.logits) if not d.equal]
        if not bad:
            return "equal"
        i, d = max(bad, key=lambda t: (t[1].max_ulp, t[1].max_abs))
        return f"row {i}: {d.describe()}"

    def worst_cache(self) -> str:
        return _worst(self.caches)

    def first_bad_rollback(self) -> str:
        return _first(self.rollback)


def _worst(diffs: list[tuple[int, str, Diff]]) -> str:
    bad = [(layer, name, d) for layer, name, d in diffs if not d.equal]
    if not bad:
        return "equal"
    layer, name, d = max(bad, key=lambda t: (t[2].max_ulp, t[2].max_abs))
    return f"layer {layer} {name}: {d.describe()}"


def _first(diffs: list[tuple[int, str, Diff]]) -> str:
    for layer, name, d in diffs:
        if not d.equal:
            return f"layer {layer} {name}: {d.describe()}"
    return "equal"


def compare_caches(batched: list[Any], serial: list[Any]) -> list[tuple[int, str, Diff]]:
    """Per layer and array, the live state of two cache lists compared byte for byte."""
    out: list[tuple[int, str, Diff]] = []
    for layer, (b, s) in enumerate(zip(batched, serial, strict=True)):
        meta_b, groups_b = live_state(b)
        meta_s, groups_s = live_state(s)
        if meta_b != meta_s:
            out.append((layer, "meta", Diff(False, shape_mismatch=f"{(meta_b or '').strip()} vs {(meta_s or '').strip()}")))
            continue
        for (name, arrs_b), (_, arrs_s) in zip(groups_b, groups_s, strict=True):
            for j, (x, y) in enumerate(zip(arrs_b, arrs_s, strict=True)):
                if x is None and y is None:
                    continue
                if x is None or y is None:
                    out.append((layer, f"{name}[{j}]", Diff(False, shape_mismatch="None vs array")))
                    continue
                out.append((layer, f"{name}[{j}]", compare_arrays(x, y)))
    return out


class SerialReplayAudit:
    """An executor observer that audits every verify window (see module docstring)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.windows: list[WindowAudit] = []
        self._incoming: list[Any] | None = None

    def _replay(self, caches: list[Any], tokens: list[int]) -> list[Any]:
        rows = []
        for tok in tokens:
            rows.append(self.model(mx.array([[tok]], mx.uint32), cache=caches)[0, -1, :])
        return rows

    def before_verify(self, index: int, window: list[int], caches: list[Any]) -> None:
        self._incoming = clone_caches(caches)

    def after_verify(self, index: int, window: list[int], block: Any, caches: list[Any]) -> None:
        assert self._incoming is not None, "after_verify without before_verify"
        serial = clone_caches(self._incoming)
        audit = WindowAudit(index, list(window))
        for i, row in enumerate(self._replay(serial, list(window))):
            audit.logits.append(compare_arrays(block[i], row))
        audit.caches = compare_caches(caches, serial)
        self.windows.append(audit)

    def after_rollback(self, index: int, k_accept: int, caches: list[Any]) -> None:
        assert self._incoming is not None and self.windows and self.windows[-1].round == index
        audit = self.windows[-1]
        kept = clone_caches(self._incoming)
        self._replay(kept, audit.window[: k_accept + 1])
        audit.k_accept = k_accept
        audit.rollback = compare_caches(caches, kept)
        self._incoming = None

    def first_bad_rollback(self) -> str | None:
        """``round R: layer L array: ...`` for the first window whose rollback differs."""
        for w in self.windows:
            if not w.rollback_equal:
                return f"round {w.round} (k_accept {w.k_accept}): {w.first_bad_rollback()}"
        return None
