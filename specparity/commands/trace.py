"""``specparity trace validate FILE...``: schema + structural checks (``traces/validate.py``)."""

from __future__ import annotations

import argparse

NAME = "trace"
HELP = "trace files"


def add_arguments(t: argparse.ArgumentParser) -> None:
    tsub = t.add_subparsers(dest="trace_command", required=True)
    tv = tsub.add_parser("validate", help="validate trace files against the schema")
    tv.add_argument("files", nargs="+")


def main(args: argparse.Namespace) -> int:
    from traces.validate import validate_main

    return validate_main(args.files)
