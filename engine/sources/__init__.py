"""Draft-source registry: one module per source kind, found by name (§3 roster).

``make_provider(kind, **kwargs)`` builds a provider from in-memory pieces;
``open_drafter(kind, draft_dir, ...)`` builds one from a local drafter
directory (what the CLI and the runners use). ``engine.sources.detect``
tells a drafter directory's kind (§3 detection order).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from engine.seam import DraftProvider

# kind -> (module, provider class)
_PROVIDERS: dict[str, tuple[str, str]] = {
    "two-model": ("engine.sources.two_model", "TwoModelProvider"),
    "ngram": ("engine.sources.ngram", "NgramProvider"),
    "mtp": ("engine.sources.mtp", "MTPProvider"),
    "native-mtp": ("engine.sources.native_mtp", "NativeMTPProvider"),
    "assistant": ("engine.sources.assistant", "AssistantProvider"),
    "deepspec": ("engine.sources.deepspec", "DeepSpecProvider"),
    "dspark": ("engine.sources.dspark", "DSparkProvider"),
}
KINDS = tuple(_PROVIDERS)
# Block drafters pin γ to their checkpoint's block size (§3 "default γ" column).
PINNED_GAMMA = ("deepspec", "dspark")


def make_provider(kind: str, **kwargs: Any) -> DraftProvider:
    """Build the provider of ``kind``; unknown kinds are refused with the roster."""
    if kind not in _PROVIDERS:
        raise ValueError(f"unknown draft source {kind!r}; known: {', '.join(KINDS)}")
    module, cls = _PROVIDERS[kind]
    provider: DraftProvider = getattr(importlib.import_module(module), cls)(**kwargs)
    return provider


def open_drafter(
    kind: str,
    draft_dir: str | Path | None,
    *,
    gamma: int,
    confidence_threshold: float | None = None,
    ngram_max: int = 3,
    ngram_min: int = 1,
) -> tuple[DraftProvider, int]:
    """A provider for a local drafter directory, and the γ to run it with.

    Two-model loads the drafter with mlx-lm; the head and block sources load
    their own artifact formats; ``ngram`` takes no directory. Block drafters
    return their pinned γ (the checkpoint's block), the others ``gamma``.
    """
    if kind == "ngram":
        return make_provider(kind, gamma=gamma, ngram_max=ngram_max, ngram_min=ngram_min), gamma
    if draft_dir is None:
        raise ValueError(f"the {kind} source needs a drafter directory")
    if kind == "two-model":
        from engine.models import load

        d = load(draft_dir)
        return make_provider(kind, draft_model=d.model, draft_tokenizer=d.tokenizer), gamma
    if kind in ("mtp", "assistant", "native-mtp"):
        return make_provider(kind, path=draft_dir), gamma
    kw = {} if confidence_threshold is None else {"confidence_threshold": confidence_threshold}
    provider = make_provider(kind, model=draft_dir, **kw)
    return provider, int(getattr(provider, "gamma", gamma)) if kind in PINNED_GAMMA else gamma
