"""The subject checks (subjects/checks.py) against fake subjects with planted bugs.

Model-free: the "target" is a deterministic token sequence per prompt, the fake
subject a round-based speculative loop over it (gamma drafts, one rejection
per round at a fixed place) that honours EOS, stop ids and the budget and
reports its counters. Each planted bug must be caught by its check with a
first-divergence message; the faithful fake must pass every check, so a check
that cannot fail (or cannot pass) is caught.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from subjects import SUBJECTS, Mode, availability
from subjects.base import RoundReport, SubjectCase, SubjectRun, SubjectUnsupported, to_trace
from subjects.checks import (
    check_budget,
    check_counters,
    check_distribution,
    check_eos,
    check_identity,
    check_mlx_lm,
    check_stop,
    chi2_p_value,
    counter_problems,
    first_divergence,
    guarded,
)

EOS = 1


def _seq(prompt_id: str, n: int) -> list[int]:
    rng = random.Random(prompt_id)
    return [rng.randrange(2, 60) for _ in range(n)]


def plain(case: SubjectCase) -> list[int]:
    eos = {EOS} if case.eos_ids is None else set(case.eos_ids)
    out = []
    for t in _seq(case.prompt_id, case.max_tokens):
        if t in eos:
            break
        out.append(t)
    return out


class Fake:
    """A faithful round-based subject; ``bug`` plants one defect."""

    def __init__(self, bug: str | None = None) -> None:
        self.bug = bug

    def __call__(self, case: SubjectCase) -> SubjectRun:
        bug = self.bug
        eos = {EOS} if case.eos_ids is None else set(case.eos_ids)
        full = _seq(case.prompt_id, case.max_tokens + 20)
        if bug == "flip":
            full[3] = full[3] + 100
        if bug == "flip-last":  # the budget's last token
            full[case.max_tokens - 1] += 100
        if bug == "flip-last-short":  # one token short of plain, its own last token wrong
            full[case.max_tokens - 2] += 100
        stream: list[int] = []
        rounds: list[RoundReport] = []
        finish = "length"
        pos = 0
        while len(stream) < case.max_tokens:
            drafted = case.gamma
            accepted = min(drafted, 1 + len(rounds) % drafted)
            block = full[pos : pos + accepted + 1]
            if bug != "overrun":
                block = block[: case.max_tokens - len(stream)]
            emitted, ended = [], False
            for t in block:
                if t in eos:
                    if bug == "emit-eos":
                        emitted.append(t)
                    if bug != "past-eos":
                        ended = True
                        break
                    continue
                emitted.append(t)
                if t in case.stop_ids and bug != "ignore-stop":
                    ended = True
                    break
            stream += emitted
            committed = len(emitted) + (1 if bug == "counter-off" else 0)
            rounds.append(RoundReport(drafted, accepted if bug != "accept-gt-draft" else drafted + 1, committed))
            pos += len(block)
            if ended:
                finish = "stop"
                break
        if bug == "flip-last-short":
            stream, finish = stream[: case.max_tokens - 1], "stop"
        if bug == "wrong-finish":
            finish = "stop"
        gen_tokens = len(stream) + (1 if finish == "stop" and case.eos_ids != () else 0)
        if bug == "eos-twice":
            gen_tokens += 2
        return SubjectRun(stream=stream, finish_reason=finish, hooks=["fake"], rounds=rounds,
                          counters={"generation_tokens": gen_tokens, "rounds": len(rounds),
                                    "drafted": sum(r.drafted for r in rounds),
                                    "accepted": sum(r.accepted for r in rounds)})


CASES = [SubjectCase("t", "fake", prompt_id=p, max_tokens=24, gamma=3) for p in ("a", "b")]


def test_faithful_fake_passes_every_check() -> None:
    f = Fake()
    for res in (check_identity(f, plain, CASES), check_budget(f, plain, CASES), check_eos(f, plain, CASES),
                check_stop(f, plain, CASES), check_counters(f, CASES),
                check_mlx_lm(f, lambda c: plain(c), CASES)):
        assert res.status == "pass", res


@pytest.mark.parametrize("bug,check,needle,div", [
    ("flip", check_identity, "output token 3", {"index": 3, "subject": 140, "expected": 40}),
    ("flip-last", check_identity, "output token 23", {"index": 23}),
    ("flip-last-short", check_identity, "output token 22", {"index": 22}),
    ("overrun", check_budget, "tokens emitted", {"index": 1, "subject": 2, "expected": 1}),
    ("wrong-finish", check_budget, "finish_reason", {"subject": "stop", "expected": "length"}),
    ("emit-eos", check_eos, "emitted as the final token", {"index": 3, "subject": 40, "expected": None}),
    ("past-eos", check_eos, "output differs", {"index": 3, "subject": 24, "expected": 3}),
    ("eos-twice", check_eos, "counted more than once", {"subject": 6, "expected": 4}),
    ("ignore-stop", check_stop, "stop id", {"index": 6, "subject": 24, "expected": 6}),
])
def test_planted_bug_is_caught(bug: str, check: Callable, needle: str, div: dict) -> None:
    """The verdict (fail), the first divergent token and both values, then the message."""
    res = check(Fake(bug), plain, CASES)
    assert res.status == "fail", res
    assert res.divergence is not None and {k: res.divergence.get(k) for k in div} == div, res.divergence
    assert res.case is not None and SubjectCase.from_id(res.case).prompt_id == "a", res.case
    assert needle in res.detail, res.detail


def test_identity_divergence_at_the_last_token() -> None:
    """Each prompt's last token, alone, differs: the check must look at every token both
    produced (a range that stops one short, or a prefix check by length, passes this)."""
    for case in CASES:
        ref = plain(case)

        def last_wrong(c: SubjectCase, ref: list[int] = ref) -> SubjectRun:
            return SubjectRun(stream=[*ref[:-1], ref[-1] + 100], finish_reason="length", hooks=["fake"])

        res = check_identity(last_wrong, plain, [case])
        assert (res.status, res.case) == ("fail", case.case_id), res
        assert res.divergence == {"index": len(ref) - 1, "subject": ref[-1] + 100, "expected": ref[-1]}
        same = check_identity(lambda c, ref=ref: SubjectRun(stream=list(ref), finish_reason="length",
                                                          hooks=["fake"]), plain, [case])
        assert same.status == "pass", same


@pytest.mark.parametrize("bug,needle", [("counter-off", "committed"), ("accept-gt-draft", "outside 0..drafted")])
def test_planted_counter_bugs(bug: str, needle: str) -> None:
    res = check_counters(Fake(bug), CASES)
    assert (res.status, res.case) == ("fail", CASES[0].case_id), res
    assert res.divergence is not None and res.divergence["problems"][0].startswith("round 0: "), res
    assert needle in res.detail, res


def test_mlx_lm_round_difference_is_caught() -> None:
    """Same tokens, different rounds (drafts or acceptance) is still a difference from mlx-lm."""
    case = CASES[0]
    run = SubjectRun(stream=[5, 6, 7, 8], finish_reason="length", hooks=["fake"],
                     rounds=[RoundReport(2, 2, 3, drafts=[5, 6]), RoundReport(2, 0, 1, drafts=[9, 9])])
    ref_rounds = [([5, 6], 2, [5, 6, 7]), ([8, 3], 1, [8])]
    res = check_mlx_lm(lambda c: run, lambda c: [5, 6, 7, 8], [case], rounds=lambda c: ref_rounds)
    assert res.status == "fail" and res.divergence == {"index": 1, "subject": [9, 9], "expected": [8, 3]}
    assert "round 1 drafts: subject [9, 9] vs mlx-lm [8, 3]" in res.detail
    same = [([5, 6], 2, [5, 6, 7]), ([9, 9], 0, [8])]
    ok = check_mlx_lm(lambda c: run, lambda c: [5, 6, 7, 8], [case], rounds=lambda c: same)
    assert ok.status == "pass" and "round for round" in ok.detail


def test_mlx_lm_difference_is_caught() -> None:
    res = check_mlx_lm(Fake(), lambda c: plain(c)[:-1] + [999], CASES)  # the last token only
    assert res.status == "fail" and res.divergence is not None, res
    assert (res.divergence["index"], res.divergence["expected"]) == (23, 999), res.divergence
    assert "vs mlx-lm 999" in res.detail
    assert check_mlx_lm(Fake(), None, CASES).status == "unsupported"


def test_unsupported_and_crash_are_reported() -> None:
    def refuses(case: SubjectCase) -> SubjectRun:
        raise SubjectUnsupported("no stop ids here")

    assert check_stop(refuses, plain, CASES).status == "unsupported"

    def crashes(case: SubjectCase) -> SubjectRun:
        raise IndexError("list index out of range")

    res = guarded("identity", lambda: check_identity(crashes, plain, CASES))
    assert res.status == "fail" and "IndexError: list index out of range" in res.detail
    assert res.case == CASES[0].case_id  # the crash keeps its case: the reproduction names it


def _sampler(probs: dict[tuple[int, int], float]) -> Callable[[SubjectCase], list[int]]:
    keys, weights = list(probs), list(probs.values())

    def draw(case: SubjectCase) -> list[int]:
        return list(random.Random(case.seed * 7919 + 13).choices(keys, weights)[0])

    return draw


P = {(2, 3): 0.4, (2, 4): 0.2, (5, 3): 0.25, (5, 6): 0.15}
Q = {(2, 3): 0.15, (2, 4): 0.2, (5, 3): 0.25, (5, 6): 0.4}


def _as_subject(draw: Callable[[SubjectCase], list[int]]) -> Callable[[SubjectCase], SubjectRun]:
    return lambda c: SubjectRun(stream=draw(c), finish_reason="length", hooks=["fake"])


def test_distribution_passes_same_law_and_catches_a_biased_sampler() -> None:
    case = SubjectCase("t", "fake", max_tokens=2, temperature=0.7, top_k=5)
    same = check_distribution(_as_subject(_sampler(P)), _sampler(P), case)
    assert same.status == "pass", same
    biased = check_distribution(_as_subject(_sampler(Q)), _sampler(P), case)
    assert biased.status == "fail" and "p=" in biased.detail, biased
    assert check_distribution(_as_subject(_sampler(P)), None, None).status == "unsupported"


def test_chi2_pools_small_cells() -> None:
    from collections import Counter

    assert chi2_p_value(Counter({(1,): 50, (2,): 50}), Counter({(1,): 50, (2,): 50})) > 0.9
    assert chi2_p_value(Counter({(1,): 90, (2,): 10}), Counter({(1,): 10, (2,): 90})) < 1e-6


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1


def test_counter_problems_name_each_disagreement() -> None:
    run = SubjectRun(stream=[5, 6, 7], finish_reason="length", hooks=[],
                     rounds=[RoundReport(2, 1, 2), RoundReport(2, 0, 1)], counters={"drafted": 5, "emitted": 4})
    probs = counter_problems(run)
    assert any("drafted=5" in p for p in probs) and any("emitted=4" in p for p in probs)
    run.extra["reported_ids"] = [5, 6, 8]
    assert any("own record of its output differs from its stream at token 2" in p for p in counter_problems(run))
    run.extra = {}
    run.prefill_tokens = 1
    run.rounds = [RoundReport(2, 1, 2)]
    run.counters = {}
    assert counter_problems(run) == []


def test_case_id_round_trip_and_bad_ids() -> None:
    c = SubjectCase("qwen3", "dspark", "x", "rnd-00", 7, 3, 0.7, 5, 11, (5,), (9,))
    assert SubjectCase.from_id(c.case_id) == c
    assert SubjectCase.from_id(c.with_(eos_ids=()).case_id).eos_ids == ()
    with pytest.raises(ValueError, match="expected MODE:TARGET"):
        SubjectCase.from_id("qwen3/x")


def test_trace_is_valid_for_a_faithful_run_and_flags_an_emitted_eos() -> None:
    from traces.validate import validate_records

    case = SubjectCase("t", "fake", prompt_id="a", max_tokens=6)
    ident = {"path": "t", "weights_sha256": None, "config_sha256": None}
    run = Fake()(case.with_(eos_ids=()))
    recs = to_trace({"name": "fake", "package": "fake", "version": "0"}, case, run, [3, 4], [EOS], ident, None)
    assert recs[0]["runner"]["hooks"] == ["fake"] and recs[0]["runner"]["level"] == "token"
    assert not validate_records(enumerate(recs, 1)), validate_records(enumerate(recs, 1))
    bad = SubjectRun(stream=[7, EOS], finish_reason="stop", hooks=["fake"])
    recs = to_trace({"name": "fake", "package": "fake", "version": "0"}, case, bad, [3, 4], [EOS], ident, None)
    errs = validate_records(enumerate(recs, 1))
    assert errs and any("EOS" in str(e) or "eos" in str(e) for e in errs), errs


def test_grade_mode_and_scoreboard_from_fakes(tmp_path: Path) -> None:
    import json

    from reports.scoreboard import failures, load_results, write_scoreboard
    from specparity.grading.engines import grade_mode

    mode = Mode(targets=("t",), unsupported={"stop": "no stop ids"})
    good = grade_mode("fake", Fake(), "fake", mode, plain_ref=plain, sample_ref=plain, mlx_lm_ref=plain)
    bad = grade_mode("fake", Fake("overrun"), "fake", mode, plain_ref=plain, sample_ref=plain, mlx_lm_ref=plain)
    assert good["identity"].status == "pass" and good["stop"].status == "unsupported"
    assert bad["budget"].status == "fail"
    doc = {"engine": "mlx-dspark", "version": "0", "available": True, "tox_env": "subject-mlx-dspark",
           "platform": {"device": "cpu", "mlx": "x"},
           "modes": {"good": {"note": "", "targets": ["t"], "checks": {k: v.to_dict() for k, v in good.items()}},
                     "bad": {"note": "", "targets": ["t"], "checks": {k: v.to_dict() for k, v in bad.items()}}}}
    (tmp_path / "mlx-dspark.json").write_text(json.dumps(doc))
    (tmp_path / "nunspark.json").write_text(json.dumps({"engine": "nunspark", "available": False, "modes": {},
                                                        "reason": "ImportError: boom", "tox_env": "x"}))
    md, html = write_scoreboard(tmp_path)
    text = md.read_text()
    assert "**FAIL**" in text and "n/a: no stop ids" in text and "ImportError: boom" in text
    fails = failures(load_results(tmp_path))
    assert [f["check"] for f in fails] == ["budget"]
    assert "python -m specparity.grading.engines mlx-dspark --case" in fails[0]["reproduce"]
    assert "class='fail'" in html.read_text()


def test_registry_names_every_package_and_reports_missing_ones() -> None:
    assert set(SUBJECTS) == {"mlx-dspark", "dspark-mlx", "dflash-mlx", "dfly-mlx", "mtplx", "mlx-lm-broomva",
                             "nunspark", "nunspark-mlxlm031", "mlx-flash", "flyto-mlx-mtp"}
    for name in SUBJECTS:
        ok, why = availability(name)
        assert ok or SUBJECTS[name].tox_env in why or "failed" in why, (name, why)


def runner_of(row: dict[str, Any]) -> str:
    """The registry name of a scoreboard row's engine (what known entries are keyed by)."""
    return str(row["engine"])


