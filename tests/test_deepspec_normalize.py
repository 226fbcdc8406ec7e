"""DeepSpec's conventions as named normalizations (``traces/normalize.py``), model-free.

Each of the four applies to exactly its pattern (DeepSpec ``base_evaluator.py``
at afdfa7c: the extra verify round at exactly ``max_new_tokens``, counters
that count discarded tokens, the unused next token after an accepted EOS, the
proposal length cut to the EOS position + 1) and refuses anything else, so a
DeepSpec behaviour outside them fails the oracle run instead of being dropped.
Also: the DeepSpec commit is a golden input, and the runner's code digest
covers the shared oracle modules and the normalizations.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest

from traces.normalize import NotApplicable, apply, deepspec_log

EOS = 281


def _round(drafts: list[int], accepted: int, nxt: int, stop: bool = False, pl: int | None = None) -> dict:
    committed = [*drafts[:accepted], nxt]
    return {"drafts": drafts, "accepted": accepted, "next": nxt, "committed": committed, "stop": stop,
            "proposal_length": len(drafts) if pl is None else pl}


def _log(rounds: list[dict], output: list[int], max_tokens: int, acc: list[int] | None = None) -> dict[str, Any]:
    if acc is None:
        acc = [r["accepted"] if r["stop"] else r["accepted"] + 1 for r in rounds]
    return {
        "max_tokens": max_tokens, "eos_ids": [1, EOS], "rounds": rounds, "output_ids": output,
        "counters": {"verify_count": len(rounds), "committed_total": sum(acc), "acceptance_lengths": acc,
                     "proposal_lengths": [r["proposal_length"] for r in rounds],
                     "accepted_draft_lengths": [r["accepted"] for r in rounds]},
    }


def budget_log() -> dict[str, Any]:
    """max 6: prefill token 5, round 0 all-accept (4 tokens), round 1 rejects (1 token) -> exactly 6
    tokens, so DeepSpec verifies once more (round 2) and trims its 2 tokens away."""
    rounds = [_round([10, 11, 12], 3, 13), _round([14, 15, 16], 0, 20), _round([21, 22, 23], 1, 24)]
    return _log(rounds, [5, 10, 11, 12, 13, 20], 6)


def eos_log() -> dict[str, Any]:
    """An EOS accepted as draft 1 of 3: DeepSpec stops, committed ends with the unused next token 99,
    proposal length 2 (EOS position + 1) though 3 drafts were verified."""
    return _log([_round([10, EOS, 12], 2, 99, stop=True, pl=2)], [5, 10, EOS], 14)


def test_extra_verify_round_and_discarded_counters_are_named() -> None:
    out = deepspec_log(budget_log())
    assert out["applied"] == ["deepspec-extra-verify-round", "deepspec-counters-count-discarded"]
    assert len(out["rounds"]) == 2 and len(out["discarded_rounds"]) == 1
    c = out["counters"]
    assert (c["verify_count"], c["committed_total"], c["discarded_tokens"]) == (2, 5, 2), c


def test_over_budget_tail_alone_is_a_counter_mapping() -> None:
    """The last round commits past the budget (whole block drafted): no extra round, counters mapped."""
    log = _log([_round([10, 11, 12], 3, 13)], [5, 10, 11], 3)
    out = deepspec_log(log)
    assert out["applied"] == ["deepspec-counters-count-discarded"], out["applied"]
    assert out["counters"]["committed_total"] == 2 and out["counters"]["discarded_tokens"] == 2


def test_accepted_eos_next_token_and_proposal_cut_are_named() -> None:
    out = deepspec_log(eos_log())
    assert out["applied"] == ["deepspec-eos-unused-next-token", "deepspec-eos-proposal-cut"]
    assert out["rounds"][0]["committed"] == [10, EOS]
    assert out["counters"]["proposal_lengths"] == [3]
    assert out["counters"]["committed_total"] == 2


def test_no_pattern_no_change() -> None:
    log = _log([_round([10, 11], 1, 30)], [5, 10, 30], 8)
    out = deepspec_log(log)
    assert out["applied"] == [] and out["rounds"] == log["rounds"] and out["counters"] == log["counters"]
    for name in ("deepspec-extra-verify-round", "deepspec-eos-unused-next-token"):
        assert apply(name, log)["rounds"] == log["rounds"]


def _planted() -> list[tuple[str, dict[str, Any]]]:
    """DeepSpec logs with one behaviour none of the four normalizations describes."""
    out = []
    two_extra = budget_log()
    two_extra["rounds"].append(_round([31, 32, 33], 0, 34))
    two_extra["counters"] = _log(two_extra["rounds"], [], 6)["counters"]
    out.append(("two rounds after the budget", two_extra))
    early = budget_log()
    early["max_tokens"] = 5  # the extra round would start one token past the budget
    early["output_ids"] = early["output_ids"][:5]
    out.append(("a verify round past the budget, not at it", early))
    out.append(("the last round alone, past the budget", past_budget_log()))
    miscount = budget_log()
    miscount["counters"]["verify_count"] += 1
    out.append(("verify_count counts a round nobody recorded", miscount))
    total = budget_log()
    total["counters"]["acceptance_lengths"][0] += 1
    total["counters"]["committed_total"] += 1
    out.append(("committed_total counts a token no round committed", total))
    no_next = eos_log()
    no_next["rounds"][0]["committed"] = [10, EOS]
    out.append(("stop round without the unused next token", no_next))
    late_eos = eos_log()
    late_eos["rounds"][0] = _round([EOS, 10, 12], 2, 99, stop=True, pl=2)
    out.append(("stop round that accepted past its first EOS", late_eos))
    cut = eos_log()
    cut["rounds"][0]["proposal_length"] = 3
    out.append(("stop round whose proposal length is not the EOS position + 1", cut))
    eos_no_stop = _log([_round([10, EOS, 12], 2, 99)], [5, 10, EOS], 14)
    out.append(("an accepted EOS without a stop", eos_no_stop))
    short = _log([_round([10, 11, 12], 1, 40, pl=2)], [5, 10, 40], 14)
    out.append(("a proposal length cut without a stop", short))
    return out


def past_budget_log() -> dict[str, Any]:
    """The LAST round starts past the budget, alone: max 4, prefill token + round 0 (4 tokens)
    = 5 tokens before round 1. DeepSpec's loop (``while start < max_length``) never verifies
    there, so this is no extra round to discard. The output is within the budget and the
    counters are consistent, so only the round's start can refuse it."""
    rounds = [_round([10, 11, 12], 3, 13), _round([14, 15, 16], 0, 20)]
    return _log(rounds, [5, 10, 11, 12], 4)


