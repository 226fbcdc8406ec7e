"""``reports.report`` / ``specparity report``: tables, plots, HTML, and the ways it fails."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from reports import tables
from reports.report import ReportError, build_report
from specparity.cli import main

# one worker builds this module's module-scoped fixture (seconds) once: `--dist loadgroup`
pytestmark = pytest.mark.xdist_group("reports-report")

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from specparity.jobs.run import run

    out = tmp_path_factory.mktemp("run")
    run(out, targets=["llama"], drafters=["self", "small"], gammas=(1, 2), n_prompts=1,
        max_tokens=8, runners=[])
    return out


def _ab_json(ratio_median: float) -> dict:
    iv = {"n": 32, "median": ratio_median, "low": ratio_median - 0.05,
          "high": ratio_median + 0.05, "confidence": 0.95, "method": "percentile"}
    return {"kind": "ab", "target": "llama", "drafter_a": "twin", "drafter_b": "small",
            "gamma": 3, "n_prompts": 32,
            "verdict": {"verdict": "FAIL", "passes": False,
                        "reasons": ["acceptance: DROP (planted)", "wall clock: B SLOWER"],
                        "acceptance": {"table": {"a": 1, "b": 40, "c": 0, "d": 9},
                                       "test": "exact binomial", "p_one_sided": 1e-12}},
            "ratios": {"wall_time_b_over_a": iv},
            "arms": [{"arm": "A", "drafter": "twin", "acceptance": 0.5},
                     {"arm": "B", "drafter": "small", "acceptance": 0.0}]}


def test_run_writes_report(run_dir: Path) -> None:
    md = (run_dir / "report.md").read_text()
    assert (run_dir / "summary.md").is_file()
    assert "Acceptance by draft position" in md and "report_files/plot1.png" in md, md[:500]
    html = (run_dir / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3, "three plots embedded"
    assert "<table" in html and "report_files/" not in html  # self-contained


def test_tables_match_counters(run_dir: Path) -> None:
    data = tables.load_run(run_dir)
    tau = tables.tau_table(data.traces).set_index(["drafter", "gamma"])
    # self drafter: every draft accepted, tau = gamma + 1 unless the budget cuts a round
    assert tau.loc[("self", 1), "acceptance"] == 1.0, tau
    assert tau.loc[("self", 1), "tau"] == 2.0, tau
    assert tau.loc[("small", 2), "acceptance"] == 0.0 and tau.loc[("small", 2), "tau"] == 1.0, tau
    by_pos = tables.acceptance_by_position(data.traces)
    sel = by_pos[(by_pos["drafter"] == "self") & (by_pos["gamma"] == 2)]
    assert list(sel["position"]) == [1, 2] and set(sel["acceptance"]) == {1.0}, sel
    lengths = tables.acceptance_lengths(data.traces)
    small = lengths[lengths["drafter"] == "small"]
    assert set(small["k_accept"]) == {0}, small


def test_report_includes_ab_results(run_dir: Path, tmp_path: Path) -> None:
    (run_dir / "ab").mkdir(exist_ok=True)
    (run_dir / "ab" / "ab.json").write_text(json.dumps(_ab_json(1.3)))
    try:
        rep = build_report(run_dir)
        md = rep.markdown.read_text()
        # names from JSON are Markdown-escaped (reports/md.py): wall\_time... renders as wall_time...
        assert "Paired A/B and bench" in md and r"wall\_time\_b\_over\_a" in md, md
        assert "**FAIL**" in md and "planted" in md
        assert rep.html.read_text().count("data:image/png;base64,") == 4
    finally:
        (run_dir / "ab" / "ab.json").unlink()


def test_cli_report_prints_summary(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "tau" in out and "speedup_vs_plain" not in out and "tok_per_s" not in out, out


def test_missing_run_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ReportError, match="no traces"):
        build_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 1
    assert "cannot read run" in capsys.readouterr().err


def test_corrupt_trace_fails(run_dir: Path, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(run_dir / "traces", bad / "traces")
    victim = next((bad / "traces" / "engine").glob("*.jsonl"))
    victim.write_text(victim.read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(ReportError, match="cannot read run"):
        build_report(bad)


def test_report_failure_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from reports import plots
    from specparity.jobs.run import run

    def boom(*_a: object) -> bytes:
        raise RuntimeError("planted plot failure")

    monkeypatch.setattr(plots, "tau_by_gamma", boom)
    with pytest.raises(ReportError, match="planted plot failure"):
        run(tmp_path, targets=["llama"], drafters=["self"], gammas=(1,), n_prompts=1,
            max_tokens=4, runners=[])
