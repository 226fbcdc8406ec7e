"""Engine two-model vs engine plain decode: the losslessness claim of §2.1.

Greedy speculative output must equal plain greedy output token for token on
tie-free prompts. Batched verify and serial decode are different GEMMs, so a
flip where the first differing sample sits on a knife-edge (margin < ε) is
reported as ``numerics``; a flip on a tie-free position is a ``logic`` failure.
"""

from __future__ import annotations

import pytest

from conformance.conftest import matrix_prompt_ids, run_trace
from specparity.cases import Case
from traces.diff import diff_traces

CASES = [
    Case(t, d, p, g, 32)
    for t in ("llama", "qwen3")
    for d in ("self", "twin", "small")
    for g in (1, 3, 5)
    for p in matrix_prompt_ids()
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.case_id)
def test_spec_tokens_equal_plain(case: Case) -> None:
    spec, plain = run_trace("engine", case), run_trace("engine", case.plain())
    div = diff_traces(spec, plain, level="tokens")
    if div is not None and div.klass == "numerics":
        pytest.xfail(f"knife-edge flip (numerics), reported not hidden:\n{div.message}")
    assert div is None, f"{case.case_id}: speculative vs plain\n{div.message}"
