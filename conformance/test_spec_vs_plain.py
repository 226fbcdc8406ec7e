"""Engine two-model vs engine plain decode: the losslessness claim of §2.1.

Greedy speculative output must equal plain greedy output token for token on
tie-free prompts. Batched verify and serial decode are different GEMMs, so a
flip that the numerics witness reproduces by arithmetic alone (each run's own
path gives its own token on the same prefix) is reported as ``numerics``;
any other flip is a ``logic`` failure. The default run takes, on each target, the twin at
γ 3 on nat-00 and each one-axis variant of it; the full cross product runs nightly
(``tests.helpers.one_axis``). A plain trace is run once per module and shared by its cases.
"""

from __future__ import annotations

from functools import cache

import pytest

from conformance.conftest import matrix_prompt_ids, run_trace, witness
from specparity.cases.case import Case
from tests.helpers import one_axis
from traces.diff import diff_traces
from traces.io import Trace

CASES = [
    Case(t, d, p, g, 32)
    for t in ("llama", "qwen3")
    for d in ("self", "twin", "small")
    for g in (1, 3, 5)
    for p in matrix_prompt_ids()
]


@cache
def _plain(case: Case) -> Trace:
    return run_trace("engine", case)


@pytest.mark.parametrize("case", one_axis(CASES, drafter="twin", gamma=3, prompt_id="nat-00"))
def test_spec_tokens_equal_plain(case: Case) -> None:
    spec, plain = run_trace("engine", case), _plain(case.plain())
    div = diff_traces(spec, plain, level="tokens", witness=witness())
    if div is not None and div.klass == "numerics":
        pytest.xfail(f"arithmetic flip (numerics), reported not hidden:\n{div.message}")
    assert div is None, f"{case.case_id}: speculative vs plain\n{div.message}"
