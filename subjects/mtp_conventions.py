"""Which native-MTP conventions an engine uses, measured from its own head calls (issue 28).

An engine that ships a native MTP path is run unmodified on a zoo native-MTP
checkpoint (``zoo/native_mtp.py``) while a wrapper on the loaded model
INSTANCE records every call of its MTP head: the target hidden it fed, the
token ids, the head-cache offset before the call and the draft logits it got
back (:class:`HeadCall`). The recorded calls are then compared, input for
input, with our ``native-mtp`` source's head driven under each named
convention (``specparity/grading/native_mtp_conventions.py``, which owns that comparison: the
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
    """One MTP head call as the engine made it: ``T`` rows (one per token fed)."""

    hidden: np.ndarray  # (T, H) the target hiddens fed to the head
    tokens: list[int]  # the T token ids embedded with them
    offset: int  # head-cache offset before the call (rows already in the head's cache)
    logits: np.ndarray | None  # (V,) float32 draft logits of the last row; None: a cache-update call
    emitted_before: int  # output tokens the engine had produced when it made the call
    position_offset: int | None = None  # an explicit RoPE position the engine passed, if any


def head_call(hidden: Any, token_ids: Any, cache: Any, logits: Any, emitted: int,
              position_offset: int | None = None) -> HeadCall:
    """A :class:`HeadCall` from the arrays of one call (``cache``: the head cache list or one cache)."""
    import mlx.core as mx

    first = cache[0] if isinstance(cache, (list, tuple)) and cache else cache
    offset = int(getattr(first, "offset", 0) or 0) if first is not None else 0
    h = np.array(hidden.astype(mx.float32)).reshape(-1, hidden.shape[-1])
    lg = None if logits is None else np.array(logits.reshape(-1, logits.shape[-1])[-1].astype(mx.float32))
    return HeadCall(hidden=h, tokens=[int(t) for t in np.array(token_ids).reshape(-1).tolist()], offset=offset,
                    logits=lg, emitted_before=emitted, position_offset=position_offset)


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
                call = head_call(hidden, next_ids, mtp_cache, None, len(stream))
                logits = type(model).mtp_forward(model, hidden, next_ids, mtp_cache)
                call.logits = np.array(logits[0, -1].astype(mx.float32))
                cap.calls.append(call)
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
    """The conventions one measured row (``specparity.grading.native_mtp_conventions.measure``) establishes, each
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
        out["concat"] = f"{cc} (first draft, max abs logit diff {first['diffs'][fm[0]]:.1e})"
        out["mask_pos0"] = f"{mk} at head-cache position 0 (in the first draft's context)"
    elif len(fm) == 2 and fm[0].split(",")[0] == fm[1].split(",")[0]:
        cc = fm[0].split(",")[0].split("=")[1]
        out["concat"] = f"{cc} (first draft, max abs logit diff {first['diffs'][fm[0]]:.1e})"
        out["mask_pos0"] = "unmeasured: masked and unmasked row 0 give the same draft logits"
    else:
        out["concat"] = out["mask_pos0"] = f"unmeasured: first call matched {fm or 'no candidate'}"
    rep = row.get("replay", {})
    fits = [k for k, v in rep.items() if v.get("calls") and v.get("calls_within") == v.get("calls")]
    fresh = row.get("fresh_head_cache_calls")
    cache_note = "" if fresh is None else f"; head cache empty before {fresh} of {row.get('calls')} calls"
    calls = row.get("calls")
    if len(fits) == 1:
        n = rep[fits[0]]["calls"]
        out["rows/position"] = f"{fits[0]} ({n}/{n} calls{cache_note})"
    elif fits and fresh == calls and row.get("rows") == calls:
        n = rep[fits[0]]["calls"]
        out["rows/position"] = (f"no head history: one row per draft on an empty head cache ({n}/{n} calls; "
                                "positions invisible)")
    else:
        out["rows/position"] = f"unmeasured: replays within tolerance {fits or 'none'}"
    d = row.get("depth_layers")
    out["depth"] = ("unmeasured: the checkpoint has 1 MTP layer (reuse and chain coincide)" if d == 1
                    else f"{d} layers: not measured")
    ident = row.get("identity")
    if ident:
        out["identity"] = (f"{ident['status']}: {ident['tokens']} greedy tokens vs plain decode"
                           + ("" if ident["first_divergence"] is None else
                              f", first divergence at token {ident['first_divergence']}"))
    return out


