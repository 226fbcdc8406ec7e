"""Every comparison kind the jobs can produce, enumerated from its one declaration
(``specparity.jobs.comparison.KINDS``, not a hand list), run under the CPU double configured as
the GPU measured (``engine/nonexact.py``, ``SPECPARITY_EMULATE_NONEXACT=0.01:0:0.001``: logit
and cache-write noise on every multi-token and batched forward): each kind is produced by the
job its declaration names and none reads ``logic`` (issue 39: the batched checks read ``logic``
on ``target_cache_digest`` there before they were classified by the one path).

A kind declared ``conditional`` (produced only in a named situation: a missing op on a run no
comparison needs, a sampled case no reference implements) is checked for its declaration only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from specparity.jobs.comparison import KINDS, Comparison, kind_of

# one worker builds this module's module-scoped fixture (seconds) once: `--dist loadgroup`
pytestmark = pytest.mark.xdist_group("comparison-kinds")

DOUBLE = "0.01:0:0.001"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[tuple[str, str, bool]]]]:
    """Each job once under the double: ``job -> [(kind, verdict, fails)]``."""
    from engine.batched import BatchRequest, batch_generate
    from engine.batched_check import classify_row
    from engine.executor import GenerationParams
    from engine.sources.two_model import TwoModelProvider
    from specparity.grading.trace_folders import grade
    from specparity.jobs.run import fill_cases, run_cases, zoo_cases
    from specparity.jobs.sessions import sessions_from_cases
    from specparity.runners import load_model

    tmp = tmp_path_factory.mktemp("kinds")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECPARITY_EMULATE_NONEXACT", DOUBLE)
        load_model.cache_clear()  # models loaded from here on wear the double
        try:
            cases = [c for c in zoo_cases(targets=["llama"], drafters=["twin"], gammas=(3,), n_prompts=1,
                                          max_tokens=16)
                     if c.temperature == 0 and not c.processors and not c.min_tokens and c.kv_bits is None]
            run = run_cases(tmp / "run", cases=cases[:1], runners=["mlx_lm"], progress=False,
                            fill_cases=fill_cases(max_tokens=16)[:1])
            sessions = sessions_from_cases(cases[:1], ["continue"], trace_dir=tmp / "sessions")
            graded = grade(tmp / "sessions", tmp / "graded", runners=["mlx_lm"], progress=False)
            from specparity.runners import case_paths

            tp, dp = case_paths(cases[0])
            target, drafter = load_model(str(tp)), load_model(str(dp))
            import zoo

            reqs = [BatchRequest(f"r{i}", list(zoo.prompts()[i].token_ids),
                                 GenerationParams(max_tokens=12, gamma=3, eos_ids=target.eos_ids, cache_digests=False),
                                 TwoModelProvider(drafter.model)) for i in range(2)]
            res = batch_generate(target.model, reqs)
            bench = [classify_row(target.model, reqs, r.rid, res) for r in reqs]
            yield {
                "run": [(c.kind, c.verdict, c.fails) for c in run.comparisons],
                "grade": [(c.kind, c.verdict, c.fails) for c in graded.comparisons],
                "sessions": [("warm-vs-cold", v.verdict, not v.ok) for v in sessions],
                "bench-batched": [("bench-identity", v.verdict, not v.ok) for v in bench],
            }
        finally:
            load_model.cache_clear()  # later tests load exact models


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_declared_kind_is_produced_by_its_jobs_under_the_double_without_logic(
        kind: Any, jobs: dict[str, list[tuple[str, str, bool]]]) -> None:
    if kind.conditional:
        name = kind.name.replace("<runner>", "mlx_lm").replace("<oracle>", "mlx_lm")
        assert kind_of(name) is kind and kind.judged
        return
    for job in kind.jobs:
        assert job in jobs, f"kind {kind.name!r}: job {job!r} is not run by this test: add it to the fixture"
        got = [(k, v, f) for k, v, f in jobs[job] if kind.matches(k)]
        assert got, f"job {job} produced no {kind.name!r} comparison under the double: {sorted({k for k, _, _ in jobs[job]})}"
        bad = [(k, v) for k, v, f in got if f or v.startswith("logic")]
        assert not bad, f"{job}: {kind.name} under the double: {bad}"


def test_every_comparison_a_job_made_is_declared(jobs: dict[str, list[tuple[str, str, bool]]]) -> None:
    for job, rows in jobs.items():
        for k, _, _ in rows:
            assert any(d.matches(k) and job in d.jobs for d in KINDS), f"{job} made {k!r}, declared for other jobs"


def test_an_undeclared_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="'batched-Z' is not declared"):
        Comparison("batched-Z", "c", "round", None)
    assert kind_of("engine-vs-mlx_lm").name == "engine-vs-<oracle>"
