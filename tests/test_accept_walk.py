"""Model-free accept-walk cases: constructed logits, scripted drafts (vLLM rejection-sampler style).

Reference: ``speculative-decoding.md`` §2 steps 2-5 (one target forward over
``[pending, *drafts]``; accept while the target's sample equals the draft; the
first mismatch emits the correction, an all-accept round the bonus; EOS never
emitted; trim the target by ``d - k``) and mlx-lm 0.32.2
``speculative_generate_step`` / ``stream_generate``.

The fake target knows one greedy continuation ``CONT`` of ``PROMPT``: at every
position whose context is ``PROMPT + CONT[:i]`` its logits put 10.0 on
``CONT[i]`` (zeros elsewhere: an unambiguous argmax, margin 10); any other
context (a position past a rejected draft) predicts ``OFF``. Its caches hold
token lists and record every trim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from fakes import FakeProvider, FakeSource, scripted

from engine.executor import GenerationParams, spec_generate

V = 64
PROMPT = [40, 41, 42, 43]
CONT = list(range(1, 21))  # the target's greedy continuation: 1, 2, 3, ...
OFF = V - 1  # the target's sample after a context that left CONT
WRONG = 50  # a draft token the target never predicts


class FakeCache:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.trims: list[int] = []

    @property
    def offset(self) -> int:
        return len(self.tokens)

    @property
    def state(self) -> mx.array:
        return mx.array(self.tokens or [0], mx.uint32)

    @property
    def keys(self) -> mx.array:  # what the engine's rollback plan takes for a KV cache
        return self.state

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, len(self.tokens))
        del self.tokens[len(self.tokens) - n :]
        self.trims.append(n)
        return n


class FakeTarget:
    """``layers`` + ``make_cache`` + ``__call__(inputs[1, T], cache)`` -> logits ``[1, T, V]``."""

    def __init__(self, n_layers: int = 2) -> None:
        self.layers = [object() for _ in range(n_layers)]
        self.calls: list[list[int]] = []
        self.caches: list[FakeCache] = []

    def make_cache(self) -> list[FakeCache]:
        self.caches = [FakeCache() for _ in self.layers]
        return self.caches

    @staticmethod
    def next_token(context: list[int]) -> int:
        gen = context[len(PROMPT) :]
        if context[: len(PROMPT)] == PROMPT and gen == CONT[: len(gen)] and len(gen) < len(CONT):
            return CONT[len(gen)]
        return OFF

    def __call__(self, inputs: mx.array, cache: list[FakeCache] | None = None) -> mx.array:
        assert cache is not None
        toks = [int(t) for t in inputs[0].tolist()]
        self.calls.append(toks)
        for c in cache:
            c.tokens.extend(toks)
        ctx = cache[0].tokens
        start = len(ctx) - len(toks)
        rows = [[0.0] * V for _ in toks]
        for i, row in enumerate(rows):
            row[self.next_token(ctx[: start + i + 1])] = 10.0
        return mx.array(rows)[None]


Script = Callable[[int, int, int], list[int]]  # (round, n, step_base) -> drafts


def ScriptedSource(script: Script) -> FakeSource:  # noqa: N802 - reads as the class it builds
    return scripted(script)


ScriptedProvider = FakeProvider


# ---------------------------------------------------------------- scripts


def perfect(rnd: int, n: int, base: int) -> list[int]:
    return CONT[base : base + n]


def empty(rnd: int, n: int, base: int) -> list[int]:
    return []


def wrong_at(p: int, first_round_only: bool = True) -> Script:
    """Perfect drafts except position ``p`` (round 0 only unless told otherwise)."""

    def script(rnd: int, n: int, base: int) -> list[int]:
        drafts = CONT[base : base + n]
        if p < len(drafts) and (rnd == 0 or not first_round_only):
            drafts[p] = WRONG
        return drafts

    return script


def run(
    script: Script, *, gamma: int = 3, max_tokens: int = 8, eos: tuple[int, ...] = (), **kw: Any
) -> tuple[Any, FakeTarget, ScriptedSource]:
    target = FakeTarget()
    src = ScriptedSource(script)
    params = GenerationParams(
        max_tokens=max_tokens, gamma=gamma, eos_ids=eos, cache_digests=False, **kw
    )
    result = spec_generate(target, ScriptedProvider(src), list(PROMPT), params)
    return result, target, src


def rounds(result: Any) -> list[dict[str, Any]]:
    return [r for r in result.records if r["type"] == "round"]


def check_rollback(result: Any, target: FakeTarget, src: ScriptedSource) -> None:
    """Every layer trimmed by ``d - k`` after each round (none when 0); the source
    committed ``(d, k)``; the cache ends holding prompt + kept positions."""
    rs = rounds(result)
    want_trims = [len(r["drafts"]) - r["k_accept"] for r in rs if len(r["drafts"]) > r["k_accept"]]
    for i, c in enumerate(target.caches):
        assert c.trims == want_trims, f"layer {i}: trims {c.trims} != d - k per round {want_trims}"
    assert [(c["d"], c["k"]) for c in src.commits] == [(len(r["drafts"]), r["k_accept"]) for r in rs]
    assert [c["accepted"] for c in src.commits] == [r["drafts"][: r["k_accept"]] for r in rs]
    kept = len(PROMPT) - 1 + sum(r["k_accept"] + 1 for r in rs)
    assert target.caches[0].offset == kept
    assert target.caches[0].tokens == (PROMPT + CONT)[:kept]
    assert [len(call) for call in target.calls[1:]] == [len(r["drafts"]) + 1 for r in rs]


def counters(result: Any) -> dict[str, Any]:
    s = result.speculation.to_dict()
    return {
        k: s[k]
        for k in ("drafted", "accepted", "rejected", "target_calls", "rounds", "acceptance_lengths")
    }


def usage(result: Any) -> tuple[int, str]:
    return result.usage.generation_tokens, result.usage.finish_reason


# ---------------------------------------------------------------- perfect match


def test_perfect_match_all_accepted_plus_bonus() -> None:
    r, target, src = run(perfect, gamma=3, max_tokens=8)
    rs = rounds(r)
    assert [(x["drafts"], x["samples"], x["k_accept"], x["emitted"], x["end"]) for x in rs] == [
        ([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4], "bonus"),
        ([5, 6, 7], [5, 6, 7, 8], 3, [5, 6, 7, 8], "budget"),
    ]
    assert r.output_ids == CONT[:8]
    assert usage(r) == (8, "length")
    assert counters(r) == {
        "drafted": 6, "accepted": 6, "rejected": 0, "target_calls": 2, "rounds": 2,
        "acceptance_lengths": [3, 3],
    }  # fmt: skip
    assert [d["feed"] for d in src.drafts] == [[PROMPT[-1]], [3, 4]]  # re-feed [last draft, bonus]
    check_rollback(r, target, src)


@pytest.mark.parametrize("gamma", [1, 2, 5])
def test_perfect_match_any_gamma_is_lossless(gamma: int) -> None:
    r, target, src = run(perfect, gamma=gamma, max_tokens=11)
    assert r.output_ids == CONT[:11]
    assert all(x["k_accept"] == len(x["drafts"]) for x in rounds(r))
    check_rollback(r, target, src)


# ---------------------------------------------------------------- early mismatch


@pytest.mark.parametrize("p", [0, 1, 2, 3])
def test_mismatch_at_each_position_emits_correction(p: int) -> None:
    r, target, src = run(wrong_at(p), gamma=4, max_tokens=10)
    first = rounds(r)[0]
    drafts = CONT[:4]
    drafts[p] = WRONG
    assert first["drafts"] == drafts
    assert first["samples"] == CONT[: p + 1], "the walk must stop at the first mismatch"
    assert (first["k_accept"], first["emitted"], first["end"]) == (p, CONT[: p + 1], "correction")
    assert target.caches[0].trims[0] == 4 - p
    assert src.drafts[1]["feed"] == [CONT[p]]  # re-feed [correction]
    assert r.output_ids == CONT[:10]
    assert usage(r) == (10, "length")
    check_rollback(r, target, src)


def test_all_rejected_every_round() -> None:
    r, target, src = run(wrong_at(0, first_round_only=False), gamma=3, max_tokens=5)
    assert [(x["k_accept"], x["emitted"], x["end"]) for x in rounds(r)] == [
        (0, [c], "correction" if i < 4 else "budget") for i, c in enumerate(CONT[:5])
    ]
    assert counters(r) == {
        "drafted": 3 + 3 + 3 + 2 + 1, "accepted": 0, "rejected": 12, "target_calls": 5, "rounds": 5,
        "acceptance_lengths": [0] * 5,
    }  # fmt: skip
    check_rollback(r, target, src)


# ---------------------------------------------------------------- empty draft


def test_empty_draft_rounds_are_plain_steps() -> None:
    r, target, src = run(empty, gamma=3, max_tokens=4)
    assert [
        (x["window"], x["samples"], x["k_accept"], x["emitted"], x["end"]) for x in rounds(r)
    ] == [
        ([PROMPT[-1]], [1], 0, [1], "bonus"),
        ([1], [2], 0, [2], "bonus"),
        ([2], [3], 0, [3], "bonus"),
        ([3], [4], 0, [4], "budget"),
    ]
    assert counters(r) == {
        "drafted": 0, "accepted": 0, "rejected": 0, "target_calls": 4, "rounds": 4,
        "acceptance_lengths": [0] * 4,
    }  # fmt: skip
    assert usage(r) == (4, "length")
    check_rollback(r, target, src)


def test_empty_draft_eos_is_plain_step_eos() -> None:
    r, target, src = run(empty, gamma=3, max_tokens=8, eos=(CONT[2],))
    last = rounds(r)[-1]
    assert (last["drafts"], last["samples"], last["emitted"], last["end"]) == ([], [3], [], "eos")
    assert r.output_ids == CONT[:2]
    assert usage(r) == (3, "stop")
    check_rollback(r, target, src)


# ---------------------------------------------------------------- EOS in the window


@pytest.mark.parametrize("q", [0, 1, 2])
def test_eos_as_accepted_draft(q: int) -> None:
    """The EOS was drafted and matches: counted as accepted, never emitted, nothing after it."""
    r, target, src = run(perfect, gamma=3, max_tokens=8, eos=(CONT[q],))
    (only,) = rounds(r)
    assert only["samples"] == CONT[: q + 1]
    assert (only["k_accept"], only["emitted"], only["end"]) == (q + 1, CONT[:q], "eos")
    assert r.output_ids == CONT[:q]
    assert usage(r) == (q + 1, "stop")
    assert counters(r)["accepted"] == q + 1 and counters(r)["rounds"] == 1
    assert target.caches[0].trims == ([3 - (q + 1)] if q < 2 else [])
    check_rollback(r, target, src)


@pytest.mark.parametrize("q", [0, 1, 2])
def test_eos_as_correction(q: int) -> None:
    """The draft at ``q`` is wrong and the target's correction there is the EOS."""
    r, target, src = run(wrong_at(q), gamma=3, max_tokens=8, eos=(CONT[q],))
    (only,) = rounds(r)
    assert only["samples"] == CONT[: q + 1]
    assert (only["k_accept"], only["emitted"], only["end"]) == (q, CONT[:q], "eos")
    assert r.output_ids == CONT[:q]
    assert usage(r) == (q + 1, "stop")
    assert target.caches[0].trims == [3 - q]
    check_rollback(r, target, src)


