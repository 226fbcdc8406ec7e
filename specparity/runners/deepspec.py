"""Runner declaration: ``deepspec``, DeepSpec's DSpark evaluator (torch; ``oracles/deepspec.py``).

DeepSpec block drafters only (greedy; the block length is the drafter's), with EOS ids.
"""

from __future__ import annotations

from typing import Any

from specparity.runners.registry import CaseRun, Runner, oracle_availability, sources


def run(x: CaseRun) -> list[dict[str, Any]]:
    from oracles import deepspec
    from specparity.runners import dspark_drafter
    from zoo.dspark import artifact_dir

    case = x.case
    assert x.dpath is not None
    return deepspec.run(
        artifact_dir(f"{case.target}-hf"),
        x.dpath,
        x.ids,
        max_tokens=case.max_tokens,
        confidence_threshold=dspark_drafter(case)[1],
        eos_ids=x.eos_ids,
        seed=case.seed,
    )


def _header() -> dict[str, Any]:
    from oracles import deepspec

    return {"name": "deepspec", "package": "deepspec", "version": deepspec.version(),
            "commit": deepspec.commit()}


RUNNER = Runner(
    name="deepspec",
    kind="reference",
    package="deepspec (local checkout, DEEPSPEC_PATH)",
    sources=sources(("eos_ids",), "deepspec"),
    run=run,
    available=oracle_availability("deepspec"),
    install_hint="tox -e deepspec with DEEPSPEC_PATH=<DeepSpec checkout>  "
                 "(torch==2.13.0 CPU + transformers==5.10.2)",
    header=_header,
    rank=50,
)
