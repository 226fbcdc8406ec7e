"""Tests for traces.diff: first divergence, levels and numerics/logic classification."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces.diff import (
    Divergence,
    Flip,
    WitnessVerdict,
    diff_main,
    diff_traces,
    eps_class,
    token_origin,
)
from traces.io import Record, Trace, write_trace
from traces.testing import clone, make_plain_trace, make_spec_trace
from traces.validate import validate_trace

# Output: 5 6 8 | 9 3 | 4 | 11 | <eos>
ROUNDS: list[Any] = [
    (None, [5, 6, 7], [5, 6, 8], 2, [5, 6, 8], "correction"),
    (None, [9], [9, 3], 1, [9, 3], "bonus"),
    (None, [4, 0], [4, 4], 1, [4, 4], "correction"),
    (None, [], [11], 0, [11], "bonus"),
    (None, [2, 2], [2], 0, [], "eos"),
]
OUTPUT = [5, 6, 8, 9, 3, 4, 4, 11]


def _spec(**kw: Any) -> Trace:
    return make_spec_trace(ROUNDS, **kw)


def _mutate(trace: Trace, fn: Any) -> Trace:
    recs = copy.deepcopy(trace.records())
    fn(recs)
    return Trace.from_records(recs)


def _round(recs: list[Record], i: int) -> Record:
    return [r for r in recs if r["type"] == "round"][i]


def test_fixture_is_valid() -> None:
    t = _spec()
    assert validate_trace(t) == []
    assert t.output_ids == OUTPUT
    assert validate_trace(make_plain_trace(OUTPUT)) == []


@pytest.mark.parametrize("level", ["round", "tokens", "acceptance"])
def test_identical(level: str) -> None:
    assert diff_traces(_spec(), clone(_spec()), level=level) is None


def test_time_margins_platform_never_compared() -> None:
    def noise(recs: list[Record]) -> None:
        recs[0]["platform"]["device"] = "gpu"
        recs[0]["runner"]["name"] = "other"
        recs[0]["target"]["path"] = "/elsewhere"
        recs[-1]["wall_s"] = 3.0
        for r in recs:
            if r["type"] == "round":
                r["time_s"] = 0.5
                r["margins"] = [m + 1.0 for m in r["margins"]]
                r["confidence"] = [0.5] * len(r["drafts"])

    for level in ("round", "tokens", "acceptance"):
        assert diff_traces(_spec(), _mutate(_spec(), noise), level=level) is None


def test_wrong_trim_feed_round_2() -> None:
    # Round 1 accepted its only draft, so round 2 must re-feed [last draft, bonus];
    # a drafter trimmed one token too far would be re-fed only [bonus].
    assert _round(_spec().records(), 2)["feed"] == [9, 3]
    bad = _mutate(_spec(), lambda rs: _round(rs, 2).__setitem__("feed", [3]))
    assert validate_trace(bad) == []
    d = diff_traces(_spec(), bad)
    assert d is not None
    assert (d.where, d.field, d.klass, d.margin) == ("round 2", "feed", "logic", None)
    assert (d.value_a, d.value_b) == ([9, 3], [3])
    assert "round 2" in d.message and "'feed'" in d.message and "logic" in d.message


def test_wrong_refeed_with_knife_edge_sample_is_still_logic() -> None:
    def refeed(rs: list[Record]) -> None:
        r = _round(rs, 1)
        r["feed"] = [5, 6, 8, 9]  # re-fed tokens the drafter already had
        r["samples"] = [9, 7]
        r["margins"] = [0.0, 0.0]

    d = diff_traces(_spec(), _mutate(_spec(), refeed))
    assert d is not None
    assert (d.where, d.field, d.klass) == ("round 1", "feed", "logic")


def test_leaked_eos_in_emitted() -> None:
    leak = _mutate(_spec(), lambda rs: _round(rs, 4).__setitem__("emitted", [2]))
    d = diff_traces(_spec(), leak)
    assert d is not None
    assert (d.where, d.field, d.klass, d.value_b) == ("round 4", "emitted", "logic", [2])
    t = diff_traces(_spec(), leak, level="tokens")
    assert t is None  # footer untouched: only visible at round level


def _flip(margin: float) -> Trace:
    # Round 2: the target sample at window position 1 flips 4 -> 0 (accepting the draft).
    rounds = list(ROUNDS)
    rounds[2] = (None, [4, 0], [4, 0, 7], 2, [4, 0, 7], "bonus")
    return make_spec_trace(rounds, margins={(2, 1): margin})


def test_flipped_sample_knife_edge_is_numerics() -> None:
    a = _spec(margins={(2, 1): 2e-4})
    d = diff_traces(a, _flip(2e-4))
    assert d is not None
    assert (d.where, d.field, d.klass, d.position) == ("round 2", "samples", "numerics", 1)
    assert d.margin == pytest.approx(2e-4)
    assert (d.basis, d.label) == ("eps", "numerics?")
    assert "numerics? (eps-based" in d.message and "0.0002" in d.message


def test_flipped_sample_tie_free_is_logic() -> None:
    d = diff_traces(_spec(), _flip(5.0))
    assert d is not None
    assert (d.where, d.field, d.klass, d.position) == ("round 2", "samples", "logic", 1)
    assert d.margin == pytest.approx(5.0)


def test_eps_rule_needs_both_margins_within_noise_and_eps_configurable() -> None:
    # Noise of at most eps per logit swaps two greedy picks only if margin_a + margin_b <= 2 eps:
    # one run's knife-edge (0.01) says nothing when the other run was decisive (0.5).
    a = _spec(margins={(2, 1): 0.5})
    b = _flip(0.01)
    d = diff_traces(a, b)
    assert d is not None and d.margin == pytest.approx(0.01) and d.klass == "logic"
    assert diff_traces(a, b, eps=0.05).klass == "logic"  # type: ignore[union-attr]
    d2 = diff_traces(a, b, eps=0.3)
    assert d2 is not None and d2.klass == "numerics" and d2.eps == 0.3 and d2.label == "numerics?"
    assert "0.5 + 0.01 <= 2 x eps 0.3" in d2.message


def test_eps_class_bound() -> None:
    assert eps_class(4e-4, 5e-4, 5e-4) == "numerics"
    assert eps_class(2.8e-4, 0.55, 1e-3) == "logic"  # issue 13's gemma3 engine vs mlx-lm margins
    assert eps_class(None, 1e-6, 1.0) == "logic"


def test_drafts_differ_samples_agree_is_logic() -> None:
    def fn(rs: list[Record]) -> None:
        r = _round(rs, 0)
        r["drafts"] = [5, 6, 9]
        r["window"] = [99, 5, 6, 9]

    d = diff_traces(_spec(), _mutate(_spec(), fn))
    assert d is not None
    assert (d.where, d.field, d.klass, d.margin) == ("round 0", "drafts", "logic", None)


def test_different_round_counts() -> None:
    short = make_spec_trace(ROUNDS[:3] + [(None, [11], [11, 2], 1, [11], "eos")])
    d = diff_traces(_spec(), short)
    assert d is not None and d.where == "round 3" and d.klass == "logic"
    extra = make_spec_trace(ROUNDS[:4] + [(None, [], [12], 0, [12], "bonus"), ROUNDS[4]])
    d = diff_traces(_spec(), extra)
    assert d is not None and d.where == "round 4"
    # Pure count difference: a strict prefix with the same records.
    prefix = _mutate(_spec(), lambda rs: rs.pop(-2))
    d = diff_traces(_spec(), prefix)
    assert d is not None
    assert (d.where, d.field, d.value_a, d.value_b, d.klass) == ("round 4", "rounds", 5, 4, "logic")


def test_prefill_and_digests() -> None:
    d = diff_traces(_spec(), _mutate(_spec(), lambda rs: rs[1].__setitem__("target_tokens", [1, 17])))
    assert d is not None and (d.where, d.field) == ("prefill", "target_tokens")
    dig = {"combined": "aa", "layers": ["a"]}
    other = {"combined": "bb", "layers": ["b"]}
    a = _mutate(_spec(), lambda rs: _round(rs, 1).__setitem__("target_cache_digest", dig))
    # one side null: not compared
    assert diff_traces(a, _spec()) is None
    b = _mutate(_spec(), lambda rs: _round(rs, 1).__setitem__("target_cache_digest", other))
    d = diff_traces(a, b)
    assert d is not None and (d.where, d.field, d.klass) == ("round 1", "target_cache_digest", "logic")


def test_footer_counters_round_and_acceptance_levels() -> None:
    bad = _mutate(_spec(), lambda rs: rs[-1]["speculation"].__setitem__("accepted", 99))
    for level in ("round", "acceptance"):
        d = diff_traces(_spec(), bad, level=level)
        assert d is not None
        assert (d.where, d.field, d.value_b, d.klass) == ("footer", "speculation.accepted", 99, "logic")
    assert diff_traces(_spec(), bad, level="tokens") is None
    plain = make_plain_trace(OUTPUT)
    d = diff_traces(_spec(), plain, level="acceptance")
    assert d is not None and d.field == "speculation"
    assert diff_traces(plain, clone(plain), level="acceptance") is None


def test_tokens_spec_vs_plain_identity() -> None:
    assert diff_traces(_spec(), make_plain_trace(OUTPUT), level="tokens") is None
    d = diff_traces(_spec(), make_plain_trace(OUTPUT), level="round")
    assert d is not None  # different structure at the strict level


def test_tokens_spec_vs_plain_divergence_numerics_and_logic() -> None:
    # Output token 6 is round 2 emitted[1] (window position 1).
    spec = _spec(margins={(2, 1): 3e-4})
    flipped = OUTPUT[:6] + [7, 11]
    plain = make_plain_trace(flipped, margins={6: 2e-4})
    d = diff_traces(spec, plain, level="tokens")
    assert d is not None
    assert (d.where, d.field, d.value_a, d.value_b, d.position) == ("output token 6", "output_ids", 4, 7, 6)
    assert d.klass == "numerics" and d.margin == pytest.approx(2e-4)
    assert "round 2 window position 1" in d.message and "plain 6" in d.message
    assert d.flip is not None and (d.flip.a.record, d.flip.a.position, d.flip.a.token) == ("round 2", 1, 4)
    assert (d.flip.b.record, d.flip.b.position, d.flip.b.token, d.flip.output_index) == ("plain 6", None, 7, 6)
    # One side on a knife-edge, the other decisive (issue 13's gemma3 pattern): not arithmetic.
    decisive = make_plain_trace(flipped, margins={6: 0.9})
    d = diff_traces(spec, decisive, level="tokens")
    assert d is not None and d.klass == "logic" and d.label == "logic?" and d.margin == pytest.approx(3e-4)


def test_tokens_length_difference_uses_eos_sample_margin() -> None:
    # spec ends on EOS after 8 tokens (EOS sample in round 4, window pos 0); plain keeps going.
    spec = _spec(margins={(4, 0): 1e-5})
    plain = make_plain_trace([*OUTPUT, 13], margins={8: 1e-4})
    d = diff_traces(spec, plain, level="tokens")
    assert d is not None
    assert (d.where, d.value_a, d.value_b, d.klass) == ("output token 8", None, 13, "numerics")
    assert d.flip is not None and (d.flip.a.token, d.flip.b.token) == (2, 13)  # the EOS sample vs 13
    budget = make_plain_trace(OUTPUT[:5], end="budget")
    d = diff_traces(_spec(), budget, level="tokens")
    assert d is not None and d.where == "output token 5" and d.margin is None and d.klass == "logic"
    assert d.basis == "structural" and d.flip is None


def test_tokens_usage_difference() -> None:
    bad = _mutate(_spec(), lambda rs: rs[-1]["usage"].__setitem__("finish_reason", "length"))
    d = diff_traces(_spec(), bad, level="tokens")
    assert d is not None and (d.where, d.field, d.klass) == ("footer", "usage.finish_reason", "logic")


def test_token_origin() -> None:
    origin = token_origin(_spec(margins={(1, 1): 0.25}))
    assert len(origin) == len(OUTPUT) + 1
    assert origin[4] == ("round 1", 1, 0.25)
    assert origin[-1] == ("round 4", 0, 5.0)


def test_bad_level() -> None:
    with pytest.raises(ValueError):
        diff_traces(_spec(), _spec(), level="bytes")


def test_divergence_fields() -> None:
    d = diff_traces(_spec(), _flip(5.0))
    assert isinstance(d, Divergence)
    assert d.level == "round"
    assert len(d.message.splitlines()) >= 4


def test_diff_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_trace(a, _spec().records())
    write_trace(b, _flip(5.0).records())
    write_trace(c, make_plain_trace(OUTPUT).records())
    assert diff_main([str(a), str(a)]) == 0
    assert capsys.readouterr().out.strip() == "identical at level round"
    assert diff_main([str(a), str(c), "--level", "tokens"]) == 0
    assert diff_main([str(a), str(b), "--eps", "0.01"]) == 1
    out = capsys.readouterr().out
    assert "round 2" in out and "samples" in out
    assert diff_main([str(a), str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    (tmp_path / "junk.jsonl").write_text("{not json\n")
    assert diff_main([str(a), str(tmp_path / "junk.jsonl")]) == 2
    assert diff_main([str(a)]) == 2
    assert diff_main([str(a), str(b), "--level", "bytes"]) == 2
    assert diff_main([str(a), str(b), "--eps", "-1"]) == 2


# --- the witness callback --------------------------------------------------------------


class _Recorder:
    def __init__(self, verdict: WitnessVerdict | None = None, error: Exception | None = None) -> None:
        self.calls: list[Flip] = []
        self.verdict, self.error = verdict, error

    def __call__(self, a: Trace, b: Trace, flip: Flip) -> WitnessVerdict | None:
        self.calls.append(flip)
        if self.error is not None:
            raise self.error
        return self.verdict


def test_witness_decides_a_flip_and_its_evidence_is_printed() -> None:
    a = _spec(margins={(2, 1): 5.0})  # margins say logic; the witness says otherwise
    w = _Recorder(WitnessVerdict("numerics", "each path reproduces its token",
                                 ("a round 2 pos 1: top-2 [4: 1.0, 0: 0.99]",), {"k": 1}))
    d = diff_traces(a, _flip(5.0), witness=w)
    assert d is not None and (d.klass, d.basis, d.label) == ("numerics", "witness", "numerics")
    assert len(w.calls) == 1
    flip = w.calls[0]
    assert (flip.output_index, flip.a.event, flip.a.position, flip.a.token, flip.b.token) == (None, 2, 1, 4, 0)
    assert flip.a.margin == 5.0
    assert "class: numerics (witness: each path reproduces its token)" in d.message
    assert "top-2 [4: 1.0, 0: 0.99]" in d.message
    assert d.to_dict()["witness"] == {"class": "numerics", "reason": "each path reproduces its token", "k": 1}
    # and a logic verdict overrides knife-edge margins
    w2 = _Recorder(WitnessVerdict("logic", "b's path does not give 0"))
    d2 = diff_traces(_spec(margins={(2, 1): 1e-6}), _flip(1e-6), witness=w2)
    assert d2 is not None and (d2.klass, d2.basis) == ("logic", "witness")


def test_witness_that_cannot_judge_or_fails_falls_back_to_eps_labelled() -> None:
    d = diff_traces(_spec(margins={(2, 1): 2e-4}), _flip(2e-4), witness=_Recorder(None))
    assert d is not None and (d.klass, d.basis, d.label) == ("numerics", "eps", "numerics?")
    assert "the witness cannot judge this flip" in d.message
    d = diff_traces(_spec(), _flip(5.0), witness=_Recorder(error=RuntimeError("no device")))
    assert d is not None and (d.label, d.basis) == ("logic?", "eps")
    assert "witness failed (RuntimeError: no device)" in d.message


def test_witness_not_asked_about_structural_divergences() -> None:
    w = _Recorder(WitnessVerdict("numerics", "never"))
    bad = _mutate(_spec(), lambda rs: _round(rs, 2).__setitem__("feed", [99]))
    d = diff_traces(_spec(), bad, witness=w)
    assert d is not None and (d.klass, d.basis) == ("logic", "structural") and w.calls == []
    d = diff_traces(_spec(), make_plain_trace(OUTPUT[:5], end="budget"), level="tokens", witness=w)
    assert d is not None and (d.klass, d.basis) == ("logic", "structural") and w.calls == []


# --- properties -------------------------------------------------------------


@st.composite
def spec_traces(draw: st.DrawFn) -> Trace:
    """Random valid greedy spec traces (drafts accepted while they match samples)."""
    n_rounds = draw(st.integers(1, 5))
    tok = st.integers(3, 40)
    rounds = []
    for i in range(n_rounds):
        last = i == n_rounds - 1
        drafts = draw(st.lists(tok, max_size=4))
        samples = draw(st.lists(tok, min_size=len(drafts) + 1, max_size=len(drafts) + 1))
        k = 0
        while k < len(drafts) and samples[k] == drafts[k]:
            k += 1
        samples = samples[: k + 1]
        if last and draw(st.booleans()):
            samples[-1] = 2
            rounds.append((None, drafts, samples, k, samples[:-1], "eos"))
        else:
            end = "bonus" if k == len(drafts) else "correction"
            rounds.append((None, drafts, samples, k, samples, "budget" if last else end))
    margin = draw(st.floats(0.0, 10.0))
    return make_spec_trace(rounds, margin=margin)


@settings(max_examples=60, deadline=None)
@given(spec_traces())
def test_property_self_diff_is_none(trace: Trace) -> None:
    assert validate_trace(trace) == []
    for level in ("round", "tokens", "acceptance"):
        assert diff_traces(trace, clone(trace), level=level) is None


COMPARED = ("feed", "drafts", "window", "samples", "k_accept", "emitted", "end")


@settings(max_examples=100, deadline=None)
@given(spec_traces(), st.data())
def test_property_single_field_mutation_found_at_that_round(trace: Trace, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(trace.rounds) - 1))
    fld = data.draw(st.sampled_from(COMPARED))
    recs = copy.deepcopy(trace.records())
    r = _round(recs, i)
    value = r[fld]
    if fld == "k_accept":
        r[fld] = value + 1
    elif fld == "end":
        r[fld] = "stop" if value != "stop" else "budget"
    else:
        r[fld] = [*value, 1000]
    d = diff_traces(trace, Trace.from_records(recs))
    assert d is not None
    assert d.where == f"round {i}"
    assert d.field == fld
    assert d.klass == "logic"


def test_diff_main_passes_the_witness(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_trace(a, _spec().records())
    write_trace(b, _flip(5.0).records())
    w = _Recorder(WitnessVerdict("numerics", "replayed both paths", ("a: top-2 [4: 1.0, 0: 0.9]",)))
    assert diff_main([str(a), str(b)], witness=w) == 1
    out = capsys.readouterr().out
    assert "class: numerics (witness: replayed both paths)" in out and "top-2 [4: 1.0" in out
    from traces.diff import WitnessDeclined

    def declines(*_: Any) -> None:
        raise WitnessDeclined("ran elsewhere")

    assert diff_main([str(a), str(b)], witness=declines) == 1
    assert "logic? (eps-based, witness declined: ran elsewhere" in capsys.readouterr().out


def test_round_samples_agree_sees_a_target_sample_difference() -> None:
    from traces.testing import make_spec_trace, round_samples_agree

    rounds = [(None, [10, 11], [10, 11, 12], 2, [10, 11, 12], "bonus")]
    a = make_spec_trace(rounds)
    same_samples_other_drafts = make_spec_trace([(None, [10, 9], [10, 11, 12], 1, [10, 11], "correction")])
    other_sample = make_spec_trace([(None, [10, 11], [10, 13, 12], 1, [10, 13], "correction")])
    assert round_samples_agree(a, same_samples_other_drafts, "round 0")
    assert not round_samples_agree(a, other_sample, "round 0")
