"""``specparity run --sessions`` (specparity/jobs/sessions.py): a user's pair, a suite's ``sessions`` key,
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
    assert "CONFORMS — 5 sessions: 5 warm ≡ cold, 0 numerics, 0 logic, 0 unsupported" in text and "Prefix-hit rate" in text and "Time to first token" in text
    data = json.loads((out / "sessions.json").read_text())
    assert data["summary"]["identical"] == 5 and data["summary"]["prefix_hit_rate"] > 0.5
    assert {r["kind"] for s in data["sessions"] for r in s["requests"]} >= {
        "fresh", "follow-up", "regenerate", "continue", "prefix", "shared-prefix"}
    # the reference ran beside, with and without the drafter, and is graded by the same checks
    lanes = {r["lane"] for r in data["reference"]}
    assert lanes == {"spec", "plain"}, lanes
    assert "## Reference: mlx-lm's prompt cache" in (out / "sessions.md").read_text()
    # the plain arm ran beside, warm ≡ cold too, and the paired report has the four cells
    paired = data["paired"]
    assert paired["arms"]["plain"]["identical"] == 5 and paired["arms"]["spec"]["identical"] == 5, paired["arms"]
    assert paired["arms"]["plain"]["prefix_hit_rate"] > 0.5
    assert set(paired["ttft_median_s"]) == {"spec_warm", "spec_cold", "plain_warm", "plain_cold"}
    assert set(paired["ratios"]) == {"spec/plain warm", "spec/plain cold", "warm/cold spec", "warm/cold plain"}
    assert "## With and without speculation (paired)" in text
    assert all(s["plain"] is not None and len(s["plain"]) == len(s["requests"]) for s in data["sessions"])
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
    assert "CONFORMS — 1 sessions: 1 warm ≡ cold, 0 numerics, 0 logic, 0 unsupported" in text and "/regenerate |" in text


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
@pytest.mark.heavy
def test_sessions_zoo_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", "--sessions", "--out", str(tmp_path / "o"), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "DIVERGENT |" not in text.split("## Reference")[0]


def test_sessions_zoo_refuses_flags_it_would_ignore(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", "--sessions", "--temps", "0.8", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "--temps need --target or --suite" in err, err


# --------------------------------------------------------------------------- the paired report, on injected timings

def _verdicts(times: list[tuple[float, float, float, float]], spec_reused: int = 6,
              plain_reused: int = 4) -> list:
    """One session whose request i > 0 has the four TTFT cells ``times[i - 1]``
    (spec warm, spec cold, plain warm, plain cold), 10-token prompts."""
    from specparity.jobs.sessions import RequestVerdict, SessionVerdict

    def req(i: int, reused: int, warm: float, cold: float) -> RequestVerdict:
        return RequestVerdict(i, "fresh" if i == 0 else "follow-up", 10, reused if i else 0, None, None, None,
                              "budget@plain", None, warm, cold)

    rows = [(1.0, 1.0, 1.0, 1.0), *times]
    return [SessionVerdict("x/multi-turn", "multi-turn",
                           requests=[req(i, spec_reused, sw, sc) for i, (sw, sc, _, _) in enumerate(rows)],
                           plain=[req(i, plain_reused, pw, pc) for i, (_, _, pw, pc) in enumerate(rows)])]


def test_paired_report_ratio_math_on_injected_timings() -> None:
    """The four cells' medians and the paired ratios are computed per request (a ratio of medians
    would differ), with a bootstrap interval around the median and the per-arm hit rates."""
    import statistics

    from specparity.jobs.sessions import paired_summary, render

    times = [(0.004, 0.010, 0.001, 0.002), (0.006, 0.010, 0.002, 0.002), (0.009, 0.012, 0.001, 0.004),
             (0.005, 0.020, 0.003, 0.003), (0.007, 0.008, 0.002, 0.005), (0.004, 0.016, 0.001, 0.002),
             (0.010, 0.011, 0.004, 0.004)]
    p = paired_summary(_verdicts(times))
    assert p["pairs"] == len(times) and p["same_prompt"] == len(times)
    for j, cell in enumerate(("spec_warm", "spec_cold", "plain_warm", "plain_cold")):
        assert p["ttft_median_s"][cell] == pytest.approx(statistics.median(t[j] for t in times))
    expect = {"spec/plain warm": [sw / pw for sw, _, pw, _ in times],
              "spec/plain cold": [sc / pc for _, sc, _, pc in times],
              "warm/cold spec": [sw / sc for sw, sc, _, _ in times],
              "warm/cold plain": [pw / pc for _, _, pw, pc in times]}
    for name, ratios in expect.items():
        r = p["ratios"][name]
        assert r["n"] == len(times) and r["median"] == pytest.approx(statistics.median(ratios)), (name, r)
        assert r["low"] <= r["median"] <= r["high"] and r["low"] >= min(ratios) and r["high"] <= max(ratios)
        assert r["wilcoxon_p"] is not None and 0 < r["wilcoxon_p"] <= 1
    # spec warm is faster than spec cold in every pair: the whole interval below 1, Wilcoxon rejects
    assert p["ratios"]["warm/cold spec"]["high"] < 1 and p["ratios"]["warm/cold spec"]["wilcoxon_p"] < 0.05
    # per-arm prefix-hit rate: 6 (spec) and 4 (plain) of 10 prompt tokens in every later request
    assert p["arms"]["spec"]["prefix_hit_rate"] == pytest.approx(0.6)
    assert p["arms"]["plain"]["prefix_hit_rate"] == pytest.approx(0.4)
    b = p["by_pair"]["x"]  # the label's pair part ("x/multi-turn" -> "x")
    assert (b["spec_hit_rate"], b["plain_hit_rate"], b["pairs"]) == pytest.approx((0.6, 0.4, len(times)))
    assert b["spec/plain warm median"] == pytest.approx(p["ratios"]["spec/plain warm"]["median"])
    text = render(_verdicts(times))
    assert "| spec | 1/1 | 60.0% | 7/7 |" in text and "| plain | 1/1 | 40.0% | 7/7 |" in text, text
    med = statistics.median(sw / pw for sw, _, pw, _ in times)
    assert f"| spec/plain warm TTFT | {med:.2f} | [" in text, text


def test_paired_report_constant_ratio_and_missing_cells() -> None:
    """A constant ratio has a zero-width interval (and no Wilcoxon p); a request missing a cell
    (no first token) is left out of every ratio, not paired with another request's time."""
    from specparity.jobs.sessions import paired_summary

    times = [(0.002 * k, 0.004 * k, 0.001 * k, 0.002 * k) for k in range(1, 7)]
    v = _verdicts(times)
    v[0].plain[3].ttft_warm_s = None  # request 3: plain warm never produced a token
    p = paired_summary(v)
    assert p["pairs"] == len(times) - 1
    r = p["ratios"]["spec/plain warm"]
    assert (r["median"], r["low"], r["high"]) == pytest.approx((2.0, 2.0, 2.0)) and r["wilcoxon_p"] is None
    assert p["ratios"]["warm/cold plain"]["median"] == pytest.approx(0.5)


