"""Logits processors: the engine vs mlx-lm, round for round, and planted history bugs.

References: mlx-lm 0.32.2 ``mlx_lm/sample_utils.py`` ``make_logits_processors``
(repetition / presence / frequency penalties with context sizes, logit bias) and
``mlx_lm/generate.py``: ``generate_step`` (history = whole prompt + emitted
tokens) and ``speculative_generate_step`` (``prev_tokens``: the last prompt token
+ emitted tokens; each draft step appends its input then its draft; the verify
window appends the pending token then the TARGET's own samples row by row; after
the round it is cut back to the emitted tokens, so rejected drafts never stay).

- Cases tagged ``+hlast`` start the engine's history where
  ``speculative_generate_step`` does and are compared with it round for round
  (feed, drafts, samples, k_accept, emitted, end, digests) at temperature 0 and
  > 0; the mlx-lm runner gets mlx-lm's own ``make_logits_processors`` output.
- With the default history (the whole prompt, §2: one history for every lane)
  the engine's speculative output equals mlx-lm's own plain ``generate_step``
  output; mlx-lm's speculative output does not (known entry
  ``mlx-lm-spec-processor-history-omits-prompt``, reproduced here).
- Planted engine variants — history advancing on rejected drafts, verify rows
  seeing drafted-but-unemitted tokens, the pending token counted twice, the
  drafter's history not advancing over its own drafts, the bonus row or the
  correction sampled without processors — are each caught against mlx-lm with
  the first divergent round named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import mlx.core as mx
import pytest

from conformance.conftest import require_oracle, run_trace
from engine.pipeline import SamplingPipeline
from engine.sampler import ProcessorParams, StepSampler
from specparity.cases.case import Case
from traces.diff import Divergence, diff_traces
from traces.io import Trace
from traces.reference import ReferenceRefused, compare_with_reference, refusal_verdict

pytestmark = pytest.mark.oracle

LAST = [
    Case("llama", "twin", "nat-00", 3, 32, processors="rp1.3c64+hlast"),
    Case("llama", "twin", "nat-00", 3, 32, temperature=0.8,
         processors="pp0.5c20+fp1c64+lb5=1.5,7=-2+hlast"),
    Case("llama", "small", "rnd-01", 1, 32, processors="rp1.5c20+hlast"),
    Case("qwen3", "twin", "nat-01", 3, 32, temperature=0.8, seed=1, processors="rp1.3c64+fp0.5c64+hlast"),
    Case("qwen3", "small", "nat-02", 2, 32, processors="pp2c8+lb3=2+hlast"),
    # count-sensitive over a short context (rewarding repetition): a history off by one token
    # (the pending token twice, a rejected draft kept) flips picks here, where a presence-style
    # penalty cannot tell (found by tools/mutation.py: verify-history-pending-twice was missed)
    Case("llama", "twin", "nat-00", 3, 32, processors="fp-1c8+hlast"),
    Case("llama", "twin", "nat-00", 3, 32, temperature=0.8, processors="pp-1.5c4+fp1c16+hlast"),
]


def _pair(case: Case) -> tuple[Trace, Trace]:
    require_oracle("mlx_lm")
    return run_trace("engine", case), run_trace("mlx_lm", case)


def test_processor_tags_round_trip() -> None:
    for case in LAST:
        proc = ProcessorParams.parse(case.processors)
        assert proc.active and proc.tag() == case.processors
        assert proc.history_prompt == "last"


@pytest.mark.parametrize("case", LAST, ids=lambda c: c.case_id)
def test_engine_matches_mlx_lm_round_for_round(case: Case) -> None:
    eng, ref = _pair(case)
    verdict = compare_with_reference(eng, ref, "mlx_lm")
    assert verdict.status == "identical", f"{case.case_id}: engine vs mlx-lm\n{verdict.format()}"
    assert eng.header["params"]["logits_processors"] == ref.header["params"]["logits_processors"]
    # Not vacuous: the processors change what the target emits.
    bare = run_trace("engine", replace(case, processors=""))
    assert bare.footer["output_ids"] != eng.footer["output_ids"], "processors had no effect"


def test_cases_cover_rejections_and_bonus_rows() -> None:
    """The round-for-round cases exercise a correction row and an all-accept bonus row."""
    ends: set[str] = set()
    for case in LAST:
        ends |= {r["end"] for r in run_trace("engine", case).rounds}
    assert {"correction", "bonus"} <= ends, ends


@pytest.mark.parametrize("tag", ["rp1.3c64", "fp1c64+lb5=1.5", "pp2c64", "fp-1c8"])
def test_spec_with_full_history_is_lossless_against_mlx_lm_plain(tag: str) -> None:
    """Default history (whole prompt): engine spec == engine plain == mlx-lm generate_step."""
    require_oracle("mlx_lm")
    case = Case("llama", "twin", "nat-00", 3, 32, processors=tag)
    spec = run_trace("engine", case)
    plain = run_trace("engine", case.plain())
    ref_plain = run_trace("mlx_lm", case.plain())
    assert diff_traces(plain, ref_plain, level="round") is None
    div = diff_traces(spec, ref_plain, level="tokens")
    assert div is None, div.message


_P = "rp1.3c64+fp-0.5c8+lb5=1.5"
SOURCE_CASES = [
    Case("llama", "twin", "nat-00", 3, 32, processors=_P),
    Case("llama", "ngram", "nat-02", 3, 32, source="ngram", processors=_P),
    Case("qwen35", "qwen35-mtp", "nat-00", 2, 24, source="mtp", processors=_P),
    Case("gemma4", "gemma4-assistant", "nat-03", 3, 14, source="assistant", processors=_P),
    Case("gemma4", "deepspec-t0", "nat-03", 4, 14, source="deepspec", processors=_P),
    Case("gemma4", "dspark-t0", "nat-03", 4, 14, source="dspark", processors=_P),
]


@pytest.mark.parametrize("case", SOURCE_CASES, ids=lambda c: c.source)
def test_every_source_is_lossless_with_processors(case: Case) -> None:
    """§2 with processors, every draft source (tail-split and full prefill): the engine's
    speculative tokens equal its plain decode's with the same processors at temperature 0."""
    spec = run_trace("engine", case)
    div = diff_traces(spec, run_trace("engine", case.plain()), level="tokens")
    assert div is None, f"{case.case_id}: spec vs plain\n{div.message}"
    assert spec.rounds and run_trace("engine", replace(case, processors="")).footer["output_ids"] != \
        spec.footer["output_ids"], "processors had no effect"


