"""The conformance tests on the user's own pairs: ``pytest conformance/ -m oracle --suite FILE``.

Each pair of the suite (``specparity.cases.suite``: model paths or zoo names, the pair's prompts,
γ and sampling settings; ``conformance/conftest.py`` turns it into ``user_pair``) gets:

- the EOS matrix (``test_eos_matrix.py``): a stopping EOS derived at an output position
  that the pair's own greedy probe emits as an accepted draft, a correction, a bonus or a
  plain step, × budget before/at/after it; engine vs mlx-lm on the token stream and round
  for round, and the accounting contract (§2 step 3, §4.7);
- the planted bugs (``test_eos_matrix.py``'s accounting plants, ``test_planted_bugs.py``'s
  short target trim and drafter over-trim): each must be caught on the pair, first round
  and field named;
- sampled decoding (``test_temperature.py``): the suite's sampled settings (or temperature
  0.8, seeds 0 and 7) round for round vs mlx-lm, and a one-seed difference caught;
- exact rotating rollback (``test_rotating_exact.py``) when the pair has a sliding-window
  cache: speculation past the ring wrap equals plain decode, rolled-back caches equal a
  kept-only serial replay.

Tests that need the zoo's own artifacts are listed in :data:`ZOO_ONLY` and skip on a
user pair saying so. Without ``--suite`` every test here skips (no user suite).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

import pytest

from conformance import eos_cases as ec
from conformance.conftest import UserPair, run_trace, witness
from conformance.test_eos_matrix import PLANTED, _plant, check_against_oracle
from traces.diff import diff_traces
from traces.reference import ReferenceRefused, compare_with_reference, refusal_verdict

PROBE_TOKENS = 24


def _first_greedy(pair: UserPair) -> Any:
    if not pair.greedy:
        pytest.skip(f"{pair}: no greedy two-model case (a drafter and temperature 0) in the suite")
    return pair.greedy[0]


@cache
def _plain_output(base: Any) -> tuple[int, ...]:
    tr = run_trace("engine", replace(base.plain(), max_tokens=PROBE_TOKENS, eos_ids=(),
                                     stop_sequences=()))
    return tuple(tr.footer["output_ids"])


@cache
def _eos_case(pair: UserPair, kind: str) -> ec.EosCase | None:
    """The first (case, j) of the pair whose greedy probe emits position ``j`` as ``kind``."""
    for base in pair.greedy:
        output = _plain_output(base)
        if kind == "plain-step":
            j = next((j for j in range(ec.MIN_EOS_INDEX, len(output) - 2)
                      if ec.is_first_occurrence(output, j)), None)
            if j is not None:
                return ec.EosCase(kind, replace(base.plain(), max_tokens=j + 1,
                                                eos_ids=(ec.eos_at(output, j),), stop_sequences=()),
                                  j, output)
            continue
        probe = run_trace("engine", replace(base, max_tokens=PROBE_TOKENS, eos_ids=(), stop_sequences=()))
        got = tuple(probe.footer["output_ids"])
        assert got == output[: len(got)], f"{probe.header['case_id']}: spec probe differs from plain decode"
        steps = ec.walk_steps(probe)
        for j in range(ec.MIN_EOS_INDEX, min(len(output), len(steps)) - 2):
            if steps[j][0] == kind and ec.is_first_occurrence(output, j) and steps[j][1] != 0:
                case = replace(base, max_tokens=j + 1, eos_ids=(ec.eos_at(output, j),), stop_sequences=())
                return ec.EosCase(kind, case, j, output)
    return None


def _eos_or_skip(pair: UserPair, kind: str) -> ec.EosCase:
    _first_greedy(pair)
    case = _eos_case(pair, kind)
    if case is None:
        pytest.skip(f"{pair}: no output position of the pair's greedy probes ({PROBE_TOKENS} tokens) "
                    f"is a first occurrence emitted as {kind}")
    return case


# ---------------------------------------------------------------- EOS


@pytest.mark.oracle
@pytest.mark.parametrize("budget", ec.BUDGETS)
@pytest.mark.parametrize("kind", (*ec.SPEC_KINDS, "plain-step"))
def test_eos_on_user_pair(oracle_ok: None, user_pair: UserPair, kind: str, budget: str) -> None:
    case = _eos_or_skip(user_pair, kind)
    c = case.with_budget(budget)
    check_against_oracle(case, budget, run_trace("engine", c), run_trace("mlx_lm", c))


# ---------------------------------------------------------------- planted bugs


@pytest.mark.oracle
@pytest.mark.parametrize(("bug", "kind", "budget", "where", "field"), PLANTED)
def test_planted_accounting_bug_on_user_pair(oracle_ok: None, user_pair: UserPair,
                                             monkeypatch: pytest.MonkeyPatch, bug: Any, kind: str,
                                             budget: str, where: str, field: str) -> None:
    case = next((c for k in (kind, *ec.SPEC_KINDS) if (c := _eos_case(user_pair, k)) is not None), None) \
        if user_pair.greedy else None
    if case is None:
        pytest.skip(f"{user_pair}: no EOS position derivable from the pair's greedy probes")
    c = case.with_budget(budget)
    ref = run_trace("mlx_lm", c)
    _plant(monkeypatch, bug)
    bad = run_trace("engine", c)
    div = diff_traces(bad, ref, level="tokens")
    assert div is not None, f"{bug.__name__} went unnoticed by the token-level diff on {c.case_id}"
    assert div.klass == "logic", div.message
    assert ec.accounting_problems(bad), f"{bug.__name__} passed the accounting check on {c.case_id}"
    with pytest.raises(AssertionError):
        check_against_oracle(case, budget, bad, ref)


def _rejecting(pair: UserPair) -> tuple[Any, Any, int]:
    """A greedy case of the pair whose mlx-lm trace rejects a draft, and that round."""
    for case in pair.greedy:
        ref = run_trace("mlx_lm", case)
        for r in ref.rounds[:-1]:
            if r["k_accept"] < len(r["drafts"]):
                return case, ref, int(r["index"])
    pytest.skip(f"{pair}: no greedy case rejects a draft (a drafter that always agrees cannot show "
                "a rollback bug)")


@pytest.mark.oracle
def test_planted_target_short_trim_on_user_pair(oracle_ok: None, user_pair: UserPair,
                                                short_target_trim: None) -> None:
    _first_greedy(user_pair)
    case, ref, r = _rejecting(user_pair)
    div = diff_traces(run_trace("engine", case), ref, level="round")
    assert div is not None, f"{case.case_id}: a short target trim went unnoticed"
    assert (div.where, div.field, div.klass) == (f"round {r}", "target_cache_digest", "logic"), div.message


@pytest.mark.oracle
def test_planted_drafter_overtrim_on_user_pair(oracle_ok: None, user_pair: UserPair,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import caches as cache_ops
    from engine.sources import two_model

    _first_greedy(user_pair)
    case, ref, r = _rejecting(user_pair)

    def commit(self: Any, d: int, k_accept: int, *args: Any, **kw: Any) -> None:
        cache_ops.trim(self.caches, max(d - k_accept, 0), "two-model drafter")

    monkeypatch.setattr(two_model.TwoModelSource, "commit", commit)
    div = diff_traces(run_trace("engine", case), ref, level="round")
    assert div is not None, f"{case.case_id}: a drafter trimmed by d - k went unnoticed"
    assert (div.where, div.field, div.klass) == (f"round {r}", "drafter_cache_digest", "logic"), div.message


# ---------------------------------------------------------------- sampled


@pytest.mark.oracle
def test_sampled_on_user_pair(oracle_ok: None, user_pair: UserPair) -> None:
    cases = user_pair.sampled or [replace(c, temperature=0.8, seed=s)
                                  for c in [_first_greedy(user_pair)] for s in (0, 7)]
    for case in cases:
        eng = run_trace("engine", case)
        try:
            ref = run_trace("mlx_lm", case)
        except ReferenceRefused as exc:
            verdict = refusal_verdict(eng, exc)
        else:
            # the comparison policy of the zoo tests: rounds up to an engine §2 ring-wrap
            # fallback, then tokens; a known reference divergence is an xfail naming it
            verdict = compare_with_reference(eng, ref, "mlx_lm", witness=witness())
        if verdict.status in ("known", "refused"):
            pytest.xfail(f"known reference behaviour {verdict.known.id if verdict.known else '?'}: "
                         f"{verdict.format()[:400]}")
        assert verdict.status == "identical", \
            f"{case.case_id}: engine vs mlx-lm at temperature {case.temperature}\n{verdict.format()}"
        assert eng.rounds or eng.plains, case.case_id
    other = replace(cases[0], seed=cases[0].seed + 1)
    assert diff_traces(run_trace("engine", cases[0]), run_trace("mlx_lm", other), level="round") \
        is not None, f"{cases[0].case_id}: a one-seed difference went unnoticed"


# ---------------------------------------------------------------- rotating


@pytest.mark.oracle
def test_rotating_exact_on_user_pair(user_pair: UserPair) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    import zoo
    from conformance.test_rotating_exact import RingAudit, assert_exact
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.rollback import is_rotating
    from specparity.cases.prompts import model_limits
    from specparity.runners import load_model

    base = _first_greedy(user_pair)
    tdir, ddir = user_pair.paths()
    t, d = load_model(str(tdir)), load_model(str(ddir))
    rings = [int(c.max_size) for c in make_prompt_cache(t.model) if is_rotating(c)]
    if not rings:
        pytest.skip(f"{user_pair}: the target has no rotating (sliding-window) cache: no ring to wrap")
    ids = list(base.prompt_tokens or zoo.prompt(base.prompt_id).token_ids)
    import json

    _, context = model_limits(json.loads((tdir / "config.json").read_text()))
    n = 4 * max(rings)
    if context is not None:
        n = min(n, context - len(ids))
    if len(ids) + n < max(rings) + 8:
        pytest.skip(f"{user_pair}: the context ({context}) leaves no room to generate past the ring "
                    f"({max(rings)})")
    params = GenerationParams(max_tokens=n, gamma=base.gamma, eos_ids=(), rotating="exact")
    audit = RingAudit(t.model)
    spec = spec_generate(t.model, audit.provider(d.model), ids, params, observer=audit)
    plain = plain_generate(t.model, ids, GenerationParams(max_tokens=n, eos_ids=()))
    assert_exact(spec, plain, audit)


# ---------------------------------------------------------------- zoo-only

ZOO_ONLY = {
    "initial-sample-eos-full-prefill": "test_eos_matrix.py::test_initial_sample_eos_full_prefill and "
    "::test_later_eos_full_prefill_spec_matches_plain need the zoo's self and small drafters of "
    "llama (an EOS as the full-prefill sample)",
    "arrival-kind-coverage": "test_eos_matrix.py::test_matrix_covers_every_arrival_kind measures the "
    "zoo matrix's arrival kinds (a user pair's kinds are each derived or skipped above)",
    "rotating-assistant-heads": "test_rotating_exact.py::test_exact_with_assistant_heads_reading_the_"
    "target_ring needs the zoo's gemma4 assistant heads",
    "known-divergence-probes": "test_two_model_vs_mlx_lm.py's known-entry probes pin zoo cases",
}


@pytest.mark.oracle
@pytest.mark.parametrize("name", sorted(ZOO_ONLY))
def test_zoo_only(user_pair: UserPair, name: str) -> None:
    pytest.skip(f"zoo-only: {ZOO_ONLY[name]}")
