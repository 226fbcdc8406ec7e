"""Every two sampling stages combined, against the reference (issue 41; ``specparity/cases/pairwise.py``).

A pipeline that applies top-p before the logits processors passed every default check: no
default case set top-p and a processor together, and spec-vs-plain cannot see it (both lanes
share the pipeline). The pairwise cases combine every two stages; the reference cases are
compared with mlx-lm 0.32.2 (``generate_step`` / ``speculative_generate_step``, which apply
``make_logits_processors`` and then ``make_sampler``'s top-p, min-p and top-k on the
log-probabilities, temperature only in the categorical draw) round for round, the pipeline
cases (min_tokens and a grammar too) spec with plain decode token for token. Two plants are
caught here: top-p before the processors, and min-p on the temperature-scaled
log-probabilities (the order of HF transformers' warpers, not mlx-lm's).
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


def test_min_p_is_combined_with_each_temperature_and_stage() -> None:
    """min-p meets both temperatures (a min-p on the scaled logits differs only at T != 1), top-p,
    top-k and every processor in some reference case."""
    cases = [c for c in reference_cases() if c.min_p]
    assert {c.temperature for c in cases} == set(STAGES["temperature"])
    assert any(c.top_p for c in cases) and any(c.top_k for c in cases)
    for proc in ("rp", "pp", "fp", "lb"):
        assert any(proc in c.processors for c in cases), proc


def test_the_default_run_holds_the_pairwise_cases() -> None:
    from specparity.cli.entry import build_parser
    from specparity.commands.run import cases_from_args
    from specparity.jobs.run import zoo_cases

    assert set(pairwise_cases()) <= set(zoo_cases())
    # and `specparity run` with no flags selects them (before, its explicit default sampling
    # made zoo_cases leave them out: the default run never ran them)
    assert set(pairwise_cases()) <= set(cases_from_args(build_parser().parse_args(["run"])))
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


def _diverging_from_mlx_lm() -> list[tuple[Case, Any]]:
    """The reference cases whose engine trace is not identical to mlx-lm's (under the plant in
    place), each with its verdict."""
    out = []
    for case in reference_cases():
        verdict = compare_with_reference(run_trace("engine", case), run_trace("mlx_lm", case), "mlx_lm")
        if verdict.status != "identical":
            out.append((case, verdict))
    return out


@pytest.mark.oracle
def test_top_p_before_processors_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: caught by a reference case with top-p and processors, at its first round;
    the pipeline cases (spec vs plain) cannot see it, which is why the reference array exists."""
    require_oracle("mlx_lm")
    _top_p_first(monkeypatch)
    caught = []
    for case, _ in _diverging_from_mlx_lm():
        assert case.top_p and case.processors, f"{case.case_id} diverged without both stages"
        caught.append(case.case_id)
    assert caught, "top-p before the processors was not caught by any pairwise reference case"


def _min_p_after_temperature(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plant: min-p's threshold taken on the temperature-scaled log-probabilities (HF
    transformers' warper order: temperature, then min-p) instead of mlx-lm's unscaled ones; the
    rest of ``make_sampler``'s chain (top-p, then min-p, then top-k, then the draw) as it is."""
    import math

    from mlx_lm.sample_utils import apply_top_k, apply_top_p, categorical_sampling

    from engine.sampler import SamplerParams, StepSampler

    real = StepSampler.from_params.__func__  # type: ignore[attr-defined]

    def from_params(cls: type[StepSampler], params: SamplerParams) -> StepSampler:
        step = real(cls, params)
        if not (params.min_p and params.temperature):
            return step
        temp, top_p, top_k, min_p = params.temperature, params.top_p, params.top_k, params.min_p

        def draw(logprobs: mx.array) -> mx.array:
            if 0 < top_p < 1.0:
                logprobs = apply_top_p(logprobs, top_p)
            scaled = logprobs * (1 / temp)
            cut = mx.max(scaled, axis=-1, keepdims=True) + math.log(min_p)
            logprobs = mx.where(scaled < cut, -float("inf"), logprobs)
            if top_k > 0:
                logprobs = apply_top_k(logprobs, top_k)
            return categorical_sampling(logprobs, temp)

        step.draw_fn = draw
        return step

    monkeypatch.setattr(StepSampler, "from_params", classmethod(from_params))


@pytest.mark.oracle
def test_min_p_after_temperature_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: caught by a reference case with min-p at a temperature other than 1 (at T = 1 the
    two orders agree), with the first divergent round named; spec-vs-plain cannot see it."""
    require_oracle("mlx_lm")
    _min_p_after_temperature(monkeypatch)
    caught = []
    for case, verdict in _diverging_from_mlx_lm():
        assert case.min_p and case.temperature != 1.0, f"{case.case_id} diverged without min-p at T != 1"
        text = verdict.format()
        assert "round" in text or "step" in text, text
        caught.append(f"{case.case_id}: {text.splitlines()[0]}")
    assert caught, "min-p after temperature was not caught by any pairwise reference case"
    print("\n".join(caught))