def test_known_entry_mlx_lm_spec_history_omits_prompt_reproduces() -> None:
    """mlx-lm's speculative output differs from its own plain output with a penalty whose
    context reaches into the prompt; the runner refuses the convention it cannot run."""
    require_oracle("mlx_lm")
    last = run_trace("mlx_lm", Case("llama", "twin", "nat-00", 3, 32, processors="rp1.3c64+hlast"))
    plain = run_trace("mlx_lm", Case("llama", None, "nat-00", 0, 32, processors="rp1.3c64"))
    assert last.footer["output_ids"] != plain.footer["output_ids"]
    full = Case("llama", "twin", "nat-00", 3, 32, processors="rp1.3c64")
    with pytest.raises(ReferenceRefused) as info:
        run_trace("mlx_lm", full)
    verdict = refusal_verdict(run_trace("engine", full), info.value)
    assert verdict.status == "refused" and verdict.known is not None
    assert verdict.known.id == "mlx-lm-spec-processor-history-omits-prompt"
    with pytest.raises(ReferenceRefused):
        run_trace("mlx_lm", replace(full.plain(), processors="rp1.3c64+hlast"))
    # History-free processors (logit bias alone) run under either convention.
    run_trace("mlx_lm", Case("llama", "twin", "nat-00", 3, 8, processors="lb5=1.5"))


# ---------------------------------------------------------------- planted bugs


