"""Runner declaration: ``optiq``, mlx-optiq's n-gram lookup and gemma4 assistant loops
(``oracles/optiq.py``: ``optiq.runtime.ngram_spec``, ``optiq.runtime.spec``).

Plain and n-gram decode take sampling, top-p/top-k and EOS ids (no stop sequences, no
logits processors); the assistant loop is greedy and stops on one EOS id (the case's
single id, else the target's first).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from specparity.cases.golden_cases import assistant_draft_cases
from specparity.runners.draft_goldens import produce_optiq_assistant
from specparity.runners.registry import (
    CaseRun,
    GoldenSet,
    Runner,
    RunnerUnsupported,
    oracle_availability,
    sources,
)


def run(x: CaseRun) -> list[dict[str, Any]]:
    from oracles import optiq

    case = x.case
    if case.drafter is not None and case.source == "assistant":
        if case.eos_ids is not None and len(case.eos_ids) != 1:
            raise RunnerUnsupported(f"optiq's assistant loop stops on one EOS id, case {case.case_id} "
                                    f"has {list(case.eos_ids)}")
        return optiq.run_assistant(x.target.model, str(x.dpath), x.ids, gamma=case.gamma,
                                   max_tokens=case.max_tokens, eos_id=x.eos_ids[0])
    return optiq.run(
        x.target.model,
        x.target.tokenizer,
        x.ids,
        ngram=case.source == "ngram" and case.drafter is not None,
        gamma=case.gamma,
        ngram_min=1,
        ngram_max=3,
        max_tokens=case.max_tokens,
        temperature=case.temperature,
        top_p=case.top_p,
        top_k=case.top_k,
        seed=case.seed,
        eos_ids=list(case.eos_ids) if case.eos_ids is not None else None,
    )


RUNNER = Runner(
    name="optiq",
    kind="reference",
    package="mlx-optiq",
    sources={**sources(("sampling", "top_p", "top_k", "eos_ids"), "plain", "ngram"),
             **sources(("eos_ids",), "assistant")},  # one EOS id (the first of the target's)
    run=run,
    available=oracle_availability("optiq"),
    install_hint="tox -e optiq  (pip install 'specparity[optiq]' in its own environment: mlx-optiq pins "
                 "transformers<5.13)",
    header=lambda: {"name": "optiq", "package": "mlx-optiq", "version": metadata.version("mlx-optiq")},
    rank=20,
    # draft-level goldens (specparity/runners/draft_goldens.py): its assistant drafter in its own loop
    goldens=(GoldenSet("optiq_assistant", "mlx-optiq",
                       ("oracles.__init__", "oracles.recording", "oracles.drafts", "oracles.optiq",
                        "traces.normalize", "specparity.runners.draft_goldens"),
                       cases=assistant_draft_cases, produce=produce_optiq_assistant),),
)
