"""The three invariances of batched speculation (``engine.batched_check``) for our engine.

- On the CPU (bit-exact): M holds bitwise (every verify row of the batched forward equals
  one-token decode, 0 ULP), B holds token for token (each row alone ≡ the row among
  joining / leaving / preempted batch-mates), seeded holds (sampled rows: the same tokens
  batched and alone; keyed per position: plain decode's tokens).
- On the CPU double of a non-bit-exact backend (``engine.nonexact``, logit noise on every
  multi-token forward, keyed by the whole batch's inputs): M differs and is ``numerics``
  only with evidence (same prefix, reproduced blocks, within the stated bound); a B flip is
  ``numerics`` with both rows weighed at the flip.
- Each check can fail: a planted neighbour rollback makes B ``logic`` naming the row and
  step; a planted shared RNG makes seeded ``logic``; a planted short rollback makes M
  ``logic`` (the row's cache is not the kept prefix's).
"""

from __future__ import annotations

from typing import Any

import pytest

import zoo
from engine import batched as eb
from engine.batched import BatchRequest, RowRng, batch_generate
from engine.batched_check import b_invariance, m_invariance, seeded_invariance, serial_flip
from engine.executor import GenerationParams
from engine.sampler import SamplerParams
from engine.sources.ngram import NgramProvider
from engine.sources.two_model import TwoModelProvider
from tests.test_batched_traces import swap_neighbour_drops


def _load(name: str, scale: float = 0.0) -> Any:
    from engine.models import load
    from engine.nonexact import emulate_nonexact

    m = load(str(zoo.model_dir(name))).model
    return emulate_nonexact(m, scale, seed=3) if scale else m


@pytest.fixture(scope="module")
def llama() -> Any:
    return _load("llama")


@pytest.fixture(scope="module")
def twin() -> Any:
    return _load(zoo.model_name("llama", "twin"))


def rows(twin: Any, temp: float = 0.0, rng: str = "position") -> list[BatchRequest]:
    """Rows r0 and r2 sampled at ``temp`` (seeded), r1 and r3 greedy; r3 drafts by n-gram
    lookup (mostly nothing: a row without drafts beside rows with them)."""
    ps = zoo.prompts()
    return [BatchRequest(f"r{i}", list(ps[i].token_ids),
                         GenerationParams(max_tokens=[12, 20, 7, 16][i], gamma=3, seed=i, eos_ids=(zoo.eos_id(),),
                                          sampler=SamplerParams(temperature=temp if i % 2 == 0 else 0.0, rng=rng)),
                         TwoModelProvider(twin) if i != 3 else NgramProvider(gamma=3),
                         arrive=[0, 0, 2, 3][i], pause=(4, 6) if i == 1 else None) for i in range(4)]


def test_cpu_all_three_hold(llama: Any, twin: Any) -> None:
    m = m_invariance(llama, rows(twin))
    assert m.verdict == "holds" and "0 ULP" in m.detail and m.checked > 40, m.to_dict()
    b = b_invariance(llama, rows(twin))
    assert b.verdict == "holds" and "preempted: r1" in b.detail, b.to_dict()
    for rng in ("position", "stream"):
        s = seeded_invariance(llama, rows(twin, 0.8, rng))
        assert s.verdict == "holds", s.to_dict()
    assert "plain decode" in seeded_invariance(llama, rows(twin, 0.8)).detail


def test_recurrent_target_m_and_b_hold() -> None:
    t, d = _load("qwen35"), _load(zoo.model_name("qwen35", "twin"))
    assert m_invariance(t, rows(d)).verdict == "holds"
    assert b_invariance(t, rows(d)).verdict == "holds"


