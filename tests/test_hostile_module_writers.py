"""Every ``python -m`` module and tool that writes goes through the ownership mechanism
(``specparity.cli.outdir``), and checks its destination before the work (issue 41).

The writers are found, not listed: every module of ``specparity/`` and ``tools/`` with a
``main`` that builds an argument parser is run up to its ``parse_args``, and each flag whose
name says it writes (``--out``, ``--json``, ``--output``, ``--report``, ...) must take one of
``specparity.cli.args``' output types and be declared in
``specparity.cli.outdir.MODULE_WRITERS``; then each declared writer gets a user's file where
it writes and must refuse in one line, exit 2, before any work (the work functions are
replaced by ones that fail the test), every byte kept, no lock or marker left.

The CLI's own subcommands: ``tests/test_hostile_outdir.py`` (``WRITERS``).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, one_error, snapshot

_OUTPUTISH = r"\bout\b|-out|output|report|json|trace|dump|save|write|dir\b"
NOT_WRITERS: dict[str, str] = {
    "tools/mutation.py --catalogue": "the catalogue it reads",
}
"""Flags whose name looks like an output but that write nothing."""
PENDING: dict[str, str] = {}
"""Writers another change puts through the mechanism: strict xfail (an XPASS says: remove it here)."""


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _modules() -> dict[str, Path]:
    """``name`` -> file for every module of the project (not the CLI's own subcommands, swept by
    test_hostile_outdir.py) whose ``main`` builds an argument parser."""
    found = {}
    for base in ("specparity", "tools", "zoo", "reports", "traces", "subjects", "oracles", "engine"):
        for f in sorted((ROOT / base).rglob("*.py")):
            rel = f.relative_to(ROOT)
            if rel.parts[:2] in (("specparity", "commands"), ("specparity", "cli")):
                continue
            text = f.read_text(encoding="utf-8")
            # a parser, or a subclass of one (bench_batched's one-line ``_Parser``)
            if "def main(" in text and ("ArgumentParser(" in text or "(argparse.ArgumentParser)" in text):
                name = rel.as_posix() if base == "tools" else ".".join(rel.with_suffix("").parts)
                found[name] = f
    return found


def _load(name: str) -> Any:
    if name.startswith("tools/"):
        sys.path.insert(0, str(ROOT / "tools"))
        return importlib.import_module(Path(name).stem)
    return importlib.import_module(name)


def _parser(name: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    mod = _load(name)

    def capture(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        raise _Captured(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        m.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        try:
            mod.main([])
        except _Captured as got:
            return got.parser
    raise AssertionError(f"{name}: main() never parsed its arguments")


def module_writing_flags(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """``"module flag"`` -> the output kind of its type (``UNDECLARED`` when the name says it
    writes but the type is not an output type)."""
    found = {}
    for name in _modules():
        for a in _parser(name, monkeypatch)._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            key = f"{name} {a.option_strings[-1] if a.option_strings else a.dest}"
            kind = getattr(a.type, "output", None)
            if kind is not None:
                found[key] = kind
            elif re.search(_OUTPUTISH, " ".join(a.option_strings) or a.dest, re.I) and key not in NOT_WRITERS:
                found[key] = "UNDECLARED"
    return found


def test_the_enumeration_finds_the_writers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not vacuous: the known writing modules are found, and each writing flag is declared."""
    from specparity.cli.outdir import MODULE_WRITERS

    mods = _modules()
    assert {"specparity.grading.engines", "specparity.grading.vlm_batched", "tools/mutation.py",
            "specparity.measure.bench_batched", "zoo.build", "zoo.train", "reports.scoreboard"} <= set(mods)
    found = module_writing_flags(monkeypatch)
    assert set(found) == set(MODULE_WRITERS), sorted(set(found) ^ set(MODULE_WRITERS))


@pytest.mark.parametrize("key", [
    pytest.param(k, marks=pytest.mark.xfail(strict=True, reason=PENDING[k])) if k in PENDING else k
    for k in sorted(__import__("specparity.cli.outdir", fromlist=["MODULE_WRITERS"]).MODULE_WRITERS)])
