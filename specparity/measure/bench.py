"""Implementation A/B: the engine vs mlx-lm, speculative vs plain, and the forwards-only bound.

Figures, never a gate. Five arms on the same pair, prompts and γ, temperature 0:

- ``engine-spec``: ``engine.executor.spec_generate`` (two-model source,
  ``cache_digests=False``);
- ``mlx_lm-spec``: mlx-lm 0.32.2 ``mlx_lm/generate.py`` ``speculative_generate_step``
  called directly (no oracle recorder, whose proxies add overhead);
- ``engine-plain`` / ``mlx_lm-plain``: ``plain_generate`` / ``generate_step`` on
  the same target (the SAME model's non-speculative baseline, §4.4);
- ``forwards``: the forwards-only bound — the very forward calls the engine's
  speculative run made (the same prefill chunks, per round the drafter's feed
  and draft steps chained on the device by ``argmax``, the target's verify
  window and its ``argmax``, one host sync per round, the same cache trims),
  with no host logic (no sampler, margins, accept walk, records). Its
  schedule is read from the engine-spec run's own records of that (prompt, γ).

Each block is one (γ, prompt, pass) with every arm back to back, the order
rotated by one arm per block so drift lands on every arm (§4.7 AB/BA). Pass 0
is **cold**: the first sight of every shape (on CUDA, MLX builds one cuDNN
attention graph per (window, cache length), 45–65 ms each, and captures CUDA
graphs; the first arm of a block pays for the shapes it shares with the
others; ``forwards`` runs last there because it replays the engine's run).
Passes 1..R of the same (γ, prompt) follow at once and are **warm**: the same
shapes, still cached (``specparity bench`` also raises MLX's CUDA cache sizes). Generation stops at the budget
or an EOS (counted as a generated token in both, as in mlx-lm's
``stream_generate``). Per block, paired ratios of time per generated token:

- ``engine_over_mlx_lm_spec`` / ``engine_over_mlx_lm_plain`` (< 1: the engine is faster);
- ``spec_speedup_engine`` / ``spec_speedup_mlx_lm`` (plain / spec; > 1: speculation pays);
- ``efficiency_engine`` / ``efficiency_mlx_lm`` (forwards-only / spec; the loop
  efficiency, 1 = no host overhead beyond the forwards).

Each is a median with a 95 % percentile bootstrap interval
(``reports.stats.median_ratio``), warm and cold separately, per γ.
``profile`` (optional) runs one warm engine-spec generation under cProfile and
keeps the functions with the most own time: where the host time goes; and, per γ, one warm
pass over the prompts under ``engine.telemetry.profiling``: the per-phase split of a round
(draft, window, forward, sync, walk, rollback, commit, records).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_NO_SCHEDULE = "the forwards arm replays the engine-spec run's schedule, which the backend could not make"
ARMS = ("engine-spec", "mlx_lm-spec", "engine-plain", "mlx_lm-plain", "forwards")
SPEC_PREFILL_STEP = 512  # mlx-lm speculative_generate_step and the engine's default
RATIOS: dict[str, tuple[str, str]] = {  # name: (numerator arm, denominator arm), per-token times
    "engine_over_mlx_lm_spec": ("engine-spec", "mlx_lm-spec"),
    "engine_over_mlx_lm_plain": ("engine-plain", "mlx_lm-plain"),
    "spec_speedup_engine": ("engine-plain", "engine-spec"),
    "spec_speedup_mlx_lm": ("mlx_lm-plain", "mlx_lm-spec"),
    "efficiency_engine": ("forwards", "engine-spec"),
    "efficiency_mlx_lm": ("forwards", "mlx_lm-spec"),
}


def _mlx_lm_run(gen: Any, eos: set[int]) -> list[int]:
    out = []
    for step in gen:  # (token, logprobs) or (token, logprobs, from_draft)
        tok = int(step[0])
        out.append(tok)
        if tok in eos:
            break
    gen.close()
    return out


def schedule_of(records: list[dict[str, Any]]) -> list[tuple[str, list[int], int, list[int], int]]:
    """The forward calls of an engine speculative run, from its records.

    ``("round", feed, n_drafts, window, k_accept)`` per verify round and
    ``("plain", [input], 0, [input], 0)`` per plain step.
    """
    out: list[tuple[str, list[int], int, list[int], int]] = []
    for r in records:
        if r["type"] == "round":
            out.append(("round", list(r["feed"]), len(r["drafts"]), list(r["window"]), int(r["k_accept"])))
        elif r["type"] == "plain":
            out.append(("plain", list(r["input"]), 0, list(r["input"]), 0))
    return out


def forwards_only(target: Any, drafter: Any, prompt_ids: list[int],
                  schedule: list[tuple[str, list[int], int, list[int], int]], kv: Any = None) -> None:
    """Replay the forward calls of ``schedule`` (see module docstring) with no host logic.

    ``kv`` (``engine.caches.KVQuantization``): caches converted after each forward, as mlx-lm.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.caches import quantize_kv, trim

    tc, dc = make_prompt_cache(target), make_prompt_cache(drafter)
    drained = prompt_ids[:-1]
    for model, caches in ((drafter, dc), (target, tc)):
        for pos in range(0, len(drained), SPEC_PREFILL_STEP):
            model(mx.array(drained[pos : pos + SPEC_PREFILL_STEP], mx.uint32)[None], cache=caches)
            quantize_kv(caches, kv)
            mx.eval([c.state for c in caches])
    for kind, feed, n, window, k in schedule:
        if kind == "plain":
            mx.eval(mx.argmax(target(mx.array(window, mx.uint32)[None], cache=tc)[0, -1]))
            quantize_kv(tc, kv)
            continue
        y = mx.array(feed, mx.uint32)
        for _ in range(n):
            y = mx.argmax(drafter(y[None], cache=dc)[0, -1:, :], axis=-1).astype(mx.uint32)
            quantize_kv(dc, kv)
            mx.async_eval(y)
        mx.eval(mx.argmax(target(mx.array(window, mx.uint32)[None], cache=tc)[0], axis=-1))
        trim(tc, n - k, "target")
        trim(dc, max(n - k - 1, 0), "drafter")
        quantize_kv(tc, kv)


