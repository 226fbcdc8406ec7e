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
