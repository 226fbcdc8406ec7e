"""Per-request cache rollback plan: trim, the spec-round trio, the ring-wrap guard.

Reference: ``../shared/reference/speculative-decoding.md`` §2 "Cache rollback
contract" and "Deliberate deviations":

- Trimmable caches (mlx-lm 0.32.2 ``models/cache.py`` ``KVCache``,
  ``RotatingKVCache`` before it wraps) roll back with ``trim(d - k)``.
- Recurrent caches (``ArraysCache`` of the gated-DeltaNet layers in
  ``models/qwen3_5.py`` ``GatedDeltaNet``) cannot be trimmed; they get the
  spec-round trio: ``begin()`` snapshots the state before the verify forward
  (MLX arrays are immutable, so the snapshot is the list of references) and
  records the mixer's position-local projections (``in_proj_*`` outputs);
  ``rollback(keep)`` restores the snapshot and REPLAYS the kept positions
  through mlx-lm's own ``GatedDeltaNet.__call__`` with the projections served
  from the recording, so conv1d and the delta kernel run on exactly the bytes
  the verify forward used; ``commit()`` (full accept) keeps the state as is.
- Rotating caches, ``rotating="guard"`` (the default): before each round, if
  ``offset + n + 1 >= max_size`` the verify window could wrap the ring, after
  which ``trim`` is no longer exact (mlx-lm ``is_trimmable`` turns False). The
  executor then stops speculating and finishes with plain decode (the §2
  ring-wrap guard) instead of raising (upstream) or trimming nothing (what
  ``trim_prompt_cache`` silently does).
- Rotating caches, ``rotating="exact"``: ``RingRound`` keeps what the round may
  overwrite and re-applies the kept positions through the cache's own update
  code. mlx-lm 0.32.2 ``RotatingKVCache.update_and_fetch`` takes a multi-token
  update through ``_update_concat`` (``_temporal_order``, then ``_trim`` to the
  last ``max_size - 1`` positions plus ``keep``, then append: new arrays, the
  old buffers are untouched) and a single token through ``_update_in_place``
  (grow or ``_trim`` into new arrays, else write ONE slot of the existing
  buffer in place, rotating ``_idx`` back to ``keep`` at ``max_size``). So
  ``begin()`` keeps the buffers by reference plus ``offset``/``_idx``, and,
  before each in-place write into those buffers, a copy of the one slot it
  overwrites; every ``update_and_fetch`` call's K/V is recorded (references).
  ``rollback(keep)`` writes the saved slots back (newest first), restores
  ``offset``/``_idx`` and re-runs mlx-lm's own ``update_and_fetch`` on the
  recorded calls cut to the first ``keep`` positions, so the cache is — byte
  for byte, buffers and indices — the incoming cache fed only the kept
  positions with the same call structure. The K/V re-applied are the ones the
  verify forward computed (the same bytes a trim would have kept). The
  target's usual round (one concat call, ``keep >= 2``) is cut instead of
  re-run: the concat's trim depends on the incoming state only, so the kept
  call writes the verify's buffer minus its rejected tail. While the
  cache is still trimmable after the round (it did not reach ``max_size``) it
  is trimmed as in guard mode, so exact and guard agree up to the wrap. A
  cache this cannot handle (not mlx-lm's ``RotatingKVCache`` update code,
  quantized keys, ``keep > 0`` — see ``ring_unsupported``) keeps the guard,
  with the reason recorded.
- A cache that is neither trimmable nor round-capable ends speculation for
  the request with a recorded reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from engine import caches as cache_ops

# Mixer attribute names of recurrent layers whose projections can be recorded.
RECURRENT_MIXERS = ("linear_attn",)

# How rotating caches are handled past the ring wrap (``GenerationParams.rotating``).
ROTATING_MODES = ("guard", "exact")

# RotatingKVCache methods whose mlx-lm 0.32.2 behaviour RingRound mirrors.
_RING_METHODS = ("update_and_fetch", "_update_concat", "_update_in_place", "_trim", "_temporal_order")


def is_rotating(c: Any) -> bool:
    return hasattr(c, "max_size") and hasattr(c, "_idx")


def is_kv(c: Any) -> bool:
    return hasattr(c, "keys") and hasattr(c, "offset") and hasattr(c, "trim")


def is_arrays(c: Any) -> bool:
    return hasattr(c, "cache") and isinstance(getattr(c, "cache", None), list)


def ring_mechanics_unsupported(c: Any) -> str | None:
    """Why ``RingRound`` cannot restore rotating cache ``c`` exactly (None: it can)."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    name = type(c).__name__
    if not isinstance(c, RotatingKVCache):
        return f"{name} is not mlx-lm RotatingKVCache"
    for m in _RING_METHODS:
        if getattr(type(c), m, None) is not getattr(RotatingKVCache, m):
            return f"{name} overrides RotatingKVCache.{m}"
    if c.keys is not None and not (isinstance(c.keys, mx.array) and isinstance(c.values, mx.array)):
        return f"{name} holds non-array (quantized?) keys/values"
    if not 0 <= int(c.keep) < int(c.max_size):
        return f"{name} keep {c.keep} outside [0, max_size {c.max_size})"
    return None