def arm_order(warm: bool, index: int) -> list[str]:
    """The arms' order in the ``index``-th warm (or cold) pass.

    Warm: all five rotated by one per warm pass. Cold: over every 4 cold passes
    each timed arm runs first once, and each of the two pairs (engine vs mlx-lm
    speculative, engine vs mlx-lm plain) runs in each order twice — whichever
    arm of a pair runs first pays the first-sight shape builds for both (on
    CUDA: cuDNN attention graphs per window and cache length), so a plain
    rotation, which puts the engine first in 3 of 4, biased the cold ratio.
    ``forwards`` goes last: it replays the engine's run.
    """
    if warm:
        k = index % len(ARMS)
        return [*ARMS[k:], *ARMS[:k]]
    es, ms, ep, mp = ARMS[:4]
    cold = ([es, ms, ep, mp], [ms, es, mp, ep], [ep, mp, es, ms], [mp, ep, ms, es])
    return [*cold[index % 4], "forwards"]


def resolve_pair(target: str | None, drafter: str | None, size: str | None, seed: int,
                 log: Callable[[str], None]) -> tuple[str, str, Path, Path]:
    """``(target name, drafter name, target dir, drafter dir)`` of the bench's pair: a ``--size``
    pair built by ``zoo/big.py``, else ``--target``/``--drafter`` (zoo names or model dirs)."""
    from specparity.measure.ab import resolve_drafter, resolve_target

    if size is not None:
        if target is not None or drafter is not None:
            raise ValueError("--size builds its own pair (zoo/big.py); drop --target/--drafter")
        from zoo import big

        tdir, ddir = big.build(size, seed, log=log)
        return f"big-{size}-s{seed}", f"layer-skip-{big.DRAFT_LAYERS}", tdir, ddir
    target, drafter = target or "llama", drafter or "twin"
    return target, drafter, resolve_target(target)[1], resolve_drafter(target, drafter)


