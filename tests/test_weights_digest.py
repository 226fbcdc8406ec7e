"""The one weights digest (``traces.digest.weights_digest``) over every dtype MLX saves.

A bf16 tensor in a single-file checkpoint used to stop every command
("'bfloat16' is not a valid PEP 3118 buffer format string"): each dtype and
quantization mlx-lm writes is digested here, single-file and sharded give the
same digest, one flipped bit changes it, and the fp32 digests pinned before the
function existed are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from traces.digest import weights_digest  # noqa: E402


def _tensors(dtype: str) -> dict[str, object]:
    rng = np.random.default_rng(7)
    base = {"a.weight": rng.standard_normal((8, 64)).astype(np.float32),
            "b.bias": rng.standard_normal((5,)).astype(np.float32)}
    if dtype in ("float32", "float16", "bfloat16"):
        return {k: mx.array(v).astype(getattr(mx, dtype)) for k, v in base.items()}
    # quantized: what mlx_lm.convert -q writes (packed uint32 weights + scales/biases)
    bits, group, mode = {"q4g32": (4, 32, "affine"), "q4g64": (4, 64, "affine"),
                         "q8g32": (8, 32, "affine"), "q8g64": (8, 64, "affine"),
                         "mxfp4": (4, 32, "mxfp4")}[dtype]
    out: dict[str, object] = {}
    for scale_dtype in (mx.bfloat16,):
        w = mx.array(base["a.weight"]).astype(scale_dtype)
        q = mx.quantize(w, group_size=group, bits=bits, mode=mode)
        out["a.weight"], out["a.scales"] = q[0], q[1]
        if len(q) > 2 and q[2] is not None:
            out["a.biases"] = q[2]
        out["b.bias"] = mx.array(base["b.bias"]).astype(scale_dtype)
    return out


DTYPES = ("float32", "float16", "bfloat16", "q4g32", "q4g64", "q8g32", "q8g64", "mxfp4")


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_single_equals_sharded_and_a_bit_flip_is_seen(tmp_path: Path, dtype: str) -> None:
    t = _tensors(dtype)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir()
    sharded.mkdir()
    mx.save_safetensors(str(single / "model.safetensors"), t, metadata={"format": "mlx"})
    names = sorted(t)
    mx.save_safetensors(str(sharded / "model-00001-of-00002.safetensors"), {k: t[k] for k in names[:1]})
    mx.save_safetensors(str(sharded / "model-00002-of-00002.safetensors"), {k: t[k] for k in names[1:]})
    d = weights_digest(single)
    assert d == weights_digest(sharded) == weights_digest(single / "model.safetensors"), dtype

    # plant: one bit of one element of the first tensor flipped
    first = names[0]
    a = t[first]
    width = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.dtype.size]
    bits = np.array(a.reshape(-1).view(width))
    bits[0] ^= 1
    planted = dict(t)
    planted[first] = mx.array(bits).view(a.dtype).reshape(a.shape)
    other = tmp_path / "planted"
    other.mkdir()
    mx.save_safetensors(str(other / "model.safetensors"), planted)
    assert weights_digest(other) != d, f"{dtype}: a flipped bit in {first} left the digest unchanged"


def test_bf16_digest_is_the_raw_bits(tmp_path: Path) -> None:
    """bf16 is hashed as its raw 16-bit patterns, computed here independently."""
    w = mx.array(np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)).astype(mx.bfloat16)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"w": w})
    raw = np.array(w.view(mx.uint16)).astype("<u2").tobytes()
    h = hashlib.sha256()
    h.update(b"w\0mlx.core.bfloat16\0" + json.dumps([3, 4]).encode() + b"\0" + raw)
    assert weights_digest(tmp_path) == h.hexdigest()


def test_fp32_digest_unchanged_from_the_numpy_formula(tmp_path: Path) -> None:
    """The digests pinned in the zoo manifests were np.asarray bytes: still the same."""
    t = {"x": mx.array(np.arange(10, dtype=np.float32)), "y": mx.array(np.ones((2, 3), np.float16))}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), t)
    h = hashlib.sha256()
    for name in sorted(t):
        arr = np.ascontiguousarray(np.asarray(t[name]))
        h.update(name.encode() + b"\0" + str(t[name].dtype).encode() + b"\0"
                 + json.dumps(list(t[name].shape)).encode() + b"\0")
        h.update(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    assert weights_digest(tmp_path) == h.hexdigest()


def test_a_fifo_named_safetensors_is_refused_not_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="not a regular file"):
        weights_digest(tmp_path)
