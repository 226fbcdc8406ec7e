"""A test double for a backend whose batched forward is not bit-exact to one-token decode.

Reference: ``../shared/reference/speculative-decoding.md`` §2.1 ("Batched
verify vs stock decode") and the measurement in issue 13: on MLX 0.32.4's
CUDA backend (NVIDIA H200) the fp32 zoo's verify-window logit rows differ from
serial decode by up to ~1e-2. On the CPU the two paths are byte-identical, so
the numerics witness (``engine/witness.py``) would never see a real flip here.

:func:`emulate_nonexact` makes a loaded mlx-lm model behave like such a
backend: every forward over more than one token (a verify window, a prefill
chunk, a two-token drafter re-feed) gets uniform noise in ``[-scale, scale]``
added to each logit; one-token forwards are untouched (plain decode's path).
The noise is a pure function of the call's inputs -- ``(seed, cache offset
before the call, input token ids)`` -- the way a deterministic GPU kernel's
rounding depends only on its inputs and shapes, so re-running the same window
on the same prefix (what the witness does) reproduces it exactly. The class
of the model instance is swapped (as
``engine/rollback.py`` does for recorded projections), so the object, its
``layers``, ``make_cache`` and every holder of a reference keep working.

Caches are not perturbed unless ``kv_scale > 0``: then every multi-token
forward also adds uniform noise in ``[-kv_scale, kv_scale]`` to the cache
state it wrote -- a KV layer's new positions (``keys``/``values``, the last
``L`` of a rotating cache's buffer after its concatenating update), an
``ArraysCache`` layer's arrays (conv and recurrent state) -- keyed like the
logits' noise plus the layer index. So a prompt prefilled in one chunk and the
same prompt prefilled in two (a warm prompt-cache request prefills only its
suffix) leave different cache bytes, as measured on the H200 (warm ≠ cold
``target_cache_digest`` from layer 1 on; cache |Δ| up to ~1e-3..1e-2,
``docs/backends.md``), while re-running a forward on the same cache and inputs
writes the same bytes. One-token forwards (plain decode, a drafter's drafting
steps) write exact bytes. A ``QuantizedKVCache`` is left alone.

**A batch** (the batched executor ``engine/batched.py``: mlx-lm's left-padded batch caches,
``BatchKVCache`` / ``BatchRotatingKVCache`` / a batched ``ArraysCache``): on a GPU a row's
arithmetic depends on the batch it runs in -- the batch size B, the row's index, its left
padding, the window length M and where the batch writes (measured on MLX 0.32.4 CUDA, H200
and H100, issue 39: a batched row's ``target_cache_digest`` differs from its serial run's
from the first round, its verify rows from one-token decode's). So every forward over a
batch (any M, any B: the batch's kernels are not one-token decode's) gets, per row ``b``,
logit noise in ``[-scale, scale]`` and (``kv_scale > 0``) cache-write noise in
``[-kv_scale, kv_scale]`` on the positions row ``b`` wrote (a batched KV layer's
``[write index, write index + M)``, a rotating batch's last M, a batched ``ArraysCache``'s
row), keyed by :func:`batch_row_key` ``(seed, B, b, left padding of b, M, write index, the
row's input ids)`` (plus the layer index for the caches). The same batch re-run writes the
same bytes (what the batched checks' replays rely on); the same row in another batch, or
alone through the serial executor, gets other noise -- as on the GPU.

``SPECPARITY_EMULATE_NONEXACT=SCALE[:SEED[:KV_SCALE]]`` asks ``specparity``'s
model loader to wrap every model it loads (:func:`from_env`). What the GPU does, measured
(docs/backends.md "The CPU double"): ``0.01:0:0.001`` (logit rows within ~1e-2, cache
writes within ~1e-3).
"""

from __future__ import annotations

import hashlib
from typing import Any, cast

import mlx.core as mx

ENV = "SPECPARITY_EMULATE_NONEXACT"

__all__ = ["ENV", "batch_row_key", "emulate_nonexact", "exact", "from_env", "emulated_kv_scale", "is_emulated"]


def _offset(cache: Any) -> int:
    for c in cache or ():
        off = getattr(c, "offset", None)
        if isinstance(off, int):
            return off
    return -1


def _key(seed: int, offset: int, inputs: mx.array) -> int:
    h = hashlib.sha256(f"{seed}:{offset}:{inputs.tolist()}".encode())
    return int.from_bytes(h.digest()[:4], "little")


