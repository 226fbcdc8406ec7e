"""Quantized-drafter acceptance A/B (§4.3, §4.5 phases 1c/1d): bf16 vs 8-bit vs 4-bit.

The DeepSpec-format zoo drafter and its mlx affine siblings draft for the same
target through the paired A/B protocol (``specparity.measure.drafter_ab.run_drafter_ab``
over ``specparity.measure.ab`` / ``reports.stats``). A drafter never changes what is
emitted, so every arm must emit the same stream; the question is acceptance,
reported per weight byte. A drafter whose Markov head is zeroed must be flagged
as an acceptance drop (the A/B can fail).
"""

from __future__ import annotations

import pytest

import zoo
from specparity.cases.case import pick_prompts
from specparity.measure.drafter_ab import deepspec_arms, run_drafter_ab
from specparity.runners import load_model


def _prompts(n: int) -> list[list[int]]:
    return [list(zoo.prompt(i).token_ids) for i in pick_prompts([p.id for p in zoo.prompts()], n)]


@pytest.fixture(scope="module")
def ab() -> dict:
    tgt = load_model(str(zoo.model_dir("qwen3")))
    return run_drafter_ab(tgt.model, deepspec_arms("qwen3"), _prompts(6), baseline="bf16", max_tokens=24,
                          eos_ids=tuple(tgt.eos_ids))


def test_quantized_arms_emit_the_same_stream_and_keep_acceptance(ab: dict) -> None:
    arms = {r["arm"]: r for r in ab["arms"]}
    assert set(arms) == {"bf16", "8-bit", "4-bit"}
    assert arms["bf16"]["weights_bytes"] > arms["8-bit"]["weights_bytes"] > arms["4-bit"]["weights_bytes"]
    for c in ab["comparisons"]:
        assert c["prompts_with_differing_streams"] == 0, c
        acc = c["verdict"]["acceptance"]
        assert acc["verdict"] != "drop", (c["b"], acc)
    per = [arms[a]["acceptance_per_mib"] for a in ("bf16", "8-bit", "4-bit")]
    assert per == sorted(per), f"acceptance per MiB should rise as bits fall: {per}"


def test_a_broken_drafter_is_flagged_as_a_drop() -> None:
    import mlx.core as mx

    from engine.dspark import deepspec_module as dsm
    from engine.sources.deepspec import DeepSpecProvider
    from zoo.dspark import artifact_dir

    broken = dsm.load(artifact_dir("qwen3-deepspec"))
    broken.markov_head.markov_w2.weight = mx.zeros_like(broken.markov_head.markov_w2.weight)
    arms = deepspec_arms("qwen3", variants=("",))
    arms["broken"] = (DeepSpecProvider(broken), arms["bf16"][1])
    tgt = load_model(str(zoo.model_dir("qwen3")))
    res = run_drafter_ab(tgt.model, arms, _prompts(6), baseline="bf16", max_tokens=24, eos_ids=tuple(tgt.eos_ids))
    (c,) = res["comparisons"]
    assert c["verdict"]["verdict"] == "FAIL" and c["verdict"]["acceptance"]["verdict"] == "drop", c
