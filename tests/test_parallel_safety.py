"""The suite runs under pytest-xdist (README: ``python -m pytest -n auto --dist loadgroup``):
what several worker processes share must stay safe when they touch it at once.

- the zoo cache (``zoo.pinned.build``): concurrent builders of one artifact take a file lock,
  so exactly one writes it and the others use its result;
- the checkout's ``runs/``: no default-run test writes there (root ``conftest.py`` guard).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest


def _slow_write(log: str, tmp: Path) -> None:
    with open(log, "a") as fh:
        fh.write(f"start {tmp.name}\n")
    time.sleep(0.5)  # long enough for the other builder to arrive while this one writes
    (tmp / "model.safetensors").write_bytes(b"x")
    with open(log, "a") as fh:
        fh.write(f"end {tmp.name}\n")


def _builder(root: str, log: str) -> None:
    import functools

    from zoo import pinned

    pinned.build(Path(root), "art", functools.partial(_slow_write, log))


def test_concurrent_zoo_builders_build_once_and_share_the_result(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_builder, args=(str(tmp_path / "cache"), str(log))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"a builder exited {p.exitcode}"
    lines = log.read_text().splitlines()
    assert [ln.split()[0] for ln in lines] == ["start", "end"], (
        f"3 concurrent builders of one zoo artifact: expected one build, the log shows {lines}")
    assert (tmp_path / "cache" / "art" / "model.safetensors").read_bytes() == b"x"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["art"], "temp dirs or the lock file left behind"


def test_a_built_artifact_is_returned_without_taking_the_lock(tmp_path: Path) -> None:
    from zoo import pinned

    d = tmp_path / "art"
    d.mkdir()
    (d / pinned.MARKER).write_bytes(b"x")
    assert pinned.build(tmp_path, "art", lambda tmp: pytest.fail("rebuilt a built artifact")) == d
    assert not (tmp_path / ".art.lock").exists()  # a read-only shared cache stays untouched


def test_a_test_writing_into_the_checkouts_runs_is_caught(tmp_path: Path) -> None:
    """The root conftest's guard: a planted ``runs/latest`` written during a test is named."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_root_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
    assert spec and spec.loader
    root_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root_conftest)
    runs = tmp_path / "runs"
    before = root_conftest.runs_entries(runs)
    assert root_conftest.runs_written(before, runs) is None
    (runs / "scoreboard").mkdir(parents=True)  # a tox environment's folder: allowed
    assert root_conftest.runs_written(before, runs) is None
    (runs / "latest").mkdir()
    why = root_conftest.runs_written(before, runs)
    assert why is not None and "runs/ (latest)" in why and "tmp_path" in why, why