# ------------------------------------------------------------------ capture: mtplx


def capture_mtplx(prompt_id: str = "nat-00", max_tokens: int = 24, target: str = "qwen35-native") -> Capture:
    """Run mtplx 2.12.2's ``generate_mtp1`` greedily on a zoo native-MTP checkpoint and record its head
    calls: ``_mtp_core`` of its Qwen text model (``mtp_patch.inject_mtp_support``: both
    ``mtp_forward`` and ``mtp_update_cache`` run it) or ``mtp_forward`` of its GLM model
    (``glm_mtp_patch.inject_glm_mtp_support``; its ``mtp_update_cache`` calls it), wrapped on the
    loaded model instance."""
    import zoo
    from subjects import mtplx as mtplx_adapter
    from zoo.native_mtp import target_paths

    gen = mtplx_adapter._import_generation()
    from mtplx.runtime import load
    from mtplx.sampling import SamplerConfig

    ckpt = str(target_paths(target)[1])
    ids = list(zoo.prompt(prompt_id).token_ids)
    cap = Capture(engine="mtplx", checkpoint=target, prompt_ids=ids, stream=[])
    try:
        rt = load(ckpt, mtp=True)
    except Exception as exc:  # noqa: BLE001 - the engine's refusal is the evidence
        msg = " ".join(str(exc).split())
        cap.notes.append(f"mtplx.runtime.load(mtp=True) raised {type(exc).__name__}: "
                         + (msg if len(msg) <= 200 else msg[:200] + "…"))
        return cap
    if not rt.mtp_enabled:
        cap.notes.append("mtplx.runtime.load(mtp=True) returned a runtime without MTP")
        return cap
    model = rt.model
    text = getattr(model, "language_model", model)
    if hasattr(type(text), "_mtp_core"):
        core = type(text)._mtp_core

        def mtp_core(hidden_states: Any, next_token_ids: Any, mtp_cache: Any = None, concat_order: Any = None,
                     mtp_hidden_variant: str = "post_norm", position_offset: int | None = None,
                     emit_logits: bool = True, input_embeddings: Any = None) -> Any:
            call = head_call(hidden_states, next_token_ids, mtp_cache, None, -1, position_offset)
            logits, hidden = core(text, hidden_states, next_token_ids, mtp_cache=mtp_cache,
                                  concat_order=concat_order, mtp_hidden_variant=mtp_hidden_variant,
                                  position_offset=position_offset, emit_logits=emit_logits,
                                  input_embeddings=input_embeddings)
            if logits is not None:
                call.logits = head_call(hidden_states, next_token_ids, None, logits, -1).logits
            cap.calls.append(call)
            return logits, hidden

        text._mtp_core = mtp_core
        cap.notes.append("hook: instance wrapper of _MTPLXTextModel._mtp_core")
    else:
        forward = type(model).mtp_forward

        def mtp_forward(hidden_states: Any, next_token_ids: Any, *a: Any, **kw: Any) -> Any:
            depth = kw.get("mtp_depth")
            mc = kw.get("mtp_cache")
            layer = (0 if depth is None else max(int(depth) - 1, 0)) if isinstance(mc, list) else 0
            one = mc[layer % len(mc)] if isinstance(mc, list) and mc else mc
            call = head_call(hidden_states, next_token_ids, one, None, -1, kw.get("position_offset"))
            out = forward(model, hidden_states, next_token_ids, *a, **kw)
            logits = out[0] if isinstance(out, tuple) else out
            call.logits = head_call(hidden_states, next_token_ids, None, logits, -1).logits
            cap.calls.append(call)
            return out

        model.mtp_forward = mtp_forward
        cap.notes.append(f"hook: instance wrapper of {type(model).__name__}.mtp_forward")
    out = gen.generate_mtp1(rt, ids, max_tokens=max_tokens, sampler=SamplerConfig(temperature=0.0, top_p=1.0,
                                                                                   top_k=0),
                            seed=0, stop_token_ids=set())
    cap.stream = [int(t) for t in out.tokens]
    if not cap.calls:
        cap.notes.append("no MTP head call was captured")
    return cap


