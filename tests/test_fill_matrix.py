"""The default tests see what the main job's fill lane sees (issue 41).

``specparity run`` (no ``--targets``/``--drafters``) runs the fill lane on
``specparity.jobs.run.fill_cases()`` — strict and echo, both syntaxes, every held-out prompt —
through ``fill_comparisons``. An echo-tier bug that only some prompts reach (an uncorroborated
copy asserted: 5 echo cases diverge) passed ``tests/test_fill.py``, whose cases are a few
hand-picked prompts, and only the main job saw it. Here the default tests run the very cases
and the very comparison function of the main job, taken from ``run()`` itself, not a copy.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest


def _main_jobs_fill_cases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The fill cases ``specparity.jobs.run.run`` hands the main job by default (captured, not rebuilt)."""
    from specparity.jobs import run as job

    got: dict[str, Any] = {}

    def capture(out_dir: Path, **kwargs: Any) -> str:
        got.update(kwargs)
        return "captured"

    monkeypatch.setattr(job, "run_cases", capture)
    monkeypatch.setattr(job, "in_run_dir", lambda out, command, work: work())
    assert job.run(tmp_path / "out", runners=["engine"]) == "captured"
    return list(got["fill_cases"])


def test_the_main_jobs_fill_lane_holds_every_tier_syntax_and_prompt(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from zoo.fill import MATRIX_PROMPTS, SYNTAXES, TIERS

    cases = _main_jobs_fill_cases(tmp_path, monkeypatch)
    assert {(c.syntax, c.tier) for c in cases} == {(s, t) for s in SYNTAXES for t in TIERS}
    assert len(cases) == len(SYNTAXES) * len(TIERS) * MATRIX_PROMPTS


def test_the_main_jobs_fill_lane_is_identical_to_plain_decode(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fill case of the main job, through the main job's own comparison: identical."""
    from specparity.jobs.run import fill_comparisons

    cases = _main_jobs_fill_cases(tmp_path, monkeypatch)
    rows, comps = fill_comparisons(cases)
    assert len(comps) == len(cases)
    bad = [c.message or f"{c.case_id}: {c.verdict}" for c in comps if c.verdict != "identical"]
    assert not bad, "\n".join(bad)


def test_an_echo_bug_only_some_prompts_reach_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: every echo copy asserted (an uncorroborated span forced without verification).
    The main job's fill lane diverges on echo cases, named at an output position inside an
    echo append; the strict tier is untouched."""
    from engine.fill.echo import EchoSource
    from specparity.jobs.run import fill_comparisons

    cases = [c for c in _main_jobs_fill_cases(tmp_path, monkeypatch) if c.tier == "echo"]
    real = EchoSource.propose

    def propose(self: EchoSource, view: Any) -> Any:
        p = real(self, view)
        return replace(p, policy="assert") if p is not None and p.policy == "verify" else p

    monkeypatch.setattr(EchoSource, "propose", propose)
    _, comps = fill_comparisons(cases)
    diverged = [c for c in comps if c.fails]
    assert diverged, "the planted echo bug was not caught by the main job's fill lane"
    first = diverged[0].divergence
    assert "fill diverges from plain decode at output token" in first.message and "echo:" in first.message
