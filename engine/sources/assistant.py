"""The ``assistant`` draft source: a Gemma-4 ``-assistant`` Q-only drafter head.

Roster row ``assistant`` of ``../shared/reference/speculative-decoding.md`` §3
(mlx-bun ``src/spec/assistant-source.ts`` + ``drafter.ts``). Reference:
mlx-optiq 0.7.7 ``optiq/runtime/spec/drafters/gemma_assistant.py``
(``GemmaAssistantDrafter.forward``, ``_AssistantBlock``, ``_centroid_decode``),
``optiq/runtime/spec/kv_view.py`` (``extract_typed_kv``) and
``optiq/runtime/spec/runtime.py`` ``spec_generate`` (position, embedding scale,
greedy drafting). The math is mirrored op for op so that greedy drafts match.

Per draft step the drafter borrows, through ``TargetView``: the target's K/V of
its last sliding and last full attention layer (read chronologically from the
LIVE caches, never written), the target's scaled ``embed_tokens`` and the
anchor hidden (the executor's pre-final-norm row, passed through the target's
final norm: optiq's drafter reads ``model.model(...)``, which returns
``norm(h)``). Step ``k`` queries at absolute position ``offset + k`` and chains
its own ``post_projection`` output. Drafting is greedy (lossless; not parity at
temperature > 0, §1).

The output head is picked by TENSOR PRESENCE (§3): ``masked_embedding.centroids``
present → centroid head; else ``lm_head.weight`` present → untied head; else
the tied embedding. optiq picks it from the config flags instead.

``prefill_mode = "full"``: the whole prompt is prefilled and the first token is
the prefill's own sample, as in optiq's ``spec_generate``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.sampler import StepSampler
from engine.seam import DraftSourceBase, PrefillMode, TapContext, TargetView
from engine.sources.kind import OpenOptions, SourceKind

KIND = "assistant"
PREFILL: PrefillMode = "full"  # §2.1; the source and its descriptor share it
CENTROIDS = "masked_embedding.centroids.weight"
ORDERING = "masked_embedding.token_ordering"


@dataclass(frozen=True)
class AssistantConfig:
    backbone_hidden_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    sliding_window: int
    vocab_size: int
    head: str  # "centroid" | "untied" | "tied" (from tensor presence)
    num_centroids: int = 0
    centroid_top_k: int = 0
    rope_theta_full: float = 1_000_000.0
    rope_theta_sliding: float = 10_000.0
    full_partial_rotary_factor: float = 1.0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], tensors: set[str]) -> AssistantConfig:
        tc = cfg.get("text_config", cfg)
        rope = tc.get("rope_parameters") or {}
        full_p, slide_p = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        head = "centroid" if CENTROIDS in tensors else ("untied" if "lm_head.weight" in tensors else "tied")
        n_c = int(cfg.get("num_centroids") or 0)
        if head == "centroid" and not (n_c and cfg.get("centroid_intermediate_top_k")):
            raise ValueError("assistant: centroid tensors present but num_centroids/top_k missing")
        return cls(
            backbone_hidden_size=int(cfg.get("backbone_hidden_size") or tc.get("backbone_hidden_size")),
            hidden_size=int(tc["hidden_size"]),
            intermediate_size=int(tc["intermediate_size"]),
            num_attention_heads=int(tc["num_attention_heads"]),
            num_key_value_heads=int(tc["num_key_value_heads"]),
            head_dim=int(tc["head_dim"]),
            global_head_dim=int(tc.get("global_head_dim") or tc["head_dim"]),
            rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
            layer_types=tuple(tc["layer_types"]),
            sliding_window=int(tc.get("sliding_window", 512)),
            vocab_size=int(tc["vocab_size"]),
            head=head,
            num_centroids=n_c if head == "centroid" else 0,
            centroid_top_k=int(cfg.get("centroid_intermediate_top_k") or 0) if head == "centroid" else 0,
            rope_theta_full=float(full_p.get("rope_theta", 1_000_000.0)),
            rope_theta_sliding=float(slide_p.get("rope_theta", 10_000.0)),
            full_partial_rotary_factor=float(full_p.get("partial_rotary_factor", 1.0)),
        )


def _rms(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x.astype(mx.float32), w, eps).astype(x.dtype)


class _Norm(nn.Module):
    """Gemma-4 raw-scale RMSNorm (optiq ``_RMSNorm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.zeros((dim,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return _rms(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, cfg: AssistantConfig, full: bool) -> None:
        super().__init__()
        from mlx_lm.models.rope_utils import initialize_rope

        self.head_dim = cfg.global_head_dim if full else cfg.head_dim
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = _Norm(self.head_dim, cfg.rms_norm_eps)
        if full:
            self.rope = initialize_rope(
                self.head_dim, traditional=False, base=cfg.rope_theta_full,
                scaling_config={"rope_type": "proportional", "factor": 1.0,
                                "partial_rotary_factor": cfg.full_partial_rotary_factor},
            )  # fmt: skip
        else:
            self.rope = initialize_rope(self.head_dim, traditional=False, base=cfg.rope_theta_sliding)

    def __call__(self, x: mx.array, keys: mx.array, values: mx.array, position: int, mask: Any) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim))
        q = self.rope(q.transpose(0, 2, 1, 3), offset=position)
        groups = self.n_heads // self.n_kv
        if groups > 1:
            keys, values = mx.repeat(keys, groups, axis=1), mx.repeat(values, groups, axis=1)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=1.0, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: AssistantConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, cfg: AssistantConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = _Attention(cfg, layer_type == "full_attention")
        self.mlp = _MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = _Norm(cfg.hidden_size, eps)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = _Norm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = _Norm(cfg.hidden_size, eps)
        self.layer_scalar = mx.zeros((1,))

    def __call__(self, h: mx.array, kv: dict[str, tuple[mx.array, mx.array]], position: int, window: int) -> mx.array:
        k, v = kv[self.layer_type]
        mask = None
        if self.layer_type == "sliding_attention":
            k_len = k.shape[-2]
            first = position - k_len + 1
            allowed_from = max(0, max(0, position - window + 1) - first)
            if allowed_from > 0:
                mask = mx.where(mx.arange(k_len) < allowed_from, mx.array(-1e9, h.dtype),
                                mx.zeros((1, 1, 1, k_len), h.dtype))
        a = self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), k, v, position, mask))
        h = h + a
        m = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return (h + m) * self.layer_scalar


