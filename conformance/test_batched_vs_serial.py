"""Batched speculation ≡ serial on every cache family, and the planted batching bugs caught.

Every zoo target (KV: llama, qwen3; rotating + KV: gemma3, gemma4, a row crossing its ring
guard leaves for the serial lane; recurrent ``ArraysCache`` + KV: qwen35) runs a mixed batch
(4 rows: prompt lengths 28/16/25/11, budgets 12/20/7/16, two rows joining mid-flight, one
preempted and resumed) whose every row is compared record for record with ``spec_generate``
on the same request alone (``engine.batched_check.check_rows``).

Planted bugs (monkeypatched, never in the shipped code), each caught by the same comparison
naming the row and the batch step where it first shows:

- one row's rollback applied to its neighbour (the drops of slots 0 and 1 swapped);
- one RNG shared across rows (no per-row generator state);
- a finished row's slot reused without reset (the joining row inherits its padding/offset);
- uniform acceptance (every row rolled back to the minimum over rows) passed off as per-row;
- a joining row placed one position off (its K/V not right-justified at the write index).
"""

from __future__ import annotations

from typing import Any

import pytest

import zoo
from engine import batched as eb
from engine.batched import BatchRequest, RowRng, batch_generate
from engine.batched_check import RowDivergence, check_rows
from engine.executor import GenerationParams
from engine.sampler import SamplerParams
from engine.sources.ngram import NgramProvider
from engine.sources.two_model import TwoModelProvider
from tests.test_batched_traces import swap_neighbour_drops

_MODELS: dict[str, Any] = {}


def load(name: str) -> Any:
    if name not in _MODELS:
        from specparity.runners import load_model

        _MODELS[name] = load_model(str(zoo.model_dir(name))).model
    return _MODELS[name]


def params(i: int, temp: float = 0.0, rng: str = "stream", **kw: Any) -> GenerationParams:
    return GenerationParams(max_tokens=[12, 20, 7, 16][i % 4], gamma=3, seed=i,
                            sampler=SamplerParams(temperature=temp, rng=rng), eos_ids=(zoo.eos_id(),), **kw)


def mixed(target: str, source: str = "twin", temp: float = 0.0, rng: str = "stream",
          **kw: Any) -> list[BatchRequest]:
    ps = zoo.prompts()

    def provider(i: int) -> Any:
        if source == "ngram" or (source == "mixed" and i % 2):
            return NgramProvider(gamma=3)
        return TwoModelProvider(load(zoo.model_name(target, "twin")))

    return [BatchRequest(f"r{i}", list(ps[i].token_ids), params(i, temp, rng, **kw), provider(i),
                         arrive=[0, 0, 2, 3][i], pause=(4, 6) if i == 1 else None) for i in range(4)]


def rows_equal_serial(target: str, reqs: list[BatchRequest], **kw: Any) -> Any:
    model = load(target)
    res = batch_generate(model, reqs, **kw)
    divs = check_rows(model, reqs, res)
    assert not divs, "\n".join(d.message for d in divs)
    return res


@pytest.mark.parametrize("target", ["llama", "qwen3", "gemma3", "gemma4", "qwen35"])
def test_every_cache_family_rows_equal_serial(target: str) -> None:
    res = rows_equal_serial(target, mixed(target, "mixed"), max_batch=3)
    assert all(res.lanes[r] == "batch" for r in res.lanes), res.lanes


@pytest.mark.parametrize("target,rng", [("qwen35", "position"), ("gemma3", "stream"), ("qwen3", "position")])
def test_sampled_rows_equal_serial(target: str, rng: str) -> None:
    rows_equal_serial(target, mixed(target, "twin", temp=0.8, rng=rng))


def test_rotating_row_leaves_for_the_serial_lane_at_its_ring_guard() -> None:
    """gemma3's sliding window is 32: the 28-token prompt reaches its ring guard after one round
    and finishes with plain decode, as its serial run does; the others keep batching."""
    res = rows_equal_serial("gemma3", mixed("gemma3", "twin"))
    left = [x for s in res.steps for x in s["left"] if x["why"].startswith("serial: ring-wrap")]
    assert left and left[0]["row"] == "r0", res.steps
    r0 = res.rows["r0"].records
    assert [r["type"] for r in r0[:3]] == ["prefill", "round", "plain"] and r0[2]["reason"] == "ring-wrap"


