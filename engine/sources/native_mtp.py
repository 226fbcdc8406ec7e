"""The ``native-mtp`` draft source: MTP layers that ship INSIDE the target checkpoint.

Roster row "GLM native" of ``../shared/reference/speculative-decoding.md`` §3
(mlx-bun ``src/spec/glm52-mtp-source.ts``). The implementations disagree on how
the head is driven, so every convention is a named parameter
(:class:`Conventions`), recorded in the trace header (``params.mtp_conventions``):

``hidden``        which target hidden feeds the head: ``"pre-norm"`` (the last
                  decoder layer's output; mlx-lm PR #990, §3 Qwen row) or
                  ``"post-norm"`` (after the target's final norm; vLLM
                  ``deepseek_mtp.py`` / ``glm4_moe_mtp.py`` and mlx-vlm 0.7.10,
                  whose verifier hands its drafters the normed hidden).
``concat``        ``"e;h"``: ``eh_proj([enorm(embed); hnorm(hidden)])`` (DeepSeek-V3,
                  GLM, Qwen ``fc``; mlx-vlm ``GlmMoeDsaMTP.__call__``) or ``"h;e"``
                  (MiMo's ``[h; e]``).
``position_base`` the drafter row built from ``(embed(t[p+1]), hidden[p])`` sits at
                  RoPE position ``p + position_base`` (0: mlx-vlm
                  ``AutoregressiveMTPDraftModel._next_position`` starts at 0 and
                  vLLM reuses the target positions; 1: the position of the token).
``mask_pos0``     zero the token embedding of the row at RoPE position 0 (vLLM
                  ``DeepSeekMultiTokenPredictorLayer.forward``:
                  ``inputs_embeds[positions == 0] = 0``; DeepSeek/GLM/MiMo mask it,
                  Qwen3-Next does not).
``depth``         with D > 1 MTP layers in the checkpoint: ``"reuse"`` (head 0 drafts
                  every step; mlx-vlm ``draft_block``) or ``"chain"`` (draft step i
                  runs head ``i mod D``; vLLM ``spec_step_idx % num_mtp_layers``), each
                  head with its own KV cache holding the rows it computed.
``chain_hidden``  the hidden a chained step feeds forward: the head's output
                  ``"post-norm"`` (after ``shared_head.norm``; mlx-vlm
                  ``GlmMoeDsaMTPDraftModel`` and ``qwen3_5_mtp``) or ``"pre-norm"``
                  (before it; mlx-vlm ``DeepseekV4MTPDraftModel._forward_hidden``
                  returns the pre-head hidden as the next step's input).
``trim``          drafter cache after a round: ``"keep-chain"`` (rows of accepted
                  drafts built from the drafter's own hidden stay, the rejected ones
                  are trimmed; mlx-vlm ``accept_verified_tokens``) or ``"rebuild"``
                  (every chain row is trimmed and the accepted rows are rebuilt from
                  the target's VERIFIED hidden; §3 GLM row, Colibri).

Every combination is lossless (drafts never change what is emitted, §2); they
change draft logits, hence acceptance. Checkpoint layouts (:func:`read_layout`):

- ``layers``: GLM-4.x / DeepSeek-V3 ``model.layers.{N+j}.*`` with ``N =
  num_hidden_layers`` and ``j < num_nextn_predict_layers``: ``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.norm``, optional ``shared_head.head`` and
  ``embed_tokens``, and one decoder layer (``input_layernorm``, ``self_attn.*``,
  ``post_attention_layernorm``, ``mlp.*``). mlx-lm 0.32.2 drops these tensors in
  ``sanitize``: ``glm4_moe.py`` ``Model.sanitize`` drops ``model.layers.{N}``,
  ``deepseek_v3.py`` ``Model.sanitize`` drops only ``model.layers.61`` (so any
  DeepSeek-V3 checkpoint with another depth fails its strict load: the plain
  reference needs a checkpoint without them, ``zoo.native_mtp``).
- ``mtp``: Qwen3-Next / Qwen3.5 ``mtp.*`` (``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
  ``mtp.pre_fc_norm_hidden``, ``mtp.layers.0.*``, ``mtp.norm``; mlx-lm
  ``qwen3_5.py``/``qwen3_next.py`` ``sanitize`` drop ``mtp.``).

The decoder layer is mlx-lm 0.32.2's own class of the target family (the class
of the target's last layer, built with the checkpoint's ``ModelArgs`` at layer
index ``N + j``); nothing of the model is re-implemented here. Drafter row
bookkeeping (predict-2-ahead, owed rows, anchor = the target's true hidden at the
emitted position) is that of ``engine.sources.mtp`` (mlx-vlm
``speculative/drafters/mtp_base.py`` ``AutoregressiveMTPDraftModel``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine import caches as cache_ops
from engine.sampler import StepSampler, token_ids
from engine.seam import DraftSourceBase, PrefillMode, TapContext, TargetView
from engine.sources.kind import OpenOptions, SourceKind
from engine.sources.mtp import owe_prompt_rows

KIND = "native-mtp"
PREFILL: PrefillMode = "full"  # §2.1; the source and its descriptor share it

_CHOICES: dict[str, tuple[Any, ...]] = {
    "hidden": ("pre-norm", "post-norm"),
    "concat": ("e;h", "h;e"),
    "position_base": (0, 1),
    "mask_pos0": (True, False),
    "depth": ("reuse", "chain"),
    "chain_hidden": ("post-norm", "pre-norm"),
    "trim": ("keep-chain", "rebuild"),
}


@dataclass(frozen=True)
class Conventions:
    """How the native MTP head is driven (module docstring); recorded in the trace header."""

    hidden: str = "post-norm"
    concat: str = "e;h"
    position_base: int = 0
    mask_pos0: bool = True
    depth: str = "reuse"
    chain_hidden: str = "post-norm"
    trim: str = "keep-chain"

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v not in _CHOICES[f.name] or type(v) is not type(_CHOICES[f.name][0]):
                raise ValueError(f"native-mtp: convention {f.name}={v!r}; valid: "
                                 f"{', '.join(repr(c) for c in _CHOICES[f.name])}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def parse(cls, spec: str | dict[str, Any] | None, base: Conventions | None = None) -> Conventions:
        """``"hidden=pre-norm,depth=chain"`` (or a dict) over ``base``; unknown names refused."""
        base = base or cls()
        if not spec:
            return base
        items = spec.items() if isinstance(spec, dict) else (
            kv.split("=", 1) if "=" in kv else (kv, "") for kv in str(spec).split(","))
        kw: dict[str, Any] = {}
        for k, v in items:
            k = str(k).strip().replace("-", "_")
            if k not in _CHOICES:
                raise ValueError(f"native-mtp: unknown convention {k!r}; known: {', '.join(_CHOICES)}")
            want = type(_CHOICES[k][0])
            if isinstance(v, str):
                v = v.strip()
                v = {"true": True, "false": False}.get(v.lower(), v) if want is bool else (
                    int(v) if want is int and v.lstrip("-").isdigit() else v)
            kw[k] = v
        return replace(base, **kw)


# Family defaults (what each reference does; the trace records the conventions used).
FAMILY_DEFAULTS: dict[str, Conventions] = {
    # GLM-4.5/4.7/5: mlx-vlm glm_moe_dsa_mtp (post-norm hidden, post-head-norm chain,
    # head reused), vLLM glm4_moe_mtp (position-0 mask).
    "glm": Conventions(),
    # DeepSeek-V3: vLLM deepseek_mtp (post-norm hidden, position-0 mask, one layer per
    # step: spec_step_idx % num_mtp_layers), mlx-vlm DeepSeek-V4 (pre-head-norm chain).
    "deepseek": Conventions(depth="chain", chain_hidden="pre-norm"),
    # Qwen3-Next / Qwen3.5: mlx-vlm qwen3_5_mtp, no position-0 mask.
    "qwen": Conventions(mask_pos0=False),
}


class ShiftedRoPE(nn.Module):
    """Wraps a decoder layer's RoPE so it rotates at the source's explicit position.

    mlx-lm's attention calls ``self.rope(x, offset=cache.offset)`` (glm4_moe,
    qwen3_5) or ``self.rope(x, offset)`` (deepseek_v3); with a chained head's
    sparse cache or ``position_base = 1`` the cache offset is not the position,
    so the source sets ``pos`` before every forward.
    """

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.pos = 0

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        return self.inner(x, offset=self.pos)


class MTPBlock(nn.Module):
    """One MTP module: ``enorm``/``hnorm``/``eh_proj`` merge, one decoder layer, ``norm``
    (``shared_head.norm``), optional own ``head`` / ``embed``."""

    def __init__(self, layer: nn.Module, hidden_size: int, eps: float, vocab: int,
                 own_head: bool, own_embed: bool) -> None:
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layer = layer
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        if own_head:
            self.head = nn.Linear(hidden_size, vocab, bias=False)
        if own_embed:
            self.embed = nn.Embedding(vocab, hidden_size)
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "rope"):
            raise ValueError(f"native-mtp: decoder layer {type(layer).__name__} has no self_attn.rope")
        self.rope = ShiftedRoPE(attn.rope)
        attn.rope = self.rope

    def __call__(self, embed: mx.array, hidden: mx.array, pos: int, concat: str,
                 cache: Any) -> tuple[mx.array, mx.array]:
        """``(pre-norm output, post-norm output)`` of rows at positions ``pos, pos+1, ...``."""
        from mlx_lm.models.base import create_attention_mask

        e, h = self.enorm(embed), self.hnorm(hidden)
        x = self.eh_proj(mx.concatenate([e, h] if concat == "e;h" else [h, e], axis=-1))
        self.rope.pos = pos
        x = self.layer(x, mask=create_attention_mask(x, cache, return_array=True), cache=cache)
        return x, self.norm(x)


# ------------------------------------------------------------------ checkpoint


def _read_config(path: Path) -> dict[str, Any]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"native-mtp: {path} has no config.json")
    cfg: dict[str, Any] = json.loads(cfg_file.read_text())
    return cfg


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    tc = cfg.get("text_config")
    return {**cfg, **tc} if isinstance(tc, dict) else cfg


def read_layout(path: str | Path) -> tuple[str, int, dict[str, mx.array]]:
    """``(layout, depth, MTP tensors)`` of a checkpoint: ``"layers"`` (``model.layers.{N+j}``)
    or ``"mtp"`` (``mtp.*``); raises when it carries no MTP tensors."""
    p = Path(path).expanduser()
    tc = _text_config(_read_config(p))
    n = int(tc.get("num_hidden_layers", 0))
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ValueError(f"native-mtp: {p} has no *.safetensors")
    layer_re = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")
    found: dict[str, mx.array] = {}
    layouts: set[str] = set()
    for f in files:
        for k, v in mx.load(str(f)).items():  # type: ignore[union-attr]
            m = layer_re.match(k)
            if m and int(m.group(1)) >= n:
                found[k] = v
                layouts.add("layers")
            elif k.startswith("mtp."):
                found[k] = v
                layouts.add("mtp")
    if not found:
        raise ValueError(f"native-mtp: {p} carries no MTP tensors (neither model.layers.{n}.* "
                         "nor mtp.*)")
    if len(layouts) > 1:
        raise ValueError(f"native-mtp: {p} carries both model.layers.{n}.* and mtp.* tensors")
    layout = layouts.pop()
    if layout == "layers":
        idx = {int(m.group(1)) for k in found if (m := layer_re.match(k))}
        depth = len(idx)
        if idx != set(range(n, n + depth)):
            raise ValueError(f"native-mtp: {p}: MTP layers {sorted(idx)} are not {n}..{n + depth - 1}")
    else:
        depth = 1 + max((int(k.split(".")[2]) for k in found if k.startswith("mtp.layers.")), default=0)
    declared = tc.get("num_nextn_predict_layers", tc.get("mtp_num_hidden_layers"))
    if declared is not None and int(declared) != depth:
        raise ValueError(f"native-mtp: {p}: config declares {declared} MTP layer(s), "
                         f"the checkpoint carries {depth}")
    return layout, depth, found


def detect(path: str | Path) -> bool:
    """Whether the checkpoint at ``path`` carries MTP tensors (config says so and tensors exist)."""
    try:
        tc = _text_config(_read_config(Path(path)))
    except (ValueError, OSError, json.JSONDecodeError):
        return False
    if not any(int(tc.get(k) or 0) > 0 for k in ("num_nextn_predict_layers", "mtp_num_hidden_layers")):
        return False
    try:
        read_layout(path)
    except ValueError:
        return False
    return True


def describe(path: str | Path, conventions: Conventions | str | dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """The trace header's ``params.mtp_conventions`` of the checkpoint at ``path`` driven with
    ``conventions`` over its family's defaults (no module is built)."""
    tc = _text_config(_read_config(Path(path)))
    layout, depth, _ = read_layout(path)
    family = _family(str(tc.get("model_type", "")), layout)
    conv = conventions if isinstance(conventions, Conventions) else Conventions.parse(
        conventions, FAMILY_DEFAULTS[family])
    return {"family": family, "layout": layout, "depth_layers": depth, **conv.to_json()}


