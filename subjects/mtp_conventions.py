"""Which native-MTP conventions an engine uses, measured from its own head calls (issue 28).

An engine that ships a native MTP path is run unmodified on a zoo native-MTP
checkpoint (``zoo/native_mtp.py``) while a wrapper on the loaded model
INSTANCE records every call of its MTP head: the target hidden it fed, the
token ids, the head-cache offset before the call and the draft logits it got
back (:class:`HeadCall`). The recorded calls are then compared, input for
input, with our ``native-mtp`` source's head driven under each named
convention (``specparity/mtp_conventions.py``, which owns that comparison: the
subjects layer never imports the engine); this module holds the capture and
the verdict logic, both model-free testable:

- ``hidden``: the hidden the engine fed equals the target's pre-norm (last
  decoder layer) or post-norm (after the final norm) hidden at which position
  (:func:`match_hidden`);
- ``concat`` / ``mask_pos0``: the first call (empty head cache, one row) gives the
  same logits as our head under ``e;h`` or ``h;e``, with or without the
  position-0 embedding mask (:func:`best_preset`);
- ``rows`` / ``position``: later calls are replayed on a fresh head cache with
  only the rows the engine built, at consecutive positions (the head-cache
  offset) or at their sequence positions; and against our source's dense rows
  (one row per sequence position, mlx-vlm's bookkeeping);
- ``depth``: measurable only with more than one MTP layer in the checkpoint.

Reference for flyto-mlx: ``omlx/patches/mlx_lm_mtp/batch_generator.py``
(``_post_init_mtp``, ``_run_verify_cycle``, ``_step_mtp`` call
``model.mtp_forward(hidden, next_ids, mtp_cache)``) and ``qwen35_model.py``
(``MTPModule.__call__``: ``fc(cat(pre_fc_norm_embedding(E), pre_fc_norm_hidden(h)))``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# tolerance for "the same array": float32 arithmetic of two implementations of one formula
SAME = 1e-4


@dataclass
class HeadCall:
    """One MTP head call as the engine made it."""

    hidden: np.ndarray  # (H,) the target hidden fed to the head
    token: int  # the token id embedded with it
    offset: int  # head-cache offset before the call (rows already in the head's cache)
    logits: np.ndarray  # (V,) float32 draft logits returned
    emitted_before: int  # output tokens the engine had produced when it made the call


@dataclass
class Capture:
    engine: str
    checkpoint: str
    prompt_ids: list[int]
    stream: list[int]
    calls: list[HeadCall] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def match_hidden(fed: np.ndarray, pre: np.ndarray, post: np.ndarray) -> tuple[str, int, float]:
    """``(kind, position, max |diff|)`` of the target hidden row closest to ``fed``.

    ``pre``/``post``: (T, H) the target's pre-norm / post-norm hidden over the whole sequence."""
    best = ("none", -1, float("inf"))
    for kind, arr in (("pre-norm", pre), ("post-norm", post)):
        d = np.max(np.abs(np.asarray(arr, np.float32) - np.asarray(fed, np.float32)[None, :]), axis=-1)
        i = int(np.argmin(d))
        if float(d[i]) < best[2]:
            best = (kind, i, float(d[i]))
    return best


def best_preset(got: np.ndarray, candidates: dict[str, np.ndarray], tol: float = SAME) -> dict[str, Any]:
    """Each candidate's max abs logit diff against ``got``; ``match``: the candidates within ``tol``
    (several when the conventions that distinguish them do not apply to this call)."""
    diffs = {k: max_abs(got, v) for k, v in candidates.items()}
    return {"diffs": diffs, "match": sorted(k for k, d in diffs.items() if d <= tol),
            "closest": min(diffs, key=lambda k: diffs[k]) if diffs else None}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ------------------------------------------------------------------ capture: flyto-mlx


