"""The numerics witness (engine/witness.py) and its non-bit-exact test double (engine/nonexact.py).

Issue 13 items 1 and 4, on the CPU: the witness replays each run's own
arithmetic path on the same prefix; the test double makes batched forwards
differ from one-token decode by up to ``SCALE`` per logit (the size measured
on the H200), so real arithmetic flips exist here. A flip the double causes is
``numerics`` with evidence; a planted token that no path gives is ``logic``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest

from engine.nonexact import ENV, emulate_nonexact, exact, from_env, is_emulated
from engine.witness import NumericsWitness, path_witness, serial_path
from specparity.cases.case import Case
from specparity.runners import case_paths, load_model, run_case
from traces.diff import diff_traces
from traces.io import Trace

SCALE = 1e-2  # max |Δ logit| of a batched row vs serial decode (H200, fp32 zoo)
# A knife-edge the double flips (plain margin 2.5e-5 at output token 14).
FLIP = Case("llama", "twin", "rnd-04", 3, 32)


def _models(*cases: Case) -> list[Any]:
    out = []
    for c in cases:
        for p in case_paths(c):
            if p is not None:
                out.append(load_model(str(p)).model)
    return list({id(m): m for m in out}.values())


@pytest.fixture
def emulated() -> Iterator[None]:
    models = _models(FLIP)
    for m in models:
        emulate_nonexact(m, SCALE)
    try:
        yield
    finally:
        for m in models:
            exact(m)


def _trace(runner: str, case: Case) -> Trace:
    return Trace.from_records(run_case(runner, case))


def _witness() -> NumericsWitness:
    return path_witness(lambda path: load_model(path).model)


# --- the test double ---------------------------------------------------------------------


def test_double_perturbs_multi_token_forwards_only_and_deterministically() -> None:
    from mlx_lm.models.cache import make_prompt_cache

    model = load_model(str(case_paths(FLIP)[0])).model
    ids = mx.array([[5, 9, 17, 3]], mx.uint32)

    def fwd(tokens: mx.array) -> mx.array:
        return model(tokens, cache=make_prompt_cache(model))

    plain_multi, plain_one = fwd(ids), fwd(ids[:, :1])
    emulate_nonexact(model, SCALE, seed=3)
    try:
        assert is_emulated(model) == (SCALE, 3)
        assert len(model.layers) > 0 and hasattr(model, "make_cache") or True
        multi, one = fwd(ids), fwd(ids[:, :1])
        delta = mx.abs(multi - plain_multi)
        assert 0 < float(delta.max().item()) <= SCALE * 1.0001
        assert mx.array_equal(one, plain_one)  # one-token decode untouched
        assert mx.array_equal(fwd(ids), multi)  # same inputs, same offset: same rounding
        emulate_nonexact(model, SCALE, seed=4)  # re-wrapping replaces, never stacks
        assert type(model).__mro__[1].__name__ == "Model" and is_emulated(model) == (SCALE, 4)
        assert not mx.array_equal(fwd(ids), multi)
    finally:
        exact(model)
    assert is_emulated(model) is None and mx.array_equal(fwd(ids), plain_multi)


def test_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    class M:
        def __call__(self, inputs: Any, cache: Any = None) -> Any:
            return inputs

    monkeypatch.delenv(ENV, raising=False)
    assert is_emulated(from_env(M())) is None
    monkeypatch.setenv(ENV, "0.02:7")
    assert is_emulated(from_env(M())) == (0.02, 7)
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(ValueError, match=ENV):
        from_env(M())


# --- the witness -------------------------------------------------------------------------


def test_arithmetic_flip_is_numerics_with_evidence(emulated: None) -> None:
    spec, plain = _trace("engine", FLIP), _trace("engine", FLIP.plain())
    assert diff_traces(spec, plain, level="tokens") is not None, "the double should flip this case"
    d = diff_traces(spec, plain, level="tokens", witness=_witness())
    assert d is not None and d.where == "output token 14", d.message
    assert (d.klass, d.basis, d.label) == ("numerics", "witness", "numerics"), d.message
    assert d.witness is not None
    paths = d.witness.data["paths"]
    assert [p["reproduced"] for p in paths[:2]] == [True, True]
    assert "verify window" in paths[0]["path"] and "one-token" in paths[1]["path"]
    da, db = d.witness.data["delta"]["a"], d.witness.data["delta"]["b"]
    assert da > 0 > db and d.witness.data["max_abs_row_delta"] <= 2 * SCALE
    assert "top-2 [" in d.message and "Δ = logit[" in d.message


def test_exact_backend_has_no_flip_to_explain() -> None:
    spec, plain = _trace("engine", FLIP), _trace("engine", FLIP.plain())
    assert diff_traces(spec, plain, level="tokens", witness=_witness()) is None


def _plant_token(trace: Trace, j: int, token: int) -> Trace:
    """Trace with output token ``j`` replaced by ``token`` (a run that emitted what no path gives)."""
    recs = copy.deepcopy(trace.records())
    seen = 0
    for r in recs:
        if r["type"] == "plain" and r["emitted"]:
            if seen == j:
                r["sample"], r["emitted"] = token, [token]
                break
            seen += 1
    recs[-1]["output_ids"][j] = token
    return Trace.from_records(recs)


def test_planted_runner_up_token_is_logic_even_on_a_knife_edge() -> None:
    # Output token 14 of the plain run sits on a 2.5e-5 margin: eps calls a swap "numerics?",
    # the witness sees that no path gives the swapped token on this prefix.
    plain = _trace("engine", FLIP.plain())
    j = 14
    assert plain.events[j]["margin"] < 1e-3
    w = _witness()
    row = serial_path(load_model(str(case_paths(FLIP)[0])).model,
                      list(plain.header["prompt"]["token_ids"]), plain.output_ids[:j])
    runner_up = row.top2[1][0]
    bad = _plant_token(plain, j, runner_up)
    assert diff_traces(plain, bad, level="tokens").label == "numerics?"  # type: ignore[union-attr]
    d = diff_traces(plain, bad, level="tokens", witness=w)
    assert d is not None and (d.klass, d.basis) == ("logic", "witness"), d.message
    assert "NOT reproduced" in d.message and f"sampled {runner_up} but its path gives" in d.message


def test_witness_declines_what_it_cannot_replay() -> None:
    plain = _trace("engine", FLIP.plain())
    bad = _plant_token(plain, 3, 7)
    sampled = copy.deepcopy(bad.records())
    sampled[0]["params"]["temperature"] = 0.7
    w = _witness()
    d = diff_traces(plain, Trace.from_records(sampled), level="tokens", witness=w)
    assert d is not None and (d.basis, d.witness, w.judged) == ("eps", None, 0), d and d.message
    assert "cannot judge" in d.message
    other = copy.deepcopy(bad.records())
    other[0]["target"]["weights_sha256"] = "0" * 64
    assert diff_traces(plain, Trace.from_records(other), level="tokens", witness=w).basis == "eps"  # type: ignore[union-attr]
    nowhere = NumericsWitness(lambda header: None)
    assert diff_traces(plain, bad, level="tokens", witness=nowhere).basis == "eps"  # type: ignore[union-attr]


def test_short_trim_flip_is_logic_under_the_double(emulated: None, short_target_trim: None) -> None:
    # The trim bug keeps a rejected token; the witness replays the correct rollback.
    spec, plain = _trace("engine", FLIP), _trace("engine", FLIP.plain())
    d = diff_traces(spec, plain, level="tokens", witness=_witness())
    assert d is not None and d.klass == "logic", d.message
    assert d.basis in ("witness", "structural"), d.message


def test_witness_declines_runs_whose_arithmetic_is_not_this_process() -> None:
    """Traces from another platform, or from an emulation not active here, fall back to eps, saying why."""
    spec, plain = None, None
    models = _models(FLIP)
    for m in models:
        emulate_nonexact(m, SCALE)
    try:
        spec, plain = _trace("engine", FLIP), _trace("engine", FLIP.plain())
    finally:
        for m in models:
            exact(m)
    d = diff_traces(spec, plain, level="tokens", witness=_witness())  # judged WITHOUT the double
    assert d is not None and d.basis == "eps", d.message
    assert "witness declined: run a's first record does not replay here" in d.message
    other = copy.deepcopy(plain.records())
    other[0]["platform"] = {**other[0]["platform"], "device": "Device(gpu, 0)", "backend": "cuda"}
    bad = _plant_token(Trace.from_records(other), 3, 7)
    d = diff_traces(plain, bad, level="tokens", witness=_witness())
    assert d is not None and d.basis == "eps" and "ran on Device(gpu, 0) cuda" in d.message, d.message


def test_replayed_first_record_matches_recorded_margins() -> None:
    spec = _trace("engine", FLIP)
    from engine.witness import evaluate_path
    from traces.diff import _token_sites

    site = _token_sites(spec)[10]
    p = evaluate_path(load_model(str(case_paths(FLIP)[0])).model, spec, site, "a")
    assert p.calibration == 0.0 and p.reproduced and p.margin == pytest.approx(site.margin, abs=1e-6)


def test_drafter_flip_names_the_run_whose_draft_its_path_does_not_give() -> None:
    """A differing draft (same feed, same earlier rounds) is judged on the two-model drafter's path."""
    spec = _trace("engine", FLIP)
    recs = copy.deepcopy(spec.records())
    rounds = [r for r in recs if r["type"] == "round"]
    r = next(x for x in rounds[1:] if len(x["drafts"]) > 1)
    r["drafts"][1] = (r["drafts"][1] + 1) % 512
    r["window"] = [r["window"][0], *r["drafts"]]
    bad = Trace.from_records(recs)
    w = _witness()
    d = diff_traces(spec, bad, witness=w)
    assert d is not None and (d.where, d.field) == (f"round {r['index']}", "drafts"), d.message
    assert d.flip is not None and d.flip.lane == "drafter" and d.flip.a.position == 1
    assert (d.klass, d.basis) == ("logic", "witness"), d.message
    assert f"b round {r['index']} draft 1 drafted {r['drafts'][1]} but its drafter path gives" in d.message
    paths = d.witness.data["paths"]  # type: ignore[union-attr]
    assert paths[0]["reproduced"] and not paths[1]["reproduced"]
    assert d.witness.data["lane"] == "drafter"  # type: ignore[union-attr]
    # without models: eps cannot judge a draft (no margins), labelled
    e = diff_traces(spec, bad)
    assert e is not None and e.label == "logic?" and "drafts carry no margins" in e.message


