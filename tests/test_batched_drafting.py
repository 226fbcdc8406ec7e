"""Batched drafting and the per-phase profile (issue 43).

The two-model rows of a batch draft in ONE drafter forward per draft step (``engine.batched``
``_Drafters``); every row must still be its serial run record for record (drafts, drafter cache
digests, tokens), greedy and sampled, with rows drafting different lengths (token budgets). A
planted drafter rollback off by one is caught with the row and round named. The per-phase
profile (``engine.telemetry.profiling``) changes no token or record, and costs nothing when off.
"""

from __future__ import annotations

from typing import Any

import pytest

import zoo
from engine import batched as eb
from engine import telemetry
from engine.batched import BatchRequest, batch_generate
from engine.batched_check import check_rows
from engine.executor import GenerationParams, spec_generate
from engine.sampler import ProcessorParams, SamplerParams
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


def _rows(twin: Any, temp: float = 0.0, n: int = 4, **kw: Any) -> list[BatchRequest]:
    ps = zoo.prompts()
    return [BatchRequest(f"r{i}", list(ps[i].token_ids),
                         GenerationParams(max_tokens=[10, 17, 6, 13][i % 4], gamma=[3, 4, 2, 3][i % 4], seed=i,
                                          sampler=SamplerParams(temperature=temp, **kw), eos_ids=(zoo.eos_id(),)),
                         TwoModelProvider(twin), arrive=[0, 0, 1, 3][i % 4]) for i in range(n)]


