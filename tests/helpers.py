"""What the test suites share: the CLI runners, the zoo model fixtures, the file checks.

Imported as ``tests.helpers`` from ``tests/`` and ``conformance/`` alike (the repository
root is on ``sys.path``: the root ``conftest.py`` puts it there, as ``python -m pytest``
does); the root ``conftest.py`` registers it as a plugin (``pytest_plugins``), so its
fixtures need no import. Its own tests: ``tests/test_helpers.py``.

- the CLI: :func:`cli` (in process, output captured), :func:`cli_rc` (in process, the exit
  status only), :func:`cli_process` / :func:`cli_command` (a fresh interpreter, for kills
  and signals), :func:`one_error` / :func:`refused` (a refusal is one ``error:`` line);
- matrices: :func:`one_axis` (a control case plus one-axis variants by default, the full
  cross product nightly);
- zoo models: :func:`load_zoo`, :func:`load_zoo_pair` (cached by
  ``specparity.runners.load_model``), and the session fixtures ``zoo_pair`` (the llama +
  twin directories) and ``tiny_run`` (a finished engine-only run of the tiny zoo);
- files: :func:`assert_whole_files` (nothing corrupt under a final name),
  :func:`read_records` / :func:`write_records` (trace JSONL), :func:`engine_trace`,
  :func:`copy_run`.

Heavy imports (mlx, zoo, specparity) happen inside the functions: this module is imported
at every pytest start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------ the CLI


def cli(argv: Sequence[Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``specparity.cli.main(argv)`` in process (each item ``str()``-ed): exit status, stdout,
    stderr (read from ``capsys``, which is left empty)."""
    from specparity.cli import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def cli_rc(*argv: Any) -> int:
    """``specparity.cli.main`` in process; only the exit status (output goes to pytest's capture)."""
    from specparity.cli import main

    return main([str(a) for a in argv])