_QWEN_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
               ".k_norm.weight", "norm.weight", "pre_fc_norm_embedding.weight",
               "pre_fc_norm_hidden.weight")


def _mlx_format(path: Path) -> bool:
    """Whether the checkpoint's safetensors say ``format: mlx`` (mlx-vlm ``_is_mlx_safetensors``)."""
    f = sorted(path.glob("*.safetensors"))[0]
    loaded: Any = mx.load(str(f), return_metadata=True)
    return bool(loaded[1].get("format") == "mlx")


def _block_keys(layout: str, depth: int, n: int, tensors: dict[str, mx.array],
                mlx_format: bool = True) -> dict[str, mx.array]:
    """Checkpoint names -> ``blocks.j.*`` names of :class:`NativeMTPHead`.

    ``mtp.*`` norms of a Hugging Face checkpoint are zero-centred and shifted by +1
    (mlx-vlm 0.7.10 ``Qwen3_5MTPDraftModel.sanitize``); an mlx-format checkpoint's are
    read as they are (``Qwen3_5MTPSplitter.on_mlx_source``)."""
    out: dict[str, mx.array] = {}
    if layout == "layers":
        for k, v in tensors.items():
            k = k.removeprefix("language_model.")
            _, _, idx, rest = k.split(".", 3)
            j = int(idx) - n
            if rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
                name = rest
            elif rest == "shared_head.norm.weight":
                name = "norm.weight"
            elif rest == "shared_head.head.weight":
                name = "head.weight"
            elif rest == "embed_tokens.weight":
                name = "embed.weight"
            elif rest.endswith("rotary_emb.inv_freq"):
                continue
            else:
                name = f"layer.{rest}"
            out[f"blocks.{j}.{name}"] = v
        return out
    if depth != 1:
        raise ValueError("native-mtp: mtp.* checkpoints with more than one MTP layer are not supported")
    names = {"mtp.fc.weight": "eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
             "mtp.pre_fc_norm_hidden.weight": "hnorm.weight", "mtp.norm.weight": "norm.weight"}
    for k, v in tensors.items():
        if not mlx_format and any(k.endswith(sfx) for sfx in _QWEN_NORMS) and v.ndim == 1:
            v = v + 1.0
        if k in names:
            out[f"blocks.0.{names[k]}"] = v
        elif k.startswith("mtp.layers.0."):
            out[f"blocks.0.layer.{k[len('mtp.layers.0.'):]}"] = v
        else:
            raise ValueError(f"native-mtp: unexpected MTP tensor {k!r}")
    return out


