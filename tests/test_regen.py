"""``specparity regen`` and the golden comparison, with planted changes.

- a planted engine bug (target trim one too few) → the live-vs-golden
  comparison reports a ``logic`` divergence at the first rejecting round; and
  regen refuses to overwrite the golden without ``--accept``;
- a planted package-version bump → the golden is reported stale with the
  version change and its comparison is skipped, not reported as a divergence;
- a regen killed with SIGKILL midway resumes and completes (``slow``);
- the Ray path gives byte-identical goldens to the process pool (``slow``;
  needs the ``ray`` extra, skipped without it; about 15 s on 2 cores, so
  ``.ci/run`` installs the extra and CI runs it).
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from specparity.cases.case import Case
from specparity.goldens import manifest as g
from specparity.goldens.regen import regen
from tests.helpers import ROOT, cli_command
from traces.io import Trace
from traces.validate import validate_file

CASE = Case("llama", "twin", "nat-00", 3, 32)
KEY_E, KEY_O = g.golden_key("engine", CASE), g.golden_key("mlx_lm", CASE)


@pytest.fixture(scope="module")
def gdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("golden")
    assert regen(d, case_glob=CASE.case_id, workers=0, progress=False).exit_code == 0
    return d


def _first_rejecting_round(path: Path) -> int:
    from traces.io import read_trace

    for r in read_trace(path).rounds[:-1]:
        if r["k_accept"] < len(r["drafts"]):
            return int(r["index"])
    raise AssertionError("no rejecting round in the golden")


def _live(case: Case) -> Trace:
    from specparity.runners import run_case

    return Trace.from_records(run_case("engine", case))


def test_live_engine_matches_fresh_goldens(gdir: Path) -> None:
    comps = g.compare_to_goldens(_live(CASE), CASE, g.check_goldens(gdir), golden_dir=gdir)
    assert [(c.golden_key, c.status) for c in comps] == [(KEY_E, "identical"), (KEY_O, "identical")]


def test_planted_short_trim_diverges_at_first_rejecting_round(
    gdir: Path, short_target_trim: None
) -> None:
    r = _first_rejecting_round(g.golden_path(gdir, KEY_O))
    comps = g.compare_to_goldens(_live(CASE), CASE, g.check_goldens(gdir, keys=[KEY_E, KEY_O]),
                                 golden_dir=gdir)
    assert [c.status for c in comps] == ["divergent", "divergent"]
    for c in comps:
        d = c.divergence
        assert (d.where, d.field, d.klass) == (f"round {r}", "target_cache_digest", "logic"), d.message
        assert f"round {r}" in c.format()


def test_planted_version_bump_is_stale_not_divergent(
    gdir: Path, monkeypatch: pytest.MonkeyPatch, short_target_trim: None
) -> None:
    real = g.package_version
    monkeypatch.setattr(g, "package_version", lambda d: "0.33.0" if d == "mlx-lm" else real(d))
    probs = g.check_goldens(gdir, keys=[KEY_E, KEY_O])
    assert [(p.key, p.kind) for p in probs] == [(KEY_O, "stale")]
    assert f"mlx-lm {real('mlx-lm')} → 0.33.0" in probs[0].format()
    # Even with a live run that differs, the stale golden is skipped, not a divergence.
    comps = {c.golden_key: c for c in g.compare_to_goldens(_live(CASE), CASE, probs, golden_dir=gdir)}
    assert comps[KEY_O].status == "skipped" and "0.33.0" in comps[KEY_O].reason
    assert comps[KEY_E].status == "divergent"  # the engine golden is fresh: the bug is seen


def test_regen_unchanged_then_stale_only_updates(gdir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    d = shutil.copytree(gdir, tmp_path / "g")
    res = regen(d, case_glob=CASE.case_id, workers=0, progress=False)
    assert {o.status for o in res.outcomes} == {"unchanged"}
    real = g.package_version
    monkeypatch.setattr(g, "package_version", lambda x: "0.33.0" if x == "mlx-lm" else real(x))
    res = regen(d, stale_only=True, case_glob=CASE.case_id, workers=0, progress=False)
    assert [(o.key, o.status) for o in res.outcomes] == [(KEY_O, "updated")]
    assert res.outcomes[0].reasons == [f"mlx-lm {real('mlx-lm')} → 0.33.0"]
    assert g.check_goldens(d, keys=[KEY_E, KEY_O]) == []


def test_regen_refuses_logic_change_without_accept(
    gdir: Path, tmp_path: Path, short_target_trim: None
) -> None:
    from specparity.goldens.regen import drift_report

    d = shutil.copytree(gdir, tmp_path / "g")
    before = g.golden_path(d, KEY_E).read_bytes()
    manifest = (d / "manifest.json").read_bytes()
    r = _first_rejecting_round(g.golden_path(d, KEY_E))
    res = regen(d, runners=["engine"], case_glob=CASE.case_id, workers=0, progress=False)
    assert res.exit_code == 1
    (o,) = res.outcomes
    assert (o.status, o.where, o.klass) == ("logic-refused", f"round {r}", "logic")
    assert g.golden_path(d, KEY_E).read_bytes() == before
    assert (d / "manifest.json").read_bytes() == manifest
    text = drift_report(res)
    assert f"| {KEY_E} | logic-refused | round {r} | target_cache_digest | logic |" in text
    assert "--accept" in text
    res = regen(d, runners=["engine"], case_glob=CASE.case_id, accept=True, workers=0,
                progress=False)
    assert res.exit_code == 0 and res.outcomes[0].status == "logic-accepted"
    assert g.golden_path(d, KEY_E).read_bytes() != before
    assert g.check_goldens(d, keys=[KEY_E]) == []


def test_cli_regen_usage_errors(tmp_path: Path) -> None:
    from specparity.cli import main

    assert main(["regen", "--golden-dir", str(tmp_path), "--runner", "nosuch",
                 "--report", str(tmp_path / "r")]) == 2


def _cmd(d: Path, glob: str, *extra: str) -> list[str]:
    return cli_command("regen", "--golden-dir", d, "--case", glob, "--report", d.parent / "report", *extra)


@pytest.mark.slow
@pytest.mark.heavy  # nightly; by default tests/test_crash_safety.py kills a regen and resumes it
def test_kill_and_restart_completes(tmp_path: Path) -> None:
    d = tmp_path / "g"
    d.mkdir()
    glob = "llama/*"
    want = set(g.golden_cases()) & {k for k in g.golden_cases() if "/llama__" in k}
    proc = subprocess.Popen(_cmd(d, glob, "--workers", "1"), cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(d.rglob("*.jsonl")):
            assert proc.poll() is None, "regen ended before the first golden appeared"
            assert time.monotonic() < deadline, "no golden after 120 s"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the regen and its pool workers
        proc.wait()
    written = list(d.rglob("*.jsonl"))
    assert 0 < len(written) < len(want), "killed too late to test a resume"
    for p in written:  # whatever is there is complete
        assert validate_file(p) == [], p
    assert (d / ".regen-journal.json").exists()
    out = subprocess.run(_cmd(d, glob, "--workers", "1"), cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert {p.relative_to(d).with_suffix("").as_posix() for p in d.rglob("*.jsonl")} == want
    for p in d.rglob("*.jsonl"):
        assert validate_file(p) == [], p
    assert set(g.load_manifest(d)["goldens"]) == want
    assert g.check_goldens(d, keys=want) == []
    assert not (d / ".regen-journal.json").exists()
    assert not list(d.rglob(".*.tmp"))
    assert f"{len(want)} selected" in out.stdout


@pytest.mark.slow
@pytest.mark.heavy  # ~17 s on 2 cores (a Ray cluster start): nightly, like tests/test_user_models.py's Ray test
def test_ray_matches_process_pool_byte_for_byte(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    glob = "llama/twin/*"
    pool, ray_dir = tmp_path / "pool", tmp_path / "ray"
    for d, extra in ((pool, ["--workers", "2"]), (ray_dir, ["--ray"])):
        d.mkdir()
        out = subprocess.run(_cmd(d, glob, *extra), cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
    files = sorted(p.relative_to(pool) for p in pool.rglob("*.jsonl"))
    want = {k for k, (_, case) in g.golden_cases().items() if fnmatch.fnmatchcase(case.case_id, glob)}
    assert {f.with_suffix("").as_posix() for f in files} == want and len(want) >= 8
    assert files == sorted(p.relative_to(ray_dir) for p in ray_dir.rglob("*.jsonl"))
    for f in files:
        assert (pool / f).read_bytes() == (ray_dir / f).read_bytes(), f
    mp, mr = g.load_manifest(pool)["goldens"], g.load_manifest(ray_dir)["goldens"]
    assert {k: e["sha256"] for k, e in mp.items()} == {k: e["sha256"] for k, e in mr.items()}


def test_unavailable_oracle_is_one_clear_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An absent reference leaves its goldens alone with one reason, never per-golden import errors;
    it fails the run only when that runner was asked for by name."""
    import oracles

    monkeypatch.setattr(oracles, "availability", lambda name: (name != "mlx_lm", "not installed here"))
    from specparity.goldens.regen import drift_report

    res = regen(tmp_path, case_glob=CASE.case_id, workers=0, progress=False)
    by = {o.key: o.status for o in res.outcomes}
    assert by[KEY_O] == "unavailable" and by[KEY_E] == "new", by
    assert res.exit_code == 0 and res.regenerated == 1
    assert "Not regenerated (1 mlx_lm goldens left as they are): oracle unavailable: not installed here" \
        in drift_report(res)
    assert not (tmp_path / "mlx_lm").exists()
    named = regen(tmp_path, runners=["mlx_lm"], case_glob=CASE.case_id, workers=0, progress=False)
    assert named.exit_code == 1 and [o.status for o in named.outcomes] == ["unavailable"]


