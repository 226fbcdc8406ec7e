"""EOS accounting, stop conditions and finish reasons: the full matrix (issue 4).

Contract (``speculative-decoding.md`` §2 step 3, §4.7; mlx-lm 0.32.2
``stream_generate``): a stopping EOS arriving as the initial sample, an
accepted draft, the correction, the bonus or a plain step is counted once in
``generation_tokens`` (``n + 1``), never emitted, and ends with ``stop``;
nothing after it is emitted or counted. The token budget ends with ``length``.
A stop sequence ends with ``stop`` at exactly the token plain decode ends on,
wherever round boundaries and bursts fall.

Matrix: arrival kind (accepted-draft, correction, bonus) x gamma {1, 2, 4} x
budget {before, at, after} the EOS x stop sequence {none, across a round
boundary, inside a burst}, plus plain steps; engine vs mlx-lm on the token
stream and round for round. The arrival kind of each case is measured from
both traces, never assumed from the construction. The initial sample (full
prefill) is engine-only: neither Case runner nor mlx-lm two-model runs it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from conformance import eos_cases as ec
from conformance.conftest import run_trace
from traces.diff import diff_traces
from traces.io import Trace

GAMMAS = (1, 2, 4)
SPEC_MATRIX = [
    pytest.param(kind, g, budget, stop, id=f"{kind}-g{g}-{budget}-{stop}")
    for kind in ec.SPEC_KINDS
    for g in GAMMAS
    for budget in ec.BUDGETS
    for stop in ec.STOP_MODES
]
PLAIN_MATRIX = [
    pytest.param(budget, stop, id=f"plain-step-{budget}-{stop}")
    for budget in ec.BUDGETS
    for stop in ("nostop", "xround")
]


def _observed(tr: Trace) -> tuple[list[int], int, str, bool]:
    u = tr.footer["usage"]
    return (
        list(tr.footer["output_ids"]),
        u["generation_tokens"],
        u["finish_reason"],
        ec.eos_reached(tr),
    )


def check_against_oracle(case: ec.EosCase, budget: str, engine: Trace, ref: Trace) -> None:
    """Every assertion of one matrix cell; messages carry the case description."""
    want = case.expected(budget)
    what = ec.describe(case, {"budget": budget})
    for name, tr in (("engine", engine), ("mlx_lm", ref)):
        problems = ec.accounting_problems(tr)
        assert not problems, f"{name}: {what}\n" + "\n".join(problems)
        got = _observed(tr)
        assert got == want, (
            f"{name}: {what}\n  (output, generation_tokens, finish_reason, eos_reached)\n"
            f"  got  {got}\n  want {want}"
        )
        if want[3]:
            assert ec.arrival_kind(tr) == case.kind, (
                f"{name}: {what}: EOS arrived as {ec.arrival_kind(tr)}"
            )
    div = diff_traces(engine, ref, level="tokens")
    assert div is None, f"{what}\n{div.message}"
    div = diff_traces(engine, ref, level="round")
    assert div is None, f"{what}\n{div.message}"


@pytest.mark.oracle
@pytest.mark.parametrize(("kind", "gamma", "budget", "stop"), SPEC_MATRIX)
def test_spec_eos_matrix(oracle_ok: None, kind: str, gamma: int, budget: str, stop: str) -> None:
    case = ec.derive_spec_case(kind, gamma, stop)
    c = case.with_budget(budget)
    check_against_oracle(case, budget, run_trace("engine", c), run_trace("mlx_lm", c))


@pytest.mark.oracle
@pytest.mark.parametrize(("budget", "stop"), PLAIN_MATRIX)
def test_plain_step_eos_matrix(oracle_ok: None, budget: str, stop: str) -> None:
    """Plain decode (mlx-lm ``generate_step``): every token is a plain step."""
    case = ec.derive_plain_case(stop)
    c = case.with_budget(budget)
    check_against_oracle(case, budget, run_trace("engine", c), run_trace("mlx_lm", c))


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ec.SPEC_KINDS)
def test_several_eos_ids_first_one_to_arrive_stops(oracle_ok: None, kind: str) -> None:
    """Two EOS ids; the one listed second arrives first, and the other never fires early."""
    from dataclasses import replace

    case = ec.derive_spec_case(kind, 2)
    tok = case.output[case.j]
    other = ec.extra_eos(case.output, case.j)
    multi = replace(case, case=replace(case.case, eos_ids=(other, tok)))
    c = multi.with_budget("after")
    check_against_oracle(multi, "after", run_trace("engine", c), run_trace("mlx_lm", c))


# ------------------------------------------------------- initial sample (full prefill)


def _full_prefill_runs(
    drafter: str, gamma: int, j: int, budget: str
) -> tuple[Trace, Trace, tuple[int, ...]]:
    import zoo
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.sources.two_model import TwoModelProvider
    from specparity.runners import load_model

    tpath, dpath = zoo.pair("llama", drafter)
    target, draft = load_model(str(tpath)), load_model(str(dpath))
    prompt = list(zoo.prompt("nat-00").token_ids)
    free = plain_generate(target.model, prompt, GenerationParams(max_tokens=12, prefill="full"))
    out = tuple(free.output_ids)
    eos = (ec.eos_at(out, j),)
    params = GenerationParams(
        max_tokens=j + ec.BUDGETS.index(budget), gamma=gamma, prefill="full", eos_ids=eos
    )
    cid = f"llama/{drafter}/nat-00/g{gamma}/full/eos{eos[0]}@{j}/{budget}"
    spec = spec_generate(target.model, TwoModelProvider(draft.model), prompt, params)
    plain = plain_generate(target.model, prompt, params)
    return (
        ec.result_trace(spec, cid, eos),
        ec.result_trace(plain, cid + "/plain", eos, "plain"),
        out,
    )


@pytest.mark.parametrize("budget", ["at", "after"])
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("drafter", ["self", "small"])
def test_initial_sample_eos_full_prefill(drafter: str, gamma: int, budget: str) -> None:
    """EOS as the full-prefill forward's own sample: counted once, nothing emitted, no round run."""
    spec, plain, _ = _full_prefill_runs(drafter, gamma, 0, budget)
    cid = spec.header["case_id"]
    for tr in (spec, plain):
        assert not ec.accounting_problems(tr), ec.accounting_problems(tr)
        assert _observed(tr) == ([], 1, "stop", True), f"{tr.header['case_id']}: {_observed(tr)}"
    assert ec.arrival_kind(spec) == "initial", f"{cid}: {ec.walk_steps(spec)}"
    assert spec.rounds == [], f"{cid}: a round ran after an initial EOS: {spec.rounds}"
    assert diff_traces(spec, plain, level="tokens") is None


