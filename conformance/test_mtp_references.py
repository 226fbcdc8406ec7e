"""Draft-logit parity: the engine's ``mtp`` head vs mlx-vlm's ``qwen3_5_mtp`` drafter.

For each draft position — every prefill row ``(embed(token_{p+1}), hidden_p)``
of a zoo prompt on ``qwen35`` and ``CHAIN`` greedy steps chained on the
drafter's own hidden — the engine head's log-probs are compared with mlx-vlm
0.7.10's on the SAME inputs (the target's pre-final-norm hidden rows from the
engine's tap). Bound: |Δ log-prob| <= ``BOUND`` (float32 on both sides, the same
weights; mlx-vlm uses its own qwen3_5 decoder layer and rope). Greedy chained
tokens must be identical. Runs in ``tox -e vlm``.
"""

from __future__ import annotations

import pytest

from conformance.conftest import require_oracle

BOUND = 1e-3
CHAIN = 3
HEADS = ("qwen35-mtp", "qwen35-mtp-self")
PROMPTS = ("nat-00", "nat-03", "rnd-00")


@pytest.mark.oracle
@pytest.mark.parametrize("pid", PROMPTS)
@pytest.mark.parametrize("head", HEADS)
def test_mtp_draft_logit_parity_vs_mlx_vlm(head: str, pid: str) -> None:
    require_oracle("mlx_vlm")
    import mlx.core as mx

    from engine import zoo
    from engine.sources.mtp import load_head, target_parts
    from engine.taps import capture_layers
    from engine.zoo.heads import head_dir
    from oracles.mlx_vlm import draft_logits
    from specparity.runners import load_model

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
