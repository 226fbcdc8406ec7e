"""Prompt-cache reuse under speculation (engine/prompt_cache.py): warm ≡ cold, the invariants,
and four planted bugs each caught naming the request (and round, where the check is a digest).

Runs on the tiny zoo (two-model, γ 3); each test a few seconds on CPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import zoo
from engine.executor import GenerationParams
from engine.prompt_cache import (
    PromptCacheError,
    PromptCacheSession,
    Segment,
    check_segment,
    cold,
    copy_caches,
    stream_tokens,
)
from engine.sampler import SamplerParams
from engine.sources.two_model import TwoModelProvider
from specparity.jobs.sessions import compare_records, run_session
from specparity.runners import load_model

GREEDY = GenerationParams(max_tokens=12, gamma=3, eos_ids=(zoo.eos_id(),))
SAMPLED = replace(GREEDY, sampler=SamplerParams(temperature=0.8), seed=7)


def _pair(target: str) -> tuple[Any, Any]:
    tp, dp = zoo.pair(target, "twin")
    return load_model(str(tp)).model, load_model(str(dp)).model


def _prompts() -> tuple[list[int], list[int]]:
    ps = [p for p in zoo.prompts() if p.kind == "natural"]
    return list(ps[0].token_ids), list(ps[1].token_ids)


def _warm_vs_cold(target: str, prompts: list[list[int]], params: GenerationParams,
                  factory: type[PromptCacheSession] = PromptCacheSession) -> list[tuple[dict, str | None]]:
    tm, dm = _pair(target)
    s = factory(tm, TwoModelProvider(dm))
    out = []
    for i, p in enumerate(prompts):
        turn = s.generate(p, params)
        c, _ = cold(tm, TwoModelProvider(dm), p, params)
        out.append((turn.reuse, compare_records(i, "test", [*turn.result.records, turn.result.footer()],
                                                [*c.records, c.footer()])))
    return out


@pytest.mark.parametrize("target", ["llama", "qwen35", "gemma3"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_multi_turn_warm_equals_cold(target: str, params: GenerationParams) -> None:
    """Follow-up, regeneration, exact continuation, prefix: token- and cache-identical to cold."""
    tm, dm = _pair(target)
    a, b = _prompts()
    v = run_session(tm, lambda: TwoModelProvider(dm), "multi-turn", a, [b], params)
    assert v.identical, v.first_divergence
    v2 = run_session(tm, lambda: TwoModelProvider(dm), "prefix", a, [b], params)
    assert v2.identical, v2.first_divergence
    reused = [r.target_reused for r in v.requests + v2.requests if r.index > 0]
    assert any(reused), f"{target}: no request reused a prefix: {reused}"


def test_end_boundary_keys_follow_each_segment_offset() -> None:
    """After a turn the target and the drafter are saved under their OWN keys (stream cut to offset)."""
    tm, dm = _pair("llama")
    a, _ = _prompts()
    s = PromptCacheSession(tm, TwoModelProvider(dm))
    turn = s.generate(a, GREEDY)
    stream = stream_tokens(a, turn.result.records)
    end = s.entries[-1]
    assert end.target.boundary == "end" and end.drafter is not None
    assert end.target.key == tuple(stream[: len(end.target.key)])
    assert end.drafter.key == tuple(stream[: len(end.drafter.key)])
    assert len(end.target.key) == int(end.target.caches[0].offset)
    assert len(end.drafter.key) == int(end.drafter.caches[0].offset)


def test_recurrent_state_reused_only_at_its_boundary() -> None:
    """qwen35 (ArraysCache): a prefix of the previous prompt is NOT reused from a longer entry."""
    a, b = _prompts()
    res = _warm_vs_cold("qwen35", [a, a[:20], a], GREEDY)
    assert all(d is None for _, d in res), [d for _, d in res if d]
    assert res[1][0]["target_reused"] == 0, res[1][0]
    assert "recurrent" in (res[1][0]["refused"] or ""), res[1][0]
    assert res[2][0]["target_reused"] == len(a) - 1, res[2][0]  # regeneration: the prefill boundary


def test_ring_wrapped_in_decode_is_refused() -> None:
    """gemma3: a ring that wrapped during decode is not reused; its prefill boundary is."""
    a, b = _prompts()
    first = a + b[:12]  # 39 drained tokens: the 32-slot ring wraps in the prefill
    res = _warm_vs_cold("gemma3", [first, first + [5, 6, 7]], GREEDY)
    assert all(d is None for _, d in res), [d for _, d in res if d]
    assert res[1][0]["target_reused"] == len(first) - 1, res[1][0]
    assert "wrapped during decode" in (res[1][0]["refused"] or ""), res[1][0]


def test_quantized_kv_segment_is_refused() -> None:
    tp, dp = zoo.pair(zoo.KV_TARGET, "twin")
    tm, dm = load_model(str(tp)).model, load_model(str(dp)).model
    a, b = _prompts()
    params = replace(GREEDY, kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    s = PromptCacheSession(tm, TwoModelProvider(dm))
    s.generate(a, params)
    turn = s.generate(a, params)
    assert turn.reuse["target_reused"] == 0 and "Quantized" in (turn.reuse["refused"] or ""), turn.reuse
    c, _ = cold(tm, TwoModelProvider(dm), a, params)
    assert compare_records(1, "regenerate", [*turn.result.records, turn.result.footer()],
                           [*c.records, c.footer()]) is None


def test_check_segment_names_request_segment_and_layer() -> None:
    tm, _ = _pair("llama")
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(tm)
    tm(mx.array([[1, 2, 3, 4]]), cache=caches)
    check_segment(Segment("target", (1, 2, 3, 4), caches, "end", 3), 4, "save")
    with pytest.raises(PromptCacheError, match=r"request 3: save: target segment \(end boundary\) layer 0 "
                       r"\(KVCache\) holds 4 positions, its key has 5: a hole"):
        check_segment(Segment("target", (1, 2, 3, 4, 5), caches, "end", 3), 5, "save")
    with pytest.raises(PromptCacheError, match=r"holds 4 positions, its key has 3: duplicate positions"):
        check_segment(Segment("target", (1, 2, 3), caches, "fetch", 3), 3, "fetch")


def test_compare_names_request_round_and_position() -> None:
    tm, dm = _pair("llama")
    a, _ = _prompts()
    c, _ = cold(tm, TwoModelProvider(dm), a, GREEDY)
    warm = [dict(r) for r in c.records]
    rnd = next(r for r in warm if r["type"] == "round" and r["index"] == 1)
    rnd["samples"] = [*rnd["samples"][:-1], rnd["samples"][-1] + 1]
    msg = compare_records(2, "follow-up", warm, list(c.records))
    assert msg is not None and msg.startswith("request 2 (follow-up): round 1: samples position"), msg


# --------------------------------------------------------------------------- planted bugs

class ShortSave(PromptCacheSession):
    """Plant: the saved target cache is one token short of its key."""

    def save(self, entry: Any) -> None:
        if entry.target.boundary == "end":
            for c in entry.target.caches:
                c.trim(1)
        super().save(entry)


class DrafterNotRestored(PromptCacheSession):
    """Plant: the drafter's saved cache never reaches the source (only the target is reused)."""

    def install_drafter(self, source: Any, seg: Any, n: int, fetch: Any) -> None:
        return None


