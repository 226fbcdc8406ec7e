"""Implementation A/B: the engine vs mlx-lm, speculative vs plain (figures, never a gate).

Four arms on the same pair, prompts and γ, temperature 0:

- ``engine-spec``: ``engine.executor.spec_generate`` (two-model source,
  ``cache_digests=False``);
- ``mlx_lm-spec``: mlx-lm 0.32.2 ``mlx_lm/generate.py`` ``speculative_generate_step``
  called directly (no oracle recorder, whose proxies add overhead);
- ``engine-plain`` / ``mlx_lm-plain``: ``plain_generate`` / ``generate_step`` on
  the same target (the SAME model's non-speculative baseline, §4.4).

Each (repeat, prompt) block runs all four arms back to back, the order rotated
by one arm per block so drift lands on every arm (§4.7 AB/BA). Generation stops
at the budget or an EOS (counted as a generated token in both, as in mlx-lm's
``stream_generate``). Per block, paired ratios of time per generated token:

- ``engine_over_mlx_lm_spec`` / ``engine_over_mlx_lm_plain`` (time; < 1: the
  engine is faster);
- ``spec_speedup_engine`` / ``spec_speedup_mlx_lm`` (plain time / spec time;
  > 1: speculation pays on this machine).

Each is reported as a median with a 95 % percentile bootstrap interval
(``reports.stats.median_ratio``).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ARMS = ("engine-spec", "mlx_lm-spec", "engine-plain", "mlx_lm-plain")


def _mlx_lm_run(gen: Any, eos: set[int]) -> int:
    n = 0
    for out in gen:
        n += 1
        if int(out[0]) in eos:
            break
    gen.close()
    return n


def run_bench(
    target: str = "llama",
    drafter: str = "twin",
    *,
    gamma: int = 3,
    n_prompts: int = 8,
    max_tokens: int = 32,
    repeats: int = 3,
    progress: Callable[[int, int], None] | None = None,
    prompts_file: Path | None = None,
) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step

    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.sources.two_model import TwoModelProvider
    from reports.stats import median_ratio
    from specparity.ab import _pick_prompts, resolve_drafter, resolve_target
    from specparity.runners import load_model

    _t, tpath = resolve_target(target)
    prompts = _pick_prompts(n_prompts, tpath, prompts_file, max_tokens)
    dpath = resolve_drafter(target, drafter)
    tgt, drf = load_model(str(tpath)), load_model(str(dpath))
    provider = TwoModelProvider(drf.model, draft_tokenizer=drf.tokenizer)
    provider.check_target(tgt.model, tgt.tokenizer)
    params = GenerationParams(max_tokens=max_tokens, gamma=gamma, eos_ids=tgt.eos_ids,
                              cache_digests=False)
    eos = set(tgt.eos_ids)

    def arm(name: str, ids: list[int]) -> tuple[int, float]:
        t0 = time.perf_counter()
        if name == "engine-spec":
            n = spec_generate(tgt.model, provider, ids, params).usage.generation_tokens
        elif name == "engine-plain":
            n = plain_generate(tgt.model, ids, params).usage.generation_tokens
        elif name == "mlx_lm-spec":
            n = _mlx_lm_run(speculative_generate_step(
                mx.array(ids, mx.uint32), tgt.model, drf.model, num_draft_tokens=gamma,
                max_tokens=max_tokens), eos)
        else:
            n = _mlx_lm_run(generate_step(mx.array(ids, mx.uint32), tgt.model,
                                          max_tokens=max_tokens), eos)
        return n, time.perf_counter() - t0

    for name in ARMS:  # untimed warm-up
        arm(name, list(prompts[0].token_ids))
    blocks = []
    total = repeats * len(prompts)
    for rep in range(repeats):
        for i, p in enumerate(prompts):
            b = rep * len(prompts) + i
            order = ARMS[b % 4:] + ARMS[: b % 4]
            row: dict[str, Any] = {"repeat": rep, "prompt_id": p.id, "order": list(order)}
            for name in order:
                n, s = arm(name, list(p.token_ids))
                row[name] = {"tokens": n, "wall_s": s}
            blocks.append(row)
            if progress is not None:
                progress(b + 1, total)

    def per_tok(row: dict[str, Any], name: str) -> float:
        return row[name]["wall_s"] / max(1, row[name]["tokens"])

    series = {
        "engine_over_mlx_lm_spec": [per_tok(r, "engine-spec") / per_tok(r, "mlx_lm-spec") for r in blocks],
        "engine_over_mlx_lm_plain": [per_tok(r, "engine-plain") / per_tok(r, "mlx_lm-plain") for r in blocks],
        "spec_speedup_engine": [per_tok(r, "engine-plain") / per_tok(r, "engine-spec") for r in blocks],
        "spec_speedup_mlx_lm": [per_tok(r, "mlx_lm-plain") / per_tok(r, "mlx_lm-spec") for r in blocks],
    }
    arms = []
    for name in ARMS:
        tokens = sum(r[name]["tokens"] for r in blocks)
        wall = sum(r[name]["wall_s"] for r in blocks)
        arms.append({"arm": name, "tokens": tokens, "wall_s": round(wall, 4),
                     "tok_per_s": round(tokens / wall, 1)})
    mismatched = sum(1 for r in blocks if len({r[a]["tokens"] for a in ARMS}) != 1)
    return {
        "kind": "bench", "target": target, "drafter": drafter, "gamma": gamma,
        "max_tokens": max_tokens, "n_prompts": len(prompts), "repeats": repeats,
        "prompt_ids": [p.id for p in prompts],
        "order": "four arms per (repeat, prompt) block, order rotated by one arm per block; "
                 "one untimed warm-up per arm",
        "blocks_with_differing_token_counts": mismatched,
        "arms": arms,
        "ratios": {k: median_ratio(v).to_dict() for k, v in series.items()},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "mlx_device": str(mx.default_device())},
        "blocks": blocks,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def bench_markdown(res: dict[str, Any]) -> str:
    import pandas as pd

    rows = [{"ratio": k, "n": v["n"], "median": round(v["median"], 3), "low": round(v["low"], 3),
             "high": round(v["high"], 3)} for k, v in res["ratios"].items()]
    return "\n".join([
        f"# bench: `{res['target']}` + `{res['drafter']}`, γ={res['gamma']}", "",
        f"{res['n_prompts']} prompts × {res['repeats']} repeats, max_tokens={res['max_tokens']}, "
        f"temperature 0; {res['order']}. Figures only: timing never fails.", "",
        pd.DataFrame(res["arms"]).to_markdown(index=False), "",
        "Paired ratios of time per token (median, 95 % percentile bootstrap interval). "
        "`engine_over_mlx_lm_*` < 1: the engine is faster; `spec_speedup_*` > 1: speculation "
        "beats the same target's plain decode.", "",
        pd.DataFrame(rows).to_markdown(index=False), "",
    ]) + "\n"


def write_bench(res: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``bench.json`` and ``bench.md`` atomically (never a partial file under either name)."""
    from traces.io import atomic_write_json, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / "bench.json", out / "bench.md"
    atomic_write_json(jp, res, nan_as_null=True)
    atomic_write_text(mp, bench_markdown(res))
    return jp, mp
