"""``specparity grade DIR``: grade traces written by any engine.

``DIR`` holds traces (``*.jsonl``, any depth) written by an engine — ours,
another Python engine through the writer API (``traces/writer.py``), or an
engine in another language that follows ``traces/schema.json`` and
``traces/INTERPRETING.md``. Each trace is validated; the cases their headers
name are re-run (plain decode and every available live reference, models by
the header's paths, checked against the header's digests) and compared with
the same verdict table, diffs and report as ``specparity run``.

``--server URL`` / ``--serve NAME`` grade an OpenAI-compatible server
(``specparity.grading.http_servers.grade_server_main``). ``--engine NAME`` grades a
registered third-party engine instead: it is run on
the cases first and its traces graded (``specparity.grading.engines.grade_engine_main``).
"""

from __future__ import annotations

import argparse
import sys

from specparity.cli.args import existing_dir, nonneg_int, runner_list, writable_dir

NAME = "grade"
HELP = "grade a folder of traces from any engine (or --engine NAME) against plain decode and the references"


def _servers() -> list[str]:
    """The servers ``--serve`` starts: the rows of ``subjects/server_rows.py`` (each is a registry runner of
    kind ``server``), the test double left out. A ``server`` runner declared without a row is not one
    (docs/runners.md, "Adding a runner/server"): it is left out here, and ``--serve`` names the row it lacks."""
    from specparity.runners import registry
    from subjects.server_rows import SERVERS

    names = [n for n in registry.names("server") if n in SERVERS] + [n for n in SERVERS
                                                                     if n not in registry.names("server")]
    return [n for n in names if not SERVERS[n].test_double]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=existing_dir, nargs="?", default=None,
                   help="folder of engine traces (*.jsonl, searched recursively)")
    from specparity.runners import registry

    p.add_argument("--engine", default=None, metavar="NAME",
                   help=f"run the registered third-party engine NAME ({', '.join(registry.names('subject'))}; "
                        "or all) on the cases and grade it (see specparity.grading.engines)")
    p.add_argument("--server", default=None, metavar="URL",
                   help="grade a running OpenAI-compatible server (with --model; specparity.grading.http_servers)")
    p.add_argument("--serve", default=None, metavar="NAME",
                   help=f"start server NAME ({', '.join(_servers())}) on "
                        "127.0.0.1 with --model [--draft], grade it with and without the drafter, stop it "
                        "(exit 0 all graded cells pass, 1 a finding, 3 nothing could be graded)")
    p.add_argument("--model", default=None, metavar="PATH", help="the served model dir (or zoo name)")
    p.add_argument("--draft", default=None, metavar="PATH", help="the served draft model dir (or zoo drafter)")
    p.add_argument("--out", type=writable_dir, default=None,
                   help="output dir for references, verdicts and report (default DIR/graded)")
    p.add_argument("--runners", type=runner_list, default=None,
                   help=f"references to re-run, comma-separated: "
                        f"{', '.join(registry.names('reference', per_case=True))} (default: all available)")
    p.add_argument("--workers", type=nonneg_int, default=0,
                   help="process-pool size for the re-runs (0: in this process)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run the re-runs on Ray (local when no ADDRESS)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    from specparity.grading.http_servers import add_server_arguments

    add_server_arguments(p)


def main(args: argparse.Namespace) -> int:
    if args.server is not None or args.serve is not None:
        from specparity.grading.http_servers import grade_server_main

        return int(grade_server_main(args))
    if args.engine is not None:
        try:
            from specparity.grading.engines import grade_engine_main
        except ImportError as exc:
            print(f"specparity grade: --engine needs specparity.grading.engines, which is not available "
                  f"here ({exc})", file=sys.stderr)
            return 2
        return int(grade_engine_main(args))
    if args.dir is None:
        print("specparity grade: give a folder of traces (DIR) or --engine NAME", file=sys.stderr)
        return 2
    from specparity.grading.trace_folders import grade_main

    return grade_main(args)
