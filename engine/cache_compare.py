"""Warm ≡ cold on a backend that is not bit-exact: cache bytes within a calibrated tolerance,
token flips through the numerics witness.

Reference: ``../shared/reference/speculative-decoding.md`` §2.1 (batched verify
vs stock decode: a non-bit-exact backend computes a prompt prefilled in one
chunk and the same prompt prefilled in two chunks -- what a warm prompt-cache
request does, ``engine/prompt_cache.py`` -- in different arithmetic), the
serial-replay audit's calibrated bound (``engine/audit.py``: ``ARITHMETIC_FACTOR``
× the largest batched-vs-serial |Δ| measured in the same run) and the numerics
witness (``engine/witness.py``: each run's own arithmetic path replayed on the
same prefix).

On MLX's CPU (bit-exact) ``specparity run --sessions`` holds a warm request to
its cold run byte for byte (``specparity.jobs.sessions.compare_records``). Elsewhere
(``engine.backend.arithmetic``: MLX's default device is not the CPU, or a model is wrapped
by the CPU's non-exact double ``engine.nonexact``) this module decides:

- **Tolerance** (:func:`calibrate`): for one model and one request, the same
  drained prompt is prefilled on fresh caches along several correct paths -- in
  one chunk (the cold run's), split at the warm request's reuse boundary (the
  warm run's), one token at a time (decode-written segments) and in chunks of
  2 and γ + 1 (a drafter's re-feed, verify windows) -- and the largest |Δ|
  against the one-chunk prefill is kept per layer and array (dtype alongside).
  The bound of a layer/array is ``factor`` (default 16, the audit's) × that
  measured |Δ|; a layer the controls leave byte-equal must stay byte-equal.
- **Cache checks** (:func:`check_caches`): warm vs cold per layer and array:
  metadata (offset, keep, max_size) and shapes exactly; values within the
  bound. A difference beyond it names the point (start / prefill / end), model,
  layer, array, position, both values, |Δ| and the bound.
- **Flips** (:func:`judge_flip`): when warm and cold sample different tokens
  after the same output prefix, each run's own path is replayed: the cold one
  from fresh caches (as the witness does), the warm one from a copy of the
  caches it started from (``CacheSnapshots.start_*``) with its recorded
  suffix prefill. ``numerics`` only when each path reproduces its own token;
  the caller also requires the start caches to pass the cache check against a
  cold prefill of the same prefix, so a one-token-short reuse or a stale
  drafter cache (their start state is wrong, not arithmetic) is never excused.
- **The request** (:func:`judge_request`): ``identical`` (byte-equal caches,
  equal records), ``numerics`` (caches within the bound and records equal
  but for arithmetic fields, or every flip witnessed) or ``logic``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import numpy as np

from engine.audit import ARITHMETIC_FACTOR, as_numpy, layer_arrays, meta_diff
from engine.witness import max_row_delta
from traces.diff import Flip, WitnessDeclined, WitnessVerdict
from traces.io import Trace

__all__ = [
    "ARITHMETIC_FIELDS",
    "CacheCheck",
    "Judgement",
    "Tolerance",
    "as_trace",
    "calibrate",
    "check_caches",
    "judge_flip",
    "judge_request",
]

# Record fields that are pure arithmetic (not byte-compared where the backend is not bit-exact).
ARITHMETIC_FIELDS = frozenset({"target_cache_digest", "drafter_cache_digest", "margins", "margin", "confidence"})


# --------------------------------------------------------------------------- tolerance

def _chunked(total: int, step: int, at: int | None = None) -> list[int]:
    """Forward sizes of a prefill of ``total`` tokens in ``step`` chunks (split first at ``at``)."""
    out: list[int] = []
    for lo, hi in ((0, at), (at, total)) if at else ((0, total),):
        n = hi - lo
        out += [step] * (n // step) + ([n % step] if n % step else [])
    return out


def _fill(model: Any, tokens: Sequence[int], sizes: Sequence[int], kv: Any = None) -> list[Any]:
    """Fresh caches of ``model`` fed ``tokens`` in forwards of ``sizes`` tokens each (``kv``: quantized
    after each forward, as the executor's prefill does, ``engine.caches.quantize_kv``)."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.caches import quantize_kv

    caches = make_prompt_cache(model)
    pos = 0
    for n in sizes:
        model(mx.array(list(tokens[pos : pos + n]), mx.uint32)[None], cache=caches)
        quantize_kv(caches, kv)
        mx.eval([c.state for c in caches])
        pos += n
    return caches


@dataclass
class Tolerance:
    """Per ``(layer, array)``: the largest |Δ| between correct prefill paths of one model.

    ``bound(layer, array)`` is ``factor`` × that; ``dtypes`` names each array's dtype;
    ``controls`` the paths measured (against the one-chunk prefill).
    """

    model: str
    factor: float = ARITHMETIC_FACTOR
    scales: dict[tuple[int, str], float] = field(default_factory=dict)
    dtypes: dict[tuple[int, str], str] = field(default_factory=dict)
    controls: list[str] = field(default_factory=list)

    def bound(self, layer: int, name: str) -> float:
        return self.factor * self.scales.get((layer, name), 0.0)

    def add(self, layer: int, name: str, dtype: str, delta: float) -> None:
        key = (layer, name)
        self.scales[key] = max(self.scales.get(key, 0.0), delta)
        self.dtypes[key] = dtype

    def per_layer(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for (layer, _), v in self.scales.items():
            out[layer] = max(out.get(layer, 0.0), v)
        return out

    def per_dtype(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, v in self.scales.items():
            t = self.dtypes.get(key, "?")
            out[t] = max(out.get(t, 0.0), v)
        return out

    def describe(self) -> str:
        layers = ", ".join(f"L{layer} {v:.2g}" for layer, v in sorted(self.per_layer().items()))
        dtypes = ", ".join(f"{t} {v:.2g}" for t, v in sorted(self.per_dtype().items()))
        return (f"{self.model}: measured |Δ| per layer {layers} ({dtypes}; controls: {', '.join(self.controls)}); "
                f"bound {self.factor:g} ×")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "factor": self.factor, "controls": list(self.controls),
                "per_layer": {str(k): v for k, v in sorted(self.per_layer().items())},
                "per_dtype": self.per_dtype(),
                "arrays": [{"layer": layer, "array": name, "dtype": self.dtypes.get((layer, name)), "scale": v}
                           for (layer, name), v in sorted(self.scales.items())]}


def _arrays(c: Any) -> tuple[str | None, list[tuple[str, Any]]]:
    """A layer's metadata and named live arrays; a quantized KV layer's keys/values dequantized
    (its packed integers say nothing about how far two values are apart)."""
    meta, arrays = layer_arrays(c)
    if isinstance(getattr(c, "keys", None), tuple | list) and hasattr(c, "bits"):
        deq = []
        for name in ("keys", "values"):
            parts = [a for n, a in arrays if n.startswith(f"{name}[")]
            if len(parts) == 3:
                deq.append((f"{name}[0]", mx.dequantize(parts[0], parts[1], parts[2], group_size=int(c.group_size),
                                                        bits=int(c.bits))))
        if len(deq) == 2:
            return f"{meta}quantized:{int(c.bits)}/{int(c.group_size)}\n", deq
    return meta, arrays


def _steps(c: Any) -> dict[str, np.ndarray]:
    """A quantized KV layer's quantization step per element (its group's scale), by array name:
    one rounding flipped by an arithmetic difference moves a dequantized value by one step."""
    if not (isinstance(getattr(c, "keys", None), tuple | list) and hasattr(c, "bits")):
        return {}
    _, arrays = layer_arrays(c)
    out = {}
    for name in ("keys", "values"):
        parts = [a for n, a in arrays if n.startswith(f"{name}[")]
        if len(parts) == 3:
            out[f"{name}[0]"] = np.repeat(np.abs(as_numpy(parts[1]).astype(np.float64)), int(c.group_size), axis=-1)
    return out


def _measure(tol: Tolerance, ref: list[Any], other: list[Any]) -> bool:
    """Add every same-shaped array's largest |Δ| of ``other`` vs ``ref`` to ``tol``; False: none compared."""
    compared = False
    for layer, (a, b) in enumerate(zip(ref, other, strict=True)):
        ma, xa = _arrays(a)
        mb, xb = _arrays(b)
        if ma != mb or len(xa) != len(xb):
            continue  # e.g. a layer converted to quantized KV on one path only
        for (nm, x), (_, y) in zip(xa, xb, strict=True):
            if x is None or y is None or x.shape != y.shape:
                continue
            d = np.abs(as_numpy(x).astype(np.float64) - as_numpy(y).astype(np.float64))
            tol.add(layer, nm, str(x.dtype).removeprefix("mlx.core."), float(d.max()) if d.size else 0.0)
            compared = True
    return compared


def calibrate(model: Any, drained: Sequence[int], split: int, step: int, gamma: int = 3, *,
              name: str = "target", factor: float = ARITHMETIC_FACTOR,
              kv: Any = None) -> tuple[Tolerance, list[Any] | None]:
    """The tolerance of ``model`` on this request (module docstring), and the cold prefix reference.

    ``drained``: the tokens a cold run prefills; ``split``: how many of them the warm
    run's start caches held (0: none); ``step``: the prefill chunk size; ``kv``: the
    run's KV quantization (``engine.caches.KVQuantization``): the split path runs with
    it (values compared dequantized); the other paths run on the positions before
    ``kv.start`` only, unquantized (past the conversion a smaller forward attends over
    quantized K/V: another computation, not arithmetic). Returns the :class:`Tolerance`
    and fresh caches holding ``drained[:split]`` prefilled in ``step`` chunks (the cold
    prefill of the reused prefix; None when ``split`` is 0).
    """
    tol = Tolerance(name, factor)
    tokens = list(drained)
    if not tokens:
        return tol, None
    ref = _fill(model, tokens, _chunked(len(tokens), step), kv)
    if 0 < split < len(tokens) and _measure(tol, ref, _fill(model, tokens, _chunked(len(tokens), step, split), kv)):
        tol.controls.append(f"split at {split}")
    base = tokens if kv is None else tokens[: int(kv.start)]
    if len(base) > 1:
        ref_base = ref if kv is None else _fill(model, base, _chunked(len(base), step))
        paths = [("one token at a time", [1] * len(base))]
        for w in dict.fromkeys((2, gamma + 1)):
            if 1 < w < len(base):
                paths.append((f"chunks of {w}", [w] * (len(base) // w) + ([len(base) % w] if len(base) % w else [])))
        for label, sizes in paths:
            if _measure(tol, ref_base, _fill(model, base, sizes)):
                tol.controls.append(label + ("" if kv is None else f" (first {len(base)}, unquantized)"))
    start = None
    if split > 0:
        start = _fill(model, tokens[:split], _chunked(split, step), kv)
    return tol, start


# --------------------------------------------------------------------------- cache checks

@dataclass
class CacheCheck:
    """Warm vs cold caches of one model at one point."""

    point: str  # "start" | "prefill" | "end"
    model: str  # "target" | "drafter"
    equal: bool = True  # byte-equal
    error: str | None = None  # the first layer/array beyond the bound (or a structural mismatch)
    max_abs: float = 0.0
    worst: str = ""  # the layer/array closest to its bound, "layer L name: |Δ| x <= bound b"
    ratio: float = 0.0  # that layer/array's |Δ| / bound

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {"point": self.point, "model": self.model, "equal": self.equal, "ok": self.ok,
                "error": self.error, "max_abs": self.max_abs, "worst": self.worst, "ratio": self.ratio}


def _position(c: Any, name: str, shape: tuple[int, ...], where: tuple[int, ...]) -> str:
    if name.startswith(("keys", "values")) and len(shape) >= 2:
        off = int(getattr(c, "offset", shape[-2]))
        return f"position {off - shape[-2] + where[-2]}"
    return f"index {list(where)}"


def check_caches(warm: Sequence[Any] | None, cold: Sequence[Any] | None, tol: Tolerance, point: str,
                 labels: tuple[str, str] = ("warm", "cold")) -> CacheCheck:
    """``warm`` vs ``cold`` per layer and array within ``tol`` (module docstring); ``labels``: how
    the two are named in a message (the batched checks: ``("batched", "serial")``)."""
    wa, co = labels
    out = CacheCheck(point, tol.model)
    if warm is None or cold is None:
        if (warm is None) != (cold is None):
            out.equal = False
            out.error = (f"{point}: {tol.model} caches: {wa} {'none' if warm is None else 'captured'}, {co} "
                         f"{'none' if cold is None else 'captured'}")
        return out
    if len(warm) != len(cold):
        out.equal = False
        out.error = f"{point}: {tol.model} caches: {wa} has {len(warm)} layers, {co} {len(cold)}"
        return out
    closest = -1.0
    for layer, (a, b) in enumerate(zip(warm, cold, strict=True)):
        ma, xa = _arrays(a)
        mb, xb = _arrays(b)
        sa, sb = _steps(a), _steps(b)
        if ma != mb:
            out.equal = False
            out.error = (f"{point}: {tol.model} layer {layer} ({type(a).__name__}): metadata differs: "
                         f"{meta_diff(ma, mb)} ({wa} first)")
            return out
        if len(xa) != len(xb):
            out.equal = False
            out.error = f"{point}: {tol.model} layer {layer}: {wa} {len(xa)} arrays, {co} {len(xb)}"
            return out
        for (nm, x), (_, y) in zip(xa, xb, strict=True):
            if x is None and y is None:
                continue
            if x is None or y is None or tuple(x.shape) != tuple(y.shape) or x.dtype != y.dtype:
                out.equal = False
                out.error = (f"{point}: {tol.model} layer {layer} {nm}: {wa} "
                             f"{None if x is None else (list(x.shape), str(x.dtype))} vs {co} "
                             f"{None if y is None else (list(y.shape), str(y.dtype))}")
                return out
            xn, yn = as_numpy(x), as_numpy(y)
            if xn.tobytes() == yn.tobytes():
                continue
            out.equal = False
            d = np.abs(xn.astype(np.float64) - yn.astype(np.float64))
            if not d.size or not np.any(d):
                continue
            bound = tol.bound(layer, nm)
            step = np.maximum(sa[nm], sb[nm]) if nm in sa and nm in sb and sa[nm].shape == d.shape else None
            allowed = bound if step is None else bound + step  # quantized: plus one quantization step
            over = np.where(np.isnan(d), np.inf, d - allowed)
            where = tuple(int(i) for i in np.unravel_index(int(np.argmax(over)), d.shape))
            delta, lim = float(d[where]), float(np.broadcast_to(allowed, d.shape)[where])
            out.max_abs = max(out.max_abs, float(np.nanmax(d)))
            if over[where] > 0:
                plus = "" if step is None else f" + its quantization step {float(step[where]):.3g}"
                out.error = (f"{point}: {tol.model} layer {layer} {nm} {_position(a, nm, tuple(x.shape), where)}: "
                             f"{wa} {float(xn[where]):.7g} != {co} {float(yn[where]):.7g}, |Δ| {delta:.3g} beyond "
                             f"the bound {lim:.3g} ({tol.factor:g} × the measured |Δ| "
                             f"{tol.scales.get((layer, nm), 0.0):.3g} between correct prefill paths{plus})")
                return out
            ratio = d / np.maximum(allowed, np.finfo(np.float64).tiny)
            at = tuple(int(i) for i in np.unravel_index(int(np.argmax(ratio)), d.shape))
            if float(ratio[at]) > closest:
                closest = out.ratio = float(ratio[at])
                lim_at = float(np.broadcast_to(allowed, d.shape)[at])
                out.worst = f"layer {layer} {nm}: |Δ| {float(d[at]):.3g} <= bound {lim_at:.3g}"
    return out


# --------------------------------------------------------------------------- flips

def as_trace(mode: str, prompt: Sequence[int], params: Any, records: Sequence[dict[str, Any]],
             source: str | None = None) -> Trace:
    """An in-memory trace of one run's records (the header fields the witness reads: the sampling
    pipeline's keys through ``engine.params.header_params``, the prefill and quantized KV)."""
    from engine.params import header_params

    core, extra = header_params(params.sampler, params.seed)
    p: dict[str, Any] = {**core, **extra, "prefill": getattr(params, "prefill", None),
                         "prefill_step_size": getattr(params, "prefill_step_size", None)}
    if params.kv is not None:
        p.update(kv_bits=params.kv.bits, kv_group_size=params.kv.group_size, quantized_kv_start=params.kv.start)
    if getattr(params, "grammar", None) is not None:
        p["grammar"] = True  # the compiled grammar itself reaches the witness through the pipeline
    header = {"type": "header", "mode": mode, "source": source, "case_id": mode,
              "prompt": {"token_ids": list(prompt)}, "params": p, "runner": {"name": "session"}}
    return Trace.from_records([header, *records])


def _judgeable(t: Trace, pipeline: Any = None) -> str | None:
    """Why the witness cannot replay run ``t`` (None: it can)."""
    params = t.header.get("params") or {}
    if params.get("temperature") and params.get("rng") != "position":
        return "a run sampled from one RNG stream (the witness replays greedy and position-keyed draws)"
    if params.get("grammar") and pipeline is None:
        return "a grammar-constrained run without its pipeline (its mask is not replayed)"
    return None


def judge_flip(target: Any, drafter: Any, warm: Trace, cold: Trace, flip: Flip,
               start_target: list[Any] | None, start_drafter: list[Any] | None,
               pipeline: Any = None) -> WitnessVerdict | None:
    """Replay the warm run (from its start caches) and the cold run (fresh) to the contested token.

    A ``traces.diff`` witness with ``a`` = warm, ``b`` = cold: ``numerics`` when each path
    reproduces its own token; ``logic`` otherwise; None when the runs cannot be replayed
    (``_judgeable``, a drafter lane of a source without a drafter model). ``pipeline``: the
    runs' sampling pipeline factory (``engine.witness.PipelineFactory``; default: rebuilt from
    the in-memory header, no grammar). Raises ``WitnessDeclined`` when a path's first record
    does not replay to its recorded margins.
    """
    from engine.witness import (
        calibration_tol,
        evaluate_draft_path,
        evaluate_path,
        header_pipeline,
        prefix_of,
    )

    if any(_judgeable(t, pipeline) for t in (warm, cold)):
        return None
    pipeline = pipeline or header_pipeline
    if flip.lane == "drafter":
        if drafter is None or any((t.header.get("params") or {}).get(k) for t in (warm, cold)
                                  for k in ("temperature", "logits_processors", "grammar")):
            return None
        pa = evaluate_draft_path(drafter, warm, flip.a, "warm", start_caches=start_drafter)
        pb = evaluate_draft_path(drafter, cold, flip.b, "cold")
        what = "drafter path"
    else:
        pa = evaluate_path(target, warm, flip.a, "warm", pipeline, start_caches=start_target)
        pb = evaluate_path(target, cold, flip.b, "cold", pipeline)
        what = "path"
        for p in (pa, pb):
            if p.calibration is not None and p.calibration > calibration_tol():
                raise WitnessDeclined(f"the {p.label.split()[0]} run's first record does not replay here "
                                      f"(margins differ by {p.calibration:.3g} of the top logit)")
        if prefix_of(warm, flip.a) != prefix_of(cold, flip.b):
            return WitnessVerdict("logic", "the two runs' prefixes differ before the contested token",
                                  (pa.format(), pb.format()))
    xa, xb = flip.a.token, flip.b.token
    max_row = max_row_delta(pa.row, pb.row)
    da = float(cast(float, pa.row[xa].item())) - float(cast(float, pa.row[xb].item()))
    db = float(cast(float, pb.row[xa].item())) - float(cast(float, pb.row[xb].item()))
    evidence = (pa.format(), pb.format(),
                f"Δ = logit[{xa}] - logit[{xb}]: warm {da:+.4g}, cold {db:+.4g}; max |row warm - row cold| "
                f"{max_row:.3g}", *pa.notes, *pb.notes)
    data = {"lane": flip.lane, "paths": [pa.to_dict(), pb.to_dict()], "max_abs_row_delta": max_row,
            "delta": {"tokens": [xa, xb], "warm": da, "cold": db}}
    if pa.reproduced and pb.reproduced:
        return WitnessVerdict("numerics", f"the warm {what} (from its reused caches) gives {xa} and the cold "
                                          f"{what} gives {xb}: arithmetic alone (rows differ by up to "
                                          f"{max_row:.3g})", evidence, data)
    bad = [f"the {p.label.split()[0]} run took {p.ran} but its {what} gives {p.token}"
           for p in (pa, pb) if not p.reproduced]
    return WitnessVerdict("logic", "; ".join(bad) + ": the arithmetic does not explain it", evidence, data)


# --------------------------------------------------------------------------- the request

@dataclass
class Judgement:
    """One warm request vs its cold run where the backend is not bit-exact."""

    verdict: str  # "identical" | "numerics" | "logic"
    message: str | None = None  # logic: the first divergence; numerics: what differs and why it is arithmetic
    # numerics: "tolerance" (records equal, caches within the bound), "witness" (every flip replayed:
    # each path gives its own token) or "not replayed" (a flip the witness cannot replay -- sampled,
    # quantized KV, grammar, a tapped source's draft -- after start and prefill caches within the bound)
    basis: str | None = None
    evidence: list[str] = field(default_factory=list)
    checks: list[CacheCheck] = field(default_factory=list)
    tolerances: list[Tolerance] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "message": self.message, "basis": self.basis,
                "evidence": list(self.evidence), "checks": [c.to_dict() for c in self.checks],
                "tolerances": [t.to_dict() for t in self.tolerances]}


def _same(a: Sequence[Any] | None, b: Sequence[Any] | None) -> bool:
    """Byte-equal live states (both None counts as equal)."""
    if a is None or b is None:
        return a is None and b is None
    from traces.digest import cache_digest

    return len(a) == len(b) and cache_digest(a) == cache_digest(b)


def _not_replayed(v: Any, warm: Trace, cold: Trace) -> str:
    """Why the flip of divergence ``v`` was not judged by a replay."""
    why = _judgeable(warm, True) or _judgeable(cold, True)
    if why:
        return why
    for mark in ("witness declined: ", "witness failed "):
        if mark in v.message:
            return mark.strip() + " " + v.message.split(mark, 1)[1].split("; ")[0]
    if v.flip is not None and v.flip.lane == "drafter":
        return f"the drafter of a {warm.header.get('source')} source is not replayed"
    return "the witness could not judge it"


def _within(checks: Sequence[CacheCheck]) -> str:
    """``caches differ within the calibrated bound at start/prefill/end ...: closest ...``."""
    diff = [c for c in checks if not c.equal]
    if not diff:
        return "caches byte-equal"
    where = ", ".join(dict.fromkeys(f"{c.point} {c.model}" for c in diff))
    top = max(diff, key=lambda c: c.ratio)
    return (f"caches differ within the calibrated bound ({where}); closest: {top.point} {top.model} {top.worst} "
            f"({top.ratio:.2g} of it)")


def _strip(t: Trace, prefill_like: dict[str, Any] | None) -> Trace:
    """``t`` without its arithmetic fields (and the prefill's token lists of ``prefill_like``)."""
    recs = []
    for r in t.records():
        r = {k: v for k, v in r.items() if k not in ARITHMETIC_FIELDS}
        if r["type"] == "prefill" and prefill_like is not None:
            for k in ("target_tokens", "drafter_tokens", "prompt_cache"):
                r[k] = prefill_like.get(k)
        recs.append(r)
    return Trace.from_records(recs)


def judge_request(target: Any, drafter: Any, warm: Trace, cold: Trace, warm_snaps: Any, cold_snaps: Any,
                  structural: str | None, *, step: int, gamma: int = 3, drafter_kind: str | None = None,
                  factor: float = ARITHMETIC_FACTOR, kv: Any = None, drafter_kv: Any = None,
                  pipeline: Any = None) -> Judgement:
    """Classify one warm request against its cold run (module docstring).

    ``warm_snaps``/``cold_snaps``: ``engine.prompt_cache.CacheSnapshots``; ``structural``:
    the first difference of the records outside ``ARITHMETIC_FIELDS`` (None: none);
    ``step``: the prefill chunk size both runs used; ``drafter``: the two-model drafter
    model whose caches are a segment (None otherwise); ``kv``/``drafter_kv``: their KV
    quantization (``GenerationParams.kv``; None: full precision).
    """
    from traces.diff import diff_traces

    if structural is None and warm_snaps.start_target is None and warm_snaps.start_drafter is None and all(
            _same(getattr(warm_snaps, k), getattr(cold_snaps, k))
            for k in ("prefill_target", "prefill_drafter", "end_target", "end_drafter")):
        return Judgement("identical")  # nothing reused, the same computation: byte-equal, no tolerance needed
    drained = list(warm_snaps.drained)
    tols = [calibrate(target, drained, warm_snaps.target_prefix, step, gamma, name="target", factor=factor, kv=kv)]
    if drafter is not None and (warm_snaps.prefill_drafter is not None or cold_snaps.prefill_drafter is not None):
        tols.append(calibrate(drafter, drained, warm_snaps.drafter_prefix or 0, step, gamma, name="drafter",
                              factor=factor, kv=drafter_kv))
    out = Judgement("identical", tolerances=[t for t, _ in tols])
    (tt, t_start), *rest = tols
    checks = []
    if warm_snaps.start_target is not None:
        checks.append(check_caches(warm_snaps.start_target, t_start, tt, "start"))
    checks.append(check_caches(warm_snaps.prefill_target, cold_snaps.prefill_target, tt, "prefill"))
    if rest:
        td, d_start = rest[0]
        if warm_snaps.start_drafter is not None:
            checks.append(check_caches(warm_snaps.start_drafter, d_start, td, "start"))
        checks.append(check_caches(warm_snaps.prefill_drafter, cold_snaps.prefill_drafter, td, "prefill"))
    out.checks = checks
    start_ok = all(c.ok for c in checks)
    if not start_ok:
        bad = next(c for c in checks if not c.ok)
        where = "the caches it started from" if bad.point == "start" else "after the prefill"
        out.verdict, out.message = "logic", f"{bad.error} ({where}; warm vs cold prefill of the same tokens)"
        return out
    figures = "; ".join(t.describe() for t in out.tolerances)
    if structural is None:
        ends = [check_caches(warm_snaps.end_target, cold_snaps.end_target, tt, "end")]
        if rest:
            ends.append(check_caches(warm_snaps.end_drafter, cold_snaps.end_drafter, rest[0][0], "end"))
        out.checks += ends
        bad_end = next((c for c in ends if not c.ok), None)
        if bad_end is not None:
            out.verdict, out.message = "logic", f"{bad_end.error} (the records agree)"
            return out
        if all(c.equal for c in out.checks):
            return out
        out.verdict, out.basis = "numerics", "tolerance"
        out.message = f"records equal; {_within(out.checks)}"
        out.evidence = [figures]
        return out

    def witness(a: Trace, b: Trace, flip: Flip) -> WitnessVerdict | None:
        return judge_flip(target, drafter if drafter_kind in (None, "two-model") else None, warm, cold, flip,
                          warm_snaps.start_target, warm_snaps.start_drafter, pipeline)

    sw, sc = _strip(warm, cold.prefill), _strip(cold, cold.prefill)
    d = diff_traces(sw, sc, level="round", witness=witness)
    if d is None or d.flip is None:
        out.verdict = "logic"
        out.message = structural + ("" if d is None else f" ({d.field} at {d.where}: no differing sample explains it)")
        return out
    verdicts = [d]
    if d.flip.lane == "drafter" and not (d.basis == "witness" and d.klass == "logic"):
        # the drafts differ (arithmetic, or not replayed): the tokens must still agree
        d2 = diff_traces(sw, sc, level="tokens", witness=witness)
        if d2 is not None:
            verdicts.append(d2)
    for v in verdicts:
        if v.basis == "witness" and v.klass == "logic":
            assert v.witness is not None
            out.verdict, out.message = "logic", f"{structural}: {v.witness.reason}"
            out.evidence = list(v.witness.evidence)
            return out
        if v.flip is None:  # a structural difference after a numerics draft flip (usage, a stop)
            out.verdict, out.message = "logic", f"{structural}; then {v.field} at {v.where}: no flip explains it"
            return out
    out.verdict = "numerics"
    bases, evidence = [], []
    for v in verdicts:
        if v.basis == "witness":
            assert v.witness is not None
            bases.append("witness")
            evidence += [v.witness.reason, *v.witness.evidence]
        else:
            bases.append("not replayed")
            evidence.append(f"flip at {v.where} ({v.field}) not replayed: {_not_replayed(v, warm, cold)}")
    out.basis = "witness" if all(b == "witness" for b in bases) else "not replayed"
    last = verdicts[-1]
    out.message = f"{structural}: " + (last.witness.reason if last.witness is not None
                                        else f"not replayed ({_not_replayed(last, warm, cold)})") + \
        f"; {_within(out.checks)}"
    out.evidence = [*evidence, figures]
    return out
