"""A second, straightforward formulation of native MTP draft logits (GLM / DeepSeek layouts).

mlx-vlm 0.7.10 has no drafter for these checkpoints' families: its GLM drafters
(``speculative/drafters/glm_moe_dsa_mtp``, ``glm5_next_mtp``; ``glm4_moe_lite_mtp``
is a splitter only) run GLM-5's DSA attention (``models/glm_moe_dsa``) and its
DeepSeek drafter (``deepseek_v4_mtp``) DeepSeek-V4's hyper-connection blocks,
neither of which is mlx-lm 0.32.2's ``glm4_moe`` / ``deepseek_v3`` trunk that
the zoo targets use. This module is the independent reference instead. It
never imports ``engine`` (oracle layer) and shares no code with
``engine.sources.native_mtp``: it reads the raw ``model.layers.{N+j}.*``
tensors, builds mlx-lm's decoder layer for the family, and recomputes every
draft row FROM SCRATCH, one row at a time, from the textbook definition
(DeepSeek-V3 report §2.2, vLLM ``deepseek_mtp.py``):

    row q of head j:  x = eh_proj(cat(enorm(E(token)), hnorm(hidden)))   (order per ``concat``)
                      E(token) = 0 when the row's RoPE position is 0 and ``mask_pos0``
                      RoPE position = q + position_base
    head output:      y = layer(x) (causal over the head's own rows), logits = head(norm(y))
    target hidden:    h_q = the last decoder layer's output over the whole final sequence
                      (``hidden = pre-norm``) or the target's final norm of it (``post-norm``)

A round whose pending token sits at index P of the final sequence drafts with
head 0 over rows q = 0..P-1 (``(s[q+1], h_q)``), then chain step i (head ``i mod
D`` under ``depth = chain``, head 0 under ``reuse``) over that head's rows plus
``(d_i, g_{i-1})`` at row position P-1+i, ``g`` being the previous step's output
(pre- or post-``shared_head.norm``, ``chain_hidden``). Which earlier chain rows a
head still holds depends on ``trim``; under ``rebuild`` (every committed row from
the target's verified hidden) none, so every round is recomputed exactly; under
``keep-chain`` only round 0 (no history yet) is — later rounds are not compared
by this reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NAME = "native_mtp_ref"


class _PosRoPE:
    """Replaces a layer's RoPE: rotates at ``pos`` whatever offset the attention passes."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.pos = inner, 0

    def __call__(self, x: Any, offset: Any = 0) -> Any:
        return self.inner(x, offset=self.pos)


