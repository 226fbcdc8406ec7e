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
    d = _copy_run(tiny_run, tmp_path / "run")
    stale = d / "traces" / "engine" / "stale__case.jsonl"
    recs = _records(_engine_trace(d, "plain"))
    recs[0]["case_id"] = "qwen3/plain/STALE-ROW/n4"
    _write_records(stale, recs)
    rc, _, err = _cli(["run", "--targets", "llama", "--drafters", "self", "--gammas", "1",
                       "--prompts", "1", "--max-tokens", "4", "--runners", "", "--out", d], capsys)
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
    real.write_text("old")
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
    """``specparity.run.run`` stubbed: its arguments are kept and it raises :class:`_Started`."""
    import specparity.run

    calls: list[dict[str, Any]] = []

    def run(out: Path, **kwargs: Any) -> None:
        calls.append({"out": out, **kwargs})
        raise _Started()

    monkeypatch.setattr(specparity.run, "run", run)
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
    cases = captured[0]["cases"]
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
    "--seed": ["4"], "--eos-ids": ["1"], "--truncate": [], "--gammas": ["2"],
    "--max-tokens": ["6"], "--suite": ["SUITE"], "--max-cases": ["1"], "--runners": [""],
    "--workers": ["1"], "--ray": ["127.0.0.1:1"], "--quiet": [], "--chat-template": [],
    "--kv-bits": ["4"], "--kv-group-size": ["32"], "--quantized-kv-start": ["0"], "--rotating": ["exact"],
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
    "sampling.processors": None, "target": None, "drafter": None, "sources": None,
    "kv_bits": "--kv-bits", "kv_group_size": "--kv-group-size", "quantized_kv_start": "--quantized-kv-start",
    "rotating": "--rotating",
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