@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_eos_as_bonus(gamma: int) -> None:
    r, target, src = run(perfect, gamma=gamma, max_tokens=8, eos=(CONT[gamma],))
    (only,) = rounds(r)
    assert (only["k_accept"], only["emitted"], only["end"]) == (gamma, CONT[:gamma], "eos")
    assert r.output_ids == CONT[:gamma]
    assert usage(r) == (gamma + 1, "stop")
    assert target.caches[0].trims == []
    check_rollback(r, target, src)


def test_eos_as_bonus_exactly_at_budget() -> None:
    """Budget 4, gamma 3: the bonus is the 4th token and an EOS: ``stop``, counted 4."""
    r, _, _ = run(perfect, gamma=3, max_tokens=4, eos=(CONT[3],))
    assert (r.output_ids, usage(r)) == (CONT[:3], (4, "stop"))


def test_eos_later_in_draft_does_not_stop_early() -> None:
    """An EOS id among the drafts past the first mismatch is never walked."""

    def script(rnd: int, n: int, base: int) -> list[int]:
        return [CONT[0], WRONG, CONT[5]][:n] if rnd == 0 else CONT[base : base + n]

    r, target, src = run(script, gamma=3, max_tokens=4, eos=(CONT[5],))
    assert rounds(r)[0]["samples"] == [1, 2] and rounds(r)[0]["end"] == "correction"
    assert (r.output_ids, usage(r)) == (CONT[:4], (4, "length"))
    check_rollback(r, target, src)


