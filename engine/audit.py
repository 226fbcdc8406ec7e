"""Spec vs serial replay audit of the verify forward, on bit-exact and non-bit-exact backends.

§2.1 ("Batched verify vs stock decode") and the native audits of §4.7 ("for
each of 140 target verification windows, it clones the pre-forward cache and
replays the same IDs through serial M1 forwards ... all projected logit rows
have identical values, and all cache offsets agree"). For every verify window
of a speculative run this module clones the incoming target caches, replays
the window's tokens one at a time through the same model, and measures

(a) every vocabulary-logit row of the batched verify against the serial
    step's row, and (b) every live cache array after the window (before the
    round's rollback) — the batched-vs-serial arithmetic of this backend,
    kept as |Δ| distributions per kind and dtype (:class:`DeltaStats`:
    max and p99, absolute and relative to the row's / array's largest
    magnitude; never ulp counts, which say nothing across sign changes);
(c) after the rollback, the rolled-back caches against a clone of the
    incoming state fed only the kept positions ``window[:k + 1]`` one at a
    time — what the caches would hold had the rejected tokens never been
    seen (mlx-lm 0.32.2 ``models/cache.py`` semantics: ``trim`` moves the
    offset, the live region is ``[..., :offset, :]``).

The rollback verdict separates arithmetic from logic (:class:`RollbackCheck`):

- ``exact``: byte-equal (a bit-exact backend such as MLX's CPU);
- ``arithmetic``: every live array has the same metadata and shape, every
  position written before the round is byte-equal, and every difference is
  within ``ARITHMETIC_FACTOR`` × the batched-vs-serial cache |Δ| measured in
  the same run (this window and every earlier one, same dtype) — the kept
  positions hold the verify forward's batched bytes, the replay serial ones;
- ``error``: an offset / ``keep`` / ``max_size`` / shape mismatch (positions
  kept or lost), a changed position from before the round, or a value
  difference beyond that bound (a wrong kept position). The evidence names
  the layer, array, position and both sizes.
"""

from __future__ import annotations

import ast
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from traces.digest import live_state

# A rolled-back value may differ from the kept-only replay by at most this many
# times the largest batched-vs-serial cache |Δ| measured so far (same dtype).
ARITHMETIC_FACTOR = 16.0
# Log-histogram resolution of the |Δ| distributions: bins per decade.
BINS_PER_DECADE = 32
_LOG_MIN = -45  # decades; float32 denormals reach 1.4e-45


def _copy_arrays(x: Any) -> Any:
    return tuple(mx.array(a) for a in x) if isinstance(x, tuple | list) else mx.array(x)


def clone_caches(caches: list[Any]) -> list[Any]:
    """Independent copies of mlx-lm caches (arrays copied, not shared)."""
    out = []
    for c in caches:
        n = copy.copy(c)
        if hasattr(c, "keys") and hasattr(c, "offset") and not callable(c.keys):
            if c.keys is not None:  # QuantizedKVCache: (packed, scales, biases) tuples
                n.keys = _copy_arrays(c.keys)
                n.values = _copy_arrays(c.values)
        elif hasattr(c, "cache") and isinstance(c.cache, list):
            n.cache = [None if a is None else mx.array(a) for a in c.cache]
        out.append(n)
    return out


def as_numpy(a: Any) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def _dtype(a: Any) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