def _verify_rows(skip: Callable[[StepSampler, int, list[int], mx.array], bool]) -> Callable[..., mx.array]:
    """``StepSampler.sample_window`` with processors skipped on the verify rows ``skip`` picks
    (same sampler calls, same randomness; the draft lane and windowless calls unchanged)."""
    real = StepSampler.sample_window

    def planted(self, logits, history=None, window=()):  # noqa: ANN001, ANN202
        if not self.has_processors or len(window) < 2:
            return real(self, logits, history, window)
        out, y, hist = [], mx.array(list(window[:1]), mx.uint32), history
        for i in range(logits.shape[0]):
            hist = y if hist is None else mx.concatenate([hist, y])
            row = logits[i : i + 1, :]
            processed = self.process(hist, row)
            if not skip(self, i, list(window), processed):
                row = processed
            y = self.draw_fn(row - mx.logsumexp(row, axis=-1, keepdims=True))
            out.append(y)
        return mx.concatenate(out, axis=0)

    return planted


def _plant_rejected_drafts_kept(mp: pytest.MonkeyPatch) -> None:
    """Rollback forgets the processor history: a rejected round's drafts stay in it."""
    seen: dict[str, Any] = {}
    real_window, real_grow = StepSampler.sample_window, SamplingPipeline.advance

    def remember(self, logits, history=None, window=()):  # noqa: ANN001, ANN202
        if len(window) > 1:
            seen["drafts"] = list(window[1:])
        return real_window(self, logits, history, window)

    def grow(self, tokens, **kw):  # noqa: ANN001, ANN003, ANN202
        drafts = seen.pop("drafts", None)
        if drafts is not None and tokens:
            k = next((i for i, (a, b) in enumerate(zip(drafts, tokens, strict=False)) if a != b), len(drafts))
            if k < len(drafts):
                tokens = [*drafts, *tokens[k:]]
        return real_grow(self, tokens, **kw)

    mp.setattr(StepSampler, "sample_window", remember)
    mp.setattr(SamplingPipeline, "advance", grow)


def _plant_verify_sees_drafts(mp: pytest.MonkeyPatch) -> None:
    """Every verify row's history already holds all of the round's (unemitted) drafts."""
    real = StepSampler.sample_window

    def leaky(self, logits, history=None, window=()):  # noqa: ANN001, ANN202
        if history is not None and len(window) > 1:
            history = mx.concatenate([history, mx.array(list(window[1:]), mx.uint32)])
        return real(self, logits, history, window)

    mp.setattr(StepSampler, "sample_window", leaky)


def _plant_pending_twice(mp: pytest.MonkeyPatch) -> None:
    """The verify history includes the pending token, and the window head adds it again."""
    mp.setattr(SamplingPipeline, "history_before_pending", lambda self: self.history)


def _plant_drafter_history_frozen(mp: pytest.MonkeyPatch) -> None:
    """The drafter's processors never see its own earlier drafts of the round."""
    real = StepSampler.sample_window

    def frozen(self, logits, history=None, window=()):  # noqa: ANN001, ANN202
        lane = self._draft_history
        out = real(self, logits, history, window)
        if history is None and not window and lane is not None:
            self._draft_history = lane
        return out

    mp.setattr(StepSampler, "sample_window", frozen)


def _plant_bonus_unprocessed(mp: pytest.MonkeyPatch) -> None:
    """The bonus row (the window's last position) is sampled without processors."""
    mp.setattr(StepSampler, "sample_window", _verify_rows(lambda s, i, w, row: i == len(w) - 1))


def _plant_correction_unprocessed(mp: pytest.MonkeyPatch) -> None:
    """The correction (the first row whose processed pick rejects the draft) skips processors."""
    def pick(s: StepSampler, i: int, w: list[int], row: mx.array) -> bool:
        return i < len(w) - 1 and int(mx.argmax(row, axis=-1).item()) != w[i + 1]

    mp.setattr(StepSampler, "sample_window", _verify_rows(pick))


def _first(trace: Trace, pred: Callable[[dict[str, Any]], bool]) -> int:
    return next((i for i, r in enumerate(trace.rounds) if pred(r)), len(trace.rounds))