def test_first_of_several_eos_ids_stops() -> None:
    r, _, _ = run(perfect, gamma=4, max_tokens=8, eos=(CONT[6], CONT[2]))
    assert (r.output_ids, usage(r), rounds(r)[-1]["end"]) == (CONT[:2], (3, "stop"), "eos")


# ---------------------------------------------------------------- budget


def test_budget_cuts_walk_before_bonus() -> None:
    """n = min(gamma, left) = 2 drafts, both accepted: the budget ends the walk at
    the last draft, the bonus is never walked or counted."""
    r, target, src = run(perfect, gamma=3, max_tokens=2)
    (only,) = rounds(r)
    assert (only["drafts"], only["samples"], only["k_accept"]) == ([1, 2], [1, 2], 2)
    assert (only["emitted"], only["end"]) == ([1, 2], "budget")
    assert usage(r) == (2, "length")
    check_rollback(r, target, src)


def test_budget_on_the_correction() -> None:
    r, target, src = run(wrong_at(1), gamma=3, max_tokens=2)
    (only,) = rounds(r)
    assert (only["k_accept"], only["emitted"], only["end"]) == (1, [1, 2], "budget")
    assert usage(r) == (2, "length")
    assert target.caches[0].trims == [1]
    check_rollback(r, target, src)