class StaleDrafter(PromptCacheSession):
    """Plant: the drafter state installed is another conversation's (same length, other tokens)."""

    def install_drafter(self, source: Any, seg: Any, n: int, fetch: Any) -> None:
        stale = next(e.drafter for e in self.entries
                     if e.drafter is not None and len(e.drafter.key) >= n and e.drafter.key[:n] != seg.key[:n])
        cut = copy_caches(stale.caches)
        for c in cut:
            c.trim(len(stale.key) - n)
        source.caches[:] = cut


class RingWithoutIndex(PromptCacheSession):
    """Plant: a wrapped ring is saved without its write index, rebuilt as ``offset % max_size``
    (right for a one-token ring, wrong for the buffer a multi-token prefill leaves)."""

    def save(self, entry: Any) -> None:
        for seg in (entry.target, entry.drafter):
            for c in seg.caches if seg is not None else ():
                if hasattr(c, "_idx") and int(c.offset) >= int(c.max_size):
                    c._idx = int(c.offset) % int(c.max_size)
        super().save(entry)


def test_plant_saved_cache_one_token_short() -> None:
    tm, dm = _pair("llama")
    a, b = _prompts()
    v = run_session(tm, lambda: TwoModelProvider(dm), "multi-turn", a, [b], GREEDY, session_factory=ShortSave)
    assert not v.identical
    assert v.first_divergence is not None and v.first_divergence.startswith("request 0 (fresh)"), v.first_divergence
    assert "target segment (end boundary) layer 0" in v.first_divergence and "a hole" in v.first_divergence


