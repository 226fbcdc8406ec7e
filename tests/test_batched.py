"""The batched executor (``engine.batched``) on the zoo ``llama`` target: every row ≡ its serial run.

Each batch mixes prompt lengths, token budgets (rows finish at different steps), arrivals
(rows join mid-flight into released slots) and a preemption (a row swapped out and back),
and every row is compared record for record (tokens, k_accept per round, emitted, end,
margins, cache digests, usage) with ``spec_generate`` on the same request alone, greedy and
sampled (``rng="stream"`` and ``"position"``), two-model and n-gram rows side by side.
"""

from __future__ import annotations

from typing import Any

import pytest
from fakes import FakeProvider, FakeSource

import zoo
from engine.batched import BatchRequest, batch_generate
from engine.batched_check import RowDivergence, check_rows, compare_row, step_of, ulp_distance
from engine.executor import GenerationParams, spec_generate
from engine.sampler import SamplerParams
from engine.sources.ngram import NgramProvider
from engine.sources.two_model import TwoModelProvider


@pytest.fixture(scope="module")
def llama() -> Any:
    from specparity.runners import load_model

    return load_model(str(zoo.model_dir("llama"))).model


@pytest.fixture(scope="module")
def twin() -> Any:
    from specparity.runners import load_model

    return load_model(str(zoo.model_dir(zoo.model_name("llama", "twin")))).model


def _params(i: int, temp: float = 0.0, rng: str = "stream", **kw: Any) -> GenerationParams:
    return GenerationParams(max_tokens=[12, 20, 7, 16][i % 4], gamma=3, seed=i,
                            sampler=SamplerParams(temperature=temp, rng=rng), eos_ids=(zoo.eos_id(),), **kw)


def mixed(provider: Any, temp: float = 0.0, rng: str = "stream", n: int = 4) -> list[BatchRequest]:
    """Four rows: prompts of 28, 16, 25 and 11 tokens; budgets 12/20/7/16; r2 and r3 arrive at
    steps 2 and 3; r1 is preempted at step 4 and resumes at step 6."""
    ps = zoo.prompts()
    return [BatchRequest(f"r{i}", list(ps[i].token_ids), _params(i, temp, rng), provider(i), arrive=[0, 0, 2, 3][i],
                         pause=(4, 6) if i == 1 else None) for i in range(n)]


def assert_rows_serial(model: Any, reqs: list[BatchRequest], **kw: Any) -> Any:
    res = batch_generate(model, reqs, **kw)
    divs = check_rows(model, reqs, res)
    assert not divs, "\n".join(d.message for d in divs)
    return res


def test_two_model_rows_equal_serial_greedy(llama: Any, twin: Any) -> None:
    reqs = mixed(lambda i: TwoModelProvider(twin))
    res = assert_rows_serial(llama, reqs, max_batch=3)
    widths = [len(s["rows"]) for s in res.steps]
    assert max(widths) == 3 and min(w for w in widths if w) == 1, widths  # B moves with joins and finishes
    assert any(s["joined"] and s["index"] > 0 for s in res.steps)
    assert {"row": "r1", "why": "preempted"} in [x for s in res.steps for x in s["left"]]
    ks = {tuple(e["k_accept"] for e in s["rows"]) for s in res.steps}
    assert any(len(set(k)) > 1 for k in ks), "every step accepted uniformly: per-row rollback not exercised"
    ends = [max(s["index"] for s in res.steps if any(e["row"] == r.rid for e in s["rows"])) for r in reqs]
    assert len(set(ends)) > 1, f"rows finished at the same step {ends}"


@pytest.mark.parametrize("rng", ["stream", "position"])
def test_two_model_rows_equal_serial_sampled(llama: Any, twin: Any, rng: str) -> None:
    assert_rows_serial(llama, mixed(lambda i: TwoModelProvider(twin), temp=0.8, rng=rng))


