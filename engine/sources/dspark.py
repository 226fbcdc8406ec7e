"""The ``dspark`` draft source: our trained DSpark block drafter (§3 roster, §4.1).

Mirrors mlx-bun ``src/spec/dflash-source.ts`` over ``dspark/module-dflash.ts``
(here :mod:`engine.dspark.module`): the target's taps on prefill and on every
verify forward grow the drafter's context K/V (accepted rows only: the verify
window's rows ``0..k_accept``); each ``draft(feed)`` drafts one block anchored
at ``feed[-1]`` and returns its confidence-pruned prefix (position 0 always
survives), at most ``n``. γ is pinned to the checkpoint's ``gamma``.

Prefill is FULL, as the second reference (mlx-vlm ``generate_step`` with a
DSpark drafter) prefills: the target's first token is the prefill's sample
and all prompt rows are context.

``last_confidence``: ``c_k`` of the kept drafts, plus the cut position's value
when pruning truncated the block inside ``n`` (``traces/INTERPRETING.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine import caches as cache_ops
from engine.dspark import loader
from engine.dspark import module as dsm
from engine.sampler import StepSampler
from engine.seam import DraftSourceBase, PrefillMode, TapContext, TargetView
from engine.sources.kind import OpenOptions, SourceKind, read_json

KIND = "dspark"
PREFILL: PrefillMode = "full"  # §2.1; the source and its descriptor share it


class _LayerView:
    def __init__(self, keys: Any, values: Any, offset: int) -> None:
        self.keys, self.values, self.offset = keys, values, offset


def _target_io(target_model: Any) -> tuple[Any, Any]:
    """The target's scaled embedding and lm-head (``share_target_embeddings``)."""
    inner = getattr(target_model, "model", target_model)
    scale = getattr(inner, "embed_scale", None)

    def embed(ids: mx.array) -> mx.array:
        e = inner.embed_tokens(ids)
        return e * scale if scale is not None else e

    head = getattr(target_model, "lm_head", None)
    return embed, (head if head is not None else inner.embed_tokens.as_linear)


class DSparkSource(DraftSourceBase):
    prefill_mode: PrefillMode = PREFILL
    wants_anchor_hidden = False
    weights_bytes = 0

    def __init__(self, model: dsm.DSparkModel, target: TargetView, threshold: float | None) -> None:
        self.model = model
        self.tap_layers = tuple(model.cfg.tap_layers)
        self.threshold = threshold
        self.embed, self.lm_head = _target_io(target.model)
        self.cache = dsm.ContextKV(model.cfg.num_hidden_layers)
        self.pending: mx.array | None = None
        self.last_confidence: list[float] | None = None

    def _features(self, ctx: TapContext, rows: int) -> mx.array:
        return mx.concatenate([ctx.hidden[i][:rows].astype(mx.float32) for i in self.tap_layers], axis=-1)

    def prefill(self, prompt_ids: list[int], ctx: TapContext | None) -> list[int]:
        if ctx is None:
            raise RuntimeError("dspark: prefill needs the tapped target hidden (tap_layers)")
        self.pending = self._features(ctx, len(ctx.tokens))
        return []

    def draft(self, feed: list[int], n: int, step_base: int, anchor_hidden: mx.array | None) -> list[int]:
        block = self.model.draft_block(self.cache, self.pending, int(feed[-1]), self.embed, self.lm_head,
                                       threshold=self.threshold)
        self.pending = None
        d = max(0, min(block.keep, n))
        self.last_confidence = block.confidence[: d + 1] if block.keep < n else block.confidence[:d]
        return block.tokens[:d]

    def commit(self, d: int, k_accept: int, ctx: TapContext | None = None,
               verified_hidden: mx.array | None = None, accepted_tokens: list[int] | None = None) -> None:
        if ctx is None:
            raise RuntimeError("dspark: commit needs the tapped verify window")
        self.pending = self._features(ctx, k_accept + 1)

    def cache_digest(self) -> dict[str, Any] | None:
        return cache_ops.cache_digest(
            [_LayerView(k, v, self.cache.length) for k, v in zip(self.cache.keys, self.cache.values, strict=True)])


class DSparkProvider:
    """Owns a loaded DSpark drafter (``dspark.json`` artifact); γ = its ``gamma``.

    ``confidence_threshold``: None uses the checkpoint's calibrated thresholds
    (or ``min_conf``; uncalibrated → fixed γ); a number overrides every position
    but 0; ``calibrating=True`` disables pruning (calibration rounds).
    """

    kind = KIND

    def __init__(self, model: dsm.DSparkModel | str | Path, *, confidence_threshold: float | None = None,
                 calibrating: bool = False) -> None:
        self.model = model if isinstance(model, dsm.DSparkModel) else loader.load_drafter(model)
        if not isinstance(self.model, dsm.DSparkModel):
            raise loader.DrafterFormatError(f"{model}: not a dspark artifact (kind 'deepspec'?)")
        self.confidence_threshold = None if confidence_threshold is None else float(confidence_threshold)
        if calibrating:
            self.confidence_threshold = 0.0
        self.gamma = self.model.cfg.gamma

    def open(self, sampler: StepSampler, target: TargetView) -> DSparkSource:
        return DSparkSource(self.model, target, self.confidence_threshold)


# ---------------------------------------------------------------- the kind (engine.sources.kind)


def _open(draft_dir: Path | None, opts: OpenOptions) -> DSparkProvider:
    assert draft_dir is not None
    return DSparkProvider(draft_dir, confidence_threshold=opts.confidence_threshold)


def _detect(d: Path, config: Callable[[], dict[str, Any]]) -> bool:
    return (d / "dspark.json").is_file()  # first in the §3 order: wins over any config.json


def _block(d: Path) -> int:
    """The checkpoint's ``gamma`` (γ is pinned to it), read without loading weights."""
    return int(read_json(Path(d) / "dspark.json")["gamma"])


def _header(draft_dir: Path | None, opts: OpenOptions) -> dict[str, Any]:
    return {"confidence_threshold": opts.confidence_threshold}


SOURCE = SourceKind(
    name=KIND, provider=DSparkProvider, open=_open, prefill=PREFILL, reuse="tapped", roster=6,
    detect=_detect, detect_rank=0, pinned_gamma=_block,
    threshold_default=None,  # the checkpoint's calibrated thresholds (DSparkProvider)
    options=frozenset({"confidence_threshold"}), header=_header, zoo="zoo.dspark:case_paths",
    hint="a dspark.json dir",
)
