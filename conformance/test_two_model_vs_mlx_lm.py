"""Engine two-model vs mlx-lm ``speculative_generate_step``, round for round.

§3 roster row ``two-model`` (oracle L1): same pair, greedy, every zoo pair,
γ ∈ {1, 2, 3, 5}: feed, drafts, window, samples, k_accept, emitted, end and
the target/drafter cache digests after every round's rollback must be equal,
and so must usage and the speculation counters. Also plain decode vs mlx-lm
``generate_step``. The default run takes, on every target, its twin drafter at γ 3 on
nat-00 and each one-axis variant of it (every drafter, every γ, every prompt); the full
cross product runs nightly (``tests.helpers.one_axis``).

The comparison policy is ``traces.reference.compare_with_reference``: where
the engine's §2 ring-wrap guard stopped speculating, the rounds before that
point are compared round for round and the run at the token level; a
divergence or refusal that matches ``traces/known_divergences.toml`` is an
xfail naming the known reference bug (never a silent skip), anything else
fails.
"""

from __future__ import annotations

import pytest

from conformance.conftest import matrix_prompt_ids, require_oracle, run_trace, witness
from specparity.cases.case import Case
from tests.helpers import one_axis
from traces.io import Trace
from traces.reference import ReferenceRefused, Verdict, compare_with_reference, refusal_verdict

GAMMAS = (1, 2, 3, 5)


def _pairs() -> list[tuple[str, str]]:
    import zoo

    return zoo.pairs()


def _max_tokens(target: str) -> int:
    # Windowed targets generate 64 tokens so the ring wraps (§2 guard, known bug).
    return 64 if target in ("gemma3", "gemma4") else 32


def _prompts(target: str) -> list[str]:
    # Fewer prompts on the slower windowed/recurrent targets in the default run.
    return matrix_prompt_ids(4 if target in ("llama", "qwen3") else 2)


CASES = [
    Case(t, d, p, g, _max_tokens(t))
    for (t, d) in _pairs()
    for g in GAMMAS
    for p in _prompts(t)
]
PLAIN = list(dict.fromkeys(c.plain() for c in CASES))


def verdict_for(case: Case) -> tuple[Trace, Verdict]:
    eng = run_trace("engine", case)
    try:
        ref = run_trace("mlx_lm", case)
    except ReferenceRefused as exc:
        return eng, refusal_verdict(eng, exc)
    return eng, compare_with_reference(eng, ref, "mlx_lm", witness=witness())


def _expect(case: Case, verdict: Verdict) -> None:
    if verdict.status in ("known", "refused"):
        assert verdict.known is not None
        pytest.xfail(f"known reference behaviour {verdict.known.id}: {verdict.format()[:400]}")
    if verdict.status == "numerics":  # a witnessed arithmetic flip after the engine's fallback
        pytest.xfail(f"arithmetic flip after the engine's fallback (numerics):\n{verdict.format()[:1200]}")
    assert verdict.status == "identical", f"{case.case_id}: engine vs mlx-lm\n{verdict.format()}"


@pytest.mark.oracle
@pytest.mark.parametrize("case", one_axis(CASES, drafter=("twin", "trained"), gamma=3, prompt_id="nat-00"))
def test_round_for_round(case: Case) -> None:
    require_oracle("mlx_lm")
    eng, verdict = verdict_for(case)
    # The comparison is not vacuous: the engine ran rounds and digests were recorded.
    assert eng.rounds or eng.plains, case.case_id
    _expect(case, verdict)


@pytest.mark.oracle
@pytest.mark.parametrize("case", PLAIN, ids=lambda c: c.case_id)
def test_plain_decode_matches_generate_step(case: Case) -> None:
    require_oracle("mlx_lm")
    _expect(case, verdict_for(case)[1])


@pytest.mark.oracle
def test_matrix_exercises_every_round_end() -> None:
    """The matrix reaches all-accept, partial and zero-accept rounds."""
    require_oracle("mlx_lm")
    ends: set[str] = set()
    ks: set[str] = set()
    for case in [c for c in CASES if c.target in ("llama", "qwen3")][::5]:
        tr = run_trace("mlx_lm", case)
        for r in tr.rounds:
            ends.add(r["end"])
            d, k = len(r["drafts"]), r["k_accept"]
            ks.add("all" if k == d else ("zero" if k == 0 else "partial"))
    assert {"correction", "bonus", "budget"} <= ends, ends
    assert ks == {"all", "zero", "partial"}, ks


KNOWN_PROBES = {
    # entry id -> a case that must show it (proves the manifest entry is live)
    "mlx-lm-rotating-trim-after-wrap": Case("gemma3", "twin", "rnd-00", 3, 64),
    "mlx-lm-refuses-recurrent-target": Case("qwen35", "twin", "nat-00", 3, 32),
    "mlx-lm-spec-processor-history-omits-prompt": Case("llama", "twin", "nat-00", 3, 32, processors="rp1.3c64"),
}


def test_every_known_entry_has_a_probe() -> None:
    from conformance.test_quantized_kv_vs_mlx_lm import KV_PROBED  # quantized KV: its own pair
    from traces.reference import known_entries

    assert {e.id for e in known_entries() if e.runner == "mlx_lm"} == set(KNOWN_PROBES) | KV_PROBED


@pytest.mark.oracle
@pytest.mark.parametrize("entry_id", sorted(KNOWN_PROBES))
def test_known_reference_behaviour_still_reproduces(entry_id: str) -> None:
    """Every known-divergence entry is exercised: an entry that no longer matches is reported."""
    require_oracle("mlx_lm")
    case = KNOWN_PROBES[entry_id]
    eng, verdict = verdict_for(case)
    assert verdict.known is not None and verdict.known.id == entry_id, (
        f"{case.case_id}: expected known reference behaviour {entry_id!r}, got {verdict.status}:\n"
        f"{verdict.format()}\n(if mlx-lm fixed it, remove the entry from traces/known_divergences.toml)"
    )
    if verdict.status == "known":
        # The engine itself stays correct on the same case.
        from traces.diff import diff_traces

        plain = run_trace("engine", case.plain())
        assert diff_traces(eng, plain, level="tokens") is None
