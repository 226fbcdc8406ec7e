"""Shared fixtures for the conformance suite.

Models are loaded once per session (``specparity.runners.load_model`` caches
them); the case matrix is small by default and grows with
``SPECPARITY_PROMPTS=all`` (the nightly setting).
"""

from __future__ import annotations

import functools
import os
from typing import Any

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


@functools.cache
def witness() -> Any:
    """The numerics witness (``engine/witness.py``) on the session's cached models.

    Pass it to ``diff_traces`` / ``compare_with_reference`` wherever a class
    decides the outcome: a flip is ``numerics`` only when each run's own
    arithmetic path reproduces its token (traces/INTERPRETING.md).
    """
    from specparity.run import numerics_witness

    return numerics_witness()


def require_oracle(name: str) -> None:
    from oracles import availability

    ok, why = availability(name)
    if not ok:
        pytest.skip(f"oracle {name} unavailable: {why}")