def test_plant_drafter_cache_not_saved() -> None:
    tm, dm = _pair("llama")
    a, b = _prompts()
    v = run_session(tm, lambda: TwoModelProvider(dm), "multi-turn", a, [b], GREEDY,
                    session_factory=DrafterNotRestored)
    assert v.first_divergence is not None and v.first_divergence.startswith("request 1 (follow-up)"), v.first_divergence
    assert "drafter segment" in v.first_divergence and "a hole" in v.first_divergence


def test_plant_stale_drafter_state() -> None:
    """Offsets agree, so only the digest check can see it: named at request 2's prefill."""
    a, b = _prompts()
    res = _warm_vs_cold("llama", [a, b, a], GREEDY, factory=StaleDrafter)
    assert res[0][1] is None and res[1][1] is None  # nothing reused yet / no stale candidate
    msg = res[2][1]
    assert msg is not None and msg.startswith("request 2 (test): prefill (before round 0): drafter_cache_digest"), msg


def test_plant_ring_reused_past_wrap_without_index() -> None:
    a, b = _prompts()
    first = a + b[:12]  # the gemma3 ring (32 slots) wraps in the prefill
    res = _warm_vs_cold("gemma3", [first, first], GREEDY, factory=RingWithoutIndex)
    assert res[1][0]["target_reused"] == len(first) - 1
    msg = res[1][1]
    assert msg is not None and msg.startswith("request 1 (test): prefill (before round 0): "), msg
    assert "_cache_digest layer 0: warm" in msg, msg  # the drafter (gemma3 twin) is checked first


# --------------------------------------------------------------------------- sources reading the target's hidden

def test_mtp_head_warm_equals_cold() -> None:
    """mtp (qwen35 head): the target segment keeps its tapped rows; the head re-reads them."""
    from engine.sources import make_provider
    from zoo.heads import head_dir

    tm = load_model(str(zoo.model_dir("qwen35"))).model
    a, b = _prompts()
    v = run_session(tm, lambda: make_provider("mtp", path=head_dir("qwen35-mtp-self")), "multi-turn", a, [b],
                    GREEDY)
    assert v.identical, v.first_divergence
    assert any(r.target_reused for r in v.requests[1:]), [r.target_reused for r in v.requests]
    assert all(r.drafter_reused is None for r in v.requests)  # re-derived from the rows, not saved


def _deepseek() -> tuple[Any, Any]:
    from engine.sources import make_provider
    from zoo.native_mtp import target_paths

    tdir, ckpt = target_paths("deepseek-mtp")
    return load_model(str(tdir)).model, lambda: make_provider("native-mtp", path=ckpt)


def test_split_profile_of_mla_is_multi() -> None:
    """mlx-lm deepseek_v3 (MLA) takes its absorbed-weights path for a one-token forward."""
    from engine.prompt_cache import split_profile

    tm, _ = _deepseek()
    a, _ = _prompts()
    assert split_profile(tm, a) == "multi"
    assert split_profile(_pair("llama")[0], a) == "exact"


