"""Every two sampling stages combined, against the reference (issue 41; ``specparity/cases/pairwise.py``).

A pipeline that applies top-p before the logits processors passed every default check: no
default case set top-p and a processor together, and spec-vs-plain cannot see it (both lanes
share the pipeline). The pairwise cases combine every two stages; the reference cases are
compared with mlx-lm 0.32.2 (``generate_step`` / ``speculative_generate_step``, which apply
``make_logits_processors`` and then ``make_sampler``'s top-p, top-k and temperature) round
for round, the pipeline cases (min_tokens and a grammar too) spec with plain decode token
for token. The top-p-before-processors plant is caught here.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from conformance.conftest import require_oracle, run_trace
from specparity.cases.case import Case
from specparity.cases.pairwise import (
    PIPELINE_STAGES,
    STAGES,
    pairwise_cases,
    pipeline_cases,
    reference_cases,
    stage_rows,
    uncovered_pairs,
)
from traces.diff import diff_traces
from traces.reference import compare_with_reference


@pytest.mark.parametrize("pipeline", [False, True])
def test_every_pair_of_stages_is_combined(pipeline: bool) -> None:
    rows = stage_rows(pipeline)
    stages = PIPELINE_STAGES if pipeline else STAGES
    assert uncovered_pairs(rows, stages) == []
    assert len(rows) <= 10, "a covering array, not the product"
    # not vacuous: dropping any row leaves some pair uncovered
    for i in range(len(rows)):
        assert uncovered_pairs(rows[:i] + rows[i + 1:], stages), f"row {i} adds no pair"


def test_top_p_is_combined_with_every_processor() -> None:
    """The issue's blind spot, named: a case with top-p and each processor, each compared with mlx-lm."""
    for proc in ("rp", "pp", "fp", "lb"):
        assert any(c.top_p and proc in c.processors and c.temperature for c in reference_cases()), proc


def test_the_default_run_holds_the_pairwise_cases() -> None:
    from specparity.jobs.run import zoo_cases

    assert set(pairwise_cases()) <= set(zoo_cases())
    assert pairwise_cases(targets=["qwen3"]) == [] and pairwise_cases(drafters=["self"]) == []


@pytest.mark.oracle
@pytest.mark.parametrize("case", reference_cases(), ids=lambda c: c.case_id)
def test_reference_cases_match_mlx_lm(case: Case) -> None:
    require_oracle("mlx_lm")
    eng, ref = run_trace("engine", case), run_trace("mlx_lm", case)
    verdict = compare_with_reference(eng, ref, "mlx_lm")
    assert verdict.status == "identical", f"{case.case_id}: engine vs mlx-lm\n{verdict.format()}"


@pytest.mark.parametrize("case", pipeline_cases(), ids=lambda c: c.case_id)
def test_pipeline_cases_spec_equals_plain(case: Case) -> None:
    spec, plain = run_trace("engine", case), run_trace("engine", case.plain())
    div = diff_traces(spec, plain, level="tokens")
    assert div is None, f"{case.case_id}: {div.message}"


def _top_p_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plant: the nucleus cut on the raw logits, before the processors move them."""
    from mlx_lm.sample_utils import apply_top_p

    from engine.sampler import StepSampler

    real = StepSampler.process

    def process(self: StepSampler, history: Any, logits: mx.array) -> mx.array:
        if self.params.top_p and self.params.temperature:
            logits = apply_top_p(logits - mx.logsumexp(logits, axis=-1, keepdims=True), self.params.top_p)
        return real(self, history, logits)

    monkeypatch.setattr(StepSampler, "process", process)


@pytest.mark.oracle
def test_top_p_before_processors_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: caught by a reference case with top-p and processors, at its first round;
    the pipeline cases (spec vs plain) cannot see it, which is why the reference array exists."""
    require_oracle("mlx_lm")
    _top_p_first(monkeypatch)
    caught = []
    for case in reference_cases():
        eng, ref = run_trace("engine", case), run_trace("mlx_lm", case)
        verdict = compare_with_reference(eng, ref, "mlx_lm")
        if verdict.status != "identical":
            assert case.top_p and case.processors, f"{case.case_id} diverged without both stages"
            caught.append(case.case_id)
    assert caught, "top-p before the processors was not caught by any pairwise reference case"
