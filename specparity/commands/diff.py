"""``specparity diff A B``: the first divergence between two traces (``traces/diff.py``)."""

from __future__ import annotations

import argparse

from specparity.cli.args import nonneg_float

NAME = "diff"
HELP = "first divergence between two traces"


def add_arguments(d: argparse.ArgumentParser) -> None:
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--level", choices=("round", "tokens", "acceptance"), default="round")
    d.add_argument("--eps", type=nonneg_float, default=None)
    d.add_argument("--no-witness", action="store_true",
                   help="classify a flip by --eps only, even when the traces' target model is local")


def main(args: argparse.Namespace) -> int:
    from traces.diff import diff_main

    argv = [args.a, args.b, "--level", args.level]
    if args.eps is not None:
        argv += ["--eps", str(args.eps)]
    witness = None
    if not args.no_witness:  # header target path a local directory: replay it (engine/witness.py)
        from specparity.runners import numerics_witness

        witness = numerics_witness()
    return diff_main(argv, witness=witness)
