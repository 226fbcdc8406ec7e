"""Runner declaration: ``deepspec``, DeepSpec's DSpark evaluator (torch; ``oracles/deepspec.py``).

DeepSpec block drafters only (greedy; the block length is the drafter's), with EOS ids.
"""

from __future__ import annotations

from typing import Any

from specparity.cases.golden_cases import deepspec_cases
from specparity.runners.registry import (
    CaseRun,
    GoldenSet,
    Runner,
    oracle_availability,
    package_version,
    sources,
)


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


def golden_identity() -> dict[str, str | None]:
    """DeepSpec's golden identity: the checkout's commit (``DEEPSPEC_PATH``: ``.deepspec-commit``
    or ``git rev-parse HEAD``) and, as its version, the torch/transformers it runs on. None where
    unknown here (no ``DEEPSPEC_PATH``, or no torch): such a field is not checked."""
    from oracles.deepspec import checkout_commit

    commit = checkout_commit()
    torch, tf = package_version("torch"), package_version("transformers")
    return {"version": f"torch {torch}, transformers {tf}" if commit and torch and tf else None,
            "commit": commit}


RUNNER = Runner(
    name="deepspec",
    kind="reference",
    package="deepspec (local checkout, DEEPSPEC_PATH)",
    sources=sources(("eos_ids",), "deepspec"),
    run=run,
    available=oracle_availability("deepspec"),
    install_hint="DeepSpec is not on the package index: check out github.com/deepseek-ai/DeepSpec, "
                 "set DEEPSPEC_PATH=<checkout>, then tox -e deepspec  (torch==2.13.0 CPU + "
                 "transformers==5.10.2)",
    header=_header,
    rank=50,
    goldens=(GoldenSet("deepspec", "deepspec", ("oracles.__init__", "oracles.recording", "oracles.deepspec",
                                                "traces.normalize"),
                       cases=deepspec_cases, identity=golden_identity),),
)
