"""Crash safety (issue 16): ``kill -9`` of ``run``, ``regen`` and ``ab`` at a random point.

After each kill: every file under a final name is whole (traces validate, JSON
parses, nothing 0-byte, no temp files published), the directory's lock died
with the process, the killed run's report says INCOMPLETE (never CONFORMS),
no pool worker outlives a killed ``regen``, and a re-run either completes
(resume or fresh start) or refuses in one clear line. The default variants
kill once per command at a random delay inside the work (seeded, printed);
``slow`` variants sweep several delays (opt in: ``SPECPARITY_CRASH_SWEEP=1``).
Re-runs happen in process (``specparity.cli.main`` / ``regen()``) to keep the
default variants near 30 s on two cores.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import assert_whole_files, cli_command, cli_env

SEED = int(os.environ.get("SPECPARITY_CRASH_SEED", random.randrange(1 << 16)))
SWEEP = pytest.mark.skipif(not os.environ.get("SPECPARITY_CRASH_SWEEP"),
                          reason="crash sweep: set SPECPARITY_CRASH_SWEEP=1")
RUN_ARGS = ["--targets", "llama", "--drafters", "self,twin", "--gammas", "1,2", "--prompts", "1",
            "--max-tokens", "4", "--runners", ""]


def _env() -> dict[str, str]:
    env = cli_env(HF_HUB_OFFLINE="1", SPECPARITY_PROGRESS_INTERVAL="0")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _spawn(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(cli_command(*args), cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _kill_when(proc: subprocess.Popen[str], ready: callable, extra_s: float, limit_s: float = 120) -> bool:  # type: ignore[valid-type]
    """SIGKILL ``proc`` (only it, not its group) ``extra_s`` after ``ready()``; False if it ended first."""
    deadline = time.monotonic() + limit_s
    while not ready():
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the command never reached the kill point"
        time.sleep(0.02)
    time.sleep(extra_s)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _in_dir(root: Path) -> list[int]:
    """Live processes whose working directory is ``root`` (the command and anything it spawned)."""
    me, out = os.getpid(), []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if int(proc.name) != me and cwd.removesuffix(" (deleted)") == str(root) and _alive(int(proc.name)):
            out.append(int(proc.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _run_killed(tmp_path: Path, after_traces: int, extra_s: float) -> None:
    out = tmp_path / "run"
    proc = _spawn(["run", *RUN_ARGS, "--out", str(out)], tmp_path)
    try:
        killed = _kill_when(proc, lambda: len(list(out.glob("traces/*/*.jsonl"))) >= after_traces,
                            extra_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"run: seed {SEED}, killed={killed} after {after_traces} traces + {extra_s:.2f} s")
    assert_whole_files(killed_writers=True, root=out)
    from specparity.cli import main

    summary = out / "summary.md"
    if killed and summary.exists() and "CONFORMS" in summary.read_text():
        # the verdict is written last: everything it summarises is already on disk
        assert (out / "comparisons.json").exists() and (out / "report.md").exists()
    if killed and (out / "traces").exists():
        rc = main(["report", str(out)])
        assert rc in (0, 1) and (out / "report.md").exists()
        status = (out / "report.md").read_text().split("**")[1]
        assert status.startswith(("INCOMPLETE", "CONFORMS")), status
        if not (out / ".specparity-run.json").read_text().count('"complete"'):
            assert status.startswith("INCOMPLETE"), "a killed run must never read CONFORMS"
    assert main(["run", *RUN_ARGS, "--out", str(out), "--quiet"]) == 0
    assert_whole_files(killed_writers=True, root=out)
    assert main(["report", str(out)]) == 0
    assert "**CONFORMS**" in (out / "report.md").read_text()
    assert not (out / ".previous-run").exists()


def test_kill_run_then_rerun(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    _run_killed(tmp_path, rng.randint(1, 6), rng.uniform(0.0, 0.3))


@pytest.mark.slow
@SWEEP
@pytest.mark.parametrize("after", [0, 1, 3, 7])
def test_kill_run_sweep(tmp_path: Path, after: int) -> None:
    _run_killed(tmp_path, after, 0.05 * after)


def _regen_killed(tmp_path: Path, extra_s: float) -> None:
    gdir = tmp_path / "golden"
    args = ["regen", "--golden-dir", str(gdir), "--case", "llama/*plain*", "--workers", "2",
            "--report", str(tmp_path / "drift")]
    proc = _spawn(args, tmp_path)
    workers: list[int] = []

    def ready() -> bool:
        workers[:] = _children(proc.pid) or workers
        return len(workers) >= 2 or bool(list(gdir.rglob("*.jsonl")))

    try:
        killed = _kill_when(proc, ready, extra_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"regen: seed {SEED}, killed={killed} + {extra_s:.2f} s, workers {workers}")
    if killed:
        # Every process started in tmp_path (pool workers, the resource tracker), seen or not.
        # A worker still importing exits once its init runs (die_with_parent); on a loaded
        # 2-core machine that can take a while: a bound for a hang, not a timing verdict.
        deadline = time.monotonic() + 120
        while (_in_dir(tmp_path) or any(_alive(w) for w in workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = sorted({*_in_dir(tmp_path), *(w for w in workers if _alive(w))})
        for w in left:
            os.kill(w, signal.SIGKILL)
        assert not left, f"pool workers outlived the killed regen: {left}"
    assert_whole_files(killed_writers=True, root=gdir)
    from specparity.goldens.regen import regen

    result = regen(gdir, case_glob="llama/*plain*", workers=0, progress=False)
    assert result.exit_code == 0, [o for o in result.outcomes if o.status == "error"]
    assert_whole_files(killed_writers=True, root=gdir)
    from specparity.goldens import manifest as g

    manifest = g.load_manifest(gdir)["goldens"]
    assert set(manifest) == {p.relative_to(gdir).with_suffix("").as_posix() for p in gdir.rglob("*.jsonl")}
    assert not (gdir / ".specparity.lock").exists()


def test_kill_regen_no_orphans_and_resume(tmp_path: Path) -> None:
    _regen_killed(tmp_path, random.Random(SEED + 1).uniform(0.0, 1.0))


@pytest.mark.slow
@SWEEP
@pytest.mark.parametrize("extra", [0.0, 0.5, 2.0])
def test_kill_regen_sweep(tmp_path: Path, extra: float) -> None:
    _regen_killed(tmp_path, extra)


def test_kill_ab_leaves_nothing_partial(tmp_path: Path) -> None:
    out = tmp_path / "ab"
    args = ["ab", "--target", "llama", "--drafter-a", "self", "--drafter-b", "twin", "--prompts", "4",
            "--allow-small", "--max-tokens", "4", "--out", str(out)]
    proc = _spawn(args, tmp_path)
    extra = random.Random(SEED + 2).uniform(0.0, 0.5)
    try:
        killed = _kill_when(proc, lambda: (out / ".specparity.lock").exists(), extra)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"ab: seed {SEED}, killed={killed} + {extra:.2f} s")
    assert_whole_files(killed_writers=True, root=out)
    from specparity.cli import main

    assert main(args) == 0  # the dead run's lock died with it
    assert_whole_files(killed_writers=True, root=out)
    assert json.loads((out / "ab.json").read_text())["kind"] == "ab"


def _term_when(proc: subprocess.Popen[str], ready: callable, limit_s: float = 120) -> bool:  # type: ignore[valid-type]
    """SIGTERM ``proc`` once ``ready()``; False if it ended first."""
    deadline = time.monotonic() + limit_s
    while not ready():
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "the command never reached the signal point"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    return True


@pytest.mark.parametrize("workers", ["0", "2"])
def test_sigterm_run_is_one_line_incomplete_and_unlocked(tmp_path: Path, workers: str) -> None:
    """Issue 23: SIGTERM ends `specparity run` with one line, exit 143, the lock released, no temp
    file left, summary.md INCOMPLETE; the earlier finished run is kept; a re-run completes."""
    from specparity.cli import main

    out = tmp_path / "run"
    assert main(["run", *RUN_ARGS, "--out", str(out), "--quiet"]) == 0
    finished = (out / "summary.md").read_text()
    proc = _spawn(["run", *RUN_ARGS, "--out", str(out), "--workers", workers], tmp_path)
    try:
        termed = _term_when(proc, lambda: (out / ".previous-run").exists()
                            and len(list(out.glob("traces/*/*.jsonl"))) >= 1)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if not termed:
        pytest.skip("the run finished before the signal point")
    assert proc.returncode == 143, output
    lines = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith(
        ("running cases", "specparity: --out")) and " cases (" not in ln]
    assert len(lines) == 1 and "interrupted by SIGTERM" in lines[0], output
    assert "Traceback" not in output
    assert not (out / ".specparity.lock").exists(), "lock released"
    assert_whole_files(out)  # no temp files left either
    assert "INCOMPLETE" in (out / "summary.md").read_text()
    assert (out / ".previous-run" / "summary.md").read_text() == finished, "finished run kept"
    assert json.loads((out / ".specparity-run.json").read_text())["state"] == "failed"
    assert not _in_dir(tmp_path), "no worker outlived the run"
    assert main(["run", *RUN_ARGS, "--out", str(out), "--quiet"]) == 0
    assert not (out / ".previous-run").exists()