def checkpoint_facts(model_dir: Path | str | None, model: Any) -> dict[str, Any]:
    """What a checkpoint is: logical parameters, the real dtype, quantization, on-disk size.

    A quantized layer (mlx ``nn.QuantizedLinear`` / ``QuantizedEmbedding``, as
    mlx-lm 0.32.2 ``utils.quantize_model`` makes them) stores ``bits``-wide
    weights packed into ``uint32`` (so ``weight.size`` undercounts 32/bits times)
    with float or ``uint8`` (mxfp4) scales: its parameters are counted as the
    unpacked ``out × in``, its scales/biases not at all. ``dtype`` is the float
    dtype holding most of the remaining (unquantized) weights — what a
    ``mlx_lm.convert --dtype`` chose — and ``quantization`` is the config's
    ``quantization`` (``bits``/``group_size``/``mode``; None when unquantized).
    """
    from mlx.utils import tree_flatten

    n, by_dtype = 0, dict[str, int]()
    for _, mod in model.named_modules() if model is not None else []:
        bits = getattr(mod, "bits", None)
        own = {k: v for k, v in mod.items() if hasattr(v, "dtype")} if hasattr(mod, "items") else {}
        if bits is not None and "scales" in own:
            n += int(own["weight"].size) * 32 // int(bits)  # uint32 words of `bits`-wide values
            own = {k: v for k, v in own.items() if k not in ("weight", "scales", "biases")}
        for v in own.values():
            n += int(v.size)
            d = str(v.dtype).removeprefix("mlx.core.")
            by_dtype[d] = by_dtype.get(d, 0) + int(v.size)
    if model is not None and not by_dtype:
        for _, v in tree_flatten(model.parameters()):
            d = str(v.dtype).removeprefix("mlx.core.")
            by_dtype[d] = by_dtype.get(d, 0) + int(v.size)
    out: dict[str, Any] = {"parameters": n, "dtype": max(by_dtype, key=by_dtype.__getitem__)
                           if by_dtype else "unknown", "quantization": None, "disk_bytes": None}
    if model_dir is not None:
        d = Path(model_dir)
        try:
            q = json.loads((d / "config.json").read_text()).get("quantization")
        except (OSError, ValueError):
            q = None
        if isinstance(q, dict):
            out["quantization"] = {"bits": q.get("bits"), "group_size": q.get("group_size"),
                                   "mode": q.get("mode", "affine")}
        out["disk_bytes"] = sum(f.stat().st_size for f in d.glob("*.safetensors") if f.is_file())
    return out


def describe_checkpoint(facts: dict[str, Any]) -> str:
    """``1.1 B parameters, bfloat16, q4 g64 affine, 0.62 GB on disk``."""
    parts = [f"{facts['parameters'] / 1e9:.3g} B parameters", str(facts["dtype"])]
    q = facts.get("quantization")
    if q:
        parts.append(f"q{q['bits']} g{q['group_size']} {q['mode']}")
    if facts.get("disk_bytes") is not None:
        parts.append(f"{facts['disk_bytes'] / 1e9:.3g} GB on disk")
    return ", ".join(parts)


