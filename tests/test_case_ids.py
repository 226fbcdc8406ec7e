"""Case ids from weight digests (specparity/cases/case.py ``model_label``, ``cached_weights_digest``).

Two fine-tunes in same-named folders with equal file sizes get different ids; the same
model in another folder keeps its id; digests are hashed once per content stamp (path,
sizes, ``mtime_ns``) and kept in process and on disk.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from specparity.cases import case as cases
from specparity.cases.case import cached_weights_digest, model_label
from tests import foreign


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECPARITY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cases, "_DIGESTS", {})
    monkeypatch.setattr(cases, "DISK_CACHE_MIN_BYTES", 0)  # the fixtures are tiny
    return tmp_path / "cache"


def _flip_one_weight(model_dir: Path) -> None:
    f = model_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # a bit of the last tensor's bytes: the file keeps its size
    f.write_bytes(bytes(data))


def test_same_named_fine_tunes_with_equal_sizes_get_different_ids(tmp_path: Path, cache_dir: Path) -> None:
    a = foreign.write_model("phi3", tmp_path / "a" / "my-finetune")
    b = tmp_path / "b" / "my-finetune"
    shutil.copytree(a, b)
    assert model_label(a) == model_label(b)  # same model, other folder: same id
    _flip_one_weight(b)
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    la, lb = model_label(a), model_label(b)
    assert la != lb and la.startswith("my-finetune-") and lb.startswith("my-finetune-")


def test_digests_are_cached_in_process_and_on_disk(tmp_path: Path, cache_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import traces.digest

    m = foreign.write_model("olmo2", tmp_path / "m")
    first = cached_weights_digest(m)
    assert first == traces.digest.weights_digest(m)
    assert len(list((cache_dir / "digests").glob("*.json"))) == 1

    def no_rehash(path: object) -> str:
        raise AssertionError(f"re-hashed {path}")

    monkeypatch.setattr(traces.digest, "weights_digest", no_rehash)
    assert cached_weights_digest(m) == first  # in process
    monkeypatch.setattr(cases, "_DIGESTS", {})
    assert cached_weights_digest(m) == first  # from disk, a new process's view
    # a rewrite changes the stamp (mtime_ns), so the planted re-hash is hit
    _flip_one_weight(m)
    st = (m / "model.safetensors").stat()
    os.utime(m / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(AssertionError, match="re-hashed"):
        cached_weights_digest(m)


def test_small_checkpoints_stay_off_the_disk_cache(tmp_path: Path, cache_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cases, "DISK_CACHE_MIN_BYTES", 1 << 30)
    cached_weights_digest(foreign.write_model("olmo2", tmp_path / "m"))
    assert not (cache_dir / "digests").exists()


def test_a_corrupt_disk_cache_is_ignored(tmp_path: Path, cache_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    m = foreign.write_model("olmo2", tmp_path / "m")
    good = cached_weights_digest(m)
    for f in (cache_dir / "digests").glob("*.json"):
        f.write_text("{not json")
    monkeypatch.setattr(cases, "_DIGESTS", {})
    assert cached_weights_digest(m) == good