class NativeMTPHead(nn.Module):
    """The checkpoint's MTP layers as ``blocks[j]`` (:class:`MTPBlock`), mlx-lm decoder layers."""

    def __init__(self, blocks: list[MTPBlock], family: str, layout: str) -> None:
        super().__init__()
        self.blocks = blocks
        self.family = family
        self.layout = layout
        self.hidden_size = int(blocks[0].eh_proj.weight.shape[0])

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.blocks]


def _family(model_type: str, layout: str) -> str:
    if layout == "mtp" or model_type.startswith("qwen3"):
        return "qwen"
    if model_type.startswith("deepseek") or model_type.startswith("kimi"):
        return "deepseek"
    return "glm"


def _decoder_layer(cfg: dict[str, Any], layout: str, index: int) -> nn.Module:
    """mlx-lm 0.32.2's decoder layer of the checkpoint's family at layer index ``index``."""
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    args = args_cls.from_dict(cfg)
    text = getattr(args, "text_config", None)
    module = __import__(model_cls.__module__, fromlist=["_"])
    if layout == "mtp":  # qwen3_5 / qwen3_next: one full-attention layer
        from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

        targs = TextModelArgs.from_dict(text if isinstance(text, dict) else _text_config(cfg))
        targs = replace(targs, num_hidden_layers=1, full_attention_interval=1)
        return DecoderLayer(targs, 0)
    for cls_name in ("DecoderLayer", "DeepseekV3DecoderLayer", "DeepseekV2DecoderLayer",
                     "TransformerBlock"):
        cls = getattr(module, cls_name, None)
        if cls is not None:
            layer: nn.Module = cls(args, index)
            return layer
    raise ValueError(f"native-mtp: no decoder layer class in {model_cls.__module__}")


