"""The ``deepspec`` draft source: DeepSeek's released ``Gemma4DSparkModel`` drafters.

Roster row ``deepspec`` of ``../shared/reference/speculative-decoding.md`` §3
and §4.3 (mlx-bun ``src/spec/deepspec-source.ts``). Mirrors DeepSpec (MIT,
commit afdfa7c) ``deepspec/eval/dspark/evaluator.py`` ``Qwen3DSparkEvaluator``
(``_init_context`` / ``_propose`` / ``_update``, shared by
``Gemma4DSparkEvaluator``) driven by ``deepspec/eval/base_evaluator.py``
``generate_decoding_sample``:

- prefill is FULL (``prefill_mode = "full"``): the target runs the whole prompt
  tapped, its first token is the prefill's own sample, and every prompt row's
  taps become pending context;
- ``draft(feed)``: the block input is ``[feed[-1], mask × (block-1)]`` (the
  last committed token, not yet in the target cache); the pending context rows
  are projected and attended in the same forward, then only they stay in the
  context cache (``crop(start)``); the block is sampled sequentially through
  the Markov head at temperature 0; a confidence threshold > 0 keeps the
  prefix before the first position whose ``sigmoid(c_k)`` falls below it
  (ℓ = 0 allowed: the executor takes one plain, tapped target step); the
  returned drafts are ``block[:min(ℓ, n)]``;
- ``commit(d, k, ctx)``: the verify window's tapped rows ``0..k`` (the pending
  token and the ACCEPTED drafts only) become the next pending context
  (``_update``: ``verified_target_hidden[:, :accepted + 1]``).

Taps: ``target_layer_ids`` in DeepSpec's convention (``-1`` = the target's
scaled embedding output ``hidden_states[0]``; ``l >= 0`` = the output of
decoder layer ``l``, our ``tap_layers`` index). The embedding rows are
computed through the target view (``embed_tokens(ids) * embed_scale``), the
layer rows are captured by the executor (``engine.taps``).

``last_confidence`` (the executor's optional hook) holds ``sigmoid(c_k)`` for
the kept drafts, plus the cut position's value when the threshold truncated
the block inside the ``n`` positions the executor asked for
(``traces/INTERPRETING.md`` ``round.confidence``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine import caches as cache_ops
from engine.dspark import deepspec_module as dsm
from engine.sampler import StepSampler
from engine.seam import DraftSourceBase, PrefillMode, TapContext, TargetView
from engine.sources.kind import OpenOptions, SourceKind, read_json

KIND = "deepspec"
PREFILL: PrefillMode = "full"  # §2.1; the source and its descriptor share it


class _LayerView:
    """A context-cache layer seen as a KV cache (for the trace digest)."""

    def __init__(self, keys: Any, values: Any, offset: int) -> None:
        self.keys, self.values, self.offset = keys, values, offset


def _embed_rows(target_model: Any, tokens: list[int]) -> mx.array:
    inner = getattr(target_model, "model", target_model)
    emb = inner.embed_tokens(mx.array(tokens, mx.uint32))
    scale = getattr(inner, "embed_scale", None)
    return (emb * scale if scale is not None else emb).astype(mx.float32)


class DeepSpecSource(DraftSourceBase):
    prefill_mode: PrefillMode = PREFILL
    wants_anchor_hidden = False

    def __init__(self, model: dsm.Gemma4DSparkModel, target: TargetView, threshold: float,
                 tap_shift: int = 0, commit_extra_rows: int = 0, redraft_on_cut: bool = False) -> None:
        self.model = model
        self.target = target
        self.threshold = float(threshold)
        self.layer_ids = tuple(i + tap_shift if i >= 0 else i for i in model.cfg.target_layer_ids)
        self.tap_layers = tuple(i for i in self.layer_ids if i >= 0)
        self.cache = dsm.ContextCache(model.cfg.num_hidden_layers)
        self.pending: mx.array | None = None
        self.weights_bytes = 0
        self.last_confidence: list[float] | None = None
        self.last_block: dsm.DraftBlock | None = None
        # Planted-bug switches for the conformance suite's negative controls only.
        self._commit_extra_rows = commit_extra_rows
        self._redraft_on_cut = redraft_on_cut

    def _features(self, ctx: TapContext, rows: int) -> mx.array:
        parts = []
        for lid in self.layer_ids:
            if lid < 0:
                parts.append(_embed_rows(self.target.model, ctx.tokens[:rows]))
            else:
                parts.append(ctx.hidden[lid][:rows].astype(mx.float32))
        return mx.concatenate(parts, axis=-1)

    def prefill(self, prompt_ids: list[int], ctx: TapContext | None) -> list[int]:
        if ctx is None:
            raise RuntimeError("deepspec: prefill needs the tapped target hidden (tap_layers)")
        self.pending = self._features(ctx, len(ctx.tokens))
        return []

    def draft(self, feed: list[int], n: int, step_base: int, anchor_hidden: mx.array | None) -> list[int]:
        block = self.model.draft_block(self.cache, self.pending, int(feed[-1]), self.threshold)
        self.pending = None
        self.last_block = block
        keep = block.keep
        if self._redraft_on_cut and keep < self.model.cfg.block_size:
            # planted bug: re-draft the cut positions instead of truncating
            keep = self.model.cfg.block_size
        d = max(0, min(keep, n))
        conf = block.confidence
        if conf is None:
            self.last_confidence = None
        else:
            self.last_confidence = conf[: d + 1] if keep < n else conf[:d]
        return block.tokens[:d]

    def commit(
        self,
        d: int,
        k_accept: int,
        ctx: TapContext | None = None,
        verified_hidden: mx.array | None = None,
        accepted_tokens: list[int] | None = None,
    ) -> None:
        if ctx is None:
            raise RuntimeError("deepspec: commit needs the tapped verify window")
        rows = min(k_accept + 1 + self._commit_extra_rows, len(ctx.tokens))
        self.pending = self._features(ctx, rows)

    def cache_digest(self) -> dict[str, Any] | None:
        views = [_LayerView(k, v, self.cache.length) for k, v in zip(self.cache.keys, self.cache.values, strict=True)]
        return cache_ops.cache_digest(views)


class DeepSpecProvider:
    """Owns a loaded ``Gemma4DSparkModel``; opens one ``DeepSpecSource`` per request.

    γ is pinned to the checkpoint's ``block_size`` (§3 roster): ``gamma``.
    """

    kind = KIND

    def __init__(self, model: dsm.Gemma4DSparkModel | str | Path, *, confidence_threshold: float = 0.0,
                 **planted: Any) -> None:
        self.model = model if isinstance(model, dsm.Gemma4DSparkModel) else dsm.load(model)
        self.confidence_threshold = float(confidence_threshold)
        self.gamma = self.model.cfg.block_size
        self.planted = planted

    def open(self, sampler: StepSampler, target: TargetView) -> DeepSpecSource:
        # Drafts are argmax whatever the request sampler (§3: the temp-0 reference's
        # arm); verification still uses the request sampler, so output stays lossless.
        src = DeepSpecSource(self.model, target, self.confidence_threshold, **self.planted)
        src.weights_bytes = 0  # the provider owns the weights
        return src


# ---------------------------------------------------------------- the kind (engine.sources.kind)


def _open(draft_dir: Path | None, opts: OpenOptions) -> DeepSpecProvider:
    assert draft_dir is not None and opts.confidence_threshold is not None
    return DeepSpecProvider(draft_dir, confidence_threshold=opts.confidence_threshold)


def _detect(d: Path, config: Callable[[], dict[str, Any]]) -> bool:
    archs = config().get("architectures") or []
    return bool(archs) and archs[0] == "Gemma4DSparkModel"


def _block(d: Path) -> int:
    """The checkpoint's ``block_size`` (γ is pinned to it), read without loading weights."""
    return int(read_json(Path(d) / "config.json")["block_size"])


def _header(draft_dir: Path | None, opts: OpenOptions) -> dict[str, Any]:
    return {"confidence_threshold": opts.confidence_threshold}


SOURCE = SourceKind(
    name=KIND, provider=DeepSpecProvider, open=_open, prefill=PREFILL, reuse="tapped", roster=5,
    detect=_detect, detect_rank=1, pinned_gamma=_block, threshold_default=0.0,
    options=frozenset({"confidence_threshold"}), header=_header, zoo="zoo.dspark:case_paths",
    hint="a Gemma4DSparkModel dir",
)
