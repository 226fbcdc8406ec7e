"""Hostile and careless input (issue 16): every bad input gets ONE clear line.

Each test plants a bad input of one class of the issue and checks, through
``specparity.cli.main`` in process (fast: tiny zoo models, ``--max-tokens 4``):
the exit status (2 usage, 1 failed run), exactly one ``specparity ...: error:``
line on stderr (no traceback, no ``internal error``), and that nothing
corrupt or partial sits under a final name. The inputs are listed in
``HOSTILE`` per class; ``test_catalogue_counts`` keeps the count honest
(reported in the closing note).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from whole_files import assert_whole_files

import zoo
from specparity.cli import main

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ---------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Default output paths (runs/latest, runs/ab) land in the test's tmp dir, never the repo."""
    monkeypatch.chdir(tmp_path)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error(err: str, *must: str) -> str:
    """Exactly one error line, no traceback/internal error; it names ``must``."""
    assert "Traceback" not in err, err
    assert "internal error" not in err, err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1, err
    for m in must:
        assert m in lines[0], (m, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    return zoo.pair("llama", "twin")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run (engine only: self drafter, γ 1, 1 prompt, 4 tokens)."""
    from specparity.run import run

    out = tmp_path_factory.mktemp("tiny-run")
    run(out, targets=["llama"], drafters=["self"], gammas=(1,), n_prompts=1, max_tokens=4,
        runners=[], progress=False)
    return out


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".specparity.lock"))
    return dst


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _write_records(path: Path, recs: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _engine_trace(run_dir: Path, mode: str) -> Path:
    for p in sorted((run_dir / "traces" / "engine").glob("*.jsonl")):
        if _records(p)[0]["mode"] == mode:
            return p
    raise AssertionError(f"no {mode} trace in {run_dir}")


# The catalogue: (class, id) of every hostile input tried below.
HOSTILE: dict[str, list[str]] = {
    "usage: flags": [
        "run --seed", "run --runners nosuch", "run --gammas 0", "run --gammas 1,,2",
        "run --gammas x", "run --max-tokens 0", "run --max-tokens 1e9", "run --prompts -3",
        "ab --max-drop nan", "ab --max-drop inf", "ab --max-drop -1", "ab --gamma 0",
        "generate --prompt-ids 5,x", "generate --prompt-ids ''", "generate --max-tokens -1",
        "generate --max-tokens 1000000000", "bench --repeats 0", "nosuch-command",
        "regen --workers 0", "audit --gamma -2", "run --gammas 1e20 (int)", "ab --prompts 1e20 (int)",
        "bench --target with NUL", "regen --golden-dir with NUL", "generate --seed -1",
        "run --suite /dev/zero", "run --prompts-file /dev/zero", "ab --prompts-file /dev/zero",
        "bench --prompts-file a dir", "zoo list --prompts-file /dev/zero", "audit --prompts-file missing", "report (no such dir)", "report (a file)",
        "diff (missing files)", "known --run (not a run dir)", "non-UTF-8 argv",
    ],
    "crashes: bad files": [
        "truncated safetensors", "config.json not JSON", "no config.json",
        "(each of the three via generate --target/--draft, ab, audit, run --target)", "trace FIFO",
        "deeply nested JSON line", "non-UTF-8 trace", "malformed comparisons.json",
        "comparisons.json not a list", "ab.json malformed", "trace validate a directory",
    ],
    "false verdicts": [
        "report: schema_version 99", "report: duplicated round index",
        "report: negative token id", "report: killed run (no comparisons)",
        "report: fewer comparisons than cases", "report: marker says failed",
        "generate --temp nan", "generate --top-p nan", "target with NaN logits",
    ],
    "unbounded work": [
        "trace validate /dev/zero", "trace validate 5 MB line", "validate 100k bad lines",
        "--max-tokens 2e6 refused", "--max-tokens 40000 warned",
    ],
    "lost or mixed data": [
        "second run into a locked --out", "second regen on a locked golden dir",
        "run over an earlier run dir (stale rows)", "disk full writing report.md",
        "disk full writing comparisons.json (run)",
    ],
    "finished work thrown away": [
        "ab --out an existing file", "bench --out under a file", "run --out under a file",
        "regen --report under a file", "regen --golden-dir a file",
        "ab: results printed before a failing write",
    ],
    "environment-dependent dispatch": ["every available runner dispatchable (all installed)"],
    "misleading figures": ["no tok/s or speedup column in report/summary"],
    "no progress in CI logs": ["plain progress lines when stderr is not a TTY"],
    "orphans and modes": ["published files are 0644 under umask 022",
                          "--trace /dev/null (device kept)", "--trace a symlink (link kept)"],
    "goldens depend on location": ["golden headers record zoo/<dir>, never an absolute path"],
    "markdown injection": ["<script>/|/backticks in case id, prompt id and path"],
    "any trace folder": ["mixed engine/reference/plain traces, colliding case ids"],
    "flag sweep (every option of every command x 5 values, counted at run time)": ["sweep"],
}


def test_catalogue_counts() -> None:
    n = sum(len(v) for v in HOSTILE.values())
    assert n >= 60, n
    print({k: len(v) for k, v in HOSTILE.items()}, "total", n)


# ---------------------------------------------------------------- usage: flags


FLAG_CASES: list[tuple[list[str], str]] = [
    (["run", "--seed"], "--seed"),
    (["run", "--runners", "nosuch"], "nosuch"),
    (["run", "--gammas", "0"], "--gammas"),
    (["run", "--gammas", "1,,2"], "--gammas"),
    (["run", "--gammas", "x"], "--gammas"),
    (["run", "--max-tokens", "0"], "--max-tokens"),
    (["run", "--max-tokens", "1e9"], "--max-tokens"),
    (["run", "--prompts", "-3"], "--prompts"),
    (["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--max-drop", "nan"],
     "--max-drop"),
    (["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--max-drop", "inf"],
     "--max-drop"),
    (["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--max-drop", "-1"],
     "--max-drop"),
    (["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--gamma", "0"],
     "--gamma"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["nosuch-command"], "nosuch-command"),
    (["regen", "--workers", "0"], "--workers"),
    (["run", "--suite", "/dev/zero"], "regular file"),
    (["run", "--prompts-file", "/dev/zero", "--target", "llama"], "regular file"),
    (["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--prompts-file",
      "/dev/zero"], "regular file"),
    (["bench", "--prompts-file", "."], "regular file"),
    (["zoo", "list", "--prompts-file", "/dev/zero"], "regular file"),
    (["audit", "--prompts-file", "/nonexistent-prompts"], "no such file"),
    (["run", "--gammas", "99999999999999999999"], "too large"),
    (["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--prompts",
      "99999999999999999999"], "too large"),
    (["bench", "--target", "zoo/a\x00b"], "NUL"),
    (["regen", "--golden-dir", "a\x00b"], "NUL"),
    (["generate", "--target", str(zoo.pair("llama", "twin")[0]), "--prompt-ids", "5", "--seed", "-1"],
     "--seed"),
    (["audit", "--gamma", "-2"], "--gamma"),
    (["run", "--temps", "5,,6"], "empty item"),
]


@pytest.fixture
def no_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flag the CLI wrongly accepts fails here at once instead of running a whole job."""
    import specparity.ab
    import specparity.bench
    import specparity.regen
    import specparity.run

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("a bad flag was accepted: the job started")

    for mod, name in ((specparity.run, "run_cases"), (specparity.ab, "run_ab"),
                      (specparity.bench, "run_bench"), (specparity.regen, "regen")):
        monkeypatch.setattr(mod, name, refuse)


@pytest.mark.parametrize("argv,names", FLAG_CASES, ids=[" ".join(a) for a, _ in FLAG_CASES])
def test_bad_flag_is_one_line(argv: list[str], names: str, capsys: pytest.CaptureFixture[str],
                              no_jobs: None) -> None:
    rc, out, err = _cli(argv, capsys)
    assert rc == 2, err
    _one_error(err, names)


GEN_FLAGS = [
    (["--prompt-ids", "5,x"], "--prompt-ids"),
    (["--prompt-ids", ""], "--prompt-ids"),
    (["--prompt-ids", "5,6", "--max-tokens", "-1"], "--max-tokens"),
    (["--prompt-ids", "5,6", "--max-tokens", "1000000000"], ""),
    (["--prompt-ids", "5,6", "--temp", "nan"], ""),
    (["--prompt-ids", "5,6", "--top-p", "nan"], ""),
    (["--prompt-ids", "5,5000"], "5000"),
]


@pytest.mark.parametrize("extra,names", GEN_FLAGS, ids=[" ".join(a) for a, _ in GEN_FLAGS])
def test_generate_bad_values(pair: tuple[Path, Path], tmp_path: Path, extra: list[str], names: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    rc, out, err = _cli(["generate", "--target", pair[0], "--draft", pair[1], "-n", "4",
                         "--trace", trace, *extra], capsys)
    assert rc == 2, err
    _one_error(err, names)
    assert not trace.exists(), "nothing written for a refused input"
    assert out.strip() == "", "no tokens streamed for a refused input"


def test_non_utf8_argv_is_one_line(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    bad = b"ab\xff\xfe".decode("utf-8", "surrogateescape")
    rc, _, err = _cli(["generate", "--target", pair[0], "-n", "4", "--prompt", bad], capsys)
    assert rc == 2
    _one_error(err, "UTF-8")


def test_missing_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, name in ((["report", tmp_path / "nope"], "nope"), (["report", afile], "afile"),
                       (["known", "--run", tmp_path], "comparisons.json")):
        rc, _, err = _cli(argv, capsys)
        assert rc in (1, 2), (argv, err)
        _one_error(err, name)
    # diff: one line naming the missing file and why
    rc, _, err = _cli(["diff", tmp_path / "a.jsonl", tmp_path / "b.jsonl"], capsys)
    assert rc == 2 and "Traceback" not in err and "internal error" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert "a.jsonl" in err and "No such file" in err


# ---------------------------------------------------------------- crashes: bad files


def _broken_model(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    st = dst / "model.safetensors"
    if how == "truncated safetensors":
        os.truncate(st, st.stat().st_size // 2)
    elif how == "config.json not JSON":
        (dst / "config.json").write_text("{bad")
    elif how == "no config.json":
        (dst / "config.json").unlink()
    return dst


@pytest.mark.parametrize("how", ["truncated safetensors", "config.json not JSON", "no config.json"])
def test_broken_model_dir(pair: tuple[Path, Path], tmp_path: Path, how: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    bad = _broken_model(pair[0], tmp_path / "model", how)
    for argv in (["generate", "--target", bad, "-n", "4", "--prompt-ids", "5,6"],
                 ["generate", "--target", pair[0], "--draft", bad, "-n", "4", "--prompt-ids", "5,6"],
                 ["ab", "--target", bad, "--drafter-a", "twin", "--drafter-b", "small"],
                 ["audit", "--target", bad, "--prompts", "1"],
                 ["run", "--target", bad, "--draft", pair[1], "--max-tokens", "4"]):
        rc, out, err = _cli(argv, capsys)
        assert rc == 2, err
        _one_error(err, str(bad))


def test_bad_trace_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nested = tmp_path / "nested.jsonl"
    nested.write_text("[" * 200_000 + "]" * 200_000 + "\n")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\n")
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # open() on it would block forever: refused before opening
    for path, what in ((nested, "nested too deeply"), (binary, "not UTF-8"), (tmp_path, "regular file"),
                       (tmp_path / "missing.jsonl", "No such file"), (fifo, "regular file")):
        rc, out, err = _cli(["trace", "validate", path], capsys)
        assert rc == 1
        assert "Traceback" not in out + err
        assert what in out and str(path) in out, out


@pytest.mark.parametrize("content,what", [
    ("{not json", "comparisons.json"),
    ('{"a": 1}', "list"),
    ("[1, 2]", "comparison 0"),
    ("[" * 100_000 + "]" * 100_000, "comparisons.json"),
], ids=["malformed", "not a list", "not objects", "deeply nested"])
def test_malformed_comparisons(tiny_run: Path, tmp_path: Path, content: str, what: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy_run(tiny_run, tmp_path / "run")
    (d / "comparisons.json").write_text(content)
    before = (d / "report.md").read_bytes()
    rc, _, err = _cli(["report", d], capsys)
    assert rc == 1
    _one_error(err, what)
    assert (d / "report.md").read_bytes() == before, "a refused report leaves the old one intact"
    rc, _, err = _cli(["known", "--run", d], capsys)
    assert rc in (1, 2)
    _one_error(err, "comparisons.json")


def test_malformed_ab_json(tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy_run(tiny_run, tmp_path / "run")
    (d / "ab").mkdir()
    (d / "ab" / "ab.json").write_text('{"kind": "ab", "target": "llama"}')
    rc, _, err = _cli(["report", d], capsys)
    assert rc == 1
    _one_error(err, "ab.json")


# ---------------------------------------------------------------- false verdicts


def _plant_schema_99(recs: list[dict[str, Any]]) -> int:
    recs[0]["schema_version"] = 99
    return 1


def _plant_dup_index(recs: list[dict[str, Any]]) -> int:
    plains = [i for i, r in enumerate(recs) if r["type"] == "plain"]
    recs[plains[1]]["index"] = recs[plains[0]]["index"]
    return plains[1] + 1


def _plant_negative_id(recs: list[dict[str, Any]]) -> int:
    recs[0]["prompt"]["token_ids"][0] = -7
    return 1


@pytest.mark.parametrize("plant", [_plant_schema_99, _plant_dup_index, _plant_negative_id],
                         ids=["schema_version 99", "duplicated index", "negative id"])
def test_report_validates_traces_first(tiny_run: Path, tmp_path: Path,
                                       plant: Callable[[list[dict[str, Any]]], int],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy_run(tiny_run, tmp_path / "run")
    victim = _engine_trace(d, "plain")
    recs = _records(victim)
    line = plant(recs)
    _write_records(victim, recs)
    rc, out, err = _cli(["report", d], capsys)
    assert rc == 1
    _one_error(err, f"{victim.name}:{line}:")
    assert "CONFORMS" not in out


def test_killed_run_is_incomplete(tiny_run: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy_run(tiny_run, tmp_path / "run")
    (d / "comparisons.json").unlink()
    marker = json.loads((d / ".specparity-run.json").read_text())
    marker.update(state="running", pid=2**22 + 12345)  # a dead run: its lock is not held
    (d / ".specparity-run.json").write_text(json.dumps(marker))
    rc, out, err = _cli(["report", d], capsys)
    assert rc == 1
    md = (d / "report.md").read_text()
    assert "**INCOMPLETE" in md and "CONFORMS" not in md, md[:400]
    assert "stopped before finishing" in md and "no comparisons.json" in md
    assert "INCOMPLETE" in err


def test_fewer_comparisons_than_cases(tiny_run: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy_run(tiny_run, tmp_path / "run")
    comps = json.loads((d / "comparisons.json").read_text())
    assert comps
    (d / "comparisons.json").write_text(json.dumps([c for c in comps if c["kind"] != "spec-vs-plain"]))
    rc, _, _ = _cli(["report", d], capsys)
    assert rc == 1
    md = (d / "report.md").read_text()
    assert "**INCOMPLETE" in md and "have no comparison" in md


def test_failed_marker_is_incomplete(tiny_run: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy_run(tiny_run, tmp_path / "run")
    marker = json.loads((d / ".specparity-run.json").read_text())
    marker.update(state="failed", error="OSError: planted")
    (d / ".specparity-run.json").write_text(json.dumps(marker))
    rc, _, _ = _cli(["report", d], capsys)
    assert rc == 1
    assert "planted" in (d / "report.md").read_text()


def test_nan_logits_target_fails_clearly(pair: tuple[Path, Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    import mlx.core as mx

    bad = tmp_path / "nan-target"
    shutil.copytree(pair[0], bad)
    weights = mx.load(str(bad / "model.safetensors"))
    weights = {k: (v * float("nan") if "norm" in k else v) for k, v in weights.items()}
    mx.save_safetensors(str(bad / "model.safetensors"), weights)
    trace = tmp_path / "t.jsonl"
    for extra in ([], ["--draft", str(pair[1])]):
        rc, out, err = _cli(["generate", "--target", bad, "-n", "8", "--prompt-ids", "5,6",
                             "--trace", trace, *extra], capsys)
        assert rc == 1, (out, err)
        _one_error(err, "non-finite logits")
        assert not trace.exists()


# ---------------------------------------------------------------- unbounded work


def test_validate_refuses_unbounded_input(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from traces import io

    monkeypatch.setattr(io, "MAX_LINE_BYTES", 1 << 20)
    big = tmp_path / "big.jsonl"
    big.write_text("[" + ",".join(["12345"] * 900_000) + "]\n")  # ~5 MB on one line
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("x\n" * 100_000)
    t0 = time.monotonic()
    rc, out, err = _cli(["trace", "validate", "/dev/zero", big, garbage], capsys)
    assert time.monotonic() - t0 < 30
    assert rc == 1 and "Traceback" not in out + err
    assert "/dev/zero: file: not a regular file" in out
    assert f"{big}:1: file: line longer than" in out
    assert "more problems" in out and len(out.splitlines()) < 300


def test_absurd_max_tokens(capsys: pytest.CaptureFixture[str], no_jobs: None) -> None:
    from specparity import args

    rc, _, err = _cli(["run", "--max-tokens", "2000000"], capsys)
    assert rc == 2
    _one_error(err, "absurd")
    assert args.max_tokens("40000") == 40000
    assert "warning" in capsys.readouterr().err


# ---------------------------------------------------------------- lost or mixed data


def test_second_run_into_locked_out_is_refused(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.outdir import DirLock

    out = tmp_path / "run"
    out.mkdir()
    with DirLock(out, "another run"):
        rc, _, err = _cli(["run", "--targets", "llama", "--drafters", "self", "--gammas", "1",
                           "--prompts", "1", "--max-tokens", "4", "--out", out], capsys)
    assert rc == 2
    _one_error(err, str(out), "another specparity process", "another run")
    assert not (out / "traces").exists()


def test_second_regen_on_locked_golden_dir_is_refused(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.outdir import DirLock

    gdir = tmp_path / "golden"
    gdir.mkdir()
    with DirLock(gdir, "specparity regen --runner engine"):
        rc, _, err = _cli(["regen", "--golden-dir", gdir, "--case", "nothing-matches",
                           "--report", tmp_path / "rep"], capsys)
    assert rc == 2
    _one_error(err, "--golden-dir", "golden directory")
    assert not (gdir / "manifest.json").exists()


def test_rerun_clears_stale_rows(tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An earlier run's rows (listed in its marker) are set aside; a file no run wrote is refused
    (issue 23: it is never moved or deleted), so no stale row reaches the report either way."""
    d = _copy_run(tiny_run, tmp_path / "run")
    stale = d / "traces" / "engine" / "stale__case.jsonl"
    recs = _records(_engine_trace(d, "plain"))
    recs[0]["case_id"] = "qwen3/plain/STALE-ROW/n4"
    _write_records(stale, recs)
    argv = ["run", "--targets", "llama", "--drafters", "self", "--gammas", "1", "--prompts", "1",
            "--max-tokens", "4", "--runners", "", "--out", d]
    rc, _, err = _cli(argv, capsys)
    assert rc == 2, err
    _one_error(err, "stale__case.jsonl", "no specparity command wrote")
    assert stale.exists() and "STALE-ROW" not in (d / "report.md").read_text()
    marker = json.loads((d / ".specparity-run.json").read_text())
    marker["files"].append("traces/engine/stale__case.jsonl")  # now the earlier run wrote it
    (d / ".specparity-run.json").write_text(json.dumps(marker))
    rc, _, err = _cli(argv, capsys)
    assert rc == 0, err
    assert "moved to .previous-run/" in err
    assert not stale.exists() and not (d / ".previous-run").exists()
    assert "STALE-ROW" not in (d / "report.md").read_text()
    assert_whole_files(d)


def _enospc(*_a: object, **_k: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_writing_report(tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy_run(tiny_run, tmp_path / "run")
    before = (d / "report.md").read_bytes()
    monkeypatch.setattr(os, "fsync", _enospc)
    rc, _, err = _cli(["report", d], capsys)
    monkeypatch.undo()
    assert rc == 1
    _one_error(err, "No space left")
    assert (d / "report.md").read_bytes() == before
    assert_whole_files(d)


def test_disk_full_during_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    from specparity import run as run_mod

    out = tmp_path / "run"

    def full(path: Any, text: str) -> None:
        if Path(path).name == "comparisons.json":
            _enospc()
        from traces.io import atomic_write_text

        atomic_write_text(path, text)

    monkeypatch.setattr(run_mod, "atomic_write_text", full)
    rc, _, err = _cli(["run", "--targets", "llama", "--drafters", "self", "--gammas", "1",
                       "--prompts", "1", "--max-tokens", "4", "--runners", "", "--out", out], capsys)
    assert rc == 1
    _one_error(err, "No space left", "free some space")
    assert not (out / "comparisons.json").exists()
    assert_whole_files(out)
    marker = json.loads((out / ".specparity-run.json").read_text())
    assert marker["state"] == "failed"


# ---------------------------------------------------------------- finished work thrown away


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
        rc, out, err = _cli(argv, capsys)
        assert rc == 2, err
        _one_error(err, str(afile))
        assert "prompts" not in err and out == "", "refused before any measurement"
    assert afile.read_text() == "keep me"


def test_ab_prints_results_before_a_failing_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import specparity.ab as ab

    def full(*_a: object, **_k: object) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ab" / "ab.json"))

    monkeypatch.setattr(ab, "write_ab", full)
    rc, out, err = _cli(["ab", "--target", "llama", "--drafter-a", "self", "--drafter-b", "twin",
                         "--prompts", "2", "--allow-small", "--max-tokens", "4",
                         "--out", tmp_path / "ab"], capsys)
    assert rc == 1
    assert "A/B llama" in out and "acceptance" in out, "the verdict is printed before writing"
    _one_error(err, "ab.json", "No space left", "verdict above is complete")


# ---------------------------------------------------------------- environment dispatch


def test_every_available_runner_is_dispatchable(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every reference 'installed', run either dispatches a runner or skips it with a reason."""
    import oracles
    from specparity import run as run_mod
    from specparity.cases import Case
    from specparity.runners import run_case

    monkeypatch.setattr(oracles, "availability", lambda name: (True, "ok"))
    runners, skipped = run_mod.available_runners(None)
    assert "hf_prompt_lookup" in skipped and "conformance/" in skipped["hf_prompt_lookup"]
    for name in runners[1:]:
        try:
            run_case(name, Case("llama", None, zoo.prompts()[0].id, 0, 4))
        except ValueError as exc:
            assert "unknown runner" not in str(exc), (name, exc)
        except Exception:  # noqa: S110 - not installed here; only dispatch is checked
            pass


# ---------------------------------------------------------------- figures, progress, modes


def test_no_unpaired_timings_in_report(tiny_run: Path) -> None:
    for name in ("report.md", "summary.md"):
        text = (tiny_run / name).read_text()
        tables = [ln for ln in text.splitlines() if ln.startswith("|")]
        assert tables, name
        for col in ("speedup", "tok_per_s", "tok/s", "wall"):
            assert not any(col in ln for ln in tables), (name, col)
        assert "specparity bench" in text


def test_progress_lines_when_not_a_tty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _cli(["run", "--targets", "llama", "--drafters", "self", "--gammas", "1",
                       "--prompts", "1", "--max-tokens", "4", "--runners", "", "--out",
                       tmp_path / "run"], capsys)
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("running cases:")]
    assert lines and lines[-1].startswith("running cases: 2/2"), err
    assert "\r" not in err


def test_published_file_modes(tiny_run: Path, tmp_path: Path) -> None:
    from specparity.goldens import save_manifest
    from traces.io import atomic_write_json

    old = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "x.json", {"a": 1})
        save_manifest({"goldens": {}}, tmp_path / "g")
        files = [tmp_path / "x.json", tmp_path / "g" / "manifest.json",
                 *tiny_run.rglob("*.jsonl"), tiny_run / "comparisons.json", tiny_run / "report.md"]
        for p in files:
            assert (p.stat().st_mode & 0o777) == 0o644, (p, oct(p.stat().st_mode))
    finally:
        os.umask(old)


def test_goldens_are_location_independent() -> None:
    from specparity.goldens import GOLDEN_DIR

    for p in sorted(Path(GOLDEN_DIR).rglob("*.jsonl"))[:400]:
        header = json.loads(p.open().readline())
        for role in ("target", "drafter"):
            ident = header.get(role)
            if isinstance(ident, dict) and ident.get("path"):
                assert not Path(ident["path"]).is_absolute(), (p, ident["path"])


# ---------------------------------------------------------------- markdown, any folder


def test_markdown_injection_escaped(tiny_run: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "folder"
    d.mkdir()
    recs = _records(_engine_trace(tiny_run, "spec"))
    recs[0]["case_id"] = "<script>alert(1)</script>|`x`"
    recs[0]["prompt"]["id"] = "<img src=x onerror=alert(2)>"
    recs[0]["target"]["path"] = "zoo/<b>bold</b>"
    _write_records(d / "evil.jsonl", recs)
    rc, _, err = _cli(["report", d], capsys)
    assert rc == 1 and "Traceback" not in err  # no comparisons: INCOMPLETE, but a report
    md = (d / "report.md").read_text()
    html = (d / "report.html").read_text()
    for raw in ("<script>", "<img src=x", "<b>bold"):
        assert raw not in md, raw
        assert raw not in html.split("<body>")[1], raw
    assert "&lt;script&gt;" in md


def test_report_on_any_trace_folder(tiny_run: Path, pair: tuple[Path, Path], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "folder"
    d.mkdir()
    for i, ids in enumerate(("5,6", "7,8")):
        assert main(["generate", "--target", str(pair[0]), "--draft", str(pair[1]), "-n", "4",
                     "--prompt-ids", ids, "--trace", str(d / f"gen{i}.jsonl")]) == 0
    assert main(["generate", "--target", str(pair[0]), "-n", "4", "--prompt-ids", "5,6",
                 "--trace", str(d / "plain.jsonl")]) == 0
    shutil.copy(_engine_trace(tiny_run, "spec"), d / "zoo-spec.jsonl")
    ref = _records(_engine_trace(tiny_run, "plain"))
    ref[0]["runner"] = {"name": "mlx_lm", "package": "mlx-lm", "version": "0", "commit": None}
    (d / "sub").mkdir()
    _write_records(d / "sub" / "ref.jsonl", ref)
    capsys.readouterr()
    rc, _, err = _cli(["report", d], capsys)
    assert rc == 1 and "Traceback" not in err and "internal error" not in err, err
    assert "INCOMPLETE" in err, err
    md = (d / "report.md").read_text()
    cases = md.split("## Cases")[1].split("##")[0]
    rows = [ln for ln in cases.splitlines() if ln.startswith("|") and "---" not in ln][1:]
    assert len(rows) == 5, cases
    assert "INCOMPLETE" in md


def test_device_and_symlink_destinations_are_not_replaced(pair: tuple[Path, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """An atomic rename over /dev/null (or a FIFO) would destroy the device node: written in place."""
    import stat

    from traces.io import atomic_write_text

    real = tmp_path / "real.jsonl"
    real.write_text(json.dumps({"type": "header", "schema_version": 1}) + "\n")  # an earlier trace
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    for dest in ("/dev/null", link):
        rc, _, err = _cli(["generate", "--target", pair[0], "-n", "4", "--prompt-ids", "5,6",
                           "--trace", dest], capsys)
        assert rc == 0, err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode), "/dev/null was replaced"
    assert link.is_symlink() and _records(real)[0]["type"] == "header"
    atomic_write_text("/dev/null", "x")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


SWEEP_VALUES = ["nan", "-1", "99999999999999999999", "/dev/zero", "a\x00b"]


def test_flag_sweep_every_flag_of_every_command(pair: tuple[Path, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option of every command (found by introspection, so new flags are covered) x bad
    values: no traceback, no internal error; a refusal is one line. Accepted values start no
    work here (the job functions are stubbed)."""
    import argparse
    import contextlib
    import io

    import engine.executor
    import specparity.ab
    import specparity.bench
    import specparity.regen
    import specparity.run
    from specparity.cli import build_parser

    class Started(Exception):
        pass

    def started(*_a: object, **_k: object) -> None:
        raise Started()

    for mod, name in ((specparity.run, "run_cases"), (specparity.run, "run_task"),
                      (specparity.run, "execute"), (specparity.ab, "run_ab"),
                      (specparity.bench, "run_bench"), (specparity.regen, "regen"),
                      (engine.executor, "spec_generate"), (engine.executor, "plain_generate")):
        monkeypatch.setattr(mod, name, started)
    base = {"generate": ["--target", str(pair[0]), "--prompt-ids", "5,6", "-n", "4"],
            "record": ["--runner", "mlx_lm", "--target", str(pair[0]), "--prompt-ids", "5,6", "-n", "4"],
            "ab": ["--target", "llama", "--drafter-a", "twin", "--drafter-b", "small"]}
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    tried, bad = 0, []
    for cmd, p in sub.choices.items():
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        for words, sp in ([([cmd], p)] if not nested else
                          [([cmd, n], q) for n, q in nested[0].choices.items()]):
            for act in sp._actions:
                if not act.option_strings or act.nargs == 0 or act.dest == "help":
                    continue
                flag = act.option_strings[-1]
                for value in SWEEP_VALUES:
                    argv = [*words, *base.get(cmd, [])]
                    if flag in argv:
                        i = argv.index(flag)
                        del argv[i:i + 2]
                    argv += [flag, value]
                    err = io.StringIO()
                    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                        rc = main(argv)
                    tried += 1
                    text = err.getvalue()
                    if "Started" in text:
                        continue  # accepted: a valid value for this flag
                    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(
                        ("running cases", "specparity: warning", "bench:", "ab:"))]
                    if "Traceback" in text or "internal error" in text or (rc != 0 and len(lines) != 1):
                        bad.append((argv, rc, text[-300:]))
    print(f"flag sweep: {tried} inputs")
    assert tried > 500
    assert not bad, bad[:5]


def test_package_data_ignores_the_working_directory(tmp_path: Path, tiny_run: Path) -> None:
    """Issue 14 item 7: a ``traces/`` folder in the cwd (here with a broken schema) changes nothing."""
    from traces import validate

    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "schema.json").write_text("{broken")
    (tmp_path / "traces" / "known_divergences.toml").write_text("broken = [")
    assert Path.cwd() == tmp_path
    validate.load_schema.cache_clear()
    validate._validator.cache_clear()
    assert validate.load_schema()["$defs"]["header"]
    assert all(validate.validate_file(p) == [] for p in tiny_run.rglob("*.jsonl"))
    from traces.reference import known_entries

    assert known_entries()


# ================================================================ issue 23: output safety and rough edges
# (wt/hosta) Three classes of issue 23, each input planted with its expected outcome:
#   1. destroying what is not ours: no input deletes or overwrites a file no specparity command
#      wrote; the last finished run survives unfinished ones; bench/audit files are atomic;
#   2. a verdict before the work is done: summary.md is written last; a failure or a signal in
#      the report step leaves INCOMPLETE (or nothing) and a non-zero exit;
#   3. rough edges: SIGTERM is one line + exit 143 with locks released; over-long paths, ~user,
#      a 2^70 seed, a bad config.json and a case id starting with "." are one usage line.

HOSTILE_23: dict[str, list[str]] = {
    "destroying what is not ours": [
        "run --out . in a checkout (traces/ package, summary.md, report.md)",
        "run --out DIR holding a user's notes.txt", "run --out DIR holding a user's report_files/x.png",
        "run --out DIR whose .previous-run/ is not ours", "grade --out DIR holding user files",
        "run dir of an older specparity (no file list): recognised outputs set aside",
        "older run dir + a user's notes.txt", "older run dir + a user's summary.md",
        "a listed output replaced by a symlink to a user's file",
        "report DIR with a user's report.md", "report DIR with a user's report.html",
        "bench --out DIR with a user's bench.json", "ab --out DIR with a user's ab.md",
        "grade --engine --out DIR with a user's NAME.json", "grade --engine with a user's scoreboard.md",
        "regen --golden-dir with a user's manifest.json", "regen --golden-dir with a user's .x.tmp",
        "regen --report DIR with a user's drift.md", "record --out DIR with a user's file at the trace path",
        "audit --json a user's file", "generate --trace a user's file",
        "generate --trace a symlink to a user's file",
        "invariant: every dir-writing command on a dir of user files (run, grade, report, bench, ab, "
        "regen --report, regen --golden-dir, record --out, grade --engine) leaves every byte",
        "two unfinished runs after a finished one: the finished one is kept",
        "a finished run replaced only once the new run completes",
        "bench.json: a failed write leaves the old file", "audit --json: a failed write leaves no file",
        "bench files listed, not foreign, for a later run into the same dir",
    ],
    "a verdict before the work is done": [
        "planted failure in the report step", "SIGTERM in the report step", "Ctrl-C in the summary step",
        "full disk writing summary.md", "full disk writing comparisons.json (summary absent)",
        "SIGTERM to a real `specparity run` process (test_crash_safety)",
    ],
    "rough edges": [
        "SIGTERM: run", "SIGTERM: ab", "SIGTERM: bench", "SIGTERM: regen", "SIGTERM: generate",
        "SIGTERM: audit", "SIGTERM: grade",
        "--out with a 300-byte component", "--out past PATH_MAX", "--trace with a 300-byte name",
        "--json past PATH_MAX", "--report with a 300-byte component", "record --out 300-byte component",
        "long model dir name -> case ids past 255 bytes as file names",
        "--seed 2^70 (generate, run, bench)", "--out ~nosuchuser/x", "--target ~nosuchuser/m",
        "--prompts-file ~nosuchuser/p", "--trace ~nosuchuser/t", "report ~nosuchuser",
        "config.json without model_type", "config.json with a string vocab_size",
        "config.json with vocab_size true", "config.json with a string eos_token_id",
        "config.json with text_config.hidden_size 0", "case id starting with '.' (run)",
        "case id starting with '.' (grade)",
    ],
}


def test_catalogue_counts_issue_23() -> None:
    counts = {k: len(v) for k, v in HOSTILE_23.items()}
    print("issue 23 (wt/hosta):", counts, "total", sum(counts.values()))
    assert sum(counts.values()) >= 50, counts


RUN_TINY = ["run", "--targets", "llama", "--drafters", "self", "--gammas", "1", "--prompts", "1",
            "--max-tokens", "4", "--runners", ""]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def _user_dir(root: Path, names: list[str]) -> dict[str, bytes]:
    """A directory of a user's files under names specparity writes; its snapshot."""
    root.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"user file {i}: {name}\n")
    return _snapshot(root)


# ---------------------------------------------------------------- 1. destroying what is not ours


def test_out_dot_in_a_checkout_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          no_jobs: None) -> None:
    checkout = tmp_path / "checkout"
    before = _user_dir(checkout, ["traces/__init__.py", "traces/io.py", "summary.md", "report.md",
                                  "comparisons.json", "report_files/logo.png", "README.md"])
    os.chdir(checkout)
    rc, out, err = _cli([*RUN_TINY, "--out", "."], capsys)
    assert rc == 2, err
    _one_error(err, "--out", "no specparity command wrote", "nothing was moved or deleted")
    assert _snapshot(checkout) == before
    assert not (checkout / ".previous-run").exists() and not (checkout / ".specparity-run.json").exists()


@pytest.mark.parametrize("names", [["notes.txt"], ["report_files/x.png"], ["traces/engine/mine.jsonl"],
                                   [".previous-run/keep.txt"]],
                         ids=["notes.txt", "report_files/x.png", "a trace of mine", ".previous-run"])
def test_run_into_a_finished_run_with_user_files_is_refused(
        tiny_run: Path, tmp_path: Path, names: list[str], capsys: pytest.CaptureFixture[str],
        no_jobs: None) -> None:
    d = _copy_run(tiny_run, tmp_path / "run")
    _user_dir(d, names)
    before = _snapshot(d)
    rc, _, err = _cli([*RUN_TINY, "--out", d], capsys)
    assert rc == 2, err
    _one_error(err, str(d), names[0].split("/")[0])
    assert _snapshot(d) == before


@pytest.mark.parametrize("user", [None, "notes.txt", "summary.md"])
def test_run_dir_of_an_older_specparity(tiny_run: Path, tmp_path: Path, user: str | None,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A run directory whose marker predates file lists: its outputs are recognised by content
    (moved aside as before); anything else, even under an output's name, is refused."""
    d = _copy_run(tiny_run, tmp_path / "run")
    marker = json.loads((d / ".specparity-run.json").read_text())
    del marker["files"], marker["added"]
    (d / ".specparity-run.json").write_text(json.dumps(marker))
    if user is not None:
        (d / user).write_text("a user's own file\n")
    before = _snapshot(d)
    rc, _, err = _cli([*RUN_TINY, "--out", d], capsys)
    if user is None:
        assert rc == 0 and "moved to .previous-run/" in err, err
        return
    assert rc == 2, err
    _one_error(err, user, "no specparity command wrote")
    assert _snapshot(d) == before


def test_listed_output_replaced_by_a_symlink_is_not_written_through(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_jobs: None) -> None:
    from specparity.outdir import add_outputs

    d = tmp_path / "bench"
    with add_outputs(d, "test") as claim:
        (claim.track(d / "bench.json")).write_text("{}")
    (d / "bench.json").unlink()
    secret = tmp_path / "secret.txt"
    secret.write_text("mine\n")
    (d / "bench.json").symlink_to(secret)
    rc, _, err = _cli(["bench", "--out", d], capsys)
    assert rc == 2, err
    _one_error(err, "bench.json", "symbolic link")
    assert secret.read_text() == "mine\n"


def test_grade_out_with_user_files_is_refused(tiny_run: Path, tmp_path: Path, no_jobs: None,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "graded"
    before = _user_dir(out, ["summary.md", "traces/engine/x.jsonl"])
    rc, _, err = _cli(["grade", tiny_run / "traces" / "engine", "--out", out, "--runners", ""], capsys)
    assert rc == 2, err
    _one_error(err, str(out), "no specparity command wrote")
    assert _snapshot(out) == before


@pytest.mark.parametrize("name", ["report.md", "report.html"])
def test_report_never_overwrites_a_users_report(tiny_run: Path, tmp_path: Path, name: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "folder"
    d.mkdir()
    shutil.copy(_engine_trace(tiny_run, "spec"), d / "t.jsonl")
    before = _user_dir(d, [name])
    rc, _, err = _cli(["report", d], capsys)
    assert rc == 2, err
    _one_error(err, name, "not written by specparity")
    assert _snapshot(d) == before
    (d / name).unlink()  # without it, the report is written and listed as ours; a re-report is fine
    assert _cli(["report", d], capsys)[0] == 1  # INCOMPLETE: a folder without comparisons
    assert _cli(["report", d], capsys)[0] == 1
    assert "report.md" in json.loads((d / ".specparity-run.json").read_text())["files"]


def _a_subject() -> str:
    from subjects import SUBJECTS

    return next(iter(SUBJECTS))


@pytest.mark.parametrize("argv,name", [
    (["bench", "--out", "{d}"], "bench.json"),
    (["grade", "--engine", "{subject}", "--out", "{d}"], "{subject}.json"),
    (["grade", "--engine", "{subject}", "--out", "{d}"], "scoreboard.md"),
    (["regen", "--case", "nothing-matches", "--golden-dir", "{d}", "--report", "{d}/rep"],
     "manifest.json"),
    (["regen", "--case", "nothing-matches", "--golden-dir", "{d}", "--report", "{d}/rep"],
     "engine/.x.tmp"),
    (["ab", "--target", "llama", "--drafter-a", "self", "--drafter-b", "twin", "--out", "{d}"], "ab.md"),
    (["regen", "--case", "nothing-matches", "--report", "{d}"], "drift.md"),
], ids=["bench", "grade --engine NAME.json", "grade --engine scoreboard.md",
         "regen --golden-dir manifest.json", "regen --golden-dir .x.tmp", "ab", "regen --report"])
def test_named_outputs_never_overwrite_user_files(tmp_path: Path, argv: list[str], name: str,
                                                  capsys: pytest.CaptureFixture[str],
                                                  no_jobs: None) -> None:
    d = tmp_path / "out"
    name = name.replace("{subject}", _a_subject())
    before = _user_dir(d, [name])
    rc, out, err = _cli([a.replace("{d}", str(d)).replace("{subject}", _a_subject())
                         for a in argv], capsys)
    assert rc == 2, err
    _one_error(err, name, "not written by specparity" if "--golden-dir" not in argv else "not goldens")
    assert _snapshot(d) == before
    assert not (d / ".specparity.lock").exists(), "lock released"


def test_record_out_never_overwrites_user_files(pair: tuple[Path, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "rec"
    argv = ["record", "--runner", "engine", "--target", pair[0], "--prompt-ids", "5,6", "-n", "4",
            "--out", d]
    assert _cli(argv, capsys)[0] == 0
    assert _cli(argv, capsys)[0] == 0, "our own trace is replaced"
    (trace,) = (d / "engine").glob("*.jsonl")
    user = tmp_path / "user"  # the same name in a folder of the user's
    (user / "engine").mkdir(parents=True)
    (user / "engine" / trace.name).write_text("my own notes\n")
    before = _snapshot(user)
    rc, _, err = _cli([*argv[:-1], user], capsys)
    assert rc == 2, err
    _one_error(err, trace.name, "not written by specparity")
    assert _snapshot(user) == before


@pytest.mark.parametrize("cmd", ["audit", "generate", "generate via symlink"])
def test_single_output_files_never_overwrite_user_files(pair: tuple[Path, Path], tmp_path: Path,
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
            ["generate", "--target", pair[0], "--prompt-ids", "5,6", "-n", "4", "--trace", dest])
    rc, out, err = _cli(argv, capsys)
    assert rc == 2, err
    _one_error(err, "--json" if cmd == "audit" else "--trace", "refusing to overwrite")
    assert user.read_text() == '{"my": "data"}\n' and out == ""


def test_audit_json_is_atomic_and_replaces_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "audit.json"
    argv = ["audit", "--targets", "llama", "--prompts", "1", "--max-tokens", "4", "--json", dest]
    monkeypatch.setattr(os, "fsync", _enospc)
    rc, _, err = _cli(argv, capsys)
    monkeypatch.undo()
    assert rc == 1
    _one_error(err, "No space left")
    assert not dest.exists() and not list(tmp_path.glob(".*.tmp")), "no 0-byte or partial file"
    assert _cli(argv, capsys)[0] == 0
    assert json.loads(dest.read_text())["kind"] == "audit"
    assert _cli(argv, capsys)[0] == 0, "an earlier audit's file is replaced"


def test_bench_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specparity.bench import write_bench

    res = {"kind": "bench", "target": "llama", "drafter": "twin", "gamma": 3, "n_prompts": 1,
           "repeats": 1, "arms": [], "by_gamma": {}}
    monkeypatch.setattr("specparity.bench.bench_markdown", lambda r: "# bench\n")
    write_bench(res, tmp_path)
    before = _snapshot(tmp_path)
    monkeypatch.setattr(os, "fsync", _enospc)
    with pytest.raises(OSError):
        write_bench({**res, "gamma": 5}, tmp_path)
    monkeypatch.undo()
    assert _snapshot(tmp_path) == before, "a failed write leaves the old files whole"
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
    from specparity.args import Terminated

    d = tmp_path / "run"
    assert _cli([*RUN_TINY, "--out", d], capsys)[0] == 0
    finished = _snapshot(d)
    finished_traces = sorted(k for k in finished if k.startswith("traces/"))
    for n in range(2):  # two interrupted runs in a row (Terminated: as SIGTERM would)
        with monkeypatch.context() as m:
            _interrupt_in(m, "specparity.run:numerics_witness", Terminated())
            rc, _, err = _cli([*RUN_TINY, "--out", d], capsys)
        assert rc == 143, err
        kept = d / ".previous-run"
        assert "**CONFORMS**" in (kept / "summary.md").read_text(), f"after {n + 1} interrupted runs"
        assert sorted(p.relative_to(kept).as_posix() for p in kept.rglob("traces/*/*.jsonl")) \
            == finished_traces
        assert "INCOMPLETE" in (d / "summary.md").read_text()
    assert _cli([*RUN_TINY, "--out", d], capsys)[0] == 0
    assert not (d / ".previous-run").exists(), "removed once a new run completed"
    assert "**CONFORMS**" in (d / "summary.md").read_text()


def test_every_dir_writing_command_leaves_user_files(tiny_run: Path, pair: tuple[Path, Path],
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
        ["record", "--runner", "engine", "--target", pair[0], "--prompt-ids", "5,6", "-n", "4",
         "--out", "{d}"],
        ["grade", "--engine", _a_subject(), "--out", "{d}"],
        ["regen", "--case", "nothing-matches", "--golden-dir", "{d}", "--report", "{d}/rep"],
    ]
    for i, argv in enumerate(commands):
        d = tmp_path / f"d{i}"
        before = _user_dir(d, names)
        rc, _, err = _cli([str(a).replace("{d}", str(d)) for a in argv], capsys)
        assert "Traceback" not in err, err
        after = _snapshot(d)
        assert {k: after.get(k) for k in before} == before, (argv[0], err)


# ---------------------------------------------------------------- 2. a verdict before the work is done


def _verdict_state(d: Path) -> tuple[str | None, bool, str]:
    summary = (d / "summary.md").read_text() if (d / "summary.md").exists() else None
    marker = json.loads((d / ".specparity-run.json").read_text())
    return summary, (d / "report.md").exists(), marker["state"]


@pytest.mark.parametrize("where,how,rc_want", [
    ("reports.report:_build", "error", 1),
    ("reports.report:_build", "sigterm", 143),
    ("reports.summary:tau_table", "ctrl-c", 130),
    ("reports.summary:atomic_write_text", "disk full", 1),
], ids=["failure in the report", "SIGTERM in the report", "Ctrl-C in the summary",
        "disk full writing summary.md"])
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
    rc, out, err = _cli([*RUN_TINY, "--out", d], capsys)
    monkeypatch.undo()
    assert rc == rc_want, err
    assert "CONFORMS" not in out
    summary, has_report, state = _verdict_state(d)
    assert state == "failed"
    assert summary is None or ("INCOMPLETE" in summary and "CONFORMS" not in summary), summary
    if how != "disk full":
        assert summary is not None and "while writing the" in summary, summary
    assert not has_report, "a report written from inside the run (it read CONFORMS) is removed"
    assert (d / "comparisons.json").exists() and list(d.glob("traces/engine/*.jsonl")), "work kept"
    assert_whole_files(d)
    if how in ("sigterm", "ctrl-c"):
        (line,) = [ln for ln in err.strip().splitlines() if not ln.startswith("running cases")]
        assert "interrupted by" in line and "summary.md says INCOMPLETE" in line, line
    rc, _, _ = _cli(["report", d], capsys)
    assert rc == 1 and "**INCOMPLETE" in (d / "report.md").read_text()


# ---------------------------------------------------------------- 3. rough edges


SIGTERM_AT = [
    ("run", [*RUN_TINY, "--out", "{d}"], "specparity.run:run_cases"),
    ("ab", ["ab", "--target", "llama", "--drafter-a", "self", "--drafter-b", "twin", "--out", "{d}"],
     "specparity.ab:run_ab"),
    ("bench", ["bench", "--out", "{d}"], "specparity.bench:run_bench"),
    ("regen", ["regen", "--golden-dir", "{d}", "--case", "x", "--report", "{d}/rep"],
     "specparity.regen:_regen"),
    ("generate", ["generate", "--target", "{t}", "--prompt-ids", "5,6", "-n", "4", "--trace",
                  "{d}/t.jsonl"], "engine.executor:plain_generate"),
    ("audit", ["audit", "--targets", "llama", "--prompts", "1", "--max-tokens", "4", "--json",
               "{d}/a.json"], "specparity.commands.audit:target_figures"),
    ("grade", ["grade", "{run}/traces/engine", "--out", "{d}", "--runners", ""],
     "specparity.grade:_grade"),
]


@pytest.mark.parametrize("name,argv,where", SIGTERM_AT, ids=[s[0] for s in SIGTERM_AT])
def test_sigterm_is_one_line_and_143(tiny_run: Path, pair: tuple[Path, Path], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch, name: str, argv: list[str],
                                     where: str, capsys: pytest.CaptureFixture[str]) -> None:
    import signal

    d = tmp_path / "out"
    _interrupt_in(monkeypatch, where, sig=signal.SIGTERM)
    argv = [str(a).replace("{d}", str(d)).replace("{t}", str(pair[0])).replace("{run}", str(tiny_run))
            for a in argv]
    rc, _, err = _cli(argv, capsys)
    monkeypatch.undo()
    assert rc == 143, err
    lines = [ln for ln in err.splitlines()
             if ln.strip() and not ln.startswith(("device", "bench:", "running cases", "grading"))]
    assert len(lines) == 1 and f"specparity {name}: interrupted by SIGTERM" in lines[0], err
    assert "Traceback" not in err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "handler restored"
    if d.exists():
        assert not list(d.rglob(".specparity.lock")), "lock released"
        assert_whole_files(d)
        for marker in d.rglob(".specparity-run.json"):
            assert json.loads(marker.read_text())["state"] != "running"
    assert not (d / "t.jsonl").exists() and not (d / "a.json").exists()


LONG = "x" * 300


@pytest.mark.parametrize("argv,flag", [
    ([*RUN_TINY, "--out", f"{LONG}/run"], "--out"),
    ([*RUN_TINY, "--out", "/".join(["y" * 200] * 21)], "--out"),
    (["generate", "--target", "{t}", "--prompt-ids", "5", "-n", "2", "--trace", f"{LONG}.jsonl"],
     "--trace"),
    (["audit", "--targets", "llama", "--json", "/".join(["z" * 200] * 21) + ".json"], "--json"),
    (["regen", "--case", "x", "--report", f"r/{LONG}"], "--report"),
    (["record", "--runner", "engine", "--target", "{t}", "--prompt-ids", "5", "-n", "2", "--out",
      f"{LONG}"], "--out"),
    (["bench", "--out", f"{LONG}"], "--out"),
    (["grade", ".", "--out", f"{LONG}"], "--out"),
], ids=["run --out component", "run --out PATH_MAX", "generate --trace", "audit --json",
        "regen --report", "record --out", "bench --out", "grade --out"])
def test_over_long_paths_are_one_line(pair: tuple[Path, Path], argv: list[str], flag: str,
                                      capsys: pytest.CaptureFixture[str], no_jobs: None) -> None:
    rc, _, err = _cli([a.replace("{t}", str(pair[0])) for a in argv], capsys)
    assert rc == 2, err
    _one_error(err, flag, "long")


def test_long_case_ids_become_short_file_names(pair: tuple[Path, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cases import STEM_MAX_BYTES, file_stem

    model = tmp_path / ("m" * 250)
    shutil.copytree(pair[0], model)
    prompts = tmp_path / "p.txt"
    prompts.write_text("ba de fi\n")
    d = tmp_path / "run"
    rc, _, err = _cli(["run", "--target", model, "--prompts-file", prompts, "--max-tokens", "4",
                       "--runners", "", "--out", d, "--quiet"], capsys)
    assert rc == 0, err
    (trace,) = (d / "traces" / "engine").glob("*.jsonl")
    assert len(trace.stem.encode()) <= STEM_MAX_BYTES and "m" * 150 in trace.stem
    assert file_stem("a" * 300) != file_stem("a" * 299 + "b"), "cut ids stay distinct"
    assert file_stem("llama/twin/nat-00/g1/n4") == "llama__twin__nat-00__g1__n4", "short ids unchanged"


@pytest.mark.parametrize("argv,flag", [
    (["generate", "--target", "{t}", "--prompt-ids", "5", "-n", "2", "--seed", str(2**70)], "--seed"),
    ([*RUN_TINY, "--seed", str(2**70)], "--seed"),
    (["bench", "--size", "tiny", "--seed", str(2**70)], "--seed"),
    ([*RUN_TINY, "--out", "~nosuchuser-23/x"], "no such user"),
    (["generate", "--target", "~nosuchuser-23/m", "--prompt-ids", "5"], "no such user"),
    (["run", "--target", "{t}", "--prompts-file", "~nosuchuser-23/p"], "no such user"),
    (["generate", "--target", "{t}", "--prompt-ids", "5", "--trace", "~nosuchuser-23/t"],
     "no such user"),
    (["report", "~nosuchuser-23"], "no such user"),
], ids=["generate --seed 2^70", "run --seed 2^70", "bench --seed 2^70", "--out ~nosuchuser",
        "--target ~nosuchuser", "--prompts-file ~nosuchuser", "--trace ~nosuchuser",
        "report ~nosuchuser"])
def test_seed_and_home_paths_are_one_line(pair: tuple[Path, Path], argv: list[str], flag: str,
                                          capsys: pytest.CaptureFixture[str], no_jobs: None) -> None:
    rc, out, err = _cli([a.replace("{t}", str(pair[0])) for a in argv], capsys)
    assert rc == 2, err
    _one_error(err, flag)
    assert not Path("~nosuchuser-23").exists(), "no literal '~user' directory created"


@pytest.mark.parametrize("edit,key", [
    (lambda c: c.pop("model_type"), "model_type"),
    (lambda c: c.update(vocab_size=str(c["vocab_size"])), "vocab_size"),
    (lambda c: c.update(vocab_size=True), "vocab_size"),
    (lambda c: c.update(eos_token_id="two"), "eos_token_id"),
    (lambda c: c.update(text_config={"hidden_size": 0}), "text_config.hidden_size"),
], ids=["no model_type", "string vocab_size", "vocab_size true", "string eos_token_id",
        "text_config.hidden_size 0"])
def test_bad_config_json_is_one_line(pair: tuple[Path, Path], tmp_path: Path, edit: Callable[..., Any],
                                     key: str, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "model"
    shutil.copytree(pair[0], bad)
    cfg = json.loads((bad / "config.json").read_text())
    edit(cfg)
    (bad / "config.json").write_text(json.dumps(cfg))
    prompts = tmp_path / "p.txt"
    prompts.write_text("ba de\n")
    for argv in (["generate", "--target", bad, "-n", "2", "--prompt-ids", "5"],
                 ["generate", "--target", pair[0], "--draft", bad, "-n", "2", "--prompt-ids", "5"],
                 ["run", "--target", bad, "--prompts-file", prompts, "--max-tokens", "2"],
                 ["audit", "--target", bad, "--prompts", "1"]):
        rc, _, err = _cli(argv, capsys)
        assert rc == 2, (argv, err)
        _one_error(err, "config.json", key)
    from engine.models import ModelLoadError, check_model_dir

    with pytest.raises(ModelLoadError, match=key):
        check_model_dir(bad)


def test_case_ids_starting_with_a_dot_are_not_hidden(pair: tuple[Path, Path], tiny_run: Path,
                                                     tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / ".hidden-model"
    shutil.copytree(pair[0], model)
    prompts = tmp_path / "p.txt"
    prompts.write_text("ba de fi\n")
    d = tmp_path / "run"
    rc, _, err = _cli(["run", "--target", model, "--draft", pair[1], "--prompts-file", prompts,
                       "--max-tokens", "4", "--gammas", "1", "--runners", "", "--out", d, "--quiet"],
                      capsys)
    assert rc == 0, err
    traces = list((d / "traces" / "engine").iterdir())
    assert len(traces) == 2 and not any(p.name.startswith(".") for p in traces), traces
    assert "**CONFORMS**" in (d / "report.md").read_text()
    folder = tmp_path / "engine-traces"
    folder.mkdir()
    recs = _records(_engine_trace(tiny_run, "spec"))
    recs[0]["case_id"] = ".hidden/case"
    _write_records(folder / "t.jsonl", recs)
    rc, _, err = _cli(["grade", folder, "--out", tmp_path / "graded", "--runners", "", "--quiet"],
                      capsys)
    assert rc == 0, err
    graded = list((tmp_path / "graded" / "traces" / "engine").iterdir())
    assert graded and not any(p.name.startswith(".") for p in graded), graded
