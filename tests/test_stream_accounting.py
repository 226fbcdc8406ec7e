"""Early stops inside a round: callbacks and stop sequences see the stream plain decode sees.

Reference: ``speculative-decoding.md`` §2 step 4 (a round's tokens go through
``onToken`` one at a time, so stop-sequence matching sees the stream
``generate()`` would produce) and §4.7 (a callback stop before a position
excludes the unused suffix of the round); mlx-lm 0.32.2 ``server.py`` stop
sequences (token-level matcher; the consumer breaks after the completing token).
Engine spec vs engine plain on the zoo ``llama`` pairs.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance import eos_cases as ec
from specparity.cases.case import Case
from tests.helpers import load_zoo_pair
from traces.diff import diff_traces


def _stop_after(count: int, seen: list[int]) -> Any:
    def on_token(t: int) -> bool:
        seen.append(t)
        return len(seen) < count

    return on_token


@pytest.mark.parametrize("offset", [0, 1, 2], ids=["burst-head", "burst-middle", "burst-last"])
@pytest.mark.parametrize("gamma", [2, 4])
def test_on_token_false_mid_burst_excludes_rest_of_round(gamma: int, offset: int) -> None:
    """Self drafter: every round emits a burst of gamma + 1; stop inside the second one."""
    import zoo
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.sources.two_model import TwoModelProvider

    target, draft = load_zoo_pair("llama", "self")
    prompt = list(zoo.prompt("nat-00").token_ids)
    pos = offset if offset < 2 else gamma  # window position in round 1; last = the bonus
    stop_index = (gamma + 1) + pos
    params = GenerationParams(max_tokens=24, gamma=gamma, eos_ids=())
    seen_spec: list[int] = []
    seen_plain: list[int] = []
    spec = spec_generate(
        target.model, TwoModelProvider(draft.model), prompt, params,
        on_token=_stop_after(stop_index + 1, seen_spec),
    )  # fmt: skip
    plain = plain_generate(
        target.model, prompt, params, on_token=_stop_after(stop_index + 1, seen_plain)
    )
    free = plain_generate(target.model, prompt, params).output_ids
    assert seen_spec == seen_plain == free[: stop_index + 1], "on_token saw a different stream"
    assert spec.output_ids == plain.output_ids == free[: stop_index + 1]
    assert spec.usage.to_dict() == plain.usage.to_dict() == {
        "prompt_tokens": len(prompt), "generation_tokens": stop_index + 1, "finish_reason": "stop",
    }  # fmt: skip
    rounds = [r for r in spec.records if r["type"] == "round"]
    assert len(rounds) == 2, f"a round ran after the callback stop: {rounds}"
    last = rounds[-1]
    assert len(last["drafts"]) == gamma and last["k_accept"] == min(pos + 1, gamma)
    assert last["emitted"] == free[gamma + 1 : stop_index + 1] and last["end"] == "stop"
    assert last["samples"] == last["emitted"], "the walk went on past the callback stop"


def _boundary_stops(drafter: str, gamma: int, length: int) -> list[tuple[int, tuple[int, ...]]]:
    """(index, stop sequence) pairs of ``length`` tokens whose last token opens a round
    and whose earlier tokens end the previous one (first completion at index)."""
    tr = ec.probe("llama", drafter, "nat-00", gamma)
    out = tuple(tr.footer["output_ids"])
    rounds_of = ec._round_of(ec.walk_steps(tr), tr)
    found = []
    for m in range(length - 1, len(out)):
        seq = out[m - length + 1 : m + 1]
        if rounds_of[m - 1] == rounds_of[m]:
            continue
        if any(out[i - length + 1 : i + 1] == seq for i in range(length - 1, m)):
            continue
        found.append((m, seq))
    return found


@pytest.mark.parametrize("length", [2, 3])
@pytest.mark.parametrize("gamma", [1, 2, 3, 5])
@pytest.mark.parametrize("drafter", ["self", "twin"])
def test_stop_sequence_across_round_boundary_fires_where_plain_does(
    drafter: str, gamma: int, length: int
) -> None:
    stops = _boundary_stops(drafter, gamma, length)
    assert stops, f"llama/{drafter}/g{gamma}: no round boundary to put a stop sequence across"
    for m, seq in stops[:3]:
        case = Case("llama", drafter, "nat-00", gamma, 24, eos_ids=(), stop_sequences=(seq,))
        spec = ec.run("engine", case)
        plain = ec.run("engine", case.plain())
        div = diff_traces(spec, plain, level="tokens")
        assert div is None, f"{case.case_id}: stop at index {m}\n{div.message}"
        assert len(spec.footer["output_ids"]) == m + 1, (
            f"{case.case_id}: stop {seq} should complete at index {m}, output {spec.footer['output_ids']}"
        )
        assert spec.footer["usage"]["finish_reason"] == "stop"
        assert spec.events[-1]["end"] == "stop"
        assert spec.events[-1]["emitted"][-1] == seq[-1]


@pytest.mark.parametrize("gamma", [2, 4])
def test_stop_sequence_and_budget_on_same_token_is_stop(gamma: int) -> None:
    """The token that completes a stop sequence also exhausts the budget: ``stop`` wins."""
    m, seq = _boundary_stops("self", gamma, 2)[0]
    case = Case("llama", "self", "nat-00", gamma, m + 1, eos_ids=(), stop_sequences=(seq,))
    spec, plain = ec.run("engine", case), ec.run("engine", case.plain())
    assert diff_traces(spec, plain, level="tokens") is None
    assert spec.footer["usage"]["finish_reason"] == "stop"
    assert spec.footer["usage"]["generation_tokens"] == m + 1


@pytest.mark.parametrize("gamma", [0, 1, 3, 5])
def test_the_budget_is_exact(gamma: int) -> None:
    """``max_tokens`` is an absolute bound, not only spec ≡ plain: both lanes stop on it, with
    ``finish_reason`` length and ``generation_tokens`` equal to it (a budget off by one in the
    shared stream would keep spec ≡ plain and pass every comparison of the two)."""
    import zoo
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.sources.two_model import TwoModelProvider

    target, draft = load_zoo_pair("llama", "twin")
    ids = list(zoo.prompt("nat-00").token_ids)
    for n in (1, 2, 7):
        params = GenerationParams(max_tokens=n, gamma=gamma, eos_ids=())
        res = (plain_generate(target.model, ids, params) if gamma == 0
               else spec_generate(target.model, TwoModelProvider(draft.model), ids, params))
        assert len(res.output_ids) == n and res.usage.generation_tokens == n, (gamma, n, res.output_ids)
        assert res.usage.finish_reason == "length", res.usage