def test_every_committed_failure_has_a_known_subject_entry() -> None:
    """Each failing check of the committed scoreboard is a `subject` entry with its reproduction."""
    import tomllib

    from reports.scoreboard import failures, load_results

    root = Path(__file__).resolve().parents[1]
    docs = load_results(root / "docs" / "scoreboard")
    entries = [e for e in tomllib.loads((root / "traces" / "known_divergences.toml").read_text())["entry"]
               if e["kind"] == "subject"]
    missing = []
    for f in failures(docs):
        hit = [e for e in entries if e["runner"] == runner_of(f) and f["check"] in e["checks"]
               and f["mode"] in e["modes"]]
        if not hit:
            missing.append(f"{f['engine']} {f['mode']}/{f['check']}: {f['detail']}")
        for e in hit:
            assert e["reproduce"] and e["reason"].strip() and e["targets"], e["id"]
    assert not missing, "failures without a [[entry]] kind = 'subject' in traces/known_divergences.toml:\n" + \
        "\n".join(missing)
    for e in entries:  # and no stale entry: each still matches a committed failure
        assert any(runner_of(f) == e["runner"] and f["check"] in e["checks"] and f["mode"] in e["modes"]
                   for f in failures(docs)), f"{e['id']} matches no failure of docs/scoreboard"


def test_a_check_stops_at_its_first_failure_and_plans_no_further_case() -> None:
    """The shared per-case loop: the reference that plans a case runs just before the subject's run
    of it, and nothing is planned or run after the first failure."""
    calls: list[tuple[str, int]] = []

    def counted(case: SubjectCase) -> list[int]:
        calls.append((case.prompt_id, case.max_tokens))
        return plain(case)

    res = check_budget(Fake("overrun"), counted, CASES)
    assert (res.status, res.cases_run, calls) == ("fail", 1, [("a", 1)]), (res, calls)


def test_a_subject_declining_a_later_case_is_unsupported_with_the_runs_so_far() -> None:
    f = Fake()

    def declines_b(case: SubjectCase) -> SubjectRun:
        if case.prompt_id == "b":
            raise SubjectUnsupported("no prompt b here")
        return f(case)

    for res in (check_identity(declines_b, plain, CASES), check_eos(declines_b, plain, CASES),
                check_counters(declines_b, CASES)):
        assert (res.status, res.detail, res.cases_run) == ("unsupported", "no prompt b here", 1), res
    assert check_counters(f, []).detail == "the engine exposes no acceptance counters or per-round reports"
    assert check_identity(f, plain, []).detail == "no case"
