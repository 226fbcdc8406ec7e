"""Work stopped midway: a full disk, SIGTERM, Ctrl-C or a failure while writing. The exit
status and one line say so, no verdict is left before the work is done, the last finished
run and every written file stay whole, locks are released.

What each test checks, and the catalogue of inputs: ``tests/test_hostile_catalogue.py``.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import RUN_TINY, assert_whole_files, cli, copy_run, one_error, snapshot

pytestmark = pytest.mark.usefixtures("in_tmp")


def _enospc(*_a: object, **_k: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_writing_report(tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    d = copy_run(tiny_run, tmp_path / "run")
    before = (d / "report.md").read_bytes()
    monkeypatch.setattr(os, "fsync", _enospc)
    rc, _, err = cli(["report", d], capsys)
    monkeypatch.undo()
    assert rc == 1
    one_error(err, "No space left")
    assert (d / "report.md").read_bytes() == before
    assert_whole_files(d)


def test_disk_full_during_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.jobs import run as run_mod

    out = tmp_path / "run"

    def full(path: Any, text: str) -> None:
        if Path(path).name == "comparisons.json":
            _enospc()
        from traces.io import atomic_write_text

        atomic_write_text(path, text)

    monkeypatch.setattr(run_mod, "atomic_write_text", full)
    rc, _, err = cli(["run", "--targets", "llama", "--drafters", "self", "--gammas", "1",
                      "--prompts", "1", "--max-tokens", "4", "--runners", "", "--out", out], capsys)
    assert rc == 1
    one_error(err, "No space left", "free some space")
    assert not (out / "comparisons.json").exists()
    assert_whole_files(out)
    marker = json.loads((out / ".specparity-run.json").read_text())
    assert marker["state"] == "failed"


def test_ab_prints_results_before_a_failing_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import specparity.measure.ab as ab

    def full(*_a: object, **_k: object) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ab" / "ab.json"))

    monkeypatch.setattr(ab, "write_ab", full)
    rc, out, err = cli(["ab", "--target", "llama", "--drafter-a", "self", "--drafter-b", "twin",
                        "--prompts", "2", "--allow-small", "--max-tokens", "4",
                        "--out", tmp_path / "ab"], capsys)
    assert rc == 1
    assert "A/B llama" in out and "acceptance" in out, "the verdict is printed before writing"
    one_error(err, "ab.json", "No space left", "verdict above is complete")


def test_audit_json_is_atomic_and_replaces_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "audit.json"
    argv = ["audit", "--targets", "llama", "--prompts", "1", "--max-tokens", "4", "--json", dest]
    monkeypatch.setattr(os, "fsync", _enospc)
    rc, _, err = cli(argv, capsys)
    monkeypatch.undo()
    assert rc == 1
    one_error(err, "No space left")
    assert not dest.exists() and not list(tmp_path.glob(".*.tmp")), "no 0-byte or partial file"
    assert cli(argv, capsys)[0] == 0
    assert json.loads(dest.read_text())["kind"] == "audit"
    assert cli(argv, capsys)[0] == 0, "an earlier audit's file is replaced"


def test_bench_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specparity.measure.bench import write_bench

    res = {"kind": "bench", "target": "llama", "drafter": "twin", "gamma": 3, "n_prompts": 1,
           "repeats": 1, "arms": [], "by_gamma": {}}
    monkeypatch.setattr("specparity.measure.bench.bench_markdown", lambda r: "# bench\n")
    write_bench(res, tmp_path)
    before = snapshot(tmp_path)
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(OSError):
        write_bench({**res, "gamma": 5}, tmp_path)
    monkeypatch.undo()
    assert snapshot(tmp_path) == before, "a failed write leaves the old files whole"
    assert_whole_files(tmp_path)


def _interrupt_in(monkeypatch: pytest.MonkeyPatch, target: str, exc: BaseException | None = None,
                  sig: int | None = None) -> None:
    """Make ``target`` (module:attr) raise ``exc`` or deliver ``sig`` to this process."""
    import signal

    mod, attr = target.split(":")

    def boom(*_a: object, **_k: object) -> Any:
        if sig is not None:
            os.kill(os.getpid(), sig)
            signal.sigtimedwait([], 0)  # the handler has run by now (it raises)
        raise exc  # type: ignore[misc]

    monkeypatch.setattr(__import__(mod, fromlist=[attr]), attr, boom)


def test_unfinished_runs_never_lose_the_last_finished_one(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cli.args import Terminated

    d = tmp_path / "run"
    assert cli([*RUN_TINY, "--out", d], capsys)[0] == 0
    finished = snapshot(d)
    finished_traces = sorted(k for k in finished if k.startswith("traces/"))
    for n in range(2):  # two interrupted runs in a row (Terminated: as SIGTERM would)
        with monkeypatch.context() as m:
            _interrupt_in(m, "specparity.jobs.run:numerics_witness", Terminated())
            rc, _, err = cli([*RUN_TINY, "--out", d], capsys)
        assert rc == 143, err
        kept = d / ".previous-run"
        assert "**CONFORMS**" in (kept / "summary.md").read_text(), f"after {n + 1} interrupted runs"
        assert sorted(p.relative_to(kept).as_posix() for p in kept.rglob("traces/*/*.jsonl")) \
            == finished_traces
        assert "INCOMPLETE" in (d / "summary.md").read_text()
    assert cli([*RUN_TINY, "--out", d], capsys)[0] == 0
    assert not (d / ".previous-run").exists(), "removed once a new run completed"
    assert "**CONFORMS**" in (d / "summary.md").read_text()


def _stderr_lines(err: str) -> list[str]:
    """stderr without progress, device and work-size announcement lines."""

    return [ln for ln in err.splitlines() if ln.strip()
            and not ln.startswith(("device", "bench:", "running cases", "grading"))
            and not re.match(r"specparity \w+: (grading )?\d+ ", ln)]


def _verdict_state(d: Path) -> tuple[str | None, bool, str]:
    summary = (d / "summary.md").read_text() if (d / "summary.md").exists() else None
    marker = json.loads((d / ".specparity-run.json").read_text())
    return summary, (d / "report.md").exists(), marker["state"]


@pytest.mark.parametrize("where,how,rc_want", [
    ("reports.report:_build", "error", 1),
    ("reports.report:_build", "sigterm", 143),
    ("reports.summary:tau_table", "ctrl-c", 130),
    ("reports.summary:atomic_write_text", "disk full", 1),
    ("specparity.jobs.run:atomic_write_text", "disk full", 1),
], ids=["failure in the report", "SIGTERM in the report", "Ctrl-C in the summary",
        "disk full writing summary.md", "disk full writing comparisons.json"])
def test_no_verdict_before_the_work_is_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            where: str, how: str, rc_want: int,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import signal

    d = tmp_path / "run"
    if how == "error":
        _interrupt_in(monkeypatch, where, RuntimeError("planted report failure"))
    elif how == "sigterm":
        _interrupt_in(monkeypatch, where, sig=signal.SIGTERM)
    elif how == "ctrl-c":
        _interrupt_in(monkeypatch, where, KeyboardInterrupt())
    else:
        _interrupt_in(monkeypatch, where, OSError(errno.ENOSPC, "No space left on device"))
    rc, out, err = cli([*RUN_TINY, "--out", d], capsys)
    monkeypatch.undo()
    assert rc == rc_want, err
    assert "CONFORMS" not in out
    summary, has_report, state = _verdict_state(d)
    assert state == "failed"
    assert summary is None or ("INCOMPLETE" in summary and "CONFORMS" not in summary), summary
    if how != "disk full":
        assert summary is not None and "while writing the" in summary, summary
    assert not has_report, "a report written from inside the run (it read CONFORMS) is removed"
    assert list(d.glob("traces/engine/*.jsonl")), "work kept"
    if where.startswith("specparity.jobs.run"):  # comparisons.json and the INCOMPLETE summary failed
        assert summary is None and not (d / "comparisons.json").exists()
    else:
        assert (d / "comparisons.json").exists()
    assert_whole_files(d)
    if how in ("sigterm", "ctrl-c"):
        (line,) = _stderr_lines(err)
        assert "interrupted by" in line and "summary.md says INCOMPLETE" in line, line
    rc, _, _ = cli(["report", d], capsys)
    assert rc == 1 and "**INCOMPLETE" in (d / "report.md").read_text()


SIGTERM_AT = [
    ("run", [*RUN_TINY, "--out", "{d}"], "specparity.jobs.run:run_cases"),
    ("ab", ["ab", "--target", "llama", "--drafter-a", "self", "--drafter-b", "twin", "--out", "{d}"],
     "specparity.measure.ab:run_ab"),
    ("bench", ["bench", "--out", "{d}"], "specparity.measure.bench:run_bench"),
    ("regen", ["regen", "--golden-dir", "{d}", "--case", "x", "--report", "{d}/rep"],
     "specparity.goldens.regen:_regen"),
    ("generate", ["generate", "--target", "{t}", "--prompt-ids", "5,6", "-n", "4", "--trace",
                  "{d}/t.jsonl"], "engine.executor:plain_generate"),
    ("audit", ["audit", "--targets", "llama", "--prompts", "1", "--max-tokens", "4", "--json",
               "{d}/a.json"], "specparity.commands.audit:target_figures"),
    ("grade", ["grade", "{run}/traces/engine", "--out", "{d}", "--runners", ""],
     "specparity.grading.trace_folders:_grade"),
]


@pytest.mark.parametrize("name,argv,where", SIGTERM_AT, ids=[s[0] for s in SIGTERM_AT])
def test_sigterm_is_one_line_and_143(tiny_run: Path, zoo_pair: tuple[Path, Path], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch, name: str, argv: list[str],
                                     where: str, capsys: pytest.CaptureFixture[str]) -> None:
    import signal

    d = tmp_path / "out"
    _interrupt_in(monkeypatch, where, sig=signal.SIGTERM)
    argv = [str(a).replace("{d}", str(d)).replace("{t}", str(zoo_pair[0])).replace("{run}", str(tiny_run))
            for a in argv]
    rc, _, err = cli(argv, capsys)
    monkeypatch.undo()
    assert rc == 143, err
    lines = _stderr_lines(err)
    assert len(lines) == 1 and f"specparity {name}: interrupted by SIGTERM" in lines[0], err
    assert "Traceback" not in err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "handler restored"
    if d.exists():
        assert not list(d.rglob(".specparity.lock")), "lock released"
        assert_whole_files(d)
        for marker in d.rglob(".specparity-run.json"):
            assert json.loads(marker.read_text())["state"] != "running"
    assert not (d / "t.jsonl").exists() and not (d / "a.json").exists()
