"""The ``deepspec`` source against DeepSpec (torch), round for round at temperature 0.

§4.3: DeepSpec's verify degenerates to exact argmax token match at temperature
0, so the port must reproduce every round: drafts (the block cut by the
confidence threshold), window, target samples, k_accept, emitted tokens, end,
the accounting, and the per-position confidence (within 1e-4; the diff never
compares confidence). Confidence thresholds 0 (whole block) and 0.5.

- default run: against the committed goldens ``traces/golden/deepspec/``
  (DeepSpec absent; the goldens are read, never regenerated here);
- ``-m oracle`` with ``DEEPSPEC_PATH`` set (``tox -e deepspec``): DeepSpec live;
- planted bugs (an off-by-one tap layer, a context row committed for a
  rejected draft, a confidence cut that re-drafts) must each be caught.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance.conftest import require_oracle, run_trace
from specparity.cases.golden_cases import deepspec_cases
from specparity.goldens.manifest import (
    GOLDEN_DIR,
    check_goldens,
    golden_key,
    golden_path,
)
from traces.diff import diff_traces
from traces.io import Trace, read_trace

CASES = deepspec_cases()
CONF_ATOL = 1e-4


def _ids(case: Any) -> str:
    return case.case_id


@pytest.fixture(scope="module")
def fresh() -> set[str]:
    bad = {p.key for p in check_goldens(runners=["deepspec"])}
    return {golden_key("deepspec", c) for c in CASES} - bad


def confidence_mismatch(a: Trace, b: Trace, atol: float = CONF_ATOL) -> str | None:
    """First round whose ``confidence`` differs in length or by more than ``atol``."""
    ra = [r for r in a.events if r["type"] == "round"]
    rb = [r for r in b.events if r["type"] == "round"]
    for x, y in zip(ra, rb, strict=False):
        ca, cb = x["confidence"], y["confidence"]
        if (ca is None) != (cb is None) or (ca is not None and (
                len(ca) != len(cb) or any(abs(p - q) > atol for p, q in zip(ca, cb, strict=True)))):
            return f"round {x['index']}: confidence {ca} vs {cb}"
    return None


def test_goldens_cover_both_thresholds_and_accepted_eos() -> None:
    drafters = {c.drafter for c in CASES}
    assert drafters == {"deepspec-t0", "deepspec-t0.5", "deepspec-kv-t0", "deepspec-kv-t0.5"}, drafters
    eos_rounds = []
    for c in CASES:
        g = read_trace(golden_path(GOLDEN_DIR, golden_key("deepspec", c)))
        eos_rounds += [r for r in g.events if r["type"] == "round" and r["end"] == "eos"
                       and r["k_accept"] == len(r["samples"]) and r["samples"][-1] in g.header["eos_ids"]]
    assert eos_rounds, "no golden has an EOS accepted inside the drafts"


@pytest.mark.golden
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_engine_matches_deepspec_golden(case: Any, fresh: set[str]) -> None:
    key = golden_key("deepspec", case)
    if key not in fresh:
        pytest.skip(f"{key} is stale/corrupt/missing (test_goldens_are_fresh names why)")
    golden = read_trace(golden_path(GOLDEN_DIR, key))
    live = run_trace("engine", case)
    div = diff_traces(live, golden, level="round")
    assert div is None, f"{case.case_id}: engine vs DeepSpec golden\n{div.message}"
    conf = confidence_mismatch(live, golden)
    assert conf is None, f"{case.case_id}: {conf}"


def test_eos_inside_accepted_drafts_is_truncated_without_bonus() -> None:
    """DeepSpec: an accepted draft EOS ends generation, no bonus (base_evaluator
    ``terminated_by_stop_token``); we count it once and never emit it."""
    case = next(c for c in CASES if c.eos_ids == (1, 281) and c.prompt_id == "nat-09")
    live = run_trace("engine", case)
    last = [r for r in live.events if r["type"] == "round"][-1]
    assert last["end"] == "eos" and last["samples"][-1] == 281 and last["k_accept"] == len(last["samples"]), last
    assert len(last["drafts"]) > last["k_accept"], "the EOS must sit inside the block, not at its end"
    assert 281 not in live.footer["output_ids"]
    usage = live.footer["usage"]
    assert usage["finish_reason"] == "stop"
    assert usage["generation_tokens"] == len(live.footer["output_ids"]) + 1, usage
    assert live.footer["speculation"]["accepted"] == sum(r["k_accept"] for r in live.events if r["type"] == "round")


# ----------------------------------------------------------------- planted bugs


def _run_planted(case: Any, **planted: Any) -> Trace:
    from engine.executor import GenerationParams, spec_generate
    from engine.sources.deepspec import DeepSpecProvider
    from specparity.runners import case_paths, dspark_drafter, load_model

    tpath, dpath = case_paths(case)
    target = load_model(str(tpath))
    golden = read_trace(golden_path(GOLDEN_DIR, golden_key("deepspec", case)))
    provider = DeepSpecProvider(dpath, confidence_threshold=dspark_drafter(case)[1], **planted)
    params = GenerationParams(max_tokens=case.max_tokens, gamma=provider.gamma, prefill="full",
                              eos_ids=tuple(golden.header["eos_ids"]))
    result = spec_generate(target.model, provider, list(golden.header["prompt"]["token_ids"]), params)
    return Trace.from_records([golden.header, *result.records, result.footer()])


@pytest.mark.parametrize(
    ("bug", "planted"),
    [
        ("off-by-one tap layer", {"tap_shift": 1}),
        ("context row committed for a rejected draft", {"commit_extra_rows": 1}),
        ("confidence cut re-drafts instead of truncating", {"redraft_on_cut": True}),
    ],
)
def test_planted_bug_is_caught(bug: str, planted: dict[str, Any]) -> None:
    caught = []
    for case in CASES:
        golden = read_trace(golden_path(GOLDEN_DIR, golden_key("deepspec", case)))
        live = _run_planted(case, **planted)
        why = diff_traces(live, golden, level="round")
        conf = confidence_mismatch(live, golden)
        if why is not None or conf is not None:
            caught.append(case.case_id)
    assert caught, f"planted bug {bug!r} went unnoticed on every DeepSpec golden"


def test_unplanted_source_is_clean() -> None:
    """The negative control of the planted-bug test: no switch, no divergence."""
    for case in CASES[:4]:
        golden = read_trace(golden_path(GOLDEN_DIR, golden_key("deepspec", case)))
        live = _run_planted(case)
        assert diff_traces(live, golden) is None and confidence_mismatch(live, golden) is None, case.case_id


# ------------------------------------------------------------------------ live


@pytest.mark.oracle
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_engine_matches_deepspec_live(case: Any) -> None:
    require_oracle("deepspec")
    ref = run_trace("deepspec", case)
    live = run_trace("engine", case)
    div = diff_traces(live, ref, level="round")
    assert div is None, f"{case.case_id}: engine vs DeepSpec live\n{div.message}"
    assert confidence_mismatch(live, ref) is None


@pytest.mark.oracle
def test_deepspec_live_reproduces_its_goldens() -> None:
    require_oracle("deepspec")
    for case in CASES[:3]:
        ref = run_trace("deepspec", case)
        golden = read_trace(golden_path(GOLDEN_DIR, golden_key("deepspec", case)))
        assert diff_traces(ref, golden) is None, case.case_id
        assert confidence_mismatch(ref, golden, atol=1e-6) is None, case.case_id  # torch threads reorder sums


def test_threshold_rounds_are_cut_by_confidence() -> None:
    """At 0.5 some rounds are truncated (len(confidence) == len(drafts) + 1, the
    cut value below the threshold) and some are ℓ = 0 (one plain, tapped step)."""
    cut = zero = 0
    for case in CASES:
        if case.drafter != "deepspec-t0.5":
            continue
        g = read_trace(golden_path(GOLDEN_DIR, golden_key("deepspec", case)))
        for r in (e for e in g.events if e["type"] == "round"):
            if len(r["confidence"]) == len(r["drafts"]) + 1:
                cut += 1
                assert r["confidence"][-1] < 0.5
                zero += not r["drafts"]
    assert cut and zero, (cut, zero)
