"""The ``assistant`` source vs mlx-optiq ``spec_generate`` + ``GemmaAssistantDrafter`` (§3 oracle L2).

Round for round at temperature 0 on the zoo ``gemma4`` target with both head
variants (tied embedding and centroid): feed, drafts, window, samples,
k_accept, emitted and end of every round before the engine's §2 ring-wrap
fallback, then the token stream, usage and counters. optiq's accounting is
recorded raw and mapped by exactly two named normalizations
(``traces/normalize.py``): ``optiq-spec-budget-drafts`` (optiq drafts γ
even with fewer tokens left) and ``optiq-stopping-eos`` (optiq yields the
stopping EOS). Anything else fails. Runs in ``tox -e optiq``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from conformance.conftest import require_oracle, run_trace
from specparity.cases import Case
from traces.diff import diff_traces
from traces.io import Trace
from traces.normalize import optiq_spec_budget_drafts, optiq_stopping_eos
from traces.reference import compare_with_reference

PROMPTS = ("nat-03", "nat-09", "nat-22", "rnd-15", "rnd-14")
HEADS = ("gemma4-assistant-self", "gemma4-assistant-centroid-self", "gemma4-assistant")
CASES = [Case("gemma4", h, p, g, 40, source="assistant") for h in HEADS for p in PROMPTS for g in (1, 3)]


def _normalized(case: Case) -> Trace:
    raw = run_trace("optiq", case).records()
    return Trace.from_records(optiq_stopping_eos(optiq_spec_budget_drafts(raw, case.max_tokens)))


@pytest.mark.oracle
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.case_id)
def test_assistant_round_for_round_vs_optiq(case: Case) -> None:
    require_oracle("optiq")
    eng = run_trace("engine", case)
    verdict = compare_with_reference(eng, _normalized(case), "optiq")
    assert verdict.status == "identical", f"{case.case_id}: engine vs optiq\n{verdict.format()}"


@pytest.mark.oracle
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.case_id)
def test_assistant_stopping_eos_vs_optiq(case: Case) -> None:
    require_oracle("optiq")
    plain = run_trace("engine", case.plain())
    case = replace(case, eos_ids=(plain.output_ids[6],))
    raw = run_trace("optiq", case)
    assert raw.output_ids[-1] in case.eos_ids, "optiq did not yield the stopping EOS"
    eng = run_trace("engine", case)
    div = diff_traces(eng, _normalized(case), level="round")
    assert div is None, f"{case.case_id}: engine vs optiq\n{div.message}"


@pytest.mark.oracle
def test_optiq_accepts_and_rejects() -> None:
    require_oracle("optiq")
    ks: set[str] = set()
    for case in CASES:
        for r in run_trace("optiq", case).rounds:
            d, k = len(r["drafts"]), r["k_accept"]
            ks.add("all" if k == d else ("zero" if k == 0 else "partial"))
    assert ks == {"all", "zero", "partial"}, ks


def test_budget_normalization_can_fail() -> None:
    """optiq-spec-budget-drafts cuts only drafts past the budget; a round that emitted past it is refused."""
    from traces.normalize import NotApplicable

    rnd = {"type": "round", "index": 0, "drafts": [7, 8, 9], "window": [5, 7, 8, 9], "k_accept": 3,
           "emitted": [7, 8], "margins": None}
    footer = {"type": "footer", "speculation": {"drafted": 3}}
    plain = {"type": "plain", "emitted": [5]}
    out = optiq_spec_budget_drafts([plain, rnd, footer], max_tokens=3)
    assert out[1]["drafts"] == [7, 8] and out[1]["window"] == [5, 7, 8] and out[1]["k_accept"] == 2
    assert out[2]["speculation"]["drafted"] == 2
    with pytest.raises(NotApplicable):
        optiq_spec_budget_drafts([plain, {**rnd, "emitted": [7, 8, 9]}, footer], max_tokens=3)
