"""mlx-vlm 0.7.10's batched MTP and DFlash loops, live (``tox -e vlm``): B-invariance and identity.

``oracles.mlx_vlm_batched`` drives mlx-vlm's ``BatchGenerator`` with a drafter unmodified;
``specparity.grading.vlm_batched`` grades every row at B = 2 and 4 (mixed prompt lengths, rows
finishing at different steps, one by EOS on gemma4) against the same row alone through the same
loop, sampled rows keyed per position, every greedy row against the engine's serial run (tokens;
rounds at B = 1 where the source matches ours) and the committed acceptance. Measured here: every
row identical on every pair, the clamp to the earliest rejection (declared uniform acceptance)
cutting drafts, and the committed scoreboard row is what a live grade gives. Planted: a loop that
hands a row its neighbour's tokens, and a clamp to the LATEST rejection, each caught naming the
row and the batch step; a capture with two rows swapped, caught at the first differing token.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from conformance.conftest import require_oracle

pytestmark = pytest.mark.oracle
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vb() -> Any:
    require_oracle("mlx_vlm_batched")
    from specparity.grading import vlm_batched

    return vlm_batched


@pytest.fixture(scope="module")
def models() -> dict[Any, Any]:
    return {}


def _pair(vb: Any, name: str) -> Any:
    return next(p for p in vb.PAIRS if p.name == name)


@pytest.mark.parametrize("name", ["qwen35/qwen35-mtp-self/pre-norm", "qwen35/qwen35-mtp", "gemma4/gemma4-assistant-self",
                                  "gemma4/gemma4-dspark", "gemma4/gemma4-deepspec-kv"])
def test_every_row_is_b_invariant_and_the_engines(vb: Any, models: dict[Any, Any], name: str) -> None:
    out = vb.grade_pair(_pair(vb, name), models)
    for check in ("B2", "B4", "seeded", "serial"):
        bad = [v.detail for v in out["verdicts"][check] if v.verdict != "identical"]
        assert not bad, f"{name} {check}:\n" + "\n".join(bad)
    assert not out["verdicts"]["acceptance"], out["verdicts"]["acceptance"]
    assert out["uniform"], f"{name}: mlx-vlm 0.7.10 declares uniform acceptance for the zoo targets"
    lengths = {v.detail.split()[0] for v in out["verdicts"]["B4"]}  # "<n> tokens, finish ..."
    assert len(out["verdicts"]["B4"]) == 4 and len(lengths) > 1, "the B = 4 rows do not finish at different steps"
    if _pair(vb, name).rounds:
        rounds = [v for v in out["verdicts"]["serial"] if v.against == vb.ROUNDS]
        assert len(rounds) == 4 and all(v.verdict == "identical" for v in rounds), [v.detail for v in rounds]


def test_the_clamp_is_exercised(vb: Any, models: dict[Any, Any]) -> None:
    """Not vacuous: at B = 4 rows commit fewer drafts than their own walks accepted (the clamp)."""
    cut = {p.name: vb.grade_pair(p, models)["acceptance"]["B4"] for p in vb.PAIRS
           if p.name in ("qwen35/qwen35-mtp-self/pre-norm", "gemma4/gemma4-deepspec-kv")}
    assert all(c["clamped"] > 0 and c["drafts_discarded"] > 0 for c in cut.values()), cut


def test_committed_row_is_a_live_grade(vb: Any) -> None:
    """docs/scoreboard/mlx_vlm_batched.json is what grading gives here, cell for cell (a fixed or a new
    failure both show)."""
    committed = json.loads((ROOT / "docs" / "scoreboard" / f"{vb.NAME}.json").read_text())
    live = vb.grade(list(vb.MODES))
    for mode, m in live["modes"].items():
        for check, r in m["checks"].items():
            c = committed["modes"][mode]["checks"][check]
            assert (r["status"], r["detail"]) == (c["status"], c["detail"]), (mode, check, r["detail"], c["detail"])
        assert m["pairs"] == committed["modes"][mode]["pairs"], mode


def test_planted_neighbour_tokens_are_caught(vb: Any, models: dict[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that hands two rows each other's tokens from its third emission on."""
    ar = importlib.import_module("mlx_vlm.generate.ar")
    orig = ar.SpeculativeGenerationBatch._append_token_responses
    calls = {"n": 0}

    def crossed(self: Any, responses: Any, tok_list: Any) -> Any:
        calls["n"] += 1
        if len(tok_list) == 4 and calls["n"] >= 3:
            tok_list = list(tok_list)
            tok_list[0], tok_list[1] = tok_list[1], tok_list[0]
        return orig(self, responses, tok_list)

    monkeypatch.setattr(ar.SpeculativeGenerationBatch, "_append_token_responses", crossed)
    out = vb.grade_pair(_pair(vb, "qwen35/qwen35-mtp-self/pre-norm"), models)
    bad = [v for v in out["verdicts"]["B4"] if v.verdict == "logic"]
    assert bad and all(v.verdict == "identical" for v in out["verdicts"]["B2"]), [v.detail for v in bad]
    assert "at B = 4: output token" in bad[0].detail and "batch step" in bad[0].detail and \
        "the loop's walk emitted" in bad[0].detail, bad[0].detail


def test_planted_clamp_to_the_latest_rejection_is_caught(vb: Any, models: dict[Any, Any],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Uniform acceptance to the LATEST rejection: rows commit drafts their own walk rejected."""
    vmtp = importlib.import_module("mlx_vlm.speculative.mtp")

    def latest(draft: Any, target: Any, accepted: list[int], budgets: list[int]) -> Any:
        a = max(accepted)
        return [a] * len(accepted), [(draft[i, :a].tolist() + target[i, a : a + 1].tolist())[: budgets[i]]
                                     for i in range(draft.shape[0])]

    monkeypatch.setattr(vmtp, "_speculative_walk_batch_uniform_acceptance", latest)
    out = vb.grade_pair(_pair(vb, "qwen35/qwen35-mtp-self/pre-norm"), models)
    probs = out["verdicts"]["acceptance"]
    assert probs and "batch step" in probs[0] and "but its own walk accepted" in probs[0], probs
    assert any(v.verdict == "logic" for v in out["verdicts"]["B2"] + out["verdicts"]["B4"])


def test_planted_capture_swap_is_caught(vb: Any, models: dict[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture hands row r0 its neighbour's output at B = 4: caught at the first differing token."""
    import dataclasses

    import oracles.mlx_vlm_batched as ob

    run = ob.run_batch

    def swapped(*a: Any, **k: Any) -> Any:
        res = run(*a, **k)
        if len(res.rows) == 4:
            r0, r1 = res.rows[0], res.rows[1]
            res.rows[0] = dataclasses.replace(r0, tokens=r1.tokens, stream=r1.stream, steps=r1.steps)
            res.rows[1] = dataclasses.replace(r1, tokens=r0.tokens, stream=r0.stream, steps=r0.steps)
        return res

    monkeypatch.setattr(ob, "run_batch", swapped)
    out = vb.grade_pair(_pair(vb, "gemma4/gemma4-dspark"), models)
    v = next(x for x in out["verdicts"]["B4"] if x.row == 0)
    assert v.verdict == "logic" and v.detail.startswith("row r0 (nat-00) at B = 4: output token "), v.detail
