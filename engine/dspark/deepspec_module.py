"""MLX port of DeepSpec's ``Gemma4DSparkModel`` (the released DSpark drafter).

Reference: DeepSpec (deepseek-ai/DeepSpec, MIT), commit afdfa7c,
``deepspec/modeling/dspark/gemma4/modeling.py`` (``Gemma4DSparkAttention``,
``Gemma4DSparkDecoderLayer``, ``Gemma4DSparkModel._forward_backbone`` /
``compute_logits`` / ``predict_confidence_step``),
``deepspec/modeling/dspark/markov_head.py`` (``VanillaMarkov``) and
``deepspec/eval/dspark/draft_ops.py`` (``forward_dspark_draft_block``,
``build_dspark_proposal``, ``_confident_prefix_length``). §4.3 of the contract.

Per draft block (``draft_block``):

1. The target's tapped hidden rows that arrived since the last block
   (``[L_new, m*H]``, the taps concatenated on the feature axis in
   ``target_layer_ids`` order) are projected ``hidden_norm(fc(.))``.
2. Block input ``[last committed, mask × (block-1)]``, scaled embedding
   (``× sqrt(H)``). Every layer: ``input_layernorm``; Q from the block; ONE
   k_proj over ``[context rows; block]`` (``attention_k_eq_v``: V is the same
   projection, ``v_norm`` without scale, no RoPE on V); QK-norm; partial
   (proportional) RoPE at the absolute positions; attention scale 1.0,
   bidirectional over ``[context cache ++ new context ++ block]``; post-attention
   norm + residual; GeGLU MLP between pre/post feed-forward norms + residual;
   ``× layer_scalar``. Final ``norm``.
3. Logits: untied ``lm_head``, final softcap ``tanh(x/c)·c``.
4. Sequential Markov sampling: ``x_k = argmax(logits_k + W2·W1[x_{k-1}])``,
   ``x_{-1}`` = the block's first input (temperature 0 only, as the oracle).
5. Confidence: ``proj([h_k; W1[x_{k-1}]])`` (logits); the proposal keeps the
   prefix before the first ``sigmoid(c_k) < threshold``; threshold ≤ 0 keeps
   the whole block; ℓ = 0 is allowed.
6. The context cache keeps ONLY the context rows (the draft cache is cropped
   back to the committed length after each block, ``past_key_values.crop``).
   Rows are cached post-norm, post-RoPE: exactly what DeepSpec's
   ``DynamicCache`` holds after ``crop(start)``.

Weights are stored in any float dtype and computed in float32 (the oracle
runs the torch module in float32). Quantized siblings (``quantization`` block
in ``config.json``, ``.scales``/``.biases`` tensors) route every 2-D matmul
through ``mx.quantized_matmul`` and ``embed_tokens`` / ``markov_w1`` through
quantized gathers (mlx ``QuantizedLinear`` / ``QuantizedEmbedding``);
``confidence_head``, norms, ``layer_scalar`` and biases stay unquantized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

ARCHITECTURE = "Gemma4DSparkModel"
QUANTIZED_SKIP = ("confidence_head",)


@dataclass(frozen=True)
class DeepSpecConfig:
    """The fields of a DeepSpec ``config.json`` the forward reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    rope_type: str
    final_logit_softcapping: float | None
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    markov_rank: int
    markov_head_type: str | None
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    hidden_activation: str = "gelu_pytorch_tanh"
    quantization: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DeepSpecConfig:
        archs = cfg.get("architectures") or []
        if not archs or archs[0] != ARCHITECTURE:
            raise ValueError(f"not a DeepSpec drafter: architectures {archs!r} (expected [{ARCHITECTURE!r}])")
        k_eq_v = bool(cfg.get("attention_k_eq_v", False))
        rope = (cfg.get("rope_parameters") or {}).get("full_attention") or {}
        head_type = cfg.get("markov_head_type")
        if int(cfg.get("markov_rank", 0)) > 0 and str(head_type).lower() != "vanilla":
            raise ValueError(f"deepspec: markov_head_type {head_type!r} is not ported (only 'vanilla')")
        if bool(cfg.get("enable_moe_block", False)) or int(cfg.get("hidden_size_per_layer_input", 0) or 0):
            raise ValueError("deepspec: MoE blocks and per-layer input gates are not supported (as in DeepSpec)")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            head_dim=int(cfg["global_head_dim"]),
            num_kv_heads=int(cfg["num_global_key_value_heads"] if k_eq_v else cfg["num_key_value_heads"]),
            k_eq_v=k_eq_v,
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=float(rope.get("rope_theta", 1_000_000.0)),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
            rope_type=str(rope.get("rope_type", "default")),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            target_layer_ids=tuple(int(i) for i in cfg["target_layer_ids"]),
            block_size=int(cfg["block_size"]),
            mask_token_id=int(cfg["mask_token_id"]),
            markov_rank=int(cfg.get("markov_rank", 0)),
            markov_head_type=head_type,
            enable_confidence_head=bool(cfg.get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", False)),
            hidden_activation=str(cfg.get("hidden_activation", "gelu_pytorch_tanh")),
            quantization=cfg.get("quantization"),
            raw=dict(cfg),
        )


