"""Tests for the tiny zoo (zoo): pinning, tamper detection, loading, prompts,
and greedy acceptance bands measured with mlx-lm 0.32.2 speculative_generate_step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import zoo
from zoo import build

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One built zoo shared by the module's read-only tests."""
    root = tmp_path_factory.mktemp("zoo-shared")
    old = os.environ.get("SPECPARITY_ZOO_DIR")
    os.environ["SPECPARITY_ZOO_DIR"] = str(root)
    try:
        for name in zoo.model_names():
            zoo.model_dir(name)
        yield root
    finally:
        if old is None:
            os.environ.pop("SPECPARITY_ZOO_DIR", None)
        else:
            os.environ["SPECPARITY_ZOO_DIR"] = old


@pytest.fixture
def fresh_zoo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECPARITY_ZOO_DIR", str(tmp_path))
    zoo.clear_verification_cache()
    yield tmp_path
    zoo.clear_verification_cache()


def test_names_and_pairs() -> None:
    assert zoo.TARGETS == ("llama", "qwen3", "gemma3", "gemma4", "qwen35")
    assert zoo.DRAFTERS == ("self", "twin", "small")
    seeded = {f"{t}{suffix}" for t in zoo.TARGETS for suffix in ("", "-twin", "-small")}
    # the quantized-KV pairs (head dim 32 and 64), not in TARGETS
    seeded |= {"llama-kv", "llama-kv-twin", "llama-kv64", "llama-kv64-twin"}
    assert set(zoo.model_names()) == seeded | {"llama-trained", "llama-trained-draft"}
    assert len(zoo.pairs()) == 16 and zoo.pairs()[-1] == ("llama-trained", "trained")
    assert set(zoo.manifest()["models"]) == seeded
    with pytest.raises(ValueError, match="llama-twin"):
        zoo.model_dir("gpt2")
    with pytest.raises(ValueError):
        zoo.pair("llama", "cousin")


