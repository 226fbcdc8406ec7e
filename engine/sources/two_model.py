"""The ``two-model`` draft source: a second, smaller model drafts autoregressively.

Mirrors mlx-lm 0.32.2 ``mlx_lm/generate.py`` ``speculative_generate_step``:
``_prefill`` (drain to ``len - 1`` in ``prefill_step_size`` chunks),
``_draft_generate`` (one ``_step`` per draft token, ``logits[:, -1:, :]``
sampled with the REQUEST sampler) and ``_rewind_cache`` (draft cache trimmed by
``max(d - k - 1, 0)``). Roster row ``two-model`` of §3: a tokenizer/vocab
mismatch is refused at open time (upstream silently accepts ~0 %).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine import caches as cache_ops
from engine.sampler import StepSampler, token_ids
from engine.seam import PrefillMode, TapContext, TargetView

KIND = "two-model"


class VocabMismatchError(ValueError):
    """The drafter does not share the target's tokenizer/vocabulary."""


def _vocab(tokenizer: Any) -> dict[str, int] | None:
    if tokenizer is None:
        return None
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    get_vocab = getattr(inner, "get_vocab", None)
    return dict(get_vocab()) if callable(get_vocab) else None


def _out_dim(model: Any) -> int | None:
    args = getattr(model, "args", None)
    return getattr(args, "vocab_size", None)


def check_compatible(target: Any, draft: Any, target_tok: Any = None, draft_tok: Any = None) -> None:
    """Refuse a drafter whose vocabulary differs from the target's."""
    tv, dv = _out_dim(target), _out_dim(draft)
    if tv is not None and dv is not None and tv != dv:
        raise VocabMismatchError(
            f"two-model: drafter vocab_size {dv} != target vocab_size {tv}; "
            "the drafter must use the target's tokenizer"
        )
    a, b = _vocab(target_tok), _vocab(draft_tok)
    if a is not None and b is not None and a != b:
        only_t = sorted(set(a) - set(b))[:5]
        only_d = sorted(set(b) - set(a))[:5]
        diff = [t for t in set(a) & set(b) if a[t] != b[t]][:5]
        raise VocabMismatchError(
            "two-model: drafter tokenizer differs from the target's "
            f"(target-only tokens {only_t}, drafter-only {only_d}, different ids {diff})"
        )


class TwoModelSource:
    prefill_mode: PrefillMode = "tail-split"
    tap_layers: tuple[int, ...] = ()
    wants_anchor_hidden = False

    def __init__(self, model: Any, sampler: StepSampler, prefill_step_size: int) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.sampler = sampler
        self.caches = make_prompt_cache(model)
        cache_ops.require_trimmable(self.caches, "two-model drafter")
        self.step = prefill_step_size
        self.weights_bytes = 0

    def prefill(self, prompt_ids: list[int], ctx: TapContext | None) -> list[int]:
        for pos in range(0, len(prompt_ids), self.step):
            chunk = prompt_ids[pos : pos + self.step]
            self.model(mx.array(chunk, mx.uint32)[None], cache=self.caches)
            mx.eval([c.state for c in self.caches])
        return list(prompt_ids)

    def draft(self, feed: list[int], n: int, step_base: int, anchor_hidden: mx.array | None) -> list[int]:
        if n <= 0:
            return []
        y = mx.array(feed, mx.uint32)
        ys = []
        for _ in range(n):
            logits = self.model(y[None], cache=self.caches)[:, -1:, :]
            y = self.sampler.sample_window(logits.squeeze(0))
            mx.async_eval(y)
            ys.append(y)
        return token_ids(mx.concatenate(ys))

    def commit(
        self,
        d: int,
        k_accept: int,
        ctx: TapContext | None = None,
        verified_hidden: mx.array | None = None,
        accepted_tokens: list[int] | None = None,
    ) -> None:
        cache_ops.trim(self.caches, max(d - k_accept - 1, 0), "two-model drafter")

    def cache_digest(self) -> dict[str, Any] | None:
        return cache_ops.cache_digest(self.caches)


class TwoModelProvider:
    """Owns the drafter model; opens one ``TwoModelSource`` per request."""

    kind = KIND

    def __init__(
        self,
        draft_model: Any,
        *,
        draft_tokenizer: Any = None,
        prefill_step_size: int = 512,
    ) -> None:
        self.model = draft_model
        self.tokenizer = draft_tokenizer
        self.prefill_step_size = prefill_step_size

    def check_target(self, target_model: Any, target_tokenizer: Any = None) -> None:
        check_compatible(target_model, self.model, target_tokenizer, self.tokenizer)

    def open(self, sampler: StepSampler, target: TargetView) -> TwoModelSource:
        check_compatible(target.model, self.model)
        return TwoModelSource(self.model, sampler, self.prefill_step_size)