def ring_unsupported(c: Any) -> str | None:
    """Why speculation past the wrap of rotating cache ``c`` cannot be exact (None: it can).

    Besides the restore mechanics: with ``keep > 0`` (mlx-lm's ``max_kv_size``
    caches keep 4) a multi-token update is not plain decode past the wrap —
    ``make_mask`` gives window position ``i`` a sliding window of ``max_size``
    over the concatenated buffer, which hides the first ``i`` buffer entries,
    the kept prefix, while single-token decode always attends to it. The
    verify itself would then differ from plain decode, whatever the rollback.
    """
    why = ring_mechanics_unsupported(c)
    if why is None and int(c.keep) > 0:
        why = (
            f"{type(c).__name__} keep={int(c.keep)}: mlx-lm's multi-token window mask hides "
            "the kept prefix from later window positions past the wrap (not plain decode)"
        )
    return why


def ring_window(*models: Any) -> int | None:
    """The smallest ``max_size`` of the rotating caches ``make_prompt_cache`` gives ``models``
    (None: none rotates). Where a round first could wrap a ring (the guard's point)."""
    from mlx_lm.models.cache import make_prompt_cache

    sizes = [int(c.max_size) for m in models if m is not None for c in make_prompt_cache(m) if is_rotating(c)]
    return min(sizes) if sizes else None


class RingRound:
    """Exact rollback of one ``RotatingKVCache`` across one round (module docstring).

    ``begin()`` before the round's forwards, ``end()`` after them (recording
    off), then ``rollback(keep)`` or ``commit()``.
    """

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.snapshot: tuple[Any, Any, int, int] | None = None
        self.saved: list[tuple[int, Any, Any]] = []  # (slot, keys, values) before each in-place write
        self.calls: list[tuple[Any, Any]] = []  # every update_and_fetch's (keys, values)
        self._base: type | None = None

    @property
    def armed(self) -> bool:
        return self.snapshot is not None

    def begin(self) -> None:
        c = self.cache
        self.snapshot = (c.keys, c.values, int(c.offset), int(c._idx))
        self.saved, self.calls = [], []
        self._base = type(c)
        c.__class__ = _recording_ring(self._base, self)

    def end(self) -> None:
        if self._base is not None:
            self.cache.__class__ = self._base
            self._base = None

    def before_update(self, keys: Any, values: Any) -> int | None:
        """Keep the slot an in-place write is about to overwrite; return it (None: no overwrite)."""
        import mlx.core as mx

        c = self.cache
        self.calls.append((keys, values))
        assert self.snapshot is not None
        if keys.shape[2] != 1 or c.keys is None or c.keys is not self.snapshot[0]:
            return None  # concat path, or a buffer this round created: nothing kept can be lost
        size = c.keys.shape[2]
        grows = int(c.offset) >= size and size < int(c.max_size)
        if grows or size > int(c.max_size):
            return None  # _update_in_place first builds a new buffer (zeros appended / _trim)
        j = int(c.keep) if int(c._idx) == int(c.max_size) else int(c._idx)
        ks = mx.contiguous(c.keys[..., j : j + 1, :])
        vs = mx.contiguous(c.values[..., j : j + 1, :])
        mx.eval(ks, vs)  # a real copy now, so the in-place write can still donate the buffer
        self.saved.append((j, ks, vs))
        return j

    def after_update(self, slot: int | None) -> None:
        if slot is not None and int(self.cache._idx) - 1 != slot:
            raise cache_ops.CacheRollbackError(
                f"RotatingKVCache wrote slot {int(self.cache._idx) - 1}, expected {slot} "
                "(mlx-lm update code changed?)"
            )

    def commit(self) -> None:
        """Keep everything the round wrote (full accept, or the caller trims)."""
        self.end()
        self.snapshot, self.saved, self.calls = None, [], []

    def rollback(self, keep: int) -> None:
        """Restore the round's incoming state and re-apply its first ``keep`` positions."""
        import mlx.core as mx

        self.end()
        if self.snapshot is None:
            raise cache_ops.CacheRollbackError("RotatingKVCache rollback without a round")
        c = self.cache
        keys, values, offset, idx = self.snapshot
        if self._concat_cut(keep):
            self.snapshot, self.saved, self.calls = None, [], []
            return
        for j, ks, vs in reversed(self.saved):
            keys[..., j : j + 1, :] = ks
            values[..., j : j + 1, :] = vs
        c.keys, c.values, c.offset, c._idx = keys, values, offset, idx
        left = keep
        for k, v in self.calls:
            if left <= 0:
                break
            s = min(left, int(k.shape[2]))
            c.update_and_fetch(k[..., :s, :], v[..., :s, :])
            left -= s
        if left > 0:
            raise cache_ops.CacheRollbackError(
                f"RotatingKVCache: keep {keep} positions but the round recorded {keep - left}"
            )
        if c.keys is not None:
            mx.eval(c.keys, c.values)
        self.snapshot, self.saved, self.calls = None, [], []

    def _concat_cut(self, keep: int) -> bool:
        """The target's case, without re-running the concat: one ``_update_concat`` call of
        ``S`` positions wrote ``[_trim(_temporal_order(incoming)), window]`` with a trim that
        depends on the incoming state only, so the kept call (``keep >= 2``, also a concat)
        writes the same buffer minus the last ``S - keep`` positions: cut them."""
        c = self.cache
        assert self.snapshot is not None
        if len(self.calls) != 1 or self.saved or keep < 2:
            return False
        s = int(self.calls[0][0].shape[2])
        size = int(c.keys.shape[2])
        if s < keep or int(c.offset) != self.snapshot[2] + s or int(c._idx) != size:
            return False  # not the state _update_concat leaves: re-apply instead
        n = size - (s - keep)
        c.keys, c.values = c.keys[..., :n, :], c.values[..., :n, :]
        c.offset, c._idx = self.snapshot[2] + keep, n
        return True


