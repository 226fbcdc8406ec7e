"""Engine two-model vs mlx-lm at temperature > 0, same seed, round for round.

§1/§2: drafts are sampled with the REQUEST sampler (one sampler call per draft
token) and the verify window with ONE sampler call over the ``[d+1, V]`` block,
in mlx-lm 0.32.2's order, so with the same ``mx.random.seed`` both consume the
global key identically and must agree on every round's drafts, samples,
k_accept and emitted tokens, and on usage and counters. Pair ``twin`` (real
accepts and rejections), temperatures 0.6 and 1.0, top-p / top-k off and on
(a control and one-axis variants). The default run takes, on each target, T 0.6 with top-p
and top-k off on nat-00 with seed 0 and each one-axis variant of it; the full cross product
runs nightly (``tests.helpers.one_axis``).

The oracle's recorder proxy takes ``mx.topk`` of every forward's logits for
the margins; ``test_recorder_consumes_no_randomness`` proves that does not
advance the global PRNG key (which would shift every later sample).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from conformance.conftest import matrix_prompt_ids, require_oracle, run_trace
from specparity.cases.case import Case
from tests.helpers import one_axis
from traces.diff import diff_traces

SAMPLING = [(0.0, 0), (0.9, 0), (0.0, 20), (0.9, 20)]  # (top_p, top_k)
TEMPERATURES = (0.6, 1.0)


def _targets() -> tuple[str, ...]:
    return ("llama", "qwen3")


CASES = [
    Case(t, "twin", p, 3, 24, temperature=temp, seed=seed, top_p=tp, top_k=tk)
    for t in _targets()
    for temp in TEMPERATURES
    for (tp, tk) in SAMPLING
    for p in matrix_prompt_ids(2)
    for seed in (0, 7)
]


@pytest.mark.oracle
@pytest.mark.parametrize("case", one_axis(CASES, temperature=TEMPERATURES[0], top_p=0.0, top_k=0,
                                          prompt_id="nat-00", seed=0))
def test_sampled_round_for_round(case: Case) -> None:
    require_oracle("mlx_lm")
    eng, ref = run_trace("engine", case), run_trace("mlx_lm", case)
    div = diff_traces(eng, ref, level="round")
    assert div is None, (
        f"{case.case_id}: engine vs mlx-lm at temperature {case.temperature}\n{div.message}"
    )
    assert eng.rounds, case.case_id


@pytest.mark.oracle
def test_matrix_is_random_and_rejects() -> None:
    """The matrix is not greedy in disguise: seeds change the output, drafts get rejected."""
    require_oracle("mlx_lm")
    base = CASES[0]
    outs = {tuple(run_trace("engine", replace(base, seed=s)).output_ids) for s in range(4)}
    assert len(outs) > 1, f"{base.case_id}: four seeds gave one output"
    counters = [run_trace("mlx_lm", c).footer["speculation"] for c in CASES[:8]]
    rejected = sum(s["rejected"] for s in counters)
    accepted = sum(s["accepted"] for s in counters)
    assert rejected > 0 and accepted > 0, (accepted, rejected)


@pytest.mark.oracle
def test_seed_mismatch_is_caught() -> None:
    """The round comparison catches a one-seed difference (it can fail)."""
    require_oracle("mlx_lm")
    case = CASES[0]
    other = replace(case, seed=case.seed + 1)
    div = diff_traces(run_trace("engine", case), run_trace("mlx_lm", other), level="round")
    assert div is not None, case.case_id


def test_recorder_consumes_no_randomness() -> None:
    """``oracles.recording.CallRecorder`` (mx.topk on the logits) leaves the PRNG key alone."""
    import mlx.core as mx

    import zoo
    from oracles.recording import CallRecorder
    from specparity.runners import load_model

    model = load_model(str(zoo.model_dir("llama"))).model
    proxy = CallRecorder(model, [])
    x = mx.array([[1, 2, 3]], mx.uint32)
    mx.random.seed(3)
    want = mx.random.uniform(shape=(4,))
    mx.random.seed(3)
    proxy(x)
    got = mx.random.uniform(shape=(4,))
    assert mx.array_equal(want, got).item(), (want, got)
