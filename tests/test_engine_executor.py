"""Executor tests with model-free FAKE draft sources against the zoo ``llama`` target.

The fake source implements the ``DraftSource`` protocol (engine/seam.py) with a
pluggable policy, so every path of ``engine.executor.spec_generate`` (zero-length
rounds, all-accept, all-reject, variable lengths, over-long drafts, taps, EOS,
budget, on_token stop, full prefill) is exercised without a drafter model and
checked token for token against ``plain_generate`` at greedy.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from fakes import FakeProvider, FakeSource, Policy

import zoo
from engine.executor import GenerationParams, plain_generate, refeed, spec_generate
from engine.seam import DraftSource
from engine.sources.two_model import TwoModelProvider
from tests.helpers import load_zoo

os.environ.setdefault("HF_HUB_OFFLINE", "1")



# ---------------------------------------------------------------- policies


def zero_policy(src: FakeSource, feed: list[int], n: int, base: int) -> list[int]:
    return []


def oracle(ref: list[int], length: Callable[[int, int], int]) -> Policy:
    """Drafts the true greedy continuation (``ref``), ``length(n, round)`` tokens long."""

    def policy(src: FakeSource, feed: list[int], n: int, base: int) -> list[int]:
        m = max(0, min(length(n, src.round), n))
        return ref[base : base + m]

    return policy


def wrong(ref: list[int], vocab: int) -> Policy:
    def policy(src: FakeSource, feed: list[int], n: int, base: int) -> list[int]:
        return [(ref[base + i] + 1) % vocab for i in range(n)]

    return policy


# ---------------------------------------------------------------- fixtures

MAX = 16
GAMMA = 3


@pytest.fixture(scope="module")
def target() -> Any:
    return load_zoo("llama")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return list(zoo.prompts()[0].token_ids)


@pytest.fixture(scope="module")
def ref(target: Any, prompt: list[int]) -> list[int]:
    r = plain_generate(target.model, prompt, GenerationParams(max_tokens=MAX))
    assert len(r.output_ids) == MAX
    return r.output_ids


def params(**kw: Any) -> GenerationParams:
    kw.setdefault("max_tokens", MAX)
    kw.setdefault("gamma", GAMMA)
    return GenerationParams(**kw)


def rounds(result: Any) -> list[dict[str, Any]]:
    return [r for r in result.records if r["type"] == "round"]


def run(target: Any, prompt: list[int], src: FakeSource, **kw: Any) -> Any:
    return spec_generate(target.model, FakeProvider(src), prompt, params(**kw))


# ---------------------------------------------------------------- (a) zero drafts


def test_zero_drafts_is_plain_decode(target: Any, prompt: list[int], ref: list[int]) -> None:
    src = FakeSource(zero_policy)
    r = run(target, prompt, src)
    assert r.output_ids == ref
    rs = rounds(r)
    assert len(rs) == MAX
    pending = [prompt[-1]]
    for i, rec in enumerate(rs):
        assert rec["drafts"] == [] and rec["k_accept"] == 0
        assert rec["window"] == pending == rec["feed"]
        assert rec["end"] == ("budget" if i == len(rs) - 1 else "bonus")
        assert rec["emitted"] == [ref[i]]
        pending = [rec["samples"][0]]
    s = r.speculation
    assert s.drafted == 0 and s.accepted == 0 and s.rejected == 0
    assert s.target_calls == s.rounds == len(rs)
    assert r.usage.finish_reason == "length" and r.usage.generation_tokens == MAX
    assert [c["d"] for c in src.commits] == [0] * MAX


# ---------------------------------------------------------------- (b) oracle


@pytest.mark.parametrize("length", ["n-1", "one", "n"])
def test_oracle_drafts_all_accepted(target: Any, prompt: list[int], ref: list[int], length: str) -> None:
    fn = {"n-1": lambda n, r: n - 1, "one": lambda n, r: 1, "n": lambda n, r: n}[length]
    src = FakeSource(oracle(ref, fn))
    r = run(target, prompt, src)
    assert r.output_ids == ref
    s = r.speculation
    assert s.drafted > 0
    assert s.accepted == s.drafted and s.rejected == 0
    for rec in rounds(r):
        assert rec["k_accept"] == len(rec["drafts"])
        assert rec["end"] in ("bonus", "budget")
    assert s.target_calls == s.rounds < MAX


# ---------------------------------------------------------------- (c) wrong drafts


def test_wrong_drafts_rejected_lossless(target: Any, prompt: list[int], ref: list[int]) -> None:
    vocab = target.model.args.vocab_size
    src = FakeSource(wrong(ref, vocab))
    r = run(target, prompt, src)
    assert r.output_ids == ref
    rs = rounds(r)
    assert len(rs) == MAX
    for rec in rs[:-1]:
        assert rec["k_accept"] == 0 and len(rec["drafts"]) >= 1
        assert rec["end"] == "correction"
        assert rec["feed"] == rec["window"][:1]
    assert r.speculation.accepted == 0
    assert r.speculation.rejected == r.speculation.drafted > 0


# ---------------------------------------------------------------- (d) too many


def test_more_than_n_drafts_is_refused(target: Any, prompt: list[int], ref: list[int]) -> None:
    src = FakeSource(lambda s, f, n, b: ref[b : b + n + 1])
    with pytest.raises(RuntimeError, match="more than n=3"):
        run(target, prompt, src)


def test_more_than_n_at_budget_edge_is_refused(target: Any, prompt: list[int], ref: list[int]) -> None:
    # n shrinks to the tokens left: 2 left with gamma 3 -> a 3-token draft is too many
    src = FakeSource(lambda s, f, n, b: [0, 0, 0])
    with pytest.raises(RuntimeError, match="more than n=2"):
        run(target, prompt, src, max_tokens=2)


# ---------------------------------------------------------------- (e) variable


def test_variable_lengths_accepted(target: Any, prompt: list[int], ref: list[int]) -> None:
    src = FakeSource(oracle(ref, lambda n, r: r % (GAMMA + 1)))
    r = run(target, prompt, src)
    assert r.output_ids == ref
    rs = rounds(r)
    for i, rec in enumerate(rs):
        n = src.drafts[i]["n"]
        assert len(rec["drafts"]) == min(i % (GAMMA + 1), n)
        assert rec["k_accept"] == len(rec["drafts"])
    assert {len(rec["drafts"]) for rec in rs} >= {0, 1, 2}
    assert r.speculation.accepted == r.speculation.drafted


# ---------------------------------------------------------------- (f) commit/feed


def test_commit_and_refeed_follow_records(target: Any, prompt: list[int]) -> None:
    vocab = target.model.args.vocab_size
    ref = plain_generate(target.model, prompt, GenerationParams(max_tokens=24)).output_ids

    def mixed(src: FakeSource, feed: list[int], n: int, base: int) -> list[int]:
        kind = src.round % 3
        if kind == 0:  # all-accept
            return ref[base : base + n]
        if kind == 1:  # first accepted, second wrong
            return ref[base : base + 1] + [(ref[base + 1] + 1) % vocab] if n >= 2 else ref[base : base + n]
        return []

    src = FakeSource(mixed)
    r = run(target, prompt, src, max_tokens=24)
    rs = rounds(r)
    assert len(src.commits) == len(rs) == len(src.drafts)
    saw_pair = saw_single = False
    for i, rec in enumerate(rs):
        c = src.commits[i]
        assert (c["d"], c["k"]) == (len(rec["drafts"]), rec["k_accept"])
        assert c["accepted"] == rec["drafts"][: rec["k_accept"]]
        assert src.drafts[i]["feed"] == rec["feed"]
        assert src.drafts[i]["out"] == rec["drafts"]
        if i + 1 < len(rs):
            k = rec["k_accept"]
            nxt = rec["samples"][k]
            assert rs[i + 1]["feed"] == refeed(rec["drafts"], k, nxt)
            assert rs[i + 1]["window"][0] == nxt
            if rec["drafts"] and k == len(rec["drafts"]):
                assert rs[i + 1]["feed"] == [rec["drafts"][-1], nxt]
                saw_pair = True
            else:
                assert rs[i + 1]["feed"] == [nxt]
                saw_single = True
    assert saw_pair and saw_single
    assert r.output_ids == ref


def test_refeed_rule() -> None:
    assert refeed([], 0, 7) == [7]
    assert refeed([1, 2], 1, 7) == [7]
    assert refeed([1, 2], 2, 7) == [2, 7]


# ---------------------------------------------------------------- (g) taps


def test_taps_shapes_and_parity(target: Any, prompt: list[int], ref: list[int]) -> None:
    hidden = target.model.args.hidden_size
    pol = oracle(ref, lambda n, r: (r % 3))
    tapped = FakeSource(pol, tap_layers=(0, 1), wants_anchor_hidden=True)
    rt = run(target, prompt, tapped)
    plain_src = FakeSource(pol)
    rp = run(target, prompt, plain_src)

    (pre_tokens, pre_ctx), = tapped.prefills
    assert pre_tokens == prompt[:-1]
    assert pre_ctx is not None and set(pre_ctx.hidden) >= {0, 1}
    assert tuple(pre_ctx.hidden[0].shape) == (len(prompt) - 1, hidden)
    assert tuple(pre_ctx.hidden[1].shape) == (len(prompt) - 1, hidden)
    assert plain_src.prefills[0][1] is None

    rs = rounds(rt)
    for rec, c in zip(rs, tapped.commits, strict=True):
        ctx = c["ctx"]
        assert ctx is not None and ctx.tokens == rec["window"]
        for layer in (0, 1):
            assert tuple(ctx.hidden[layer].shape) == (len(rec["window"]), hidden)
        assert tuple(c["verified"].shape) == (1, hidden)
    assert tapped.drafts[0]["anchor"] is None
    for d in tapped.drafts[1:]:
        assert d["anchor"] is not None and tuple(d["anchor"].shape) == (1, hidden)
    assert all(d["anchor"] is None for d in plain_src.drafts)
    assert all(c["ctx"] is None for c in plain_src.commits)

    assert rt.output_ids == rp.output_ids == ref
    assert [x["margins"] for x in rs] == [x["margins"] for x in rounds(rp)]
    assert [x["samples"] for x in rs] == [x["samples"] for x in rounds(rp)]


def test_anchor_only_taps_last_layer(target: Any, prompt: list[int], ref: list[int]) -> None:
    n_layers = len(target.model.layers)
    src = FakeSource(oracle(ref, lambda n, r: 1), wants_anchor_hidden=True)
    r = run(target, prompt, src, max_tokens=6)
    assert r.output_ids == ref[:6]
    assert set(src.prefills[0][1].hidden) == {n_layers - 1}
    # the anchor of round r+1 is the last-layer hidden at the accepted position k of round r
    for i in range(1, len(src.drafts)):
        c = src.commits[i - 1]
        want = c["ctx"].hidden[n_layers - 1][c["k"] : c["k"] + 1]
        assert mx.array_equal(src.drafts[i]["anchor"], want).item()


# ---------------------------------------------------------------- (h) EOS


@pytest.mark.parametrize("policy", ["zero", "oracle"])
def test_eos_stops_and_is_counted_once(target: Any, prompt: list[int], ref: list[int], policy: str) -> None:
    t = ref[5]
    assert t not in ref[:5], "pick a prompt whose 6th greedy token is new"
    pr = plain_generate(target.model, prompt, GenerationParams(max_tokens=MAX, eos_ids=(t,)))
    pol = zero_policy if policy == "zero" else oracle(ref, lambda n, r: n)
    sr = run(target, prompt, FakeSource(pol), eos_ids=(t,))
    for res in (pr, sr):
        assert res.output_ids == ref[:5]
        assert t not in res.output_ids
        assert res.usage.finish_reason == "stop"
        assert res.usage.generation_tokens == 6
    last = rounds(sr)[-1]
    assert last["end"] == "eos" and t not in last["emitted"]
    assert pr.records[-1]["end"] == "eos" and pr.records[-1]["emitted"] == []


# ---------------------------------------------------------------- (i) budget


@pytest.mark.parametrize("policy", ["zero", "oracle", "wrong"])
def test_budget(target: Any, prompt: list[int], ref: list[int], policy: str) -> None:
    vocab = target.model.args.vocab_size
    pol = {"zero": zero_policy, "oracle": oracle(ref, lambda n, r: n), "wrong": wrong(ref, vocab)}[policy]
    src = FakeSource(pol)
    r = run(target, prompt, src, max_tokens=7)
    assert r.output_ids == ref[:7]
    assert r.usage.finish_reason == "length" and r.usage.generation_tokens == 7
    rs = rounds(r)
    assert rs[-1]["end"] == "budget"
    assert all(rec["end"] != "budget" for rec in rs[:-1])
    assert all(d["n"] <= 7 - d["step_base"] for d in src.drafts)


# ---------------------------------------------------------------- (j) on_token


@pytest.mark.parametrize("policy", ["zero", "oracle"])
def test_on_token_false_stops(target: Any, prompt: list[int], ref: list[int], policy: str) -> None:
    seen: list[int] = []

    def on_token(tok: int) -> bool | None:
        seen.append(tok)
        return False if len(seen) == 3 else None

    pol = zero_policy if policy == "zero" else oracle(ref, lambda n, r: n)
    r = spec_generate(target.model, FakeProvider(FakeSource(pol)), prompt, params(), on_token=on_token)
    assert r.output_ids == seen == ref[:3]
    assert r.usage.finish_reason == "stop" and r.usage.generation_tokens == 3
    assert rounds(r)[-1]["end"] == "stop"

    seen.clear()
    p = plain_generate(target.model, prompt, params(), on_token=on_token)
    assert p.output_ids == ref[:3] and p.usage.finish_reason == "stop"


# ---------------------------------------------------------------- (k) full prefill


def test_full_prefill_self_drafter(target: Any, prompt: list[int]) -> None:
    pp = params(prefill="full")
    plain = plain_generate(target.model, prompt, pp)
    spec = spec_generate(target.model, TwoModelProvider(target.model), prompt, pp)
    assert spec.output_ids == plain.output_ids
    assert spec.records[0]["type"] == "prefill"
    assert spec.records[0]["target_tokens"] == prompt
    first = spec.records[1]
    assert first["type"] == "plain" and first["reason"] == "initial"
    assert first["sample"] == plain.output_ids[0]
    assert first["input"] == [prompt[-1]]
    assert all(rec["type"] == "round" for rec in spec.records[2:])
    s = spec.speculation
    assert s.accepted == s.drafted > 0  # the target drafting for itself at greedy
    assert s.target_calls == s.rounds + 1


def test_full_prefill_fake_source(target: Any, prompt: list[int], ref: list[int]) -> None:
    # full prefill with a fake: the first token comes from the prefill forward
    src = FakeSource(zero_policy)
    r = run(target, prompt, src, prefill="full", max_tokens=5)
    assert r.output_ids == ref[:5]
    assert src.prefills[0][0] == prompt
    assert rounds(r)[0]["feed"] == [ref[0]]
    assert len(rounds(r)) == 4


# ---------------------------------------------------------------- (l) validation


@pytest.mark.parametrize(
    "kw",
    [
        {"max_tokens": 0},
        {"max_tokens": -1},
        {"gamma": -1},
        {"prefill": "bogus"},
        {"prefill_step_size": 0},
    ],
)
def test_params_validation(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        GenerationParams(**kw)


def test_gamma_zero_is_allowed_and_plain(target: Any, prompt: list[int], ref: list[int]) -> None:
    src = FakeSource(lambda s, f, n, b: [0] * n)
    r = run(target, prompt, src, gamma=0, max_tokens=4)
    assert r.output_ids == ref[:4]
    assert all(d["n"] == 0 for d in src.drafts)


def test_empty_prompt_refused(target: Any) -> None:
    with pytest.raises(ValueError, match="empty"):
        spec_generate(target.model, FakeProvider(FakeSource(zero_policy)), [], params())
    with pytest.raises(ValueError, match="empty"):
        plain_generate(target.model, [], params())


def test_fake_source_satisfies_protocol() -> None:
    assert isinstance(FakeSource(zero_policy), DraftSource)


def test_chunked_tapped_prefill(target: Any, prompt: list[int], ref: list[int]) -> None:
    hidden = target.model.args.hidden_size
    src = FakeSource(oracle(ref, lambda n, r: n), tap_layers=(0,))
    r = run(target, prompt, src, prefill_step_size=5, max_tokens=8)
    assert r.output_ids == ref[:8]
    ctx = src.prefills[0][1]
    assert tuple(ctx.hidden[0].shape) == (len(prompt) - 1, hidden)
    assert ctx.tokens == prompt[:-1]
    whole = FakeSource(oracle(ref, lambda n, r: n), tap_layers=(0,))
    run(target, prompt, whole, max_tokens=2)
    assert mx.allclose(whole.prefills[0][1].hidden[0], ctx.hidden[0], atol=1e-5).item()


def test_one_token_prompt(target: Any) -> None:
    one = [5]
    p = plain_generate(target.model, one, GenerationParams(max_tokens=6))
    src = FakeSource(oracle(p.output_ids, lambda n, r: n))
    s = run(target, one, src, max_tokens=6)
    assert s.output_ids == p.output_ids
    assert src.prefills[0][0] == []
    assert s.records[0]["target_tokens"] == []