# ------------------------------------------------------------------ vllm-mlx: can its MTP loop run?


class _LogLines:
    """Collects the messages of the named loggers while active (their own log lines are the evidence)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        import logging

        self.names, self.lines = names, []
        outer = self

        class _H(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                outer.lines.append(record.getMessage())

        self.handler = _H(logging.DEBUG)

    def __enter__(self) -> _LogLines:
        import logging

        self.saved = []
        for n in self.names:
            log = logging.getLogger(n)
            self.saved.append((log, log.level))
            log.addHandler(self.handler)
            log.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: Any) -> None:
        for log, level in self.saved:
            log.removeHandler(self.handler)
            log.setLevel(level)


def vllm_mlx_support(target: str) -> tuple[bool, str]:
    """Whether vllm-mlx's MTP decode loop can run on the zoo checkpoint ``target`` here, with its own
    log lines as the evidence: ``vllm_mlx.utils.tokenizer.load_model_with_fallback`` (which calls
    ``_try_inject_mtp``: ``patches/qwen3_5_mtp.py`` / ``qwen3_next_mtp.py`` ``inject_mtp_support``)
    and ``vllm_mlx.scheduler._install_mtp`` on an mlx-lm ``BatchGenerator`` (what its scheduler does)."""
    from mlx_lm.generate import BatchGenerator

    from zoo.native_mtp import target_paths

    ckpt = str(target_paths(target)[1])
    why: list[str] = []
    with _LogLines(("vllm_mlx", "vllm_mlx.utils.tokenizer", "vllm_mlx.patches.qwen3_5_mtp",
                    "vllm_mlx.patches.qwen3_next_mtp", "vllm_mlx.scheduler")) as logs:
        try:
            from vllm_mlx.utils.tokenizer import load_model_with_fallback

            model, _ = load_model_with_fallback(ckpt)
        except Exception as exc:  # noqa: BLE001 - the engine's refusal is the evidence
            msg = " ".join(str(exc).split())
            return False, (f"vllm_mlx.utils.tokenizer.load_model_with_fallback raised {type(exc).__name__}: "
                           + (msg if len(msg) <= 200 else msg[:200] + "…"))
        inner = getattr(model, "language_model", model)
        head = getattr(inner, "mtp", None) is not None or getattr(model, "mtp", None) is not None
        if not head and "qwen3_5" in str(model.__class__.__module__):
            # the loader's own injection was not reached on this path: ask it directly
            import json
            from pathlib import Path

            from vllm_mlx.patches.qwen3_5_mtp import inject_mtp_support

            cfg = json.loads((Path(ckpt) / "config.json").read_text())
            head = bool(inject_mtp_support(model, ckpt, cfg))
        if not head:
            said = list(dict.fromkeys(x for x in logs.lines if "[MTP" in x))
            why.append("no MTP head attached (log: " + (" | ".join(said) or "nothing") + ")")
        from vllm_mlx.scheduler import _install_mtp

        bg = BatchGenerator(model)
        before = getattr(bg, "_step", None)
        _install_mtp(bg, model)
        installed = getattr(bg, "_step", None) is not before and before is not None
        if not installed:
            said = [x for x in logs.lines if "[MTP] disabled" in x]
            why.append("scheduler._install_mtp installed nothing: "
                       + (said[-1] if said else "BatchGenerator has no _step hook"))
        bg.close()
    if why:
        return False, "; ".join(why)
    return True, "vllm-mlx loads the checkpoint with an MTP head and installs its MTP step"