class DeltaStats:
    """Distribution of element-wise |Δ| between two paths, absolute and relative.

    Relative |Δ| is divided by the largest magnitude of the reference (serial)
    row or array it belongs to. Max values are exact; p99 comes from a
    log-histogram with ``BINS_PER_DECADE`` bins per decade and is the upper
    edge of the bin holding the 99th percentile (at most ~7.5 % high).
    """

    def __init__(self) -> None:
        self.elements = 0
        self.arrays = 0
        self.equal_arrays = 0
        self.max_abs = 0.0
        self.max_rel = 0.0
        self._abs = np.zeros(0, np.int64)
        self._rel = np.zeros(0, np.int64)
        self._zeros = 0

    @staticmethod
    def _bins(x: np.ndarray) -> np.ndarray:
        pos = x[x > 0]
        idx = np.floor(np.log10(pos) * BINS_PER_DECADE).astype(np.int64) - _LOG_MIN * BINS_PER_DECADE
        return np.clip(idx, 0, None)

    def _add_hist(self, hist: np.ndarray, x: np.ndarray) -> np.ndarray:
        idx = self._bins(x)
        if idx.size:
            counts = np.bincount(idx)
            if counts.size > hist.size:
                hist = np.pad(hist, (0, counts.size - hist.size))
            hist[: counts.size] += counts
        return hist

    def add(self, absd: np.ndarray, scale: float | np.ndarray) -> None:
        """Add one array's |Δ| (any shape) with its reference magnitude (scalar or broadcast)."""
        absd = np.asarray(absd, np.float64)
        rel = absd / np.maximum(np.asarray(scale, np.float64), np.finfo(np.float64).tiny)
        self.arrays += 1
        self.elements += absd.size
        self._zeros += int(np.count_nonzero(absd == 0))
        if not np.any(absd):
            self.equal_arrays += 1
            return
        self.max_abs = max(self.max_abs, float(np.nanmax(absd)))
        self.max_rel = max(self.max_rel, float(np.nanmax(rel)))
        self._abs = self._add_hist(self._abs, absd)
        self._rel = self._add_hist(self._rel, rel)

    def _quantile(self, hist: np.ndarray, q: float) -> float:
        rank = math.ceil(q * self.elements)
        if rank <= self._zeros or not hist.size:
            return 0.0
        i = int(np.searchsorted(np.cumsum(hist), rank - self._zeros))
        return float(10 ** ((i + 1) / BINS_PER_DECADE + _LOG_MIN))

    def p99_abs(self) -> float:
        return min(self._quantile(self._abs, 0.99), self.max_abs)

    def p99_rel(self) -> float:
        return min(self._quantile(self._rel, 0.99), self.max_rel)

    def to_dict(self) -> dict[str, Any]:
        return {
            "arrays": self.arrays, "byte_equal_arrays": self.equal_arrays, "elements": self.elements,
            "max_abs": self.max_abs, "p99_abs": self.p99_abs(),
            "max_rel": self.max_rel, "p99_rel": self.p99_rel(),
        }


@dataclass
class Diff:
    """How two arrays of (expected) the same shape differ."""

    equal: bool
    max_abs: float = 0.0
    max_rel: float = 0.0  # max |Δ| / max |reference|
    where: tuple[int, ...] = ()
    shape_mismatch: str = ""
    dtype: str = ""

    def describe(self) -> str:
        if self.shape_mismatch:
            return self.shape_mismatch
        if self.equal:
            return "equal"
        return f"max |Δ| {self.max_abs:.3g} (rel {self.max_rel:.2g}) at {list(self.where)}"