def load_head(path: str | Path) -> tuple[NativeMTPHead, dict[str, Any]]:
    """The MTP head of the checkpoint at ``path`` (offline); strict: every parameter present."""
    p = Path(path).expanduser()
    cfg = _read_config(p)
    tc = _text_config(cfg)
    layout, depth, tensors = read_layout(p)
    n = int(tc["num_hidden_layers"])
    weights = _block_keys(layout, depth, n, tensors, _mlx_format(p))
    h, vocab, eps = int(tc["hidden_size"]), int(tc["vocab_size"]), float(tc.get("rms_norm_eps", 1e-6))
    blocks = []
    for j in range(depth):
        own_head = f"blocks.{j}.head.weight" in weights
        own_embed = f"blocks.{j}.embed.weight" in weights
        blocks.append(MTPBlock(_decoder_layer(cfg, layout, n + j), h, eps, vocab, own_head, own_embed))
    head = NativeMTPHead(blocks, _family(str(tc.get("model_type", "")), layout), layout)
    head.load_weights(list(weights.items()), strict=True)
    mx.eval(head.parameters())
    return head, cfg


# ---------------------------------------------------------------------- source


def target_parts(target_model: Any) -> tuple[Any, Any, Any]:
    """(embed_tokens, lm_head callable, final norm) of an mlx-lm target."""
    lm = getattr(target_model, "language_model", target_model)
    inner = lm.model
    head = getattr(lm, "lm_head", None) or inner.embed_tokens.as_linear
    return inner.embed_tokens, head, inner.norm


