"""Batched rows classified by one path (``engine.batched_check.classify_row``) on the CPU double
of a GPU's batched arithmetic (``engine.nonexact``: per-row logit and cache-write noise keyed by
the batch), issue 39.

- Without a bug every row reads ``identical`` or ``numerics`` (caches within the calibrated
  bound, flips witnessed in the row's own batch), and the M invariance reads ``numerics``.
- Before the classification, the same batch read ``logic`` on ``target_cache_digest`` (byte
  equality on a backend that is not bit-exact): kept as a check that the double does to a batch
  what the GPU did (the row's cache digest differs from its serial run's from round 0).
- Planted per-row bugs still read ``logic`` with the row and its round named: one row's trim
  applied to another, a shared RNG across rows, a preempted row resumed one token short, a
  padding offset off by one (each planted by monkeypatching the batched executor).
"""

from __future__ import annotations

from typing import Any

import pytest

import zoo
from engine import batched as eb
from engine.batched import BatchRequest, RowRng, batch_generate
from engine.batched_check import RowJudge, backend_bound, classify_row, compare_row, m_invariance
from engine.executor import GenerationParams
from engine.sampler import SamplerParams
from engine.sources.ngram import NgramProvider
from engine.sources.two_model import TwoModelProvider
from tests.test_batched_traces import swap_neighbour_drops

SCALE, KV = 0.01, 0.001  # docs/backends.md: the double configured as the GPU measured


def _load(name: str) -> Any:
    from engine.models import load

    return load(str(zoo.model_dir(name))).model


@pytest.fixture(scope="module")
def double() -> Any:
    from engine.nonexact import emulate_nonexact

    return emulate_nonexact(_load("llama"), SCALE, seed=0, kv_scale=KV)


@pytest.fixture(scope="module")
def twin() -> Any:
    return _load(zoo.model_name("llama", "twin"))


def rows(twin: Any, rng: str = "position") -> list[BatchRequest]:
    """The run's B = 4 shape (specparity.jobs.batched): r0, r2 sampled at T 0.8, r1, r3 greedy;
    r3 drafts by n-gram lookup and joins at step 2; r1 is preempted at step 3 and resumes at 5."""
    ps = zoo.prompts()
    return [BatchRequest(f"r{i}", list(ps[i].token_ids),
                         GenerationParams(max_tokens=[12, 20, 7, 16][i], gamma=3, seed=i, eos_ids=(zoo.eos_id(),),
                                          sampler=SamplerParams(temperature=0.8 if i % 2 == 0 else 0.0, rng=rng)),
                         TwoModelProvider(twin) if i != 3 else NgramProvider(gamma=3),
                         arrive=[0, 0, 0, 2][i], pause=(3, 5) if i == 1 else None) for i in range(4)]


def judge(model: Any, reqs: list[BatchRequest]) -> list[Any]:
    res = batch_generate(model, reqs)
    j = RowJudge(model, reqs, res)
    return [j.classify(r.rid) for r in reqs]


def test_double_rows_are_numerics_with_evidence_never_logic(double: Any, twin: Any) -> None:
    reqs = rows(twin)
    res = batch_generate(double, reqs)
    # what the GPU showed (issue 39): byte equality reads the row's cache digest as a difference at round 0
    raw = compare_row("r1", res.rows["r1"], RowJudge(double, reqs, res).serial("r1"), res.steps,
                      ignore=frozenset({"margins", "confidence"}))
    assert raw is not None and raw.field == "target_cache_digest" and raw.round == 0, raw
    verdicts = [RowJudge(double, reqs, res).classify(r.rid) for r in reqs]
    assert all(v.verdict == "numerics" for v in verdicts), [v.to_dict() for v in verdicts]
    assert all(any("within the calibrated bound" in e for e in v.evidence) for v in verdicts), verdicts
    one = classify_row(double, reqs, "r3", res)  # the public single-row form agrees
    assert one.verdict == "numerics" and one.row == "r3"
    assert backend_bound(double) > 0


def test_double_m_reads_numerics(double: Any, twin: Any) -> None:
    m = m_invariance(double, rows(twin), budget=backend_bound(double))
    assert m.verdict == "numerics", m.to_dict()
    assert any("same prefix within the calibrated bound" in e for e in m.evidence), m.evidence


def test_exact_rows_are_identical(twin: Any) -> None:
    model = _load("llama")
    assert backend_bound(model) == 0.0
    assert {v.verdict for v in judge(model, rows(twin))} == {"identical"}


def _logic(verdicts: list[Any]) -> Any:
    bad = [v for v in verdicts if v.verdict == "logic"]
    assert bad, [v.to_dict() for v in verdicts]
    first = bad[0]
    assert first.message.startswith(f"row {first.row}: "), first.message
    assert first.round is not None and f"(round {first.round})" in first.message, first.message
    return first


def test_plant_one_rows_trim_applied_to_another(double: Any, twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    swap_neighbour_drops(monkeypatch)  # row 0 rolls back by row 1's count and vice versa
    first = _logic(judge(double, rows(twin)))
    assert "batch step" in first.message


def test_plant_shared_rng_across_rows(double: Any, twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = RowRng(active=False)
    monkeypatch.setattr(eb, "_row_rng", lambda row: shared)
    first = _logic(judge(double, rows(twin, "stream")))
    assert first.row in ("r0", "r2"), first.message  # a sampled row draws another row's stream


def test_plant_preempted_row_resumed_one_token_short(double: Any, twin: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    real = eb._Batch.join

    def join(self: Any, row: Any, caches: list[Any]) -> int:
        if row.swapped is not None:  # resuming after preemption: its caches lose their last position
            for c in caches:
                c.trim(1)
        return real(self, row, caches)

    monkeypatch.setattr(eb._Batch, "join", join)
    first = _logic(judge(double, rows(twin)))
    assert first.row == "r1", first.message  # the preempted row


def test_plant_padding_offset_off_by_one(double: Any, twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eb, "_join_start", lambda idx, length: idx - length - 1 if idx > length else idx - length)
    first = _logic(judge(double, rows(twin)))
    assert first.row in ("r1", "r2", "r3"), first.message  # a row joining a longer batch
