"""``specparity ab`` / ``bench`` on the zoo: each verdict path with a planted difference."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from specparity.cli import main
from specparity.measure.ab import accepted_flags, common_prefix, run_ab

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SMALL = dict(n_prompts=8, max_tokens=8, allow_small=True)


class Timings:
    """An injected timing source (``run_ab(timing=...)``): arm A takes 1 s per generated token,
    arm B ``factors[i]`` s per token on prompt ``i``; records every call (never the warm-up)."""

    def __init__(self, factors: list[float]) -> None:
        self.factors = factors
        self.calls: list[tuple[str, int]] = []

    def __call__(self, arm: str, i: int, res: Any) -> float:
        self.calls.append((arm, i))
        per_token = 1.0 if arm == "A" else self.factors[i]
        return per_token * res.usage.generation_tokens


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


def _tie(factors: list[float]) -> dict[str, Any]:
    """twin vs twin (no acceptance drop), B's time per token on prompt i = factors[i] x A's."""
    t = Timings(factors)
    res = run_ab("llama", "twin", "twin", timing=t, **SMALL)
    assert sorted(t.calls) == sorted((a, i) for a in "AB" for i in range(8)), t.calls  # no warm-up
    assert res["per_prompt_time_ratio_b_over_a"] == pytest.approx(factors)
    v = res["verdict"]
    assert v["acceptance"]["verdict"] == "no drop" and v["acceptance"]["drop_pts"] == 0, v
    return res


def test_tie_with_slower_b_fails_on_injected_timings() -> None:
    # A harness that took A/B instead of B/A would call this B faster and PASS.
    res = _tie([1.3, 1.25, 1.31, 1.28, 1.27, 1.35, 1.29, 1.3])
    v = res["verdict"]
    assert (v["verdict"], v["passes"], v["wall_clock"]) == ("FAIL", False, "slower"), v
    assert res["ratios"]["wall_time_b_over_a"]["low"] > 1
    assert "SLOWER" in v["reasons"][1], v["reasons"]


def test_tie_with_faster_b_passes_on_injected_timings() -> None:
    res = _tie([0.7, 0.72, 0.69, 0.75, 0.71, 0.7, 0.73, 0.68])
    v = res["verdict"]
    assert (v["verdict"], v["passes"], v["wall_clock"]) == ("PASS", True, "faster"), v
    assert res["ratios"]["wall_time_b_over_a"]["high"] < 1
    assert res["arms"][0]["wall_s"] == res["arms"][0]["tokens"]  # 1 s per token: the injected clock


def test_median_below_one_whose_interval_straddles_one_fails() -> None:
    """Median 0.87, mean 0.89, 5 of 8 prompts faster, interval [0.70, 1.10]: a gate on the median,
    the mean, the lower bound or a majority would PASS; §4.5 wants the whole interval below 1."""
    res = _tie([0.62, 0.7, 0.78, 0.84, 0.9, 1.04, 1.1, 1.16])
    w = res["ratios"]["wall_time_b_over_a"]
    assert w["median"] < 1 and w["low"] < 1 < w["high"], w
    v = res["verdict"]
    assert (v["verdict"], v["passes"], v["wall_clock"]) == ("FAIL", False, "straddles"), v
    assert "straddles" in v["reasons"][1], v["reasons"]


def test_timing_source_must_give_seconds() -> None:
    with pytest.raises(ValueError, match="timing of arm A prompt 0: 0.0 is not a finite number"):
        run_ab("llama", "twin", "twin", timing=lambda arm, i, res: 0.0, **SMALL)


def test_cli_ab_writes_and_refuses_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small",
                 "--prompts", "8", "--out", str(tmp_path / "refused")]) == 2
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


def test_cli_ab_unknown_drafter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "nope",
                 "--allow-small", "--prompts", "2", "--out", str(tmp_path / "refused")]) == 2
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
