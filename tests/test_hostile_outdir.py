"""Hostile output destinations: a locked, foreign or non-directory ``--out``, a user's files
under the names specparity writes, symlinks and devices in place of outputs, an earlier
run's leftovers. No input deletes or overwrites a file no specparity command wrote.

What each test checks, and the catalogue of inputs: ``tests/test_hostile_catalogue.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    RUN_TINY,
    assert_whole_files,
    cli,
    copy_run,
    engine_trace,
    one_error,
    read_records,
    snapshot,
    user_dir,
    write_records,
)

pytestmark = pytest.mark.usefixtures("in_tmp")


def test_second_run_into_locked_out_is_refused(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cli.outdir import DirLock

    out = tmp_path / "run"
    out.mkdir()
    with DirLock(out, "another run"):
        rc, _, err = cli(["run", "--targets", "llama", "--drafters", "self", "--gammas", "1",
                          "--prompts", "1", "--max-tokens", "4", "--out", out], capsys)
    assert rc == 2
    one_error(err, str(out), "another specparity process", "another run")
    assert not (out / "traces").exists()


def test_second_regen_on_locked_golden_dir_is_refused(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cli.outdir import DirLock

    gdir = tmp_path / "golden"
    gdir.mkdir()
    with DirLock(gdir, "specparity regen --runner engine"):
        rc, _, err = cli(["regen", "--golden-dir", gdir, "--case", "nothing-matches",
                          "--report", tmp_path / "rep"], capsys)
    assert rc == 2
    one_error(err, "--golden-dir", "golden directory")
    assert not (gdir / "manifest.json").exists()


def test_rerun_clears_stale_rows(tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An earlier run's rows (listed in its marker) are set aside; a file no run wrote is refused
    (it is never moved or deleted), so no stale row reaches the report either way."""
    d = copy_run(tiny_run, tmp_path / "run")
    stale = d / "traces" / "engine" / "stale__case.jsonl"
    recs = read_records(engine_trace(d, "plain"))
    recs[0]["case_id"] = "qwen3/plain/STALE-ROW/n4"
    write_records(stale, recs)
    argv = ["run", "--targets", "llama", "--drafters", "self", "--gammas", "1", "--prompts", "1",
            "--max-tokens", "4", "--runners", "", "--out", d]
    rc, _, err = cli(argv, capsys)
    assert rc == 2, err
    one_error(err, "stale__case.jsonl", "no specparity command wrote")
    assert stale.exists() and "STALE-ROW" not in (d / "report.md").read_text()
    marker = json.loads((d / ".specparity-run.json").read_text())
    marker["files"].append("traces/engine/stale__case.jsonl")  # now the earlier run wrote it
    (d / ".specparity-run.json").write_text(json.dumps(marker))
    rc, _, err = cli(argv, capsys)
    assert rc == 0, err
    assert "moved to .previous-run/" in err
    assert not stale.exists() and not (d / ".previous-run").exists()
    assert "STALE-ROW" not in (d / "report.md").read_text()
    assert_whole_files(d)


def test_unwritable_outputs_refused_before_work(tmp_path: Path, no_jobs: None,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    for argv in (["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small",
                  "--out", afile],
                 ["bench", "--out", afile / "sub"],
                 ["run", "--targets", "llama", "--out", afile / "sub"],
                 ["regen", "--report", afile / "sub", "--case", "llama/*"],
                 ["regen", "--golden-dir", afile, "--case", "llama/*"]):
        rc, out, err = cli(argv, capsys)
        assert rc == 2, err
        one_error(err, afile.name)  # long paths are shortened in the middle (xdist tmp dirs), the name stays
        assert "prompts" not in err and out == "", "refused before any measurement"
    assert afile.read_text() == "keep me"


def test_device_and_symlink_destinations_are_not_replaced(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """An atomic rename over /dev/null (or a FIFO) would destroy the device node: written in place."""
    import stat

    from traces.io import atomic_write_text

    real = tmp_path / "real.jsonl"
    real.write_text(json.dumps({"type": "header", "schema_version": 1}) + "\n")  # an earlier trace
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    for dest in ("/dev/null", link):
        rc, _, err = cli(["generate", "--target", zoo_pair[0], "-n", "4", "--prompt-ids", "5,6",
                          "--trace", dest], capsys)
        assert rc == 0, err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode), "/dev/null was replaced"
    assert link.is_symlink() and read_records(real)[0]["type"] == "header"
    atomic_write_text("/dev/null", "x")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_out_dot_in_a_checkout_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          no_jobs: None) -> None:
    checkout = tmp_path / "checkout"
    before = user_dir(checkout, ["traces/__init__.py", "traces/io.py", "summary.md", "report.md",
                                 "comparisons.json", "report_files/logo.png", "README.md"])
    os.chdir(checkout)
    rc, out, err = cli([*RUN_TINY, "--out", "."], capsys)
    assert rc == 2, err
    one_error(err, "--out", "no specparity command wrote", "nothing was moved or deleted")
    assert snapshot(checkout) == before
    assert not (checkout / ".previous-run").exists() and not (checkout / ".specparity-run.json").exists()