def capture_flyto(prompt_id: str = "nat-00", max_tokens: int = 24, target: str = "qwen35-native") -> Capture:
    """Run flyto-mlx's MTP path greedily on a zoo native-MTP checkpoint and record its head calls."""
    import logging

    import mlx.core as mx

    import zoo
    from subjects import flyto_mlx as fly
    from zoo.native_mtp import target_paths

    ckpt = str(target_paths(target)[1])
    ids = list(zoo.prompt(prompt_id).token_ids)
    cap = Capture(engine="flyto-mlx", checkpoint=target, prompt_ids=ids, stream=[])
    lines = fly._Lines()
    log = logging.getLogger(fly._LOGGER)
    log.addHandler(lines)
    old = log.level
    log.setLevel(logging.DEBUG)
    try:
        with fly._flyto_patched(ckpt):
            import mlx_lm
            from mlx_lm.generate import BatchGenerator
            from omlx.patches.mlx_lm_mtp import stamp_model_mtp_active

            model, _ = mlx_lm.load(ckpt)
            stamp_model_mtp_active(model, True)
            if not hasattr(model, "mtp_forward") or getattr(
                    getattr(model, "language_model", model), "mtp", None) is None:
                cap.notes.append(f"no MTP head attached to {type(model).__module__}.{type(model).__name__}")
                return cap
            stream: list[int] = []

            def record(hidden: Any, next_ids: Any, mtp_cache: Any) -> Any:
                offset = int(getattr(mtp_cache[0], "offset", 0) or 0) if mtp_cache else 0
                logits = type(model).mtp_forward(model, hidden, next_ids, mtp_cache)
                cap.calls.append(HeadCall(
                    hidden=np.array(hidden.reshape(-1).astype(mx.float32)),
                    token=int(next_ids.reshape(-1)[0].item()), offset=offset,
                    logits=np.array(logits[0, -1].astype(mx.float32)), emitted_before=len(stream)))
                return logits

            model.mtp_forward = record  # this instance only; the engine calls gen_batch.model.mtp_forward
            gen = BatchGenerator(model, stop_tokens=None)
            gen.insert([ids], max_tokens=[max_tokens])
            done = False
            while not done:
                responses = gen.next_generated()
                if not responses:
                    break
                for r in responses:
                    stream.append(int(r.token))
                    done = done or r.finish_reason is not None
            gen.close()
            cap.stream = stream
    finally:
        log.removeHandler(lines)
        log.setLevel(old)
    if not any(x.startswith("MTP path activated") for x in lines.lines):
        cap.notes.append("MTP path not activated: " + " | ".join(lines.lines[-2:]))
    return cap


def flyto_family_support(target: str) -> tuple[bool, str]:
    """Whether flyto-mlx 0.7.0 attaches an MTP head for the zoo checkpoint ``target``, with its own gate's
    answer (``omlx/utils/model_loading.py`` ``_is_mtp_compatible``) as the evidence."""
    import json
    from pathlib import Path

    from omlx.utils.model_loading import _is_mtp_compatible

    from zoo.native_mtp import target_paths

    cfg = json.loads((Path(target_paths(target)[1]) / "config.json").read_text())
    mt = cfg.get("model_type")
    ok = bool(_is_mtp_compatible(cfg, mt))
    return ok, (f"omlx.utils.model_loading._is_mtp_compatible(config, {mt!r}) = {ok} (flyto-mlx 0.7.0 "
                "patches qwen3_5*/qwen3_6* (mlx-lm PR 990) and deepseek_v4* (Blaizzy/mlx-lm PR 15) only)")


def verdict(row: dict[str, Any]) -> dict[str, str]:
    """The conventions one measured row (``specparity.mtp_conventions.measure``) establishes, each
    with the measurement behind it; ``unmeasured`` where the calls could not tell."""
    out: dict[str, str] = {}
    h = row.get("hidden", {})
    match = h.get("match") or []
    offs = h.get("token_offset_from_hidden_row") or []
    if len(match) == 1 and offs == [1]:
        out["hidden"] = (f"{match[0]} (target row q with token q+1 in every call, max abs diff "
                         f"{h.get('max_diff', 0):.1e})")
    else:
        out["hidden"] = f"unmeasured: rows matched {match or 'none'}, token offsets {offs}"
    first = row.get("first_call", {})
    fm = first.get("match") or []
    if len(fm) == 1:
        cc, mk = (kv.split("=")[1] for kv in fm[0].split(","))
        out["concat"] = f"{cc} (first call, max abs logit diff {first['diffs'][fm[0]]:.1e})"
        out["mask_pos0"] = f"{mk} (first call is head-cache row 0)" if first.get("offset") == 0 else \
            "unmeasured: the first call is not at row 0"
    else:
        out["concat"] = out["mask_pos0"] = f"unmeasured: first call matched {fm or 'no candidate'}"
    rep = row.get("replay", {})
    calls = row.get("calls", 0)
    fits = [k for k, v in rep.items() if v.get("calls_within") == calls and calls]
    out["rows/position"] = (f"{fits[0]} ({calls}/{calls} calls)" if len(fits) == 1
                            else f"unmeasured: replays within tolerance {fits or 'none'}")
    d = row.get("depth_layers")
    out["depth"] = ("unmeasured: the checkpoint has 1 MTP layer (reuse and chain coincide)" if d == 1
                    else f"{d} layers: not measured")
    ident = row.get("identity")
    if ident:
        out["identity"] = (f"{ident['status']}: {ident['tokens']} greedy tokens vs plain decode"
                           + ("" if ident["first_divergence"] is None else
                              f", first divergence at token {ident['first_divergence']}"))
    return out
