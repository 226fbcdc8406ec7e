"""Which draft source a drafter artifact is: the §3 detection order.

Reference: ``../shared/reference/speculative-decoding.md`` §3 (mlx-bun
``src/server.ts`` ``detectDraftKind``): ``dspark.json`` → ``dspark``;
``config.json`` ``architectures[0] == "Gemma4DSparkModel"`` → ``deepspec``;
``model_type`` containing ``assistant`` → ``assistant``; ``model_type`` ending
``_mtp`` → ``mtp``; a checkpoint declaring ``num_nextn_predict_layers`` (or
``mtp_num_hidden_layers``) and carrying the MTP tensors (``model.layers.{N}.*``,
``mtp.*``) → ``native-mtp``; else ``two-model``. ``ngram`` is never detected (it has no
artifact) and refuses a drafter directory.

The order is not written here: each kind's descriptor (``engine/sources/<kind>.py``
``SOURCE``) carries its ``detect`` test and ``detect_rank``; ``detect_kind`` runs them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class DraftKindError(ValueError):
    """A drafter directory/kind combination that cannot work."""


def detect_kind(draft_dir: str | Path) -> str:
    """The source kind of the drafter artifact at ``draft_dir``.

    The kinds' ``detect`` tests run in their ``detect_rank`` order (module docstring);
    the ``detect_fallback`` kind answers when none matches.
    """
    from engine.sources.kind import all_kinds

    d = Path(draft_dir)
    if not d.is_dir():
        raise DraftKindError(f"drafter {str(d)!r} is not a local directory (nothing is downloaded)")
    cfg: list[dict[str, Any]] = []

    def config() -> dict[str, Any]:
        if not cfg:
            cfg_path = d / "config.json"
            if not cfg_path.is_file():
                raise DraftKindError(f"{d}: neither dspark.json nor config.json; not a drafter artifact")
            try:
                data = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as exc:
                raise DraftKindError(f"{cfg_path}: not valid JSON ({exc})") from exc
            cfg.append(data if isinstance(data, dict) else {})
        return cfg[0]

    kinds = all_kinds()
    for k in sorted((k for k in kinds if k.detect is not None), key=lambda k: (k.detect_rank, k.name)):
        assert k.detect is not None
        if k.detect(d, config):
            return k.name
    config()  # the fallback is a model directory: it has a config.json
    fallback = [k.name for k in kinds if k.detect_fallback]
    if len(fallback) != 1:
        raise DraftKindError(f"{d}: no source kind claims it (fallback kinds: {fallback})")
    return fallback[0]


def resolve_kind(requested: str | None, draft_dir: str | Path | None) -> str:
    """The kind to use: an explicit ``--source`` wins, else detection; a model-free kind takes no drafter."""
    from engine.sources.kind import all_kinds, find

    desc = find(requested)
    if desc is not None and not desc.takes_dir:
        if draft_dir is not None:
            raise DraftKindError(f"the {desc.name} source is model-free: it refuses a drafter directory")
        return desc.name
    if draft_dir is None:
        if requested in (None, "auto"):
            free = " or ".join(f"--source {k.name}" for k in all_kinds() if not k.takes_dir)
            raise DraftKindError(f"no drafter given: pass --draft DIR, or {free}")
        raise DraftKindError(f"--source {requested} needs --draft DIR")
    if requested in (None, "auto"):
        return detect_kind(draft_dir)
    return requested
