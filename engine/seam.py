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
- ``DraftSourceBase`` is the class every source in ``engine/sources`` inherits: the
  protocol's data members with their usual values and every OPTIONAL hook the executor
  looks up, each with its default and what that default means (``None``: the source
  has no such hook, which is what the executor's ``getattr(source, hook, None)``
  reads; a no-op: the hook is there and changes nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import mlx.core as mx

    from engine.caches import KVQuantization
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


class DraftSourceBase:
    """What every draft source starts from: the :class:`DraftSource` protocol's data members
    with their common values, and every optional hook the executor looks up, with its default.

    A source overrides a hook by defining it (a method, or an instance attribute). The
    defaults are chosen so that a source inheriting them behaves exactly as a source that
    does not have the attribute at all (``engine.executor`` reads each hook with
    ``getattr(source, name, None)``):

    - ``draft_array`` None: no lazy device-array drafts; the executor calls ``draft`` and
      reads the list (a source defining it also marks its ``draft`` ``via_draft_array``).
    - ``last_confidence`` None: the source reports no per-position draft confidence (the
      round record's ``confidence`` is null); a block drafter sets it on every ``draft``.
    - ``set_kv_quantization`` None: the source cannot speculate over a quantized target
      KV cache (it reads the target's caches or hidden states): with ``kv_bits`` the request
      falls back to plain decode, reason ``quantized-kv`` (§6). A source that can sets a
      method, even a no-op one (ngram: model-free, nothing to convert).
    - ``set_rotating(mode)``: a no-op: the source has no rotating caches of its own to roll
      back exactly (``rotating="exact"`` changes nothing for it).
    - ``rollback_guard(feed, n)``: None: the source can always roll back a round of ``n``
      drafts (no reason to stop speculating).
    """

    prefill_mode: PrefillMode  # its kind's §2.1 convention (engine.sources.kind.SourceKind.prefill)
    tap_layers: tuple[int, ...] = ()
    wants_anchor_hidden: bool = False
    weights_bytes: int = 0

    draft_array: ClassVar[Callable[..., mx.array] | None] = None  # (self, feed, n, step_base, anchor_hidden)
    last_confidence: list[float] | None = None
    set_kv_quantization: ClassVar[Callable[[Any, KVQuantization], None] | None] = None

    def set_rotating(self, mode: str) -> None:
        """Request option ``rotating`` (the source's own rotating caches): default no-op."""

    def rollback_guard(self, feed: list[int], n: int) -> str | None:
        """Why the source could not roll back a round of ``n`` drafts now: default never (None)."""
        return None


OPTIONAL_HOOKS: tuple[str, ...] = ("draft_array", "last_confidence", "set_kv_quantization", "set_rotating",
                                   "rollback_guard")
"""The optional :class:`DraftSource` hooks ``engine.executor`` looks up (``DraftSourceBase``)."""


@runtime_checkable
class DraftProvider(Protocol):
    """Server-lifetime owner of the draft weights (§1)."""

    kind: str

    def open(self, sampler: StepSampler, target: TargetView) -> DraftSource:
        """Open a per-request ``DraftSource`` bound to the target's live state."""
        ...