def run_bench(
    target: str | None = None,
    drafter: str | None = None,
    *,
    gamma: int | None = 3,
    gammas: tuple[int, ...] | None = None,
    n_prompts: int = 8,
    max_tokens: int = 32,
    repeats: int = 3,
    size: str | None = None,
    seed: int = 0,
    profile: bool = False,
    progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] | None = None,
    prompts_file: Path | None = None,
    chat_template: bool = False,
    cache: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Time the five arms (module docstring); ``gammas`` overrides ``gamma``.

    ``cache``: :func:`specparity.cli.kv_args.cache_fields`; ``kv_*`` go to both engines (mlx-lm's
    ``kv_bits``/``kv_group_size``/``quantized_kv_start``), ``rotating`` to the engine only.
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step

    from engine.backend import Unsupported, emulate_from_env, run_supported
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.sources.two_model import TwoModelProvider
    from reports.stats import median_ratio
    from specparity.cli.devices import describe_device
    from specparity.measure.ab import choose_prompts, engine_cache
    from specparity.runners import load_model

    emulate_from_env()  # SPECPARITY_EMULATE_MISSING_OP: the missing-op double here too
    say = log or (lambda _m: None)
    gs = tuple(gammas) if gammas else (gamma or 3,)
    tname, dname, tpath, dpath = resolve_pair(target, drafter, size, seed, say)
    prompts = choose_prompts(n_prompts, tpath, prompts_file, max_tokens, chat_template)
    tgt, drf = load_model(str(tpath)), load_model(str(dpath))
    provider = TwoModelProvider(drf.model, draft_tokenizer=drf.tokenizer)
    provider.check_target(tgt.model, tgt.tokenizer)
    eos = set(tgt.eos_ids)
    schedules: dict[tuple[int, str], list[Any]] = {}
    outputs: dict[tuple[int, str, str], list[int]] = {}
    accept: dict[int, list[int]] = {g: [0, 0] for g in gs}

    def params(g: int) -> GenerationParams:
        return GenerationParams(max_tokens=max_tokens, gamma=g, eos_ids=tgt.eos_ids, cache_digests=False,
                                **engine_cache(cache))

    mlx_kv = {k: v for k, v in engine_cache(cache).items() if k != "rotating"}

    def arm(name: str, g: int, pid: str, ids: list[int]) -> tuple[int, float]:
        t0 = time.perf_counter()
        if name == "engine-spec":
            res = spec_generate(tgt.model, provider, ids, params(g))
            wall = time.perf_counter() - t0
            schedules.setdefault((g, pid), schedule_of(res.records))
            if (g, pid, name) not in outputs and res.speculation is not None:
                accept[g][0] += res.speculation.accepted
                accept[g][1] += res.speculation.drafted
            out = res.output_ids + ([] if res.usage.finish_reason != "stop" else [-1])
            outputs.setdefault((g, pid, name), out)
            return res.usage.generation_tokens, wall
        if name == "engine-plain":
            n = plain_generate(tgt.model, ids, params(g)).usage.generation_tokens
        elif name == "mlx_lm-spec":
            toks = _mlx_lm_run(speculative_generate_step(
                mx.array(ids, mx.uint32), tgt.model, drf.model, num_draft_tokens=g,
                max_tokens=max_tokens, **mlx_kv), eos)
            wall = time.perf_counter() - t0
            outputs.setdefault((g, pid, name), [t if t not in eos else -1 for t in toks])
            return len(toks), wall
        elif name == "mlx_lm-plain":
            n = len(_mlx_lm_run(generate_step(mx.array(ids, mx.uint32), tgt.model,
                                              max_tokens=max_tokens, **mlx_kv), eos))
        else:
            sched = schedules[(g, pid)]
            forwards_only(tgt.model, drf.model, ids, sched, params(g).kv)
            wall = time.perf_counter() - t0
            return -1, wall  # tokens: the engine-spec run's
        return n, time.perf_counter() - t0

    blocks: list[dict[str, Any]] = []
    # a missing op (engine.backend.run_supported): that arm's verdict in that block, the bench goes on
    missing: dict[str, dict[str, Any]] = {}  # arm -> the first missing op's info
    unsupported: list[dict[str, Any]] = []
    total = (repeats + 1) * len(gs) * len(prompts)
    b = 0
    seen = {True: 0, False: 0}  # warm / cold passes so far
    # The warm passes of a (γ, prompt) follow its cold pass directly, so the shapes they time
    # are still in MLX's CUDA graph/cuDNN caches (LRU, a few hundred entries by default).
    for g, p, pas in ((g, p, pas) for g in gs for p in prompts for pas in range(repeats + 1)):
        order = arm_order(pas > 0, seen[pas > 0])
        seen[pas > 0] += 1
        row: dict[str, Any] = {"pass": pas, "warm": pas > 0, "gamma": g, "prompt_id": p.id,
                               "order": order}
        for name in order:
            where = f"{name} γ={g} {p.id} pass {pas}"
            got: Any = None
            if name == "forwards" and (g, p.id) not in schedules:
                # untimed: the schedule; without it the forwards arm has nothing to replay
                sched = run_supported(lambda: arm("engine-spec", g, p.id, list(p.token_ids)), where)  # noqa: B023
                if isinstance(sched, Unsupported):
                    got = Unsupported(where, {**sched.info, "verdict": f"{sched.verdict} ({_NO_SCHEDULE})"})
            if got is None:
                got = run_supported(lambda: arm(name, g, p.id, list(p.token_ids)), where)  # noqa: B023
            if isinstance(got, Unsupported):
                row[name] = {"tokens": 0, "wall_s": None, "unsupported": got.verdict}
                missing.setdefault(name, got.info)
                unsupported.append({"arm": name, "gamma": g, "prompt_id": p.id, "pass": pas, "text": got.text,
                                    "verdict": got.verdict})
                continue
            row[name] = {"tokens": got[0], "wall_s": got[1]}
        if "unsupported" not in row["forwards"]:
            row["forwards"]["tokens"] = row["engine-spec"]["tokens"]
        blocks.append(row)
        b += 1
        if progress is not None:
            progress(b, total)

    def per_tok(row: dict[str, Any], name: str) -> float:
        return float(row[name]["wall_s"] / max(1, row[name]["tokens"]))

    def measured(row: dict[str, Any], name: str) -> bool:
        return "unsupported" not in row[name]

    def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
        out = {}
        for k, (a, c) in RATIOS.items():  # over the blocks where both arms were measured
            both = [r for r in rows if measured(r, a) and measured(r, c)]
            if both:
                out[k] = median_ratio([per_tok(r, a) / per_tok(r, c) for r in both]).to_dict()
        return out

    by_gamma = {}
    for g in gs:
        warm = [r for r in blocks if r["gamma"] == g and r["warm"]]
        cold = [r for r in blocks if r["gamma"] == g and not r["warm"]]
        acc, drafted = accept[g]
        by_gamma[str(g)] = {
            "acceptance": acc / drafted if drafted else None, "accepted": acc, "drafted": drafted,
            "warm": ratios(warm), "cold": ratios(cold),
            "arms_warm": _arm_totals(warm), "arms_cold": _arm_totals(cold),
        }
    both = [(g, p.id) for g in gs for p in prompts
            if (g, p.id, "engine-spec") in outputs and (g, p.id, "mlx_lm-spec") in outputs]
    same = sum(outputs[(g, pid, "engine-spec")] == outputs[(g, pid, "mlx_lm-spec")] for g, pid in both)
    flat = {(k if len(gs) == 1 else f"{k} γ={g}"): v
            for g in gs for k, v in by_gamma[str(g)]["warm"].items()}
    tfacts, dfacts = checkpoint_facts(tpath, tgt.model), checkpoint_facts(dpath, drf.model)
    res: dict[str, Any] = {
        **({"cache": dict(cache)} if cache else {}),
        "kind": "bench", "target": tname, "drafter": dname,
        "gamma": gs[0] if len(gs) == 1 else ",".join(map(str, gs)), "gammas": list(gs),
        "max_tokens": max_tokens, "n_prompts": len(prompts), "repeats": repeats,
        "prompt_ids": [p.id for p in prompts],
        "target_path": str(tpath), "drafter_path": str(dpath),
        "target_parameters": tfacts["parameters"], "drafter_parameters": dfacts["parameters"],
        "dtype": tfacts["dtype"], "target_checkpoint": tfacts, "drafter_checkpoint": dfacts,
        "order": "per block (γ, prompt, pass) every arm back to back, order rotated by one arm per "
                 "block; pass 0 cold (forwards last), passes 1..R warm right after (same shapes)",
        "blocks_with_differing_token_counts": sum(
            1 for r in blocks if len({r[a]["tokens"] for a in ARMS if measured(r, a)}) > 1),
        "unsupported": unsupported,
        "unsupported_arms": {a: str(info["verdict"]) for a, info in missing.items()},
        "engine_vs_mlx_lm_identical_outputs": f"{same}/{len(both)}",
        "arms": _arm_totals([r for r in blocks if r["warm"]]),
        "ratios": flat,
        "by_gamma": by_gamma,
        "goal": _goal(by_gamma),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "mlx": mx.__version__, "mlx_device": describe_device(),
                    **{k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")}},
        "blocks": blocks,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if profile and "engine-spec" not in missing:  # nothing to profile where the backend could not run it
        res["profile"] = _profile(lambda: spec_generate(tgt.model, provider, list(prompts[0].token_ids),
                                                        params(gs[-1])))
        res["phases"] = {str(g): _phases(lambda g=g: [spec_generate(tgt.model, provider, list(p.token_ids), params(g))
                                                      for p in prompts]) for g in gs}
    return res


def _phases(fn: Callable[[], Any]) -> dict[str, Any]:
    """Where a round's time goes (``engine.telemetry.profiling``): one warm pass over the prompts."""
    from engine.telemetry import profiling

    fn()  # warm
    with profiling() as prof:
        fn()
    return prof.to_dict()


def _arm_totals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name in ARMS:
        rows_in = [r for r in rows if "unsupported" not in r[name]]
        tokens = sum(r[name]["tokens"] for r in rows_in)
        wall = sum(r[name]["wall_s"] for r in rows_in)
        out.append({"arm": name, "tokens": tokens, "wall_s": round(wall, 4),
                    "tok_per_s": round(tokens / wall, 1) if wall > 0 else None})
    return out


def _goal(by_gamma: dict[str, Any]) -> list[str]:
    """Issue 13's benchmark goal, per γ: efficiency >= 0.95 of the bound; engine/mlx-lm high <= 1."""
    lines = []
    for g, d in by_gamma.items():
        w = d["warm"]
        if "efficiency_engine" not in w or "engine_over_mlx_lm_spec" not in w:
            continue  # an arm unsupported on this backend: no goal figure
        eff, rel = w["efficiency_engine"], w["engine_over_mlx_lm_spec"]
        lines.append(f"γ={g}: engine efficiency {eff['median']:.3f} [{eff['low']:.3f}, {eff['high']:.3f}] "
                     f"({'meets' if eff['median'] >= 0.95 else 'below'} 0.95); engine/mlx-lm "
                     f"{rel['median']:.3f} [{rel['low']:.3f}, {rel['high']:.3f}] "
                     f"({'meets' if rel['high'] <= 1.0 else 'misses'} upper bound <= 1.0)")
    return lines


def _profile(fn: Callable[[], Any], top: int = 15) -> list[dict[str, Any]]:
    import cProfile
    import pstats

    fn()  # warm
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_cc, calls, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}({func})", "calls": calls,
                     "own_s": round(tt, 5), "cumulative_s": round(ct, 5)})
    rows.sort(key=lambda r: -r["own_s"])
    return rows[:top]


