"""The ``mtp`` draft source: a Qwen-trained MTP head (``qwen3_5_mtp``) on a qwen3_5 target.

Roster row ``mtp`` of ``../shared/reference/speculative-decoding.md`` §3
(mlx-bun ``src/spec/qwen-mtp-source.ts``). Reference: mlx-vlm 0.7.10
``mlx_vlm/speculative/drafters/qwen3_5_mtp/qwen3_5_mtp.py``
(``Qwen3_5MTPDraftModel``: ``_forward_hidden``, ``prefill_from_target_hidden``,
``draft_block``, ``accept_verified_tokens``) driven by
``mlx_vlm/speculative/mtp.py`` ``_mtp_rounds``.

The head is one full-attention decoder layer (mlx-lm 0.32.2
``models/qwen3_5.py`` ``DecoderLayer``, reused here) behind an ``fc`` merge of
``RMSNorm(embed(token))`` and ``RMSNorm(hidden)``, with its own KV cache; it
borrows the target's ``embed_tokens`` and ``lm_head``. Row conventions (§3
"Row conventions worth knowing"):

- predict-2-ahead: the drafter row at position ``p`` is built from
  ``(embed(token_{p+1}), hidden_p)`` where ``hidden_p`` is the target's
  PRE-final-norm last-layer output (``tap_layers = [n_layers - 1]``);
- ``prefill`` (full prompt, ``prefill_mode = "full"``) holds rows
  ``0..L-2``; the row of the last prompt position needs the first sampled
  token, so it is built by the first ``draft()``;
- ``draft()`` opens with the pending token's row from the target's TRUE hidden
  at the emitted position (the anchor), then chains its own output hidden for
  the rest of the block; rows that are still owed (prefill, the all-accept
  row) are processed in the same forward, as mlx-vlm processes them together;
- ``commit()`` trims the rejected chain rows and, on an all-accept round,
  owes the missing row ``(embed(last draft), verify hidden at its position)``;
- drafts are sampled with the REQUEST sampler from a ``[1, V]`` row (the
  module output ``[1, 1, V]`` is reshaped first; top-k slices 2-D rows).

Weights: ``config.json`` (``model_type: qwen3_5_mtp``, ``text_config`` of the
target plus ``mtp_num_hidden_layers``, ``block_size``) and ``*.safetensors``
in mlx-vlm's layout (``fc.weight``, ``pre_fc_norm_*``, ``layers.N.*``,
``norm.weight``) or the HF layout (``mtp.`` prefix, zero-centred norms, shifted
by +1 as mlx-vlm's ``sanitize`` does).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine import caches as cache_ops
from engine.sampler import StepSampler, token_ids
from engine.seam import DraftSourceBase, PrefillMode, TapContext, TargetView
from engine.sources.kind import OpenOptions, SourceKind

KIND = "mtp"
PREFILL: PrefillMode = "full"  # §2.1; the source and its descriptor share it
MODEL_TYPE = "qwen3_5_mtp"
_NORM_SUFFIXES = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)


class MTPHead(nn.Module):
    """The ``qwen3_5_mtp`` module tree (mlx-vlm ``Qwen3_5MTPDraftModel`` parameters)."""

    def __init__(self, text_config: dict[str, Any]) -> None:
        super().__init__()
        from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

        args = TextModelArgs.from_dict(text_config)
        if getattr(args, "num_experts", 0) > 0:
            raise ValueError("mtp: MoE MTP heads are not supported by this source")
        n = int(text_config.get("mtp_num_hidden_layers", 1))
        layer_args = replace(args, num_hidden_layers=n, full_attention_interval=1)
        h = args.hidden_size
        self.hidden_size = h
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(layer_args, 0) for _ in range(n)]
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)

    def __call__(self, token_embed: mx.array, hidden: mx.array, cache: list[Any]) -> mx.array:
        from mlx_lm.models.base import create_attention_mask

        h = mx.concatenate(
            [self.pre_fc_norm_embedding(token_embed), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        h = self.fc(h)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, mask=create_attention_mask(h, c), cache=c)
        return self.norm(h)

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-vlm ``Qwen3_5MTPDraftModel.sanitize`` for dense heads: HF ``mtp.`` keys lose
    the prefix and their zero-centred norms are shifted by +1."""
    out = {}
    for key, value in weights.items():
        hf = key.startswith("mtp.")
        if hf:
            key = key[len("mtp.") :]
            if any(key.endswith(s) for s in _NORM_SUFFIXES) and value.ndim == 1:
                value = value + 1.0
        out[key] = value
    return out


