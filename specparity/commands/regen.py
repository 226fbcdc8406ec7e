"""``specparity regen``: regenerate golden traces (``traces/golden/``).

Regenerates every golden, or those of ``--runner`` / ``--case GLOB`` (matched
against the case id, its file stem or ``runner/stem``), or only the stale,
corrupt or missing ones (``--stale-only``), on a local process pool
(``--workers N``, default: the CPU count) or on Ray (``--ray`` for a local
instance, ``--ray ADDRESS`` for a cluster whose nodes have specparity
installed). Writes are atomic and a killed run resumes where it stopped.
Ends with a drift report (also written to ``--report DIR``/drift.md and
drift.json): which goldens changed, the first divergent round and its class.
A ``logic`` change is not written without ``--accept``. Exit status: 0, or 1
when a change was refused or a run failed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specparity import args as a
from specparity.commands import positive

NAME = "regen"
HELP = "regenerate golden traces (stale ones with --stale-only), with a drift report"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runner", action="append", metavar="R",
                   help="only this runner's goldens (repeatable)")
    p.add_argument("--case", metavar="GLOB", help="only cases matching GLOB (case id or file stem)")
    p.add_argument("--stale-only", action="store_true", help="only stale, corrupt or missing goldens")
    p.add_argument("--accept", action="store_true", help="write goldens whose change is class logic")
    p.add_argument("--workers", type=positive, default=None, metavar="N",
                   help="local process-pool size (default: CPU count)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run on Ray: a local instance, or the cluster at ADDRESS")
    p.add_argument("--golden-dir", type=a.writable_dir, default=None, metavar="DIR",
                   help="golden directory (default: traces/golden)")
    p.add_argument("--report", type=a.writable_dir, default=Path("runs/regen"), metavar="DIR",
                   help="where drift.md / drift.json go (default: runs/regen)")


def main(args: argparse.Namespace) -> int:
    from specparity.outdir import add_outputs

    with add_outputs(args.report, "specparity regen", flag="--report") as claim:
        for name in ("drift.json", "drift.md"):  # refused before any golden is regenerated
            claim.check(args.report / name)
        return _regen(args, claim)


def _regen(args: argparse.Namespace, claim: object) -> int:
    from specparity.goldens import GOLDEN_DIR
    from specparity.regen import drift_report, regen, write_report

    result = regen(
        args.golden_dir or GOLDEN_DIR,
        runners=args.runner,
        case_glob=args.case,
        stale_only=args.stale_only,
        accept=args.accept,
        workers=args.workers,
        ray=args.ray is not None,
        ray_address=args.ray or None,
    )
    for name in ("drift.json", "drift.md"):
        claim.track(args.report / name)  # type: ignore[attr-defined]
    path = write_report(result, args.report)
    print(drift_report(result), end="")
    print(f"drift report: {path}")
    return result.exit_code