class NativeMTPSource(DraftSourceBase):
    prefill_mode: PrefillMode = PREFILL
    tap_layers: tuple[int, ...] = ()
    wants_anchor_hidden = True
    weights_bytes = 0

    def __init__(self, head: NativeMTPHead, conv: Conventions, sampler: StepSampler,
                 target: TargetView) -> None:
        self.head = head
        self.conv = conv
        self.sampler = sampler
        t_embed, t_head, self.final_norm = target_parts(target.model)
        b0 = head.blocks[0]
        own_embed, own_head = getattr(b0, "embed", None), getattr(b0, "head", None)
        self.embed = t_embed if own_embed is None else own_embed
        self.lm_head = t_head if own_head is None else own_head
        self.n_layers = target.num_layers
        self.cache = head.make_cache()
        # Rows owed to head 0: (token p+1, target hidden p), built at the next draft().
        self._owed_tokens: list[int] = []
        self._owed_hidden: list[mx.array] = []
        self._next_pos = 0  # row position (before position_base) of the next head-0 row
        self._held: mx.array | None = None
        self._chain: list[int] = []  # head index of each chain row of this round
        self._round_start = 0  # row position of the round's pending row
        # Optional draft-logit log (provider.logit_log is a list): (pending row position,
        # draft position, float32 logits) per draft, for the draft-logit comparisons.
        self.logit_log: list[tuple[int, int, Any]] | None = None

    # -- conventions
    def _target_hidden(self, h: mx.array) -> mx.array:
        return self.final_norm(h) if self.conv.hidden == "post-norm" else h

    def _embed(self, tokens: mx.array, pos: int) -> mx.array:
        e = self.embed(tokens.reshape(1, -1).astype(mx.uint32))
        if self.conv.mask_pos0 and pos + self.conv.position_base == 0:
            keep = (mx.arange(e.shape[1]) > 0).astype(e.dtype)[None, :, None]
            e = e * keep
        return e

    def _run(self, j: int, tokens: mx.array, hidden: mx.array, pos: int) -> tuple[mx.array, mx.array]:
        """Head ``j`` over rows at row positions ``pos..``: (hidden fed forward, logits hidden)."""
        pre, post = self.head.blocks[j](self._embed(tokens, pos), hidden, pos + self.conv.position_base,
                                        self.conv.concat, self.cache[j])
        return (post if self.conv.chain_hidden == "post-norm" else pre), post

    def _logits_row(self, post: mx.array, i: int) -> mx.array:
        logits = self.lm_head(post[:, -1:, :])
        row = logits.reshape(1, logits.shape[-1])
        if self.logit_log is not None:
            self.logit_log.append((self._round_start, i, row[0].astype(mx.float32)))
        return row

    # -- seam
    def prefill(self, prompt_ids: list[int], ctx: TapContext | None) -> list[int]:
        self._next_pos = 0
        return owe_prompt_rows(self, prompt_ids, ctx)

    def draft(self, feed: list[int], n: int, step_base: int, anchor_hidden: mx.array | None) -> list[int]:
        anchor = anchor_hidden if anchor_hidden is not None else self._held
        if anchor is None:
            raise RuntimeError("native-mtp: no anchor hidden for the pending token (prefill was not tapped)")
        self._held = None
        self._owed_tokens.append(int(feed[-1]))
        self._owed_hidden.append(anchor.reshape(1, -1))
        self._chain = []
        if n <= 0:
            return []  # the pending row stays owed; positions stay contiguous
        tokens = mx.array(self._owed_tokens)
        hidden = self._target_hidden(mx.concatenate(self._owed_hidden, axis=0)[None])
        start = self._next_pos
        self._next_pos += len(self._owed_tokens)
        self._round_start = self._next_pos - 1
        self._owed_tokens, self._owed_hidden = [], []
        fwd, post = self._run(0, tokens, hidden, start)
        fwd = fwd[:, -1:, :]
        y = self.sampler.sample_window(self._logits_row(post, 0))
        ys = [y]
        depth = len(self.head.blocks)
        for i in range(1, n):
            j = i % depth if self.conv.depth == "chain" else 0
            fwd, post = self._run(j, y, fwd, self._round_start + i)
            self._chain.append(j)
            y = self.sampler.sample_window(self._logits_row(post, i))
            ys.append(y)
        mx.eval(ys, [c.state for c in self.cache if c.keys is not None])
        return token_ids(mx.concatenate(ys))

    def _trim_chain(self, keep: int) -> None:
        """Trim the round's chain rows past the first ``keep`` (rows of rejected drafts)."""
        for j in range(len(self.cache)):
            drop = sum(1 for i, hj in enumerate(self._chain) if hj == j and i >= keep)
            cache_ops.trim([self.cache[j]], drop, "native-mtp drafter")

    def commit(self, d: int, k_accept: int, ctx: TapContext | None = None,
               verified_hidden: mx.array | None = None,
               accepted_tokens: list[int] | None = None) -> None:
        if d == 0:
            return
        chain_rows = len(self._chain)
        if self.conv.trim == "keep-chain":
            keep = min(k_accept, chain_rows)
            self._trim_chain(keep)
            if k_accept >= d:
                if ctx is None or accepted_tokens is None:
                    raise RuntimeError("native-mtp: an all-accept commit needs the verify hidden and drafts")
                vh = ctx.hidden[self.n_layers - 1]
                self._owed_tokens = [int(accepted_tokens[d - 1])]
                self._owed_hidden = [vh[d - 1 : d]]
            self._next_pos = self._round_start + 1 + keep
        else:  # rebuild: only the pending row stands; accepted rows come from the verified hidden
            self._trim_chain(0)
            if k_accept > 0:
                if ctx is None or accepted_tokens is None:
                    raise RuntimeError("native-mtp: a rebuild commit needs the verify hidden and drafts")
                vh = ctx.hidden[self.n_layers - 1]
                self._owed_tokens = [int(t) for t in accepted_tokens[:k_accept]]
                self._owed_hidden = [vh[:k_accept]]
            self._next_pos = self._round_start + 1
        self._chain = []

    def cache_digest(self) -> dict[str, Any] | None:
        return cache_ops.cache_digest([c for c in self.cache if c.keys is not None] or self.cache[:1])