_RING_CLASSES: dict[type, type] = {}


def _recording_ring(base: type, r: RingRound) -> type:
    """A subclass of ``base`` whose ``update_and_fetch`` reports to ``self._ring_round``."""
    cls = _RING_CLASSES.get(base)
    if cls is None:

        def update_and_fetch(self: Any, keys: Any, values: Any) -> Any:
            ring: RingRound = self._ring_round
            slot = ring.before_update(keys, values)
            out = getattr(base, "update_and_fetch")(self, keys, values)  # noqa: B009
            ring.after_update(slot)
            return out

        cls = type(f"Recording{base.__name__}", (base,), {"update_and_fetch": update_and_fetch})
        _RING_CLASSES[base] = cls
    r.cache._ring_round = r
    return cls


@dataclass
class _Recurrent:
    index: int
    cache: Any
    mixer: Any
    projections: dict[str, Any]
    snapshot: tuple[list[Any], Any, Any] | None = None
    recorded: dict[str, Any] = field(default_factory=dict)
    inputs: Any = None
    mask: Any = None


class CacheRollback:
    """How one request's target caches roll back after each verify round."""

    def __init__(self, model: Any, caches: list[Any], rotating: str = "guard") -> None:
        if rotating not in ROTATING_MODES:
            raise ValueError(f"rotating must be one of {ROTATING_MODES}, got {rotating!r}")
        self.model = model
        self.caches = caches
        self.rotating = rotating
        self.trimmable: list[Any] = []
        self.recurrent: list[_Recurrent] = []
        self.rings: dict[int, RingRound] = {}  # exact mode: layer -> its ring round
        self.ring_fallback: dict[int, str] = {}  # exact mode: layer -> why it keeps the guard
        self.unsupported: list[str] = []
        layers = getattr(model, "layers", [])
        for i, c in enumerate(caches):
            if rotating == "exact" and is_rotating(c):
                why = ring_unsupported(c)
                if why is None:
                    self.rings[i] = RingRound(c)
                    continue
                self.ring_fallback[i] = why
            if is_kv(c) and (is_rotating(c) or c.is_trimmable()):
                # A rotating cache that is no longer trimmable is the ring
                # guard's business (it stops speculation before any round).
                self.trimmable.append(c)
                continue
            mixer = None
            if is_arrays(c) and i < len(layers):
                mixer = next(
                    (getattr(layers[i], a) for a in RECURRENT_MIXERS if hasattr(layers[i], a)), None
                )
            if mixer is None:
                self.unsupported.append(f"layer {i} ({type(c).__name__})")
                continue
            projections = {
                name: mod
                for name, mod in mixer.children().items()
                if name.startswith("in_proj") and hasattr(mod, "weight")
            }
            if not projections:
                self.unsupported.append(f"layer {i} ({type(c).__name__}: no in_proj_* to record)")
                continue
            self.recurrent.append(_Recurrent(i, c, mixer, projections))
        # the caches the ring guard watches, found once (the list only changes through a new plan)
        self._guarded = [(i, c) for i, c in enumerate(caches) if i not in self.rings and is_rotating(c)]

    @property
    def capable(self) -> bool:
        return not self.unsupported

    @property
    def reason(self) -> str:
        return "caches that can neither trim nor replay: " + ", ".join(self.unsupported)

    def ring_guard(self, n: int) -> str | None:
        """Why a verify window of ``n + 1`` positions must not run now (§2 guard)."""
        for i, c in self._guarded:
            if int(c.offset) + n + 1 >= int(c.max_size):
                why = f" (exact rollback unsupported: {self.ring_fallback[i]})" if i in self.ring_fallback else ""
                return (
                    f"ring-wrap: layer {i} RotatingKVCache offset {int(c.offset)} + window {n + 1} "
                    f">= max_size {int(c.max_size)}{why}"
                )
        return None

    @contextmanager
    def round(self) -> Iterator[None]:
        """Arm the recurrent layers (``begin``) and the exact rings around the verify forward."""
        if not self.recurrent and not self.rings:
            yield
            return
        swapped: list[tuple[Any, type]] = []
        try:
            for ring in self.rings.values():
                ring.begin()
            for r in self.recurrent:
                c = r.cache
                r.snapshot = (list(c.cache), c.lengths, c.left_padding)
                r.recorded = {}
                swapped.append((r.mixer, type(r.mixer)))
                r.mixer.__class__ = recording_mixer(type(r.mixer), r)
                for name, mod in r.projections.items():
                    swapped.append((mod, type(mod)))
                    mod.__class__ = recording_projection(type(mod), r, name)
            yield
        finally:
            for ring in self.rings.values():
                ring.end()
            for obj, cls in reversed(swapped):
                obj.__class__ = cls

    def rollback(self, d: int, k: int) -> None:
        """Keep window positions ``0..k`` of a ``d``-draft round."""
        cache_ops.trim(self.trimmable, d - k, "target")
        for ring in self.rings.values():
            if k == d:
                ring.commit()
            elif ring.cache.is_trimmable():
                ring.commit()  # the round did not reach max_size: trim, as guard mode does
                cache_ops.trim([ring.cache], d - k, "target")
            else:
                ring.rollback(k + 1)
        for r in self.recurrent:
            if k < d:
                self._replay(r, keep=k + 1)
            r.snapshot = None
            r.recorded = {}

    def _replay(self, r: _Recurrent, keep: int) -> None:
        import mlx.core as mx

        assert r.snapshot is not None, "rollback without a spec round"
        c = r.cache
        c.cache, c.lengths, c.left_padding = list(r.snapshot[0]), r.snapshot[1], r.snapshot[2]
        served = {name: out[:, :keep] for name, out in r.recorded.items()}
        swapped = []
        try:
            for name, mod in r.projections.items():
                swapped.append((mod, type(mod)))
                mod.__class__ = serving_projection(type(mod), served[name])
            mask = r.mask[..., :keep] if r.mask is not None else None
            r.mixer(r.inputs[:, :keep], mask, c)
        finally:
            for obj, cls in reversed(swapped):
                obj.__class__ = cls
        mx.eval([a for a in c.cache if a is not None])


def recording_mixer(base: type, r: _Recurrent) -> type:
    def __call__(self: Any, inputs: Any, mask: Any = None, cache: Any = None) -> Any:
        r.inputs, r.mask = inputs, mask
        return base.__call__(self, inputs, mask, cache)

    return type(f"Recording{base.__name__}", (base,), {"__call__": __call__})


def recording_projection(base: type, r: _Recurrent, name: str) -> type:
    def __call__(self: Any, x: Any) -> Any:
        out = base.__call__(self, x)
        r.recorded[name] = out
        return out

    return type(f"Recording{base.__name__}", (base,), {"__call__": __call__})


def serving_projection(base: type, value: Any) -> type:
    def __call__(self: Any, x: Any) -> Any:
        return value

    return type(f"Serving{base.__name__}", (base,), {"__call__": __call__})
