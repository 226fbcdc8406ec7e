"""Oracle runner for mlx-vlm: the ``qwen3_5_mtp`` drafter, driven unmodified.

Reference: mlx-vlm 0.7.10 ``mlx_vlm/speculative/drafters/__init__.py``
``load_drafter`` and ``drafters/qwen3_5_mtp/qwen3_5_mtp.py``
``Qwen3_5MTPDraftModel`` (``bind``, ``reset``, ``_forward_tokens``,
``_lm_head_fn``). The drafter is bound to a minimal target that carries the zoo
target's own ``embed_tokens`` and ``lm_head`` tensors (``bind`` looks up
exactly those two), so the reference computes its rows with its own decoder
layer, norms and ``fc``.

What runs today: per-position draft logits (``draft_logits``) on inputs the
caller supplies (token ids, target hidden rows), for the draft-logit parity
check. The round loop (``speculative/mtp.py`` ``_mtp_rounds``) needs an mlx-vlm
target model; it is not wired yet (see README "MTP and assistant sources").
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

from oracles import OracleUnavailable

NAME = "mlx_vlm"
INSTALL_HINT = "tox -e vlm  (pip install 'specparity[vlm]': mlx-vlm==0.7.10 in its own environment)"


def require() -> None:
    try:
        import mlx_vlm.speculative.drafters  # noqa: F401
    except ImportError as exc:
        raise OracleUnavailable(f"mlx-vlm is not installed; install it with: {INSTALL_HINT}") from exc


def version() -> str:
    return metadata.version("mlx-vlm")


def _bound_drafter(head_path: str | Path, embed_weight: Any, lm_head_weight: Any) -> Any:
    import mlx.nn as nn
    from mlx_vlm.speculative.drafters import load_drafter

    draft, kind = load_drafter(str(head_path))
    if kind != "mtp":
        raise RuntimeError(f"mlx-vlm resolved draft kind {kind!r} for {head_path}, expected 'mtp'")

    class _Target(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(*embed_weight.shape)
            self.embed_tokens.weight = embed_weight
            self.lm_head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False)
            self.lm_head.weight = lm_head_weight

    draft.reset(_Target())
    return draft


def draft_logits(
    head_path: str | Path,
    embed_weight: Any,
    lm_head_weight: Any,
    row_tokens: list[int],
    row_hidden: Any,
    chain: int,
) -> tuple[Any, Any]:
    """Reference drafter logits: one forward over the rows ``(row_tokens[i], row_hidden[i])``
    (``[T, H]``), then ``chain`` greedy steps chained on its own output hidden.

    Returns ``(row_logits [T, V], chain_logits [chain, V])``.
    """
    require()
    import mlx.core as mx

    draft = _bound_drafter(head_path, embed_weight, lm_head_weight)
    toks = mx.array([row_tokens], dtype=mx.int32)
    h = draft._forward_tokens(toks, row_hidden[None], mx.int32)
    rows = draft._lm_head_fn(h)[0]
    out = []
    h_prev = h[:, -1:, :]
    for _ in range(chain):
        logits = draft._lm_head_fn(h_prev)
        tok = mx.argmax(logits, axis=-1)
        h_prev = draft._forward_token(tok.astype(mx.int32), h_prev, mx.int32)
        out.append(draft._lm_head_fn(h_prev)[0, 0])
    return rows, (mx.stack(out) if out else mx.zeros((0, rows.shape[-1])))
