"""The ``specparity`` command line.

Each subcommand is a module of ``specparity.commands`` (``run``, ``generate``,
``zoo``, ``trace``, ``diff``, ...). Exit status: 0 success / conformance, 1
divergence or invalid trace, 2 usage error.
"""

from __future__ import annotations

import argparse
import sys

from specparity.commands import discover


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specparity", description="Conformance harness for speculative decoding on MLX.")
    sub = p.add_subparsers(dest="command", required=True)
    for mod in discover():
        mod.add_arguments(sub.add_parser(mod.NAME, help=mod.HELP, description=mod.__doc__))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {m.NAME: m for m in discover()}
    try:
        return int(commands[args.command].main(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"specparity: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