def test_budget_before_eos_reports_length() -> None:
    """Budget 3, EOS at index 3 (a bonus that is never walked): ``length``, EOS not counted."""
    r, _, _ = run(perfect, gamma=3, max_tokens=3, eos=(CONT[3],))
    assert (r.output_ids, usage(r), rounds(r)[-1]["end"]) == (CONT[:3], (3, "length"), "budget")


def test_budget_mid_second_round_cut_by_short_n() -> None:
    r, target, src = run(perfect, gamma=3, max_tokens=6)
    assert [(x["drafts"], x["emitted"], x["end"]) for x in rounds(r)] == [
        ([1, 2, 3], [1, 2, 3, 4], "bonus"),
        ([5, 6], [5, 6], "budget"),
    ]
    check_rollback(r, target, src)


def test_on_token_stop_mid_burst_excludes_rest() -> None:
    seen: list[int] = []

    def on_token(t: int) -> bool:
        seen.append(t)
        return t != CONT[1]

    target = FakeTarget()
    src = ScriptedSource(perfect)
    params = GenerationParams(max_tokens=8, gamma=3, cache_digests=False)
    r = spec_generate(target, ScriptedProvider(src), list(PROMPT), params, on_token=on_token)
    (only,) = rounds(r)
    assert (only["samples"], only["emitted"], only["end"]) == ([1, 2], [1, 2], "stop")
    assert (seen, r.output_ids, usage(r)) == ([1, 2], [1, 2], (2, "stop"))


# ---------------------------------------------------------------- the references' walk


def _rebuild(result: Any, eos: tuple[int, ...], max_tokens: int, walk: Callable[..., Any]) -> str | None:
    """Rebuild every engine round with ``walk`` from its own picks; where the first differs."""
    produced = 0
    for r in rounds(result):
        got = walk(r["drafts"], r["samples"], set(eos), produced, max_tokens)
        want = (r["samples"], r["emitted"], r["k_accept"], r["end"])
        if tuple(got) != want:
            return f"round {r['index']}: rebuilt {got} != engine {want}"
        produced += len(r["emitted"])
    return None


SCENARIOS = [(perfect, 3, 8, ()), (perfect, 3, 8, (CONT[1],)), (wrong_at(0), 3, 8, ()),
             (wrong_at(2, first_round_only=False), 3, 12, ()), (wrong_at(1), 3, 8, (CONT[1],)),
             (perfect, 2, 5, ()), (perfect, 3, 3, (CONT[3],)), (empty, 3, 4, ())]


@pytest.mark.parametrize("i", range(len(SCENARIOS)))
def test_reference_walk_rebuilds_the_engine_rounds(i: int) -> None:
    """``oracles.recording.accept_walk`` (the DeepSpec, mlx-vlm DSpark and draft-golden
    runners' walk) and the executor's walk: two codings of §2 steps 2-5, one answer."""
    from oracles.recording import accept_walk

    script, gamma, max_tokens, eos = SCENARIOS[i]
    r, _, _ = run(script, gamma=gamma, max_tokens=max_tokens, eos=eos)
    assert rounds(r)
    assert _rebuild(r, eos, max_tokens, accept_walk) is None


def test_reference_walk_check_sees_an_emitted_eos() -> None:
    from oracles.recording import accept_walk

    def leaky(drafts: list[int], targets: list[int], eos: set[int], produced: int, budget: int) -> Any:
        samples, emitted, k, end = accept_walk(drafts, targets, eos, produced, budget)
        return samples, emitted + samples[-1:] if end == "eos" else emitted, k, end  # emits the EOS

    r, _, _ = run(perfect, gamma=3, max_tokens=8, eos=(CONT[1],))
    msg = _rebuild(r, (CONT[1],), 8, leaky)
    assert msg is not None and msg.startswith("round 0: rebuilt")