def test_ngram_and_two_model_rows_share_a_batch(llama: Any, twin: Any) -> None:
    reqs = mixed(lambda i: NgramProvider(gamma=3) if i % 2 else TwoModelProvider(twin))
    assert_rows_serial(llama, reqs)


def test_tapped_source_runs_on_the_serial_lane(llama: Any, twin: Any) -> None:
    """A source reading the target's hidden states cannot share the batch: serial lane, reason kept."""

    def tapped(i: int) -> Any:
        class Fresh(FakeProvider):
            def open(self, sampler: Any, target: Any) -> Any:
                return FakeSource(lambda s, feed, n, base: [], tap_layers=(0,))

        return Fresh(FakeSource(lambda s, feed, n, base: []))

    reqs = mixed(lambda i: tapped(i) if i == 2 else TwoModelProvider(twin))
    res = assert_rows_serial(llama, reqs)
    assert res.lanes["r2"].startswith("serial: the FakeSource source reads the target's hidden states"), res.lanes
    assert all(res.lanes[r] == "batch" for r in ("r0", "r1", "r3")), res.lanes


def test_one_token_prompt_and_full_prefill_rows(llama: Any, twin: Any) -> None:
    """A one-token prompt (tail-split drains nothing: an empty row joins) and a full-prefill row
    (its first token is the prefill's own sample, before it joins)."""
    ps = zoo.prompts()
    reqs = [BatchRequest("one", [int(ps[0].token_ids[0])], _params(0), TwoModelProvider(twin)),
            BatchRequest("full", list(ps[1].token_ids), _params(1, prefill="full"), NgramProvider(gamma=3)),
            BatchRequest("long", list(ps[2].token_ids), _params(2), TwoModelProvider(twin), arrive=1)]
    assert_rows_serial(llama, reqs)


def test_max_batch_one_is_serial_order(llama: Any, twin: Any) -> None:
    res = assert_rows_serial(llama, mixed(lambda i: TwoModelProvider(twin))[:3], max_batch=1)
    assert all(len(s["rows"]) <= 1 for s in res.steps)


def test_compare_row_names_row_step_and_neighbours(llama: Any, twin: Any) -> None:
    reqs = mixed(lambda i: TwoModelProvider(twin))
    res = batch_generate(llama, reqs)
    serial = spec_generate(llama, TwoModelProvider(twin), reqs[0].prompt_ids, reqs[0].params)
    at = step_of(res.steps, "r0", 2)
    assert at is not None
    bad = res.rows["r0"]
    bad.records[3]["k_accept"] += 1  # records: prefill, round 0, round 1, round 2
    div = compare_row("r0", bad, serial, res.steps)
    assert isinstance(div, RowDivergence)
    assert (div.row, div.step, div.round, div.field) == ("r0", at["step"], 2, "k_accept"), div.message
    assert f"batch step {at['step']} (round 2)" in div.message and "rows present: " in div.message
    assert all(nb in div.message for nb in at["neighbours"]), div.message


def test_bad_requests_are_refused(llama: Any, twin: Any) -> None:
    with pytest.raises(ValueError, match="row 'x': prompt_ids must not be empty"):
        BatchRequest("x", [], _params(0), TwoModelProvider(twin))
    with pytest.raises(ValueError, match="pause must be"):
        BatchRequest("x", [1, 2], _params(0), TwoModelProvider(twin), pause=(3, 3))
    r = BatchRequest("x", [1, 2], _params(0), TwoModelProvider(twin))
    with pytest.raises(ValueError, match="row ids must be unique"):
        batch_generate(llama, [r, r])
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        batch_generate(llama, [r], max_batch=0)


def test_ulp_distance() -> None:
    assert ulp_distance(1.0, 1.0) == 0
    assert ulp_distance(-0.0, 0.0) == 0
    import numpy as np

    x = np.float32(1.5)
    assert ulp_distance(float(x), float(np.nextafter(x, np.float32(2)))) == 1
    assert ulp_distance(-1e-45, 1e-45) == 2
