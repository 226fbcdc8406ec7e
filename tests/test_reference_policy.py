"""The known-divergence policy (``traces/reference.py``) can fail.

A known reference bug is only excused where its signature matches: a
divergence BEFORE the engine's ring-wrap point, on a target the entry does not
list, or an unexplained refusal are failures.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from traces.io import Trace
from traces.reference import (
    ReferenceRefused,
    compare_with_reference,
    fallback_point,
    known_entries,
    refusal_verdict,
)
from traces.testing import make_spec_trace


def _with_fallback(trace: Trace, after_round: int, tokens: list[int]) -> Trace:
    """Replace rounds after ``after_round`` by ring-wrap plain steps emitting ``tokens``."""
    recs: list[dict[str, Any]] = [trace.header]
    if trace.prefill is not None:
        recs.append(trace.prefill)
    rounds = trace.rounds[:after_round]
    recs += rounds
    out = [t for r in rounds for t in r["emitted"]]
    prev = out[-1] if out else trace.header["prompt"]["token_ids"][-1]
    for i, t in enumerate(tokens):
        recs.append({"type": "plain", "index": i, "input": [prev], "sample": t, "margin": 5.0,
                     "emitted": [t], "end": "budget" if i == len(tokens) - 1 else None,
                     "reason": "ring-wrap", "target_cache_digest": None, "time_s": None})
        prev = t
        out.append(t)
    footer = dict(trace.footer, output_ids=out)
    footer["usage"] = dict(footer["usage"], generation_tokens=len(out), finish_reason="length")
    recs.append(footer)
    return Trace.from_records(recs)


ROUNDS = [
    (None, [10, 11], [10, 11, 12], 2, [10, 11, 12], "bonus"),
    (None, [13, 14], [13, 20], 1, [13, 20], "correction"),
    (None, [21, 22], [21, 22, 23], 2, [21, 22, 23], "bonus"),
]


def _pair(target: str, diverge_at: int) -> tuple[Trace, Trace]:
    ref = make_spec_trace(ROUNDS + [(None, [24], [24, 25], 1, [24, 25], "budget")], case_id=f"{target}/twin/p/g2/n10")
    eng = _with_fallback(make_spec_trace(ROUNDS, case_id=f"{target}/twin/p/g2/n10"), 2, [21, 22, 23, 24, 25])
    if diverge_at >= 0:
        out = list(ref.footer["output_ids"])
        out[diverge_at] = 99
        recs = ref.records()
        recs[-1] = dict(recs[-1], output_ids=out)
        ref = Trace.from_records(recs)
    return eng, ref


def test_fallback_point() -> None:
    eng, _ = _pair("gemma3", -1)
    assert fallback_point(eng) == (2, 5)


def test_identical_tokens_after_fallback_pass() -> None:
    eng, ref = _pair("gemma3", -1)
    v = compare_with_reference(eng, ref, "mlx_lm")
    assert v.status == "identical", v.format()


def test_divergence_after_ring_wrap_is_known() -> None:
    eng, ref = _pair("gemma3", 7)
    v = compare_with_reference(eng, ref, "mlx_lm")
    assert v.status == "known" and v.known is not None
    assert v.known.id == "mlx-lm-rotating-trim-after-wrap"
    assert not v.fails


def test_divergence_before_ring_wrap_is_not_excused() -> None:
    eng, ref = _pair("gemma3", 3)  # inside the rounds compared round for round
    v = compare_with_reference(eng, ref, "mlx_lm")
    assert v.status == "divergent" and v.fails, v.format()


def test_a_user_model_is_excused_by_an_any_target_entry() -> None:
    # mlx-lm's trim-after-wrap is a behaviour of its own code: any model with a
    # rotating cache (a user's gemma3 dir, named <dir>-<digest>) shows it.
    eng, ref = _pair("my-gemma-3f2a9c", 7)
    v = compare_with_reference(eng, ref, "mlx_lm")
    assert v.status == "known" and v.known is not None and not v.fails


def test_unlisted_target_is_not_excused(monkeypatch: pytest.MonkeyPatch) -> None:
    # An entry that lists targets applies to those alone.
    import traces.reference as ref_mod

    listed = tuple(dataclasses.replace(e, targets=("gemma3",)) for e in known_entries())
    monkeypatch.setattr(ref_mod, "known_entries", lambda *a, **k: listed)
    assert compare_with_reference(*_pair("gemma3", 7), "mlx_lm").status == "known"
    v = compare_with_reference(*_pair("llama", 7), "mlx_lm")
    assert v.status == "divergent" and v.fails


def test_other_runner_is_not_excused() -> None:
    eng, ref = _pair("gemma3", 7)
    assert compare_with_reference(eng, ref, "optiq").status == "divergent"


def test_refusals() -> None:
    eng, _ = _pair("qwen35", -1)
    msg = "Speculative decoding requires a trimmable prompt cache (got {'ArraysCache'})."
    v = refusal_verdict(eng, ReferenceRefused("mlx_lm", "qwen35/twin/p/g2/n10", msg))
    assert v.status == "refused" and v.known is not None and not v.fails
    v2 = refusal_verdict(eng, ReferenceRefused("mlx_lm", "qwen35/twin/p/g2/n10", "segfault"))
    assert v2.status == "divergent" and v2.fails and "unexplained" in v2.format()
    # Excused on any target only by its message, and only for the runner it names.
    eng_llama, _ = _pair("llama", -1)
    assert not refusal_verdict(eng_llama, ReferenceRefused("mlx_lm", "x", msg)).fails
    assert refusal_verdict(eng_llama, ReferenceRefused("optiq", "x", msg)).fails


def test_manifest_entries_are_complete() -> None:
    for e in known_entries():
        assert e.reason and e.reproduce and e.targets, e.id
        assert e.kind in ("divergence", "refusal", "subject"), e.id
        if e.kind == "refusal":
            assert e.message, e.id