def test_double_m_is_numerics_with_evidence(twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.batched_check as bc

    noisy = _load("llama", 0.01)
    m = m_invariance(noisy, rows(twin), budget=0.01)
    assert m.verdict == "numerics", m.to_dict()
    assert any("same prefix" in e for e in m.evidence) and any("reproduced" in e for e in m.evidence), m.evidence
    monkeypatch.setattr(bc, "logit_spread", lambda *a: 0.0)  # no measured spread: the stated bound alone
    tight = m_invariance(noisy, rows(twin), budget=1e-4)  # a bound the backend does not keep
    assert tight.verdict == "logic" and "beyond the stated bound" in tight.detail, tight.to_dict()


def _spread_grows_with_depth(monkeypatch: pytest.MonkeyPatch, reqs: list[BatchRequest], deep: float) -> None:
    """The measured spread between correct forward paths: 0 at the prompts, ``deep`` at depth,
    as a GPU's recurrent state drifts further at round 3 than at the prompt (the CPU double's
    one-row paths agree at every depth, so the measurement is stood in for here)."""
    import engine.batched_check as bc

    calls: list[int] = []

    def spread(model: Any, toks: list[int], gamma: int) -> float:
        calls.append(len(toks))  # one call per row at its prompt first, then the rows weighed at depth
        return 0.0 if len(calls) <= len(reqs) else deep

    monkeypatch.setattr(bc, "logit_spread", spread)


def test_double_m_weighs_a_row_at_its_own_depth(twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off a bit-exact backend a row beyond the prompts' spread is judged against the spread of its
    own tokens at that round (seen on an H100: qwen35/twin/B4 at round 3, |Δ| 8 × the prompts'),
    and stays numerics with that evidence."""
    noisy, reqs = _load("llama", 0.01), rows(twin)
    _spread_grows_with_depth(monkeypatch, reqs, 0.01)
    m = m_invariance(noisy, reqs, budget=1e-4)
    assert m.verdict == "numerics", m.to_dict()
    assert any("weighed at their own depth" in e for e in m.evidence), m.evidence


def test_plant_shifted_verify_logits_break_m_at_their_own_depth(twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plant: a batched forward hands each row the logits of the position before (a padding or
    window offset off by one). Weighed at its own depth it is still logic, with the row and round."""
    import mlx.core as mx

    noisy, reqs = _load("llama", 0.01), rows(twin)
    call = type(noisy).__call__

    def shifted(self: Any, inputs: Any, *a: Any, **k: Any) -> Any:
        out = call(self, inputs, *a, **k)
        if inputs.shape[0] > 1 and inputs.shape[-1] > 1:
            out = mx.concatenate([out[:, :1], out[:, :-1]], axis=1)
        return out

    monkeypatch.setattr(type(noisy), "__call__", shifted)
    _spread_grows_with_depth(monkeypatch, reqs, 0.01)
    m = m_invariance(noisy, reqs, budget=1e-4)
    assert m.verdict == "logic" and "row r" in m.detail and "round" in m.detail, m.to_dict()
    assert "own" in m.detail and "tokens" in m.detail, m.detail


def test_double_b_flip_is_numerics_with_evidence(twin: Any) -> None:
    noisy = _load("llama", 0.5)
    b = b_invariance(noisy, rows(twin), budget=0.5)
    assert b.verdict == "numerics", b.to_dict()
    assert any("re-runs reproduce both blocks: True" in e for e in b.evidence), b.evidence
    assert any("its own row's pick: [True, True]" in e for e in b.evidence), b.evidence
    strict = b_invariance(noisy, rows(twin), budget=0.0)  # no stated bound: a flip is a bug
    assert strict.verdict == "logic", strict.to_dict()


def test_plant_neighbour_rollback_breaks_b(llama: Any, twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    swap_neighbour_drops(monkeypatch)  # the plant: row 0 rolls back by row 1's count and vice versa
    b = b_invariance(llama, rows(twin))
    assert b.verdict == "logic" and "batch step" in b.detail and "rows present" in b.detail, b.to_dict()


def test_plant_shared_rng_breaks_seeded(llama: Any, twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = RowRng(active=False)
    monkeypatch.setattr(eb, "_row_rng", lambda row: shared)
    s = seeded_invariance(llama, rows(twin, 0.8, "stream"))
    assert s.verdict == "logic" and s.detail.startswith("row r0: batch step 0 (round 0)"), s.to_dict()


def test_plant_short_rollback_breaks_m(llama: Any, twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real = eb._drops
    monkeypatch.setattr(eb, "_drops", lambda keeps, width: [max(x - 1, 0) for x in real(keeps, width)])
    m = m_invariance(llama, rows(twin))
    assert m.verdict == "logic" and "not one-token decode's cache" in m.detail, m.to_dict()


def test_double_row_vs_serial_flip_is_numerics_with_evidence(twin: Any) -> None:
    """Off a bit-exact backend a batched row may leave its serial run on a knife-edge: weighed
    with both verify blocks at the flip (``serial_flip``), never failed without evidence."""
    noisy = _load("llama", 0.5)
    reqs = rows(twin)
    res = batch_generate(noisy, reqs)
    flips = [f for f in (serial_flip(noisy, reqs, r.rid, res, budget=0.5) for r in reqs) if f is not None]
    assert flips, "no row left its serial run at noise 0.5: the case no longer exercises the weighing"
    assert all(f.verdict == "numerics" for f in flips), [f.to_dict() for f in flips]
    assert all(any("re-runs reproduce both blocks: True" in e for e in f.evidence) for f in flips)
    strict = serial_flip(noisy, reqs, next(r.rid for r in reqs if serial_flip(noisy, reqs, r.rid, res, budget=0.5)),
                         res, budget=0.0)
    assert strict is not None and strict.verdict == "logic", strict


def test_double_row_flip_weighed_against_its_own_tokens_spread(twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``classify_row``: a flip beyond the stated bound (1e-2) is weighed against what correct
    forward paths of the row's own tokens differ by when that is larger (a bf16 1.1B model on an
    H100: bench_batched B = 8 read logic at round 7 under the stated 1e-2). Stood in for here (the
    double's one-row paths agree): 0 -> the stated bound alone, logic; 0.5 -> numerics, with the
    measured spread named in the evidence."""
    import engine.batched_check as bc

    noisy = _load("llama", 0.5)
    reqs = rows(twin)
    res = batch_generate(noisy, reqs)
    flipped = [r.rid for r in reqs if serial_flip(noisy, reqs, r.rid, res, budget=0.5) is not None]
    assert flipped, "no row left its serial run at noise 0.5"
    monkeypatch.setattr(bc, "logit_spread", lambda *a: 0.0)
    stated = [bc.classify_row(noisy, reqs, rid, res, bound=0.01) for rid in flipped]
    assert any(v.verdict == "logic" for v in stated), [v.message for v in stated]
    monkeypatch.setattr(bc, "logit_spread", lambda *a: 0.5)
    own = [bc.classify_row(noisy, reqs, rid, res, bound=0.01) for rid in flipped]
    weighed = [v for v, s in zip(own, stated, strict=True) if s.verdict == "logic"]
    assert weighed and all(v.verdict == "numerics" for v in weighed), [(v.message, v.evidence) for v in weighed]
    assert all(any("the row's own" in e for e in v.evidence) for v in weighed)