def _sites_replay_exactly(trace: Trace, model: Any) -> int:
    from engine.witness import evaluate_path
    from traces.diff import _token_sites

    sites = _token_sites(trace)[1::3]
    for s in sites:
        p = evaluate_path(model, trace, s, "a")
        assert p.reproduced and p.margin == s.margin and not p.notes, (s, p.format(), p.notes)
    return len(sites)


def test_replay_is_exact_through_recurrent_and_past_wrap_rollbacks() -> None:
    """The witness's own rollback keeps the verify's bytes: recorded margins reproduce exactly."""
    import zoo
    from engine.executor import GenerationParams, spec_generate
    from engine.sources.two_model import TwoModelProvider

    rec = Case("qwen35", "twin", "nat-03", 3, 32)  # gated-DeltaNet rounds with rejections
    tr = _trace("engine", rec)
    assert any(r["k_accept"] < len(r["drafts"]) for r in tr.rounds)
    assert _sites_replay_exactly(tr, load_model(str(case_paths(rec)[0])).model) >= 8
    ring = Case("gemma3", "twin", "nat-00", 3, 64)  # rotating="exact": speculation past the wrap
    tp, dp = case_paths(ring)
    target, drafter = load_model(str(tp)), load_model(str(dp))
    params = GenerationParams(max_tokens=64, gamma=3, eos_ids=target.eos_ids, rotating="exact")
    res = spec_generate(target.model, TwoModelProvider(drafter.model),
                        list(zoo.prompt("nat-00").token_ids), params)
    exact_tr = Trace.from_records([_trace("engine", ring).header, *res.records, res.footer()])
    assert not exact_tr.plains and len(exact_tr.rounds) > 20
    assert _sites_replay_exactly(exact_tr, target.model) >= 15