def test_plain_arm_divergence_is_reported_and_fails_the_session() -> None:
    """A plain warm ≠ cold fails the session (``identical``) and is named in the paired section,
    while the spec table keeps its own verdict."""
    from specparity.jobs.sessions import render, summary

    v = _verdicts([(0.004, 0.010, 0.001, 0.002)] * 3)
    v[0].plain[2].divergence = "request 2 (follow-up): plain step 1: sample: warm 5 != cold 6"
    assert v[0].spec_identical and not v[0].identical
    assert v[0].first_divergence == "plain arm: request 2 (follow-up): plain step 1: sample: warm 5 != cold 6"
    text = render(v)
    assert "| plain | 0/1 |" in text and "- x/multi-turn: plain arm: request 2 (follow-up): plain step 1" in text
    assert summary(v)["identical"] == 1  # the spec arm's own count (the first line) is unchanged


# Every field of a session group (specparity.jobs.sessions._group_key: the case's fields but the prompt)
# changed to another value: the group's label (its trace folder) must change with it, or two groups
# would write into one folder and read as one row. A new Case field fails here until it has a value.
OTHER_VALUE = {
    "target": "gemma3", "drafter": "self", "gamma": 2, "max_tokens": 12, "temperature": 0.9, "seed": 8,
    "eos_ids": (5,), "stop_sequences": ((7, 8),), "source": "ngram", "top_p": 0.8, "top_k": 8,
    "target_path": "/elsewhere/llama", "draft_path": "/elsewhere/twin", "processors": "rp1.3c16",
    "kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 12, "rotating": "exact", "grammar": "json-small",
    "reasoning_end": "</think>", "min_tokens": 3, "rng": "position", "min_p": 0.2,
}


def test_every_group_field_shows_in_the_sessions_label() -> None:
    from dataclasses import fields, replace

    from specparity.cases.case import Case
    from specparity.jobs.sessions import _group_key, _label

    base = Case("llama", "twin", "a", 3, 6, temperature=0.7, seed=1, kv_bits=4, quantized_kv_start=8,
                target_path="/models/llama", draft_path="/models/twin")
    grouped = {f.name for f in fields(Case)} - {"prompt_id", "prompt_tokens"}
    assert grouped == set(OTHER_VALUE), f"give these fields another value here: {sorted(grouped ^ set(OTHER_VALUE))}"
    same = []
    for name, value in OTHER_VALUE.items():
        other = replace(base, **{name: value})
        assert _group_key(other) != _group_key(base), name
        if _label(other) == _label(base):
            same.append(name)
    assert not same, f"fields two session groups may differ in that their label (trace folder) leaves out: {same}"
