"""``specparity run``: the main job on the tiny zoo (``specparity/run.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specparity.commands import int_list, positive, str_list

NAME = "run"
HELP = "run engine + every available oracle on the zoo and report"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("runs/latest"), help="output dir (default runs/latest)")
    p.add_argument("--targets", type=str_list, default=None, help="comma-separated zoo targets")
    p.add_argument("--drafters", type=str_list, default=None, help="comma-separated drafters")
    p.add_argument("--gammas", type=int_list, default=(1, 2, 3, 5), help="default 1,2,3,5")
    p.add_argument("--prompts", type=positive, default=8, help="prompts per cell (default 8)")
    p.add_argument("--max-tokens", type=positive, default=32)
    p.add_argument("--runners", type=str_list, default=None, help="oracles to run (default: all available)")


def main(args: argparse.Namespace) -> int:
    from specparity.run import run

    result = run(
        args.out, targets=args.targets, drafters=args.drafters, gammas=args.gammas,
        n_prompts=args.prompts, max_tokens=args.max_tokens, runners=args.runners,
    )
    print((args.out / "summary.md").read_text())
    print(f"traces and report written to {args.out}/", file=sys.stderr)
    return 0 if result.ok else 1
