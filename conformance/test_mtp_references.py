"""Draft-logit parity: the engine's ``mtp`` head vs mlx-vlm's ``qwen3_5_mtp`` drafter.

For each draft position — every prefill row ``(embed(token_{p+1}), hidden_p)``
of a zoo prompt on ``qwen35`` and ``CHAIN`` greedy steps chained on the
drafter's own hidden — the engine head's log-probs are compared with mlx-vlm
0.7.10's on the SAME inputs (the target's pre-final-norm hidden rows from the
engine's tap). Bound: |Δ log-prob| <= ``BOUND`` (float32 on both sides, the same
weights; mlx-vlm uses its own qwen3_5 decoder layer and rope). Greedy chained
tokens must be identical. Runs in ``tox -e vlm``.

Round loop: mlx-vlm's own ``_mtp_rounds`` (``oracles.mlx_vlm.run_mtp``: its
``generate_step`` unmodified, block size pinned to γ+1 <= the head's
``block_size``, unchunked prefill so the drafter sees every prompt row) vs the
engine ``mtp`` source, round for round at temperature 0 (feed, drafts, window,
samples, k_accept, emitted, end, counters), with real partial accepts and
gated-DeltaNet rollbacks. mlx-vlm 0.7.10 feeds its drafter the target's
POST-final-norm hidden where §3 (and the engine) use the PRE-final-norm one
(documented behaviour ``mlx-vlm-mtp-post-norm-hidden``, reproduced below).
That flips some draft tokens (both heads; e.g. self head nat-02 round 7), so
a run must be identical round for round up to its first differing DRAFT
(never a target sample), and the token streams must be identical (lossless
on both sides). With the §3-aligned target adapter (``load_target(...,
hidden="pre-norm")``: final norm moved into the target's head, loop and
drafter unmodified) every run must be identical round for round.
"""

from __future__ import annotations

import pytest

from conformance.conftest import require_oracle
from traces.testing import round_samples_agree

BOUND = 1e-3
CHAIN = 3
HEADS = ("qwen35-mtp", "qwen35-mtp-self")
PROMPTS = ("nat-00", "nat-03", "rnd-00")
LOOP_PROMPTS = ("nat-00", "nat-01", "nat-02", "nat-03", "rnd-00")
LOOP_N = 40


def _loop_cases(head: str) -> list:
    from specparity.cases.case import Case

    return [Case("qwen35", head, p, g, LOOP_N, source="mtp") for p in LOOP_PROMPTS for g in (1, 2)]


_VLM_TARGET: dict = {}


def _vlm_trace(case, eng, hidden: str = "native"):  # noqa: ANN001, ANN202
    """mlx-vlm's round loop on ``case``, as a trace carrying the engine trace's header (runner swapped)."""
    import zoo
    from oracles.mlx_vlm import load_target, run_mtp, version
    from traces.io import Trace
    from zoo.heads import head_dir

    if hidden not in _VLM_TARGET:
        _VLM_TARGET[hidden] = load_target(zoo.model_dir(case.target), hidden=hidden)
    header = dict(eng.records()[0])
    body, _ = run_mtp(
        zoo.model_dir(case.target), head_dir(case.drafter), list(header["prompt"]["token_ids"]),
        gamma=case.gamma, max_tokens=case.max_tokens, eos_ids=list(header["eos_ids"]), model=_VLM_TARGET[hidden],
    )  # fmt: skip
    header["runner"] = {"name": "mlx_vlm", "package": "mlx-vlm", "version": version()}
    return Trace.from_records([header, *body])


ALL_LOOP_CASES = _loop_cases("qwen35-mtp-self") + _loop_cases("qwen35-mtp")


@pytest.mark.oracle
@pytest.mark.parametrize("case", ALL_LOOP_CASES, ids=lambda c: c.case_id)
def test_mtp_round_for_round_vs_mlx_vlm_prenorm(case) -> None:  # noqa: ANN001
    """mlx-vlm's loop and drafter unmodified on the §3-aligned target adapter (pre-norm hidden): identical."""
    require_oracle("mlx_vlm")
    from conformance.conftest import run_trace
    from traces.reference import compare_with_reference

    eng = run_trace("engine", case)
    verdict = compare_with_reference(eng, _vlm_trace(case, eng, "pre-norm"), "mlx_vlm")
    assert verdict.status == "identical", f"{case.case_id}: engine vs mlx-vlm (pre-norm)\n{verdict.format()}"


@pytest.mark.oracle
def test_mlx_vlm_mtp_loop_partial_accepts_and_rollbacks() -> None:
    """The identical runs are not vacuous: partial accepts (0 < k < d) and rejected drafts (DeltaNet rollbacks)."""
    require_oracle("mlx_vlm")
    from conformance.conftest import run_trace
    from traces.diff import diff_traces

    partial = rejected = identical = 0
    for case in _loop_cases("qwen35-mtp-self"):
        eng = run_trace("engine", case)
        ref = _vlm_trace(case, eng, "pre-norm")
        identical += diff_traces(eng, ref, level="round") is None
        partial += sum(1 for r in ref.rounds if 0 < r["k_accept"] < len(r["drafts"]))
        rejected += ref.footer["speculation"]["rejected"]
    print(f"\nmlx-vlm MTP loop (pre-norm), self head: {identical}/10 identical, {partial} partial-accept rounds")
    assert partial > 0 and rejected > 0 and identical > 0, (partial, rejected, identical)