# --- the regen lock is held at every write (issue 23) ------------------------------------------


def test_lock_held_is_the_kernel_lock_of_this_process(tmp_path: Path) -> None:
    import fcntl
    import json

    from specparity.cli.outdir import LOCK_NAME, DirLock

    assert not g.lock_held(tmp_path) and not g.lock_held(tmp_path / "absent")
    with DirLock(tmp_path, "test", flag="--golden-dir", what="golden directory"):
        assert g.lock_held(tmp_path)
        g.assert_lock_held(tmp_path, "a golden")
    assert not g.lock_held(tmp_path)
    # A stale lock file (its holder died: the flock went with it) is not held.
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": os.getpid()}))
    assert not g.lock_held(tmp_path)
    # Held, but by another process (its pid in the file): not ours; save_manifest waits for nobody.
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": 1, "command": "specparity regen"}).encode())
        assert not g.lock_held(tmp_path)
        with pytest.raises(g.GoldenLockError, match="without holding the directory's lock"):
            g.assert_lock_held(tmp_path, "the manifest")
        from specparity.cli.outdir import Busy

        with pytest.raises(Busy, match="another specparity process"):
            g.save_manifest({"goldens": {}}, tmp_path)
        assert not (tmp_path / g.MANIFEST_NAME).exists()
    finally:
        os.close(fd)


