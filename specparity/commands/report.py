"""``specparity report RUN_DIR``: Markdown + self-contained HTML report of a run (``reports/report.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "report"
HELP = "write RUN_DIR/report.md and report.html from a run's traces (+ A/B and bench results)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="a `specparity run` output directory")


def main(args: argparse.Namespace) -> int:
    from reports.report import ReportError, build_report

    try:
        rep = build_report(args.run_dir)
    except ReportError as exc:
        print(f"specparity: error: {exc}", file=sys.stderr)
        return 1
    print(rep.summary.to_markdown(index=False) if not rep.summary.empty else "(no speculative cases)")
    print(f"report written to {rep.markdown} and {rep.html}", file=sys.stderr)
    return 0
