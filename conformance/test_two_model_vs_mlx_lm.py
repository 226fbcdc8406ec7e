"""Engine two-model vs mlx-lm ``speculative_generate_step``, round for round.

§3 roster row ``two-model`` (oracle L1): same pair, greedy, every zoo pair,
γ ∈ {1, 2, 3, 5}: feed, drafts, window, samples, k_accept, emitted, end and
the target/drafter cache digests after every round's rollback must be equal,
and so must usage and the speculation counters. Also plain decode vs mlx-lm
``generate_step``.
"""

from __future__ import annotations

import pytest

from conformance.conftest import matrix_prompt_ids, require_oracle, run_trace
from specparity.cases import Case
from traces.diff import diff_traces

GAMMAS = (1, 2, 3, 5)


def _pairs() -> list[tuple[str, str]]:
    from engine import zoo

    return zoo.pairs()


CASES = [
    Case(t, d, p, g, 32) for (t, d) in _pairs() for g in GAMMAS for p in matrix_prompt_ids()
]
PLAIN = list(dict.fromkeys(c.plain() for c in CASES))


@pytest.mark.oracle
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.case_id)
def test_round_for_round(case: Case) -> None:
    require_oracle("mlx_lm")
    eng, ref = run_trace("engine", case), run_trace("mlx_lm", case)
    div = diff_traces(eng, ref, level="round")
    assert div is None, f"{case.case_id}: engine vs mlx-lm\n{div.message}"
    # The comparison is not vacuous: rounds happened and digests were compared.
    assert eng.rounds and ref.rounds[0]["target_cache_digest"] is not None


@pytest.mark.oracle
@pytest.mark.parametrize("case", PLAIN, ids=lambda c: c.case_id)
def test_plain_decode_matches_generate_step(case: Case) -> None:
    require_oracle("mlx_lm")
    div = diff_traces(run_trace("engine", case), run_trace("mlx_lm", case), level="round")
    assert div is None, f"{case.case_id}: engine plain vs mlx-lm generate_step\n{div.message}"


@pytest.mark.oracle
def test_matrix_exercises_every_round_end() -> None:
    """The matrix reaches all-accept, partial and zero-accept rounds."""
    require_oracle("mlx_lm")
    ends: set[str] = set()
    ks: set[str] = set()
    for case in CASES[:: max(1, len(CASES) // 40)]:
        tr = run_trace("mlx_lm", case)
        for r in tr.rounds:
            ends.add(r["end"])
            d, k = len(r["drafts"]), r["k_accept"]
            ks.add("all" if k == d else ("zero" if k == 0 else "partial"))
    assert {"correction", "bonus", "budget"} <= ends, ends
    assert ks == {"all", "zero", "partial"}, ks