class Reference:
    """The checkpoint's MTP heads and target, recomputed row by row."""

    def __init__(self, target_dir: str | Path, checkpoint: str | Path) -> None:
        import mlx.core as mx
        import mlx.nn as nn
        from mlx_lm.utils import _get_classes, load_model

        self.target = load_model(Path(target_dir))[0]
        cfg = json.loads((Path(checkpoint) / "config.json").read_text())
        n = int(cfg["num_hidden_layers"])
        depth = int(cfg.get("num_nextn_predict_layers") or 0)
        model_cls, args_cls = _get_classes(cfg)
        args = args_cls.from_dict(cfg)
        module = __import__(model_cls.__module__, fromlist=["_"])
        layer_cls = getattr(module, "DecoderLayer", None) or module.DeepseekV3DecoderLayer
        raw = {k: v for f in sorted(Path(checkpoint).glob("*.safetensors")) for k, v in mx.load(str(f)).items()}
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.heads = []
        for j in range(depth):
            pre = f"model.layers.{n + j}."
            w = {k[len(pre):]: v for k, v in raw.items() if k.startswith(pre)}
            if not w:
                raise ValueError(f"{checkpoint}: no MTP tensors {pre}*")
            layer = layer_cls(args, n + j)
            layer.load_weights([(k, v) for k, v in w.items() if k.split(".")[0] in
                                ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")],
                               strict=True)
            rope = _PosRoPE(layer.self_attn.rope)
            layer.self_attn.rope = rope

            def norm(weight: Any, eps: float = eps) -> Any:
                return lambda x: mx.fast.rms_norm(x, weight, eps)

            self.heads.append({
                "layer": layer, "rope": rope, "enorm": norm(w["enorm.weight"]),
                "hnorm": norm(w["hnorm.weight"]), "eh_proj": w["eh_proj.weight"],
                "norm": norm(w["shared_head.norm.weight"]),
                "head": w.get("shared_head.head.weight"), "embed": w.get("embed_tokens.weight"),
            })
        self.nn = nn

    def target_hidden(self, tokens: list[int], hidden: str) -> Any:
        """``[T, H]`` last-decoder-layer output over ``tokens`` (one causal forward, no cache)."""
        import mlx.core as mx
        from mlx_lm.models.base import create_attention_mask

        inner = self.target.model
        h = inner.embed_tokens(mx.array(tokens)[None])
        mask = create_attention_mask(h, None, return_array=True)
        for layer in inner.layers:
            h = layer(h, mask, None)
        return (inner.norm(h) if hidden == "post-norm" else h)[0]

    def head_rows(self, j: int, rows: list[tuple[int, Any, int]], conv: dict[str, Any]) -> tuple[Any, Any]:
        """Head ``j`` over ``rows`` = [(token, hidden [H], row position)], one at a time with a
        fresh cache: (pre-norm output, post-norm output) of the LAST row."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        hd = self.heads[j]
        embed_w = hd["embed"] if hd["embed"] is not None else self.target.model.embed_tokens.weight
        cache = KVCache()
        y = None
        for tok, hid, q in rows:
            pos = q + int(conv["position_base"])
            e = embed_w[tok][None, None]
            if conv["mask_pos0"] and pos == 0:
                e = mx.zeros_like(e)
            parts = [hd["enorm"](e), hd["hnorm"](hid.reshape(1, 1, -1))]
            x = mx.concatenate(parts if conv["concat"] == "e;h" else parts[::-1], axis=-1) @ hd["eh_proj"].T
            hd["rope"].pos = pos
            y = hd["layer"](x, None, cache)
        assert y is not None
        return y[0, -1], hd["norm"](y)[0, -1]

    def logits(self, j: int, post: Any) -> Any:
        head = self.heads[j]["head"]
        if head is not None:
            return post @ head.T
        lm = getattr(self.target, "lm_head", None)
        return lm(post) if lm is not None else self.target.model.embed_tokens.as_linear(post)


def draft_logits(ref: Reference, trace: list[dict[str, Any]]) -> dict[tuple[int, int], Any]:
    """``{(round index, draft position): logits [V]}`` recomputed for the rounds of an engine
    trace that this formulation determines (all rounds under ``trim = rebuild``, round 0 under
    ``keep-chain``); conventions from the header's ``params.mtp_conventions``."""
    header = trace[0]
    conv = header["params"]["mtp_conventions"]
    prompt = list(header["prompt"]["token_ids"])
    events = [r for r in trace if r.get("type") in ("plain", "round")]
    seq = prompt + [int(t) for r in events for t in r["emitted"]]
    hid = ref.target_hidden(seq, conv["hidden"])
    depth = len(ref.heads)
    out: dict[tuple[int, int], Any] = {}
    emitted = 0
    rounds = 0
    for r in events:
        if r["type"] == "round" and r["drafts"]:
            p = len(prompt) + emitted - 1  # index of the pending token in seq
            if int(seq[p]) != int(r["feed"][-1]):
                raise ValueError(f"round {r['index']}: feed {r['feed']} is not seq[{p}] = {seq[p]}")
            if conv["trim"] == "rebuild" or rounds == 0:
                base = [(int(seq[q + 1]), hid[q], q) for q in range(p)]
                held: dict[int, list[tuple[int, Any, int]]] = {0: list(base)}
                pre, post = ref.head_rows(0, base, conv)
                out[(r["index"], 0)] = ref.logits(0, post)
                for i in range(1, len(r["drafts"])):
                    g = post if conv["chain_hidden"] == "post-norm" else pre
                    j = i % depth if conv["depth"] == "chain" else 0
                    held.setdefault(j, []).append((int(r["drafts"][i - 1]), g, p - 1 + i))
                    pre, post = ref.head_rows(j, held[j], conv)
                    out[(r["index"], i)] = ref.logits(j, post)
            rounds += 1
        emitted += len(r["emitted"])
    return out


def compare(engine: dict[tuple[int, int], Any], reference: dict[tuple[int, int], Any],
            bound: float) -> list[str]:
    """One line per draft row whose log-probs differ by more than ``bound`` (worst first row
    named by round and position), or whose row one side lacks."""
    import mlx.core as mx

    bad = []
    for key in sorted(reference):
        if key not in engine:
            bad.append(f"round {key[0]}, position {key[1]}: the engine drafted no row here")
            continue
        a, b = engine[key], reference[key]
        d = float(mx.max(mx.abs((a - mx.logsumexp(a)) - (b - mx.logsumexp(b)))).item())
        if d > bound:
            bad.append(f"round {key[0]}, position {key[1]}: |Δ log-prob| {d:.3g} > {bound:g}")
    return bad


def require() -> None:
    """Always available: it needs mlx-lm only (the harness's own dependency)."""
