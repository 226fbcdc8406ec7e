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

from specparity.cli import args as a
from specparity.commands import positive

NAME = "regen"
HELP = "regenerate golden traces (stale ones with --stale-only), with a drift report"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specparity.runners import registry

    p.add_argument("--runner", action="append", metavar="R",
                   help=f"only this golden set's goldens (repeatable): {', '.join(registry.golden_sets())}")
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
    from specparity.cli.outdir import add_outputs

    if args.golden_dir is not None:
        _check_golden_dir(args.golden_dir)
    with add_outputs(args.report, "specparity regen", flag="--report", own_folder=True) as claim:
        for name in ("drift.json", "drift.md"):  # refused before any golden is regenerated
            claim.check(args.report / name)
        return _regen(args, claim)


def _check_golden_dir(d: Path) -> None:
    """Refuse a ``--golden-dir`` holding files regen did not write (it replaces goldens, the
    manifest and its journal there, and removes its own temp files): one line, nothing touched."""
    from specparity.cli.args import UsageError, is_trace, read_small_json
    from specparity.cli.outdir import LOCK_NAME, PROBE_PREFIX
    from specparity.goldens.manifest import MANIFEST_NAME
    from specparity.goldens.regen import JOURNAL_NAME

    if not d.is_dir():
        return
    foreign = []
    for p in sorted(d.rglob("*")):
        if p.is_dir() and not p.is_symlink():
            continue
        name = p.name
        if p.parent == d and (name in (LOCK_NAME, JOURNAL_NAME) or name.startswith(PROBE_PREFIX)):
            continue
        if name.startswith(".") and name.endswith(".tmp") and (
                ".jsonl." in name or name.startswith((f".{MANIFEST_NAME}.", f".{JOURNAL_NAME}."))):
            continue  # a killed writer's temp file of a golden, the manifest or the journal
        if p.suffix == ".jsonl" and not p.is_symlink() and is_trace(p):
            continue
        if p.parent == d and name == MANIFEST_NAME:
            doc = read_small_json(p)
            if isinstance(doc, dict) and isinstance(doc.get("goldens"), dict):
                continue
        foreign.append(p.relative_to(d).as_posix())
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UsageError(f"--golden-dir {d}: holds {len(foreign)} file(s) that are not goldens "
                         f"or their manifest ({shown}); regen replaces files there: give a "
                         "golden directory or a new one")


def _regen(args: argparse.Namespace, claim: object) -> int:
    from specparity.goldens.manifest import GOLDEN_DIR
    from specparity.goldens.regen import drift_report, regen, write_report

    try:
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
    except KeyboardInterrupt:
        from specparity.cli.outdir import note_interrupt

        note_interrupt("the goldens written so far are whole and in the manifest; the same "
                       "`specparity regen` resumes from its journal")
        raise
    for name in ("drift.json", "drift.md"):
        claim.track(args.report / name)  # type: ignore[attr-defined]
    path = write_report(result, args.report)
    print(drift_report(result), end="")
    print(f"drift report: {path}")
    return result.exit_code
