"""A test double for a backend whose batched forward is not bit-exact to one-token decode.

Reference: ``../shared/reference/speculative-decoding.md`` §2.1 ("Batched
verify vs stock decode") and the measurement in issue 13: on MLX 0.32.4's
CUDA backend (NVIDIA H200) the fp32 zoo's verify-window logit rows differ from
serial decode by up to ~1e-2. On the CPU the two paths are byte-identical, so
the numerics witness (``engine/witness.py``) would never see a real flip here.

:func:`emulate_nonexact` makes a loaded mlx-lm model behave like such a
backend: every forward over more than one token (a verify window, a prefill
chunk, a two-token drafter re-feed) gets uniform noise in ``[-scale, scale]``
added to each logit; one-token forwards are untouched (plain decode's path).
The noise is a pure function of the call's inputs -- ``(seed, cache offset
before the call, input token ids)`` -- the way a deterministic GPU kernel's
rounding depends only on its inputs and shapes, so re-running the same window
on the same prefix (what the witness does) reproduces it exactly. Caches are
not perturbed. The class of the model instance is swapped (as
``engine/rollback.py`` does for recorded projections), so the object, its
``layers``, ``make_cache`` and every holder of a reference keep working.

``SPECPARITY_EMULATE_NONEXACT=SCALE[:SEED]`` asks ``specparity``'s model
loader to wrap every model it loads (:func:`from_env`).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import mlx.core as mx

ENV = "SPECPARITY_EMULATE_NONEXACT"

__all__ = ["ENV", "emulate_nonexact", "exact", "from_env", "is_emulated"]


def _offset(cache: Any) -> int:
    for c in cache or ():
        off = getattr(c, "offset", None)
        if isinstance(off, int):
            return off
    return -1


def _key(seed: int, offset: int, inputs: mx.array) -> int:
    h = hashlib.sha256(f"{seed}:{offset}:{inputs.tolist()}".encode())
    return int.from_bytes(h.digest()[:4], "little")


def emulate_nonexact(model: Any, scale: float, seed: int = 0) -> Any:
    """Perturb ``model``'s multi-token forwards in place (module docstring); returns ``model``."""
    if scale < 0:
        raise ValueError(f"scale must be >= 0, got {scale}")
    base = type(model)
    if getattr(base, "_nonexact", None) is not None:
        base = base.__mro__[1]

    def __call__(self: Any, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", args[0] if args else None)
        offset = _offset(cache)
        out = base.__call__(self, inputs, *args, **kwargs)
        if inputs.ndim < 2 or inputs.shape[-1] <= 1 or scale == 0:
            return out
        noise = mx.random.uniform(-scale, scale, out.shape, key=mx.random.key(_key(seed, offset, inputs)))
        return out + noise.astype(out.dtype)

    model.__class__ = type(f"NonExact{base.__name__}", (base,),
                           {"__call__": __call__, "_nonexact": (scale, seed)})
    return model


def is_emulated(model: Any) -> tuple[float, int] | None:
    """``(scale, seed)`` when ``model`` is wrapped by :func:`emulate_nonexact`."""
    return getattr(type(model), "_nonexact", None)


def exact(model: Any) -> Any:
    """Undo :func:`emulate_nonexact` on ``model`` (no-op on an unwrapped model)."""
    if is_emulated(model) is not None:
        model.__class__ = type(model).__mro__[1]
    return model


def from_env(model: Any) -> Any:
    """Wrap ``model`` when ``SPECPARITY_EMULATE_NONEXACT=SCALE[:SEED]`` is set."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return model
    scale_s, _, seed_s = value.partition(":")
    try:
        scale, seed = float(scale_s), int(seed_s or 0)
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: expected SCALE[:SEED], e.g. 0.01 or 0.01:7") from None
    return emulate_nonexact(model, scale, seed)