def _absdiff(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if np.issubdtype(x.dtype, np.floating):
        return np.abs(x.astype(np.float64) - y.astype(np.float64))
    return np.abs(x.astype(np.int64) - y.astype(np.int64)).astype(np.float64)


def compare_arrays(a: Any, b: Any, stats: DeltaStats | None = None, *, rows: bool = False) -> Diff:
    """``a`` (batched / under test) vs ``b`` (serial / reference); optionally add |Δ| to ``stats``.

    ``rows``: relative |Δ| is taken per last-axis row (logit rows) instead of per array.
    """
    x, y = as_numpy(a), as_numpy(b)
    dtype = _dtype(a) if hasattr(a, "dtype") else str(x.dtype)
    if x.shape != y.shape:
        return Diff(False, shape_mismatch=f"shape {list(x.shape)} vs {list(y.shape)}", dtype=dtype)
    absd = _absdiff(x, y)
    mag = np.abs(y.astype(np.float64))
    scale: float | np.ndarray
    if rows and y.ndim:
        scale = mag.max(axis=-1, keepdims=True) if y.size else 1.0
    else:
        scale = float(mag.max()) if y.size else 1.0
    if stats is not None:
        stats.add(absd, scale)
    if x.tobytes() == y.tobytes():
        return Diff(True, dtype=dtype)
    if not absd.size or not np.any(absd):  # e.g. -0.0 vs +0.0
        return Diff(False, 0.0, 0.0, (), dtype=dtype)
    flat = int(np.nanargmax(absd))
    where = tuple(int(i) for i in np.unravel_index(flat, x.shape))
    ref = float(np.asarray(scale).reshape(-1)[0]) if np.ndim(scale) == 0 else float(
        np.asarray(scale)[where[:-1]].reshape(-1)[0])
    max_abs = float(absd[where])
    return Diff(False, max_abs, max_abs / ref if ref > 0 else math.inf, where, dtype=dtype)


def meta_diff(a: str | None, b: str | None) -> str:
    """``offset 38 vs 37`` for the metadata keys (``traces.digest.live_state``) that differ."""
    def parse(m: str | None) -> dict[str, Any]:
        text = (m or "").strip()
        if text.startswith("meta:"):
            return dict(ast.literal_eval(text.removeprefix("meta:")))
        return {"state": text}

    x, y = parse(a), parse(b)
    keys = [k for k in dict.fromkeys([*x, *y]) if x.get(k) != y.get(k)]
    return ", ".join(f"{k} {x.get(k)} vs {y.get(k)}" for k in keys)


def layer_arrays(c: Any) -> tuple[str | None, list[tuple[str, Any]]]:
    meta, groups = live_state(c)
    return meta, [(f"{name}[{j}]", a) for name, arrs in groups for j, a in enumerate(arrs)]


def compare_caches(
    batched: list[Any], serial: list[Any], stats: Callable[[str], DeltaStats] | None = None
) -> list[tuple[int, str, Diff]]:
    """Per layer and array, the live state of two cache lists (metadata, shapes, values).

    ``stats(dtype)``, when given, returns the distribution each array's |Δ| is added to.
    """
    out: list[tuple[int, str, Diff]] = []
    for layer, (b, s) in enumerate(zip(batched, serial, strict=True)):
        meta_b, arrs_b = layer_arrays(b)
        meta_s, arrs_s = layer_arrays(s)
        if meta_b != meta_s:
            out.append((layer, "meta", Diff(False, shape_mismatch=meta_diff(meta_b, meta_s))))
            continue
        if len(arrs_b) != len(arrs_s):
            out.append((layer, "arrays", Diff(False, shape_mismatch=f"{len(arrs_b)} vs {len(arrs_s)} arrays")))
            continue
        for (name, x), (_, y) in zip(arrs_b, arrs_s, strict=True):
            if x is None and y is None:
                continue
            if x is None or y is None:
                out.append((layer, name, Diff(False, shape_mismatch="None vs array")))
                continue
            out.append((layer, name, compare_arrays(x, y, stats(_dtype(x)) if stats else None)))
    return out


@dataclass
class RollbackCheck:
    """The rollback verdict of one window: ``exact`` | ``arithmetic`` | ``error``, with evidence."""

    verdict: str
    bound: float  # allowed |Δ| (ARITHMETIC_FACTOR × measured arithmetic scale)
    scale: float  # the measured batched-vs-serial cache |Δ| the bound derives from
    errors: list[str] = field(default_factory=list)  # one line per layer/array in error
    arithmetic: list[str] = field(default_factory=list)  # one line per layer/array within the bound
    max_abs: float = 0.0  # largest |Δ| vs the kept-only replay


def _position_deltas(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Largest |Δ| per time position of a ``[..., T, D]`` KV array."""
    d = _absdiff(x, y)
    return d.reshape(-1, d.shape[-2], d.shape[-1]).max(axis=(0, 2)) if d.size else np.zeros(d.shape[-2])


def check_rollback(
    rolled: list[Any],
    kept_replay: list[Any],
    incoming_offsets: list[int | None],
    scale: float,
    factor: float = ARITHMETIC_FACTOR,
    stats: Callable[[str], DeltaStats] | None = None,
) -> tuple[RollbackCheck, list[tuple[int, str, Diff]]]:
    """Rolled-back caches vs a kept-only serial replay of the same incoming state.

    Args:
        rolled: The caches after the round's rollback.
        kept_replay: A clone of the incoming caches fed only the kept positions, one at a time.
        incoming_offsets: Per layer, the KV offset before the round (None: no positions).
        scale: The batched-vs-serial cache |Δ| measured in this run (same dtype); 0 on a
            bit-exact backend, where any difference is an error.
        factor: How far beyond ``scale`` a difference is still arithmetic.
        stats: ``stats(dtype)``: the distribution the rollback |Δ| is added to.
    """
    bound = factor * scale
    diffs = compare_caches(rolled, kept_replay, stats)
    errors: list[str] = []
    arithmetic: list[str] = []
    for layer, name, d in diffs:
        if d.equal:
            continue
        if d.shape_mismatch:
            what = "metadata (offset/keep/max_size)" if name == "meta" else "shape"
            errors.append(f"layer {layer} {name}: {d.describe()} (kept-only replay second): {what} "
                          "differs, positions were kept or lost")
            continue
        if name.startswith(("keys", "values")):
            _, arrs_r = layer_arrays(rolled[layer])
            _, arrs_k = layer_arrays(kept_replay[layer])
            x = as_numpy(dict(arrs_r)[name])
            y = as_numpy(dict(arrs_k)[name])
            per_pos = _position_deltas(x, y)
            # The live view is in temporal order (a rotating cache's last max_size positions):
            # its last (offset after - offset before) entries are this round's kept positions.
            off = incoming_offsets[layer] or 0
            end = int(getattr(kept_replay[layer], "offset", off))
            first = end - per_pos.size  # absolute position of the view's first entry
            n_pre = min(max(off - first, 0), per_pos.size)
            changed_pre = np.nonzero(per_pos[:n_pre])[0]
            if changed_pre.size:
                p = int(changed_pre[0])
                errors.append(f"layer {layer} {name}: position {first + p} (written before this round, "
                              f"offset {off}) changed by |Δ| {per_pos[p]:.3g}: the rollback touched kept "
                              "history")
                continue
            beyond = np.nonzero(per_pos > bound)[0]
            if beyond.size:
                p = int(beyond[0])
                errors.append(f"layer {layer} {name}: kept position {first + p} differs from the kept-only "
                              f"replay by |Δ| {per_pos[p]:.3g}, beyond {factor:g} × the measured "
                              f"batched-vs-serial |Δ| {scale:.3g}: a wrong value at a kept position")
                continue
        elif d.max_abs > bound:
            errors.append(f"layer {layer} {name}: {d.describe()} vs the kept-only replay, beyond {factor:g} × "
                          f"the measured batched-vs-serial |Δ| {scale:.3g}")
            continue
        arithmetic.append(f"layer {layer} {name}: {d.describe()} <= {factor:g} × measured {scale:.3g}")
    max_abs = max((d.max_abs for _, _, d in diffs), default=0.0)
    if errors:
        verdict = "error"
    elif arithmetic:
        verdict = "arithmetic"
    else:
        verdict = "exact"
    return RollbackCheck(verdict, bound, scale, errors, arithmetic, max_abs), diffs


@dataclass
class WindowAudit:
    round: int
    window: list[int]
    prompt: str = ""
    logits: list[Diff] = field(default_factory=list)  # one per window position
    argmax_flips: list[int] = field(default_factory=list)  # rows whose top-1 differs
    caches: list[tuple[int, str, Diff]] = field(default_factory=list)  # (layer, array, diff)
    k_accept: int | None = None
    rollback: list[tuple[int, str, Diff]] = field(default_factory=list)  # after rollback
    rollback_check: RollbackCheck | None = None

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
    def rollback_ok(self) -> bool:
        return self.rollback_check is None or self.rollback_check.verdict != "error"

    @property
    def equal(self) -> bool:
        return self.logits_equal and self.caches_equal and self.rollback_equal

    def worst_logits(self) -> str:
        bad = [(i, d) for i, d in enumerate(self.logits) if not d.equal]
        if not bad:
            return "equal"
        i, d = max(bad, key=lambda t: t[1].max_abs)
        flips = f", top-1 differs in rows {self.argmax_flips}" if self.argmax_flips else ""
        return f"row {i}: {d.describe()}{flips}"

    def worst_cache(self) -> str:
        return _worst(self.caches)

    def first_bad_rollback(self) -> str:
        rc = self.rollback_check
        if rc is not None and rc.errors:
            return rc.errors[0]
        return _first(self.rollback)

    def rollback_summary(self) -> str:
        rc = self.rollback_check
        if rc is None:
            return "not checked"
        if rc.verdict == "exact":
            return "exact"
        if rc.verdict == "arithmetic":
            return f"within arithmetic (max |Δ| {rc.max_abs:.3g} <= bound {rc.bound:.3g})"
        return f"ERROR {rc.errors[0]}"


def _worst(diffs: list[tuple[int, str, Diff]]) -> str:
    bad = [(layer, name, d) for layer, name, d in diffs if not d.equal]
    if not bad:
        return "equal"
    layer, name, d = max(bad, key=lambda t: (bool(t[2].shape_mismatch), t[2].max_abs))
    return f"layer {layer} {name}: {d.describe()}"


def _first(diffs: list[tuple[int, str, Diff]]) -> str:
    for layer, name, d in diffs:
        if not d.equal:
            return f"layer {layer} {name}: {d.describe()}"
    return "equal"


def _kv_offsets(caches: list[Any]) -> list[int | None]:
    return [int(c.offset) if hasattr(c, "keys") and hasattr(c, "offset") else None for c in caches]


class SerialReplayAudit:
    """An executor observer that audits every verify window (see module docstring).

    ``stats`` holds the |Δ| distributions keyed by ``(kind, dtype)``, kind one of
    ``logits`` (batched vs serial rows), ``cache`` (live arrays after the
    verify vs after the serial replay) and ``rollback`` (rolled back vs kept-only replay).
    ``prompt`` labels the windows of the next request.
    """

    def __init__(self, model: Any, factor: float = ARITHMETIC_FACTOR) -> None:
        self.model = model
        self.factor = factor
        self.windows: list[WindowAudit] = []
        self.stats: dict[tuple[str, str], DeltaStats] = {}
        self.prompt = ""
        self._incoming: list[Any] | None = None
        self._cache_scale: dict[str, float] = {}  # dtype -> largest batched-vs-serial cache |Δ| so far

    def _stats(self, kind: str, dtype: str) -> DeltaStats:
        return self.stats.setdefault((kind, dtype), DeltaStats())

    def _replay(self, caches: list[Any], tokens: list[int]) -> list[Any]:
        rows = []
        for tok in tokens:
            row = self.model(mx.array([[tok]], mx.uint32), cache=caches)[0, -1, :]
            mx.eval(row)
            rows.append(row)
        return rows

    def before_verify(self, index: int, window: list[int], caches: list[Any]) -> None:
        self._incoming = clone_caches(caches)
        mx.eval([c.state for c in self._incoming if hasattr(c, "state")])

    def after_verify(self, index: int, window: list[int], block: Any, caches: list[Any]) -> None:
        assert self._incoming is not None, "after_verify without before_verify"
        serial = clone_caches(self._incoming)
        audit = WindowAudit(index, list(window), self.prompt)
        for i, row in enumerate(self._replay(serial, list(window))):
            audit.logits.append(compare_arrays(block[i], row, self._stats("logits", _dtype(row)), rows=True))
            if int(mx.argmax(block[i])) != int(mx.argmax(row)):
                audit.argmax_flips.append(i)
        audit.caches = compare_caches(caches, serial, lambda t: self._stats("cache", t))
        for _, _, d in audit.caches:  # the run's arithmetic scale, for the rollback bound
            if not d.shape_mismatch:
                self._cache_scale[d.dtype] = max(self._cache_scale.get(d.dtype, 0.0), d.max_abs)
        self.windows.append(audit)

    def after_rollback(self, index: int, k_accept: int, caches: list[Any]) -> None:
        assert self._incoming is not None and self.windows and self.windows[-1].round == index
        audit = self.windows[-1]
        kept = clone_caches(self._incoming)
        self._replay(kept, audit.window[: k_accept + 1])
        audit.k_accept = k_accept
        dtypes = {d.dtype for _, _, d in audit.caches if d.dtype}
        scale = max((self._cache_scale.get(t, 0.0) for t in dtypes), default=0.0)
        audit.rollback_check, audit.rollback = check_rollback(
            caches, kept, _kv_offsets(self._incoming), scale, self.factor,
            lambda t: self._stats("rollback", t),
        )
        self._incoming = None

    def rollback_errors(self) -> list[str]:
        """``[prompt ]round R (k_accept K): <evidence>`` for every layer/array in rollback error."""
        out = []
        for w in self.windows:
            if w.rollback_check is not None:
                label = f"{w.prompt} " if w.prompt else ""
                out += [f"{label}round {w.round} (k_accept {w.k_accept}): {e}" for e in w.rollback_check.errors]
        return out

    def first_bad_rollback(self) -> str | None:
        """``round R (k_accept K): layer L array: ...`` for the first window whose rollback is an error."""
        for w in self.windows:
            if not w.rollback_ok:
                return f"round {w.round} (k_accept {w.k_accept}): {w.first_bad_rollback()}"
        return None