class NativeMTPProvider:
    """Owns the MTP head read from a checkpoint; opens one ``NativeMTPSource`` per request.

    ``conventions``: a :class:`Conventions`, a ``"name=value,..."`` string or a dict,
    applied over the family's defaults (:data:`FAMILY_DEFAULTS`).
    """

    kind = KIND

    def __init__(self, head: NativeMTPHead | None = None, *, path: str | Path | None = None,
                 conventions: Conventions | str | dict[str, Any] | None = None, **_: Any) -> None:
        if head is None:
            if path is None:
                raise ValueError("native-mtp: pass a loaded head or the checkpoint directory (path=)")
            head, self.config = load_head(path)
        else:
            self.config = {}
        self.head = head
        self.path = Path(path) if path is not None else None
        base = FAMILY_DEFAULTS[head.family]
        self.conventions = conventions if isinstance(conventions, Conventions) else Conventions.parse(
            conventions, base)
        self.logit_log: list[tuple[int, int, Any]] | None = None  # set to [] to record draft logits

    def header_params(self) -> dict[str, Any]:
        """What the trace header records (``params.mtp_conventions``)."""
        return {"family": self.head.family, "layout": self.head.layout,
                "depth_layers": len(self.head.blocks), **self.conventions.to_json()}

    def check_target(self, target_model: Any, target_tokenizer: Any = None) -> None:
        embed, _, _ = target_parts(target_model)
        th = int(embed.weight.shape[-1])
        if th != self.head.hidden_size:
            raise ValueError(f"native-mtp: head hidden_size {self.head.hidden_size} != target hidden_size {th}")

    def open(self, sampler: StepSampler, target: TargetView) -> NativeMTPSource:
        self.check_target(target.model)
        source = NativeMTPSource(self.head, self.conventions, sampler, target)
        source.logit_log = self.logit_log
        return source


# ---------------------------------------------------------------- the kind (engine.sources.kind)


def _open(draft_dir: Path | None, opts: OpenOptions) -> NativeMTPProvider:
    return NativeMTPProvider(path=draft_dir, conventions=opts.conventions)


def _detect(d: Path, config: Callable[[], dict[str, Any]]) -> bool:
    config()  # a checkpoint has a config.json (refused with the detection's message if not)
    return detect(d)  # carries its own MTP layers (model.layers.{N}, mtp.*)


def _header(draft_dir: Path | None, opts: OpenOptions) -> dict[str, Any]:
    assert draft_dir is not None  # header objects may carry extra keys: every MTP convention
    return {"mtp_conventions": describe(draft_dir, opts.conventions)}


SOURCE = SourceKind(
    name=KIND, provider=NativeMTPProvider, open=_open, prefill=PREFILL, reuse="tapped", roster=3,
    detect=_detect, detect_rank=4, options=frozenset({"conventions"}), header=_header,
    zoo=None,  # the MTP layers sit inside the zoo target's checkpoint (zoo/native_mtp.py, by target)
    hint="a checkpoint carrying its own MTP layers: model.layers.{N}.* or mtp.*",
)
