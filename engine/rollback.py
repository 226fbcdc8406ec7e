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
- Rotating caches: before each round, if ``offset + n + 1 >= max_size`` the
  verify window could wrap the ring, after which ``trim`` is no longer exact
  (mlx-lm ``is_trimmable`` turns False). The executor then stops speculating
  and finishes with plain decode (the §2 ring-wrap guard) instead of raising
  (upstream) or trimming nothing (what ``trim_prompt_cache`` silently does).
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


def is_rotating(c: Any) -> bool:
    return hasattr(c, "max_size") and hasattr(c, "_idx")


def is_kv(c: Any) -> bool:
    return hasattr(c, "keys") and hasattr(c, "offset") and hasattr(c, "trim")


def is_arrays(c: Any) -> bool:
    return hasattr(c, "cache") and isinstance(getattr(c, "cache", None), list)


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

    def __init__(self, model: Any, caches: list[Any]) -> None:
        self.model = model
        self.caches = caches
        self.trimmable: list[Any] = []
        self.recurrent: list[_Recurrent] = []
        self.unsupported: list[str] = []
        layers = getattr(model, "layers", [])
        for i, c in enumerate(caches):
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

    @property
    def capable(self) -> bool:
        return not self.unsupported

    @property
    def reason(self) -> str:
        return "caches that can neither trim nor replay: " + ", ".join(self.unsupported)

    def ring_guard(self, n: int) -> str | None:
        """Why a verify window of ``n + 1`` positions must not run now (§2 guard)."""
        for i, c in enumerate(self.caches):
            if is_rotating(c) and int(c.offset) + n + 1 >= int(c.max_size):
                return (
                    f"ring-wrap: layer {i} RotatingKVCache offset {int(c.offset)} + window {n + 1} "
                    f">= max_size {int(c.max_size)}"
                )
        return None

    @contextmanager
    def round(self) -> Iterator[None]:
        """Arm the recurrent layers around the verify forward (``begin``)."""
        if not self.recurrent:
            yield
            return
        swapped: list[tuple[Any, type]] = []
        try:
            for r in self.recurrent:
                c = r.cache
                r.snapshot = (list(c.cache), c.lengths, c.left_padding)
                r.recorded = {}
                swapped.append((r.mixer, type(r.mixer)))
                r.mixer.__class__ = _recording_mixer(type(r.mixer), r)
                for name, mod in r.projections.items():
                    swapped.append((mod, type(mod)))
                    mod.__class__ = _recording_projection(type(mod), r, name)
            yield
        finally:
            for obj, cls in reversed(swapped):
                obj.__class__ = cls

    def rollback(self, d: int, k: int) -> None:
        """Keep window positions ``0..k`` of a ``d``-draft round."""
        cache_ops.trim(self.trimmable, d - k, "target")
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
                mod.__class__ = _serving_projection(type(mod), served[name])
            mask = r.mask[..., :keep] if r.mask is not None else None
            r.mixer(r.inputs[:, :keep], mask, c)
        finally:
            for obj, cls in reversed(swapped):
                obj.__class__ = cls
        mx.eval([a for a in c.cache if a is not None])


def _recording_mixer(base: type, r: _Recurrent) -> type:
    def __call__(self: Any, inputs: Any, mask: Any = None, cache: Any = None) -> Any:
        r.inputs, r.mask = inputs, mask
        return base.__call__(self, inputs, mask, cache)

    return type(f"Recording{base.__name__}", (base,), {"__call__": __call__})


def _recording_projection(base: type, r: _Recurrent, name: str) -> type:
    def __call__(self: Any, x: Any) -> Any:
        out = base.__call__(self, x)
        r.recorded[name] = out
        return out

    return type(f"Recording{base.__name__}", (base,), {"__call__": __call__})


def _serving_projection(base: type, value: Any) -> type:
    def __call__(self: Any, x: Any) -> Any:
        return value

    return type(f"Serving{base.__name__}", (base,), {"__call__": __call__})