class _Inner(nn.Module):
    def __init__(self, cfg: AssistantConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [_Block(cfg, t) for t in cfg.layer_types]
        self.norm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)


class _Masked(nn.Module):
    def __init__(self, cfg: AssistantConfig) -> None:
        super().__init__()
        self.centroids = nn.Linear(cfg.hidden_size, cfg.num_centroids, bias=False)
        self.token_ordering = mx.zeros((cfg.vocab_size,), dtype=mx.int32)


class AssistantDrafter(nn.Module):
    """HF ``gemma4_assistant`` tensor names; the forward of optiq's ``GemmaAssistantDrafter``."""

    def __init__(self, cfg: AssistantConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _Inner(cfg)
        self.pre_projection = nn.Linear(2 * cfg.backbone_hidden_size, cfg.hidden_size, bias=False)
        self.post_projection = nn.Linear(cfg.hidden_size, cfg.backbone_hidden_size, bias=False)
        if cfg.head == "centroid":
            self.masked_embedding = _Masked(cfg)
        elif cfg.head == "untied":
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(self, token_emb: mx.array, hidden: mx.array, kv: dict, position: int) -> tuple[mx.array, mx.array]:
        """(logits ``[V]``, next hidden ``[1, 1, backbone]``) for one draft step."""
        h = self.pre_projection(mx.concatenate([token_emb, hidden], axis=-1))
        for blk in self.model.layers:
            h = blk(h, kv, position, self.cfg.sliding_window)
        h = self.model.norm(h)
        if self.cfg.head == "centroid":
            logits = self._centroid_logits(h)
        elif self.cfg.head == "untied":
            logits = self.lm_head(h)
        else:
            logits = self.model.embed_tokens.as_linear(h)
        return logits.squeeze(0).squeeze(0), self.post_projection(h)

    def _centroid_logits(self, h: mx.array) -> mx.array:
        cfg = self.cfg
        scores = h @ self.masked_embedding.centroids.weight.T
        top_k = min(cfg.centroid_top_k, cfg.num_centroids)
        top = mx.argpartition(-scores, kth=top_k - 1, axis=-1)[..., :top_k]
        vpc = cfg.vocab_size // cfg.num_centroids
        ids = self.masked_embedding.token_ordering.reshape(cfg.num_centroids, vpc)[top]
        cand = self.model.embed_tokens.weight[ids]
        s = (h[..., None, None, :] * cand).sum(axis=-1).reshape(1, 1, top_k * vpc)
        logits = mx.full((1, 1, cfg.vocab_size), -1e30, dtype=h.dtype)
        return mx.put_along_axis(logits, ids.reshape(1, 1, -1).astype(mx.int32), s.astype(logits.dtype), axis=-1)


def load_drafter(path: str | Path) -> AssistantDrafter:
    """Load a ``gemma4_assistant`` directory (offline); every module parameter must be present."""
    from engine.models import parameters

    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise ValueError(f"assistant: {p} has no config.json")
    cfg_dict = json.loads((p / "config.json").read_text())
    if "assistant" not in str(cfg_dict.get("model_type", "")):
        raise ValueError(f"assistant: {p}: model_type {cfg_dict.get('model_type')!r} is not an assistant")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ValueError(f"assistant: {p} has no *.safetensors")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))  # type: ignore[arg-type]
    cfg = AssistantConfig.from_dict(cfg_dict, set(weights))
    model = AssistantDrafter(cfg)
    if ORDERING in weights:
        weights[ORDERING] = weights[ORDERING].astype(mx.int32)
    want = set(parameters(model))
    missing = sorted(want - set(weights))
    if missing:
        raise ValueError(f"assistant: {p}: parameters missing from the checkpoint: {missing[:8]}")
    model.load_weights([(k, v) for k, v in weights.items() if k in want], strict=True)
    mx.eval(model.parameters())
    return model


