"""Runner declaration: ``mlx_lm``, mlx-lm 0.32.2's own decode loops (``oracles/mlx_lm.py``).

``generate_step`` (plain) and ``speculative_generate_step`` (a draft model only):
sampling, top-p/top-k/min-p, EOS ids, stop sequences, logits processors and quantized KV
(``kv_bits``, ``kv_group_size``, ``quantized_kv_start``).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from specparity.cases.golden_cases import default_cases
from specparity.runners.registry import CaseRun, GoldenSet, Runner, oracle_availability, sources


def run(x: CaseRun) -> list[dict[str, Any]]:
    from oracles import mlx_lm as oracle
    from specparity.runners import processor_params
    from traces.reference import ReferenceRefused

    case = x.case
    proc = processor_params(case) if case.processors else None
    try:
        return oracle.run(
            x.target.model,
            x.target.tokenizer,
            x.ids,
            draft=x.draft.model if x.draft is not None else None,
            gamma=case.gamma,
            max_tokens=case.max_tokens,
            temperature=case.temperature,
            top_p=case.top_p,
            top_k=case.top_k,
            min_p=case.min_p,
            seed=case.seed,
            eos_ids=list(case.eos_ids) if case.eos_ids is not None else None,
            stop_sequences=[list(s) for s in case.stop_sequences],
            logits_processors=proc.kwargs() if proc is not None else None,
            processor_history=proc.history_prompt if proc is not None else None,
            kv_bits=case.kv_bits, kv_group_size=case.kv_group_size,
            quantized_kv_start=case.quantized_kv_start,
        )
    except ReferenceRefused as exc:
        raise ReferenceRefused("mlx_lm", case.case_id, exc.message) from None


def runs_processors(case: Any) -> bool:
    """Whether mlx-lm applies the case's processor history convention (``generate_step``:
    the whole prompt; ``speculative_generate_step``: the last prompt token)."""
    tag = getattr(case, "processors", "")
    if not any(part[:2] in ("rp", "pp", "fp") for part in tag.split("+")):
        return True
    return tag.endswith("+hlast") == (case.drafter is not None)


@cache
def trimmable(target: str) -> bool:
    """Whether the zoo target's prompt cache can be trimmed (mlx-lm's
    ``speculative_generate_step`` refuses a target whose cache cannot)."""
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    import zoo
    from specparity.runners import load_model

    return bool(can_trim_prompt_cache(make_prompt_cache(load_model(str(zoo.model_dir(target))).model)))


RUNNER = Runner(
    name="mlx_lm",
    kind="reference",
    package="mlx-lm",
    sources=sources(("sampling", "top_p", "top_k", "min_p", "eos_ids", "stop_sequences", "logits_processors",
                     "kv_cache"), "plain", "two-model"),
    run=run,
    available=oracle_availability("mlx_lm"),
    install_hint="pip install 'specparity[oracles]'  (mlx-lm>=0.32,<0.33)",
    rank=10,
    goldens=(GoldenSet("mlx_lm", "mlx-lm", ("oracles.__init__", "oracles.recording", "oracles.mlx_lm"),
                       cases=default_cases,
                       supports=lambda case: runs_processors(case)
                       and (case.drafter is None or trimmable(case.target))),),
)
