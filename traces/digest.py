"""Cache digests: sha256 of each layer's live state, plus a combined digest.

The rule (``traces/INTERPRETING.md``): for a KV-style cache (mlx-lm 0.32.2
``models/cache.py`` ``KVCache``: ``keys``/``values`` buffers and an ``offset``)
only the region up to the offset is hashed — buffers past the offset are
garbage. Other caches hash every array of their ``state``. Each layer digest
also covers the cache class name and offset; bfloat16 arrays are widened to
float32 first (numpy has no bfloat16), which is exact. Shared by the engine
and the oracle runners so both sides hash the same bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any


def live_arrays(cache: Any) -> list[Any]:
    """The arrays that hold ``cache``'s live state, sliced to its offset."""
    import mlx.core as mx

    if hasattr(cache, "keys") and hasattr(cache, "offset") and not callable(cache.keys):
        if cache.keys is None:
            return []
        n = min(int(cache.offset), cache.keys.shape[-2])
        return [cache.keys[..., :n, :], cache.values[..., :n, :]]
    state = cache.state
    items = state if isinstance(state, (list, tuple)) else [state]
    return [a for a in items if isinstance(a, mx.array)]


def layer_digest(cache: Any) -> str:
    import mlx.core as mx
    import numpy as np

    h = hashlib.sha256()
    h.update(f"{type(cache).__name__}:{getattr(cache, 'offset', '')}".encode())
    for a in live_arrays(cache):
        arr = np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)
        h.update(str(arr.shape).encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def cache_digest(caches: list[Any]) -> dict[str, Any]:
    """``{"combined": sha256, "layers": [sha256, ...]}`` for a list of layer caches."""
    layers = [layer_digest(c) for c in caches]
    combined = hashlib.sha256("".join(layers).encode()).hexdigest()
    return {"combined": combined, "layers": layers}
