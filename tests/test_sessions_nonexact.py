"""Warm ≡ cold where the backend is not bit-exact (engine/cache_compare.py, specparity/jobs/sessions.py),
proved on the CPU with the non-exact double (engine/nonexact.py, its cache-write noise on).

Under the double a warm request (its suffix prefilled on the reused caches) and its cold run
(the whole prompt in one chunk) leave different cache bytes and, on knife-edges, different
tokens -- as measured on the H200 (issue 31). Those read ``numerics`` (caches within the
bound calibrated in the same run, every flip witnessed); the planted session bugs still read
``logic``, on the CPU's exact path and under the double, named by request, point, model,
layer, array and position.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import mlx.core as mx
import pytest

import zoo
from engine.backend import arithmetic
from engine.cache_compare import Tolerance, calibrate, check_caches
from engine.executor import GenerationParams
from engine.nonexact import ENV, emulate_nonexact, emulated_kv_scale, exact, from_env, is_emulated
from engine.prompt_cache import PromptCacheSession, cold, copy_caches
from engine.sources.two_model import TwoModelProvider
from specparity.jobs.sessions import (
    NonExact,
    RequestVerdict,
    SessionVerdict,
    render,
    run_session,
    summary,
)
from specparity.runners import load_model
from tests.test_prompt_cache import RingWithoutIndex, ShortSave, StaleDrafter

GREEDY = GenerationParams(max_tokens=10, gamma=3, eos_ids=(zoo.eos_id(),))
# Logit noise as measured on the H200 (engine/nonexact.py); cache-write noise magnified (the H200's
# cache |Δ| is 1e-3..9e-3) so the tiny zoo's sessions flip tokens and the witness has work to do.
SCALE, KV = 1e-2, 5e-2


def _prompts() -> tuple[list[int], list[int]]:
    ps = [p for p in zoo.prompts() if p.kind == "natural"]
    return list(ps[0].token_ids), list(ps[1].token_ids)


def _pair(target: str) -> tuple[Any, Any]:
    tp, dp = zoo.pair(target, "twin")
    return load_model(str(tp)).model, load_model(str(dp)).model


@pytest.fixture
def double() -> Iterator[dict[str, tuple[Any, Any]]]:
    """llama, gemma3 (RotatingKVCache) and qwen35 (ArraysCache) pairs under the double, unwrapped after
    each test (the loaded models are shared with every other test of the process)."""
    pairs = {t: _pair(t) for t in ("llama", "gemma3", "qwen35")}
    for tm, dm in pairs.values():
        emulate_nonexact(tm, SCALE, 0, KV)
        emulate_nonexact(dm, SCALE, 1, KV)
    try:
        yield pairs
    finally:
        for tm, dm in pairs.values():
            exact(tm)
            exact(dm)


# --------------------------------------------------------------------------- the double's cache noise

def test_double_perturbs_cache_writes_of_multi_token_forwards() -> None:
    """Cache-write noise: a one-chunk prefill and the same prompt split in two leave different
    bytes; the same forward on the same inputs writes the same bytes; one-token forwards exact."""
    from mlx_lm.models.cache import make_prompt_cache

    tm, _ = _pair("llama")
    ids = _prompts()[0][:12]

    def fill(sizes: list[int]) -> list[Any]:
        c, pos = make_prompt_cache(tm), 0
        for n in sizes:
            tm(mx.array(ids[pos : pos + n], mx.uint32)[None], cache=c)
            pos += n
        mx.eval([x.state for x in c])
        return c

    def keys(c: list[Any], layer: int = 0) -> mx.array:
        return c[layer].keys[..., :12, :]

    exact_one, exact_split, exact_serial = fill([12]), fill([5, 7]), fill([1] * 12)
    assert mx.array_equal(keys(exact_one), keys(exact_split)) and mx.array_equal(keys(exact_one), keys(exact_serial))
    emulate_nonexact(tm, 0.0, 3, 1e-3)
    try:
        assert emulated_kv_scale(tm) == 1e-3 and arithmetic(tm).exact is False
        one, split, serial = fill([12]), fill([5, 7]), fill([1] * 12)
        d = float(mx.abs(keys(one) - keys(split)).max().item())
        assert 0 < d <= 2 * 1e-3 * 1.001, d  # layer 0: the two writes' noise alone
        assert not mx.array_equal(keys(one, 1), keys(split, 1))
        assert mx.array_equal(keys(one), keys(fill([12])))  # input-deterministic
        assert mx.array_equal(keys(serial), keys(exact_serial))  # one-token forwards untouched
    finally:
        exact(tm)
    assert arithmetic(tm).exact is True and "cpu" in arithmetic(tm).why


def test_env_switch_takes_the_cache_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    class M:
        def __call__(self, inputs: Any, cache: Any = None) -> Any:
            return inputs

    monkeypatch.setenv(ENV, "0.02:7:0.001")
    m = from_env(M())
    assert is_emulated(m) == (0.02, 7) and emulated_kv_scale(m) == 0.001
    monkeypatch.setenv(ENV, "0.02:7:lots")
    with pytest.raises(ValueError, match="SCALE\\[:SEED\\[:KV_SCALE\\]\\]"):
        from_env(M())


# --------------------------------------------------------------------------- tolerance and the check

def test_check_names_layer_array_position_values_and_bound() -> None:
    """A value planted beyond the calibrated bound is named; one within it passes as arithmetic."""
    tm, _ = _pair("llama")
    a, _ = _prompts()
    emulate_nonexact(tm, 0.0, 0, 1e-3)
    try:
        tol, start = calibrate(tm, a[:20], 12, 2048)
    finally:
        exact(tm)
    assert start is not None and int(start[0].offset) == 12
    assert set(tol.controls) >= {"split at 12", "one token at a time"}, tol.controls
    assert all(0 < v < 1e-2 for v in tol.per_layer().values()), tol.describe()
    warm = copy_caches(start)
    assert check_caches(warm, start, tol, "start").equal
    bound = tol.bound(1, "keys[0]")
    warm[1].keys[0, 0, 7, 3] = start[1].keys[0, 0, 7, 3] + 0.5 * bound
    ok = check_caches(warm, start, tol, "start")
    assert ok.ok and not ok.equal and "layer 1 keys[0]" in ok.worst, ok
    warm[1].keys[0, 0, 7, 3] = start[1].keys[0, 0, 7, 3] + 3 * bound
    bad = check_caches(warm, start, tol, "start")
    assert bad.error is not None and bad.error.startswith("start: target layer 1 keys[0] position 7: warm "), bad.error
    assert "beyond the bound" in bad.error and f"{bound:.3g}" in bad.error, bad.error
    short = copy_caches(start)
    for c in short:
        c.trim(1)
    msg = check_caches(short, start, tol, "start").error
    assert msg is not None and "metadata differs: offset 11 vs 12" in msg, msg


def test_a_layer_the_controls_leave_equal_must_stay_equal() -> None:
    tol = Tolerance("target")
    tol.add(0, "keys[0]", "float32", 0.0)
    assert tol.bound(0, "keys[0]") == 0.0 and tol.bound(5, "values[0]") == 0.0


# --------------------------------------------------------------------------- the zoo under the double

@pytest.mark.parametrize(("target", "name"), [("llama", "prefix"), ("gemma3", "continue"), ("qwen35", "continue")])
def test_zoo_sessions_identical_or_numerics(double: dict[str, tuple[Any, Any]], target: str, name: str) -> None:
    """KVCache, RotatingKVCache, ArraysCache: both arms warm ≡ cold or numerics, never logic; the
    cache bytes differ (the double's warm suffix prefill) and a token flip is witnessed."""
    tm, dm = double[target]
    a, b = _prompts()
    v = run_session(tm, lambda: TwoModelProvider(dm), name, a, [b], GREEDY, plain=True)
    assert v.arithmetic is not None and "non-exact double" in v.arithmetic
    assert v.ok, v.first_divergence
    reqs = [*v.requests, *(v.plain or ())]
    assert any(r.target_reused for r in reqs), [r.target_reused for r in reqs]
    assert any(r.verdict == "numerics" for r in reqs), [r.verdict for r in reqs]
    witnessed = [r for r in reqs if (r.judgement or {}).get("basis") == "witness"]
    assert witnessed, [r.numerics for r in reqs]
    assert "arithmetic alone" in (witnessed[0].numerics or ""), witnessed[0].numerics
    for r in reqs:
        for c in (r.judgement or {}).get("checks", []):
            assert c["ok"] and c["ratio"] < 0.5, c  # warm vs cold sit well inside 16 × the control


def test_seeded_flip_is_numerics_not_replayed(double: dict[str, tuple[Any, Any]]) -> None:
    """A seeded run's flip cannot be replayed (the witness replays greedy runs): numerics only
    because its start and prefill caches are within the bound, and labelled as not replayed."""
    from engine.sampler import SamplerParams

    tm, dm = double["gemma3"]
    a, b = _prompts()
    seeded = replace(GREEDY, sampler=SamplerParams(temperature=0.8), seed=7)
    v = run_session(tm, lambda: TwoModelProvider(dm), "continue", a, [b], seeded, plain=True)
    assert v.ok, v.first_divergence
    unreplayed = [r for r in [*v.requests, *(v.plain or ())] if (r.judgement or {}).get("basis") == "not replayed"]
    assert unreplayed, [r.numerics for r in [*v.requests, *(v.plain or ())]]
    assert "not replayed (a run sampled from one RNG stream" in (unreplayed[0].numerics or ""), \
        unreplayed[0].numerics


def test_position_keyed_seeded_flip_is_witnessed(double: dict[str, tuple[Any, Any]]) -> None:
    """With a key per (seed, output position) (``rng="position"``) a sampled flip IS replayed:
    each path draws with the same key from its own row."""
    from engine.sampler import SamplerParams

    tm, dm = double["gemma3"]
    a, b = _prompts()
    seeded = replace(GREEDY, sampler=SamplerParams(temperature=0.8, rng="position"), seed=7)
    v = run_session(tm, lambda: TwoModelProvider(dm), "continue", a, [b], seeded, plain=True)
    assert v.ok, v.first_divergence
    reqs = [*v.requests, *(v.plain or ())]
    assert not any((r.judgement or {}).get("basis") == "not replayed" for r in reqs), [r.numerics for r in reqs]
    assert any((r.judgement or {}).get("basis") == "witness" for r in reqs), [r.numerics for r in reqs]


def test_quantized_kv_compared_dequantized_within_a_step() -> None:
    """llama-kv, 4-bit KV from position 36: the prefill boundary (27 tokens, not yet quantized) is
    reused, so warm and cold quantize slightly different floats: values are compared dequantized,
    one quantization step allowed on top of the calibrated bound; never logic."""
    tp, dp = zoo.pair(zoo.KV_TARGET, "twin")
    tm, dm = load_model(str(tp)).model, load_model(str(dp)).model
    a, b = _prompts()
    params = replace(GREEDY, kv_bits=4, kv_group_size=32, quantized_kv_start=36)
    emulate_nonexact(tm, SCALE, 0, 1e-2)
    emulate_nonexact(dm, SCALE, 1, 1e-2)
    try:
        v = run_session(tm, lambda: TwoModelProvider(dm), "eos", a, [b], params, plain=True)
    finally:
        exact(tm)
        exact(dm)
    assert v.ok, v.first_divergence
    reqs = [*v.requests, *(v.plain or ())]
    assert any(r.target_reused for r in reqs) and any(r.verdict == "numerics" for r in reqs), \
        [(r.target_reused, r.verdict) for r in reqs]


_NIGHTLY = (pytest.mark.slow, pytest.mark.heavy)
_SCALES = (1e-3, 1e-2, 5e-2)
_TARGETS = ("llama", "gemma3", "qwen35")


@pytest.mark.parametrize("target, kv", [
    pytest.param(t, kv, marks=() if i == j else _NIGHTLY)  # by default a diagonal: each target, each scale once
    for i, t in enumerate(_TARGETS) for j, kv in enumerate(_SCALES)])
def test_zoo_matrix_no_false_logic(target: str, kv: float) -> None:
    """Every session, both arms, greedy, at three cache-noise scales: 0 logic (the full 3 x 3 nightly)."""
    from specparity.jobs.sessions import SESSIONS

    tm, dm = _pair(target)
    a, b = _prompts()
    emulate_nonexact(tm, SCALE, 0, kv)
    emulate_nonexact(dm, SCALE, 1, kv)
    try:
        for name in SESSIONS:
            v = run_session(tm, lambda: TwoModelProvider(dm), name, a, [b], GREEDY, plain=True)
            assert v.ok, (name, v.first_divergence)
    finally:
        exact(tm)
        exact(dm)


# --------------------------------------------------------------------------- planted bugs

class OneShortReuse(PromptCacheSession):
    """Plant: the reused target prefix lost its last position and the hole was papered over with
    the position before it re-fed (offsets and keys agree: only the cache contents can tell)."""

    def fetch(self, prompt_ids: Any, params: Any) -> Any:
        f, caches = super().fetch(prompt_ids, params)
        n = f.target_prefix
        if n >= 2:
            for c in caches:
                c.trim(1)
            self.model(mx.array([[f.drained[n - 2]]], mx.uint32), cache=caches)
            mx.eval([c.state for c in caches])
        return f, caches


def _judged(target: str, prompts: list[list[int]], factory: type, *, nonexact: bool,
            params: GenerationParams = GREEDY) -> list[str | None]:
    """Run ``prompts`` through one session warm and cold, judged as ``run_session`` judges them
    (``NonExact.judge`` under the double, byte equality otherwise); the logic divergences."""
    from specparity.jobs.sessions import compare_records

    tm, dm = _pair(target)
    s = factory(tm, TwoModelProvider(dm))
    nx = NonExact("test", tm, dm, "two-model") if nonexact else None
    if nx is not None:
        s.keep_caches, s.exact_arithmetic = True, False
    out = []
    for i, p in enumerate(prompts):
        turn = s.generate(p, params)
        cap = nx.capture() if nx is not None else None
        c, _ = cold(tm, TwoModelProvider(dm), p, params, reuse=cap)
        if nx is None:
            out.append(compare_records(i, "test", [*turn.result.records, turn.result.footer()],
                                       [*c.records, c.footer()]))
        else:
            out.append(nx.judge(i, "test", p, params, turn, c, cap)[0])
    return out


def _emulated(target: str) -> tuple[Any, Any]:
    tm, dm = _pair(target)
    emulate_nonexact(tm, SCALE, 0, KV)
    emulate_nonexact(dm, SCALE, 1, KV)
    return tm, dm


@pytest.mark.parametrize("nonexact", [False, True], ids=["cpu-exact", "double"])
def test_plant_one_token_short_reuse(nonexact: bool) -> None:
    """Offsets and keys agree; the cpu digest or the double's tolerance check names the prefix."""
    a, b = _prompts()
    follow = [*a, *b[:6]]
    if nonexact:
        tm, dm = _emulated("llama")
    try:
        msgs = _judged("llama", [a, follow], OneShortReuse, nonexact=nonexact)
    finally:
        if nonexact:
            exact(tm)
            exact(dm)
    assert msgs[0] is None, msgs
    msg = msgs[1]
    assert msg is not None, "the one-token-short reuse passed"
    if nonexact:
        n = len(a)  # request 0's end boundary holds all of a (and its stream): a is reused
        assert msg.startswith(f"request 1 (test): start: target layer 0 keys[0] position {n - 1}: warm "), msg
        assert "beyond the bound" in msg and "(the caches it started from;" in msg, msg
    else:
        assert msg.startswith("request 1 (test): prefill (before round 0): target_cache_digest layer 0"), msg


@pytest.mark.parametrize("nonexact", [False, True], ids=["cpu-exact", "double"])
def test_plant_stale_drafter_cache(nonexact: bool) -> None:
    a, b = _prompts()
    if nonexact:
        tm, dm = _emulated("llama")
    try:
        # b's end boundary (b + 12 tokens) is at least as long as a's reused prefix: the stale candidate
        msgs = _judged("llama", [a, b, a], StaleDrafter, nonexact=nonexact, params=replace(GREEDY, max_tokens=12))
    finally:
        if nonexact:
            exact(tm)
            exact(dm)
    assert msgs[0] is None and msgs[1] is None, msgs
    msg = msgs[2]
    assert msg is not None, "the stale drafter passed"
    if nonexact:
        assert msg.startswith("request 2 (test): start: drafter layer 0 keys[0] position "), msg
        assert "beyond the bound" in msg, msg
    else:
        assert msg.startswith("request 2 (test): prefill (before round 0): drafter_cache_digest layer 0"), msg


def test_plant_ring_without_index_under_the_double() -> None:
    """gemma3: a wrapped ring saved without its write index (offsets agree) still fails."""
    a, b = _prompts()
    first = a + b[:12]  # the 32-slot ring wraps in the prefill
    tm, dm = _emulated("gemma3")
    try:
        msgs = _judged("gemma3", [first, first], RingWithoutIndex, nonexact=True)
    finally:
        exact(tm)
        exact(dm)
    assert msgs[0] is None, msgs
    assert msgs[1] is not None and msgs[1].startswith("request 1 (test): start: "), msgs[1]
    assert "layer 0 keys[0] position" in msgs[1] and "beyond the bound" in msgs[1], msgs[1]


def test_plant_saved_cache_one_token_short_under_the_double(double: dict[str, tuple[Any, Any]]) -> None:
    """The save invariant names it before any tolerance is involved: logic, and the run fails."""
    tm, dm = double["llama"]
    a, b = _prompts()
    v = run_session(tm, lambda: TwoModelProvider(dm), "multi-turn", a, [b], GREEDY, session_factory=ShortSave)
    assert v.spec_verdict == "logic" and not v.ok
    assert v.first_divergence is not None and v.first_divergence.startswith("request 0 (fresh)"), v.first_divergence
    assert "a hole" in v.first_divergence


def test_planted_token_no_path_gives_is_logic(double: dict[str, tuple[Any, Any]]) -> None:
    """A warm sample its own path (replayed from the reused caches) does not give: logic, with
    the witness's evidence; the caches themselves are within the bound."""
    tm, dm = double["llama"]
    a, b = _prompts()
    follow = [*a, *b[:6]]
    s = PromptCacheSession(tm, TwoModelProvider(dm))
    nx = NonExact("test", tm, dm, "two-model")
    s.keep_caches, s.exact_arithmetic = True, False
    s.generate(a, GREEDY)
    turn = s.generate(follow, GREEDY)
    cap = nx.capture()
    c, _ = cold(tm, TwoModelProvider(dm), follow, GREEDY, reuse=cap)
    assert turn.reuse["target_reused"] == len(a)  # request 0's end boundary holds all of a
    r1 = next(r for r in turn.result.records if r["type"] == "round" and r["index"] == 1)
    r1["samples"] = [*r1["samples"][:-1], r1["samples"][-1] + 1]  # a token its path does not give
    msg, j = nx.judge(1, "follow-up", follow, GREEDY, turn, c, cap)
    assert j.verdict == "logic" and msg is not None, j
    assert msg.startswith("request 1 (follow-up): round 1: samples position"), msg
    assert "its path gives" in msg and "the arithmetic does not explain it" in msg, msg
    assert all(ch.ok for ch in j.checks), [ch.error for ch in j.checks]


# --------------------------------------------------------------------------- report

def _req(i: int, verdict: str, div: str | None = None, basis: str | None = None) -> RequestVerdict:
    return RequestVerdict(i, "follow-up", 30, 20, 20, None, None, "budget@bonus", div, 0.01, 0.02, verdict,
                          None if verdict != "numerics" else f"request {i} (follow-up): flip [{basis}]",
                          None if basis is None else {"basis": basis, "evidence": ["e1", "e2"]})


def test_summary_counts_each_verdict_and_only_logic_fails() -> None:
    vs = [SessionVerdict("p/a", "a", [_req(0, "identical"), _req(1, "numerics", basis="witness")],
                         arithmetic="gpu"),
          SessionVerdict("p/b", "b", [_req(0, "identical"), _req(1, "numerics", basis="tolerance")],
                         arithmetic="gpu"),
          SessionVerdict("p/c", "c", [_req(0, "identical"), _req(1, "logic", "request 1 (follow-up): x")],
                         arithmetic="gpu"),
          SessionVerdict("p/d", "d", [_req(0, "identical")], arithmetic="gpu")]
    s = summary(vs)
    assert (s["identical"], s["numerics"], s["logic"]) == (1, 2, 1), s
    assert (s["requests_identical"], s["requests_numerics"], s["requests_numerics_bytes"],
            s["requests_numerics_witnessed"], s["requests_logic"]) == (4, 2, 1, 1, 1), s
    assert [v.ok for v in vs] == [True, True, False, True]
    text = render(vs)
    assert "Sessions: 1 identical, 2 numerics, 1 logic" in text, text
    assert "| p/a | numerics |" in text and "| p/c | DIVERGENT |" in text and "| p/d | warm ≡ cold |" in text
    assert "Numerics (warm ≠ cold by arithmetic alone), 2 requests" in text


def test_cpu_path_unchanged() -> None:
    """On the CPU (no double) a session is judged byte for byte, as before: no arithmetic line."""
    tm, dm = _pair("llama")
    a, b = _prompts()
    v = run_session(tm, lambda: TwoModelProvider(dm), "regenerate", a, [b], replace(GREEDY, max_tokens=6))
    assert v.arithmetic is None and v.identical and all(r.judgement is None for r in v.requests)
    assert "Not bit-exact" not in render([v])