def test_planted_recurrent_rollback_bug_is_not_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec-round trio that forgets to replay the kept positions: the witness keeps its own."""
    from engine import rollback

    monkeypatch.setattr(rollback.CacheRollback, "_replay", lambda self, r, keep: None)
    case = Case("qwen35", "twin", "nat-03", 3, 32)
    spec, plain = _trace("engine", case), _trace("engine", case.plain())
    d = diff_traces(spec, plain, level="tokens", witness=_witness())
    assert d is not None and (d.klass, d.basis) == ("logic", "witness"), d and d.message


# --- issue 23: the witness on a greedy run with logits processors, and on a drafter flip
# --- after rejecting rounds ------------------------------------------------------------------

RP = Case("llama", "twin", "rnd-04", 3, 32, processors="rp1.3c64")


def test_greedy_run_with_processors_is_replayed_with_its_processors() -> None:
    """A greedy run with a repetition penalty is judged on ITS path: the penalty applied on the
    prompt + emitted history, as the engine applies it. Planted at output token 23, where the
    penalty changed the pick: the correct run's token is reproduced and the planted one is not
    (logic, naming b). A witness that replayed plain greedy would call the correct run's token
    unexplained; one that declined left the class to the eps guess."""
    plain = _trace("engine", RP.plain())
    assert plain.header["params"]["temperature"] == 0 and plain.header["params"]["logits_processors"]
    model = load_model(str(case_paths(RP)[0])).model
    prompt = list(plain.header["prompt"]["token_ids"])
    j = next(j for j in range(len(plain.output_ids))
             if serial_path(model, prompt, plain.output_ids[:j]).token != plain.output_ids[j])
    assert j == 23, j  # the first token the processors changed
    assert serial_path(model, prompt, plain.output_ids[:j], like=plain).token == plain.output_ids[j]
    bad = _plant_token(plain, j, (plain.output_ids[j] + 1) % 512)
    w = _witness()
    d = diff_traces(plain, bad, level="tokens", witness=w)
    assert d is not None and d.where == f"output token {j}", d and d.message
    assert (d.klass, d.basis, d.label) == ("logic", "witness", "logic"), d.message
    assert d.witness is not None and w.judged == 1
    paths = d.witness.data["paths"]
    assert [p["reproduced"] for p in paths[:2]] == [True, False], d.message
    assert "logits processors applied" in paths[0]["path"], paths[0]


@pytest.mark.parametrize("case", [
    RP,
    Case("llama", "twin", "nat-00", 3, 32, processors="rp2c64+hlast"),  # the prompt's head matters
    Case("llama", "twin", "nat-00", 3, 32, processors="fp-3c64"),  # a count: the pending token once
], ids=lambda c: c.processors)
def test_processor_history_of_a_spec_run_replays_exactly(case: Case) -> None:
    """Every target sample of a greedy spec run with logits processors is reproduced on its own
    path: the history from the whole prompt or its last token (``+hlast``), grown by the
    emitted tokens, a window's rows seeing the pending token once and then the path's own
    samples. (A replay starting every history at the whole prompt misses token 10 of the
    ``+hlast`` run; one that counted the pending token twice misses tokens 5 and 8 of the
    negative frequency penalty's.)"""
    from engine.witness import evaluate_path
    from traces.diff import _token_sites

    model = load_model(str(case_paths(case)[0])).model
    spec = _trace("engine", case)
    sites = _token_sites(spec)
    for site in sites:
        p = evaluate_path(model, spec, site, "a")
        assert p.reproduced, (case.case_id, site, p.format())
    assert len(sites) == 32


def _drop(r: dict[str, Any]) -> int:
    return max(len(r["drafts"]) - int(r["k_accept"]) - 1, 0)


def test_drafter_path_reproduces_every_draft_through_rejecting_rounds() -> None:
    """Every draft of every round, replayed on the drafter's own path with the rollback the
    contract gives (``trim(max(d - k - 1, 0))``): a replay trimming one too many or too few,
    or not at all, misses a dozen of these 42 drafts."""
    from engine.witness import evaluate_draft_path
    from traces.diff import TokenSite

    spec = _trace("engine", FLIP)
    drafter = load_model(str(case_paths(FLIP)[1])).model
    assert sum(_drop(r) > 0 for r in spec.rounds) >= 5  # rounds whose rollback matters
    n = 0
    for ev, rec in enumerate(spec.events):
        for p, tok in enumerate(rec.get("drafts") or []):
            site = TokenSite(event=ev, record=f"round {rec['index']}", position=p, token=tok, margin=None)
            got = evaluate_draft_path(drafter, spec, site, "a")
            assert got.reproduced, (site, got.format(), got.notes)
            n += 1
    assert n >= 40, n


def test_drafter_flip_after_rejecting_rounds_names_the_planted_run() -> None:
    """A draft planted in the first round after three rounds whose drafter rollback dropped
    positions: the good run's drafter path still gives its draft (a wrong replay trim would
    not: the verdict would name both runs, or the good one), the planted one's does not."""
    spec = _trace("engine", FLIP)
    recs = copy.deepcopy(spec.records())
    rounds = [r for r in recs if r["type"] == "round"]
    i = next(i for i in range(len(rounds)) if sum(_drop(r) > 0 for r in rounds[:i]) >= 3
             and rounds[i]["drafts"])
    r = rounds[i]
    r["drafts"][0] = (r["drafts"][0] + 1) % 512
    r["window"] = [r["window"][0], *r["drafts"]]
    d = diff_traces(spec, Trace.from_records(recs), witness=_witness())
    assert d is not None and (d.where, d.field) == (f"round {r['index']}", "drafts"), d and d.message
    assert d.flip is not None and (d.flip.lane, d.flip.a.position) == ("drafter", 0)
    assert (d.klass, d.basis) == ("logic", "witness"), d.message
    paths = d.witness.data["paths"]  # type: ignore[union-attr]
    assert [p["reproduced"] for p in paths] == [True, False], d.message
    assert f"b round {r['index']} draft 0 drafted {r['drafts'][0]}" in d.message
