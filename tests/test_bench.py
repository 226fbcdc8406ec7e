"""``specparity bench`` on a tiny seeded bf16 layer-skip pair (``zoo/big.py``; issue 13 item 6).

The CPU smoke of the GPU bench path: the pair builds from its seed, the five
arms run, the forwards-only bound replays exactly the forward calls of the
engine's run (same models, same input shapes, same order — a dropped round is
seen), and the JSON carries warm and cold paired intervals per γ.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import zoo
from engine.executor import GenerationParams, spec_generate
from engine.sources.two_model import TwoModelProvider
from specparity.cli import main
from specparity.measure.bench import RATIOS, forwards_only, schedule_of
from specparity.runners import load_model
from zoo import big


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[Any, Any]:
    t, d = big.build("tiny", 0, log=lambda _m: None)
    return load_model(str(t)), load_model(str(d))


def test_tiny_pair_is_a_layer_skip_of_its_target(tiny_pair: tuple[Any, Any]) -> None:
    tgt, drf = tiny_pair
    r = big.recipe("tiny")
    assert len(tgt.model.layers) == r.num_hidden_layers and len(drf.model.layers) == big.DRAFT_LAYERS
    tw, dw = dict(_flat(tgt.model)), dict(_flat(drf.model))
    assert set(dw) < set(tw) and all(mx.array_equal(dw[k], tw[k]).item() for k in dw)
    assert tw["model.layers.0.self_attn.q_proj.weight"].dtype == mx.bfloat16
    deep, shallow = tw["model.layers.3.mlp.down_proj.weight"], tw["model.layers.1.mlp.down_proj.weight"]
    ratio = mx.abs(deep.astype(mx.float32)).mean().item() / mx.abs(shallow.astype(mx.float32)).mean().item()
    assert ratio == pytest.approx(big.DEEP_SCALE, rel=0.2)
    assert big.recipe("1b").parameters() > 1.0e9
    assert big.build("tiny", 0) == big.pair_dirs(r)  # found, not rebuilt


def _flat(model: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())




def test_forwards_only_replays_the_engines_forward_calls(tiny_pair: tuple[Any, Any],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    tgt, drf = tiny_pair
    ids = list(zoo.prompt("nat-00").token_ids)
    params = GenerationParams(max_tokens=20, gamma=3, eos_ids=tgt.eos_ids, cache_digests=False)
    engine_calls: list[tuple[str, tuple[int, ...]]] = []
    # Both models are the same class: one wrapper tells them apart by identity.
    cls = type(tgt.model)
    real = cls.__call__
    log: list[tuple[str, tuple[int, ...]]] = engine_calls

    def call(self: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
        log.append(("target" if self is tgt.model else "drafter", tuple(inputs.shape)))
        return real(self, inputs, *a, **kw)

    monkeypatch.setattr(cls, "__call__", call)
    res = spec_generate(tgt.model, TwoModelProvider(drf.model), ids, params)
    sched = schedule_of(res.records)
    assert sched and all(kind == "round" for kind, *_ in sched)
    bound_calls: list[tuple[str, tuple[int, ...]]] = []
    log = bound_calls
    forwards_only(tgt.model, drf.model, ids, sched)
    assert bound_calls == engine_calls
    log = []
    forwards_only(tgt.model, drf.model, ids, sched[:-1])  # planted: a round dropped
    assert log != engine_calls


def test_bench_tiny_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--size", "tiny", "--gammas", "2,3", "--prompts", "2", "--repeats", "1",
                 "--max-tokens", "8", "--device", "cpu", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["target"] == "big-tiny-s0" and data["gammas"] == [2, 3] and data["dtype"] == "bfloat16"
    assert data["blocks_with_differing_token_counts"] == 0, data["blocks"]
    assert data["engine_vs_mlx_lm_identical_outputs"] == "4/4"
    for g in ("2", "3"):
        d = data["by_gamma"][g]
        assert set(d["warm"]) == set(RATIOS) == set(d["cold"])
        assert 0 <= d["acceptance"] <= 1 and d["drafted"] > 0
        for iv in d["warm"].values():
            assert iv["low"] <= iv["median"] <= iv["high"] and iv["n"] == 2
    assert {b["pass"] for b in data["blocks"]} == {0, 1}
    assert all(b["order"][-1] == "forwards" for b in data["blocks"] if b["pass"] == 0)
    # 4 cold passes: each timed arm first in one of them (the shape builds are not all one arm's)
    assert len({b["order"][0] for b in data["blocks"] if b["pass"] == 0}) == 4
    assert len(data["goal"]) == 2 and "efficiency_engine γ=3" in data["ratios"]
    out = capsys.readouterr().out
    assert "## γ=2: acceptance" in out and "cold (first sight" in out


def test_bench_size_excludes_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--size", "tiny", "--target", "llama", "--out", str(tmp_path / "refused")]) == 2
    assert "--size builds its own pair" in capsys.readouterr().err


# --- the engine's host-overhead changes keep every trace byte ---------------------------------


def test_margin_without_sort_is_bit_identical_to_topk() -> None:
    import numpy as np

    from engine.sampler import margin_array

    def topk_margin(logits: Any) -> Any:
        x = logits.astype(mx.float32)
        top = mx.topk(x, 2, axis=-1)
        broken = mx.any(mx.isnan(x) | mx.isposinf(x), axis=-1)
        return mx.where(broken, mx.array(float("nan")), mx.abs(top[:, 0] - top[:, 1]))

    rng = np.random.default_rng(0)
    edge = rng.standard_normal((6, 64)).astype(np.float32)
    edge[0, 3] = edge[0, 9] = 50.0  # a tie at the top: margin 0
    edge[1, :] = -np.inf
    edge[2, :] = -np.inf
    edge[2, 5] = 1.0
    edge[3] = 0.0
    edge[4, 7] = np.nan
    edge[5, 2] = np.inf
    for rows in (rng.standard_normal((5, 512)), 7 * rng.standard_normal((3, 32000)), edge,
                 rng.standard_normal((2, 2))):
        for dt in (mx.float32, mx.bfloat16, mx.float16):
            a = mx.array(np.asarray(rows, np.float32)).astype(dt)
            want, got = np.array(topk_margin(a)), np.array(margin_array(a))
            assert want.tobytes() == got.tobytes(), (dt, want, got)


@pytest.mark.parametrize("target", ["llama", "qwen35", "gemma3"])
def test_drafts_kept_on_device_give_the_same_records(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.sampler import token_ids
    from engine.sources.two_model import TwoModelSource

    t, d = zoo.pair(target, "twin")
    tgt, drf = load_model(str(t)), load_model(str(d))
    params = GenerationParams(max_tokens=40, gamma=3, eos_ids=tgt.eos_ids)
    ids = list(zoo.prompt("rnd-00").token_ids)

    def strip(res: Any) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k != "time_s"} for r in res.records]

    calls: list[int] = []
    real = TwoModelSource.draft_array

    def counted(self: Any, *a: Any) -> Any:
        calls.append(1)
        return real(self, *a)

    monkeypatch.setattr(TwoModelSource, "draft_array", counted)
    lazy = spec_generate(tgt.model, TwoModelProvider(drf.model), ids, params)
    assert calls, "the device-drafts path was not taken"
    monkeypatch.delattr(TwoModelSource, "draft_array")
    monkeypatch.setattr(TwoModelSource, "draft",
                        lambda self, feed, n, step, anchor: token_ids(real(self, feed, n, step, anchor)))
    listed = spec_generate(tgt.model, TwoModelProvider(drf.model), ids, params)
    assert strip(lazy) == strip(listed)


def test_an_overridden_draft_keeps_the_list_path() -> None:
    """A source whose ``draft`` is replaced (a planted delay, a subclass) is called, not bypassed."""
    from engine.sources import two_model

    t, d = zoo.pair("llama", "twin")
    tgt, drf = load_model(str(t)), load_model(str(d))
    called: list[int] = []

    class Provider(two_model.TwoModelProvider):
        def open(self, sampler: Any, target: Any) -> Any:
            src = super().open(sampler, target)
            inner = src.draft

            def draft(*a: Any, **k: Any) -> list[int]:
                called.append(1)
                return inner(*a, **k)

            src.draft = draft  # type: ignore[method-assign]
            return src

    class Sub(two_model.TwoModelSource):
        def draft(self, *a: Any, **k: Any) -> list[int]:
            called.append(2)
            return super().draft(*a, **k)

    params = GenerationParams(max_tokens=8, gamma=3, eos_ids=tgt.eos_ids)
    spec_generate(tgt.model, Provider(drf.model), list(zoo.prompt("nat-00").token_ids), params)
    assert 1 in called
    from engine.executor import lazy_drafts
    from engine.hooks import NO_OBSERVER
    from engine.sampler import SamplerParams, StepSampler

    sub = Sub(drf.model, StepSampler.from_params(SamplerParams()), 512)
    assert lazy_drafts(sub, NO_OBSERVER, (), sub.sampler) is None
    plain = two_model.TwoModelSource(drf.model, sub.sampler, 512)
    assert lazy_drafts(plain, NO_OBSERVER, (), sub.sampler) is not None


def test_cold_passes_are_balanced() -> None:
    from specparity.measure.bench import ARMS, arm_order

    cold = [arm_order(False, i) for i in range(4)]
    assert sorted(o[0] for o in cold) == sorted(ARMS[:4])  # each timed arm first once
    assert all(o[-1] == "forwards" and sorted(o) == sorted(ARMS) for o in cold)
    for a, b in (("engine-spec", "mlx_lm-spec"), ("engine-plain", "mlx_lm-plain")):
        assert sum(o.index(a) < o.index(b) for o in cold) == 2, (a, b)  # each order twice
    assert arm_order(False, 5) == cold[1]
    assert sorted(arm_order(True, i)[0] for i in range(5)) == sorted(ARMS)
