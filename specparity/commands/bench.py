"""``specparity bench``: engine vs mlx-lm and speculative vs plain, paired (``specparity/bench.py``).

Prints the figures and writes ``bench.json`` + ``bench.md`` into ``--out``
(checked writable and locked before measuring; figures printed before the
files are written). Never fails on timing: exit 0 unless a usage or write error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specparity import args as a

NAME = "bench"
HELP = "paired timing: engine vs mlx-lm speculative_generate_step, spec vs plain (figures only)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="llama", type=a.model_ref, help="zoo target, trained name or model dir")
    p.add_argument("--drafter", default="twin", type=a.model_ref, help="self|twin|small, trained name or model dir")
    p.add_argument("--gamma", type=a.positive_int, default=3)
    p.add_argument("--prompts", type=a.positive_int, default=8)
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="prompts file (JSONL {\"id\",\"text\"|\"token_ids\"} or one per line) instead "
                        "of the zoo's; required for a target outside the zoo's vocabulary")
    p.add_argument("--max-tokens", type=a.max_tokens, default=32)
    p.add_argument("--repeats", type=a.positive_int, default=3)
    p.add_argument("--out", type=a.writable_dir, default=Path("runs/bench"))


def main(args: argparse.Namespace) -> int:
    from specparity.bench import bench_markdown, run_bench, write_bench
    from specparity.outdir import lock_dir

    with lock_dir(args.out, "specparity bench", flag="--out", what="output directory"):
        res = run_bench(args.target, args.drafter, gamma=args.gamma, n_prompts=args.prompts,
                        max_tokens=args.max_tokens, repeats=args.repeats,
                        prompts_file=args.prompts_file)
        print(bench_markdown(res), flush=True)
        try:
            write_bench(res, args.out)
        except OSError as exc:
            raise OSError(exc.errno, f"{exc.strerror} (the figures above are complete; only the "
                          "files were not written)", exc.filename) from None
    print(f"written {args.out}/bench.json and bench.md", file=sys.stderr)
    return 0