def bench_markdown(res: dict[str, Any]) -> str:
    import pandas as pd

    def table(ratios: dict[str, Any]) -> str:
        rows = [{"ratio": k, "n": v["n"], "median": round(v["median"], 3), "low": round(v["low"], 3),
                 "high": round(v["high"], 3)} for k, v in ratios.items()]
        return pd.DataFrame(rows).to_markdown(index=False) if rows else "_none_"

    lines = [
        f"# bench: `{res['target']}` + `{res['drafter']}`, γ={res['gamma']}", "",
        f"{res['n_prompts']} prompts × {res['repeats']} warm passes (+1 cold), "
        f"max_tokens={res['max_tokens']}, temperature 0; {res['order']}. "
        f"Device {res['machine']['mlx_device']}, {_models_line(res)}. "
        f"Engine and mlx-lm speculative outputs identical: {res.get('engine_vs_mlx_lm_identical_outputs')}. "
        "Figures only: timing never fails.", "",
        *([f"**{len(res['unsupported_arms'])} of {len(ARMS)} arms unsupported on {res['machine']['mlx_device']}**"
           f"{'' if measured_anything(res) else ' — NOTHING MEASURED (no paired ratio)'}: "
           + "; ".join(f"{a}: {v}" for a, v in res["unsupported_arms"].items()), ""]
          if res.get("unsupported_arms") else []),
        "Paired ratios of time per token (median, 95 % percentile bootstrap interval). "
        "`engine_over_mlx_lm_*` < 1: the engine is faster; `spec_speedup_*` > 1: speculation "
        "beats the same target's plain decode; `efficiency_*`: forwards-only bound / spec time.", "",
    ]
    for g, d in res.get("by_gamma", {}).items():
        acc = d["acceptance"]
        lines += [f"## γ={g}: acceptance {acc:.1%} ({d['accepted']}/{d['drafted']})" if acc is not None
                  else f"## γ={g}", "", "warm:", "", table(d["warm"]), "", "cold (first sight of every shape):",
                  "", table(d["cold"]), "",
                  pd.DataFrame(d["arms_warm"]).to_markdown(index=False), ""]
    if res.get("unsupported"):
        lines += unsupported_lines(res) + [""]
    if res.get("goal"):
        lines += ["## goal (issue 13: efficiency >= 0.95, engine/mlx-lm upper bound <= 1.0)", "",
                  *[f"- {g}" for g in res["goal"]], ""]
    if res.get("phases"):
        from engine.telemetry import phase_table

        lines += ["## per-phase split of an engine round (one warm pass over the prompts, each phase "
                  "evaluated at its end)", "",
                  phase_table({f"γ={g}": d for g, d in res["phases"].items()}).rstrip("\n"), ""]
    if res.get("profile"):
        lines += ["## where the engine's host time goes (cProfile, one warm generation, own time)", "",
                  pd.DataFrame(res["profile"]).to_markdown(index=False), ""]
    return "\n".join(lines) + "\n"