def test_plant_split_sensitive_target_treated_as_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: the probe's verdict ignored (a one-token suffix after a reused MLA prefix): the
    digest check names the request and the layer; with the probe, warm ≡ cold."""
    import engine.prompt_cache as pc

    tm, mk = _deepseek()
    a, b = _prompts()
    good = run_session(tm, mk, "regenerate", a, [b], GREEDY)
    assert good.identical, good.first_divergence
    monkeypatch.setitem(pc._SPLIT, id(tm), (tm, "exact"))
    bad = run_session(tm, mk, "regenerate", a, [b], GREEDY)
    msg = bad.first_divergence
    assert msg is not None and msg.startswith("request 1 (regenerate): prefill (before round 0): "
                                              "target_cache_digest layer 1"), msg


# --------------------------------------------------------------------------- random sessions

def test_random_sessions_warm_equal_cold() -> None:
    """Hypothesis draws request sequences (every kind, cut points, budgets) on llama and qwen35:
    each warm request equals its cold run."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from specparity.jobs.sessions import next_prompt

    pairs = {t: _pair(t) for t in ("llama", "qwen35")}
    a, b = _prompts()
    kinds = ("follow-up", "continue", "regenerate", "prefix", "shared-prefix")

    @settings(max_examples=4, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(target=st.sampled_from(sorted(pairs)), ops=st.lists(st.sampled_from(kinds), min_size=1, max_size=4),
           budgets=st.lists(st.integers(1, 10), min_size=5, max_size=5), temp=st.sampled_from([0.0, 0.8]))
    def check(target: str, ops: list[str], budgets: list[int], temp: float) -> None:
        tm, dm = pairs[target]
        s = PromptCacheSession(tm, TwoModelProvider(dm))
        prompt, stream = list(a), list(a)
        for i, kind in enumerate(["fresh", *ops]):
            if i:
                prompt = next_prompt(kind, prompt, stream, b)
            p = replace(GREEDY, max_tokens=budgets[i], sampler=SamplerParams(temperature=temp), seed=i)
            turn = s.generate(prompt, p)
            c, _ = cold(tm, TwoModelProvider(dm), prompt, p)
            msg = compare_records(i, kind, [*turn.result.records, turn.result.footer()], [*c.records, c.footer()])
            assert msg is None, f"{target} {['fresh', *ops]} budgets {budgets} t{temp}: {msg}"
            stream = stream_tokens(prompt, turn.result.records)

    check()


def test_plant_entry_chosen_without_comparing_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: an entry offered for its length, not its tokens: the fetch's key check names it."""
    monkeypatch.setattr(Segment, "usable", lambda self, drained: (min(len(self.key), len(drained)), None))
    tm, dm = _pair("llama")
    a, b = _prompts()
    s = PromptCacheSession(tm, TwoModelProvider(dm))
    s.generate(a, GREEDY)
    with pytest.raises(PromptCacheError, match=r"request 1: fetch: target segment \(request 0 \w+\) key differs "
                                               r"from the prompt within the \d+ reused positions"):
        s.generate(b, GREEDY)


def test_eos_endings_leave_different_keys() -> None:
    """An accepted EOS draft leaves the EOS in the target's cache (its key ends with it); an EOS
    correction does not; each end key matches its caches' offset, and the next turn is warm ≡ cold."""
    from specparity.jobs.sessions import _end

    tm, dm = _pair("llama")
    a, b = _prompts()
    base, _ = cold(tm, TwoModelProvider(dm), a, replace(GREEDY, max_tokens=24))
    seen: dict[str, bool] = {}
    for j in range(1, 20):
        eos = base.output_ids[j]
        if eos in base.output_ids[:j]:
            continue  # it would stop earlier
        p = replace(GREEDY, max_tokens=24, eos_ids=(eos,))
        s = PromptCacheSession(tm, TwoModelProvider(dm))
        turn = s.generate(a, p)
        end = _end(turn.result.records)
        assert end is not None and end.startswith("eos@"), end
        key = s.entries[-1].target.key
        assert len(key) == int(s.entries[-1].target.caches[0].offset)
        stream = stream_tokens(a, turn.result.records)
        assert stream[-1] == eos and key == tuple(stream[: len(key)])
        seen[end] = key[-1] == eos
        nxt = [*stream, *b[:4]]
        warm = s.generate(nxt, p)
        c, _ = cold(tm, TwoModelProvider(dm), nxt, p)
        assert compare_records(1, "follow-up", [*warm.result.records, warm.result.footer()],
                               [*c.records, c.footer()]) is None
        assert warm.reuse["target_reused"] == len(key), (end, warm.reuse)
        if {"eos@accepted", "eos@correction"} <= set(seen):
            break
    assert seen.get("eos@accepted") is True, seen  # the accepted EOS draft is in the cache
    assert seen.get("eos@correction") is False, seen  # the EOS correction is not


# --------------------------------------------------------------------------- the plain arm (no speculation)

@pytest.mark.parametrize("target", ["llama", "gemma3", "qwen35"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_plain_arm_warm_equals_cold(target: str, params: GenerationParams) -> None:
    """The same prompt cache under plain decode (KVCache, RotatingKVCache, ArraysCache): every warm
    plain request equals its cold run record for record, and later requests reuse a prefix."""
    tm, dm = _pair(target)
    a, b = _prompts()
    for name in ("multi-turn", "prefix"):
        v = run_session(tm, lambda: TwoModelProvider(dm), name, a, [b], params, plain=True)
        assert v.plain is not None and len(v.plain) == len(v.requests), (v.plain, v.plain_error)
        assert v.identical, v.first_divergence
        reused = [r.target_reused for r in v.plain if r.index > 0]
        assert any(reused), f"{target} {name}: the plain arm reused nothing: {reused}"
        assert all(r.drafter_reused is None for r in v.plain)
        if params is GREEDY:  # greedy speculation is lossless: both arms see the same prompts
            assert [r.prompt_tokens for r in v.plain] == [r.prompt_tokens for r in v.requests]


def test_plain_session_keys_and_refusals() -> None:
    """Plain end boundary keyed by the stream cut to the offset; a gemma3 ring wrapped in decode
    is refused for the plain arm too, its prefill boundary reused."""
    from engine.prompt_cache import PlainPromptCacheSession, cold_plain

    tm, _ = _pair("llama")
    a, b = _prompts()
    s = PlainPromptCacheSession(tm)
    turn = s.generate(a, GREEDY)
    end = s.entries[-1].target
    stream = stream_tokens(a, turn.result.records)
    assert end.boundary == "end" and s.entries[-1].drafter is None
    assert end.key == tuple(stream[: len(end.key)]) and len(end.key) == int(end.caches[0].offset)
    g, _ = _pair("gemma3")
    first = a + b[:12]
    s = PlainPromptCacheSession(g)
    s.generate(first, GREEDY)
    nxt = first + [5, 6, 7]
    turn = s.generate(nxt, GREEDY)
    assert turn.reuse["target_reused"] == len(first) - 1, turn.reuse
    assert "wrapped during decode" in (turn.reuse["refused"] or ""), turn.reuse
    c, _ = cold_plain(g, nxt, GREEDY)
    assert compare_records(1, "plain", [*turn.result.records, turn.result.footer()], [*c.records, c.footer()]) is None


def test_plain_generate_unchanged_without_reuse() -> None:
    """``plain_generate`` without ``target_caches``/``reuse`` is the baseline it was: same records
    (no ``prompt_cache`` field) as a run on fresh caches passed in."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.executor import plain_generate

    tm, _ = _pair("llama")
    a, _ = _prompts()
    base = plain_generate(tm, a, GREEDY)
    fresh = plain_generate(tm, a, GREEDY, target_caches=make_prompt_cache(tm))
    assert "prompt_cache" not in base.records[0]
    assert compare_records(0, "plain", [*base.records, base.footer()], [*fresh.records, fresh.footer()]) is None


def _plain_short_save() -> type:
    from engine.prompt_cache import PlainPromptCacheSession

    class PlainShortSave(PlainPromptCacheSession):
        """Plant: the plain arm's saved target cache is one token short of its key."""

        def save(self, entry: Any) -> None:
            if entry.target.boundary == "end":
                for c in entry.target.caches:
                    c.trim(1)
            super().save(entry)

    return PlainShortSave


def _plain_stale_prefix() -> type:
    from engine.prompt_cache import PlainPromptCacheSession

    class PlainStalePrefix(PlainPromptCacheSession):
        """Plant: a fetch installs another conversation's caches cut to the reused length (offsets
        agree, so only the record digests can see it)."""

        def fetch(self, prompt_ids: Any, params: Any) -> Any:
            f, caches = super().fetch(prompt_ids, params)
            n, want = f.target_prefix, tuple(f.drained[: f.target_prefix])
            stale = [e.target for e in self.entries if len(e.target.key) >= n and e.target.key[:n] != want]
            if n and stale:
                cut = copy_caches(stale[0].caches)
                for c in cut:
                    c.trim(len(stale[0].key) - n)
                caches[:] = cut
            return f, caches

    return PlainStalePrefix


def test_plant_plain_saved_cache_one_token_short() -> None:
    """The plain arm's invariant check names the request, segment and layer; the spec arm passes."""
    tm, dm = _pair("llama")
    a, b = _prompts()
    v = run_session(tm, lambda: TwoModelProvider(dm), "multi-turn", a, [b], GREEDY,
                    plain_session_factory=_plain_short_save())
    assert v.spec_identical and not v.identical
    msg = v.first_divergence
    assert msg is not None and msg.startswith("plain arm: request 0 (fresh): PromptCacheError: request 0: save: "
                                              "target segment (end boundary) layer 0"), msg
    assert "a hole" in msg, msg


def test_plant_plain_stale_prefix() -> None:
    """Offsets agree, so the record digests catch it: request 2's prefill, the target's layer 0."""
    from engine.prompt_cache import cold_plain

    tm, _ = _pair("llama")
    a, b = _prompts()
    s = _plain_stale_prefix()(tm)
    msgs = []
    for i, p in enumerate([a, b, a]):
        turn = s.generate(p, GREEDY)
        c, _ = cold_plain(tm, p, GREEDY)
        msgs.append(compare_records(i, "plain", [*turn.result.records, turn.result.footer()], [*c.records, c.footer()]))
    assert msgs[0] is None and msgs[1] is None, msgs  # nothing reused yet (b shares no prefix with a)
    assert msgs[2] is not None and msgs[2].startswith(
        "request 2 (plain): prefill (before round 0): target_cache_digest layer 0"), msgs[2]