def test_pair_self_is_target(zoo_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECPARITY_ZOO_DIR", str(zoo_root))
    t, d = zoo.pair("qwen3", "self")
    assert t == d and t.parent == zoo_root and t.name.startswith("qwen3-")
    t, d = zoo.pair("llama", "twin")
    assert t.name.rsplit("-", 1)[0] == "llama" and d.name.rsplit("-", 1)[0] == "llama-twin"


def test_build_is_deterministic_and_matches_manifest(tmp_path: Path) -> None:
    man = zoo.manifest()
    assert man["tokenizer_sha256"] == zoo.tokenizer_digest()
    for name in build.MODEL_NAMES:
        a = build.write_model(name, tmp_path / "a" / name)
        b = build.write_model(name, tmp_path / "b" / name)
        assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
        entry = man["models"][name]
        assert zoo.weights_digest(a) == zoo.weights_digest(b) == entry["weights_sha256"]
        assert zoo.config_digest(a) == zoo.config_digest(b) == entry["config_sha256"]
        assert entry["tokenizer_sha256"] == zoo.tokenizer_digest()
        assert entry["recipe"] == build.RECIPES[name].to_json()


def test_model_dir_builds_atomically(fresh_zoo: Path) -> None:
    d = zoo.model_dir("llama-small")
    digest = zoo.manifest()["models"]["llama-small"]["weights_sha256"]
    assert d == fresh_zoo / f"llama-small-{digest[:12]}"  # keyed by the pinned digest
    assert [p.name.rsplit("-", 1)[0] for p in fresh_zoo.iterdir()] == ["llama-small"]  # no temp leftovers
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["eos_token_id"] == zoo.eos_id()
    assert zoo.model_dir("llama-small") == d  # cached path, no rebuild


def test_tampered_weights_raise(fresh_zoo: Path) -> None:
    d = zoo.model_dir("qwen3-small")
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x40  # flip a bit in the last tensor's payload
    st = f.stat()
    f.write_bytes(bytes(data))
    # same size; make sure mtime moves even on coarse-timestamp filesystems
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    with pytest.raises(zoo.ZooDriftError, match=r"^zoo drift: qwen3-small: model\.safetensors"):
        zoo.model_dir("qwen3-small")
    # a fresh process (empty verification cache) catches it too
    zoo.clear_verification_cache()
    with pytest.raises(zoo.ZooDriftError, match="model.safetensors"):
        zoo.model_dir("qwen3-small")


def test_altered_tensor_raises(fresh_zoo: Path) -> None:
    import mlx.core as mx

    d = zoo.model_dir("llama-small")
    f = d / "model.safetensors"
    tensors = mx.load(str(f))
    k = sorted(tensors)[0]
    tensors[k] = tensors[k] * 1.0001
    mx.save_safetensors(str(f), tensors, metadata={"format": "mlx"})
    zoo.clear_verification_cache()
    with pytest.raises(zoo.ZooDriftError) as ei:
        zoo.model_dir("llama-small")
    msg = str(ei.value)
    assert msg.startswith("zoo drift:") and "llama-small" in msg and "model.safetensors" in msg
    assert zoo.manifest()["models"]["llama-small"]["weights_sha256"] in msg


def test_tampered_config_raises(fresh_zoo: Path) -> None:
    d = zoo.model_dir("llama-small")
    cfg = d / "config.json"
    text = cfg.read_text()
    assert '"rms_norm_eps": 1e-06' in text
    cfg.write_text(text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    zoo.clear_verification_cache()
    with pytest.raises(zoo.ZooDriftError, match="config.json"):
        zoo.model_dir("llama-small")


def test_manifest_mismatch_raises(fresh_zoo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = zoo.manifest()
    fake = json.loads(json.dumps(real))
    fake["models"]["qwen3-small"]["weights_sha256"] = "0" * 64
    monkeypatch.setattr(zoo, "manifest", lambda: fake)
    with pytest.raises(zoo.ZooDriftError) as ei:
        zoo.model_dir("qwen3-small")
    msg = str(ei.value)
    assert msg.startswith("zoo drift: qwen3-small: model.safetensors")
    assert "0" * 64 in msg and real["models"]["qwen3-small"]["weights_sha256"] in msg


def test_recipe_mismatch_raises(fresh_zoo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = json.loads(json.dumps(zoo.manifest()))
    fake["models"]["llama-twin"]["recipe"]["noise_scale"] = 0.5
    monkeypatch.setattr(zoo, "manifest", lambda: fake)
    with pytest.raises(zoo.ZooDriftError, match="zoo drift: llama-twin: build recipe"):
        zoo.model_dir("llama-twin")


def _getters() -> list[tuple[str, object, str, type]]:
    from zoo import dspark, heads, native_mtp

    return [("head", heads.head_dir, "qwen35-mtp", heads.HeadDriftError),
            ("native-mtp", native_mtp.model_dir, "glm-mtp", native_mtp.NativeDriftError),
            ("dspark", dspark.artifact_dir, "qwen3-dspark", zoo.ZooDriftError)]


@pytest.mark.parametrize("kind", ["head", "native-mtp", "dspark"])
def test_every_pinned_artifact_is_built_and_its_drift_caught(fresh_zoo: Path, kind: str) -> None:
    """The one getter (``zoo.pinned.artifact``) behind heads, native-MTP checkpoints and
    DSpark/DeepSpec drafters: built once into the cache, then a missing or tampered file is
    drift naming the artifact and the file."""
    _, get, name, drift = next(g for g in _getters() if g[0] == kind)
    d = get(name)
    assert d.parent == fresh_zoo and d.name.startswith(("head-", "native-", "qwen3-")), d
    assert get(name) == d and len([p for p in fresh_zoo.iterdir() if name in p.name]) == 1
    cfg = next(p for p in (d / "dspark.json", d / "config.json") if p.exists())
    text = cfg.read_text()
    cfg.write_text(text.replace("}", ', "planted": 1}', 1) if text.startswith("{") else text + " ")
    zoo.clear_verification_cache()
    with pytest.raises(drift, match=rf"zoo drift: .*{name}.*(config|{cfg.name})"):
        get(name)
    cfg.unlink()
    # dspark's file list is what the built dir holds: a deleted config is a digest mismatch there
    with pytest.raises(drift, match=rf"zoo drift: .*{name}: " + ("" if kind == "dspark" else f"missing file in {d}")):
        get(name)


def test_check_digests_names_the_file_and_both_digests(tmp_path: Path) -> None:
    from zoo import pinned

    def boom() -> str:
        raise OSError("unreadable here")

    entry = {"w": "a" * 64, "c": "b" * 64}
    ok = (("model.safetensors", "w", lambda: "a" * 64),)
    pinned.check_digests(tmp_path, entry, ok, ValueError, "advice")
    with pytest.raises(ValueError, match=rf"^config.json in {tmp_path} has sha256 c+, manifest expects b+ \(fix it\)$"):
        pinned.check_digests(tmp_path, entry, (*ok, ("config.json", "c", lambda: "c" * 64)), ValueError, "fix it")
    with pytest.raises(ValueError, match=r"config.json in .* unreadable \(unreadable here\); expected sha256 b+$"):
        pinned.check_digests(tmp_path, entry, (("config.json", "c", boom),), ValueError, "fix it")


@pytest.mark.parametrize("name", ["llama", "llama-twin", "llama-small", "qwen3", "qwen3-twin", "qwen3-small"])
def test_mlx_lm_load(zoo_root: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx
    import mlx_lm

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SPECPARITY_ZOO_DIR", str(zoo_root))
    model, tok = mlx_lm.load(str(zoo.model_dir(name)))
    assert zoo.eos_id() in tok.eos_token_ids
    assert tok.convert_tokens_to_ids(zoo.EOS_TOKEN) == zoo.eos_id()
    ids = list(zoo.prompt("nat-00").token_ids)
    assert tok.encode(zoo.prompt("nat-00").text) == ids  # no BOS added
    logits = model(mx.array(ids)[None])
    assert logits.shape == (1, len(ids), 512) and logits.dtype == mx.float32


def test_prompt_set() -> None:
    ps = zoo.prompts()
    assert len(ps) >= 32
    ids = [p.id for p in ps]
    assert len(set(ids)) == len(ids)
    assert {p.kind for p in ps} == {"natural", "random"}
    for p in ps:
        assert isinstance(p.token_ids, tuple) and 5 <= len(p.token_ids) <= 40
        assert all(0 <= t < 512 for t in p.token_ids)
        prefix = "nat-" if p.kind == "natural" else "rnd-"
        assert p.id.startswith(prefix)
        assert (p.text is not None) == (p.kind == "natural")
        assert zoo.eos_id() not in p.token_ids
    assert zoo.prompt("rnd-00").kind == "random"
    with pytest.raises(KeyError):
        zoo.prompt("nat-99")


def test_tokenizer_round_trip() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(zoo.tokenizer_path()))
    assert tok.get_vocab_size() == 512
    assert tok.token_to_id(zoo.EOS_TOKEN) == zoo.eos_id()
    for p in zoo.prompts():
        if p.kind != "natural":
            continue
        assert tuple(tok.encode(p.text, add_special_tokens=False).ids) == p.token_ids
        assert tok.decode(list(p.token_ids)) == p.text


def test_import_is_light() -> None:
    import subprocess
    import sys

    code = "import sys, zoo; print('mlx_lm' in sys.modules, 'mlx.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("target", ["llama", "qwen3"])
def test_acceptance_bands(zoo_root: Path, target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECPARITY_ZOO_DIR", str(zoo_root))
    assert zoo.measure_acceptance(target, "self", prompt_ids=["nat-00", "rnd-00"]) == 1.0
    acc = zoo.measure_acceptance(target, "twin", gamma=3, max_tokens=32)
    assert 0.30 <= acc <= 0.80, acc