def test_last_round_past_the_budget_is_refused_not_discarded() -> None:
    from traces.normalize import _produced_before, deepspec_extra_verify_round

    log = past_budget_log()
    before = _produced_before(log["rounds"])
    assert before == [1, 5] and before[-1] > log["max_tokens"]  # last, and past (not at) the budget
    # A check of "the last round" alone, or of "starts at or past the budget", would discard it.
    with pytest.raises(NotApplicable, match=r"deepspec round 1 starts after 5 tokens \(budget 4\)"):
        deepspec_extra_verify_round(log)
    with pytest.raises(NotApplicable, match="deepspec round 1"):
        deepspec_log(log)
    at_budget = copy.deepcopy(log)
    at_budget["max_tokens"] = 5  # the same round at exactly the budget is the extra round
    at_budget["output_ids"] = [5, 10, 11, 12, 13]
    out = deepspec_extra_verify_round(at_budget)
    assert out["applied"] == ["deepspec-extra-verify-round"] and len(out["discarded_rounds"]) == 1


@pytest.mark.parametrize(("why", "log"), _planted(), ids=[w for w, _ in _planted()])
def test_planted_deepspec_behaviour_is_refused(why: str, log: dict[str, Any]) -> None:
    with pytest.raises(NotApplicable, match="deepspec"):
        deepspec_log(log)


