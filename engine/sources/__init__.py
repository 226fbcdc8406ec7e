"""Draft-source registry: one module per source kind, found by listing this package (§3 roster).

Each ``engine/sources/<kind>.py`` exports ``SOURCE``, its :class:`engine.sources.kind.SourceKind`
descriptor; nothing here lists kinds by hand. ``make_provider(kind, **kwargs)`` builds a
provider from in-memory pieces; ``open_drafter(kind, draft_dir, ...)`` builds one from a
local drafter directory. ``engine.sources.detect`` tells a drafter directory's kind (§3
detection order, derived from the descriptors). ``KINDS`` (the roster) and
``PINNED_GAMMA`` (block drafters) are derived on every read, so a kind registered
in-process (``engine.sources.kind.registered``) appears in them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.seam import DraftProvider
from engine.sources.kind import (
    OpenOptions,
    SourceKind,
    all_kinds,
    find,
    get,
    names,
    prefill_for,
    roster_help,
)

__all__ = ["KINDS", "PINNED_GAMMA", "OpenOptions", "SourceKind", "all_kinds", "find", "get",
           "make_provider", "names", "open_drafter", "prefill_for", "roster_help"]


def __getattr__(name: str) -> Any:  # PEP 562: derived tables, never typed again
    if name == "KINDS":
        return names()
    if name == "PINNED_GAMMA":  # block drafters pin γ to their checkpoint's block (§3 "default γ")
        return tuple(k.name for k in all_kinds() if k.pinned_gamma is not None)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_provider(kind: str, **kwargs: Any) -> DraftProvider:
    """Build the provider of ``kind``; unknown kinds are refused with the roster."""
    provider: DraftProvider = get(kind).provider(**kwargs)
    return provider


def open_drafter(
    kind: str,
    draft_dir: str | Path | None,
    *,
    gamma: int,
    confidence_threshold: float | None = None,
    ngram_max: int = 3,
    ngram_min: int = 1,
    conventions: str | None = None,
) -> tuple[DraftProvider, int]:
    """A provider for a local drafter directory, and the γ to run it with.

    How the kind opens is its descriptor's ``open`` (two-model loads the drafter with
    mlx-lm; the head and block sources load their own artifact formats; a model-free
    kind takes no directory). Block drafters return their pinned γ (the checkpoint's
    block), the others ``gamma``.
    """
    desc = get(kind)
    if desc.takes_dir and draft_dir is None:
        raise ValueError(f"the {kind} source needs a drafter directory")
    opts = desc.open_options(OpenOptions(gamma=gamma, confidence_threshold=confidence_threshold,
                                         conventions=conventions, ngram_max=ngram_max, ngram_min=ngram_min))
    provider = desc.open(Path(draft_dir) if draft_dir is not None else None, opts)
    return provider, (int(getattr(provider, "gamma", gamma)) if desc.pinned_gamma is not None else gamma)