def cli_command(*argv: Any) -> list[str]:
    """The command line of ``specparity ARGV`` in a fresh interpreter (this checkout's code)."""
    return [sys.executable, "-m", "specparity.cli", *(str(a) for a in argv)]


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment with this checkout first on ``PYTHONPATH``, plus ``extra``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def cli_process(argv: Sequence[Any], *, cwd: Path | str | None = None, env: dict[str, str] | None = None,
                timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``specparity ARGV`` in a fresh interpreter, output captured as text. ``env`` replaces
    :func:`cli_env`'s (give ``cli_env(...)`` to add to it)."""
    return subprocess.run(cli_command(*argv), cwd=cwd, env=cli_env() if env is None else env,
                          capture_output=True, text=True, timeout=timeout)


def one_error(err: str, *must: str) -> str:
    """Exactly one ``error:`` line on ``err``, no traceback, no internal error; the line names
    each of ``must``. Returns the line."""
    assert "Traceback" not in err, err
    assert "internal error" not in err, err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1, err
    for m in must:
        assert m in lines[0], (m, lines[0])
    return lines[0]


def refused(rc: int, err: str, *must: str) -> str:
    """A usage refusal: exit status 2 and :func:`one_error`."""
    assert rc == 2, err
    return one_error(err, *must)


# The smallest zoo run: llama with itself as drafter, γ 1, one prompt, 4 tokens, engine only.
RUN_TINY = ["run", "--targets", "llama", "--drafters", "self", "--gammas", "1", "--prompts", "1",
            "--max-tokens", "4", "--runners", ""]


@pytest.fixture
def no_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs stubbed to fail at once: a flag the CLI wrongly accepts fails the test at once
    instead of running a whole job."""
    import specparity.goldens.regen
    import specparity.jobs.run
    import specparity.measure.ab
    import specparity.measure.bench

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("a bad flag was accepted: the job started")

    for mod, name in ((specparity.jobs.run, "run_cases"), (specparity.measure.ab, "run_ab"),
                      (specparity.measure.bench, "run_bench"), (specparity.goldens.regen, "regen")):
        monkeypatch.setattr(mod, name, refuse)


class JobStarted(Exception):
    """Raised by a stubbed job (:func:`captured`): the input was accepted and work would have
    started. The CLI reports it as an internal error naming this class."""


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``specparity.jobs.run.run`` (and ``run --sessions``' job) stubbed: its arguments are kept and it
    raises :class:`JobStarted`."""
    import specparity.jobs.run
    import specparity.jobs.sessions

    calls: list[dict[str, Any]] = []

    def run(out: Path, **kwargs: Any) -> None:
        calls.append({"out": out, **kwargs})
        raise JobStarted()

    def sessions(cases: Any, out: Path, **kwargs: Any) -> None:  # run --sessions: another job
        calls.append({"out": out, "sessions": True, "cases": list(cases), **kwargs})
        raise JobStarted()

    monkeypatch.setattr(specparity.jobs.run, "run", run)
    monkeypatch.setattr(specparity.jobs.sessions, "main_sessions", sessions)
    return calls


# ------------------------------------------------------------------------------ matrices


def one_axis(cases: Sequence[Any], **control: Any) -> list[Any]:
    """``cases`` as pytest params (id: the case id), a control case plus one-axis variants in the
    default run (STYLE.md: avoid the full cross product). ``control`` maps a case field to its
    control value, or to a tuple of values that all count as control. A case whose fields leave
    the control in at most one of them runs by default; the rest of the cross product is marked
    ``slow`` + ``heavy`` (root conftest: run with ``-m slow`` or ``SPECPARITY_PROMPTS=all``,
    as the nightly workflow does), so the whole matrix still runs, and its test ids are kept."""
    def off(case: Any) -> int:
        return sum(getattr(case, f) not in (v if isinstance(v, tuple) else (v,)) for f, v in control.items())

    heavy = (pytest.mark.slow, pytest.mark.heavy)
    return [pytest.param(c, id=c.case_id, marks=() if off(c) <= 1 else heavy) for c in cases]


# ------------------------------------------------------------------------------ zoo models


def load_zoo(name: str) -> Any:
    """Zoo model ``name`` loaded (``specparity.runners.load_model``: cached per process)."""
    import zoo
    from specparity.runners import load_model

    return load_model(str(zoo.model_dir(name)))


def load_zoo_pair(target: str, drafter: str = "twin") -> tuple[Any, Any]:
    """``(target, drafter)`` of a zoo pair, loaded (cached per process)."""
    import zoo
    from specparity.runners import load_model

    t, d = zoo.pair(target, drafter)
    return load_model(str(t)), load_model(str(d))


@pytest.fixture(scope="session")
def zoo_pair() -> tuple[Path, Path]:
    """The directories of the zoo's llama target and its twin drafter."""
    import zoo

    return zoo.pair("llama", "twin")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run (engine only: self drafter, γ 1, 1 prompt, 4 tokens). Read-only:
    copy it (:func:`copy_run`) before planting anything."""
    from specparity.jobs.run import run

    out = tmp_path_factory.mktemp("tiny-run")
    run(out, targets=["llama"], drafters=["self"], gammas=(1,), n_prompts=1, max_tokens=4,
        runners=[], progress=False)
    return out


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test runs in its own tmp dir: default output paths (runs/latest, runs/ab) land
    there, never in the checkout."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ------------------------------------------------------------------------------ files


def assert_whole_files(root: Path, *, killed_writers: bool = False) -> None:
    """Nothing corrupt under a final name below ``root``: every visible file is non-empty,
    traces validate, JSON parses. ``killed_writers``: a SIGKILLed writer may leave its hidden
    ``.*.tmp`` file (never under a final name; readers skip it); otherwise none may be left."""
    from traces.validate import validate_file

    for p in root.rglob("*"):
        if not p.is_file() or p.name.startswith("."):
            continue
        assert p.stat().st_size > 0, f"0-byte file under a final name: {p}"
        if p.suffix == ".jsonl":
            assert validate_file(p) == [], p
        elif p.suffix == ".json":
            json.loads(p.read_text())
    if not killed_writers:
        assert not list(root.rglob(".*.tmp")), "temp files left behind"


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a JSONL file (blank lines skipped)."""
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def write_records(path: Path, recs: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def engine_trace(run_dir: Path, mode: str) -> Path:
    """The first engine trace of ``mode`` (``spec`` / ``plain``) in a run directory."""
    for p in sorted((run_dir / "traces" / "engine").glob("*.jsonl")):
        if read_records(p)[0]["mode"] == mode:
            return p
    raise AssertionError(f"no {mode} trace in {run_dir}")


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of run directory ``src`` at ``dst`` (without its lock file)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".specparity.lock"))
    return dst


def snapshot(root: Path) -> dict[str, bytes]:
    """Every regular file below ``root`` (not through symlinks): relative path -> bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def user_dir(root: Path, names: list[str]) -> dict[str, bytes]:
    """A directory of a user's files under ``names`` (specparity's own output names, say);
    its :func:`snapshot`."""
    root.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"user file {i}: {name}\n")
    return snapshot(root)


def fifo_guard(fifo: Path, after_s: float = 5.0) -> threading.Event:
    """If the code under test wrongly opens ``fifo``, a writer unblocks it after ``after_s``
    (so a regression fails the test instead of hanging it) and sets the returned event: a
    blocking write-open of a FIFO returns only once a reader has it open."""
    opened = threading.Event()

    def unblock() -> None:
        try:
            os.close(os.open(fifo, os.O_WRONLY))
            opened.set()
        except OSError:
            pass

    t = threading.Timer(after_s, unblock)
    t.daemon = True
    t.start()
    return opened
