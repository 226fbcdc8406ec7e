"""Drafter artifact kinds and the DSpark loader (§3 detection order, §4.1 format).

Reference: mlx-bun ``src/server.ts`` ``detectDraftKind`` and
``src/spec/dspark/loader.ts`` ``loadDsparkDrafter`` (§3, §4.1 "Checkpoint
format"): ``dspark.json`` → ``dspark``; ``config.json`` ``architectures[0] ==
"Gemma4DSparkModel"`` → ``deepspec``. ``dspark.json`` must stamp ``variant``:
``"dspark"`` (legacy ``"dflash"`` accepted) loads the v2 module; a v1
single-vector checkpoint is refused with a pointer at the v2 format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.dspark import module as dspark_module

V1_MARKERS = ("v1", "single-vector", "dspark-v1")
V1_MESSAGE = (
    "{path}: a v1 single-vector DSpark checkpoint (variant {variant!r}): it fuses ONE final-hidden "
    "vector as a token and drops the paper's multi-layer KV injection (§4.2), so it is not loaded. "
    "Re-export it in the v2 format: dspark.json with variant \"dspark\", tap_layers, gamma, backbone, "
    "and fc + per-layer k_proj/v_proj weights (engine/dspark/module.py; a DeepSpec checkpoint loads "
    "as kind \"deepspec\" instead)."
)


class DrafterFormatError(ValueError):
    """The artifact is not a drafter this engine loads (with the reason and the fix)."""


def detect_kind(path: Path | str) -> str | None:
    """``dspark`` / ``deepspec`` / None, in the §3 detection order."""
    p = Path(path)
    if (p / "dspark.json").exists():
        return "dspark"
    cfg = p / "config.json"
    if cfg.exists():
        archs = json.loads(cfg.read_text()).get("architectures") or []
        if archs and archs[0] == "Gemma4DSparkModel":
            return "deepspec"
    return None


def check_dspark_json(path: Path | str) -> dict[str, Any]:
    p = Path(path)
    try:
        d = json.loads((p / "dspark.json").read_text())
    except FileNotFoundError as exc:
        raise DrafterFormatError(f"{p}: no dspark.json (is it a DeepSpec checkpoint? use kind 'deepspec')") from exc
    variant = d.get("variant")
    if variant is None or variant in V1_MARKERS or d.get("fuse") == "single-vector" or "anchor_proj" in d:
        raise DrafterFormatError(V1_MESSAGE.format(path=p, variant=variant))
    if variant != dspark_module.VARIANT and variant not in dspark_module.LEGACY_VARIANTS:
        raise DrafterFormatError(f"{p}: unknown DSpark variant {variant!r}; expected 'dspark' (or legacy 'dflash')")
    if "tap_layers" not in d or "backbone" not in d:
        raise DrafterFormatError(V1_MESSAGE.format(path=p, variant=variant))
    return d


def load_drafter(path: Path | str) -> Any:
    """The loaded drafter module of a ``dspark`` or ``deepspec`` artifact."""
    kind = detect_kind(path)
    if kind == "dspark":
        check_dspark_json(path)
        return dspark_module.load_dspark(path)
    if kind == "deepspec":
        from engine.dspark import deepspec_module

        return deepspec_module.load(path)
    raise DrafterFormatError(f"{path}: neither dspark.json nor a Gemma4DSparkModel config.json")