@pytest.mark.parametrize("names", [["notes.txt"], ["report_files/x.png"], ["traces/engine/mine.jsonl"],
                                   [".previous-run/keep.txt"]],
                         ids=["notes.txt", "report_files/x.png", "a trace of mine", ".previous-run"])
def test_run_into_a_finished_run_with_user_files_is_refused(
        tiny_run: Path, tmp_path: Path, names: list[str], capsys: pytest.CaptureFixture[str],
        no_jobs: None) -> None:
    d = copy_run(tiny_run, tmp_path / "run")
    user_dir(d, names)
    before = snapshot(d)
    rc, _, err = cli([*RUN_TINY, "--out", d], capsys)
    assert rc == 2, err
    one_error(err, str(d), names[0].split("/")[0])
    assert snapshot(d) == before


@pytest.mark.parametrize("user", [None, "notes.txt", "summary.md"])
def test_run_dir_of_an_older_specparity(tiny_run: Path, tmp_path: Path, user: str | None,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A run directory whose marker predates file lists: its outputs are recognised by content
    (moved aside as before); anything else, even under an output's name, is refused."""
    d = copy_run(tiny_run, tmp_path / "run")
    marker = json.loads((d / ".specparity-run.json").read_text())
    del marker["files"], marker["added"]
    (d / ".specparity-run.json").write_text(json.dumps(marker))
    if user is not None:
        (d / user).write_text("a user's own file\n")
    before = snapshot(d)
    rc, _, err = cli([*RUN_TINY, "--out", d], capsys)
    if user is None:
        assert rc == 0 and "moved to .previous-run/" in err, err
        return
    assert rc == 2, err
    one_error(err, user, "no specparity command wrote")
    assert snapshot(d) == before


def test_listed_output_replaced_by_a_symlink_is_not_written_through(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_jobs: None) -> None:
    from specparity.cli.outdir import add_outputs

    d = tmp_path / "bench"
    with add_outputs(d, "test") as claim:
        (claim.track(d / "bench.json")).write_text("{}")
    (d / "bench.json").unlink()
    secret = tmp_path / "secret.txt"
    secret.write_text("mine\n")
    (d / "bench.json").symlink_to(secret)
    rc, _, err = cli(["bench", "--out", d], capsys)
    assert rc == 2, err
    one_error(err, "bench.json", "symbolic link")
    assert secret.read_text() == "mine\n"


def test_run_out_a_big_folder_is_refused_without_walking_it_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_jobs: None) -> None:
    """``--out ~``: refused after the first 1000 foreign files, the rest never walked."""
    from traces import outdir

    home = tmp_path / "home"
    for i in range(30):
        user_dir(home / f"d{i:02d}", [f"f{j}.txt" for j in range(50)])
    seen: list[str] = []
    walk = outdir._inventory

    def counting(directory: Path) -> Any:
        for rel in walk(directory):
            seen.append(rel)
            yield rel

    monkeypatch.setattr(outdir, "_inventory", counting)
    rc, _, err = cli([*RUN_TINY, "--out", home], capsys)
    assert rc == 2, err
    one_error(err, "1000+ file(s) no specparity command wrote")
    assert len(seen) == outdir.FOREIGN_SCAN_LIMIT < 1500


