"""Cache digests for traces: sha256 over each cache layer's live state.

Reference: mlx-lm 0.32.2 ``mlx_lm/models/cache.py`` (``KVCache``,
``RotatingKVCache``, ``QuantizedKVCache``, ``ArraysCache``, ``CacheList``).
Only the valid region is hashed: a ``KVCache`` buffer past ``offset`` is
garbage (``trim`` only moves ``offset``), so ``keys[..., :offset, :]`` is what
counts.  A rotating cache is hashed in temporal order.

Digest format (``DIGEST`` in ``traces/INTERPRETING.md``): ``layers[i]`` is the
hex sha256 of layer ``i``; ``combined`` is the hex sha256 of the layer digests
joined by ``"\\n"``.  Each layer hash covers its kind, integer metadata
(``offset`` ...) and, per array, ``dtype``, ``shape`` and the raw bytes, so the
digest is bit-exact: equal only for identical cache contents.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SAFETENSORS_DTYPES", "WeightsError", "array_bytes", "cache_digest", "layer_digest", "live_state",
           "safetensors_header", "weight_files", "weights_digest"]


def array_bytes(a: Any) -> tuple[str, tuple[int, ...], bytes]:
    """``(dtype name, shape, raw C-order bytes)`` of an mlx or numpy array."""
    import numpy as np

    if isinstance(a, np.ndarray):
        arr = np.ascontiguousarray(a)
        return str(arr.dtype), tuple(arr.shape), arr.tobytes()
    import mlx.core as mx

    dtype = str(a.dtype).removeprefix("mlx.core.")
    shape = tuple(int(s) for s in a.shape)
    size = a.dtype.size
    # numpy has no bfloat16: reinterpret every dtype as unsigned ints of its width.
    as_uint = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[size]
    flat = a.reshape(-1) if a.ndim else a.reshape(1)
    raw = np.array(flat.view(as_uint) if a.dtype != as_uint else flat, copy=True)
    return dtype, shape, raw.tobytes()


SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
                      "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
                      "F64": 8, "I64": 8, "U64": 8, "C64": 8}
"""Bytes per element of every safetensors dtype (the safetensors format's ``Dtype``; MLX reads these)."""
MAX_HEADER_BYTES = 100 << 20
"""A safetensors header longer than this is refused (the format's own limit is 100 MB)."""


class WeightsError(ValueError):
    """A weights file whose header does not describe the file (one line naming file and tensor)."""


def safetensors_header(f: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors file's header, checked against each other and the file
    before anything (MLX's loader) trusts them.

    Format (huggingface/safetensors ``docs`` "Format"): 8 bytes little-endian header length
    ``N``, ``N`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]},
    "__metadata__": {...}}``, then the data; offsets are relative to the data. Refused (one line
    naming the file and the tensor): a header past the file, not a JSON object, an entry without
    a known ``dtype`` (:data:`SAFETENSORS_DTYPES`), a ``shape`` that is not a list of integers
    >= 0, ``data_offsets`` that are not ``0 <= begin <= end``, a byte length that is not
    ``prod(shape) * itemsize``, data past the end of the file, overlapping tensors.
    """
    p = Path(f)
    fix = "an incomplete download or a corrupt file; re-download or rebuild it"
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise WeightsError(f"{p}: truncated safetensors file ({size} bytes): {fix}")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise WeightsError(f"{p}: safetensors header length {n} exceeds the file: {fix}")
            header = json.loads(fh.read(n))
    except OSError as exc:
        raise WeightsError(f"{p}: cannot read ({exc.strerror})") from None
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, WeightsError):
            raise
        raise WeightsError(f"{p}: unreadable safetensors header: {fix}") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{p}: unreadable safetensors header (not a JSON object): {fix}")
    data = size - 8 - n
    spans = []
    out: dict[str, dict[str, Any]] = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        where = f"{p}: tensor {name!r}"
        if not isinstance(t, dict):
            raise WeightsError(f"{where}: not an object: {fix}")
        dtype, shape, offs = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise WeightsError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(SAFETENSORS_DTYPES)})")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise WeightsError(f"{where}: shape {shape!r} is not a list of integers >= 0: {fix}")
        if not (isinstance(offs, list) and len(offs) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise WeightsError(f"{where}: no valid data_offsets ({offs!r}): {fix}")
        begin, end = offs
        if not 0 <= begin <= end:
            raise WeightsError(f"{where}: data_offsets {offs} are not 0 <= begin <= end: {fix}")
        count = 1
        for d in shape:
            count *= d
        want = count * SAFETENSORS_DTYPES[dtype]
        if end - begin != want:
            raise WeightsError(f"{where}: data_offsets {offs} hold {end - begin} bytes, its shape {shape} "
                               f"of {dtype} needs {want}: {fix}")
        if end > data:
            raise WeightsError(f"{p}: truncated ({size} bytes, tensors need {8 + n + end}): {fix}")
        spans.append((begin, end, name))
        out[name] = t
    reach, owner = 0, ""
    for begin, end, name in sorted(spans):
        if end > begin and begin < reach:
            raise WeightsError(f"{p}: tensors {owner!r} and {name!r} overlap (bytes {begin}..{min(reach, end)} "
                               f"of the data): {fix}")
        if end > reach:
            reach, owner = end, name
    return out


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The ``*.safetensors`` regular files of a model dir (or ``[path]`` for one file), sorted,
    each header checked against its file (:func:`safetensors_header`).

    Only regular files: a FIFO or a device named ``*.safetensors`` would block
    or never end a read, so it is refused with a one-line ``ValueError``.
    """
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    for f in files:
        if not f.is_file():
            raise ValueError(f"{f}: not a regular file (a weights file must be one)")
        safetensors_header(f)  # before mx.load trusts its offsets
    return files


def weights_digest(path: str | os.PathLike[str]) -> str:
    """Canonical sha256 of a model's weights, for every dtype and quantization MLX saves.

    ``path`` is a model dir (every ``*.safetensors`` in it: single-file or
    sharded give the same digest) or one ``.safetensors`` file. The digest
    covers the sorted tensor names and, per tensor, ``str(dtype)`` (e.g.
    ``mlx.core.bfloat16``), the shape as JSON and the raw little-endian bytes
    as ``mx.load`` gives them: independent of the safetensors header layout,
    key order and sharding. Quantized checkpoints (uint32 packed weights with
    float scales/biases, mxfp4's uint8 scales) are hashed like any other
    tensors. The bytes are read through an unsigned view of the same width,
    since numpy has no bfloat16 (``np.asarray`` of a bf16 array raises
    "'bfloat16' is not a valid PEP 3118 buffer format string"); for every other
    dtype that view gives the same bytes ``np.asarray`` would, so the digests
    pinned before this function existed are unchanged.

    The one weights digest of the project: trace headers (``weights_sha256``),
    the zoo manifests, the golden manifest and case ids all call it.
    """
    import mlx.core as mx

    tensors: dict[str, Any] = {}
    for f in weight_files(path):
        tensors.update(mx.load(str(f)))  # type: ignore[arg-type]
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = tensors[name]
        h.update(name.encode() + b"\0" + str(a.dtype).encode() + b"\0"
                 + json.dumps([int(s) for s in a.shape]).encode() + b"\0")
        h.update(array_bytes(a)[2])
        del a
        tensors[name] = None  # free each tensor once hashed (a model may not fit twice)
    return h.hexdigest()


def _hash_arrays(h: Any, name: str, arrays: Iterable[Any]) -> None:
    for i, a in enumerate(arrays):
        if a is None:
            h.update(f"{name}[{i}]:none\n".encode())
            continue
        dtype, shape, raw = array_bytes(a)
        h.update(f"{name}[{i}]:{dtype}:{list(shape)}\n".encode())
        h.update(raw)


def _kv_live(c: Any) -> tuple[list[Any], list[Any]]:
    """Live keys/values (lists, to cover quantized tuples) of a KV-style cache."""
    keys, values, offset = c.keys, c.values, int(c.offset)
    if keys is None:
        return [], []

    def cut(x: Any) -> list[Any]:
        parts = list(x) if isinstance(x, tuple | list) else [x]
        return [p[..., :offset, :] for p in parts]

    if hasattr(c, "max_size") and hasattr(c, "_temporal_order"):
        n = min(offset, int(c.max_size))
        def order(x: Any) -> list[Any]:
            parts = list(x) if isinstance(x, tuple | list) else [x]
            return [c._temporal_order(p)[..., -n:, :] if n else p[..., :0, :] for p in parts]
        return order(keys), order(values)
    return cut(keys), cut(values)


def layer_digest(c: Any) -> str:
    """Hex sha256 of one cache layer's live state.

    Args:
        c: An mlx-lm cache object (or anything with ``keys``/``values``/``offset``,
            ``cache`` (arrays cache), ``caches`` (cache list) or ``state``).

    Returns:
        The hex digest.
    """
    h = hashlib.sha256()
    h.update(f"kind:{type(c).__name__}\n".encode())
    if hasattr(c, "caches") and isinstance(c.caches, Sequence | tuple):
        for sub in c.caches:
            h.update(layer_digest(sub).encode())
        return h.hexdigest()
    meta, groups = live_state(c)
    if meta is not None:
        h.update(meta.encode())
    for name, arrays in groups:
        _hash_arrays(h, name, arrays)
    return h.hexdigest()


def live_state(c: Any) -> tuple[str | None, list[tuple[str, list[Any]]]]:
    """A cache layer's live state: a metadata line and named groups of arrays.

    KV-style caches give ``keys``/``values`` cut to the live region (a rotating
    cache in temporal order); an arrays cache its ``cache`` list; anything else
    the arrays of its ``state``. This is exactly what ``layer_digest`` hashes
    and what the serial-replay audit compares byte for byte.
    """
    if hasattr(c, "keys") and hasattr(c, "offset"):
        meta = {"offset": int(c.offset)}
        for attr in ("keep", "max_size"):
            if hasattr(c, attr):
                meta[attr] = int(getattr(c, attr))
        keys, values = _kv_live(c)
        return f"meta:{sorted(meta.items())}\n", [("keys", keys), ("values", values)]
    if hasattr(c, "cache") and isinstance(c.cache, list):
        return None, [("cache", list(c.cache))]
    state = getattr(c, "state", [])
    flat: list[Any] = []
    _flatten(state, flat)
    arrays = [x for x in flat if hasattr(x, "shape")]
    scalars = [x for x in flat if not hasattr(x, "shape")]
    return f"scalars:{scalars!r}\n", [("state", arrays)]


def _flatten(x: Any, out: list[Any]) -> None:
    if isinstance(x, list | tuple):
        for y in x:
            _flatten(y, out)
    else:
        out.append(x)


def cache_digest(caches: Sequence[Any]) -> dict[str, Any]:
    """Digest of a whole prompt cache (one entry per layer).

    Args:
        caches: The per-layer cache list.

    Returns:
        ``{"combined": hex, "layers": [hex, ...]}``.
    """
    layers = [layer_digest(c) for c in caches]
    combined = hashlib.sha256("\n".join(layers).encode()).hexdigest()
    return {"combined": combined, "layers": layers}


CONFIG_FILES = ("dspark.json", "config.json")
"""A model directory's configuration file, first found: a DSpark drafter's ``dspark.json``
(it has no ``config.json``), else mlx-lm's ``config.json``."""


def config_digest(model_dir: str | os.PathLike[str]) -> str | None:
    """sha256 of a model directory's configuration file (:data:`CONFIG_FILES`), None without one.

    The one definition of a trace header's ``config_sha256``: every header builder (the
    runners, ``traces.writer.model_identity``) and every check of a header (``grade``) use it.
    A FIFO or other non-regular file is refused (``traces.io.regular_file``).
    """
    from traces.io import regular_file

    p = Path(model_dir)
    for name in CONFIG_FILES:
        f = p / name
        if f.exists():
            return hashlib.sha256(regular_file(f).read_bytes()).hexdigest()
    return None