def load_head(path: str | Path) -> tuple[MTPHead, dict[str, Any]]:
    """Load a ``qwen3_5_mtp`` head directory (offline); strict: every parameter must be present."""
    p = Path(path).expanduser()
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"mtp: {p} has no config.json")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("model_type") != MODEL_TYPE:
        raise ValueError(f"mtp: {p}: model_type {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}")
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ValueError(f"mtp: {p} has no *.safetensors")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))  # type: ignore[arg-type]
    head = MTPHead(cfg["text_config"])
    head.load_weights(list(sanitize(weights).items()), strict=True)
    mx.eval(head.parameters())
    return head, cfg


def _as_row(logits: mx.array) -> mx.array:
    """The ``[1, V]`` sampler contract (§3): the head's ``[1, 1, V]`` output as one row."""
    return logits.reshape(1, logits.shape[-1])


def target_parts(target_model: Any) -> tuple[Any, float, Any, Any]:
    """(embed_tokens, embed_scale, lm_head callable, final norm) of an mlx-lm target
    (mlx-vlm ``Qwen3_5MTPDraftModel.bind``)."""
    lm = getattr(target_model, "language_model", target_model)
    inner = lm.model
    embed = inner.embed_tokens
    scale = float(getattr(inner, "embed_scale", 1.0))
    head = getattr(lm, "lm_head", None) or embed.as_linear
    return embed, scale, head, inner.norm


def owe_prompt_rows(src: Any, prompt_ids: list[int], ctx: TapContext | None) -> list[int]:
    """Prefill of a head drafter fed (token p+1, hidden p): the prompt's rows are owed to the
    drafter cache (built at the next draft), the last hidden row held as the tail-split anchor.
    Sets ``src._owed_tokens``, ``src._owed_hidden``, ``src._held``; returns the owed tokens."""
    if ctx is None or not prompt_ids:
        src._owed_tokens, src._owed_hidden, src._held = [], [], None
        return []
    hidden = ctx.hidden[src.n_layers - 1]
    src._owed_tokens = list(prompt_ids[1:])
    src._owed_hidden = [hidden[: len(prompt_ids) - 1]]
    src._held = hidden[-1:]
    return list(prompt_ids[1:])


