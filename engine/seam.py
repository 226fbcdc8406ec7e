"""The draft-source seam: ``DraftProvider`` / ``DraftSource`` / ``TargetView``.

Mirrors ``../shared/reference/speculative-decoding.md`` §1 (mlx-bun
``src/spec/source.ts``). Every drafter kind implements these two protocols and
differs only in what fills the draft; the executor (``engine.executor``) is the
only code that drives the target.

- ``DraftProvider.open(sampler, target)`` is called once per request and returns
  a ``DraftSource`` that owns the per-request draft state.
- ``DraftSource.draft(feed, n, step_base, anchor_hidden)`` may return fewer
  than ``n`` tokens, including zero; the returned length is authoritative.
- ``DraftSource.commit(d, k_accept, ...)`` is called after every verify round
  (and after a zero-length round) so the source can roll back its own state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import mlx.core as mx

    from engine.sampler import StepSampler

PrefillMode = Literal["tail-split", "full"]
PREFILL_MODES: tuple[PrefillMode, ...] = ("tail-split", "full")


@dataclass
class TargetView:
    """Read-only view of the target model and its LIVE caches.

    The arrays in ``caches`` are the ones the executor drives; sources that
    borrow donor K/V, embeddings or the lm-head read them through this view and
    must never mutate them.
    """

    model: Any
    caches: list[Any]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def offset(self) -> int:
        """Number of positions the target caches hold."""
        return int(self.caches[0].offset) if self.caches else 0


@dataclass
class TapContext:
    """Hidden states captured from the target's tap layers for one forward.

    ``hidden[layer]`` has shape ``[T, H]`` (batch squeezed), one row per
    position fed in that forward, in order.
    """

    tokens: list[int]
    hidden: dict[int, mx.array]


@runtime_checkable
class DraftSource(Protocol):
    """Per-request draft state (§1)."""

    prefill_mode: PrefillMode
    tap_layers: tuple[int, ...]
    wants_anchor_hidden: bool
    weights_bytes: int

    def prefill(self, prompt_ids: list[int], ctx: TapContext | None) -> list[int]:
        """Seed the draft state; return the token ids the drafter consumed."""
        ...

    def draft(
        self,
        feed: list[int],
        n: int,
        step_base: int,
        anchor_hidden: mx.array | None,
    ) -> list[int]:
        """Propose ``0..n`` tokens continuing ``feed``."""
        ...

    def commit(
        self,
        d: int,
        k_accept: int,
        ctx: TapContext | None = None,
        verified_hidden: mx.array | None = None,
        accepted_tokens: list[int] | None = None,
    ) -> None:
        """Roll the draft state back to the accepted prefix of the round."""
        ...

    def cache_digest(self) -> dict[str, Any] | None:
        """Digest of the source's own caches (None when it has none)."""
        ...


@runtime_checkable
class DraftProvider(Protocol):
    """Server-lifetime owner of the draft weights (§1)."""

    kind: str

    def open(self, sampler: StepSampler, target: TargetView) -> DraftSource:
        """Open a per-request ``DraftSource`` bound to the target's live state."""
        ...
