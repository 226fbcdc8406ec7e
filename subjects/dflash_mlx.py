"""dflash-mlx 0.1.8 (PyPI ``dflash-mlx``), driven unmodified through its Python API.

Reference: ``dflash_mlx/runtime/context.py`` ``build_offline_runtime_context(verify_mode=)``,
``dflash_mlx/runtime/bundle.py`` ``load_runtime_bundle(model_ref, draft_ref,
verify_config)`` and ``dflash_mlx/runtime/__init__.py`` ``stream_dflash_generate``
(``prompt_tokens_override``, ``stop_token_ids``, ``block_tokens``), exactly as its
own ``generate.run_generate`` drives them. Events (``engine/events.py``):
``TokenEvent(token_id, ...)`` per token, ``CycleCompleteEvent(block_len,
commit_count, acceptance_len, ...)`` per verify cycle, ``SummaryEvent
(generated_token_ids, generation_tokens, accepted_from_draft,
cycles_completed, acceptance_history)`` at the end.

Drafter: a tiny DFlash draft model in dflash-mlx's own format, built by
instantiating its ``model.py`` ``DFlashDraftModel`` from a config derived
from the zoo ``qwen3`` target (1 layer, target taps 0 and 1, block 4, mask
token = last id, no draft lm_head: the runtime projects through the target's
head) and saving its seeded random parameters (``model.safetensors``), which
``load_draft_bundle`` reads back through mlx-lm's loader. EOS: ``stop_token_ids``
(that list is also the only stop-id mechanism, so a stop id is an EOS here:
the ``stop`` check is not separate). Greedy only (no sampler parameter).
Trace level: token, with per-cycle counts.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import zoo
from subjects import Mode
from subjects.base import RoundReport, SubjectCase, SubjectRun, timed
from subjects.common import case_mode, dist_version, eos_for, prompt_ids, require_module

NAME = "dflash-mlx"
_STOP = "stop_token_ids is the EOS list itself: no separate stop-id parameter"
_GREEDY = "stream_dflash_generate takes no temperature/sampler"
MODES = {
    f"verify-{m}": Mode(targets=("qwen3",), drafter="qwen3-dflash-random",
                        note=f"stream_dflash_generate, verify mode {m!r}, tiny random DFlash drafter in its format",
                        unsupported={"stop": _STOP, "distribution": _GREEDY})
    for m in ("dflash", "adaptive", "ddtree")
}


def require() -> None:
    require_module("dflash_mlx.runtime", NAME)


def version() -> str:
    return dist_version("dflash-mlx")


def drafter_config(target: str) -> dict[str, Any]:
    t = json.loads((zoo.model_dir(target) / "config.json").read_text())
    return {
        "model_type": t["model_type"], "architectures": ["DFlashDraftModel"],
        "hidden_size": t["hidden_size"], "num_hidden_layers": 1,
        "intermediate_size": t["intermediate_size"], "num_attention_heads": t["num_attention_heads"],
        "rms_norm_eps": t["rms_norm_eps"], "vocab_size": t["vocab_size"],
        "num_key_value_heads": t["num_key_value_heads"], "max_position_embeddings": t["max_position_embeddings"],
        "rope_theta": t.get("rope_theta", 1000000.0), "head_dim": t.get("head_dim", 16),
        "tie_word_embeddings": False, "num_target_layers": t["num_hidden_layers"], "block_size": 4,
        "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": t["vocab_size"] - 1},
    }


@cache
def drafter_dir(target: str) -> str:
    from dflash_mlx.model import DFlashDraftModel, DFlashDraftModelArgs

    from subjects.drafters import module_checkpoint

    cfg = drafter_config(target)
    d = module_checkpoint(f"dflash-mlx-{version()}-{target}-random",
                          lambda: DFlashDraftModel(DFlashDraftModelArgs.from_dict(cfg)), cfg)
    return str(d)


def drafter_path(case: SubjectCase) -> str | None:
    return drafter_dir(case.target)


@cache
def _bundle(target: str, verify_mode: str) -> tuple[Any, Any]:
    from dflash_mlx.runtime.bundle import load_runtime_bundle
    from dflash_mlx.runtime.context import build_offline_runtime_context

    ctx = build_offline_runtime_context(verify_mode=verify_mode)
    bundle = load_runtime_bundle(model_ref=str(zoo.model_dir(target)), draft_ref=drafter_dir(target),
                                 verify_config=ctx.verify)
    return ctx, bundle


def summary_counters(events: list[Any]) -> tuple[dict[str, int], dict[str, Any]]:
    """The counters and reported ids of dflash-mlx's ``SummaryEvent`` (dfly-mlx streams the same)."""
    from dflash_mlx.engine.events import SummaryEvent

    summary = next((e for e in events if isinstance(e, SummaryEvent)), None)
    if summary is None:
        return {}, {}
    counters = {"generation_tokens": int(summary.generation_tokens),
                "accepted": int(summary.accepted_from_draft), "rounds": int(summary.cycles_completed)}
    return counters, {"reported_ids": [int(t) for t in summary.generated_token_ids]}


def generate(case: SubjectCase) -> SubjectRun:
    from dflash_mlx.engine.events import CycleCompleteEvent, TokenEvent
    from dflash_mlx.runtime import stream_dflash_generate

    case_mode(case, MODES, "dflash-mlx", stop=_STOP, greedy=_GREEDY)
    ctx, b = _bundle(case.target, case.mode.removeprefix("verify-"))
    eos = sorted(eos_for(case.eos_ids))

    def run() -> list[Any]:
        stream = stream_dflash_generate(
            target_model=b.target_model, target_ops=b.target_ops, tokenizer=b.tokenizer,
            draft_model=b.draft_model, draft_backend=b.draft_backend, prompt="",
            prompt_tokens_override=list(prompt_ids(case.prompt_id)), max_new_tokens=case.max_tokens,
            use_chat_template=False, stop_token_ids=eos, runtime_context=ctx)
        try:
            return list(stream)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    events, wall = timed(run)
    tokens = [int(e.token_id) for e in events if isinstance(e, TokenEvent)]
    cycles = [e for e in events if isinstance(e, CycleCompleteEvent)]
    rounds = [RoundReport(drafted=max(int(c.block_len) - 1, 0), accepted=int(c.acceptance_len),
                          committed=int(c.commit_count), source=c.draft_source) for c in cycles] or None
    counters, extra = summary_counters(events)
    prefill = max(len(tokens) - sum(r.committed for r in rounds), 0) if rounds else 0
    return SubjectRun(stream=tokens, finish_reason=None, rounds=rounds, counters=counters, wall_s=wall,
                      prefill_tokens=min(prefill, 1), extra=extra,
                      hooks=["dflash_mlx.runtime.stream_dflash_generate (TokenEvent, CycleCompleteEvent, "
                             "SummaryEvent)", "dflash_mlx.runtime.bundle.load_runtime_bundle"])
