"""Which draft source a drafter artifact is: the §3 detection order.

Reference: ``../shared/reference/speculative-decoding.md`` §3 (mlx-bun
``src/server.ts`` ``detectDraftKind``): ``dspark.json`` → ``dspark``;
``config.json`` ``architectures[0] == "Gemma4DSparkModel"`` → ``deepspec``;
``model_type`` containing ``assistant`` → ``assistant``; ``model_type`` ending
``_mtp`` → ``mtp``; a checkpoint declaring ``num_nextn_predict_layers`` (or
``mtp_num_hidden_layers``) and carrying the MTP tensors (``model.layers.{N}.*``,
``mtp.*``) → ``native-mtp``; else ``two-model``. ``ngram`` is never detected (it has no
artifact) and refuses a drafter directory.
"""

from __future__ import annotations

import json
from pathlib import Path


class DraftKindError(ValueError):
    """A drafter directory/kind combination that cannot work."""


def detect_kind(draft_dir: str | Path) -> str:
    """The source kind of the drafter artifact at ``draft_dir``."""
    d = Path(draft_dir)
    if not d.is_dir():
        raise DraftKindError(f"drafter {str(d)!r} is not a local directory (nothing is downloaded)")
    if (d / "dspark.json").is_file():
        return "dspark"
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise DraftKindError(f"{d}: neither dspark.json nor config.json; not a drafter artifact")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise DraftKindError(f"{cfg_path}: not valid JSON ({exc})") from exc
    archs = cfg.get("architectures") or []
    if archs and archs[0] == "Gemma4DSparkModel":
        return "deepspec"
    model_type = str(cfg.get("model_type", ""))
    if "assistant" in model_type:
        return "assistant"
    if model_type.endswith("_mtp"):
        return "mtp"
    from engine.sources.native_mtp import detect as carries_mtp

    if carries_mtp(d):  # a checkpoint carrying its own MTP layers (model.layers.{N}, mtp.*)
        return "native-mtp"
    return "two-model"


def resolve_kind(requested: str | None, draft_dir: str | Path | None) -> str:
    """The kind to use: an explicit ``--source`` wins, else detection; ngram takes no drafter."""
    if requested == "ngram":
        if draft_dir is not None:
            raise DraftKindError("the ngram source is model-free: it refuses a drafter directory")
        return "ngram"
    if draft_dir is None:
        if requested in (None, "auto"):
            raise DraftKindError("no drafter given: pass --draft DIR, or --source ngram")
        raise DraftKindError(f"--source {requested} needs --draft DIR")
    if requested in (None, "auto"):
        return detect_kind(draft_dir)
    return requested