def unsupported_lines(res: dict[str, Any]) -> list[str]:
    """The section listing each arm the backend could not run (``engine.backend.run_supported``):
    the arm, its verdict, how many blocks, and MLX's line of the first."""
    gone = res.get("unsupported") or []
    n_blocks = len(res.get("blocks", [])) or 1
    lines = ["## unsupported on this backend (those arms' ratios are left out; the rest are measured)", ""]
    for name in ARMS:
        mine = [u for u in gone if u["arm"] == name]
        if mine:
            lines.append(f"- `{name}`: `{mine[0]['verdict']}` in {len(mine)}/{n_blocks} blocks — {mine[0]['text']}")
    return lines


def measured_anything(res: dict[str, Any]) -> bool:
    """Whether the bench has at least one paired ratio (every ratio needs two measured arms)."""
    return any(d["warm"] or d["cold"] for d in res.get("by_gamma", {}).values())


def _models_line(res: dict[str, Any]) -> str:
    if "target_checkpoint" in res:
        return (f"target {describe_checkpoint(res['target_checkpoint'])}; "
                f"drafter {describe_checkpoint(res['drafter_checkpoint'])}")
    return (f"target {res.get('target_parameters', 0) / 1e9:.3g} B parameters ({res.get('dtype')}), "
            f"drafter {res.get('drafter_parameters', 0) / 1e9:.3g} B")


def write_bench(res: dict[str, Any], out: Path,
                track: Callable[[Path], Any] | None = None) -> tuple[Path, Path]:
    """Write ``bench.json`` and ``bench.md`` atomically (never a truncated or 0-byte file)."""
    from traces.io import atomic_write_json, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / "bench.json", out / "bench.md"
    for p in (jp, mp):
        if track is not None:
            track(p)
    atomic_write_json(jp, res, nan_as_null=True)
    atomic_write_text(mp, bench_markdown(res))
    return jp, mp
