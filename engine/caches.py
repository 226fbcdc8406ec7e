"""The cache rollback contract and cache digests.

Reference: ``../shared/reference/speculative-decoding.md`` §2 "Cache rollback
contract"; mlx-lm 0.32.2 ``mlx_lm/models/cache.py`` (``is_trimmable``,
``trim``, ``trim_prompt_cache``). mlx-lm's ``trim_prompt_cache`` silently trims
nothing when a cache is not trimmable; here every rollback is checked, so a
cache that cannot roll back is an error, never a silent no-op.
"""

from __future__ import annotations

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


def cache_digest(caches: list[Any]) -> dict[str, Any]:
    """sha256 per layer over the live region plus a combined digest (``traces.digest``)."""
    return _digest(caches)