def donor_layers(target_model: Any) -> tuple[int, int]:
    """Cache indices of the last sliding and last full attention donor layers (optiq ``find_donor_layers``)."""
    lm = getattr(target_model, "language_model", target_model)
    model = lm.model if hasattr(lm, "model") else lm
    sliding = full = -1
    idx = 0
    for layer in model.layers:
        if not getattr(layer.self_attn, "has_kv", True):
            continue
        lt = getattr(layer, "layer_type", "full_attention")
        if lt == "sliding_attention":
            sliding = idx
        elif lt == "full_attention":
            full = idx
        idx += 1
    if sliding < 0 or full < 0:
        raise ValueError(f"assistant: the target needs a sliding and a full attention donor layer "
                         f"(found sliding={sliding}, full={full})")
    return sliding, full


def _read_kv(cache: Any) -> tuple[mx.array, mx.array]:
    """(K, V) in chronological order (optiq ``_read_cache_temporal``); read-only."""
    if cache.keys is None:
        raise RuntimeError("assistant: donor cache is empty")
    if hasattr(cache, "_temporal_order"):
        k, v = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
        valid = min(cache.offset, getattr(cache, "max_size", k.shape[-2]) - 1, k.shape[-2])
        return k[..., -valid:, :], v[..., -valid:, :]
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