def test_grade_out_with_user_files_is_refused(tiny_run: Path, tmp_path: Path, no_jobs: None,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "graded"
    before = user_dir(out, ["summary.md", "traces/engine/x.jsonl"])
    rc, _, err = cli(["grade", tiny_run / "traces" / "engine", "--out", out, "--runners", ""], capsys)
    assert rc == 2, err
    one_error(err, str(out), "no specparity command wrote")
    assert snapshot(out) == before


@pytest.mark.parametrize("name", ["report.md", "report.html"])
def test_report_never_overwrites_a_users_report(tiny_run: Path, tmp_path: Path, name: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "folder"
    d.mkdir()
    shutil.copy(engine_trace(tiny_run, "spec"), d / "t.jsonl")
    before = user_dir(d, [name])
    rc, _, err = cli(["report", d], capsys)
    assert rc == 2, err
    one_error(err, name, "not written by specparity")
    assert snapshot(d) == before
    (d / name).unlink()  # without it, the report is written and listed as ours; a re-report is fine
    assert cli(["report", d], capsys)[0] == 1  # INCOMPLETE: a folder without comparisons
    assert cli(["report", d], capsys)[0] == 1
    assert "report.md" in json.loads((d / ".specparity-run.json").read_text())["files"]


def _a_subject() -> str:
    from subjects import SUBJECTS

    return next(iter(SUBJECTS))


FOLDER = "no specparity command wrote"  # an --out the command owns: the folder is refused
BESIDE = "not written by specparity"  # files written beside others: the one file is refused


@pytest.mark.parametrize("argv,name,msg", [
    (["bench", "--out", "{d}"], "bench.json", FOLDER),
    (["grade", "--engine", "{subject}", "--out", "{d}"], "{subject}.json", BESIDE),
    (["grade", "--engine", "{subject}", "--out", "{d}"], "scoreboard.md", BESIDE),
    (["grade", "--serve", "fake", "--model", "llama", "--out", "{d}"], "scoreboard.html", BESIDE),
    (["regen", "--case", "nothing-matches", "--golden-dir", "{d}", "--report", "{d}/rep"],
     "manifest.json", "not goldens"),
    (["regen", "--case", "nothing-matches", "--golden-dir", "{d}", "--report", "{d}/rep"],
     "engine/.x.tmp", "not goldens"),
    (["ab", "--target", "llama", "--drafter-a", "self", "--drafter-b", "twin", "--out", "{d}"], "ab.md",
     FOLDER),
    (["regen", "--case", "nothing-matches", "--report", "{d}"], "drift.md", FOLDER),
], ids=["bench", "grade --engine NAME.json", "grade --engine scoreboard.md",
         "grade --serve scoreboard.html",
         "regen --golden-dir manifest.json", "regen --golden-dir .x.tmp", "ab", "regen --report"])
def test_named_outputs_never_overwrite_user_files(tmp_path: Path, argv: list[str], name: str, msg: str,
                                                  capsys: pytest.CaptureFixture[str],
                                                  no_jobs: None) -> None:
    d = tmp_path / "out"
    name = name.replace("{subject}", _a_subject())
    before = user_dir(d, [name])
    rc, out, err = cli([a.replace("{d}", str(d)).replace("{subject}", _a_subject())
                        for a in argv], capsys)
    assert rc == 2, err
    one_error(err, name, msg)
    assert snapshot(d) == before
    assert not (d / ".specparity.lock").exists(), "lock released"


def test_record_out_never_overwrites_user_files(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "rec"
    argv = ["record", "--runner", "engine", "--target", zoo_pair[0], "--prompt-ids", "5,6", "-n", "4",
            "--out", d]
    assert cli(argv, capsys)[0] == 0
    assert cli(argv, capsys)[0] == 0, "our own trace is replaced"
    (trace,) = (d / "engine").glob("*.jsonl")
    user = tmp_path / "user"  # the same name in a folder of the user's
    (user / "engine").mkdir(parents=True)
    (user / "engine" / trace.name).write_text("my own notes\n")
    before = snapshot(user)
    rc, _, err = cli([*argv[:-1], user], capsys)
    assert rc == 2, err
    one_error(err, trace.name, FOLDER)
    assert snapshot(user) == before


@pytest.mark.parametrize("cmd", ["audit", "generate", "generate via symlink"])
def test_single_output_files_never_overwrite_user_files(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                         cmd: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    user = tmp_path / "mine.json"
    user.write_text('{"my": "data"}\n')
    dest = user
    if cmd == "generate via symlink":
        dest = tmp_path / "link.jsonl"
        dest.symlink_to(user)
    argv = (["audit", "--targets", "llama", "--prompts", "1", "--max-tokens", "4", "--json", dest]
            if cmd == "audit" else
            ["generate", "--target", zoo_pair[0], "--prompt-ids", "5,6", "-n", "4", "--trace", dest])
    rc, out, err = cli(argv, capsys)
    assert rc == 2, err
    one_error(err, "--json" if cmd == "audit" else "--trace", "refusing to overwrite")
    assert user.read_text() == '{"my": "data"}\n' and out == ""


def test_every_dir_writing_command_leaves_user_files(tiny_run: Path, zoo_pair: tuple[Path, Path],
                                                     tmp_path: Path, no_jobs: None,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The invariant: whatever a command does (refuse, fail, run), user files keep every byte."""
    names = ["traces/engine/a.jsonl", "traces/__init__.py", "summary.md", "comparisons.json",
             "report.md", "report.html", "report_files/plot1.png", "bench.json", "bench.md",
             "ab.json", "ab.md", "drift.json", "drift.md", "engine/x.jsonl", ".previous-run/x",
             "notes.txt"]
    commands = [
        [*RUN_TINY, "--out", "{d}"],
        ["grade", tiny_run / "traces" / "engine", "--out", "{d}", "--runners", ""],
        ["report", "{d}"],
        ["bench", "--out", "{d}"],
        ["ab", "--target", "llama", "--drafter-a", "self", "--drafter-b", "twin", "--out", "{d}"],
        ["regen", "--case", "nothing-matches", "--report", "{d}"],
        ["record", "--runner", "engine", "--target", zoo_pair[0], "--prompt-ids", "5,6", "-n", "4",
         "--out", "{d}"],
        ["grade", "--engine", _a_subject(), "--out", "{d}"],
        ["grade", "--serve", "fake", "--model", "llama", "--out", "{d}"],
        ["regen", "--case", "nothing-matches", "--golden-dir", "{d}", "--report", "{d}/rep"],
    ]
    for i, argv in enumerate(commands):
        d = tmp_path / f"d{i}"
        before = user_dir(d, names)
        rc, _, err = cli([str(a).replace("{d}", str(d)) for a in argv], capsys)
        assert "Traceback" not in err, err
        after = snapshot(d)
        assert {k: after.get(k) for k in before} == before, (argv[0], err)


def test_files_added_to_a_run_dir_survive_the_next_run(tiny_run: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """bench/ab/record files put into a run directory are ours (listed as added): a later run
    neither refuses the directory nor moves them."""
    from specparity.cli.outdir import add_outputs

    d = copy_run(tiny_run, tmp_path / "run")
    with add_outputs(d, "specparity ab") as claim:
        claim.track(d / "ab.md").write_text("# A/B\n")
    rc, _, err = cli([*RUN_TINY, "--out", d], capsys)
    assert rc == 0, err
    assert (d / "ab.md").read_text() == "# A/B\n"
    assert "ab.md" in json.loads((d / ".specparity-run.json").read_text())["added"]


# ------------------------------------------------------------------ every writer, from the parser

NOT_WRITERS = {"grade dir": "the traces it grades (read, never written)", "regen --accept": "a switch"}
"""Flags whose name looks like an output but that write nothing (the sweep's only exceptions)."""
_OUTPUTISH = r"\bout\b|-out|report|json|trace|golden|dump|save|write|dir"
_SCOPES = {"dir": ("run", "folder", "goldens"), "file": ("file",), "beside": ("beside",)}


def writing_flags() -> dict[str, str]:
    """``"command flag"`` -> its type's output kind (``dir``/``file``/``beside``) for every flag
    of the CLI parser that names where a command writes; ``UNDECLARED`` for a flag whose name
    says output but whose type is not one of ``specparity.cli.args``' output types."""
    import argparse
    import re

    from specparity.cli.entry import build_parser

    found: dict[str, str] = {}

    def walk(parser: argparse.ArgumentParser, prefix: list[str]) -> None:
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, [*prefix, name])
                continue
            if isinstance(a, argparse._HelpAction):
                continue
            key = " ".join([*prefix, a.option_strings[-1] if a.option_strings else a.dest])
            kind = getattr(a.type, "output", None)
            if kind is not None:
                found[key] = kind
            elif re.search(_OUTPUTISH, f"{' '.join(a.option_strings)} {a.dest}", re.I) \
                    and key not in NOT_WRITERS:
                found[key] = "UNDECLARED"

    walk(build_parser(), [])
    return found


def test_every_writing_flag_uses_the_ownership_mechanism() -> None:
    """A new flag that writes must take one of the output types and be declared in
    ``specparity.cli.outdir.WRITERS`` (then the sweeps below plant its inputs)."""
    from specparity.cli.outdir import WRITERS

    found = writing_flags()
    undeclared = sorted(k for k, v in found.items() if v == "UNDECLARED")
    assert not undeclared, f"{undeclared}: give these an output type (specparity.cli.args) or list them in NOT_WRITERS"
    assert set(found) == set(WRITERS), (sorted(set(found) ^ set(WRITERS)))
    for key, kind in found.items():
        assert WRITERS[key] in _SCOPES[kind], (key, kind, WRITERS[key])
    assert set(SWEEP_WRITERS) == set(WRITERS), sorted(set(WRITERS) - set(SWEEP_WRITERS))


SESSIONS_SUITE = """sessions = ["prefix"]
gammas = [2]
max_tokens = 4
zoo_prompts = 2
[[pair]]
target = "llama"
drafter = "twin"
"""


def sweep(zoo_pair: tuple[Path, Path], tiny_run: Path, tmp: Path) -> list[tuple[str, str, list[Any]]]:
    """``(writer, id, argv)``: every writing flag in every mode, small and fast; ``{d}`` the
    destination (a folder, or a file for the ``file`` writers)."""
    t = zoo_pair[0]
    suite = tmp / "sessions.toml"
    suite.write_text(SESSIONS_SUITE)
    gen = ["--target", t, "--prompt-ids", "5,6", "-n", "4"]
    return [
        ("run --out", "run", [*RUN_TINY, "--out", "{d}"]),
        ("run --out", "run --sessions (suite)", ["run", "--suite", suite, "--out", "{d}"]),
        ("run --out", "run --sessions (zoo)", ["run", "--sessions", "--targets", "llama", "--max-tokens",
                                               "4", "--out", "{d}"]),
        ("grade --out", "grade", ["grade", tiny_run / "traces" / "engine", "--runners", "", "--out", "{d}"]),
        ("bench --out", "bench", ["bench", "--prompts", "1", "--repeats", "1", "--max-tokens", "4",
                                  "--out", "{d}"]),
        ("ab --out", "ab", ["ab", "--target", "llama", "--drafter-a", "self", "--drafter-b", "twin",
                            "--prompts", "2", "--allow-small", "--max-tokens", "4", "--out", "{d}"]),
        ("record --out", "record --out", ["record", "--runner", "engine", *gen, "--out", "{d}"]),
        ("regen --report", "regen --report", ["regen", "--case", "nothing-matches", "--report", "{d}"]),
        ("regen --golden-dir", "regen --golden-dir", ["regen", "--case", "nothing-matches", "--golden-dir",
                                                      "{d}", "--report", tmp / "drift"]),
        ("report run_dir", "report", ["report", "{d}"]),
        ("generate --trace", "generate --trace", ["generate", *gen, "--trace", "{d}"]),
        ("record --trace", "record --trace", ["record", "--runner", "engine", *gen, "--trace", "{d}"]),
        ("audit --json", "audit --json", ["audit", "--targets", "llama", "--prompts", "1", "--max-tokens",
                                          "4", "--json", "{d}"]),
    ]


SWEEP_WRITERS = ("run --out", "grade --out", "bench --out", "ab --out", "record --out", "regen --report",
                 "regen --golden-dir", "report run_dir", "generate --trace", "record --trace",
                 "audit --json")
SWEEP_IDS = ["run", "run --sessions (suite)", "run --sessions (zoo)", "grade", "bench", "ab", "record --out",
             "regen --report", "regen --golden-dir", "report", "generate --trace", "record --trace",
             "audit --json"]


def _argv(argv: list[Any], d: Path) -> list[str]:
    return [str(a).replace("{d}", str(d)) for a in argv]


def _variant(zoo_pair: tuple[Path, Path], tiny_run: Path, tmp: Path, which: str) -> tuple[str, list[Any]]:
    (writer, argv), = [(w, a) for w, i, a in sweep(zoo_pair, tiny_run, tmp) if i == which]
    return writer, argv


@pytest.mark.parametrize("which", SWEEP_IDS)
def test_sweep_a_foreign_file_is_refused(which: str, zoo_pair: tuple[Path, Path], tiny_run: Path,
                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every writer: a destination holding a file no specparity command wrote is one line, exit 2,
    every byte kept, no lock left (a folder the command owns: any file; files written beside
    others (report): the file it would replace; one file: that file)."""
    from specparity.cli.outdir import WRITERS

    writer, argv = _variant(zoo_pair, tiny_run, tmp_path, which)
    scope = WRITERS[writer]
    if scope == "file":
        d = tmp_path / "mine.out"
        d.write_text("a user's own file\n")
        rc, out, err = cli(_argv(argv, d), capsys)
        assert rc == 2, err
        one_error(err, str(d), "refusing to overwrite")
        assert d.read_text() == "a user's own file\n" and out == ""
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
        return
    d = tmp_path / "dest"
    if scope == "beside":  # report DIR: a folder of traces with a user's report.md
        d.mkdir()
        shutil.copy(engine_trace(tiny_run, "spec"), d / "t.jsonl")
        before = user_dir(d, ["report.md"])
        must = ["report.md", "not written by specparity"]
    else:
        before = user_dir(d, ["notes.txt"])
        must = ["notes.txt", "not goldens" if scope == "goldens" else "no specparity command wrote"]
    rc, out, err = cli(_argv(argv, d), capsys)
    assert rc == 2, err
    one_error(err, *must)
    assert snapshot(d) == before
    assert not (d / ".specparity.lock").exists() and not (d / ".specparity-run.json").exists()


@pytest.mark.parametrize("which", SWEEP_IDS)
def test_sweep_a_locked_destination_is_refused(which: str, zoo_pair: tuple[Path, Path], tiny_run: Path,
                                               tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every writer: a destination another specparity process is writing is one line naming the
    holder, exit 2, nothing written."""
    from specparity.cli.outdir import FILE_LOCK, WRITERS, DirLock

    writer, argv = _variant(zoo_pair, tiny_run, tmp_path, which)
    if WRITERS[writer] == "file":
        d = tmp_path / "out" / "x.out"
        d.parent.mkdir()
        lock = DirLock(d.parent, "the other writer", name=FILE_LOCK.format(d.name), shown=d)
    else:
        d = tmp_path / "dest"
        d.mkdir()
        if WRITERS[writer] == "beside":
            shutil.copy(engine_trace(tiny_run, "spec"), d / "t.jsonl")
        lock = DirLock(d, "the other writer")
    with lock:
        before = snapshot(d.parent if WRITERS[writer] == "file" else d)
        rc, out, err = cli(_argv(argv, d), capsys)
        after = snapshot(d.parent if WRITERS[writer] == "file" else d)
    assert rc == 2, err
    one_error(err, str(d), "another specparity process", "the other writer")
    assert after == before


@pytest.mark.parametrize("which", [i for i in SWEEP_IDS if i not in ("run --sessions (zoo)",)])
def test_sweep_written_files_are_listed_and_a_run_takes_the_folder_after(
        which: str, zoo_pair: tuple[Path, Path], tiny_run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every writer, into a new destination and into a finished run's folder: it succeeds, every
    file it leaves is listed in the folder's marker (a single file is recognisably ours), and a
    plain ``run --out`` into the same folder afterwards takes it (the files other commands added
    kept, a run's set aside) — never 'files no specparity command wrote'."""
    from specparity.cli.outdir import WRITERS
    from traces.outdir import _listed, _read_marker

    writer, argv = _variant(zoo_pair, tiny_run, tmp_path, which)
    scope = WRITERS[writer]
    if scope == "file":
        d = tmp_path / "f" / "x.out"
        for _ in range(2):  # the second replaces our own file
            rc, _, err = cli(_argv(argv, d), capsys)
            assert rc == 0, err
        assert_whole_files(d.parent)
        assert [p.name for p in d.parent.iterdir()] == ["x.out"], "no lock or temp file left"
        return
    if scope == "goldens":
        pytest.skip("regen --golden-dir writes goldens (own rules: tests/test_regen.py)")
    for fresh in (True, False):
        d = tmp_path / ("new" if fresh else "run")
        if scope == "beside" or not fresh:
            copy_run(tiny_run, d)
        rc, _, err = cli(_argv(argv, d), capsys)
        assert rc in (0, 1), err  # report: 1 is a verdict (INCOMPLETE folder), not a refusal
        assert "error:" not in err, err
        files, added = _listed(_read_marker(d), d)
        on_disk = {p.relative_to(d).as_posix() for p in d.rglob("*")
                   if p.is_file() and not p.relative_to(d).as_posix().startswith(".")}
        assert on_disk <= files | added, f"unlisted: {sorted(on_disk - files - added)}"
        assert not (d / ".specparity.lock").exists()
        assert_whole_files(d)
        rc, _, err = cli([*RUN_TINY, "--out", d], capsys)
        assert rc == 0, err
        for rel in added:
            assert (d / rel).exists(), f"{rel}, added by {which}, was not kept by the next run"