class _Counting:
    """Counts the drafter's forwards and the rows of each."""

    def __init__(self, model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batch_sizes: list[int] = []
        cls = type(model)
        real = cls.__call__
        seen = self.batch_sizes

        def call(self_: Any, inputs: Any, *a: Any, **k: Any) -> Any:
            if self_ is model:
                seen.append(int(inputs.shape[0]))
            return real(self_, inputs, *a, **k)

        monkeypatch.setattr(cls, "__call__", call)


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_two_model_rows_draft_in_one_batch_and_equal_serial(llama: Any, twin: Any, temp: float,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = _rows(twin, temp)
    serial = {r.rid: spec_generate(llama, r.provider, r.prompt_ids, r.params) for r in reqs}
    counting = _Counting(twin, monkeypatch)
    res = batch_generate(llama, reqs)
    assert res.drafting == {r.rid: "batched" for r in reqs}, res.drafting
    assert max(counting.batch_sizes) >= 3, counting.batch_sizes  # several rows in one drafter forward
    divs = check_rows(llama, reqs, res, serial)
    assert not divs, "\n".join(d.message for d in divs)
    # fewer drafter forwards than the rows' serial runs made
    serial_forwards = sum(r.speculation.drafted for r in serial.values() if r.speculation)
    batched_forwards = sum(1 for b in counting.batch_sizes if b > 1)
    assert batched_forwards < serial_forwards


def test_rows_that_cannot_batch_their_drafts_say_why(llama: Any, twin: Any) -> None:
    ps = zoo.prompts()
    proc = SamplerParams(processors=ProcessorParams(repetition_penalty=1.3))
    reqs = [BatchRequest("r0", list(ps[0].token_ids), GenerationParams(max_tokens=9, eos_ids=(zoo.eos_id(),)),
                         TwoModelProvider(twin)),
            BatchRequest("r1", list(ps[1].token_ids), GenerationParams(max_tokens=9, eos_ids=(zoo.eos_id(),),
                                                                       sampler=proc), TwoModelProvider(twin)),
            BatchRequest("r2", list(ps[2].token_ids), GenerationParams(max_tokens=9, eos_ids=(zoo.eos_id(),)),
                         NgramProvider(gamma=3))]
    res = batch_generate(llama, reqs)
    assert res.drafting["r0"] == "batched"
    assert res.drafting["r1"].startswith("per row: logits processors"), res.drafting
    assert res.drafting["r2"].startswith("per row: the NgramSource source"), res.drafting
    divs = check_rows(llama, reqs, res)
    assert not divs, "\n".join(d.message for d in divs)


def test_a_drafter_rollback_off_by_one_is_caught(llama: Any, twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eb, "_drafter_keeps", lambda d, k: min(k + 1, d - 1))  # keeps a rejected draft
    reqs = _rows(twin)
    res = batch_generate(llama, reqs)
    divs = check_rows(llama, reqs, res)
    assert divs, "a drafter cache keeping a rejected draft went unnoticed"
    first = divs[0]
    assert first.field in ("drafter_cache_digest", "drafts"), first.message
    assert first.round is not None and f"round {first.round}" in first.message and first.row in first.message


def test_the_profile_changes_nothing_and_is_free_when_off(llama: Any, twin: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = _rows(twin, n=3)
    plain_batch = batch_generate(llama, reqs)
    plain_serial = spec_generate(llama, reqs[1].provider, reqs[1].prompt_ids, reqs[1].params)
    with telemetry.profiling() as prof:
        prof_batch = batch_generate(llama, _rows(twin, n=3))
        prof_serial = spec_generate(llama, reqs[1].provider, reqs[1].prompt_ids, reqs[1].params)
    strip = lambda recs: [{k: v for k, v in r.items() if k != "time_s"} for r in recs]  # noqa: E731
    for rid in plain_batch.rows:
        assert strip(prof_batch.rows[rid].records) == strip(plain_batch.rows[rid].records), rid
    assert strip(prof_serial.records) == strip(plain_serial.records)
    d = prof.to_dict()
    assert d["rounds"] > 0 and set(d["phases"]) == set(telemetry.PHASES)
    assert all(v["s"] >= 0 for v in d["phases"].values()) and d["phases"]["forward"]["s"] > 0
    assert "| forward |" in telemetry.phase_table({"batched": d})

    def no(*_a: Any, **_k: Any) -> None:
        raise AssertionError("profiling work while the profile is off")

    monkeypatch.setattr(telemetry.PhaseProfile, "lap", no)
    monkeypatch.setattr(telemetry.PhaseProfile, "start", no)
    batch_generate(llama, _rows(twin, n=2))
    spec_generate(llama, reqs[0].provider, reqs[0].prompt_ids, reqs[0].params)


def test_batch_drafts_off_drafts_per_row(llama: Any, twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = _rows(twin, n=3)
    counting = _Counting(twin, monkeypatch)
    res = batch_generate(llama, reqs, batch_drafts=False)
    assert res.drafting == {r.rid: "per row: batch_drafts=False" for r in reqs}, res.drafting
    assert set(counting.batch_sizes) == {1}, counting.batch_sizes
    divs = check_rows(llama, reqs, res)
    assert not divs, "\n".join(d.message for d in divs)


def test_off_a_bit_exact_backend_rows_draft_alone_unless_asked(twin: Any) -> None:
    from engine.nonexact import emulate_nonexact, exact
    from specparity.runners import load_model

    noisy = emulate_nonexact(load_model(str(zoo.model_dir("llama"))).model, 0.01)  # the loader's shared model
    try:
        res = batch_generate(noisy, _rows(twin, n=2))
        assert all(v.startswith("per row: the backend is not bit-exact") for v in res.drafting.values()), res.drafting
        res = batch_generate(noisy, _rows(twin, n=2), batch_drafts=True)
        assert set(res.drafting.values()) == {"batched"}, res.drafting
    finally:
        exact(noisy)


def test_a_lone_row_drafts_alone_and_joins_when_a_second_comes(llama: Any, twin: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ps = zoo.prompts()
    params = GenerationParams(max_tokens=24, gamma=3, eos_ids=(zoo.eos_id(),))
    reqs = [BatchRequest("r0", list(ps[0].token_ids), params, TwoModelProvider(twin)),
            BatchRequest("r1", list(ps[1].token_ids), GenerationParams(max_tokens=8, gamma=2, eos_ids=(zoo.eos_id(),)),
                         TwoModelProvider(twin), arrive=2)]
    counting = _Counting(twin, monkeypatch)
    res = batch_generate(llama, reqs)
    sizes = counting.batch_sizes
    first_pair = sizes.index(2)
    assert first_pair > 0 and set(sizes[:first_pair]) == {1}, sizes  # r0 alone: its own B = 1 drafter forwards
    assert sizes[-1] == 1, sizes  # r1 done: r0 drafts alone again
    divs = check_rows(llama, reqs, res)
    assert not divs, "\n".join(d.message for d in divs)