def _noise(like: mx.array, scale: float, key: int) -> mx.array:
    return mx.random.uniform(-scale, scale, like.shape, key=mx.random.key(key)).astype(like.dtype)


def _kv_layer(c: Any) -> bool:
    """A KV layer with plain (not quantized) arrays, or one that holds nothing yet."""
    keys = getattr(c, "keys", False)
    return isinstance(getattr(c, "offset", None), int) and (keys is None or isinstance(keys, mx.array))


def _perturb_caches(cache: Any, before: list[int | None], length: int, scale: float, key: int) -> None:
    """Add noise to what one ``length``-token forward wrote into each cache layer (module docstring)."""
    for i, c in enumerate(cache):
        k = (key + 7919 * (i + 1)) % (1 << 32)
        if _kv_layer(c) and c.keys is not None and before[i] is not None:
            if hasattr(c, "max_size"):  # RotatingKVCache: a multi-token update concatenates at the end
                n = min(length, int(c.keys.shape[2]))
                c.keys[..., -n:, :] = c.keys[..., -n:, :] + _noise(c.keys[..., -n:, :], scale, k)
                c.values[..., -n:, :] = c.values[..., -n:, :] + _noise(c.values[..., -n:, :], scale, k + 1)
            else:
                lo, hi = int(before[i] or 0), int(c.offset)
                if hi > lo:
                    c.keys[..., lo:hi, :] = c.keys[..., lo:hi, :] + _noise(c.keys[..., lo:hi, :], scale, k)
                    c.values[..., lo:hi, :] = c.values[..., lo:hi, :] + _noise(c.values[..., lo:hi, :], scale,
                                                                              k + 1)
        elif isinstance(getattr(c, "cache", None), list):  # ArraysCache: the recurrent state
            c.cache = [a if a is None or not mx.issubdtype(a.dtype, mx.floating)
                       else a + _noise(a, scale, k + j) for j, a in enumerate(c.cache)]


def _batched(cache: Any) -> bool:
    """mlx-lm's batch caches: a KV layer with per-row ``left_padding`` (the batched executor's)."""
    return any(_batch_kv(c) for c in cache or ())


def _batch_kv(c: Any) -> bool:
    return hasattr(c, "keys") and getattr(c, "left_padding", None) is not None


def batch_row_key(seed: int, batch: int, row: int, left_padding: int, width: int, write_index: int,
                  inputs: list[int]) -> int:
    """The noise key of row ``row`` of a ``batch``-row forward over ``width`` positions written at
    ``write_index`` (module docstring): a pure function of where the row runs and what it feeds."""
    h = hashlib.sha256(f"{seed}:batch:{batch}:{row}:{left_padding}:{width}:{write_index}:{inputs}".encode())
    return int.from_bytes(h.digest()[:4], "little")


def _perturb_batch(cache: Any, idx: list[int | None], keys: list[int], width: int, kv_scale: float) -> None:
    """Add each row's cache-write noise to what one batched ``width``-wide forward wrote."""
    for i, c in enumerate(cache):
        if _batch_kv(c):
            if c.keys is None or not isinstance(c.keys, mx.array) or idx[i] is None:
                continue
            if hasattr(c, "max_size"):  # BatchRotatingKVCache: a W >= 2 update concatenates at the end
                if width < 2:
                    continue
                n = min(width, int(c.keys.shape[2]))
                lo, hi = int(c.keys.shape[2]) - n, int(c.keys.shape[2])
            else:
                lo, hi = int(idx[i] or 0), int(c._idx)
            if hi <= lo:
                continue
            kk, vv = mx.array(c.keys), mx.array(c.values)
            for b, key in enumerate(keys):
                k = (key + 7919 * (i + 1)) % (1 << 32)
                kk[b : b + 1, :, lo:hi, :] = kk[b : b + 1, :, lo:hi, :] + _noise(kk[b : b + 1, :, lo:hi, :], kv_scale, k)
                vv[b : b + 1, :, lo:hi, :] = vv[b : b + 1, :, lo:hi, :] + _noise(vv[b : b + 1, :, lo:hi, :], kv_scale,
                                                                                  k + 1)
            c.keys, c.values = kk, vv
        elif isinstance(getattr(c, "cache", None), list):  # a batched ArraysCache: each row's state
            new = []
            for j, a in enumerate(c.cache):
                if a is None or not mx.issubdtype(a.dtype, mx.floating) or a.shape[0] != len(keys):
                    new.append(a)
                    continue
                rows = [a[b : b + 1] + _noise(a[b : b + 1], kv_scale, (key + 7919 * (i + 1) + j) % (1 << 32))
                        for b, key in enumerate(keys)]
                new.append(mx.concatenate(rows, axis=0))
            c.cache = new


