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
import re
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
    from traces import io

    monkeypatch.setattr(io, "MAX_LINE_BYTES", 1 << 20)
    big = tmp_path / "big.jsonl"
    big.write_text("[" + ",".join(["12345"] * 900_000) + "]\n")  # ~5 MB on one line
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("x\n" * 100_000)
    # no wall-clock bound: the per-test timeout catches a hang; the bounds are asserted below
    rc, out, err = _cli(["trace", "validate", "/dev/zero", big, garbage], capsys)
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


# ================================================================ issue 23 (wt/hostb)
# Three classes of issue 23, each with planted inputs and the expected outcome:
# silently misread or ignored input, grading lies, unbounded work.

HOSTILE_23: dict[str, list[str]] = {
    "silently misread or ignored input": [
        "run --targets llama,nosuch", "run --drafters twim", "run --runners mlx_lm,nosuch",
        "run --targets llama,,qwen3", "run --source warp --target llama", "audit --targets nosuch",
        "grade --runners nosuch", "zoo_cases(targets=[nosuch]) (API)",
        "JSONL prompts with a BOM", "JSON array of prompts", "JSON array cut short",
        "'[INST] hi' plain text", "JSONL prompt nested 100k deep",
        "zoo matrix --temps/--top-k/--seed/--eos-ids applied", "--top-k without a temperature",
        "--suite with --temps", "--prompts with --prompts-file",
        "every run flag honoured or refused (zoo path and user path, counted at run time)",
        "run --max-tokens 5000 on the zoo (context 2048)",
        "suite key x sweep value agrees with its flag (counted at run time)",
    ],
    "grading lies": [
        "header source 'warp-drive'", "plain header with source 'ngram'", "header γ 10^9",
        "header seed 2^70", "header max_tokens 0", "header top_k 2^40",
        "grade DIR with an earlier grade --out inside", "grade a run output itself",
        "writer prompt id 187.7", "writer prompt id '496'", "writer prompt id True",
        "writer round sample True", "writer plain sample '5'", "writer margin 'nan'",
        "make_header eos id 1.0",
    ],
    "unbounded work": [
        "report axis ticks for a γ of 10^9", "10^6-line prompts file", "zoo matrix past --max-cases",
        "suite past --max-cases", "case count announced before the run", "grade / (walk limit)",
        "grade: folders nested past the depth limit", "grade: a FIFO named x.jsonl",
        "grade: a symlink loop", "FIFO model.safetensors (load, --target)",
        "FIFO config.json", "FIFO tokenizer.json", "FIFO prompts file (suite)",
        "/dev/zero as a suite's prompts_file", "FIFO run marker (report)",
    ],
}


def test_catalogue_counts_issue_23() -> None:
    n = sum(len(v) for v in HOSTILE_23.values())
    assert n >= 45, n
    print({k: len(v) for k, v in HOSTILE_23.items()}, "total", n)


