"""``specparity.cli.main`` in-process: generate, trace validate, diff, run, usage errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import zoo
from specparity.cli import main

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def dirs() -> tuple[Path, Path]:
    return zoo.pair("llama", "twin")


def _generate(dirs: tuple[Path, Path], out: Path, n: int, ids: str = "5,6,7") -> int:
    tdir, ddir = dirs
    return main(["generate", "--target", str(tdir), "--draft", str(ddir), "-n", str(n),
                 "--prompt-ids", ids, "--trace", str(out)])


@pytest.fixture(scope="module")
def traces(dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("cli-traces")
    a, b = d / "t8.jsonl", d / "t9.jsonl"
    # 5,6,7 hits EOS after 3 tokens on llama (identical traces for -n 8 and -n 9);
    # 10,20,30 runs past 9 tokens, so the budget makes the traces differ
    assert _generate(dirs, a, 8, "10,20,30") == 0
    assert _generate(dirs, b, 9, "10,20,30") == 0
    return a, b


def test_generate_spec_writes_valid_trace(dirs: tuple[Path, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    t = tmp_path / "t.jsonl"
    assert _generate(dirs, t, 8) == 0
    out, err = capsys.readouterr()
    assert "finish=" in err and "accepted" in err and "target calls" in err
    assert f"trace written to {t}" in err
    assert t.is_file() and len(t.read_text().splitlines()) >= 3
    assert main(["trace", "validate", str(t)]) == 0
    assert f"{t}: ok" in capsys.readouterr().out


def test_generate_plain(dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = tmp_path / "plain.jsonl"
    assert main(["generate", "--target", str(dirs[0]), "-n", "4", "--prompt-ids", "5,6,7",
                 "--trace", str(t)]) == 0
    err = capsys.readouterr().err
    assert "finish=" in err and "accepted" not in err
    assert main(["trace", "validate", str(t)]) == 0


def test_generate_missing_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "does-not-exist"
    rc = main(["generate", "--target", str(missing), "-n", "4", "--prompt-ids", "5,6,7"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no such directory" in err and str(missing) in err


def test_diff_same_and_different(traces: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = traces
    assert main(["diff", str(a), str(a)]) == 0
    assert main(["diff", str(a), str(b)]) == 1
    assert main(["diff", str(a), str(b), "--level", "tokens"]) == 1
    capsys.readouterr()


def test_trace_validate_corrupted_line(traces: tuple[Path, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    lines = traces[0].read_text().splitlines()
    assert len(lines) >= 3
    lines[2] = lines[2][: len(lines[2]) // 2]  # truncated JSON on line 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    assert main(["trace", "validate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{bad}:3" in out


def test_trace_validate_mixed_files(traces: tuple[Path, Path], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "junk.jsonl"
    bad.write_text("not json\n")
    assert main(["trace", "validate", str(traces[0]), str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"{traces[0]}: ok" in out and f"{bad}:1" in out


def test_run_conforms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "run"
    rc = main(["run", "--out", str(out_dir), "--targets", "llama", "--drafters", "twin",
               "--gammas", "2", "--prompts", "2", "--max-tokens", "8"])
    assert rc == 0
    summary = (out_dir / "summary.md").read_text()
    assert "CONFORMS" in summary
    assert "CONFORMS" in capsys.readouterr().out
    for runner in ("engine", "mlx_lm"):
        found = list((out_dir / "traces" / runner).rglob("*.jsonl"))
        assert found, f"no traces under traces/{runner}"


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--gammas", "0"],
        ["run", "--gammas", "a,b"],
        ["run", "--prompts", "0"],
        ["generate", "--target", "x"],  # neither --prompt nor --prompt-ids
        ["generate", "--target", "x", "--prompt", "hi", "--prompt-ids", "1"],
        ["diff", "only-one"],
        [],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2  # one error line, no SystemExit escaping the CLI boundary
    err = capsys.readouterr().err
    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1, err


def test_known_lists_entries_and_hits(tmp_path, capsys) -> None:  # noqa: ANN001
    import json

    from specparity.cli import main

    (tmp_path / "comparisons.json").write_text(json.dumps(
        [{"known": "mlx-lm-refuses-recurrent-target"}, {"known": None}]))
    assert main(["known", "--run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mlx-lm-rotating-trim-after-wrap" in out and "matched nothing in this run" in out
    assert "in " + str(tmp_path) + ": 1 comparison(s)" in out
    assert main(["known", "--run", str(tmp_path / "missing")]) == 2


def test_generate_detects_the_source_and_reports_fallback(capsys) -> None:  # noqa: ANN001
    """--draft alone picks the source by the §3 detection order; ngram needs none."""
    import zoo
    from specparity.cli import main
    from zoo.heads import head_dir

    q35 = zoo.model_dir("qwen35")
    assert main(["generate", "--target", str(q35), "--draft", str(head_dir("qwen35-mtp-self")),
                 "-n", "6", "--prompt-ids", "5,6,7"]) == 0
    assert "source mtp" in capsys.readouterr().err
    llama = zoo.model_dir("llama")
    assert main(["generate", "--target", str(llama), "--source", "ngram", "-n", "6",
                 "--prompt-ids", "5,6,7,5,6"]) == 0
    assert "source ngram" in capsys.readouterr().err
    g3, g3t = zoo.pair("gemma3", "twin")
    longest = max(zoo.prompts(), key=lambda p: len(p.token_ids))
    ids = ",".join(str(t) for t in longest.token_ids)
    assert main(["generate", "--target", str(g3), "--draft", str(g3t), "-n", "4", "--prompt-ids", ids]) == 0
    err = capsys.readouterr().err
    assert "speculation stopped after 0 tokens (ring-wrap)" in err and "RotatingKVCache" in err