def test_regen_writes_only_under_its_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every golden, manifest and journal write of a real regen happens with the lock held
    (seen from outside, at the writers), and the lock is gone afterwards."""
    import traces.io

    d = tmp_path / "g"
    seen: list[tuple[str, bool]] = []
    real_text, real_trace = g.atomic_write_text, traces.io.write_trace

    def text(path: Path, s: str) -> None:
        seen.append((Path(path).name, g.lock_held(d)))
        real_text(path, s)

    def trace(path: Any, records: Any, **kw: Any) -> Any:
        seen.append((Path(path).name, g.lock_held(d)))
        return real_trace(path, records, **kw)

    monkeypatch.setattr(g, "atomic_write_text", text)
    monkeypatch.setattr(traces.io, "write_trace", trace)
    res = regen(d, runners=["engine"], case_glob=CASE.case_id, workers=0, progress=False)
    assert res.exit_code == 0 and [o.status for o in res.outcomes] == ["new"], res.outcomes
    names = [n for n, _ in seen]
    assert {g.MANIFEST_NAME, ".regen-journal.json"} <= set(names), names
    assert any(n.endswith(".jsonl") for n in names), names
    assert all(held for _, held in seen), seen
    assert not g.lock_held(d)


def test_planted_regen_without_its_lock_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: regen's lock taken away (a write path outside the lock). Caught before any write."""
    import contextlib

    import specparity.cli.outdir

    monkeypatch.setattr(specparity.cli.outdir, "lock_dir", lambda *a, **k: contextlib.nullcontext())
    d = tmp_path / "g"
    d.mkdir()
    with pytest.raises(g.GoldenLockError, match="without holding the directory's lock"):
        regen(d, runners=["engine"], case_glob=CASE.case_id, workers=0, progress=False)
    assert list(d.iterdir()) == []


@pytest.mark.parametrize("writer", ["golden", "manifest", "journal"])
def test_planted_write_after_the_lock_is_released_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """Plant: the lock released just before one of regen's writes (as if that write ran after
    the ``with`` block, e.g. a late pool result). Each write path refuses before writing."""
    import traces.io
    from specparity.cli.outdir import DirLock
    from specparity.goldens import regen as regen_mod

    held: list[DirLock] = []
    real_acquire = DirLock.acquire

    def acquire(self: DirLock) -> DirLock:
        held.append(self)
        return real_acquire(self)

    monkeypatch.setattr(DirLock, "acquire", acquire)

    def release() -> None:
        for lock in held:
            lock.release()

    if writer == "golden":  # released in _apply, before the golden file is written
        real = traces.io.Trace.from_records

        def from_records(cls: Any, records: Any, *a: Any, **k: Any) -> Any:
            if sys._getframe(1).f_code.co_name == "_apply":
                release()
            return real(records, *a, **k)

        monkeypatch.setattr(traces.io.Trace, "from_records", classmethod(from_records))
    elif writer == "manifest":  # released after the golden, before its manifest entry is saved
        real_entry = g.manifest_entry
        monkeypatch.setattr(g, "manifest_entry", lambda *a: (release(), real_entry(*a))[1])
    else:  # released before the journal's first write
        real_select = regen_mod.select
        monkeypatch.setattr(regen_mod, "select", lambda *a: (release(), real_select(*a))[1])
    d = tmp_path / "g"
    with pytest.raises(g.GoldenLockError, match="without holding the directory's lock"):
        regen(d, runners=["engine"], case_glob=CASE.case_id, workers=0, progress=False)
    assert not (d / g.MANIFEST_NAME).exists()
    written = sorted(p.name for p in d.rglob("*.jsonl"))
    assert written == ([] if writer != "manifest" else [Path(g.golden_path(d, KEY_E)).name]), written
