"""The ``two-model`` draft source: a second, smaller model drafts autoregressively.

Mirrors mlx-lm 0.32.2 ``mlx_lm/generate.py`` ``speculative_generate_step``:
``_prefill`` (drain to ``len - 1`` in ``prefill_step_size`` chunks),
``_draft_generate`` (one ``_step`` per draft token, ``logits[:, -1:, :]``
sampled with the REQUEST sampler) and ``_rewind_cache`` (draft cache trimmed by
``max(d - k - 1, 0)``). Roster row ``two-model`` of §3: a drafter whose ids
could mean other tokens than the target's is refused at open time (upstream
silently accepts ~0 %); a padded vocabulary with the target's tokenizer is
accepted as upstream runs it (:func:`check_compatible`).

Drafters whose caches mlx-lm cannot trim (§2 "Cache rollback contract"):

- recurrent layers (``ArraysCache``, e.g. a qwen3_5 drafter): the source
  snapshots every drafter cache before drafting and, when a draft is rejected,
  restores the snapshot and re-runs the SAME calls for the kept prefix (the
  feed call, then one call per kept draft), which reproduces the kept state
  byte for byte; upstream refuses such drafters;
- rotating caches (a sliding-window drafter): by default ``rollback_guard``
  reports when the round could wrap the drafter's ring, and the executor stops
  speculating (the §2 ring-wrap guard). With the request option
  ``rotating="exact"`` (``set_rotating``) each rotating drafter cache gets an
  ``engine.rollback.RingRound`` around the drafting calls: the drafter writes
  the feed (``_update_concat`` for two tokens, ``_update_in_place`` for one)
  then one in-place slot per further draft, so the round keeps the slots those
  writes overwrite; on a rejection past the wrap it restores them and
  re-applies the kept positions' recorded K/V in the same calls (the feed,
  then one per kept draft), byte for byte the drafter fed only the kept
  tokens. While the cache is still trimmable it is trimmed as before. A
  rotating cache RingRound cannot handle keeps the guard, reason recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from engine import caches as cache_ops
from engine.rollback import RingRound, is_arrays, is_kv, is_rotating, ring_unsupported
from engine.sampler import StepSampler, token_ids
from engine.seam import DraftSourceBase, PrefillMode, TapContext, TargetView
from engine.sources.kind import OpenOptions, SourceKind

KIND = "two-model"
PREFILL: PrefillMode = "tail-split"  # §2.1; the source and its descriptor share it


class VocabMismatchError(ValueError):
    """The drafter's ids could mean other tokens than the target's."""


def _vocab(tokenizer: Any) -> dict[str, int] | None:
    if tokenizer is None:
        return None
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    get_vocab = getattr(inner, "get_vocab", None)
    return dict(get_vocab()) if callable(get_vocab) else None


def _out_dim(model: Any) -> int | None:
    args = getattr(model, "args", None)
    return getattr(args, "vocab_size", None)


def _by_id(vocab: dict[str, int]) -> dict[int, str]:
    return {int(i): t for t, i in vocab.items()}


def check_compatible(target: Any, draft: Any, target_tok: Any = None, draft_tok: Any = None) -> None:
    """Refuse a drafter whose ids could mean other tokens than the target's.

    Each model can emit (and is fed) any id below its ``vocab_size`` (its
    embedding rows). A padded vocabulary — embedding rows past the tokenizer,
    as real Qwen pairs have (0.5B: 151936 rows, 7B: 152064, one tokenizer) —
    is accepted when the two tokenizers map every id below the smaller
    ``vocab_size`` to the same token, and no id the larger model alone has is a
    token of either tokenizer (it is padding: no token, never trained). mlx-lm
    0.32.2 ``speculative_generate_step`` runs such pairs (it checks nothing).
    Without both tokenizers only equal ``vocab_size`` can be accepted.
    """
    tv, dv = _out_dim(target), _out_dim(draft)
    a, b = _vocab(target_tok), _vocab(draft_tok)
    if a is None or b is None:
        if tv is not None and dv is not None and tv != dv:
            raise VocabMismatchError(
                f"two-model: drafter vocab_size {dv} != target vocab_size {tv} and no tokenizers "
                "to compare; a padded vocabulary is accepted only when both tokenizers are given "
                "and map every shared id to the same token"
            )
        return
    ta, tb = _by_id(a), _by_id(b)
    shared = min(tv, dv) if tv is not None and dv is not None else max([*ta, *tb], default=-1) + 1
    for i in sorted(set(ta) | set(tb)):
        if i < shared and ta.get(i) != tb.get(i):
            def say(t: str | None) -> str:
                return "no token" if t is None else repr(t)

            raise VocabMismatchError(
                f"two-model: id {i} is {say(ta.get(i))} for the target but {say(tb.get(i))} for "
                "the drafter; the drafter must use the target's tokenizer"
            )
    for who, ids, own, other, n in (("target", ta, tv, "drafter", dv), ("drafter", tb, dv, "target", tv)):
        # a token this model can emit (below its own rows) that the other cannot embed; ids past
        # both models' rows (a tokenizer larger than the models) neither model emits
        beyond = sorted(i for i in ids if n is not None and n <= i and (own is None or i < own))
        if beyond:
            i = beyond[0]
            raise VocabMismatchError(
                f"two-model: id {i} is {ids[i]!r} for the {who} but outside the {other}'s "
                f"vocabulary [0, {n}); the drafter must cover every token of the target's tokenizer"
            )


class TwoModelSource(DraftSourceBase):
    prefill_mode: PrefillMode = PREFILL
    tap_layers: tuple[int, ...] = ()
    wants_anchor_hidden = False

    def __init__(self, model: Any, sampler: StepSampler, prefill_step_size: int,
                 target_vocab: int | None = None) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        # Padded vocabularies (check_compatible): an id one model's embedding lacks is
        # padding, never a token; fed to that model it indexes past the table (a segfault
        # on MLX), so it stops the run with its reason instead.
        self.vocab = _out_dim(model)
        dv = self.vocab
        self.target_vocab = target_vocab if dv is not None and target_vocab is not None and dv > target_vocab else None
        self.sampler = sampler
        self.caches = make_prompt_cache(model)
        self.kv = [is_kv(c) for c in self.caches]
        self._rotating = [i for i, c in enumerate(self.caches) if is_rotating(c)]  # the ring guard's, found once
        self.replay = not all(self.kv)
        self.unsupported = [
            f"layer {i} ({type(c).__name__})"
            for i, c in enumerate(self.caches)
            if not self.kv[i] and not is_arrays(c)
        ]
        self.step = prefill_step_size
        self.weights_bytes = 0
        self._snapshot: list[Any] | None = None
        self._feed: list[int] = []
        self._first_feed = False
        self.rings: dict[int, RingRound] = {}  # rotating="exact": layer -> its ring round
        self.ring_fallback: dict[int, str] = {}
        self.kv_quantization: cache_ops.KVQuantization | None = None

    def set_kv_quantization(self, q: cache_ops.KVQuantization) -> None:
        """Quantized KV: the drafter's caches convert as mlx-lm's ``speculative_generate_step``
        converts its draft cache (``maybe_quantize_kv_cache`` after every drafter forward, on
        the offset before the round's trim). Drafts only: the output does not depend on it."""
        self.kv_quantization = q

    def _quantize(self) -> None:
        cache_ops.quantize_kv(self.caches, self.kv_quantization, "two-model drafter")

    def set_rotating(self, mode: str) -> None:
        """Request option ``rotating``: ``"exact"`` arms a RingRound per rotating cache."""
        self.rings, self.ring_fallback = {}, {}
        if mode != "exact":
            return
        for i, c in enumerate(self.caches):
            if is_rotating(c):
                why = ring_unsupported(c)
                if why is None:
                    self.rings[i] = RingRound(c)
                else:
                    self.ring_fallback[i] = why

    def rollback_guard(self, feed: list[int], n: int) -> str | None:
        """Why the drafter could not roll back a round of ``n`` drafts now."""
        if self.unsupported:
            return "no-rollback: two-model drafter caches that can neither trim nor replay: " + ", ".join(
                self.unsupported
            )
        for i in self._rotating:
            c = self.caches[i]
            if i in self.rings:
                continue
            if int(c.offset) + len(feed) + n - 1 >= int(c.max_size):
                why = f" (exact rollback unsupported: {self.ring_fallback[i]})" if i in self.ring_fallback else ""
                return (
                    f"ring-wrap: two-model drafter layer {i} RotatingKVCache offset {int(c.offset)} "
                    f"+ {len(feed) + n - 1} >= max_size {int(c.max_size)}{why}"
                )
        return None

    def prefill(self, prompt_ids: list[int], ctx: TapContext | None) -> list[int]:
        if self.vocab is not None and prompt_ids and max(prompt_ids) >= self.vocab:
            i, t = next((i, int(t)) for i, t in enumerate(prompt_ids) if int(t) >= self.vocab)
            raise VocabMismatchError(
                f"two-model: the prompt token {t} (position {i}) is a padding row outside the "
                f"drafter's vocabulary [0, {self.vocab}) (no token of either tokenizer)")
        self._first_feed = True  # tail-split: the first feed is the prompt's last token
        for pos in range(0, len(prompt_ids), self.step):
            chunk = prompt_ids[pos : pos + self.step]
            self.model(mx.array(chunk, mx.uint32)[None], cache=self.caches)
            self._quantize()
            mx.eval([c.state for c in self.caches])
        return list(prompt_ids)

    def draft(self, feed: list[int], n: int, step_base: int, anchor_hidden: mx.array | None) -> list[int]:
        return token_ids(self.draft_array(feed, n, step_base, anchor_hidden))

    draft.via_draft_array = True  # type: ignore[attr-defined]  # the executor may call draft_array

    def draft_array(self, feed: list[int], n: int, step_base: int, anchor_hidden: mx.array | None) -> mx.array:
        """The ``n`` drafts as a lazy ``uint32`` device array (mlx-lm ``_draft_generate``): the
        executor builds the verify window on it without reading the drafts back first."""
        if n <= 0:
            return mx.array([], mx.uint32)
        if self.vocab is not None and any(int(t) >= self.vocab for t in feed):
            pad = next(int(t) for t in feed if int(t) >= self.vocab)
            what = "prompt token" if self._first_feed else "target emitted id"
            raise VocabMismatchError(
                f"two-model: the {what} {pad} is a padding row outside the drafter's "
                f"vocabulary [0, {self.vocab}) (no token of either tokenizer)")
        self._first_feed = False
        if self.replay:
            self._snapshot = [
                int(c.offset) if self.kv[i] else (list(c.cache), c.lengths, c.left_padding)
                for i, c in enumerate(self.caches)
            ]
            self._feed = list(feed)
        y = mx.array(feed, mx.uint32)
        ys = []
        for ring in self.rings.values():
            ring.begin()
        try:
            for _ in range(n):
                logits = self.model(y[None], cache=self.caches)[:, -1:, :]
                self._quantize()
                y = self.sampler.sample_window(logits.squeeze(0))
                mx.async_eval(y)
                ys.append(y)
        finally:
            for ring in self.rings.values():
                ring.end()
        out = mx.concatenate(ys)
        if self.target_vocab is not None:  # a wider drafter: read back, never feed padding on
            wide = [int(t) for t in token_ids(out) if int(t) >= self.target_vocab]
            if wide:
                raise VocabMismatchError(
                    f"two-model: the drafter proposed id {wide[0]}, a padding row outside the "
                    f"target's vocabulary [0, {self.target_vocab}) (no token of either tokenizer)")
        return out

    def commit(
        self,
        d: int,
        k_accept: int,
        ctx: TapContext | None = None,
        verified_hidden: mx.array | None = None,
        accepted_tokens: list[int] | None = None,
    ) -> None:
        if self.rings:
            self._commit_rings(d, k_accept)
        if not self.replay:
            cache_ops.trim(
                [c for i, c in enumerate(self.caches) if i not in self.rings],
                max(d - k_accept - 1, 0),
                "two-model drafter",
            )
            return
        if d == 0 or k_accept == d or self._snapshot is None:
            return  # nothing drafted, or every processed token is kept
        for i, c in enumerate(self.caches):
            snap = self._snapshot[i]
            if i in self.rings:
                continue  # already restored to the round's start by _commit_rings
            if self.kv[i]:
                cache_ops.trim([c], int(c.offset) - snap, "two-model drafter")
            else:
                c.cache, c.lengths, c.left_padding = list(snap[0]), snap[1], snap[2]
        drafts = list(accepted_tokens or [])
        for chunk in [self._feed] + [[t] for t in drafts[:k_accept]]:
            self.model(mx.array(chunk, mx.uint32)[None], cache=self.caches)
            self._quantize()
        mx.eval([c.state for c in self.caches])
        self._snapshot = None

    def _commit_rings(self, d: int, k_accept: int) -> None:
        """Roll the exact rings back: keep every processed position but the rejected tail."""
        trim = max(d - k_accept - 1, 0)
        for ring in self.rings.values():
            if not ring.armed:
                continue
            processed = sum(int(k.shape[2]) for k, _ in ring.calls)
            if self.replay and not (d == 0 or k_accept == d):
                ring.rollback(0)  # restored to the round's start; the model replay re-feeds it
            elif trim == 0:
                ring.commit()
            elif ring.cache.is_trimmable():
                ring.commit()
                cache_ops.trim([ring.cache], trim, "two-model drafter")
            else:
                ring.rollback(processed - trim)

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
        if target_tokenizer is not None and self.tokenizer is not None:
            self._checked = target_model  # open() need not re-check this target's ids

    def open(self, sampler: StepSampler, target: TargetView) -> TwoModelSource:
        if getattr(self, "_checked", None) is not target.model:
            check_compatible(target.model, self.model)
        return TwoModelSource(self.model, sampler, self.prefill_step_size, _out_dim(target.model))


# ---------------------------------------------------------------- the kind (engine.sources.kind)


def _open(draft_dir: Path | None, opts: OpenOptions) -> TwoModelProvider:
    assert draft_dir is not None
    d = opts.loader()(str(draft_dir))
    return TwoModelProvider(d.model, draft_tokenizer=d.tokenizer)


SOURCE = SourceKind(
    name=KIND, provider=TwoModelProvider, open=_open, prefill=PREFILL, reuse="segment", roster=0,
    detect_fallback=True,  # §3: a directory no other detector claims is a drafter model
    loads_model=True, zoo="zoo:pair", label_prefix=False,
    hint="a drafter mlx-lm model dir",
)
