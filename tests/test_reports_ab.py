"""``specparity ab`` / ``bench`` on the zoo: each verdict path with a planted difference."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from specparity.ab import accepted_flags, common_prefix, run_ab
from specparity.cli import main

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SMALL = dict(n_prompts=8, max_tokens=8, allow_small=True)


def _slow_arm(monkeypatch: pytest.MonkeyPatch, slow_index: int, delay_s: float = 0.01) -> None:
    """Plant a slower arm: the ``slow_index``-th provider run_ab builds (0 = A, 1 = B) sleeps per draft."""
    from engine.sources import two_model

    made: list[Any] = []

    class Provider(two_model.TwoModelProvider):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self.slow = len(made) == slow_index
            made.append(self)

        def open(self, sampler: Any, target: Any) -> Any:
            src = super().open(sampler, target)
            if self.slow:
                inner = src.draft

                def draft(*a: Any, **k: Any) -> list[int]:
                    time.sleep(delay_s)
                    return inner(*a, **k)

                src.draft = draft  # type: ignore[method-assign]
            return src

    monkeypatch.setattr(two_model, "TwoModelProvider", Provider)


def test_accepted_flags_and_prefix() -> None:
    recs = [{"type": "prefill"},
            {"type": "round", "emitted": [5, 6, 7], "k_accept": 2},
            {"type": "round", "emitted": [8], "k_accept": 0},
            {"type": "plain", "emitted": [9]}]
    assert accepted_flags(recs) == [True, True, False, False, False]
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([1], [1, 2]) == 1


def test_planted_regression_is_drop() -> None:
    res = run_ab("llama", "self", "small", **SMALL)
    acc = res["verdict"]["acceptance"]
    assert acc["verdict"] == "drop" and res["verdict"]["verdict"] == "FAIL", acc
    assert res["prompts_with_differing_streams"] == 0, res["prompts_with_differing_streams"]
    assert res["arms"][0]["acceptance"] == 1.0


def test_tie_with_planted_slower_b_fails_on_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_arm(monkeypatch, slow_index=1)
    res = run_ab("llama", "twin", "twin", **SMALL)
    v = res["verdict"]
    assert v["acceptance"]["verdict"] == "no drop" and v["acceptance"]["drop_pts"] == 0, v
    assert not v["passes"] and "SLOWER" in v["reasons"][1], v["reasons"]


def test_tie_with_faster_b_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_arm(monkeypatch, slow_index=0)
    res = run_ab("llama", "twin", "twin", **SMALL)
    assert res["verdict"]["passes"], res["verdict"]["reasons"]
    assert res["ratios"]["wall_time_b_over_a"]["high"] < 1


def test_cli_ab_writes_and_refuses_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small",
                 "--prompts", "8"]) == 2
    assert "--allow-small" in capsys.readouterr().err
    out = tmp_path / "ab"
    rc = main(["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small",
               "--prompts", "8", "--allow-small", "--max-tokens", "6", "--out", str(out)])
    assert rc == 0, "a FAIL verdict is a measurement, not an error"
    assert "FAIL" in capsys.readouterr().out
    data = json.loads((out / "ab.json").read_text())
    assert data["verdict"]["verdict"] == "FAIL" and (out / "ab.md").is_file()
    assert main(["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small",
                 "--prompts", "8", "--allow-small", "--max-tokens", "6", "--out", str(out),
                 "--strict"]) == 1


def test_cli_ab_unknown_drafter(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "nope",
                 "--allow-small", "--prompts", "2"]) == 2
    assert "neither a zoo drafter" in capsys.readouterr().err


def test_bench_reports_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--prompts", "2", "--repeats", "1", "--max-tokens", "6",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert set(data["ratios"]) == {"engine_over_mlx_lm_spec", "engine_over_mlx_lm_plain",
                                   "spec_speedup_engine", "spec_speedup_mlx_lm",
                                   "efficiency_engine", "efficiency_mlx_lm"}
    assert data["blocks_with_differing_token_counts"] == 0, data["blocks"]
    for iv in data["ratios"].values():
        assert iv["low"] <= iv["median"] <= iv["high"] and iv["n"] == 2
    assert "spec_speedup_engine" in capsys.readouterr().out