class _Started(Exception):
    """Raised by a stubbed job: the input was accepted and work would have started."""


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``specparity.run.run`` (and ``run --sessions``' job) stubbed: its arguments are kept and it
    raises :class:`_Started`."""
    import specparity.run
    import specparity.sessions

    calls: list[dict[str, Any]] = []

    def run(out: Path, **kwargs: Any) -> None:
        calls.append({"out": out, **kwargs})
        raise _Started()

    def sessions(cases: Any, out: Path, **kwargs: Any) -> None:  # run --sessions: another job
        calls.append({"out": out, "sessions": True, "cases": list(cases), **kwargs})
        raise _Started()

    monkeypatch.setattr(specparity.run, "run", run)
    monkeypatch.setattr(specparity.sessions, "main_sessions", sessions)
    return calls


def _refused(rc: int, err: str, *must: str) -> str:
    assert rc == 2, err
    return _one_error(err, *must)


# ---------------------------------------------------------------- misread or ignored input


NAME_CASES: list[tuple[list[str], str]] = [
    (["run", "--targets", "llama,nosuch"], "'nosuch'; known: llama"),
    (["run", "--drafters", "twim"], "'twim'; known: self, twin"),
    (["run", "--runners", "mlx_lm,nosuch"], "'nosuch'; known: engine, mlx_lm"),
    (["run", "--targets", "llama,,qwen3"], "llama,,qwen3"),
    (["run", "--source", "warp", "--target", "llama"], "'warp'; known: two-model"),
    (["audit", "--targets", "nosuch"], "'nosuch'; known: llama"),
    (["grade", ".", "--runners", "nosuch"], "'nosuch'; known: engine"),
]


@pytest.mark.parametrize("argv,names", NAME_CASES, ids=[" ".join(a) for a, _ in NAME_CASES])
def test_unknown_names_are_refused_with_the_known_ones(argv: list[str], names: str,
                                                      capsys: pytest.CaptureFixture[str],
                                                      captured: list[dict[str, Any]]) -> None:
    """Before: unknown names were dropped and the run conformed on fewer pairs/references."""
    rc, _, err = _cli(argv, capsys)
    _refused(rc, err, names)
    assert not captured


def test_zoo_cases_api_refuses_unknown_names() -> None:
    from specparity.run import zoo_cases

    with pytest.raises(ValueError, match="unknown zoo target.*'nosuch'.*known: llama"):
        zoo_cases(targets=["llama", "nosuch"], gammas=(1,), n_prompts=1)
    with pytest.raises(ValueError, match="unknown zoo drafter.*'twim'"):
        zoo_cases(targets=["llama"], drafters=["twim"], gammas=(1,), n_prompts=1)


def test_prompts_file_bom_json_array_and_text(tmp_path: Path) -> None:
    """A BOM is dropped (before: the JSONL was read as one text prompt per line); a JSON array
    is read as prompts; JSON-looking garbage is refused, not read as text."""
    from specparity.prompts import PromptError, read_prompts_file

    objs = [{"id": "a", "token_ids": [5, 6, 7]}, {"id": "b", "text": "ba de"}]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(o) + "\n" for o in objs).encode())
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps(objs, indent=2))
    want = [("a", None, (5, 6, 7)), ("b", "ba de", None)]
    for f in (bom, arr):
        assert [(p.id, p.text, p.token_ids) for p in read_prompts_file(f)] == want, f
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(objs)[:-5])
    with pytest.raises(PromptError, match="JSON array of prompts but is not valid JSON"):
        read_prompts_file(cut)
    bad_item = tmp_path / "item.json"
    bad_item.write_text('[{"id": "a", "text": "x"}, 5]')
    with pytest.raises(PromptError, match="item 2: expected a JSON object"):
        read_prompts_file(bad_item)
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"id": ' + "[" * 100_000 + "\n")
    with pytest.raises(PromptError, match="deep.jsonl:1"):
        read_prompts_file(deep)
    inst = tmp_path / "inst.txt"
    inst.write_text("[INST] hi [/INST]\n")
    assert [(p.id, p.text) for p in read_prompts_file(inst)] == [("line-1", "[INST] hi [/INST]")]


def test_zoo_matrix_applies_sampling_and_eos_flags(capsys: pytest.CaptureFixture[str],
                                                  captured: list[dict[str, Any]]) -> None:
    """Before: --temps/--top-k/--seed/--eos-ids were ignored on the zoo matrix (greedy only)."""
    rc, _, err = _cli(["run", "--targets", "llama", "--drafters", "twin", "--gammas", "2",
                       "--prompts", "1", "--temps", "0,0.7", "--top-k", "5", "--seed", "9",
                       "--eos-ids", "1"], capsys)
    assert rc == 1 and "_Started" in err, err
    cases = [c for c in captured[0]["cases"] if not c.grammar]  # the grammar cases: tests/test_grammar.py
    assert sorted(c.temperature for c in cases) == [0.0, 0.7]
    sampled = next(c for c in cases if c.temperature)
    assert (sampled.top_k, sampled.seed, sampled.eos_ids) == (5, 9, (1,))
    assert sampled.case_id == "llama/twin/nat-00/g2/n32/t0.7s9k5/eos1"


@pytest.mark.parametrize("argv,names", [
    (["run", "--top-k", "5"], "--top-k"),
    (["run", "--targets", "llama", "--seed", "3", "--temps", "0"], "--seed"),
    (["run", "--suite", "SUITE", "--temps", "0.5"], "--temps"),
    (["run", "--suite", "SUITE", "--gammas", "2", "--max-tokens", "8"], "--gammas, --max-tokens"),
    (["run", "--target", "llama", "--prompts-file", "P", "--prompts", "2"], "--prompts"),
], ids=["top-k greedy", "seed greedy", "suite+temps", "suite+gammas", "prompts+file"])
def test_flags_that_cannot_apply_are_refused(argv: list[str], names: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            captured: list[dict[str, Any]]) -> None:
    suite = tmp_path / "s.toml"
    suite.write_text('[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "token_ids": [5, 6]}\n')
    argv = [str(suite) if a == "SUITE" else str(prompts) if a == "P" else a for a in argv]
    rc, _, err = _cli(argv, capsys)
    _refused(rc, err, names)
    assert not captured


# A valid value other than the default for every option of `run` (a new flag fails the test
# until it is listed here): given alone, it must change what runs or be refused.
RUN_FLAG_VALUES: dict[str, list[str]] = {
    "--out": ["OUT2"], "--targets": ["qwen3"], "--drafters": ["small"], "--prompts": ["2"],
    "--target": ["TARGET"], "--draft": ["DRAFT"], "--source": ["ngram"],
    "--prompts-file": ["PROMPTS"], "--temps": ["0,0.5"], "--top-p": ["0.9"], "--top-k": ["3"],
    "--seed": ["4"], "--min-tokens": ["3"], "--rng": ["position"], "--eos-ids": ["1"], "--truncate": [],
    "--gammas": ["2"],
    "--max-tokens": ["6"], "--suite": ["SUITE"], "--max-cases": ["1"], "--runners": [""],
    "--workers": ["1"], "--ray": ["127.0.0.1:1"], "--quiet": [], "--chat-template": [],
    "--kv-bits": ["4"], "--kv-group-size": ["32"], "--quantized-kv-start": ["0"], "--rotating": ["exact"],
    "--grammar": ["lark-list"], "--reasoning-end": ["ll"], "--sessions": [],
}
# Flags that act only in a situation the baseline lacks: given with these, the baseline is refused
# and the flag must make it run.
CONDITIONAL = {"--truncate": ["--max-tokens", "2046"]}
PROCESS_FLAGS = {"--device": "sets this process's MLX device (tests/test_bench_devices.py)",
                 "--help": "prints help"}


def test_every_run_flag_is_honoured_or_refused(pair: tuple[Path, Path], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              captured: list[dict[str, Any]]) -> None:
    """On the zoo path and on the user-model path, each flag given alone (over a baseline)
    either changes the cases/job the run receives or is refused in one line."""
    import argparse
    import contextlib
    import io

    from specparity.cli import build_parser

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "token_ids": [5, 6, 7]}\n{"id": "b", "token_ids": [9, 8]}\n')
    prompts2 = tmp_path / "p2.jsonl"
    prompts2.write_text('{"id": "c", "token_ids": [5, 6, 7]}\n')
    suite = tmp_path / "s.toml"
    suite.write_text('gammas = [1]\n[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    subst = {"OUT2": str(tmp_path / "out2"), "TARGET": str(zoo.model_dir("qwen3")),
             "DRAFT": str(zoo.model_dir("llama-small")), "PROMPTS": str(prompts2), "SUITE": str(suite)}
    paths = {
        "zoo": ["--targets", "llama", "--drafters", "twin", "--prompts", "1", "--gammas", "1"],
        "user": ["--target", str(pair[0]), "--draft", str(pair[1]), "--prompts-file", str(prompts),
                 "--gammas", "1"],
    }
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = [a for a in sub.choices["run"]._actions if a.option_strings]
    missing = [a.option_strings[-1] for a in flags
               if a.option_strings[-1] not in RUN_FLAG_VALUES and a.option_strings[-1] not in PROCESS_FLAGS]
    assert not missing, f"list a non-default value for {missing} in RUN_FLAG_VALUES"

    def call(argv: list[str]) -> tuple[int, str, dict[str, Any] | None]:
        captured.clear()
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["run", "--out", str(tmp_path / "out"), *argv])
        return rc, err.getvalue(), (captured[0] if captured else None)

    def view(job: dict[str, Any] | None) -> Any:
        if job is None:
            return None
        return {k: ([(c.case_id, c.prompt_tokens) for c in v] if k == "cases" else v)
                for k, v in job.items()}

    tried, ignored = 0, []
    for name, base in paths.items():
        rc, err, plain_job0 = call(base)
        assert plain_job0 is not None, (name, err)
        for flag, values in RUN_FLAG_VALUES.items():
            job0 = call([*base, *CONDITIONAL[flag]])[2] if flag in CONDITIONAL else plain_job0
            for value in values or [None]:
                argv = [*base, *CONDITIONAL.get(flag, [])]
                if flag in argv:  # replace the baseline's value
                    i = argv.index(flag)
                    del argv[i:i + 2]
                argv += [flag] if value is None else [flag, subst.get(value, value)]
                rc, err, job = call(argv)
                tried += 1
                if job is None:  # refused: one line, no traceback
                    assert rc == 2 and "Traceback" not in err, (name, argv, err)
                    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1, (name, argv, err)
                elif view(job) == view(job0):
                    ignored.append((name, flag, value))
    print(f"run flags: {tried} inputs")
    assert not ignored, f"flags accepted and ignored: {ignored}"


def test_max_tokens_past_the_zoo_context(capsys: pytest.CaptureFixture[str],
                                        captured: list[dict[str, Any]]) -> None:
    """Before: only the user path checked the context; the zoo path ran past it."""
    rc, _, err = _cli(["run", "--targets", "llama", "--drafters", "self", "--max-tokens", "5000"],
                      capsys)
    _refused(rc, err, "nat-00", "5000", "context of 2048")
    assert not captured


# TOML spelling of the flag sweep's values, and the flag whose validator a suite key shares.
SUITE_SWEEP = {"nan": "nan", "-1": "-1", "99999999999999999999": "99999999999999999999",
               "/dev/zero": '"/dev/zero"', "a\x00b": '"a\\u0000b"'}
SUITE_KEY_FLAG: dict[str, str | None] = {
    "gammas": "--gammas", "max_tokens": "--max-tokens", "zoo_prompts": "--prompts",
    "prompts_file": "--prompts-file", "eos_ids": "--eos-ids", "stop_ids": None,
    "stop_strings": None, "truncate": None, "chat_template": None, "sampling.temperature": "--temps",
    "sampling.top_p": "--top-p", "sampling.top_k": "--top-k", "sampling.seed": "--seed",
    "sampling.min_tokens": "--min-tokens", "sampling.rng": "--rng",
    "sampling.processors": None, "target": None, "drafter": None, "sources": None,
    "kv_bits": "--kv-bits", "kv_group_size": "--kv-group-size", "quantized_kv_start": "--quantized-kv-start",
    "rotating": "--rotating", "grammar": "--grammar", "reasoning_end": "--reasoning-end",
}
_LIST_KEYS = {"gammas", "eos_ids", "stop_strings", "sources"}


def test_suite_values_go_through_the_flag_validators(tmp_path: Path,
                                                    captured: list[dict[str, Any]]) -> None:
    """Every suite key x every flag-sweep value: no traceback; a suite accepts a value exactly
    when the key's flag accepts it (before: seed = 2^70, gammas = [10^20] ... were accepted)."""
    import contextlib
    import io

    from specparity.suite import _PAIR_KEYS, _SAMPLING_KEYS

    assert set(SUITE_KEY_FLAG) == ({k for k in _PAIR_KEYS if k not in ("source", "sampling")}
                                   | {f"sampling.{k}" for k in _SAMPLING_KEYS}), "a new suite key"

    def accepted(argv: list[str]) -> tuple[bool, str]:
        captured.clear()
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["run", "--out", str(tmp_path / "out"), *argv])
        text = err.getvalue()
        assert "Traceback" not in text and ("internal error" not in text or captured), (argv, text)
        if not captured:
            assert rc == 2 and len([ln for ln in text.splitlines() if "error:" in ln]) == 1, (argv, text)
        return bool(captured), text

    tried, disagree = 0, []
    for key, flag in SUITE_KEY_FLAG.items():
        for raw, toml in SUITE_SWEEP.items():
            value = f"[{toml}]" if key in _LIST_KEYS else f"[[{toml}]]" if key == "stop_ids" else toml
            pair = {"target": '"llama"', "drafter": '"twin"', "sources": '["two-model"]'}
            top = ["zoo_prompts = 1", "gammas = [1]"]
            if key.startswith("sampling."):
                temp = "" if key == "sampling.temperature" else "temperature = 0.5, "
                top.append(f"sampling = [{{{temp}{key.split('.')[1]} = {value}}}]")
            elif key in pair:
                pair[key] = value
            else:
                top = [ln for ln in top if not ln.startswith(key)] + [f"{key} = {value}"]
            suite = tmp_path / f"s{tried}.toml"
            suite.write_text("\n".join(top) + "\n[[pair]]\n"
                             + "".join(f"{k} = {v}\n" for k, v in pair.items()))
            ok, text = accepted(["--suite", str(suite)])
            tried += 1
            if flag is not None:
                extra = ["--temps", "0.5"] if flag in ("--top-p", "--top-k", "--seed") else []
                base = ["--target", "llama", "--draft", str(zoo.model_dir("llama-twin"))] \
                    if flag == "--prompts-file" else ["--targets", "llama", "--drafters", "twin"]
                flag_ok, flag_text = accepted([*base, "--gammas", "1", *extra, flag, raw])
                if ok != flag_ok:
                    disagree.append((key, raw, text[-200:], flag_text[-200:]))
    print(f"suite sweep: {tried} suites")
    assert not disagree, disagree


