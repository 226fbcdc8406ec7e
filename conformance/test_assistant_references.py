"""The ``assistant`` source vs mlx-optiq ``spec_generate`` + ``GemmaAssistantDrafter`` (§3 oracle L2).

Round for round at temperature 0 on the zoo ``gemma4`` target with both head
variants (tied embedding and centroid): feed, drafts, window, samples,
k_accept, emitted and end of every round before the engine's §2 ring-wrap
fallback, then the token stream, usage and counters. optiq's accounting is
recorded raw and mapped by exactly two named normalizations
(``traces/normalize.py``): ``optiq-spec-budget-drafts`` (optiq drafts γ
even with fewer tokens left) and ``optiq-stopping-eos`` (optiq yields the
stopping EOS). Anything else fails. Runs in ``tox -e optiq``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from conformance.conftest import require_oracle, run_trace
from specparity.cases.case import Case
from traces.diff import diff_traces
from traces.io import Trace
from traces.normalize import mlx_vlm_stopping_eos, optiq_spec_budget_drafts, optiq_stopping_eos
from traces.reference import compare_with_reference
from traces.testing import round_samples_agree

PROMPTS = ("nat-03", "nat-09", "nat-22", "rnd-15", "rnd-14")
HEADS = ("gemma4-assistant-self", "gemma4-assistant-centroid-self", "gemma4-assistant")
CASES = [Case("gemma4", h, p, g, 40, source="assistant") for h in HEADS for p in PROMPTS for g in (1, 3)]


def _normalized(case: Case) -> Trace:
    raw = run_trace("optiq", case).records()
    return Trace.from_records(optiq_stopping_eos(optiq_spec_budget_drafts(raw, case.max_tokens)))


@pytest.mark.oracle
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.case_id)
def test_assistant_round_for_round_vs_optiq(case: Case) -> None:
    require_oracle("optiq")
    eng = run_trace("engine", case)
    verdict = compare_with_reference(eng, _normalized(case), "optiq")
    assert verdict.status == "identical", f"{case.case_id}: engine vs optiq\n{verdict.format()}"


@pytest.mark.oracle
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.case_id)
def test_assistant_stopping_eos_vs_optiq(case: Case) -> None:
    require_oracle("optiq")
    plain = run_trace("engine", case.plain())
    case = replace(case, eos_ids=(plain.output_ids[6],))
    raw = run_trace("optiq", case)
    assert raw.output_ids[-1] in case.eos_ids, "optiq did not yield the stopping EOS"
    eng = run_trace("engine", case)
    div = diff_traces(eng, _normalized(case), level="round")
    assert div is None, f"{case.case_id}: engine vs optiq\n{div.message}"


@pytest.mark.oracle
def test_optiq_accepts_and_rejects() -> None:
    require_oracle("optiq")
    ks: set[str] = set()
    for case in CASES:
        for r in run_trace("optiq", case).rounds:
            d, k = len(r["drafts"]), r["k_accept"]
            ks.add("all" if k == d else ("zero" if k == 0 else "partial"))
    assert ks == {"all", "zero", "partial"}, ks


def test_budget_normalization_can_fail() -> None:
    """optiq-spec-budget-drafts cuts only drafts past the budget; a round that emitted past it is refused."""
    from traces.normalize import NotApplicable

    rnd = {"type": "round", "index": 0, "drafts": [7, 8, 9], "window": [5, 7, 8, 9], "k_accept": 3,
           "emitted": [7, 8], "margins": None}
    footer = {"type": "footer", "speculation": {"drafted": 3}}
    plain = {"type": "plain", "emitted": [5]}
    out = optiq_spec_budget_drafts([plain, rnd, footer], max_tokens=3)
    assert out[1]["drafts"] == [7, 8] and out[1]["window"] == [5, 7, 8] and out[1]["k_accept"] == 2
    assert out[2]["speculation"]["drafted"] == 2
    with pytest.raises(NotApplicable):
        optiq_spec_budget_drafts([plain, {**rnd, "emitted": [7, 8, 9]}, footer], max_tokens=3)


# ------------------------------------------------------------ mlx-vlm gemma4 assistant drafter
# Second assistant reference: mlx-vlm 0.7.10 ``Gemma4AssistantDraftModel`` (its own gemma4
# layers, masks and heads; ``oracles.mlx_vlm.assistant_*``). Runs with
# ``tox -e vlm -- conformance/test_assistant_references.py``. mlx-vlm holds the drafter's
# query position at kv_offset-1 for every draft step (HF SinglePositionMultiTokenCandidateGenerator);
# optiq — §3's L2 oracle for this row, round-for-round identical above — and the engine query
# step k at kv_offset+k (documented behaviour ``mlx-vlm-assistant-fixed-draft-position``).
# Compared exactly where the rule agrees: mlx-vlm's own forward at the engine's positions
# must give the engine's draft logits (|Δ log-prob| <= VLM_BOUND) and greedy drafts.
# Below, mlx-vlm's round loop too (``test_assistant_rounds_vs_mlx_vlm_loop``).

VLM_BOUND = 1e-4
VLM_STEPS = 3  # the zoo heads' block_size - 1
VLM_STATES = [(h, p, m) for h in HEADS for p in ("nat-03", "nat-09", "rnd-14") for m in (0, 5)]


def _vlm_state(pid: str, extra: int):  # noqa: ANN202
    """Target state after the prompt and ``extra`` plain greedy tokens: (target, kv, offset, anchor, token)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import zoo
    from engine.sources.assistant import _read_kv, donor_layers
    from engine.taps import capture_layers
    from specparity.runners import load_model

    t = load_model(str(zoo.model_dir("gemma4"))).model
    inner = getattr(t, "language_model", t).model
    cache = make_prompt_cache(t)
    n = len(inner.layers)
    feed = list(zoo.prompt(pid).token_ids)
    for _ in range(extra + 1):
        with capture_layers(t, [n - 1]) as cap:
            logits = t(mx.array(feed)[None], cache=cache)
            mx.eval(logits, cap)
        tok = int(mx.argmax(logits[0, -1]))
        feed = [tok]
    anchor = inner.norm(cap[n - 1][0][-1:].reshape(1, 1, -1))
    don = donor_layers(t)
    kv = {"sliding_attention": _read_kv(cache[don[0]]), "full_attention": _read_kv(cache[don[1]])}
    offset = int(cache[0].offset)
    assert all(k.shape[-2] == offset for k, _ in kv.values()), "state past the sliding window: not comparable"
    return t, kv, offset, anchor, tok