class AssistantSource(DraftSourceBase):
    prefill_mode: PrefillMode = PREFILL
    tap_layers: tuple[int, ...] = ()
    wants_anchor_hidden = True
    weights_bytes = 0

    def __init__(self, drafter: AssistantDrafter, target: TargetView) -> None:
        self.drafter = drafter
        self.target = target
        lm = getattr(target.model, "language_model", target.model)
        self.inner = lm.model
        self.embed_scale = float(getattr(self.inner, "embed_scale", 1.0))
        self.donors = donor_layers(target.model)
        self._held: mx.array | None = None

    def prefill(self, prompt_ids: list[int], ctx: TapContext | None) -> list[int]:
        self._held = None if ctx is None else ctx.hidden[self.target.num_layers - 1][-1:]
        return []

    def _embed(self, tok: int) -> mx.array:
        return self.inner.embed_tokens(mx.array([[tok]])) * self.embed_scale

    def draft(self, feed: list[int], n: int, step_base: int, anchor_hidden: mx.array | None) -> list[int]:
        anchor = anchor_hidden if anchor_hidden is not None else self._held
        self._held = None
        if n <= 0:
            return []
        if anchor is None:
            raise RuntimeError("assistant: no anchor hidden for the pending token")
        # optiq feeds the target's post-final-norm hidden; the anchor is pre-norm.
        h = self.inner.norm(anchor.reshape(1, 1, -1))
        caches = self.target.caches
        kv = {"sliding_attention": _read_kv(caches[self.donors[0]]),
              "full_attention": _read_kv(caches[self.donors[1]])}
        position = int(self.target.offset)
        tok = int(feed[-1])
        drafts: list[int] = []
        for k in range(n):
            logits, h = self.drafter(self._embed(tok), h, kv, position + k)
            tok = int(mx.argmax(logits))
            drafts.append(tok)
        return drafts

    def commit(
        self,
        d: int,
        k_accept: int,
        ctx: TapContext | None = None,
        verified_hidden: mx.array | None = None,
        accepted_tokens: list[int] | None = None,
    ) -> None:
        return None  # no state of its own: K/V and the anchor are re-read each step

    def cache_digest(self) -> dict[str, Any] | None:
        return None


class AssistantProvider:
    """Owns a loaded assistant drafter; opens one ``AssistantSource`` per request."""

    kind = KIND

    def __init__(self, drafter: AssistantDrafter | None = None, *, path: str | Path | None = None, **_: Any) -> None:
        if drafter is None:
            if path is None:
                raise ValueError("assistant: pass a loaded drafter or the drafter directory (path=)")
            drafter = load_drafter(path)
        self.drafter = drafter
        self.path = Path(path) if path is not None else None

    def check_target(self, target_model: Any, target_tokenizer: Any = None) -> None:
        lm = getattr(target_model, "language_model", target_model)
        w = lm.model.embed_tokens.weight
        cfg = self.drafter.cfg
        if int(w.shape[-1]) != cfg.backbone_hidden_size:
            raise ValueError(f"assistant: backbone_hidden_size {cfg.backbone_hidden_size} != target hidden {w.shape[-1]}")
        if int(w.shape[0]) != cfg.vocab_size:
            raise ValueError(f"assistant: vocab_size {cfg.vocab_size} != target vocab {w.shape[0]}")
        donor_layers(target_model)

    def open(self, sampler: StepSampler, target: TargetView) -> AssistantSource:
        self.check_target(target.model)
        return AssistantSource(self.drafter, target)


# ---------------------------------------------------------------- the kind (engine.sources.kind)


def _open(draft_dir: Path | None, opts: OpenOptions) -> AssistantProvider:
    return AssistantProvider(path=draft_dir)


def _detect(d: Path, config: Callable[[], dict[str, Any]]) -> bool:
    return "assistant" in str(config().get("model_type", ""))  # gemma4_assistant dirs


SOURCE = SourceKind(
    name=KIND, provider=AssistantProvider, open=_open, prefill=PREFILL, reuse="tapped", roster=4,
    detect=_detect, detect_rank=2, zoo="zoo.heads:case_paths",
    hint="a gemma4_assistant dir",
)
