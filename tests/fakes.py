"""Model-free draft sources shared by the engine tests (the §1 seam, driven by a policy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from engine.seam import TapContext, TargetView

# policy(source, feed, n, step_base) -> proposed drafts (may be longer than n on purpose)
Policy = Callable[["FakeSource", list[int], int, int], list[int]]


class FakeSource:
    """A model-free ``DraftSource``: drafts come from ``policy``; every call is logged."""

    prefill_mode = "tail-split"
    weights_bytes = 0

    def __init__(
        self,
        policy: Policy,
        *,
        tap_layers: tuple[int, ...] = (),
        wants_anchor_hidden: bool = False,
    ) -> None:
        self.policy = policy
        self.tap_layers = tap_layers
        self.wants_anchor_hidden = wants_anchor_hidden
        self.prefills: list[tuple[list[int], TapContext | None]] = []
        self.drafts: list[dict[str, Any]] = []
        self.commits: list[dict[str, Any]] = []
        self.round = 0

    def prefill(self, prompt_ids: list[int], ctx: TapContext | None) -> list[int]:
        self.prefills.append((list(prompt_ids), ctx))
        return list(prompt_ids)

    def draft(self, feed: list[int], n: int, step_base: int, anchor_hidden: mx.array | None) -> list[int]:
        out = list(self.policy(self, list(feed), n, step_base))
        self.drafts.append(
            {"feed": list(feed), "n": n, "step_base": step_base, "anchor": anchor_hidden, "out": out}
        )
        return out

    def commit(
        self,
        d: int,
        k_accept: int,
        ctx: TapContext | None = None,
        verified_hidden: mx.array | None = None,
        accepted_tokens: list[int] | None = None,
    ) -> None:
        self.commits.append(
            {"d": d, "k": k_accept, "ctx": ctx, "verified": verified_hidden, "accepted": accepted_tokens}
        )
        self.round += 1

    def cache_digest(self) -> dict[str, Any] | None:
        return None


class FakeProvider:
    kind = "fake"

    def __init__(self, source: FakeSource) -> None:
        self.source = source
        self.opened = 0

    def open(self, sampler: Any, target: TargetView) -> FakeSource:
        self.opened += 1
        return self.source


def scripted(script: Callable[[int, int, int], list[int]]) -> FakeSource:
    """A source whose drafts are ``script(round, n, step_base)``."""
    return FakeSource(lambda src, feed, n, step_base: script(src.round, n, step_base))
