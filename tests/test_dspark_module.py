"""Our DSpark drafter (§4.1): format, loader, pruning and calibration."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import zoo
from engine.dspark import calibration, loader
from engine.dspark import module as dsm
from specparity.runners import load_model
from zoo.dspark import artifact_dir


@pytest.fixture()
def art(tmp_path: Path) -> Path:
    dst = tmp_path / "dspark"
    shutil.copytree(artifact_dir("gemma4-dspark"), dst)
    return dst


def _patch(path: Path, **kw: object) -> None:
    d = json.loads((path / "dspark.json").read_text())
    for k, v in kw.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    (path / "dspark.json").write_text(json.dumps(d))


def test_detect_kind_follows_the_roster_order(art: Path) -> None:
    assert loader.detect_kind(art) == "dspark"  # dspark.json wins over config.json
    assert loader.detect_kind(artifact_dir("gemma4-deepspec")) == "deepspec"
    assert loader.detect_kind(zoo.model_dir("gemma4")) is None


@pytest.mark.parametrize("variant", [None, "v1", "single-vector"])
def test_v1_checkpoints_are_refused_with_a_pointer(art: Path, variant: str | None) -> None:
    _patch(art, variant=variant)
    with pytest.raises(loader.DrafterFormatError, match=r'v1 single-vector.*variant "dspark"'):
        loader.load_drafter(art)


def test_legacy_dflash_variant_loads(art: Path) -> None:
    _patch(art, variant="dflash")
    assert isinstance(loader.load_drafter(art), dsm.DSparkModel)


def test_unknown_variant_is_refused(art: Path) -> None:
    _patch(art, variant="dspark3")
    with pytest.raises(loader.DrafterFormatError, match="unknown DSpark variant"):
        loader.load_drafter(art)


def _block(thr: float | None):  # noqa: ANN202
    import mlx.core as mx

    from engine.dspark.module import ContextKV
    from engine.sources.dspark import _target_io
    from engine.taps import capture_layers

    model = load_model(str(zoo.model_dir("gemma4"))).model
    drafter = loader.load_drafter(artifact_dir("gemma4-dspark"))
    ids = list(zoo.prompt("nat-03").token_ids)
    with capture_layers(model, drafter.cfg.tap_layers) as cap:
        model(mx.array(ids, mx.uint32)[None])
        feats = mx.concatenate([cap[i][0] for i in drafter.cfg.tap_layers], axis=-1)
    embed, head = _target_io(model)
    return drafter.draft_block(ContextKV(drafter.cfg.num_hidden_layers), feats, ids[-1], embed, head, threshold=thr)


def test_position_zero_always_survives_and_pruning_truncates_never_redraws() -> None:
    full = _block(0.0)
    assert full.keep == len(full.tokens) == 4
    cut = _block(1.0)  # every c_k < 1: everything after position 0 is pruned
    assert cut.keep == 1 and cut.tokens == full.tokens, (cut, full)
    mid = _block(sorted(full.confidence[1:])[1])
    assert 1 <= mid.keep < 4 and mid.tokens[: mid.keep] == full.tokens[: mid.keep]
    assert all(c >= sorted(full.confidence[1:])[1] for c in mid.confidence[1 : mid.keep])


def test_fit_thresholds_rules() -> None:
    good = [(0.9, True)] * 30 + [(0.2, False)] * 30
    th = calibration.fit_thresholds([good, good, good[:5], [(0.5, False)] * 40], target=0.8, min_samples=20)
    assert th[0] == 0.0, "position 0 is never pruned"
    assert th[1] == 0.9, th  # smallest τ whose smoothed P(acc | c >= τ) >= 0.8
    assert th[2] == 0.0, "under-sampled → 0"
    assert th[3] == 1.0, "unreachable → 1.0"
    # Laplace smoothing: 3/3 accepted is (3+1)/(3+2) = 0.8, not 1.0
    assert calibration.fit_thresholds([[], [(0.7, True)] * 3], target=0.81, min_samples=1)[1] == 1.0


def test_calibrate_writes_thresholds_and_the_source_uses_them(art: Path) -> None:
    from engine.executor import GenerationParams, spec_generate
    from engine.sources.dspark import DSparkProvider

    model = load_model(str(zoo.model_dir("gemma4"))).model
    prompts = [list(p.token_ids) for p in zoo.prompts() if len(p.token_ids) <= 13]
    th = calibration.calibrate(art, model, prompts, target=0.5, max_tokens=16, min_samples=5)
    assert th[0] == 0.0 and len(th) == 4
    assert json.loads((art / "dspark.json").read_text())["thresholds"] == th
    provider = DSparkProvider(art)  # None: the checkpoint's calibrated thresholds
    assert provider.model.cfg.thresholds == tuple(th)
    res = spec_generate(model, provider, prompts[0], GenerationParams(max_tokens=16, gamma=4, prefill="full"))
    for r in (x for x in res.records if x["type"] == "round"):
        assert r["drafts"], "position 0 always survives"
        if len(r["confidence"]) == len(r["drafts"]) + 1:
            assert r["confidence"][-1] < th[len(r["drafts"])]
