"""``specparity report DIR``: Markdown + self-contained HTML report of a run (``reports/report.py``).

DIR is a ``specparity run`` output or any folder of traces (engine, reference
and plain, any mix). Exit status: 0 when the run CONFORMS, 1 when it diverges,
is INCOMPLETE (killed midway, fewer comparisons than cases, or no
comparisons at all) or cannot be read (one line naming the file). An existing
``report.md``/``report.html``/``report_files/`` that specparity did not write
is refused (exit 2), never overwritten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specparity.cli.args import report_dir

NAME = "report"
HELP = "write DIR/report.md and report.html from a run's (or any folder's) traces"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=report_dir, help="a `specparity run` output directory or a folder of traces")


def main(args: argparse.Namespace) -> int:
    from reports.report import ReportError, build_report
    from specparity.cli.outdir import add_outputs, run_output

    try:
        d = Path(args.run_dir)
        with add_outputs(d, "specparity report", flag="report", run_output=True, create=False,
                         recognise=lambda p: run_output(d, p.relative_to(d).as_posix())) as claim:
            rep = build_report(Path(args.run_dir), track=claim.track)
    except ReportError as exc:
        print(f"specparity: error: {exc}", file=sys.stderr)
        return 1
    print(rep.summary.to_markdown(index=False) if not rep.summary.empty else "(no speculative cases)")
    print(f"report written to {rep.markdown} and {rep.html}", file=sys.stderr)
    if not rep.conforms:
        print(f"specparity: report: {rep.status}: see {rep.markdown}", file=sys.stderr)
        return 1
    return 0
