"""``specparity bench``: engine vs mlx-lm and speculative vs plain, paired (``specparity/bench.py``).

Prints the figures and writes ``bench.json`` + ``bench.md`` into ``--out``.
Never fails on timing: exit 0 unless a usage error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specparity.commands import positive

NAME = "bench"
HELP = "paired timing: engine vs mlx-lm speculative_generate_step, spec vs plain (figures only)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="llama", help="zoo target, trained name or model dir")
    p.add_argument("--drafter", default="twin", help="self|twin|small, trained name or model dir")
    p.add_argument("--gamma", type=positive, default=3)
    p.add_argument("--prompts", type=positive, default=8)
    p.add_argument("--max-tokens", type=positive, default=32)
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/bench"))


def main(args: argparse.Namespace) -> int:
    from specparity.bench import bench_markdown, run_bench, write_bench

    res = run_bench(args.target, args.drafter, gamma=args.gamma, n_prompts=args.prompts,
                    max_tokens=args.max_tokens, repeats=args.repeats)
    write_bench(res, args.out)
    print(bench_markdown(res))
    print(f"written {args.out}/bench.json and bench.md", file=sys.stderr)
    return 0