def _engine_steps(head: str, t, kv, offset: int, anchor, tok: int, positions):  # noqa: ANN001, ANN202
    import mlx.core as mx

    from engine.sources.assistant import load_drafter
    from zoo.heads import head_dir

    drafter = load_drafter(head_dir(head))
    inner = getattr(t, "language_model", t).model
    scale = float(getattr(inner, "embed_scale", 1.0))
    out, h = [], anchor
    for pos in positions:
        logits, h = drafter(inner.embed_tokens(mx.array([[tok]])) * scale, h, kv, pos)
        out.append(logits.reshape(-1))
        tok = int(mx.argmax(out[-1]))
    return out


def _dlogprob(a, b) -> float:  # noqa: ANN001
    import mlx.core as mx

    # The centroid head scores only the selected clusters' tokens; the rest is a sentinel:
    # -inf/-1e30 in the engine (optiq), min(selected) - 1 in mlx-vlm. Compare the selected sets,
    # then log-softmax over the selected tokens only (the distribution both heads define).
    def selected(x):  # noqa: ANN001, ANN202
        bad = ~mx.isfinite(x) | (x <= -1e29)
        floor = mx.min(mx.where(bad, mx.inf, x))
        if int((x == floor).sum()) > 1:  # a repeated minimum is mlx-vlm's sentinel
            bad = bad | (x == floor)
        return ~bad

    fa, fb = selected(a), selected(b)
    assert bool(mx.all(fa == fb)), f"different selected token sets ({int(fa.sum())} vs {int(fb.sum())})"
    ma, mb = mx.where(fa, a, -mx.inf), mx.where(fb, b, -mx.inf)
    la, lb = ma - mx.logsumexp(ma), mb - mx.logsumexp(mb)
    return float(mx.max(mx.where(fa, mx.abs(la - lb), 0.0)))


@pytest.mark.oracle
@pytest.mark.parametrize(("head", "pid", "extra"), VLM_STATES)
def test_assistant_draft_logits_vs_mlx_vlm_at_engine_positions(head: str, pid: str, extra: int) -> None:
    require_oracle("mlx_vlm")
    import mlx.core as mx

    from oracles.mlx_vlm import assistant_step_logits
    from zoo.heads import head_dir

    t, kv, off, anchor, tok = _vlm_state(pid, extra)
    positions = [off + k for k in range(VLM_STEPS)]
    eng = _engine_steps(head, t, kv, off, anchor, tok, positions)
    ref = assistant_step_logits(head_dir(head), t, kv, off, anchor, tok, positions)
    worst = max(_dlogprob(a, b) for a, b in zip(eng, ref, strict=True))
    print(f"\n{head}/{pid}+{extra}: worst |dlogprob| {worst:.3g} over {VLM_STEPS} steps at offset+k")
    assert worst <= VLM_BOUND, f"{head}/{pid}+{extra}: {worst} > {VLM_BOUND}"
    assert [int(mx.argmax(x)) for x in eng] == [int(mx.argmax(x)) for x in ref]


