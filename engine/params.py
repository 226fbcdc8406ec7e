"""A request's settings (:class:`GenerationParams`) and the trace-header codec of its sampling
pipeline: a plain value type and its serialisation, beside each other and apart from their
consumers (the executor, ``engine.executor``; the sampling pipeline, ``engine.pipeline``; the
numerics witness, ``engine.witness``), so neither consumer imports the other to reach them.

``engine.executor`` re-exports :class:`GenerationParams` (its historical home); ``engine.pipeline``
re-exports the codec for ``specparity.runners`` (whose source the goldens digest).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine import caches as cache_ops
from engine.rollback import ROTATING_MODES
from engine.sampler import SamplerParams
from engine.seam import PREFILL_MODES, PrefillMode

__all__ = ["GenerationParams", "header_params", "params_from_header", "processors_block",
           "processors_from_block", "sampler_from_header"]


@dataclass(frozen=True)
class GenerationParams:
    """Per-request settings shared by plain and speculative decode."""

    max_tokens: int = 32
    gamma: int = 3
    sampler: SamplerParams = field(default_factory=SamplerParams)
    seed: int | None = 0
    prefill: PrefillMode | None = None
    prefill_step_size: int | None = None
    eos_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    cache_digests: bool = True
    on_no_rollback: str = "plain"  # "plain": finish with plain decode; "error": raise
    # Rotating caches past the ring wrap: "guard" (§2: finish with plain decode) or
    # "exact" (engine/rollback.py RingRound: keep, restore and re-apply; guard as fallback).
    rotating: str = "guard"
    # Quantized KV (mlx-lm generate_step / speculative_generate_step parameters).
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 5000
    # Grammar-constrained decoding (engine.grammar: mask in the accept walk, drafter free).
    grammar: Any = None

    @property
    def kv(self) -> cache_ops.KVQuantization | None:
        if self.kv_bits is None:
            return None
        return cache_ops.KVQuantization(self.kv_bits, self.kv_group_size, self.quantized_kv_start)

    def __post_init__(self) -> None:
        self.kv  # noqa: B018  # validates kv_bits / kv_group_size / quantized_kv_start
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")
        if self.prefill is not None and self.prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {self.prefill!r}")
        if self.prefill_step_size is not None and self.prefill_step_size < 1:
            raise ValueError("prefill_step_size must be >= 1")
        if self.on_no_rollback not in ("plain", "error"):
            raise ValueError(f"on_no_rollback must be 'plain' or 'error', got {self.on_no_rollback!r}")
        if self.rotating not in ROTATING_MODES:
            raise ValueError(f"rotating must be one of {ROTATING_MODES}, got {self.rotating!r}")
        if any(len(s) == 0 for s in self.stop_sequences):
            raise ValueError("stop sequences must not be empty")



# ---------------------------------------------------------------------- the trace header
# The pipeline's part of a trace header's ``params`` (traces/INTERPRETING.md): written by
# :func:`header_params` (every runner's header builder, ``specparity.runners``) and read back
# by :func:`params_from_header` (the numerics witness). ``tests/test_pipeline.py`` plants a
# non-default value in every ``SamplerParams`` field and checks the round trip, so a stage
# added to the pipeline cannot be forgotten by the replay.

_PROCESSOR_KEYS = ("repetition_penalty", "repetition_context_size", "presence_penalty",
                   "presence_context_size", "frequency_penalty", "frequency_context_size")


def processors_block(proc: Any) -> dict[str, Any]:
    """The header's ``params.logits_processors`` block of a ``ProcessorParams``."""
    kw = proc.kwargs()
    kw["logit_bias"] = [[t, v] for t, v in (kw["logit_bias"] or {}).items()]
    return {**kw, "history_prompt": proc.history_prompt}


def processors_from_block(block: Any) -> Any:
    """Inverse of :func:`processors_block` (a ``ProcessorParams``; ValueError on a bad block)."""
    from engine.sampler import ProcessorParams

    if not isinstance(block, dict):
        raise ValueError(f"params.logits_processors must be an object, got {type(block).__name__}")
    bias = block.get("logit_bias") or ()
    return ProcessorParams(
        logit_bias=tuple((int(t), float(v)) for t, v in bias),
        **{k: block[k] for k in (*_PROCESSOR_KEYS, "history_prompt") if k in block and block[k] is not None})


def header_params(sampler: Any, seed: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(core, extra)``: the header keys of a request's sampling pipeline.

    ``core`` (always present, in this order): temperature, top_p, top_k, min_p, seed; ``extra``
    (present only when not the default, so older traces keep their bytes): logits_processors,
    min_tokens, rng.
    """
    core = {"temperature": sampler.temperature, "top_p": sampler.top_p, "top_k": sampler.top_k,
            "min_p": sampler.min_p, "seed": seed}
    extra: dict[str, Any] = {}
    if sampler.effective_processors.active:
        extra["logits_processors"] = processors_block(sampler.effective_processors)
    if sampler.min_tokens:
        extra["min_tokens"] = sampler.min_tokens
    if sampler.rng != "stream":
        extra["rng"] = sampler.rng
    return core, extra


def sampler_from_header(params: dict[str, Any]) -> Any:
    """The ``SamplerParams`` a header's ``params`` records (inverse of :func:`header_params`)."""
    from engine.sampler import ProcessorParams, SamplerParams

    lp = params.get("logits_processors")
    proc = processors_from_block(lp) if lp is not None else ProcessorParams()
    return SamplerParams(
        temperature=float(params.get("temperature") or 0.0), top_p=float(params.get("top_p") or 0.0),
        top_k=int(params.get("top_k") or 0), min_p=float(params.get("min_p") or 0.0),
        processors=proc if proc.active else ProcessorParams(),
        min_tokens=int(params.get("min_tokens") or 0), rng=str(params.get("rng") or "stream"))


def params_from_header(header: dict[str, Any], grammar: Any = None) -> Any:
    """The ``GenerationParams`` a run's pipeline was built from, as its trace header records
    them (sampler, seed, EOS ids, max tokens; ``grammar``: the compiled grammar, which needs
    the tokenizer: ``engine.grammar.grammar_from_header``)."""
    p = header.get("params") or {}
    return GenerationParams(max_tokens=int(p.get("max_tokens") or 1), gamma=0, sampler=sampler_from_header(p),
                            seed=p.get("seed"), eos_ids=tuple(int(t) for t in header.get("eos_ids") or ()),
                            grammar=grammar)
