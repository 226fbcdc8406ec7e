"""The §3 detection order for drafter artifacts (``engine.sources.detect``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.sources.detect import DraftKindError, detect_kind, resolve_kind


def _art(tmp_path: Path, name: str, cfg: dict | None = None, dspark: bool = False) -> Path:
    d = tmp_path / name
    d.mkdir()
    if cfg is not None:
        (d / "config.json").write_text(json.dumps(cfg))
    if dspark:
        (d / "dspark.json").write_text("{}")
    return d


@pytest.mark.parametrize(
    ("cfg", "dspark", "kind"),
    [
        ({"model_type": "llama"}, True, "dspark"),  # dspark.json wins over everything
        ({"architectures": ["Gemma4DSparkModel"], "model_type": "gemma4_assistant"}, False, "deepspec"),
        ({"model_type": "gemma4_assistant"}, False, "assistant"),
        ({"model_type": "qwen3_5_mtp"}, False, "mtp"),
        ({"model_type": "qwen3"}, False, "two-model"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, False, "two-model"),
    ],
)
def test_detection_order(tmp_path: Path, cfg: dict, dspark: bool, kind: str) -> None:
    assert detect_kind(_art(tmp_path, "d", cfg, dspark)) == kind


def test_zoo_artifacts(tmp_path: Path) -> None:
    import zoo

    assert detect_kind(zoo.model_dir("llama-twin")) == "two-model"


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(DraftKindError, match="not a local directory"):
        detect_kind(tmp_path / "missing")
    with pytest.raises(DraftKindError, match="neither dspark.json nor config.json"):
        detect_kind(_art(tmp_path, "empty"))
    bad = _art(tmp_path, "bad")
    (bad / "config.json").write_text("{nope")
    with pytest.raises(DraftKindError, match="not valid JSON"):
        detect_kind(bad)
    with pytest.raises(DraftKindError, match="refuses a drafter"):
        resolve_kind("ngram", tmp_path)
    with pytest.raises(DraftKindError, match="--source ngram"):
        resolve_kind(None, None)
    with pytest.raises(DraftKindError, match="needs --draft"):
        resolve_kind("mtp", None)


def test_explicit_kind_wins(tmp_path: Path) -> None:
    d = _art(tmp_path, "d", {"model_type": "qwen3_5_mtp"})
    assert resolve_kind(None, d) == "mtp"
    assert resolve_kind("auto", d) == "mtp"
    assert resolve_kind("two-model", d) == "two-model"
    assert resolve_kind("ngram", None) == "ngram"
