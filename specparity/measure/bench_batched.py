"""Throughput of batched speculation (``engine/batched.py``): figures, never a gate.

``python -m specparity.measure.bench_batched [--target llama] [--drafter twin|ngram|self|small]
[--size tiny|small|1b] [--rows 1,2,4,8] [--repeats 5] [--max-tokens 32] [--gamma 3]
[--json FILE]`` — for each batch size B: B requests (zoo prompts of mixed lengths, greedy) run
as ONE batch (``batch_generate``) and as B serial runs (``spec_generate`` one after the other),
both with cache digests off; the two arms alternate order every repeat (AB, BA, ...) after one
untimed warm-up of each, and each row's output must be identical in the two arms (else the
figure is refused). Printed per B: rows per second of each arm (median over repeats), tokens
per second, and the paired speedup ``serial wall / batched wall`` — the median of the
per-repeat ratios with its 95 % percentile-bootstrap interval (``reports.stats.median_ratio``), and
the same ratio of the process's CPU time (``time.process_time``: steadier than wall time on a
machine shared with other work, where the wall ratio swings with the load).

``--size 1b`` builds the seeded ≥1B bf16 pair (``zoo/big.py``, GPU-only in practice):
``python -m specparity.measure.bench_batched --size 1b --rows 1,2,4,8 --repeats 5 --max-tokens 64``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["bench_batched", "main", "markdown"]


def bench_batched(target: str | None = None, drafter: str | None = None, *, size: str | None = None,
                  rows: Sequence[int] = (1, 2, 4, 8), repeats: int = 5, max_tokens: int = 32, gamma: int = 3,
                  seed: int = 0, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time batched vs serial at each batch size (module docstring); the result as a dict."""
    from engine.batched import BatchRequest, batch_generate
    from engine.executor import GenerationParams, spec_generate
    from engine.sources.ngram import NgramProvider
    from engine.sources.two_model import TwoModelProvider
    from reports.stats import median_ratio
    from specparity.cli.devices import describe_device
    from specparity.measure.ab import choose_prompts as _pick_prompts
    from specparity.measure.bench import resolve_pair as _resolve
    from specparity.runners import load_model

    say = log or (lambda _m: None)
    if repeats < 1 or not rows or min(rows) < 1:
        raise ValueError("--repeats and every --rows value must be >= 1")
    ngram = drafter == "ngram"
    tname, dname, tpath, dpath = _resolve(target, None if ngram else drafter, size, seed, say)
    if ngram:
        dname = "ngram"
    tgt = load_model(str(tpath))
    drf = None if ngram else load_model(str(dpath))
    prompts = _pick_prompts(max(rows), tpath, None, max_tokens)

    def provider() -> Any:
        return NgramProvider(gamma=gamma) if drf is None else TwoModelProvider(drf.model)

    params = GenerationParams(max_tokens=max_tokens, gamma=gamma, eos_ids=tgt.eos_ids, cache_digests=False)

    def batched(b: int) -> tuple[float, float, list[list[int]], int]:
        reqs = [BatchRequest(f"r{i}", list(prompts[i].token_ids), params, provider()) for i in range(b)]
        t0, c0 = time.perf_counter(), time.process_time()
        res = batch_generate(tgt.model, reqs)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        outs = [res.rows[f"r{i}"].output_ids for i in range(b)]
        return wall, cpu, outs, sum(len(o) for o in outs)

    def serial(b: int) -> tuple[float, float, list[list[int]], int]:
        t0, c0 = time.perf_counter(), time.process_time()
        outs = [spec_generate(tgt.model, provider(), list(prompts[i].token_ids), params).output_ids for i in range(b)]
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return wall, cpu, outs, sum(len(o) for o in outs)

    table = []
    for b in rows:
        say(f"B = {b}: warm-up")
        batched(b)
        serial(b)
        walls: dict[str, list[float]] = {"batched": [], "serial": []}
        cpus: dict[str, list[float]] = {"batched": [], "serial": []}
        tokens = 0
        for rep in range(repeats):
            order = ("batched", "serial") if rep % 2 == 0 else ("serial", "batched")
            outs = {}
            for arm in order:
                wall, cpu, out, tokens = (batched if arm == "batched" else serial)(b)
                walls[arm].append(wall)
                cpus[arm].append(cpu)
                outs[arm] = out
            if outs["batched"] != outs["serial"]:
                i = next(j for j, (x, y) in enumerate(zip(outs["batched"], outs["serial"], strict=True)) if x != y)
                raise RuntimeError(f"B = {b}, repeat {rep}: row r{i} differs batched vs serial; no throughput "
                                   "figure for outputs that are not identical")
            say(f"B = {b}: repeat {rep + 1}/{repeats}: batched {walls['batched'][-1]:.3f} s, "
                f"serial {walls['serial'][-1]:.3f} s")
        ratio = median_ratio([s / bt for s, bt in zip(walls["serial"], walls["batched"], strict=True)])
        cpu_ratio = median_ratio([s / bt for s, bt in zip(cpus["serial"], cpus["batched"], strict=True)])
        med = {arm: sorted(w)[len(w) // 2] for arm, w in walls.items()}
        table.append({"rows": b, "tokens": tokens, "repeats": repeats,
                      "batched_wall_s": walls["batched"], "serial_wall_s": walls["serial"],
                      "batched_rows_per_s": b / med["batched"], "serial_rows_per_s": b / med["serial"],
                      "batched_tokens_per_s": tokens / med["batched"], "serial_tokens_per_s": tokens / med["serial"],
                      "batched_cpu_s": cpus["batched"], "serial_cpu_s": cpus["serial"],
                      "speedup": ratio.to_dict(), "cpu_speedup": cpu_ratio.to_dict(), "identical_outputs": True})
    return {"kind": "bench-batched", "target": tname, "drafter": dname, "gamma": gamma, "max_tokens": max_tokens,
            "device": describe_device(), "table": table}


def markdown(res: dict[str, Any]) -> str:
    lines = [f"Batched vs serial speculation: {res['target']} / {res['drafter']}, γ {res['gamma']}, "
             f"{res['max_tokens']} tokens per row, greedy, on {res['device']}; every row identical in both arms.",
             "",
             "| B | tokens | batched rows/s | serial rows/s | batched tok/s | serial tok/s | speedup (serial/batched wall), "
             "median [95% CI] | CPU-time speedup [95% CI] | repeats |",
             "|---:|---:|---:|---:|---:|---:|:---|:---|---:|"]
    for r in res["table"]:
        s, c = r["speedup"], r["cpu_speedup"]
        lines.append(f"| {r['rows']} | {r['tokens']} | {r['batched_rows_per_s']:.2f} | {r['serial_rows_per_s']:.2f} | "
                     f"{r['batched_tokens_per_s']:.1f} | {r['serial_tokens_per_s']:.1f} | "
                     f"{s['median']:.2f} [{s['low']:.2f}, {s['high']:.2f}] | "
                     f"{c['median']:.2f} [{c['low']:.2f}, {c['high']:.2f}] | {r['repeats']} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specparity.measure.bench_batched", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", default=None, help="a zoo drafter (twin, self, small) or ngram")
    p.add_argument("--size", default=None, choices=("tiny", "small", "1b"))
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(list(argv) if argv is not None else None)
    try:
        rows = tuple(int(x) for x in args.rows.split(","))
        res = bench_batched(args.target, args.drafter, size=args.size, rows=rows, repeats=args.repeats,
                            max_tokens=args.max_tokens, gamma=args.gamma, seed=args.seed,
                            log=lambda m: print(m, file=sys.stderr))
    except ValueError as exc:
        print(f"bench_batched: {exc}", file=sys.stderr)
        return 2
    print(markdown(res))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
