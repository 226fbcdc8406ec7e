"""Draft-source registry: one module per source kind, found by name (§3 roster)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.seam import DraftProvider

KINDS = ("two-model", "ngram", "mtp", "assistant", "deepspec", "dspark")


def make_provider(kind: str, **kwargs: Any) -> DraftProvider:
    """Build the provider of ``kind``; unknown kinds are refused with the roster."""
    factories: dict[str, Callable[..., DraftProvider]] = {}
    if kind == "two-model":
        from engine.sources.two_model import TwoModelProvider

        factories[kind] = TwoModelProvider
    if kind == "ngram":
        from engine.sources.ngram import NgramProvider

        factories[kind] = NgramProvider
    if kind == "mtp":
        from engine.sources.mtp import MTPProvider

        factories[kind] = MTPProvider
    if kind == "assistant":
        from engine.sources.assistant import AssistantProvider

        factories[kind] = AssistantProvider
    if kind == "deepspec":
        from engine.sources.deepspec import DeepSpecProvider

        factories[kind] = DeepSpecProvider
    if kind == "dspark":
        from engine.sources.dspark import DSparkProvider

        factories[kind] = DSparkProvider
    if kind not in factories:
        raise ValueError(f"unknown draft source {kind!r}; known: {', '.join(KINDS)}")
    return factories[kind](**kwargs)
