"""The cache rollback contract and cache digests.

Reference: ``../shared/reference/speculative-decoding.md`` §2 "Cache rollback
contract"; mlx-lm 0.32.2 ``mlx_lm/models/cache.py`` (``is_trimmable``,
``trim``, ``trim_prompt_cache``). mlx-lm's ``trim_prompt_cache`` silently trims
nothing when a cache is not trimmable; here every rollback is checked, so a
cache that cannot roll back is an error, never a silent no-op.

Quantized KV (mlx-lm 0.32.2 ``generate.py`` ``maybe_quantize_kv_cache``,
``models/cache.py`` ``KVCache.to_quantized`` / ``QuantizedKVCache``): a cache
with ``to_quantized`` is replaced, in its list, by its quantized copy once its
``offset`` reaches ``quantized_kv_start``. ``mx.quantize`` quantizes each
position's head vector on its own (groups along the last axis), so a
``QuantizedKVCache`` rolls back with ``trim`` exactly like ``KVCache``: the
kept positions' bytes do not depend on what was written after them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from traces.digest import cache_digest as _digest


class CacheRollbackError(RuntimeError):
    """A cache cannot be rolled back the way the verify round needs."""


def trim(caches: list[Any], n: int, who: str = "cache") -> None:
    """Trim ``n`` positions from every cache, or raise ``CacheRollbackError``."""
    if n <= 0:
        return
    for i, c in enumerate(caches):
        if not c.is_trimmable():
            raise CacheRollbackError(
                f"{who}: layer {i} ({type(c).__name__}) cannot trim {n} positions"
            )
        got = c.trim(n)
        if got != n:
            raise CacheRollbackError(
                f"{who}: layer {i} ({type(c).__name__}) trimmed {got} of {n} positions"
            )


# mlx 0.32 affine quantization: supported bits and group sizes (``mx.quantize``).
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class KVQuantization:
    """mlx-lm's ``kv_bits`` / ``kv_group_size`` / ``quantized_kv_start``."""

    bits: int
    group_size: int = 64
    start: int = 5000  # mlx-lm DEFAULT_QUANTIZED_KV_START

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {KV_BITS}, got {self.bits}")
        if self.group_size not in KV_GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {self.group_size}")
        if self.start < 0:
            raise ValueError(f"quantized_kv_start must be >= 0, got {self.start}")


def quantize_kv(caches: list[Any], q: KVQuantization | None, who: str = "target") -> bool:
    """mlx-lm ``maybe_quantize_kv_cache``: convert, in place in ``caches``, every cache
    with ``to_quantized`` whose offset reached ``q.start``; True when any was converted.

    mlx-lm's own errors become one-line ``ValueError``s naming the layer (its
    ``RotatingKVCache.to_quantized`` raises ``NotImplementedError``; ``mx.quantize``
    refuses a head dim the group size does not divide).
    """
    if q is None:
        return False
    done = False
    for i, c in enumerate(caches):
        if hasattr(c, "to_quantized") and int(c.offset) >= q.start:
            try:
                caches[i] = c.to_quantized(group_size=q.group_size, bits=q.bits)
            except (NotImplementedError, ValueError) as exc:
                how = "" if isinstance(exc, NotImplementedError) else f" with group size {q.group_size}"
                raise ValueError(
                    f"kv_bits {q.bits}: {who} layer {i} ({type(c).__name__}) cannot be quantized"
                    f"{how}: {str(exc).splitlines()[0]}"
                ) from None
            done = True
    return done


def quantizable(caches: list[Any]) -> bool:
    """Whether some cache would still be converted by :func:`quantize_kv`."""
    return any(hasattr(c, "to_quantized") for c in caches)


def cache_digest(caches: list[Any]) -> dict[str, Any]:
    """sha256 per layer over the live region plus a combined digest (``traces.digest``)."""
    return _digest(caches)
