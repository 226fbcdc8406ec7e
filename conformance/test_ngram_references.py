"""The ngram source vs the n-gram references: HF prompt lookup and mlx-optiq.

Rule differences from §3 are DOCUMENTED in ``conformance/reference_rules.toml``
(reason + an example history); each example must still show its difference.
Everything else is checked exactly: on random histories each reference equals
a brute-force model of its documented rule, and equals the §3 lookup wherever
the documented differences do not fire. Live optiq runs (tokens, accounting
after the named ``optiq-stopping-eos`` normalization) must equal plain greedy.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.conftest import matrix_prompt_ids, require_oracle, run_trace
from engine.sources.ngram import lookup
from specparity.cases.case import Case
from traces.diff import diff_traces
from traces.io import Trace
from traces.normalize import NotApplicable, optiq_stopping_eos

RULES = tomllib.loads((Path(__file__).parent / "reference_rules.toml").read_text())
histories = st.lists(st.integers(0, 3), min_size=1, max_size=30)


def overlap_rule(history: list[int], n: int, ngram_max: int, ngram_min: int = 1) -> list[int]:
    """§3 with overlapping occurrences allowed (HF's documented difference)."""
    size = len(history)
    for k in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        tail = history[size - k :]
        for i in range(size - k):
            if history[i : i + k] == tail:
                return history[i + k : i + k + n]
    return []


def optiq_rule(
    history: list[int], n: int, ngram_max: int, ngram_min: int, keep: int = 4
) -> list[int]:
    """optiq's documented rule: last ``keep`` occurrences, longest agreement, ties -> latest."""
    size = len(history)
    for g in range(ngram_max, ngram_min - 1, -1):
        if size < g:
            continue
        tail = history[size - g :]
        ends = [e for e in range(g, size + 1) if history[e - g : e] == tail][-keep:]
        cands = [e for e in ends if e != size]
        if not cands:
            continue

        def agree(e: int) -> int:
            i = 0
            while i < 48 and e - 1 - i >= 0 and history[e - 1 - i] == history[size - 1 - i]:
                i += 1
            return i

        best = max((agree(e), e) for e in cands)[1]
        if history[best : best + n]:
            return history[best : best + n]
    return []


# ------------------------------------------------------------------ HF
@pytest.mark.oracle
@pytest.mark.parametrize("name", [k for k in RULES["hf_prompt_lookup"]])
def test_hf_documented_difference(name: str) -> None:
    require_oracle("hf_prompt_lookup")
    from oracles.hf_prompt_lookup import propose

    r = RULES["hf_prompt_lookup"][name]
    spec = lookup(r["history"], r["n"], r["ngram_max"], r.get("ngram_min", 1))
    ref = propose(r["history"], r["n"], r["ngram_max"])
    assert spec == r["spec"] and ref == r["reference_proposal"] and spec != ref, (name, spec, ref)


@pytest.mark.oracle
@settings(max_examples=300, deadline=None)
@given(history=histories, n=st.integers(1, 8), ngram_max=st.integers(1, 4))
def test_hf_equals_documented_rule(history: list[int], n: int, ngram_max: int) -> None:
    require_oracle("hf_prompt_lookup")
    from oracles.hf_prompt_lookup import propose

    ref = propose(history, n, ngram_max)
    assert ref == overlap_rule(history, n, ngram_max), (history, n, ngram_max, ref)
    if overlap_rule(history, n, ngram_max) == lookup(history, n, ngram_max, 1):
        assert ref == lookup(history, n, ngram_max, 1), (history, ref)


# ------------------------------------------------------------------ optiq
def _index_propose(history: list[int], n: int, ngram_max: int, ngram_min: int) -> list[int]:
    from optiq.runtime.ngram_spec import NgramIndex

    ix = NgramIndex(ngram_min, ngram_max)
    ix.extend(history)
    return ix.propose(n)


@pytest.mark.oracle
@pytest.mark.parametrize("name", ["occurrence", "overlap"])
def test_optiq_documented_difference(name: str) -> None:
    require_oracle("optiq")
    r = RULES["optiq"][name]
    spec = lookup(r["history"], r["n"], r["ngram_max"], r["ngram_min"])
    ref = _index_propose(r["history"], r["n"], r["ngram_max"], r["ngram_min"])
    assert spec == r["spec"] and ref == r["reference_proposal"] and spec != ref, (name, spec, ref)


@pytest.mark.oracle
@settings(max_examples=300, deadline=None)
@given(history=histories, n=st.integers(1, 8), ngram_min=st.integers(1, 3), extra=st.integers(0, 2))
def test_optiq_index_equals_documented_rule(
    history: list[int], n: int, ngram_min: int, extra: int
) -> None:
    require_oracle("optiq")
    ngram_max = ngram_min + extra
    ref = _index_propose(history, n, ngram_max, ngram_min)
    assert ref == optiq_rule(history, n, ngram_max, ngram_min), (
        history,
        n,
        ngram_min,
        ngram_max,
        ref,
    )
    if optiq_rule(history, n, ngram_max, ngram_min) == lookup(history, n, ngram_max, ngram_min):
        assert ref == lookup(history, n, ngram_max, ngram_min)


def _optiq_cases() -> list[Case]:
    out = []
    for t in ("llama", "qwen3"):
        for p in matrix_prompt_ids(4):
            out.append(Case(t, "ngram", p, 10, 48, source="ngram"))
    return out


def _eos_case(case: Case) -> Case:
    """The same case with the 6th plain token declared EOS: a stopping-EOS run."""
    from dataclasses import replace

    plain = run_trace("engine", case.plain())
    return replace(case, eos_ids=(plain.output_ids[5],))


@pytest.mark.oracle
@pytest.mark.parametrize("eos", [False, True], ids=["budget", "eos"])
@pytest.mark.parametrize("case", _optiq_cases(), ids=lambda c: c.case_id)
def test_optiq_ngram_tokens_equal_plain(case: Case, eos: bool) -> None:
    require_oracle("optiq")
    if eos:
        case = _eos_case(case)
    raw = run_trace("optiq", case)
    ref = Trace.from_records(optiq_stopping_eos(raw.records()))
    plain = run_trace("engine", case.plain())
    div = diff_traces(ref, plain, level="tokens")
    assert div is None, f"{case.case_id}: optiq ngram vs engine plain\n{div.message}"
    if eos:
        assert raw.output_ids[-1] in case.eos_ids, "optiq did not yield the stopping EOS"
        assert raw.footer["usage"]["finish_reason"] == "stop"
    # Every drafted round copies what optiq's documented rule proposes.
    history = list(raw.header["prompt"]["token_ids"])
    for r in raw.rounds:
        if r["drafts"]:
            want = optiq_rule(history, len(r["drafts"]), 3, 1)
            assert r["drafts"] == want, (case.case_id, r["index"], r["drafts"], want)
        history += r["emitted"]


@pytest.mark.oracle
@pytest.mark.parametrize("case", _optiq_cases()[:2], ids=lambda c: c.case_id)
def test_optiq_plain_round_for_round(case: Case) -> None:
    require_oracle("optiq")
    case = _eos_case(case)
    raw = run_trace("optiq", case.plain())
    div = diff_traces(
        Trace.from_records(optiq_stopping_eos(raw.records())),
        run_trace("engine", case.plain()),
        level="round",
    )
    assert div is None, f"{case.case_id}: optiq plain vs engine plain\n{div.message}"


@pytest.mark.oracle
def test_optiq_ngram_drafts_and_accepts() -> None:
    require_oracle("optiq")
    tot = {"drafted": 0, "accepted": 0}
    for case in _optiq_cases():
        s = run_trace("optiq", case).footer["speculation"]
        tot["drafted"] += s["drafted"]
        tot["accepted"] += s["accepted"]
    print(f"\noptiq ngram over {len(_optiq_cases())} cases: {tot}")
    assert tot["drafted"] > 0, tot


def test_normalization_can_fail() -> None:
    """optiq-stopping-eos removes ONLY the stopping EOS: other differences survive it."""
    header = {"type": "header", "eos_ids": [0]}
    rnd = {"type": "round", "emitted": [5, 0], "end": "eos"}
    footer = {
        "type": "footer",
        "usage": {"finish_reason": "stop", "generation_tokens": 2},
        "output_ids": [5, 0],
    }
    norm = optiq_stopping_eos([header, rnd, footer])
    assert norm[-1]["output_ids"] == [5] and norm[1]["emitted"] == [5]
    assert norm[-1]["usage"]["generation_tokens"] == 2
    # A run that stopped on a non-EOS token is refused, not silently "fixed".
    with pytest.raises(NotApplicable):
        optiq_stopping_eos([header, {**rnd, "emitted": [5, 6]}, {**footer, "output_ids": [5, 6]}])
    # A budget stop is left untouched: a trailing extra token still differs.
    budget = {**footer, "usage": {"finish_reason": "length", "generation_tokens": 2}}
    assert optiq_stopping_eos([header, {**rnd, "end": "budget"}, budget])[-1]["output_ids"] == [
        5,
        0,
    ]
