"""``specparity known [--run DIR]``: the known reference behaviours and where they hit.

Lists ``traces/known_divergences.toml`` (id, runner, targets, kind, reason,
reproduction). With ``--run DIR`` (a ``specparity run`` output), also counts
the comparisons each entry explained in that run, and reports entries that
explained nothing there (a fixed reference bug, or a case the run did not
cover).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

NAME = "known"
HELP = "list known reference divergences/refusals (and their hits in a run)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", type=Path, default=None, help="a specparity run dir (reads comparisons.json)")


def main(args: argparse.Namespace) -> int:
    from traces.reference import known_entries

    hits: Counter[str] | None = None
    if args.run is not None:
        from reports.tables import load_comparisons

        path = args.run / "comparisons.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not a specparity run dir (no comparisons.json)")
        hits = Counter(c["known"] for c in load_comparisons(path, strict=False) if c.get("known"))
    for e in known_entries():
        print(f"{e.id}  [{e.kind}, runner {e.runner}, targets {', '.join(e.targets)}]")
        print(f"  reason:    {e.reason.splitlines()[0]} ...")
        print(f"  reproduce: {e.reproduce}")
        if hits is not None:
            n = hits.get(e.id, 0)
            print(f"  in {args.run}: {n} comparison(s)" + ("" if n else "  <- matched nothing in this run"))
        print()
    return 0
