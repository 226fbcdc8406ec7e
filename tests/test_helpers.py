"""Tests of the shared test helpers (``tests/helpers.py``): a helper that passed what it should
refuse would pass every test built on it, so each check is shown catching a planted fault."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests import helpers as h

# ------------------------------------------------------------------------------ the CLI


def test_cli_stringifies_and_captures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    print("left over from before")
    capsys.readouterr()
    rc, out, err = h.cli(["trace", "validate", tmp_path / "missing.jsonl"], capsys)
    assert rc == 1 and str(tmp_path / "missing.jsonl") in out and "No such file" in out, (rc, out, err)
    assert capsys.readouterr() == ("", ""), "the helper drains what it read"


def test_cli_rc_returns_the_exit_status(tmp_path: Path) -> None:
    assert h.cli_rc("nosuch-command") == 2
    assert h.cli_rc("trace", "validate", tmp_path) == 1  # a Path argument: str()-ed


def test_cli_command_and_env_run_this_checkout() -> None:
    assert h.cli_command("run", Path("x"), 3) == [sys.executable, "-m", "specparity.cli", "run", "x", "3"]
    env = h.cli_env(EXTRA="1")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(h.ROOT) and env["EXTRA"] == "1"
    assert (h.ROOT / "specparity" / "cli" / "entry.py").is_file()


def test_cli_process_is_a_fresh_interpreter(tmp_path: Path) -> None:
    p = h.cli_process(["nosuch-command"], cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert h.one_error(p.stderr, "nosuch-command")


def test_one_error_accepts_one_line_and_returns_it() -> None:
    err = "progress 1/2\nspecparity run: error: --gammas: bad value '0'\n"
    assert h.one_error(err, "--gammas", "'0'") == "specparity run: error: --gammas: bad value '0'"


@pytest.mark.parametrize("err,must", [
    ("specparity run: error: a\nspecparity run: error: b\n", ()),
    ("", ()),
    ("Traceback (most recent call last):\nspecparity: error: x\n", ()),
    ("specparity: internal error: KeyError: 'x'\n", ()),
    ("specparity run: error: --gammas: bad\n", ("--max-tokens",)),
], ids=["two lines", "no line", "traceback", "internal error", "flag not named"])
def test_one_error_catches_each_planted_fault(err: str, must: tuple[str, ...]) -> None:
    with pytest.raises(AssertionError):
        h.one_error(err, *must)


def test_refused_wants_exit_status_2() -> None:
    assert h.refused(2, "specparity: error: x\n", "x")
    with pytest.raises(AssertionError):
        h.refused(1, "specparity: error: x\n", "x")


def test_no_jobs_stops_every_job(no_jobs: None) -> None:
    import specparity.goldens.regen
    import specparity.jobs.run
    import specparity.measure.ab
    import specparity.measure.bench

    for fn in (specparity.jobs.run.run_cases, specparity.measure.ab.run_ab, specparity.measure.bench.run_bench,
               specparity.goldens.regen.regen):
        with pytest.raises(AssertionError, match="the job started"):
            fn()


def test_captured_keeps_the_job_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          captured: list[dict]) -> None:
    rc, _, err = h.cli([*h.RUN_TINY, "--out", tmp_path / "o"], capsys)
    assert rc == 1 and "JobStarted" in err, err  # the CLI names the stub's exception
    (job,) = captured
    assert job["out"] == tmp_path / "o"
    assert [c.case_id for c in job["cases"]] == ["llama/self/nat-00/g1/n4"]


# ------------------------------------------------------------------------------ matrices


def test_one_axis_keeps_the_control_and_each_single_axis_variant() -> None:
    import itertools
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class C:
        target: str
        gamma: int
        prompt_id: str

        @property
        def case_id(self) -> str:
            return f"{self.target}/g{self.gamma}/{self.prompt_id}"

    cases = [C(t, g, p) for t, g, p in itertools.product(("a", "b"), (1, 3, 5), ("p0", "p1"))]
    params = h.one_axis(cases, target=("a", "b"), gamma=3, prompt_id="p0")
    assert [p.id for p in params] == [c.case_id for c in cases], "every case kept, ids unchanged"
    default = [p.values[0].case_id for p in params if not p.marks]
    assert default == ["a/g1/p0", "a/g3/p0", "a/g3/p1", "a/g5/p0", "b/g1/p0", "b/g3/p0", "b/g3/p1", "b/g5/p0"]
    heavy = [p for p in params if p.marks]
    assert len(heavy) == 4 and all({m.name for m in p.marks} == {"slow", "heavy"} for p in heavy)
    assert {c.gamma for c in cases} == {p.values[0].gamma for p in params if not p.marks}, "every value by default"


# ------------------------------------------------------------------------------ zoo models


def test_zoo_fixtures(zoo_pair: tuple[Path, Path], tiny_run: Path) -> None:
    import zoo

    assert zoo_pair == zoo.pair("llama", "twin") and all((d / "config.json").is_file() for d in zoo_pair)
    assert json.loads((tiny_run / ".specparity-run.json").read_text())["state"] == "complete"
    assert h.read_records(h.engine_trace(tiny_run, "spec"))[0]["mode"] == "spec"
    assert h.read_records(h.engine_trace(tiny_run, "plain"))[0]["mode"] == "plain"
    with pytest.raises(AssertionError, match="no grammar trace"):
        h.engine_trace(tiny_run, "grammar")
    h.assert_whole_files(tiny_run)


def test_loaded_models_are_the_cached_ones() -> None:
    import zoo
    from specparity.runners import load_model

    t, d = h.load_zoo_pair("llama")
    assert t is load_model(str(zoo.model_dir("llama"))) and d is load_model(str(zoo.model_dir("llama-twin")))
    assert h.load_zoo("llama") is t


def test_in_tmp_changes_directory(in_tmp: Path, tmp_path: Path) -> None:
    assert in_tmp == tmp_path and Path.cwd() == tmp_path


# ------------------------------------------------------------------------------ files


def test_copy_run_leaves_the_lock(tiny_run: Path, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / ".specparity.lock").write_text("pid")
    (tmp_path / "src" / "a.txt").write_text("a")
    d = h.copy_run(tmp_path / "src", tmp_path / "dst")
    assert sorted(p.name for p in d.iterdir()) == ["a.txt"]


def test_records_round_trip(tmp_path: Path) -> None:
    recs = [{"type": "header", "n": 1}, {"type": "plain", "ids": [1, 2]}]
    h.write_records(tmp_path / "t.jsonl", recs)
    assert h.read_records(tmp_path / "t.jsonl") == recs
    (tmp_path / "t.jsonl").write_text((tmp_path / "t.jsonl").read_text() + "\n  \n")
    assert h.read_records(tmp_path / "t.jsonl") == recs


@pytest.mark.parametrize("plant,words", [
    (lambda d: (d / "empty.md").write_text(""), "0-byte file under a final name"),
    (lambda d: (d / "bad.json").write_text("{no"), "Expecting"),
    (lambda d: (d / ".half.tmp").write_text("x"), "temp files left behind"),
    (lambda d: (d / "t.jsonl").write_text('{"type": "plain"}\n'), "t.jsonl"),
], ids=["0-byte", "bad JSON", "temp file", "invalid trace"])
def test_assert_whole_files_catches_each_planted_fault(tiny_run: Path, tmp_path: Path, plant, words: str) -> None:  # noqa: ANN001
    d = h.copy_run(tiny_run, tmp_path / "run")
    h.assert_whole_files(d)
    plant(d)
    with pytest.raises((AssertionError, ValueError), match=words):
        h.assert_whole_files(d)


def test_assert_whole_files_allows_a_killed_writers_temp_file(tmp_path: Path) -> None:
    (tmp_path / ".x.tmp").write_text("half")
    h.assert_whole_files(tmp_path, killed_writers=True)


def test_user_dir_and_snapshot(tmp_path: Path) -> None:
    before = h.user_dir(tmp_path / "u", ["notes.txt", "traces/engine/a.jsonl"])
    assert before == {"notes.txt": b"user file 0: notes.txt\n",
                      "traces/engine/a.jsonl": b"user file 1: traces/engine/a.jsonl\n"}
    (tmp_path / "u" / "link").symlink_to(tmp_path / "u" / "notes.txt")
    assert h.snapshot(tmp_path / "u") == before, "links are not followed"
    (tmp_path / "u" / "notes.txt").write_text("changed")
    assert h.snapshot(tmp_path / "u") != before


def test_fifo_guard_sees_an_open_and_only_an_open(tmp_path: Path) -> None:
    quiet, opened = tmp_path / "quiet", tmp_path / "opened"
    os.mkfifo(quiet)
    os.mkfifo(opened)
    r = os.open(opened, os.O_RDONLY | os.O_NONBLOCK)  # "the code under test opened it"
    try:
        ev_quiet, ev_opened = h.fifo_guard(quiet, after_s=0.01), h.fifo_guard(opened, after_s=0.01)
        assert ev_opened.wait(10), "an opened FIFO is reported"
        time.sleep(0.2)
        assert not ev_quiet.is_set(), "a FIFO nobody opened is not"
    finally:
        os.close(r)
        os.close(os.open(quiet, os.O_RDONLY | os.O_NONBLOCK))  # release the guard's blocked writer


# ------------------------------------------------------------------------------ the suites' layout


def test_no_module_name_in_both_suites() -> None:
    """A basename in both ``tests/`` and ``conformance/`` hides which one a report names: each
    module is named by what it tests (``conformance/``: against a reference or plain decode)."""
    names = {d: {p.name for p in (h.ROOT / d).glob("*.py")} for d in ("tests", "conformance")}
    both = sorted(names["tests"] & names["conformance"] - {"__init__.py", "conftest.py"})
    assert not both, f"in both tests/ and conformance/: {both}"
