"""Our DSpark block drafter (§4.1): KV injection + Markov head + confidence head.

Reference: ``../shared/reference/speculative-decoding.md`` §4.1 (mlx-bun
``src/spec/dspark/module-dflash.ts``, paper Eq 2–3, 5, 7 and Alg 1 in its
single-user form). The arithmetic of one block is the DFlash/DSpark drafter of
mlx-vlm 0.7.10 (``mlx_vlm/speculative/drafters/qwen3_dflash/dflash.py``
``DFlashAttention`` / ``DFlashDraftModel._hidden`` and
``drafters/dspark/dspark.py`` ``DSparkDraftModel``), so that mlx-vlm can run
the same checkpoint as a second reference:

- Eq 2: the tapped target rows ``[L, m*H]`` (taps concatenated in
  ``tap_layers`` order) are projected ``H_ctx = hidden_norm(fc(.))``;
- Eq 3: every layer projects the context with its OWN ``k_proj``/``v_proj``
  (K is QK-normed, V is not), the block ``[anchor, mask × (γ-1)]`` likewise;
  Q from the block; the block attends bidirectionally over
  ``[context cache ++ new context ++ block]`` (scale ``head_dim^-1/2``,
  RoPE at absolute positions). Only context rows are cached;
- the backbone layers are Qwen3-style (RMSNorm, SwiGLU); the token embedding
  (times the target's ``embed_scale``) and the lm-head are the TARGET's
  (``share_target_embeddings``), with the optional final softcap;
- Eq 5 Markov head: ``x_k = argmax(logits_k + W2·W1[x_{k-1}])``, sequential,
  ``x_{-1}`` the anchor (position 0 predicts the first draft);
- Eq 7 confidence head: ``c_k = σ(wᵀ[h_k; W1[x_{k-1}]] + b)`` (the bias is
  our superset);
- Alg 1, single-user form: position ``k >= 1`` is dropped, and the block
  truncated there, when ``c_k < thresholds[k]`` (or ``min_conf``); position 0
  always survives; an uncalibrated checkpoint drafts fixed γ. Pruning changes
  how many positions the target verifies, never what is emitted.

Checkpoint: ``dspark.json`` (``variant: "dspark"``; legacy ``"dflash"``
accepted) + ``model.safetensors`` (mlx-vlm key names) + an mlx-vlm
``config.json`` (``Qwen3DSparkModel`` with ``dflash_config``).
:mod:`engine.dspark.loader` dispatches by variant and refuses v1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

VARIANT = "dspark"
LEGACY_VARIANTS = ("dflash",)
FORMAT = 2


@dataclass(frozen=True)
class DSparkConfig:
    gamma: int
    tap_layers: tuple[int, ...]
    mask_token_id: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    markov_rank: int
    confidence_with_markov: bool = True
    final_logit_softcapping: float | None = None
    thresholds: tuple[float, ...] | None = None
    min_conf: float | None = None
    variant: str = VARIANT
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DSparkConfig:
        b = d["backbone"]
        return cls(
            gamma=int(d["gamma"]), tap_layers=tuple(int(i) for i in d["tap_layers"]),
            mask_token_id=int(d["mask_token_id"]), hidden_size=int(b["hidden_size"]),
            intermediate_size=int(b["intermediate_size"]), num_hidden_layers=int(b["num_hidden_layers"]),
            num_attention_heads=int(b["num_attention_heads"]), num_key_value_heads=int(b["num_key_value_heads"]),
            head_dim=int(b["head_dim"]), rms_norm_eps=float(b["rms_norm_eps"]), rope_theta=float(b["rope_theta"]),
            vocab_size=int(d["vocab_size"]), markov_rank=int(d["markov_rank"]),
            confidence_with_markov=bool(d.get("confidence_with_markov", True)),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            thresholds=tuple(float(t) for t in d["thresholds"]) if d.get("thresholds") is not None else None,
            min_conf=float(d["min_conf"]) if d.get("min_conf") is not None else None,
            variant=str(d["variant"]), raw=dict(d),
        )

    def threshold(self, k: int, override: float | None = None) -> float:
        """The pruning threshold of block position ``k`` (0: never pruned)."""
        if k == 0:
            return 0.0
        if override is not None:
            return override
        if self.thresholds is not None and k < len(self.thresholds):
            return self.thresholds[k]
        return self.min_conf or 0.0


class _Attention(nn.Module):
    def __init__(self, c: DSparkConfig) -> None:
        super().__init__()
        h, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=c.rms_norm_eps)
        self.nh, self.nkv, self.hd = nh, nkv, hd


class _MLP(nn.Module):
    def __init__(self, c: DSparkConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: DSparkConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)


class _Markov(nn.Module):
    def __init__(self, c: DSparkConfig) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(c.vocab_size, c.markov_rank)
        self.markov_w2 = nn.Linear(c.markov_rank, c.vocab_size, bias=False)


class _Confidence(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1)


class ContextKV:
    """Per-request context K/V (RoPE'd keys, raw values), one pair per layer."""

    def __init__(self, n_layers: int) -> None:
        self.keys: list[mx.array | None] = [None] * n_layers
        self.values: list[mx.array | None] = [None] * n_layers
        self.length = 0


@dataclass
class Block:
    tokens: list[int]
    confidence: list[float]
    keep: int  # ℓ >= 1: the surviving prefix


class DSparkModel(nn.Module):
    def __init__(self, c: DSparkConfig) -> None:
        super().__init__()
        self.cfg = c
        self.fc = nn.Linear(len(c.tap_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = [_Layer(c) for _ in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.markov_head = _Markov(c)
        self.confidence_head = _Confidence(c.hidden_size + (c.markov_rank if c.confidence_with_markov else 0))
        self.rope = nn.RoPE(c.head_dim, traditional=False, base=c.rope_theta)

    def draft_block(
        self, cache: ContextKV, feats: mx.array | None, anchor: int, embed: Any, lm_head: Any,
        threshold: float | None = None,
    ) -> Block:
        """One block: context rows ``feats`` ([L, m*H]) join the cache; γ drafts sampled."""
        c = self.cfg
        ctx = (self.hidden_norm(self.fc(feats.astype(mx.float32)))[None] if feats is not None and feats.shape[0]
               else mx.zeros((1, 0, c.hidden_size), mx.float32))
        s = int(ctx.shape[1])
        ids = [int(anchor)] + [c.mask_token_id] * (c.gamma - 1)
        x = embed(mx.array(ids, mx.uint32)[None]).astype(mx.float32)
        scale = 1.0 / (c.head_dim**0.5)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            xn = layer.input_layernorm(x)
            b = x.shape[1]
            q = a.q_norm(a.q_proj(xn).reshape(1, b, a.nh, a.hd)).transpose(0, 2, 1, 3)
            ck = a.k_norm(a.k_proj(ctx).reshape(1, s, a.nkv, a.hd)).transpose(0, 2, 1, 3)
            cv = a.v_proj(ctx).reshape(1, s, a.nkv, a.hd).transpose(0, 2, 1, 3)
            pk = a.k_norm(a.k_proj(xn).reshape(1, b, a.nkv, a.hd)).transpose(0, 2, 1, 3)
            pv = a.v_proj(xn).reshape(1, b, a.nkv, a.hd).transpose(0, 2, 1, 3)
            q = self.rope(q, offset=cache.length + s)
            ck = self.rope(ck, offset=cache.length)
            pk = self.rope(pk, offset=cache.length + s)
            old_k, old_v = cache.keys[i], cache.values[i]
            if old_k is not None and old_v is not None:
                ck = mx.concatenate([old_k, ck], axis=2)
                cv = mx.concatenate([old_v, cv], axis=2)
            cache.keys[i], cache.values[i] = ck, cv
            keys = mx.concatenate([ck, pk], axis=2)
            values = mx.concatenate([cv, pv], axis=2)
            o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)
            x = x + a.o_proj(o.transpose(0, 2, 1, 3).reshape(1, b, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        cache.length += s
        hidden = self.norm(x)[0]
        logits = lm_head(hidden)
        if c.final_logit_softcapping is not None:
            cap = float(c.final_logit_softcapping)
            logits = mx.tanh(logits / cap) * cap
        mx.eval(logits, *[t for t in [*cache.keys, *cache.values] if t is not None])
        tokens: list[int] = []
        prevs: list[int] = []
        prev = int(anchor)
        for k in range(c.gamma):
            row = logits[k] + self.markov_head.markov_w2(self.markov_head.markov_w1(mx.array([prev], mx.uint32)))[0]
            prevs.append(prev)
            prev = int(cast(int, mx.argmax(row).item()))
            tokens.append(prev)
        feats_c = hidden
        if c.confidence_with_markov:
            feats_c = mx.concatenate([hidden, self.markov_head.markov_w1(mx.array(prevs, mx.uint32))], axis=-1)
        sig = mx.sigmoid(self.confidence_head.proj(feats_c)[:, 0].astype(mx.float32))
        conf = [float(v) for v in cast(list[float], sig.tolist())]
        keep = c.gamma
        for k in range(1, c.gamma):  # position 0 always survives
            if conf[k] < c.threshold(k, threshold):
                keep = k
                break
        return Block(tokens=tokens, confidence=conf, keep=keep)


def read_dspark_json(path: Path | str) -> dict[str, Any]:
    return json.loads((Path(path) / "dspark.json").read_text())


def load_dspark(path: Path | str) -> DSparkModel:
    """Load a v2 ``dspark`` checkpoint (use :func:`engine.dspark.loader.load_drafter`)."""
    p = Path(path)
    cfg = DSparkConfig.from_json(read_dspark_json(p))
    model = DSparkModel(cfg)
    weights = dict(mx.load(str(p / "model.safetensors")))  # type: ignore[arg-type]
    weights = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def save_thresholds(path: Path | str, thresholds: list[float]) -> None:
    """Patch calibrated per-position thresholds into ``dspark.json`` in place."""
    p = Path(path) / "dspark.json"
    d = json.loads(p.read_text())
    d["thresholds"] = [float(t) for t in thresholds]
    p.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
