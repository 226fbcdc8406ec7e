"""``specparity bench``: engine vs mlx-lm, speculative vs plain and the forwards-only bound
(``specparity/measure/bench.py``), paired, warm and cold.

Prints the figures and writes ``bench.json`` + ``bench.md`` into ``--out``
(checked writable and locked before measuring; figures printed before the
files are written). Never fails on timing: exit 0 unless a usage or write error.
A missing op (``engine.backend.run_supported``: MLX's own error for an op the backend lacks) is
that arm's verdict in that block, ``unsupported on <device>: <op>``: listed in the headline, a
section of ``bench.md`` and ``bench.json`` (``unsupported``, ``unsupported_arms``), its ratios
left out, the other arms measured; exit 0 when at least one paired ratio was measured, exit 1
when none was (every ratio needs an arm the backend could not run: NOTHING MEASURED).
``--size tiny|small|1b`` benches a seeded bf16 layer-skip pair built on first
use (``zoo/big.py``; ``1b`` is for a GPU: ``--device gpu``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specparity.cases.prompts import CHAT_TEMPLATE_HELP
from specparity.cli import args as a
from specparity.cli.devices import add_device_argument
from specparity.cli.kv_args import add_kv_arguments, cache_fields

NAME = "bench"
HELP = "paired timing: engine vs mlx-lm speculative_generate_step, spec vs plain, forwards-only bound"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, type=a.model_ref,
                   help="zoo target, trained name or model dir (default llama)")
    p.add_argument("--drafter", default=None, type=a.model_ref,
                   help="self|twin|small, trained name or model dir (default twin)")
    p.add_argument("--size", default=None, choices=("tiny", "small", "1b"),
                   help="bench a seeded bf16 llama + its own first 2 layers (zoo/big.py) instead")
    p.add_argument("--seed", type=a.seed, default=0, help="--size: the weights' seed")
    p.add_argument("--gamma", type=a.gamma, default=3)
    p.add_argument("--gammas", type=a.gamma_list, default=None, help="several γ (overrides --gamma)")
    p.add_argument("--prompts", type=a.positive_int, default=8)
    p.add_argument("--prompts-file", type=a.readable_file, default=None,
                   help="prompts file (JSONL {\"id\",\"text\"|\"token_ids\"} or one per line) instead "
                        "of the zoo's; required for a target outside the zoo's vocabulary")
    # --chat-template (issue 22): text prompts through the tokenizer's chat template
    p.add_argument("--chat-template", action="store_true", help=CHAT_TEMPLATE_HELP)
    p.add_argument("--max-tokens", type=a.max_tokens, default=32)
    p.add_argument("--repeats", type=a.positive_int, default=3, help="warm passes (after one cold pass)")
    p.add_argument("--profile", action="store_true",
                   help="also print the per-phase split of an engine round (draft, window, forward, sync, "
                        "walk, rollback, commit, records) and profile one warm generation (cProfile)")
    p.add_argument("--out", type=a.writable_dir, default=Path("runs/bench"))
    add_kv_arguments(p)
    add_device_argument(p)


def main(args: argparse.Namespace) -> int:
    # MLX's CUDA backend caches a cuDNN attention graph per (window, cache length) and a CUDA
    # graph per op sequence, LRU (256 / 400 by default): keep every shape a block times.
    os.environ.setdefault("MLX_CUDA_SDPA_CACHE_SIZE", "4096")
    os.environ.setdefault("MLX_CUDA_GRAPH_CACHE_SIZE", "4096")
    from specparity.cli.devices import use_device

    device = use_device(args.device)
    from specparity.cli.outdir import add_outputs
    from specparity.measure.bench import bench_markdown, measured_anything, run_bench, write_bench

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    step = max(1, ((args.repeats + 1) * args.prompts * len(args.gammas or (1,))) // 20)

    def progress(done: int, total: int) -> None:
        if done % step == 0 or done == total:
            log(f"bench: block {done}/{total}")

    log(f"bench: device {device}")
    with add_outputs(args.out, "specparity bench", flag="--out", own_folder=True) as claim:
        for name in ("bench.json", "bench.md"):  # refused before measuring if not ours
            claim.check(args.out / name)
        res = run_bench(args.target, args.drafter, gamma=args.gamma, gammas=args.gammas,
                        n_prompts=args.prompts, max_tokens=args.max_tokens, repeats=args.repeats,
                        size=args.size, seed=args.seed, profile=args.profile, progress=progress,
                        log=log, prompts_file=args.prompts_file,
                        chat_template=args.chat_template, cache=cache_fields(args))
        print(bench_markdown(res), flush=True)
        try:
            write_bench(res, args.out, track=claim.track)
        except OSError as exc:
            raise OSError(exc.errno, f"{exc.strerror} (the figures above are complete; only the "
                          "files were not written)", exc.filename) from None
    print(f"written {args.out}/bench.json and bench.md", file=sys.stderr)
    if not measured_anything(res):  # every arm a ratio needs was unsupported: never read as success
        print(f"specparity bench: nothing measured: {'; '.join(res['unsupported_arms'].values())}", file=sys.stderr)
        return 1
    return 0