@pytest.mark.parametrize("budget", ec.BUDGETS)
@pytest.mark.parametrize("gamma", GAMMAS)
def test_later_eos_full_prefill_spec_matches_plain(gamma: int, budget: str) -> None:
    """Full prefill with the EOS later in the stream: spec accounting equals plain's."""
    spec, plain, out = _full_prefill_runs("twin", gamma, 5, budget)
    for tr in (spec, plain):
        assert not ec.accounting_problems(tr), ec.accounting_problems(tr)
    reached = budget != "before"
    want = (list(out[:5]), 5 + int(reached), "stop" if reached else "length", reached)
    assert _observed(spec) == want, f"{spec.header['case_id']}: {_observed(spec)} != {want}"
    div = diff_traces(spec, plain, level="tokens")
    assert div is None, div.message


# ------------------------------------------------------- coverage, measured


def test_matrix_covers_every_arrival_kind() -> None:
    """Measure (engine traces) the arrival kind of every EOS-reaching matrix cell."""
    seen: Counter[str] = Counter()
    for kind in ec.SPEC_KINDS:
        for g in GAMMAS:
            case = ec.derive_spec_case(kind, g)
            for budget in ("at", "after"):
                seen[str(ec.arrival_kind(run_trace("engine", case.with_budget(budget))))] += 1
    plain = ec.derive_plain_case()
    for budget in ("at", "after"):
        seen[str(ec.arrival_kind(run_trace("engine", plain.with_budget(budget))))] += 1
    for g in GAMMAS:
        spec, _, _ = _full_prefill_runs("self", g, 0, "at")
        seen[str(ec.arrival_kind(spec))] += 1
    missing = set(ec.ARRIVAL_KINDS) - set(seen)
    assert not missing, f"arrival kinds never measured: {sorted(missing)}; measured {dict(seen)}"
    assert "None" not in seen, f"a cell meant to reach its EOS did not: {dict(seen)}"


# ------------------------------------------------------- planted bugs


def _plant(monkeypatch: pytest.MonkeyPatch, after: Any) -> None:
    """Wrap ``TokenStream.offer``: ``after(stream, token, stop)`` may corrupt the result."""
    import engine.stream as ex

    real = ex.TokenStream.offer

    def offer(self: Any, token: int) -> str | None:
        return after(self, token, real(self, token))

    monkeypatch.setattr(ex.TokenStream, "offer", offer)


def _bug_eos_as_content(stream: Any, token: int, stop: str | None) -> str | None:
    if stop == "eos":
        stream.output.append(token)
    return stop


def _bug_eos_counted_twice(stream: Any, token: int, stop: str | None) -> str | None:
    if stop == "eos":
        stream.usage.generation_tokens += 1
    return stop


def _bug_budget_as_stop(stream: Any, token: int, stop: str | None) -> str | None:
    if stop == "budget":
        stream.usage.finish_reason = "stop"
    return stop


PLANTED = [
    pytest.param(
        _bug_eos_as_content,
        "bonus",
        "at",
        "output token",
        "output_ids",
        id="eos-emitted-as-content",
    ),
    pytest.param(
        _bug_eos_counted_twice,
        "accepted-draft",
        "after",
        "footer",
        "usage.generation_tokens",
        id="eos-counted-twice",
    ),
    pytest.param(
        _bug_budget_as_stop,
        "correction",
        "before",
        "footer",
        "usage.finish_reason",
        id="budget-stop-as-stop",
    ),
]


@pytest.mark.oracle
@pytest.mark.parametrize(("bug", "kind", "budget", "where", "field"), PLANTED)
def test_planted_accounting_bug_is_caught(
    oracle_ok: None,
    monkeypatch: pytest.MonkeyPatch,
    bug: Any,
    kind: str,
    budget: str,
    where: str,
    field: str,
) -> None:
    case = ec.derive_spec_case(kind, 2)
    c = case.with_budget(budget)
    ref = run_trace("mlx_lm", c)
    _plant(monkeypatch, bug)
    bad = run_trace("engine", c)
    div = diff_traces(bad, ref, level="tokens")
    assert div is not None, f"{bug.__name__} went unnoticed by the token-level diff on {c.case_id}"
    assert div.where.startswith(where) and div.field.endswith(field.split(".")[-1]), div.message
    assert div.klass == "logic", div.message
    # the self-contained accounting check catches it without an oracle too
    assert ec.accounting_problems(bad), f"{bug.__name__} passed the accounting check on {c.case_id}"
    with pytest.raises(AssertionError):
        check_against_oracle(case, budget, bad, ref)
