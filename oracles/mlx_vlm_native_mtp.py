"""Oracle runner for mlx-vlm's native-checkpoint MTP path: the Qwen ``mtp.*`` family.

Reference: mlx-vlm 0.7.10 ``speculative/drafters/mtp_split.py`` (``get_mtp_splitter``,
``MTPSplitter.prepare``/``split``; ``MTP_SPLITTERS["qwen3_5"]`` =
``qwen3_5_mtp/split.py`` ``Qwen3_5MTPSplitter``: ``mtp.*`` selected, the prefix
dropped, an mlx-format source read as it is (``on_mlx_source``), a Hugging Face
one sanitized with the zero-centred norm shift) and
``speculative/drafters/__init__.py`` ``load_drafter`` (a native checkpoint is loaded
through that splitter registry). The drafter is then mlx-vlm's own
``Qwen3_5MTPDraftModel``, driven unmodified by ``oracles.mlx_vlm`` (``draft_logits``,
``run_mtp``).

mlx-vlm implements the Qwen3.5 / Qwen3-Next family only among the zoo's native
checkpoints: its GLM drafters run GLM-5's DSA attention and its DeepSeek drafter
DeepSeek-V4's hyper-connections, not mlx-lm's ``glm4_moe`` / ``deepseek_v3``
(``oracles/native_mtp_ref.py`` is the reference there). mlx-vlm's conventions, as
the engine's ``native-mtp`` source names them: ``hidden = post-norm`` (its verifier
hands the drafter the target's final-norm output), ``concat = e;h``
(``fc([pre_fc_norm_embedding(e); pre_fc_norm_hidden(h)])``), ``position_base = 0``
(``_next_position`` from 0), ``mask_pos0 = false``, ``depth = reuse``,
``chain_hidden = post-norm`` (``_forward_hidden`` returns ``self.norm(h)``),
``trim = keep-chain`` (``accept_verified_tokens``) — the engine's ``qwen`` family
defaults.
"""

from __future__ import annotations

from pathlib import Path

from oracles import OracleUnavailable

NAME = "mlx_vlm_native_mtp"


def require() -> None:
    try:
        import mlx_vlm.speculative.drafters.mtp_split  # noqa: F401
    except ImportError as exc:
        raise OracleUnavailable("mlx-vlm (with mtp_split) is not installed") from exc


def split(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """mlx-vlm's own splitter on a native checkpoint: a standalone drafter directory
    (``config.json`` with ``block_size = depth + 2``, the ``mtp.*`` tensors), what
    ``oracles.mlx_vlm.run_mtp`` reads."""
    require()
    import json

    from mlx_vlm.speculative.drafters.mtp_split import get_mtp_splitter

    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    splitter = get_mtp_splitter(source_config=cfg)
    if splitter is None:
        raise ValueError(f"mlx-vlm has no MTP splitter for {checkpoint} (model_type "
                         f"{cfg.get('model_type')!r})")
    return Path(splitter.split(str(checkpoint), str(out_dir)))