def _rejected(r: dict[str, Any]) -> bool:
    return r["k_accept"] < len(r["drafts"])


# plant -> the earliest round it can change, from the correct (reference) trace
PLANTS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], Callable[[Trace], int]]] = {
    "rejected-drafts-kept": (_plant_rejected_drafts_kept, lambda t: _first(t, _rejected) + 1),
    "verify-sees-drafts": (_plant_verify_sees_drafts, lambda t: _first(t, lambda r: len(r["drafts"]) > 0)),
    "pending-twice": (_plant_pending_twice, lambda t: 0),
    "drafter-history-frozen": (_plant_drafter_history_frozen, lambda t: _first(t, lambda r: len(r["drafts"]) > 1)),
    "bonus-unprocessed": (_plant_bonus_unprocessed, lambda t: _first(t, lambda r: r["end"] == "bonus")),
    "correction-unprocessed": (_plant_correction_unprocessed, lambda t: _first(t, _rejected)),
}
# Rewarding repetition (negative presence/frequency penalties, repetition penalty < 1) over a
# short context makes history tokens the target's top contenders, so a wrong history flips picks.
_T0 = Case("llama", "twin", "nat-00", 3, 32, processors="fp-1c8+hlast")
_T0_RP = Case("llama", "twin", "nat-00", 3, 32, processors="rp0.7c6+hlast")
_T8 = Case("llama", "twin", "nat-00", 3, 32, temperature=0.8, processors="rp0.7c6+fp-0.5c8+hlast")
_T8_PP = Case("llama", "twin", "nat-00", 3, 32, temperature=0.8, processors="pp-1.5c4+fp1c16+hlast")
PLANT_CASES = [
    ("rejected-drafts-kept", _T0), ("rejected-drafts-kept", _T8),
    ("verify-sees-drafts", _T0), ("verify-sees-drafts", _T8),
    ("pending-twice", _T0), ("pending-twice", _T8_PP),
    ("drafter-history-frozen", _T0_RP), ("drafter-history-frozen", _T8),
    ("bonus-unprocessed", _T0),
    ("correction-unprocessed", _T0), ("correction-unprocessed", _T8),
]


def caught_at(plant: str, case: Case, mp: pytest.MonkeyPatch) -> tuple[Divergence | None, int]:
    """(first divergence of the planted engine from mlx-lm, earliest round the plant can act)."""
    good, ref = _pair(case)
    assert compare_with_reference(good, ref, "mlx_lm").status == "identical", case.case_id
    install, earliest = PLANTS[plant]
    install(mp)
    try:
        bad = run_trace("engine", case)
    finally:
        mp.undo()
    return diff_traces(bad, ref, level="round"), earliest(ref)


@pytest.mark.parametrize(("plant", "case"), PLANT_CASES, ids=[f"{p}-{c.case_id}" for p, c in PLANT_CASES])
def test_planted_processor_bug_is_caught(plant: str, case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    div, earliest = caught_at(plant, case, monkeypatch)
    assert div is not None, f"plant {plant!r} not caught on {case.case_id}"
    assert div.where.startswith("round ") and div.where in div.message, div.message
    assert int(div.where.split()[1]) >= earliest, (plant, div.where, earliest)


def test_suite_sampling_tables_carry_processors(tmp_path) -> None:  # noqa: ANN001
    from specparity.cases.suite import SuiteError, load_suite, suite_cases

    f = tmp_path / "s.toml"
    f.write_text('gammas = [3]\nmax_tokens = 8\nzoo_prompts = 1\n'
                 'sampling = [{temperature = 0.0, processors = "lb5=1.5+rp1.3c64+hlast"}, {temperature = 0.0}]\n'
                 '[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    cases = suite_cases(load_suite(f))
    assert [c.processors for c in cases] == ["rp1.3c64+lb5=1.5+hlast", ""]  # canonical tag
    f.write_text(f.read_text().replace("rp1.3c64", "rpX"))
    with pytest.raises(SuiteError, match=r"sampling\[0\]\.processors: bad logits-processor part 'rpX'"):
        load_suite(f)