# ---------------------------------------------------------------- grading lies


def _grade_dir(tiny_run: Path, tmp_path: Path, plant: Callable[[dict[str, Any]], None],
               mode: str = "spec") -> Path:
    d = tmp_path / "engine-traces"
    d.mkdir()
    recs = _records(_engine_trace(tiny_run, mode))
    plant(recs[0])
    _write_records(d / "t.jsonl", recs)
    return d


HEADER_PLANTS: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("unknown source", lambda h: h.update(source="warp-drive"), "spec", "header.source"),
    ("plain with a source", lambda h: h.update(source="ngram"), "plain", "header.source"),
    ("gamma 1e9", lambda h: h["params"].update(gamma=10**9), "spec", "header.params.gamma"),
    ("seed 2^70", lambda h: h["params"].update(seed=2**70), "spec", "header.params.seed"),
    ("max_tokens 0", lambda h: h["params"].update(max_tokens=0), "spec", "header.params.max_tokens"),
    ("top_k 2^40", lambda h: h["params"].update(top_k=2**40), "spec", "header.params.top_k"),
]


@pytest.mark.parametrize("plant,mode,field", [p[1:] for p in HEADER_PLANTS],
                         ids=[p[0] for p in HEADER_PLANTS])
def test_grade_refuses_impossible_headers(tiny_run: Path, tmp_path: Path, plant: Any, mode: str,
                                         field: str, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: graded as if valid (an unknown source re-run as two-model, γ 10^9 to 23 GB)."""
    import specparity.grade

    def no_models(*_a: object, **_k: object) -> None:
        raise AssertionError("a model was looked up for an invalid header")

    monkeypatch.setattr(specparity.grade, "case_from_header", no_models)
    d = _grade_dir(tiny_run, tmp_path, plant, mode)
    rc, _, err = _cli(["grade", d, "--out", tmp_path / "g"], capsys)
    assert rc == 1, err
    assert f"t.jsonl:1: {field}:" in err, err
    assert "Traceback" not in err and "internal error" not in err
    assert not (tmp_path / "g").exists()


def test_grade_skips_its_own_earlier_output(tiny_run: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `grade D --out D/g2` graded D/g1 (an earlier grade's re-runs and copies) too."""
    from specparity.grade import GradeError, find_traces

    d = tmp_path / "d"
    shutil.copytree(tiny_run / "traces" / "engine", d)
    own = sorted(d.glob("*.jsonl"))
    _copy_run(tiny_run, d / "g1")  # an earlier output: marker + traces/<runner>/...
    assert len(list((d / "g1").rglob("*.jsonl"))) >= 2
    assert find_traces(d, d / "g2") == own
    with pytest.raises(GradeError, match="is a specparity run/grade output"):
        find_traces(d / "g1")
    rc, _, err = _cli(["grade", tiny_run], capsys)
    assert rc == 1 and "traces/engine" in _one_error(err), err


@pytest.mark.parametrize("value,where", [
    (187.7, "prompt_ids"), ("496", "prompt_ids"), (True, "prompt_ids"),
    (True, "round.samples"), ("5", "plain.sample"), ("nan", "round.margins"), (1.0, "eos_ids"),
], ids=["float id", "str id", "bool id", "bool sample", "str plain sample", "str margin", "float eos"])
def test_writer_refuses_non_integer_token_ids(value: Any, where: str) -> None:
    """Before: int()/float() coerced 187.7 -> 187, "496" -> 496, True -> 1 into a valid trace."""
    from traces.records import RecordValueError
    from traces.writer import EngineTrace

    def trace(**kw: Any) -> EngineTrace:
        args: dict[str, Any] = {"runner": {"name": "x"}, "case_id": "c", "prompt_id": "p",
                                "prompt_ids": [1, 2], "target": {"path": "t"}, "eos_ids": [0],
                                "drafter": {"path": "d"}}
        return EngineTrace(**{**args, **kw})

    field = {"prompt_ids": "prompt.token_ids[1]", "eos_ids": "eos_ids[0]"}.get(where, where)
    with pytest.raises(RecordValueError, match=rf"^{re.escape(field)}"):
        if where == "prompt_ids":
            trace(prompt_ids=[1, value])
        elif where == "eos_ids":
            trace(eos_ids=[value])
        elif where == "round.samples":
            trace().round(feed=[1], pending=1, drafts=[2], samples=[value], k_accept=0, emitted=[],
                          end="correction", margins=[0.5, 0.5])
        elif where == "round.margins":
            trace().round(feed=[1], pending=1, drafts=[2], samples=[3], k_accept=0, emitted=[3],
                          end="correction", margins=[value, 0.5])
        else:
            trace(drafter=None).plain(input=[1], sample=value, margin=0.5, emitted=[5], end=None)


def test_writer_accepts_numpy_and_mlx_integers() -> None:
    import mlx.core as mx
    import numpy as np

    from traces.validate import validate_records
    from traces.writer import EngineTrace

    tr = EngineTrace(runner={"name": "x", "version": "1"}, case_id="c", prompt_id="p", prompt_ids=np.array([1, 2]),
                     target={"path": "t", "weights_sha256": None, "config_sha256": None},
                     eos_ids=[np.int64(0)], drafter={"path": "d", "weights_sha256": None,
                                                     "config_sha256": None},
                     params={"gamma": 1})
    tr.round(feed=[mx.array(2)], pending=np.int32(2), drafts=[3], samples=[3, 4], k_accept=1,
             emitted=[3, 4], end="bonus", margins=[np.float32(1.5), 2.0])
    recs = tr.all_records()
    assert recs[1]["window"] == [2, 3] and recs[0]["prompt"]["token_ids"] == [1, 2]
    assert all(type(t) is int for t in recs[1]["feed"] + recs[1]["samples"])
    assert validate_records(enumerate(json.loads(json.dumps(r)) for r in recs)) == []


# ---------------------------------------------------------------- unbounded work


def test_report_ticks_follow_the_values_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: one axis tick per γ up to the largest (a γ of 10^9: 23 GB)."""
    import matplotlib.axes
    import pandas as pd

    from reports import plots

    ticks: list[int] = []
    real = matplotlib.axes.Axes.set_xticks

    def count(self: Any, t: Any, *a: Any, **k: Any) -> Any:
        ticks.append(len(t))
        assert len(t) < 100, f"{len(t)} ticks"
        return real(self, list(t), *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks", count)
    df = pd.DataFrame({"target": ["t"] * 2, "drafter": ["d"] * 2, "gamma": [10**9] * 2,
                       "k_accept": [0, 2], "share": [0.5, 0.5]})
    assert plots.acceptance_lengths(df)
    pos = pd.DataFrame({"target": ["t"] * 2, "drafter": ["d"] * 2, "gamma": [10**9] * 2,
                        "position": [1, 10**6], "acceptance": [0.5, 0.1]})
    assert plots.acceptance_by_position(pos)
    assert ticks and max(ticks) <= 3


def test_case_limit_and_count(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              captured: list[dict[str, Any]]) -> None:
    """Before: a 10^6-line prompts file (or suite) started a million cases without a word."""
    big = tmp_path / "big.txt"
    big.write_text("ba de\n" * 1_000_000)
    rc, _, err = _cli(["run", "--target", "llama", "--draft", "twin", "--prompts-file", big], capsys)
    _refused(rc, err, "4000000 cases exceed the limit of 10000 (--max-cases)")
    rc, _, err = _cli(["run", "--max-cases", "100"], capsys)  # the whole zoo matrix
    _refused(rc, err, "exceed the limit of 100")
    suite = tmp_path / "s.toml"
    suite.write_text(f'prompts_file = "{big}"\n[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    rc, _, err = _cli(["run", "--suite", suite], capsys)
    _refused(rc, err, "(--max-cases)")
    assert not captured
    small = tmp_path / "small.txt"
    small.write_text("ba de\n" * 3)
    rc, _, err = _cli(["run", "--target", "llama", "--draft", "twin", "--prompts-file", small,
                       "--max-cases", "12"], capsys)
    assert rc == 1 and "_Started" in err and len(captured[0]["cases"]) == 12, err


def test_case_count_announced_before_the_run(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _cli(["run", "--targets", "llama", "--drafters", "self", "--gammas", "1",
                       "--prompts", "1", "--max-tokens", "4", "--runners", "", "--out",
                       tmp_path / "o"], capsys)
    assert rc == 0, err
    line = "specparity run: 2 cases (1 speculative, 1 plain), 2 runs on engine"
    assert line in err and err.index(line) < err.index("running cases"), err


def test_grade_walk_is_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `grade /` walked the whole file system (rglob), FIFOs included."""
    import specparity.grade
    from specparity.grade import GradeError, find_traces

    monkeypatch.setattr(specparity.grade, "MAX_WALK_ENTRIES", 2000)
    rc, _, err = _cli(["grade", "/", "--out", tmp_path / "g"], capsys)
    assert rc == 1 and "more than 2000 files and folders" in _one_error(err), err
    deep = tmp_path / "deep"
    (deep / "/".join("abcdefghijklmnopqrstu")).mkdir(parents=True)
    with pytest.raises(GradeError, match="nested deeper than 16 levels"):
        find_traces(deep)
    d = tmp_path / "d"
    d.mkdir()
    os.mkfifo(d / "x.jsonl")
    opened = _fifo_guard(d / "x.jsonl")
    (d / "loop").symlink_to(d)
    (d / "a.jsonl").write_text("{}\n")
    assert find_traces(d) == [d / "a.jsonl"]
    rc, _, err = _cli(["grade", d, "--out", tmp_path / "g2"], capsys)
    assert rc == 1 and "a.jsonl" in err and "x.jsonl" not in err, err
    assert not opened.is_set(), "the FIFO was opened"


def _fifo_guard(fifo: Path) -> Any:
    """If the code under test wrongly opens ``fifo``, a writer unblocks it after 5 s (so a
    regression fails the test instead of hanging it) and sets the returned event: a blocking
    write-open of a FIFO returns only once a reader has it open."""
    import threading

    opened = threading.Event()

    def unblock() -> None:
        try:
            os.close(os.open(fifo, os.O_WRONLY))
            opened.set()
        except OSError:
            pass

    t = threading.Timer(5.0, unblock)
    t.daemon = True
    t.start()
    return opened


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_fifo_model_files_are_refused(pair: tuple[Path, Path], tmp_path: Path, name: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Before: mlx-lm's loader (or our config read) blocked forever on a FIFO in the model dir."""
    from engine.models import ModelLoadError, load

    d = shutil.copytree(pair[0], tmp_path / "m")
    (d / name).unlink()
    os.mkfifo(d / name)
    opened = _fifo_guard(d / name)
    with pytest.raises(ModelLoadError, match=f"{name}: not a regular file"):
        load(d)
    rc, _, err = _cli(["generate", "--target", d, "-n", "2", "--prompt-ids", "5,6"], capsys)
    _refused(rc, err, name, "not a regular file")
    assert not opened.is_set(), f"{name} was opened"


def test_fifo_and_device_prompts_files_are_refused(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.prompts import PromptError, read_prompts_file

    fifo = tmp_path / "p.jsonl"
    os.mkfifo(fifo)
    opened = _fifo_guard(fifo)
    with pytest.raises(PromptError, match="not a regular file"):
        read_prompts_file(fifo)
    for target in (fifo, "/dev/zero"):
        suite = tmp_path / "s.toml"
        suite.write_text(f'prompts_file = "{target}"\n[[pair]]\ntarget = "llama"\n')
        rc, _, err = _cli(["run", "--suite", suite], capsys)
        _refused(rc, err, "prompts_file", "not a regular file")
    assert not opened.is_set(), "the FIFO was opened"


def test_report_with_a_fifo_run_marker(tiny_run: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Before: reading the marker blocked on a FIFO; now: unreadable marker, INCOMPLETE, exit 1."""
    from reports.tables import RUN_MARKER

    d = _copy_run(tiny_run, tmp_path / "r")
    (d / RUN_MARKER).unlink()
    os.mkfifo(d / RUN_MARKER)
    opened = _fifo_guard(d / RUN_MARKER)
    rc, out, err = _cli(["report", d], capsys)
    assert rc == 1 and "INCOMPLETE" in err, (out, err)
    assert "unreadable run marker" in (d / "report.md").read_text()
    assert not opened.is_set(), "the FIFO marker was opened"


# ================================================================ issue 23: output safety and rough edges
# (wt/hosta) Three classes of issue 23, each input planted with its expected outcome:
#   1. destroying what is not ours: no input deletes or overwrites a file no specparity command
#      wrote; the last finished run survives unfinished ones; bench/audit files are atomic;
#   2. a verdict before the work is done: summary.md is written last; a failure or a signal in
#      the report step leaves INCOMPLETE (or nothing) and a non-zero exit;
#   3. rough edges: SIGTERM is one line + exit 143 with locks released; over-long paths, ~user,
#      a 2^70 seed, a bad config.json and a case id starting with "." are one usage line.

HOSTILE_23_OUTPUT: dict[str, list[str]] = {
    "destroying what is not ours": [
        "run --out . in a checkout (traces/ package, summary.md, report.md)",
        "run --out DIR holding a user's notes.txt", "run --out DIR holding a user's report_files/x.png",
        "run --out DIR whose .previous-run/ is not ours", "grade --out DIR holding user files",
        "run --out a 1500-file folder (a home folder): refused after 1000, not walked further",
        "run dir of an older specparity (no file list): recognised outputs set aside",
        "older run dir + a user's notes.txt", "older run dir + a user's summary.md",
        "a listed output replaced by a symlink to a user's file",
        "report DIR with a user's report.md", "report DIR with a user's report.html",
        "bench --out DIR with a user's bench.json", "ab --out DIR with a user's ab.md",
        "grade --engine --out DIR with a user's NAME.json", "grade --engine with a user's scoreboard.md",
        "grade --serve --out DIR with a user's scoreboard.html",
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
        "full disk from comparisons.json on (no summary at all)",
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


def test_catalogue_counts_issue_23_output() -> None:
    counts = {k: len(v) for k, v in HOSTILE_23_OUTPUT.items()}
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


def test_run_out_a_big_folder_is_refused_without_walking_it_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_jobs: None) -> None:
    """``--out ~``: refused after the first 1000 foreign files, the rest never walked."""
    from specparity import outdir

    home = tmp_path / "home"
    for i in range(30):
        _user_dir(home / f"d{i:02d}", [f"f{j}.txt" for j in range(50)])
    seen: list[str] = []
    walk = outdir._inventory

    def counting(directory: Path) -> Any:
        for rel in walk(directory):
            seen.append(rel)
            yield rel

    monkeypatch.setattr(outdir, "_inventory", counting)
    rc, _, err = _cli([*RUN_TINY, "--out", home], capsys)
    assert rc == 2, err
    _one_error(err, "1000+ file(s) no specparity command wrote")
    assert len(seen) == outdir.FOREIGN_SCAN_LIMIT < 1500


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
    (["grade", "--serve", "fake", "--model", "llama", "--out", "{d}"], "scoreboard.html"),
    (["regen", "--case", "nothing-matches", "--golden-dir", "{d}", "--report", "{d}/rep"],
     "manifest.json"),
    (["regen", "--case", "nothing-matches", "--golden-dir", "{d}", "--report", "{d}/rep"],
     "engine/.x.tmp"),
    (["ab", "--target", "llama", "--drafter-a", "self", "--drafter-b", "twin", "--out", "{d}"], "ab.md"),
    (["regen", "--case", "nothing-matches", "--report", "{d}"], "drift.md"),
], ids=["bench", "grade --engine NAME.json", "grade --engine scoreboard.md",
         "grade --serve scoreboard.html",
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
        ["grade", "--serve", "fake", "--model", "llama", "--out", "{d}"],
        ["regen", "--case", "nothing-matches", "--golden-dir", "{d}", "--report", "{d}/rep"],
    ]
    for i, argv in enumerate(commands):
        d = tmp_path / f"d{i}"
        before = _user_dir(d, names)
        rc, _, err = _cli([str(a).replace("{d}", str(d)) for a in argv], capsys)
        assert "Traceback" not in err, err
        after = _snapshot(d)
        assert {k: after.get(k) for k in before} == before, (argv[0], err)


def test_files_added_to_a_run_dir_survive_the_next_run(tiny_run: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """bench/ab/record files put into a run directory are ours (listed as added): a later run
    neither refuses the directory nor moves them."""
    from specparity.outdir import add_outputs

    d = _copy_run(tiny_run, tmp_path / "run")
    with add_outputs(d, "specparity ab") as claim:
        claim.track(d / "ab.md").write_text("# A/B\n")
    rc, _, err = _cli([*RUN_TINY, "--out", d], capsys)
    assert rc == 0, err
    assert (d / "ab.md").read_text() == "# A/B\n"
    assert "ab.md" in json.loads((d / ".specparity-run.json").read_text())["added"]


# ---------------------------------------------------------------- 2. a verdict before the work is done


def _stderr_lines(err: str) -> list[str]:
    """stderr without progress, device and work-size announcement lines."""
    import re

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
    ("specparity.run:atomic_write_text", "disk full", 1),
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
    assert list(d.glob("traces/engine/*.jsonl")), "work kept"
    if where.startswith("specparity.run"):  # comparisons.json and the INCOMPLETE summary failed
        assert summary is None and not (d / "comparisons.json").exists()
    else:
        assert (d / "comparisons.json").exists()
    assert_whole_files(d)
    if how in ("sigterm", "ctrl-c"):
        (line,) = _stderr_lines(err)
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


def test_grade_reads_a_folder_other_commands_added_traces_to(tiny_run: Path, tmp_path: Path) -> None:
    """`record --out D` marks D as holding added outputs (state ``outputs``, no run id):
    D is the user's folder of traces and is graded; a run's marker (a run id) or an
    unreadable one keeps the folder out."""
    import json

    from reports.tables import RUN_MARKER
    from specparity.grade import GradeError, find_traces

    d = tmp_path / "rec"
    shutil.copytree(tiny_run / "traces" / "engine", d / "engine")
    own = sorted((d / "engine").glob("*.jsonl"))
    (d / RUN_MARKER).write_text(json.dumps({"command": "specparity record", "state": "outputs",
                                            "files": [], "added": [str(p.relative_to(d)) for p in own]}))
    assert own and find_traces(d) == own
    (d / RUN_MARKER).write_text(json.dumps({"command": "specparity run", "state": "complete",
                                            "run_id": "abc", "files": [], "added": []}))
    with pytest.raises(GradeError, match="is a specparity run/grade output"):
        find_traces(d)
    (d / RUN_MARKER).write_text("{not json")
    with pytest.raises(GradeError, match="is a specparity run/grade output"):
        find_traces(d)