def _batch_call(base: type, self: Any, inputs: mx.array, cache: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                scale: float, seed: int, kv_scale: float) -> Any:
    """A forward over mlx-lm's batch caches: per-row noise keyed by where the row runs."""
    bsz, width = int(inputs.shape[0]), int(inputs.shape[-1])
    lp = next((c.left_padding for c in cache if _batch_kv(c)), None)
    pads = [int(x) for x in lp.tolist()] if lp is not None else [0] * bsz
    idx = [int(c._idx) if _batch_kv(c) and hasattr(c, "_idx") else None for c in cache]
    write = next((x for x in idx if x is not None), 0)
    rows = cast(list[list[int]], inputs.tolist())
    keys = [batch_row_key(seed, bsz, b, pads[b] if b < len(pads) else 0, width, write, rows[b]) for b in range(bsz)]
    out = base.__call__(self, inputs, *args, **kwargs)
    if kv_scale:
        _perturb_batch(cache, idx, keys, width, kv_scale)
    if scale == 0:
        return out
    noise = mx.concatenate([mx.random.uniform(-scale, scale, (1, *out.shape[1:]), key=mx.random.key(k))
                            for k in keys], axis=0)
    return out + noise.astype(out.dtype)


def emulate_nonexact(model: Any, scale: float, seed: int = 0, kv_scale: float = 0.0) -> Any:
    """Perturb ``model``'s multi-token forwards in place (module docstring); returns ``model``.

    ``kv_scale > 0``: those forwards' cache writes too (input-deterministic, per layer)."""
    if scale < 0 or kv_scale < 0:
        raise ValueError(f"scale and kv_scale must be >= 0, got {scale}, {kv_scale}")
    base = type(model)
    if getattr(base, "_nonexact", None) is not None:
        base = base.__mro__[1]

    def __call__(self: Any, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", args[0] if args else None)
        if cache and inputs.ndim >= 2 and _batched(cache):
            return _batch_call(base, self, inputs, cache, args, kwargs, scale, seed, kv_scale)
        offset = _offset(cache)
        multi = inputs.ndim >= 2 and inputs.shape[-1] > 1
        before = [int(c.offset) if _kv_layer(c) else None for c in cache] if multi and kv_scale and cache \
            else None
        out = base.__call__(self, inputs, *args, **kwargs)
        if not multi or (scale == 0 and before is None):
            return out
        key = _key(seed, offset, inputs)
        if before is not None:
            _perturb_caches(cache, before, int(inputs.shape[-1]), kv_scale, key)
        if scale == 0:
            return out
        noise = mx.random.uniform(-scale, scale, out.shape, key=mx.random.key(key))
        return out + noise.astype(out.dtype)

    model.__class__ = type(f"NonExact{base.__name__}", (base,),
                           {"__call__": __call__, "_nonexact": (scale, seed), "_nonexact_kv": kv_scale})
    return model


def is_emulated(model: Any) -> tuple[float, int] | None:
    """``(scale, seed)`` when ``model`` is wrapped by :func:`emulate_nonexact`."""
    return getattr(type(model), "_nonexact", None)


def emulated_kv_scale(model: Any) -> float:
    """The cache-write noise of a wrapped ``model`` (0.0: caches exact, or not wrapped)."""
    return float(getattr(type(model), "_nonexact_kv", 0.0) or 0.0)


def exact(model: Any) -> Any:
    """Undo :func:`emulate_nonexact` on ``model`` (no-op on an unwrapped model)."""
    if is_emulated(model) is not None:
        model.__class__ = type(model).__mro__[1]
    return model


def from_env(model: Any) -> Any:
    """Wrap ``model`` when ``SPECPARITY_EMULATE_NONEXACT=SCALE[:SEED[:KV_SCALE]]`` is set
    (parsed by ``traces.env``: a malformed value is one line naming the variable)."""
    from traces import env

    parsed = env.get(ENV)
    if parsed is None:
        return model
    scale, seed, kv = parsed
    return emulate_nonexact(model, scale, seed, kv)