def _rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


class _Rope:
    """HF ``proportional`` / ``default`` RoPE over the full head dim (rotate-half layout)."""

    def __init__(self, cfg: DeepSpecConfig) -> None:
        dims = cfg.head_dim
        rotated = int(dims * cfg.partial_rotary_factor) if cfg.rope_type == "proportional" else dims
        exponents = mx.arange(0, rotated, 2, dtype=mx.float32) / dims
        self.freqs = mx.concatenate([cfg.rope_theta**exponents, mx.full(((dims - rotated) // 2,), mx.inf)])
        self.dims = dims

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self.freqs)


class _Attention(nn.Module):
    def __init__(self, cfg: DeepSpecConfig) -> None:
        super().__init__()
        h, nh, hd, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.num_kv_heads
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        if not cfg.k_eq_v:
            self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_eq_v = cfg.k_eq_v
        self.nh, self.hd, self.nkv, self.eps = nh, hd, nkv, cfg.rms_norm_eps


class _Layer(nn.Module):
    def __init__(self, cfg: DeepSpecConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.post_feedforward_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.layer_scalar = mx.ones((1,))


class _MLP(nn.Module):
    def __init__(self, cfg: DeepSpecConfig) -> None:
        super().__init__()
        if cfg.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"deepspec: hidden_activation {cfg.hidden_activation!r} not ported")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class _Markov(nn.Module):
    def __init__(self, cfg: DeepSpecConfig) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)


class _Confidence(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1)


@dataclass
class DraftBlock:
    """One proposal: the sampled block, its confidence and the kept length ℓ."""

    tokens: list[int]  # all block_size sampled tokens
    confidence: list[float] | None  # sigmoid(c_k) for every block position, or None
    keep: int  # ℓ: the confident prefix length (block_size when not truncated)


class Gemma4DSparkModel(nn.Module):
    """The drafter's weights and forward; per-request state lives in :class:`ContextCache`."""

    def __init__(self, cfg: DeepSpecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.layers = [_Layer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        if cfg.markov_rank > 0:
            self.markov_head = _Markov(cfg)
        if cfg.enable_confidence_head:
            dim = h + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_head = _Confidence(dim)
        self.rope = _Rope(cfg)
        self.embed_scale = float(h) ** 0.5
        # DeepSpec normalises V (scale-less RMSNorm). False reproduces mlx-vlm 0.7.10's
        # gemma4_dspark, which omits it (traces/known_divergences.toml); never a default.
        self.apply_v_norm = True

    # ----------------------------------------------------------------- forward

    def project_context(self, feats: mx.array) -> mx.array:
        """``hidden_norm(fc(taps))`` for ``[L, m*H]`` tapped rows."""
        return self.hidden_norm(self.fc(feats.astype(mx.float32)))

    def backbone(
        self, cache: ContextCache, new_ctx: mx.array, block_ids: list[int]
    ) -> tuple[mx.array, list[tuple[mx.array, mx.array]]]:
        """Block hidden ``[B, H]`` and per-layer (K, V) of the new context rows.

        ``new_ctx`` is ``[L_new, H]`` (already projected). The returned K/V are
        what the caller appends to the cache (context rows only).
        """
        n_new = int(new_ctx.shape[0])
        b = len(block_ids)
        start = cache.length + n_new
        x = self.embed_tokens(mx.array(block_ids, mx.uint32)) * self.embed_scale
        x = x.astype(mx.float32)[None]  # [1, B, H]
        ctx = new_ctx[None]
        new_kv: list[tuple[mx.array, mx.array]] = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            residual = x
            hn = layer.input_layernorm(x)
            q = attn.q_proj(hn).reshape(1, b, attn.nh, attn.hd)
            q = attn.q_norm(q).transpose(0, 2, 1, 3)
            kv_in = mx.concatenate([ctx, hn], axis=1)  # [1, L_new + B, H]
            k_raw = attn.k_proj(kv_in).reshape(1, n_new + b, attn.nkv, attn.hd)
            v_raw = k_raw if attn.k_eq_v else attn.v_proj(kv_in).reshape(1, n_new + b, attn.nkv, attn.hd)
            k = attn.k_norm(k_raw).transpose(0, 2, 1, 3)
            v = (_rms_norm(v_raw, None, attn.eps) if self.apply_v_norm else v_raw).transpose(0, 2, 1, 3)
            k = self.rope(k, offset=cache.length)
            q = self.rope(q, offset=start)
            k_all, v_all = k, v
            old_k, old_v = cache.keys[i], cache.values[i]
            if old_k is not None and old_v is not None:
                k_all = mx.concatenate([old_k, k], axis=2)
                v_all = mx.concatenate([old_v, v], axis=2)
            out = mx.fast.scaled_dot_product_attention(q, k_all, v_all, scale=1.0)
            out = out.transpose(0, 2, 1, 3).reshape(1, b, -1)
            h = layer.post_attention_layernorm(attn.o_proj(out))
            x = residual + h
            residual = x
            h = layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
            x = (residual + h) * layer.layer_scalar
            new_kv.append((k[:, :, :n_new], v[:, :, :n_new]))
        return self.norm(x)[0], new_kv

    def logits(self, hidden: mx.array) -> mx.array:
        out = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            out = mx.tanh(out / float(cap)) * float(cap)
        return out

    def draft_block(
        self, cache: ContextCache, new_feats: mx.array | None, first_token: int, threshold: float
    ) -> DraftBlock:
        """Forward one block, sample it sequentially, score confidence, commit the context rows."""
        cfg = self.cfg
        if new_feats is None or int(new_feats.shape[0]) == 0:
            new_ctx = mx.zeros((0, cfg.hidden_size), mx.float32)
        else:
            new_ctx = self.project_context(new_feats)
        block_ids = [int(first_token)] + [cfg.mask_token_id] * (cfg.block_size - 1)
        hidden, new_kv = self.backbone(cache, new_ctx, block_ids)
        base = self.logits(hidden)  # [B, V]
        mx.eval(base, *[a for kv in new_kv for a in kv])
        cache.append(new_kv, int(new_ctx.shape[0]))  # crop: keep the context rows only

        tokens: list[int] = []
        prev = int(first_token)
        prevs: list[int] = []
        for k in range(cfg.block_size):
            row = base[k]
            if cfg.markov_rank > 0:
                row = row + self.markov_head.markov_w2(self.markov_head.markov_w1(mx.array([prev], mx.uint32)))[0]
            prevs.append(prev)
            prev = int(cast(int, mx.argmax(row).item()))
            tokens.append(prev)

        confidence: list[float] | None = None
        keep = cfg.block_size
        if cfg.enable_confidence_head:
            feats = hidden
            if cfg.confidence_head_with_markov:
                emb = self.markov_head.markov_w1(mx.array(prevs, mx.uint32)).astype(hidden.dtype)
                feats = mx.concatenate([hidden, emb], axis=-1)
            logit = self.confidence_head.proj(feats)[:, 0].astype(mx.float32)
            sig = mx.sigmoid(logit)
            confidence = [float(c) for c in cast(list[float], sig.tolist())]
            if threshold > 0.0:
                below = [c < threshold for c in confidence]
                keep = below.index(True) if any(below) else cfg.block_size
        return DraftBlock(tokens=tokens, confidence=confidence, keep=keep)


class ContextCache:
    """Per-request context K/V: one ``[1, n_kv, L, head_dim]`` pair per draft layer."""

    def __init__(self, n_layers: int) -> None:
        self.keys: list[mx.array | None] = [None] * n_layers
        self.values: list[mx.array | None] = [None] * n_layers
        self.length = 0

    def append(self, kv: list[tuple[mx.array, mx.array]], n: int) -> None:
        if n == 0:
            return
        for i, (k, v) in enumerate(kv):
            ki, vi = self.keys[i], self.values[i]
            self.keys[i] = k if ki is None else mx.concatenate([ki, k], axis=2)
            self.values[i] = v if vi is None else mx.concatenate([vi, v], axis=2)
        self.length += n

    def state(self) -> list[mx.array]:
        return [a for pair in zip(self.keys, self.values, strict=True) for a in pair if a is not None]


# ------------------------------------------------------------------- loading


def read_config(path: Path | str) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())


def is_deepspec_dir(path: Path | str) -> bool:
    p = Path(path) / "config.json"
    if not p.exists():
        return False
    archs = json.loads(p.read_text()).get("architectures") or []
    return bool(archs) and archs[0] == ARCHITECTURE


def _quant_predicate(path: str, module: nn.Module) -> bool:
    if any(path.startswith(s) for s in QUANTIZED_SKIP):
        return False
    return isinstance(module, (nn.Linear, nn.Embedding))


def load(path: Path | str) -> Gemma4DSparkModel:
    """Load a DeepSpec-format drafter (bf16/f32, or an mlx affine-quantized sibling)."""
    p = Path(path)
    cfg = DeepSpecConfig.from_dict(read_config(p))
    model = Gemma4DSparkModel(cfg)
    weights: dict[str, mx.array] = {}
    for f in sorted(p.glob("*.safetensors")):
        weights.update(mx.load(str(f)))  # type: ignore[arg-type]
    weights = {k: v for k, v in weights.items() if "rotary_emb" not in k}
    if cfg.quantization is not None:
        q = cfg.quantization
        nn.quantize(model, group_size=int(q["group_size"]), bits=int(q["bits"]),
                    class_predicate=lambda name, m: _quant_predicate(name, m) and f"{name}.scales" in weights)
    # Computed in float32 whatever the storage dtype (the oracle runs float32).
    weights = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def quantize_dir(src: Path | str, dst: Path | str, bits: int, group_size: int = 64) -> Path:
    """Write an mlx affine-quantized sibling of a DeepSpec drafter dir (§4.3).

    Every 2-D matmul weight and the ``embed_tokens`` / ``markov_w1`` gather
    tables are quantized; ``confidence_head``, norms, ``layer_scalar`` stay as
    they are. ``config.json`` keeps the architecture stamp and gains
    ``quantization: {bits, group_size}``.
    """
    from engine.models import parameters

    src, dst = Path(src), Path(dst)
    model = load(src)
    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=_quant_predicate)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = read_config(src)
    cfg["quantization"] = {"group_size": group_size, "bits": bits}
    flat = parameters(model)
    mx.save_safetensors(str(dst / "model.safetensors"), flat, metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dst


def weights_bytes(model: Gemma4DSparkModel) -> int:
    from mlx.utils import tree_flatten

    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return int(sum(v.nbytes for _, v in flat))


__all__ = [
    "ARCHITECTURE",
    "ContextCache",
    "DeepSpecConfig",
    "DraftBlock",
    "Gemma4DSparkModel",
    "is_deepspec_dir",
    "load",
    "quantize_dir",
    "weights_bytes",
]