@pytest.mark.oracle
def test_mlx_vlm_assistant_fixed_draft_position() -> None:
    """Reproduction of ``mlx-vlm-assistant-fixed-draft-position``: mlx-vlm's unmodified draft_block queries
    every step at kv_offset-1; its drafts are the greedy chain at that fixed position; they differ from the
    engine's (offset+k) on some zoo states, and already step 0's logits differ."""
    require_oracle("mlx_vlm")
    import mlx.core as mx

    from oracles.mlx_vlm import assistant_draft_block, assistant_step_logits
    from zoo.heads import head_dir

    differ = 0
    step0 = []
    for head, pid, extra in VLM_STATES:
        t, kv, off, anchor, tok = _vlm_state(pid, extra)
        drafts, positions = assistant_draft_block(head_dir(head), t, kv, off, anchor, tok, VLM_STEPS + 1)
        assert positions == [off - 1] * VLM_STEPS, positions
        fixed = assistant_step_logits(head_dir(head), t, kv, off, anchor, tok, positions)
        assert drafts == [int(mx.argmax(x)) for x in fixed]
        eng = _engine_steps(head, t, kv, off, anchor, tok, [off + k for k in range(VLM_STEPS)])
        differ += drafts != [int(mx.argmax(x)) for x in eng]
        try:
            step0.append(_dlogprob(eng[0], fixed[0]))
        except AssertionError:  # centroid head: already the selected clusters differ
            step0.append(float("inf"))
    print(f"\nmlx-vlm fixed-position drafts differ from the engine's on {differ}/{len(VLM_STATES)} states; "
          f"step-0 |dlogprob| min {min(step0):.3g}")  # fmt: skip
    assert differ > 0 and min(step0) > 1e-3


# The round loop: mlx-vlm's own ``_mtp_rounds`` on the zoo gemma4 target (weights in mlx-vlm's
# gemma4.Model, untied head + mlx-lm's RoPE parameters mapped; ``oracles.mlx_vlm.run_mtp``).
# Its fixed draft position flips drafts (documented), so: token streams identical (lossless on both
# sides), and the first round-level difference must be a DRAFT with the target samples agreeing.
VLM_LOOP_CASES = [Case("gemma4", h, p, g, 40, source="assistant") for h in HEADS for p in PROMPTS for g in (1, 3)]
_VLM_G4: dict = {}


@pytest.mark.oracle
@pytest.mark.parametrize("case", VLM_LOOP_CASES, ids=lambda c: c.case_id)
def test_assistant_rounds_vs_mlx_vlm_loop(case: Case) -> None:
    require_oracle("mlx_vlm")
    import zoo
    from oracles.mlx_vlm import load_target, run_mtp, version
    from zoo.heads import head_dir

    eng = run_trace("engine", case)
    header = dict(eng.records()[0])
    if "m" not in _VLM_G4:
        _VLM_G4["m"] = load_target(zoo.model_dir("gemma4"))
    body, _ = run_mtp(
        zoo.model_dir("gemma4"), head_dir(case.drafter), list(header["prompt"]["token_ids"]), gamma=case.gamma,
        max_tokens=case.max_tokens, eos_ids=list(header["eos_ids"]), model=_VLM_G4["m"],
    )  # fmt: skip
    header["runner"] = {"name": "mlx_vlm", "package": "mlx-vlm", "version": version()}
    ref = Trace.from_records(mlx_vlm_stopping_eos([header, *body]))
    assert diff_traces(eng, ref, level="tokens") is None, f"{case.case_id}: token streams differ"
    if compare_with_reference(eng, ref, "mlx_vlm").status == "identical":
        print(f"\n{case.case_id}: identical round for round")
        return
    div = diff_traces(eng, ref, level="round")
    print(f"\n{case.case_id}: first difference {div and div.where} drafts")
    assert div is not None and div.where.startswith("round") and div.field == "drafts", div and div.message
    assert "first differing draft" in div.message, div.message
    assert round_samples_agree(eng, ref, div.where), div.message


def test_mlx_vlm_stopping_eos_normalization_can_fail() -> None:
    """``mlx-vlm-stopping-eos`` drops exactly one trailing stopping EOS; anything else is refused."""
    from traces.normalize import NotApplicable, apply

    header = {"type": "header", "eos_ids": [1]}
    rnd = {"type": "round", "index": 0, "drafts": [7], "window": [5, 7], "k_accept": 1, "emitted": [7, 1], "end": "eos"}
    footer = {"type": "footer", "usage": {"finish_reason": "stop", "generation_tokens": 3}, "output_ids": [5, 7, 1]}
    out = apply("mlx-vlm-stopping-eos", [header, rnd, footer])
    assert out[1]["emitted"] == [7] and out[2]["output_ids"] == [5, 7] and out[2]["usage"]["generation_tokens"] == 3
    with pytest.raises(NotApplicable):  # the last token is not an EOS id
        apply("mlx-vlm-stopping-eos", [header, {**rnd, "emitted": [7, 9]}, {**footer, "output_ids": [5, 7, 9]}])
    with pytest.raises(NotApplicable):  # stopped, but the last record did not end on EOS
        apply("mlx-vlm-stopping-eos", [header, {**rnd, "end": "budget"}, footer])
