"""The executor's cross-cutting collaborators, as named protocols with null objects.

``engine.executor.spec_generate`` / ``plain_generate`` take two optional
collaborators that are not part of the draft-source seam (§1): prompt-cache
reuse (``engine.prompt_cache``) and a round observer (the serial-replay audit,
``engine.audit.SerialReplayAudit``). Each is a :class:`typing.Protocol` here,
and the executor always holds one: the caller's, or the null object
(:data:`NO_REUSE`, :data:`NO_OBSERVER`) that changes nothing. So the loop reads
straight through (mlx-lm 0.32.2 ``speculative_generate_step`` has neither; a
run with the null objects is exactly that loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import mlx.core as mx

    from engine.seam import DraftSource, TapContext


class Reuse(Protocol):
    """Prompt-cache reuse (``engine.prompt_cache.Fetch``).

    ``target_prefix``: drained tokens the target caches already hold (only the rest is
    prefilled); ``open_source(source)`` installs the drafter's saved state and returns
    how many drained tokens it holds; ``tap_context(ctx, drained)`` prepends the reused
    prefix's saved tap rows; ``after_prefill(caches, source, ctx)`` sees the prefill
    boundary (``source`` None in plain decode); ``after_round(ctx, k)`` every round;
    ``record()`` is the prefill record's ``prompt_cache`` block (None: no block).
    """

    target_prefix: int

    def open_source(self, source: DraftSource) -> int: ...

    def tap_context(self, ctx: TapContext, drained: list[int]) -> TapContext: ...

    def after_prefill(self, caches: list[Any], source: DraftSource | None, ctx: TapContext | None = None) -> None: ...

    def after_round(self, ctx: TapContext | None, k: int) -> None: ...

    def record(self) -> dict[str, Any] | None: ...


class RoundObserver(Protocol):
    """Told about every verify forward; must not mutate ``caches``."""

    def before_verify(self, index: int, window: list[int], caches: list[Any]) -> None: ...

    def after_verify(self, index: int, window: list[int], block: mx.array, caches: list[Any]) -> None: ...

    def after_rollback(self, index: int, k_accept: int, caches: list[Any]) -> None: ...


class NoReuse:
    """The null :class:`Reuse`: nothing held, nothing saved, no record block."""

    target_prefix = 0

    def open_source(self, source: DraftSource) -> int:
        return 0

    def tap_context(self, ctx: TapContext, drained: list[int]) -> TapContext:
        return ctx

    def after_prefill(self, caches: list[Any], source: DraftSource | None, ctx: TapContext | None = None) -> None:
        return None

    def after_round(self, ctx: TapContext | None, k: int) -> None:
        return None

    def record(self) -> dict[str, Any] | None:
        return None


class NoObserver:
    """The null :class:`RoundObserver`."""

    observing = False

    def before_verify(self, index: int, window: list[int], caches: list[Any]) -> None:
        return None

    def after_verify(self, index: int, window: list[int], block: mx.array, caches: list[Any]) -> None:
        return None

    def after_rollback(self, index: int, k_accept: int, caches: list[Any]) -> None:
        return None


NO_REUSE = NoReuse()
NO_OBSERVER = NoObserver()


def observing(observer: RoundObserver) -> bool:
    """Whether ``observer`` watches the rounds (it reads the window before the verify, so the
    drafts must be host values then)."""
    return getattr(observer, "observing", True)
