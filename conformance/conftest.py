"""Shared fixtures for the conformance suite.

Models are loaded once per session (``specparity.runners.load_model`` caches
them); the case matrix is small by default and grows with
``SPECPARITY_PROMPTS=all`` (the nightly setting).
"""

from __future__ import annotations

import os

import pytest

from traces.io import Trace


def matrix_prompt_ids(default: int = 6) -> list[str]:
    import zoo
    from specparity.cases import pick_prompts

    ids = [p.id for p in zoo.prompts()]
    want = os.environ.get("SPECPARITY_PROMPTS", str(default))
    return ids if want == "all" else pick_prompts(ids, int(want))


def run_trace(runner: str, case) -> Trace:  # noqa: ANN001
    from specparity.runners import run_case

    return Trace.from_records(run_case(runner, case))


def require_oracle(name: str) -> None:
    from oracles import availability

    ok, why = availability(name)
    if not ok:
        pytest.skip(f"oracle {name} unavailable: {why}")