class MTPSource(DraftSourceBase):
    prefill_mode: PrefillMode = PREFILL
    tap_layers: tuple[int, ...] = ()
    wants_anchor_hidden = True
    weights_bytes = 0

    def __init__(self, head: MTPHead, sampler: StepSampler, target: TargetView) -> None:
        self.head = head
        self.sampler = sampler
        self.embed, self.embed_scale, self.lm_head, _ = target_parts(target.model)
        self.n_layers = target.num_layers
        self.cache = head.make_cache()
        # Rows owed to the drafter cache: (token p+1, hidden p), built at the next draft().
        self._owed_tokens: list[int] = []
        self._owed_hidden: list[mx.array] = []
        self._held: mx.array | None = None  # last prefill hidden row (tail-split anchor)
        self._chain = 0  # rows built from the drafter's own hidden this round

    def _embed(self, tokens: list[int]) -> mx.array:
        return self.embed(mx.array(tokens, mx.uint32)[None]) * self.embed_scale

    def prefill(self, prompt_ids: list[int], ctx: TapContext | None) -> list[int]:
        return owe_prompt_rows(self, prompt_ids, ctx)

    def draft(
        self, feed: list[int], n: int, step_base: int, anchor_hidden: mx.array | None
    ) -> list[int]:
        anchor = anchor_hidden if anchor_hidden is not None else self._held
        if anchor is None:
            raise RuntimeError("mtp: no anchor hidden for the pending token (prefill was not tapped)")
        self._held = None
        self._owed_tokens.append(int(feed[-1]))
        self._owed_hidden.append(anchor.reshape(1, -1))
        self._chain = 0
        if n <= 0:
            return []  # the pending row stays owed; positions stay contiguous
        tokens = self._owed_tokens
        hidden = mx.concatenate(self._owed_hidden, axis=0)[None]
        self._owed_tokens, self._owed_hidden = [], []
        h = self.head(self._embed(tokens), hidden, self.cache)[:, -1:, :]
        ys = []
        y = self.sampler.sample_window(_as_row(self.lm_head(h)))
        ys.append(y)
        for _ in range(n - 1):
            h = self.head(self._embed_arr(y), h, self.cache)
            self._chain += 1
            y = self.sampler.sample_window(_as_row(self.lm_head(h)))
            ys.append(y)
        mx.eval(ys, [c.state for c in self.cache])
        return token_ids(mx.concatenate(ys))

    def _embed_arr(self, y: mx.array) -> mx.array:
        return self.embed(y.reshape(1, 1).astype(mx.uint32)) * self.embed_scale

    def commit(
        self,
        d: int,
        k_accept: int,
        ctx: TapContext | None = None,
        verified_hidden: mx.array | None = None,
        accepted_tokens: list[int] | None = None,
    ) -> None:
        if d == 0:
            return
        if k_accept < d:
            # Chain rows for drafts 1..d-1; rows of rejected drafts go.
            cache_ops.trim(self.cache, self._chain - k_accept, "mtp drafter")
        else:
            if ctx is None or accepted_tokens is None:
                raise RuntimeError("mtp: an all-accept commit needs the verify hidden and the drafts")
            vh = ctx.hidden[self.n_layers - 1]
            self._owed_tokens = [int(accepted_tokens[d - 1])]
            self._owed_hidden = [vh[d - 1 : d]]
        self._chain = 0

    def cache_digest(self) -> dict[str, Any] | None:
        return cache_ops.cache_digest(self.cache)


class MTPProvider:
    """Owns a loaded MTP head; opens one ``MTPSource`` per request."""

    kind = KIND

    def __init__(self, head: MTPHead | None = None, *, path: str | Path | None = None, **_: Any) -> None:
        if head is None:
            if path is None:
                raise ValueError("mtp: pass a loaded head or the head directory (path=)")
            head, self.config = load_head(path)
        else:
            self.config = {}
        self.head = head
        self.path = Path(path) if path is not None else None

    def check_target(self, target_model: Any, target_tokenizer: Any = None) -> None:
        embed, _, _, _ = target_parts(target_model)
        th = int(embed.weight.shape[-1])
        if th != self.head.hidden_size:
            raise ValueError(f"mtp: head hidden_size {self.head.hidden_size} != target hidden_size {th}")
        tv = self.config.get("text_config", {}).get("vocab_size")
        if tv is not None and int(tv) != int(embed.weight.shape[0]):
            raise ValueError(f"mtp: head vocab_size {tv} != target vocab {embed.weight.shape[0]}")

    def open(self, sampler: StepSampler, target: TargetView) -> MTPSource:
        self.check_target(target.model)
        return MTPSource(self.head, sampler, target)


# ---------------------------------------------------------------- the kind (engine.sources.kind)


def _open(draft_dir: Path | None, opts: OpenOptions) -> MTPProvider:
    return MTPProvider(path=draft_dir)


def _detect(d: Path, config: Callable[[], dict[str, Any]]) -> bool:
    return str(config().get("model_type", "")).endswith("_mtp")  # qwen3_5_mtp head dirs


SOURCE = SourceKind(
    name=KIND, provider=MTPProvider, open=_open, prefill=PREFILL, reuse="tapped", roster=2,
    detect=_detect, detect_rank=3, zoo="zoo.heads:case_paths",
    hint="a qwen3_5_mtp head dir",
)
