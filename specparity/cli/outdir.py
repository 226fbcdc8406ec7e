"""Output directories of the CLI and its ``python -m`` modules: :mod:`traces.outdir`, the
project's one ownership mechanism, plus what only the command line knows.

Everything of :mod:`traces.outdir` is re-exported here (``prepare_dir``, ``DirLock``,
``claim_output_dir``, ``add_outputs``, ``claim_output_file``, ...; its module doc states the
rules). This module adds:

- :data:`WRITERS` and :data:`MODULE_WRITERS`: every flag that names where a command or a
  ``python -m`` module / tool writes, and how it owns it (swept by
  ``tests/test_hostile_outdir.py`` and ``tests/test_hostile_module_writers.py``);
- :func:`run_output`: an older specparity's run outputs recognised by content (registered
  with :data:`traces.outdir.LEGACY_RUN_OUTPUT`);
- :func:`refusal`: a ``python -m`` module's one line for a refused destination (exit 2);
- :func:`json_of_kind`: ``ours`` for :func:`claim_output_file`. A single JSON output file
  (``--json FILE``): ``type=specparity.cli.args.output_file(ours, what)`` checks it at parse
  time, then ``with claim_output_file(path, command, flag=..., what=..., ours=...)`` around the
  work and the write.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from traces.outdir import (  # noqa: F401  (the mechanism, re-exported)
    BOOKKEEPING,
    FILE_LOCK,
    FOREIGN_SCAN_LIMIT,
    JOURNAL,
    LEGACY_RUN_OUTPUT,
    LOCK_NAME,
    PREVIOUS,
    PROBE_PREFIX,
    RUN_MARKER,
    Busy,
    Claim,
    DirLock,
    UsageError,
    add_outputs,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    claim_output_dir,
    claim_output_file,
    claim_run_dir,
    file_head,
    interrupt_notes,
    lock_dir,
    note_interrupt,
    output_dir_arg,
    prepare_dir,
    publish_tree,
    refuse_unowned_file,
    set_stage,
    track,
)

WRITERS: dict[str, str] = {
    "run --out": "run",  # claim_output_dir: run, run --sessions (a whole folder, one run)
    "grade --out": "run",  # grade DIR: claim_output_dir (--engine/--serve: add_outputs beside)
    "bench --out": "folder",  # add_outputs(own_folder=True)
    "ab --out": "folder",
    "record --out": "folder",
    "regen --report": "folder",
    "regen --golden-dir": "goldens",  # DirLock + only goldens and their manifest (commands/regen.py)
    "report run_dir": "beside",  # add_outputs: report.md/.html/report_files beside the traces
    "generate --trace": "file",  # claim_output_file
    "record --trace": "file",
    "audit --json": "file",
}
"""Every flag of the CLI that names where a command writes, and how it owns it (the scopes in
the module doc). ``tests/test_hostile_outdir.py`` derives the writing flags from the CLI
parser, checks they are exactly these, and plants a foreign file, a lock and an earlier run
for each."""

MODULE_WRITERS: dict[str, str] = {
    "specparity.grading.engines --out": "beside",  # grade_engine_main: add_outputs, each file checked first
    "specparity.grading.http_servers --out": "beside",  # grade_server_main: add_outputs
    "specparity.grading.native_mtp_conventions --out": "beside",  # add_outputs, before the capture
    "specparity.grading.vlm_batched --out": "beside",  # add_outputs, before the availability check
    "specparity.measure.bench_batched --json": "file",  # claim_output_file (the perf helper's)
    "tools/mutation.py --out": "folder",  # add_outputs(own_folder=True), before any mutation
    "zoo.build --out": "folder",  # traces.outdir.add_outputs(own_folder=True) + publish_tree
    "zoo.train --out": "beside",  # add_outputs: every file it replaces checked before training
    "reports.scoreboard dir": "beside",  # add_outputs: scoreboard.md/.html beside the results
    "reports.oracle_runs --out": "file",  # claim_output_file: a summary it wrote (its heading), checked first
}
"""Every writing flag of a ``python -m`` module or tool (``"module flag"`` -> the scope, as in
:data:`WRITERS`). ``tests/test_hostile_module_writers.py`` finds the modules with a parser,
reads each parser's flags, checks the writing ones are exactly these, and plants a user's
file in each destination: refused in one line before any work."""


def refusal(prog: str, exc: BaseException) -> int:
    """A ``python -m`` module's one line for a refused destination (or other bad input): exit 2."""
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return 2


def json_of_kind(kind: str, key: str = "kind") -> Callable[[Path], bool]:
    """``ours`` for :func:`claim_output_file`: an existing file is ours if it is a JSON object
    whose ``key`` is ``kind`` (the marker a writer puts in its own document)."""

    def ours(p: Path) -> bool:
        from specparity.cli.args import read_small_json

        doc = read_small_json(p)
        return isinstance(doc, dict) and doc.get(key) == kind

    ours.__name__ = f"json_of_kind_{kind}"
    return ours



def run_output(directory: Path, rel: str) -> bool:
    """Whether ``DIR/rel`` is recognisably a run output by its content (a trace, the summary,
    comparisons, the report and its plots): for run directories written before the markers
    listed their files, and for a report rebuilt over one."""
    from specparity.cli.args import is_trace, read_small_json

    p = directory / rel
    if p.is_symlink() or not p.is_file():
        return False
    if rel.startswith("traces/") and rel.endswith(".jsonl"):
        return is_trace(p)
    if rel == "summary.md":
        return file_head(p).startswith("# specparity run")
    if rel == "report.md":
        return file_head(p).startswith("# specparity report")
    if rel == "report.html":
        return "<title>specparity report</title>" in file_head(p)
    if rel == "comparisons.json":
        data = read_small_json(p)
        return isinstance(data, list) and all(isinstance(c, dict) and "case_id" in c for c in data)
    if rel.startswith("report_files/plot") and rel.endswith(".png"):
        return run_output(directory, "report.md")
    return False



LEGACY_RUN_OUTPUT.append(run_output)
