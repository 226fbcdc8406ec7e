"""The committed trained pair (``zoo/train.py``): pinned digests, drift, loadability."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from zoo import ZooDriftError, train


def test_trained_pair_verifies_and_loads() -> None:
    tdir, ddir = train.trained_pair()
    man = train.trained_manifest()
    for d in (tdir, ddir):
        assert (d / "model.safetensors").stat().st_size < 2 * 1024 * 1024, d
    acc = man["pair"]["acceptance"]["acceptance"]
    assert 0.0 < acc < 1.0, man["pair"]
    from engine.models import load

    t, dr = load(tdir), load(ddir)
    assert t.model.args.vocab_size == dr.model.args.vocab_size == 512
    assert len(dr.model.layers) == 1 and len(t.model.layers) > 1


def test_unknown_trained_name() -> None:
    with pytest.raises(ValueError, match="unknown trained model"):
        train.trained_dir("nope")


@pytest.mark.parametrize("victim", ["model.safetensors", "config.json"])
def test_drift_is_detected(victim: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(train.TRAINED_ROOT, tmp_path / "trained")
    monkeypatch.setattr(train, "TRAINED_ROOT", tmp_path / "trained")
    monkeypatch.setattr(train, "TRAINED_MANIFEST", tmp_path / "trained" / "manifest.json")
    assert train.trained_dir(train.DRAFTER_NAME) == tmp_path / "trained" / train.DRAFTER_NAME
    f = tmp_path / "trained" / train.DRAFTER_NAME / victim
    if victim == "config.json":
        cfg = json.loads(f.read_text())
        cfg["rms_norm_eps"] = 1e-5
        f.write_text(json.dumps(cfg))
    else:
        import mlx.core as mx

        w = dict(mx.load(str(f)))
        k = sorted(w)[0]
        w[k] = w[k] * 1.001
        mx.save_safetensors(str(f), w)
    with pytest.raises(ZooDriftError, match="zoo drift: llama-trained-draft"):
        train.trained_dir(train.DRAFTER_NAME)
