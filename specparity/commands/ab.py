"""``specparity ab``: paired drafter A/B on one target (``specparity/ab.py``, §4.5 phase 1c).

Prints the verdict and writes ``ab.json`` + ``ab.md`` into ``--out``. Exit 0
whatever the verdict (it is a measurement); ``--strict`` exits 1 on FAIL.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specparity.commands import positive

NAME = "ab"
HELP = "paired drafter A/B: McNemar acceptance gate + paired wall-clock verdict"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="zoo target (llama, qwen3), trained name or model dir")
    p.add_argument("--drafter-a", required=True, help="baseline drafter: self|twin|small, trained name or dir")
    p.add_argument("--drafter-b", required=True, help="candidate drafter (same forms)")
    p.add_argument("--gamma", type=positive, default=3)
    p.add_argument("--prompts", type=positive, default=32, help="prompts (default 32; < 32 refused)")
    p.add_argument("--allow-small", action="store_true", help="allow fewer than 32 prompts")
    p.add_argument("--max-drop", type=float, default=3.0, help="allowed acceptance drop, points")
    p.add_argument("--max-tokens", type=positive, default=32)
    p.add_argument("--out", type=Path, default=Path("runs/ab"))
    p.add_argument("--strict", action="store_true", help="exit 1 when the verdict is FAIL")


def main(args: argparse.Namespace) -> int:
    from specparity.ab import run_ab, write_ab

    if args.max_drop < 0:
        raise ValueError(f"--max-drop must be >= 0, got {args.max_drop}")

    def progress(i: int, n: int) -> None:
        if i == n or i % 8 == 0:
            print(f"ab: {i}/{n} prompts", file=sys.stderr)

    res = run_ab(args.target, args.drafter_a, args.drafter_b, gamma=args.gamma,
                 n_prompts=args.prompts, max_tokens=args.max_tokens, max_drop=args.max_drop,
                 allow_small=args.allow_small, progress=progress)
    jp, mp = write_ab(res, args.out)
    v = res["verdict"]
    print(f"A/B {res['target']}: A={res['drafter_a']} vs B={res['drafter_b']} "
          f"(γ={res['gamma']}, {res['n_prompts']} prompts): {v['verdict']}")
    for r in v["reasons"]:
        print(f"  {r}")
    print(f"written {jp} and {mp}", file=sys.stderr)
    return 1 if args.strict and not v["passes"] else 0