def test_serial_lane_rows_quantized_kv_and_exact_rings() -> None:
    """Rows the batch cannot hold run alone through the serial executor, reason recorded."""
    reqs = mixed("llama-kv", "twin", kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    res = rows_equal_serial("llama-kv", reqs)
    assert all(v.startswith("serial: quantized KV") for v in res.lanes.values()), res.lanes
    res = rows_equal_serial("gemma3", mixed("gemma3", "twin", rotating="exact"))
    assert all("rotating='exact'" in v for v in res.lanes.values()), res.lanes


def test_grammar_processor_and_min_tokens_rows_equal_serial() -> None:
    """Per-row sampling pipelines in one batch: a JSON-schema row and a regex row (each its own
    grammar matcher, the constrained walk), two rows with penalties + logit bias + min_tokens 4,
    greedy and sampled with position keys, one preempted."""
    from specparity.cases.case import Case
    from specparity.jobs.batched import BatchCase, row_requests
    from specparity.jobs.run import SIDE_STATE_PROCESSORS
    from zoo import grammars as G

    t, d, p = G.PAIRS[0]
    ids = G.prompt_ids(p)
    rows = (Case(t, d, p, 3, 24, prompt_tokens=ids, grammar="json-small"),
            Case(t, d, "nat-01", 3, 20, processors=SIDE_STATE_PROCESSORS, min_tokens=4, temperature=0.8, seed=1,
                 rng="position"),
            Case(t, d, "nat-02", 3, 16, processors=SIDE_STATE_PROCESSORS, min_tokens=4),
            Case(t, d, p, 3, 24, prompt_tokens=ids, grammar="regex-sentence", temperature=0.8, seed=3,
                 rng="position"))
    model, reqs, _ = row_requests(BatchCase("g", rows, (0, 0, 1, 2), (None, (2, 4), None, None)))
    assert reqs[0].params.grammar is not None and reqs[3].params.grammar is not None
    res = batch_generate(model.model, reqs)
    divs = check_rows(model.model, reqs, res)
    assert not divs, "\n".join(x.message for x in divs)
    assert all(v == "batch" for v in res.lanes.values()), res.lanes


def eight_rows(target: str, temp: float = 0.0, rng: str = "stream", source: str = "twin") -> list[BatchRequest]:
    """Eight rows, γ 1..4, budgets 6..27, three arriving per step; with ``max_batch=6`` two wait."""
    ps = zoo.prompts()
    twin = load(zoo.model_name(target, "twin"))
    return [BatchRequest(f"q{i}", list(ps[4 + i].token_ids),
                         GenerationParams(max_tokens=6 + 3 * i, gamma=1 + i % 4, seed=i, eos_ids=(zoo.eos_id(),),
                                          sampler=SamplerParams(temperature=temp, rng=rng)),
                         NgramProvider(gamma=3) if source == "ngram" or (source == "mixed" and i % 2)
                         else TwoModelProvider(twin), arrive=i // 3)
            for i in range(8)]


def test_rotating_batch_padding_never_reaches_the_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows rolled right accumulate left padding; the padding every row shares is cut after each
    rollback, so the write index stays at the longest row and a rotating batch never wraps
    through padding (found by the nightly matrix: the ring's front cut, then a trim, left
    mlx-lm's mask one column longer than the keys). Without the cut the batch stops, naming it."""
    rows_equal_serial("gemma3", eight_rows("gemma3"), max_batch=6)
    monkeypatch.setattr(eb, "_drop_common_padding", lambda c: None)
    with pytest.raises(RuntimeError, match=r"batched rotating cache reached its ring \(write index 3\d"):
        batch_generate(load("gemma3"), eight_rows("gemma3"), max_batch=6)


# ---------------------------------------------------------------------- planted bugs


def planted(target: str, reqs: list[BatchRequest], **kw: Any) -> tuple[Any, list[RowDivergence]]:
    model = load(target)
    res = batch_generate(model, reqs, **kw)
    divs = check_rows(model, reqs, res)
    assert divs, "the planted bug went unnoticed: every row ≡ serial"
    return res, sorted(divs, key=lambda d: (d.step if d.step is not None else 1 << 30))


def first_step(res: Any, pred: Any) -> dict[str, Any]:
    for s in res.steps:
        if len(s["rows"]) >= 2 and pred(s):
            return s
    pytest.fail("no step triggers the plant")


def drop(s: dict[str, Any], e: dict[str, Any]) -> int:
    return s["width"] - e["k_accept"] - 1


def test_plant_neighbour_rollback_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    swap_neighbour_drops(monkeypatch)  # the plant: row 0 rolls back by row 1's count and vice versa
    res, divs = planted("llama", mixed("llama"))
    s = first_step(res, lambda s: drop(s, s["rows"][0]) != drop(s, s["rows"][1]))
    first = divs[0]
    assert first.step == s["index"], first.message
    assert first.row in (s["rows"][0]["row"], s["rows"][1]["row"]), first.message
    assert first.field == "target_cache_digest", first.message
    assert f"row {first.row}: batch step {s['index']}" in first.message


def test_plant_shared_rng_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = RowRng(active=False)
    monkeypatch.setattr(eb, "_row_rng", lambda row: shared)
    res, divs = planted("llama", mixed("llama", "twin", temp=0.8))
    first = divs[0]
    # r1's request start re-seeded the one generator: r0's first draws are r1's stream
    assert (first.row, first.step, first.round) == ("r0", 0, 0), first.message
    assert "row r0: batch step 0 (round 0)" in first.message


def test_plant_slot_reused_without_reset_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eb, "_reset_slot", lambda batch, slot: None)
    ps = zoo.prompts()
    twin = TwoModelProvider(load(zoo.model_name("llama", "twin")))
    reqs = [BatchRequest("short", list(ps[0].token_ids), GenerationParams(max_tokens=4, gamma=3), twin),
            BatchRequest("long", list(ps[1].token_ids), params(1), twin),
            BatchRequest("late", list(ps[3].token_ids), params(3), twin, arrive=1)]
    res, divs = planted("llama", reqs, max_batch=2)
    joined = next(s for s in res.steps if "late" in s["joined"])
    assert [e["slot"] for e in joined["rows"] if e["row"] == "late"] == [0], joined  # the short row's slot
    first = divs[0]
    assert (first.row, first.step, first.round) == ("late", joined["index"], 0), first.message


def test_plant_uniform_acceptance_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eb, "_drops", lambda keeps, width: [width - min(keeps)] * len(keeps))
    res, divs = planted("llama", mixed("llama"))
    s = first_step(res, lambda s: len({e["k_accept"] for e in s["rows"]}) > 1)
    first = divs[0]
    lo = min(e["k_accept"] for e in s["rows"])
    assert first.step == s["index"], first.message
    assert first.row in [e["row"] for e in s["rows"] if e["k_accept"] > lo], first.message
    assert first.field == "target_cache_digest", first.message


def test_plant_join_at_wrong_offset_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eb, "_join_start", lambda idx, length: idx - length - 1 if idx > length else idx - length)
    res, divs = planted("llama", mixed("llama"))
    first = divs[0]
    # r0 (28 tokens) opens the batch; r1 (16 tokens) is the first to join a longer batch
    assert (first.row, first.step, first.round) == ("r1", 0, 0), first.message
    assert "row r1: batch step 0 (round 0); rows present: r0" in first.message


# ---------------------------------------------------------------------- the nightly matrix


@pytest.mark.heavy
@pytest.mark.parametrize("target", ["llama", "qwen3", "gemma3", "gemma4", "qwen35"])
@pytest.mark.parametrize("source", ["twin", "ngram", "mixed"])
@pytest.mark.parametrize("sampling", ["greedy", "stream", "position"])
def test_matrix_rows_equal_serial(target: str, source: str, sampling: str) -> None:
    """Every target x draft source x sampling, B = 4 with joins and a preemption, then eight rows
    (B up to 8, max_batch 6: two wait for a slot)."""
    temp = 0.0 if sampling == "greedy" else 0.8
    rng = "stream" if sampling == "greedy" else sampling
    rows_equal_serial(target, mixed(target, source, temp, rng))
    rows_equal_serial(target, eight_rows(target, temp, rng, source), max_batch=6)