def test_every_module_writer_takes_an_output_type(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An output type checks the destination at parse time (writable, not a directory for a
    file, not a file for a folder), before anything runs."""
    found = module_writing_flags(monkeypatch)
    assert found.get(key, "UNDECLARED") != "UNDECLARED", f"{key}: give it an output type (specparity.cli.args)"


# ------------------------------------------------------------------ the sweep: a user's file

def _boom(*a: Any, **k: Any) -> Any:
    raise AssertionError("the work started before the destination was checked")


def _engines(d: Path, m: pytest.MonkeyPatch) -> tuple[list[str], str]:
    from specparity.grading import engines
    from specparity.runners import registry

    name = registry.names("subject")[0]
    m.setattr(engines, "_grade_engines", _boom)
    m.setattr(engines, "grade_engine", _boom)
    return [name, "--out", str(d)], f"{name}.json"


def _servers(d: Path, m: pytest.MonkeyPatch) -> tuple[list[str], str]:
    from specparity.grading import http_servers
    from specparity.runners import registry

    m.setattr(http_servers, "_grade_served_into", _boom)
    return ["--serve", registry.names("server")[0], "--model", "llama", "--out", str(d)], "scoreboard.md"


def _conventions(d: Path, m: pytest.MonkeyPatch) -> tuple[list[str], str]:
    from specparity.grading import native_mtp_conventions as c

    m.setattr(c, "grade", _boom)
    return ["mtplx", "--out", str(d)], "mtp-conventions-mtplx.json"


def _vlm(d: Path, m: pytest.MonkeyPatch) -> tuple[list[str], str]:
    from specparity.grading import vlm_batched
    from specparity.runners import registry

    m.setattr(vlm_batched, "grade", _boom)
    m.setattr(registry, "get", _boom)
    return ["--out", str(d)], "scoreboard.md"


def _mutation(d: Path, m: pytest.MonkeyPatch) -> tuple[list[str], str]:
    mod = _load("tools/mutation.py")
    m.setattr(mod, "run", _boom)
    m.setattr(mod, "scratch_tree", _boom)
    return ["--out", str(d)], "mutation.md"


def _bench_batched(d: Path, m: pytest.MonkeyPatch) -> tuple[list[str], str]:
    mod = _load("specparity.measure.bench_batched")
    for fn in ("measure", "run", "bench"):
        if hasattr(mod, fn):
            m.setattr(mod, fn, _boom)
    return ["--json", str(d / "bench.json")], "bench.json"


def _zoo_build(d: Path, m: pytest.MonkeyPatch) -> tuple[list[str], str]:
    mod = _load("zoo.build")
    m.setattr(mod, "write_model", _boom)
    return ["--out", str(d)], "notes.txt"


def _zoo_train(d: Path, m: pytest.MonkeyPatch) -> tuple[list[str], str]:
    mod = _load("zoo.train")
    m.setattr(mod, "_train", _boom)
    return ["--out", str(d)], "manifest.json"


def _scoreboard(d: Path, m: pytest.MonkeyPatch) -> tuple[list[str], str]:
    mod = _load("reports.scoreboard")
    m.setattr(mod, "load_results", _boom)
    return [str(d)], "scoreboard.md"


def _oracle_runs(d: Path, m: pytest.MonkeyPatch) -> tuple[list[str], str]:
    mod = _load("reports.oracle_runs")
    m.setattr(mod, "load", _boom)
    m.setattr(mod, "summarize", _boom)
    return [str(d), "--out", str(d / "summary.md")], "summary.md"


SWEEP: dict[str, Callable[[Path, pytest.MonkeyPatch], tuple[list[str], str]]] = {
    "zoo.build --out": _zoo_build,
    "zoo.train --out": _zoo_train,
    "reports.scoreboard dir": _scoreboard,
    "reports.oracle_runs --out": _oracle_runs,
    "specparity.grading.engines --out": _engines,
    "specparity.grading.http_servers --out": _servers,
    "specparity.grading.native_mtp_conventions --out": _conventions,
    "specparity.grading.vlm_batched --out": _vlm,
    "tools/mutation.py --out": _mutation,
    "specparity.measure.bench_batched --json": _bench_batched,
}


def test_the_sweep_covers_every_module_writer() -> None:
    from specparity.cli.outdir import MODULE_WRITERS

    assert set(SWEEP) == set(MODULE_WRITERS)


@pytest.mark.parametrize("key", [
    pytest.param(k, marks=pytest.mark.xfail(strict=True, reason=PENDING[k])) if k in PENDING else k
    for k in sorted(SWEEP)])
def test_a_users_file_is_refused_before_the_work(key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "dest"
    d.mkdir()
    argv, planted = SWEEP[key](d, monkeypatch)
    (d / planted).write_text("a user's own file\n")
    before = snapshot(d)
    mod = _load(key.split()[0])
    try:
        rc = mod.main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    _, err = capsys.readouterr()
    assert rc == 2, err
    one_error(err, planted)
    assert snapshot(d) == before, "a file was written, moved or removed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"], "something written outside --out"


@pytest.mark.parametrize("key", [
    pytest.param(k, marks=pytest.mark.xfail(strict=True, reason=PENDING[k])) if k in PENDING else k
    for k in sorted(SWEEP)])
def test_a_file_where_a_folder_goes_is_refused_at_parse_time(key: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The destination's kind and writability are checked before ``main`` does anything."""
    from specparity.cli.outdir import MODULE_WRITERS

    monkeypatch.chdir(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    d = tmp_path / "dest"
    argv, _ = SWEEP[key](d, monkeypatch)
    flag = key.split()[1]
    bad = str(afile / "sub" if MODULE_WRITERS[key] == "file" else afile)
    if flag.startswith("-"):
        argv[argv.index(flag) + 1] = bad
    else:  # a positional destination
        argv[argv.index(str(d))] = bad
    mod = _load(key.split()[0])
    with pytest.raises(SystemExit) as exc:
        mod.main(argv)
    _, err = capsys.readouterr()
    assert exc.value.code == 2
    one_error(err, afile.name)  # long paths are shortened in the middle (xdist tmp dirs), the name stays
    assert afile.read_text() == "keep me" and not d.exists()
