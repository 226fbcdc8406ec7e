"""Each comparison can fail: planted engine bugs must be caught, first round named.

For every check of the suite a deliberate bug is planted in the engine (via
monkeypatch, never in the shipped code) and the same comparison that passes on
the real engine must report a ``logic`` divergence at the round where the bug
first shows, naming the field:

- a target trim one too few (§2 step 5: ``trim(d - k)``) → the target cache
  digest after the first rejecting round;
- a drafter trim of ``d - k`` instead of ``max(d - k - 1, 0)`` → the drafter
  cache digest after the first rejecting round;
- a re-feed that forgets the last draft after an all-accept round (§1 "feed")
  → the next round's feed;
- a leaked EOS (EOS emitted as content, §2 step 3) → the EOS round's emission;
- the same trim bug seen from the token level, engine spec vs engine plain.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance.conftest import run_trace, witness
from specparity.cases.case import Case
from traces.diff import diff_traces
from traces.io import Trace

TWIN = Case("llama", "twin", "nat-00", 3, 32)


def _first_round(trace: Trace, pred: Any) -> int:
    for r in trace.rounds[:-1]:
        if pred(r):
            return int(r["index"])
    pytest.fail(f"{trace.header['case_id']}: no round matches the planted bug's trigger")


@pytest.mark.oracle
def test_target_trim_one_too_few_is_caught(oracle_ok: None, short_target_trim: None) -> None:
    ref = run_trace("mlx_lm", TWIN)
    bad = run_trace("engine", TWIN)
    r = _first_round(ref, lambda r: r["k_accept"] < len(r["drafts"]))
    div = diff_traces(bad, ref, level="round")
    assert div is not None, "a short target trim went unnoticed"
    assert (div.where, div.field, div.klass) == (f"round {r}", "target_cache_digest", "logic"), div.message
    assert div.basis == "structural" and div.value_a != div.value_b, div.message
    assert f"round {r}" in div.message


@pytest.mark.oracle
def test_drafter_overtrim_is_caught(oracle_ok: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import caches as cache_ops
    from engine.sources import two_model

    def commit(self: Any, d: int, k_accept: int, *args: Any, **kw: Any) -> None:
        cache_ops.trim(self.caches, max(d - k_accept, 0), "two-model drafter")

    monkeypatch.setattr(two_model.TwoModelSource, "commit", commit)
    ref = run_trace("mlx_lm", TWIN)
    bad = run_trace("engine", TWIN)
    r = _first_round(ref, lambda r: r["k_accept"] < len(r["drafts"]))
    div = diff_traces(bad, ref, level="round")
    assert div is not None, "a drafter trimmed by d - k went unnoticed"
    assert (div.where, div.field, div.klass) == (f"round {r}", "drafter_cache_digest", "logic"), div.message
    assert div.basis == "structural", div.message


@pytest.mark.oracle
def test_wrong_refeed_is_caught(oracle_ok: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.executor as ex

    monkeypatch.setattr(ex, "refeed", lambda drafts, k, nxt: [nxt])
    case = Case("llama", "twin", "nat-00", 1, 32)
    ref = run_trace("mlx_lm", case)
    bad = run_trace("engine", case)
    r = _first_round(ref, lambda r: r["k_accept"] == len(r["drafts"]) > 0) + 1
    div = diff_traces(bad, ref, level="round")
    assert div is not None, "a re-feed without the last draft went unnoticed"
    assert (div.where, div.field, div.klass, div.basis) == (f"round {r}", "feed", "logic", "structural"), \
        div.message
    assert len(div.value_a) == 1 and len(div.value_b) == 2 and div.value_a[0] == div.value_b[1], div.message


@pytest.mark.oracle
def test_leaked_eos_is_caught(oracle_ok: None) -> None:
    """EOS derived from a plain run (the 6th emitted token); the bad engine forgets it."""
    base = run_trace("mlx_lm", TWIN)
    eos = base.footer["output_ids"][5]
    case = Case("llama", "twin", "nat-00", 3, 32, eos_ids=(eos,))
    ref = run_trace("mlx_lm", case)
    assert ref.footer["usage"]["finish_reason"] == "stop"
    assert eos not in ref.footer["output_ids"]
    good = run_trace("engine", case)
    assert diff_traces(good, ref, level="round") is None
    bad_case = Case("llama", "twin", "nat-00", 3, 32, eos_ids=())
    bad = run_trace("engine", bad_case)
    r = next(i for i, rec in enumerate(ref.rounds) if rec["end"] == "eos")
    div = diff_traces(bad, ref, level="round")
    assert div is not None, "an EOS emitted as content went unnoticed"
    # The reference's samples stop at the EOS; the bad engine sampled the same and went on.
    assert (div.where, div.field, div.klass, div.basis) == (f"round {r}", "samples", "logic", "structural"), \
        div.message
    assert div.value_b[-1] == eos and div.value_a[: len(div.value_b)] == div.value_b, div.message


def test_trim_bug_breaks_spec_vs_plain(short_target_trim: None) -> None:
    spec = run_trace("engine", TWIN)
    plain = run_trace("engine", TWIN.plain())
    div = diff_traces(spec, plain, level="tokens", witness=witness())
    assert div is not None, "spec vs plain missed a target that keeps a rejected token"
    first = next(i for i, (x, y) in enumerate(zip(spec.output_ids, plain.output_ids, strict=False)) if x != y)
    assert (div.where, div.position) == (f"output token {first}", first), div.message
    # The class is the witness's (the flip replayed on both paths), not an eps guess.
    assert (div.klass, div.basis, div.label) == ("logic", "witness", "logic"), div.message
    assert div.witness is not None and not div.witness.data["paths"][0]["reproduced"], div.message