@pytest.mark.oracle
@pytest.mark.parametrize("case", ALL_LOOP_CASES, ids=lambda c: c.case_id)
def test_mtp_rounds_vs_mlx_vlm_native(case) -> None:  # noqa: ANN001
    """Round for round up to the first draft that the documented ``mlx-vlm-mtp-post-norm-hidden``
    flips; that difference must be a draft (target samples agree), and the token streams identical."""
    require_oracle("mlx_vlm")
    from conformance.conftest import run_trace
    from traces.diff import diff_traces

    eng = run_trace("engine", case)
    ref = _vlm_trace(case, eng)
    assert diff_traces(eng, ref, level="tokens") is None, f"{case.case_id}: token streams differ"
    div = diff_traces(eng, ref, level="round")
    if div is not None:
        assert div.where.startswith("round") and div.field == "drafts", div.message
        assert "first differing draft" in div.message, div.message
        assert round_samples_agree(eng, ref, div.where), div.message


@pytest.mark.oracle
def test_mlx_vlm_mtp_feeds_post_norm_hidden() -> None:
    """Reproduction of ``mlx-vlm-mtp-post-norm-hidden``: the verify hidden mlx-vlm hands its MTP drafter
    equals the target's final-norm output, not the pre-final-norm last-layer output §3 prescribes."""
    require_oracle("mlx_vlm")
    import mlx.core as mx

    import zoo
    from engine.taps import capture_layers
    from oracles.mlx_vlm import load_target
    from specparity.runners import load_model

    ids = list(zoo.prompt("rnd-00").token_ids)
    vlm = load_target(zoo.model_dir("qwen35"))
    hidden = vlm.language_model(mx.array([ids]), return_hidden=True).hidden_states[-1][0]
    target = load_model(str(zoo.model_dir("qwen35"))).model
    n = len(target.layers)
    with capture_layers(target, [n - 1]) as cap:
        mx.eval(target(mx.array(ids)[None]), cap)
    pre = cap[n - 1][0]
    post = target.model.norm(pre)
    assert float(mx.abs(hidden - post).max()) < 1e-4
    assert float(mx.abs(hidden - pre).max()) > 1e-1


def test_mlx_vlm_rebuild_refuses_inconsistent_logs() -> None:
    """The round rebuild checks the yielded stream against the walk (model-free; runs in the default venv)."""
    from oracles.mlx_vlm import _rebuild_mtp

    log = [("verify", [5, 7, 8], [1.0, 1.0, 1.0]), ("walk", 1, [7, 9], [7, 9, 3])]
    recs = _rebuild_mtp(log, [1, 2, 3], [5, 7, 9], 1.0, {0}, 0.0)
    rnd = recs[2]
    assert (rnd["drafts"], rnd["k_accept"], rnd["emitted"], rnd["end"]) == ([7, 8], 1, [7, 9], "budget")
    with pytest.raises(RuntimeError):
        _rebuild_mtp(log, [1, 2, 3], [5, 7, 4], 1.0, {0}, 0.0)
    with pytest.raises(RuntimeError):
        _rebuild_mtp([("verify", [6, 7, 8], [1.0] * 3), log[1]], [1, 2, 3], [5, 7, 9], 1.0, {0}, 0.0)


@pytest.mark.oracle
@pytest.mark.parametrize("pid", PROMPTS)
@pytest.mark.parametrize("head", HEADS)
def test_mtp_draft_logit_parity_vs_mlx_vlm(head: str, pid: str) -> None:
    require_oracle("mlx_vlm")
    import mlx.core as mx

    import zoo
    from engine.sources.mtp import load_head, target_parts
    from engine.taps import capture_layers
    from oracles.mlx_vlm import draft_logits
    from specparity.runners import load_model
    from zoo.heads import head_dir

    target = load_model(str(zoo.model_dir("qwen35"))).model
    ids = list(zoo.prompt(pid).token_ids)
    n = len(target.layers)
    with capture_layers(target, [n - 1]) as cap:
        logits = target(mx.array(ids)[None])
        mx.eval(logits, cap)
    hidden = cap[n - 1][0]
    bonus = int(mx.argmax(logits[0, -1]))
    rows = ids[1:] + [bonus]
    embed, scale, lm_head, _ = target_parts(target)

    ref_rows, ref_chain = draft_logits(head_dir(head), embed.weight, lm_head.weight, rows, hidden, CHAIN)

    mtp, _ = load_head(head_dir(head))
    cache = mtp.make_cache()
    h = mtp(embed(mx.array(rows)[None]) * scale, hidden[None], cache)
    eng_rows = lm_head(h)[0]
    chain = []
    hp = h[:, -1:, :]
    for _ in range(CHAIN):
        tok = mx.argmax(lm_head(hp), axis=-1)
        hp = mtp(embed(tok.astype(mx.uint32)) * scale, hp, cache)
        chain.append(lm_head(hp)[0, 0])
    eng_chain = mx.stack(chain)

    def lp(x):
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    worst = max(float(mx.abs(lp(eng_rows) - lp(ref_rows)).max()), float(mx.abs(lp(eng_chain) - lp(ref_chain)).max()))
    print(f"\n{head}/{pid}: worst |dlogprob| {worst:.3g} over {len(rows)} rows + {CHAIN} chained steps")
    assert worst <= BOUND, f"{head}/{pid}: worst |dlogprob| {worst} > {BOUND}"
    assert mx.argmax(eng_chain, -1).tolist() == mx.argmax(ref_chain, -1).tolist()
    assert mx.argmax(eng_rows, -1).tolist() == mx.argmax(ref_rows, -1).tolist()
