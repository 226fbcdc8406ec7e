"""``specparity run --sessions`` (specparity/sessions.py): a user's pair, a suite's ``sessions`` key,
the reference section, and refused flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specparity.cli import main

PROMPTS = [
    {"id": "a", "token_ids": [3, 17, 40, 41, 99, 12, 7, 8, 200, 201, 33, 34, 35, 60, 61, 62, 70, 71]},
    {"id": "b", "token_ids": [5, 6, 9, 120, 121, 122, 130, 140, 150, 160]},
]


@pytest.fixture()
def prompts(tmp_path: Path) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    return p


def test_sessions_on_a_pair(tmp_path: Path, prompts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(["run", "--sessions", "--target", "llama", "--draft", "twin", "--prompts-file", str(prompts),
               "--gammas", "3", "--max-tokens", "6", "--out", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "5/5 sessions warm ≡ cold" in text and "Prefix-hit rate" in text and "Time to first token" in text
    data = json.loads((out / "sessions.json").read_text())
    assert data["summary"]["identical"] == 5 and data["summary"]["prefix_hit_rate"] > 0.5
    assert {r["kind"] for s in data["sessions"] for r in s["requests"]} >= {
        "fresh", "follow-up", "regenerate", "continue", "prefix", "shared-prefix"}
    # the reference ran beside, with and without the drafter, and is graded by the same checks
    lanes = {r["lane"] for r in data["reference"]}
    assert lanes == {"spec", "plain"}, lanes
    assert "## Reference: mlx-lm's prompt cache" in (out / "sessions.md").read_text()
    # every warm request's trace is written, valid, and records what it reused
    from traces.io import read_trace
    from traces.validate import validate_file

    files = sorted((out / "traces" / "sessions").rglob("*.jsonl"))
    assert len(files) == 18, files
    assert all(validate_file(f) == [] for f in files)
    r1 = read_trace(next(f for f in files if f.parent.name == "multi-turn" and f.name.startswith("r1-")))
    assert r1.prefill is not None and r1.prefill["prompt_cache"]["target_reused"] > 0, r1.prefill
    assert len(r1.prefill["target_tokens"]) == len(r1.header["prompt"]["token_ids"]) - 1 - \
        r1.prefill["prompt_cache"]["target_reused"]


def test_suite_sessions_key(tmp_path: Path, prompts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suite = tmp_path / "s.toml"
    suite.write_text(f'sessions = ["regenerate"]\ngammas = [3]\nmax_tokens = 5\nprompts_file = "{prompts.name}"\n'
                     '[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    rc = main(["run", "--suite", str(suite), "--out", str(tmp_path / "o"), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "1/1 sessions warm ≡ cold" in text and "/regenerate |" in text


def test_suite_sessions_key_unknown_name(tmp_path: Path, prompts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suite = tmp_path / "s.toml"
    suite.write_text('sessions = ["nope"]\n[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    rc = main(["run", "--suite", str(suite), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "'sessions' must be true or a list of" in err, err


def test_sessions_refuses_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", "--sessions", "--workers", "2", "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "--sessions runs in this process" in capsys.readouterr().err


@pytest.mark.slow
def test_sessions_zoo_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", "--sessions", "--out", str(tmp_path / "o"), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "DIVERGENT |" not in text.split("## Reference")[0]


def test_sessions_zoo_refuses_flags_it_would_ignore(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", "--sessions", "--temps", "0.8", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "--temps need --target or --suite" in err, err
