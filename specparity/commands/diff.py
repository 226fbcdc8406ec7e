"""``specparity diff A B``: the first divergence between two traces (``traces/diff.py``)."""

from __future__ import annotations

import argparse

NAME = "diff"
HELP = "first divergence between two traces"


def add_arguments(d: argparse.ArgumentParser) -> None:
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--level", choices=("round", "tokens", "acceptance"), default="round")
    d.add_argument("--eps", type=float, default=None)


def main(args: argparse.Namespace) -> int:
    from traces.diff import diff_main

    argv = [args.a, args.b, "--level", args.level]
    if args.eps is not None:
        argv += ["--eps", str(args.eps)]
    return diff_main(argv)