def test_oracle_maps_and_checks_deepspec_counters() -> None:
    """``oracles.deepspec``: the recorded rounds + DeepSpec's sample counters go through the four
    normalizations and must equal the rebuilt trace's counters (torch-free part of ``run``)."""
    from oracles.deepspec import check_counters, deepspec_log_of

    log = budget_log()
    raw = copy.deepcopy(log["rounds"])
    c = log["counters"]
    sample = SimpleNamespace(acceptance_lengths=c["acceptance_lengths"], proposal_lengths=c["proposal_lengths"],
                             accepted_draft_lengths=c["accepted_draft_lengths"], verify_count=c["verify_count"])
    out = deepspec_log_of(raw, sample, 6, [1, EOS], log["output_ids"])
    rebuilt = [{"type": "round"}, {"type": "round"}]
    check_counters(out, rebuilt, generation_tokens=6)
    with pytest.raises(RuntimeError, match="verify_count"):
        check_counters(out, rebuilt[:1], generation_tokens=6)
    with pytest.raises(RuntimeError, match="committed_total"):
        check_counters(out, rebuilt, generation_tokens=7)
    sample.verify_count += 1  # planted: DeepSpec counted a verify the recorder never saw
    with pytest.raises(NotApplicable):
        deepspec_log_of(raw, sample, 6, [1, EOS], log["output_ids"])


# ------------------------------------------------------------------ golden inputs


def _checkout(tmp_path, commit: str):  # noqa: ANN001, ANN202
    root = tmp_path / commit
    (root / "deepspec" / "eval" / "dspark").mkdir(parents=True)
    (root / "deepspec" / "eval" / "dspark" / "evaluator.py").write_text("")
    (root / ".deepspec-commit").write_text(commit + "\n")
    return root


def test_deepspec_commit_is_a_golden_input(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from specparity.cases.golden_cases import deepspec_cases
    from specparity.goldens.manifest import InputsContext, check_goldens, golden_key

    case = deepspec_cases()[0]
    key = golden_key("deepspec", case)
    monkeypatch.delenv("DEEPSPEC_PATH", raising=False)
    assert InputsContext().inputs("deepspec", case)["runner"]["commit"] is None
    unknown = {p.key: p for p in check_goldens(runners=["deepspec"], keys=[key])}
    assert not any("commit" in r for p in unknown.values() for r in p.reasons), unknown
    monkeypatch.setenv("DEEPSPEC_PATH", str(_checkout(tmp_path, "0123456789abcdef")))
    assert InputsContext().inputs("deepspec", case)["runner"]["commit"] == "0123456789abcdef"
    stale = {p.key: p for p in check_goldens(runners=["deepspec"], keys=[key])}
    assert key in stale and any("deepspec commit" in r and "0123456789ab" in r for r in stale[key].reasons), stale


def test_deepspec_code_digest_covers_shared_oracle_code() -> None:
    from specparity.goldens.manifest import _module_files
    from specparity.runners.registry import golden_sets

    info = golden_sets()["deepspec"]
    files = {rel for m in info.code_modules for rel in _module_files(m, info.code_exclude)}
    for rel in ("oracles/__init__.py", "oracles/recording.py", "oracles/deepspec.py", "traces/normalize.py"):
        assert rel in files, f"deepspec code digest misses {rel}: {sorted(files)}"


@pytest.mark.oracle
def test_every_deepspec_normalization_fires_on_the_golden_cases() -> None:
    """Live (``DEEPSPEC_PATH=… tox -e deepspec -- tests/test_deepspec_normalize.py``): DeepSpec on the
    golden cases needs each of the four normalizations somewhere and nothing else (no refusal)."""
    from collections import Counter

    from specparity.runners.registry import availability
    from traces.normalize import DEEPSPEC_ORDER

    ok, why = availability("deepspec")
    if not ok:
        pytest.skip(f"oracle deepspec unavailable: {why}")
    from oracles import deepspec
    from specparity.cases.golden_cases import deepspec_cases
    from specparity.runners import run_case

    seen: Counter[str] = Counter()
    for case in deepspec_cases():
        run_case("deepspec", case)
        seen.update(deepspec.LAST_APPLIED)
    assert set(seen) == set(DEEPSPEC_ORDER), seen
