"""``specparity record --runner NAME``: a reference trace for any case.

Takes ``generate``'s flags (target, drafter, source, prompt, γ, sampling, EOS
ids, logits processors) and runs the case with a reference runner instead of
the engine: ``mlx_lm`` here; ``optiq``, ``deepspec`` in the environments that
install them (``--runner all``: every per-case runner of the registry usable here
that implements the case, the others named with the reason; ``engine`` is
accepted too). A runner named with ``--runner`` that lacks the case's source or
one of its options (``specparity.runners.registry.unsupported``), a blank or
unknown name, or one not run per case is refused in one line, exit 2. The trace
is written as ``specparity run`` writes it (``specparity.runners.run_case``),
to ``--trace FILE`` (one runner) or ``--out DIR/<runner>/<case>.jsonl``.
A reference that refuses the case at run time (e.g. mlx-lm on a non-trimmable
cache) is reported with its reason and exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

NAME = "record"
HELP = "record a reference trace (mlx_lm, optiq, ...) for any case, with generate's flags"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specparity.commands import generate

    generate.add_arguments(p)
    from specparity.runners import registry

    p.add_argument("--runner", required=True,
                   help=f"per-case runner(s) of the registry, comma-separated: "
                        f"{', '.join(registry.names(per_case=True))} (docs/runners.md), or 'all' (every "
                        "one usable here that implements the case); a runner lacking the case's source or "
                        "an option is refused (exit 2)")
    from specparity.cli import args as a

    p.add_argument("--out", type=a.writable_dir, default=None,
                   help="write DIR/<runner>/<case>.jsonl (default: --trace FILE, or runs/record)")


def runner_names(given: str) -> list[str]:
    """``--runner``'s names, each a per-case runner of the registry, or ``["all"]``.

    A blank name, an unknown one, or one not run per case is refused in one line (exit 2)
    before any model loads: a record that records nothing is not a success.
    """
    from specparity.runners import registry

    names = [r.strip() for r in given.split(",")]
    known = ", ".join(n for n, r in registry.all_runners().items() if r.per_case)
    if any(not n for n in names):
        raise registry.RunnerUnsupported(f"--runner: empty runner name in {given!r}; known: {known}, all")
    if names == ["all"]:
        return names
    for n in names:
        if n == "all":
            raise registry.RunnerUnsupported("--runner: 'all' stands alone (not in a list)")
        if n not in registry.all_runners():
            raise registry.RunnerUnsupported(f"--runner: unknown runner {n!r}; known: {known}, all")
        r = registry.get(n)
        if not r.per_case:
            raise registry.RunnerUnsupported(f"--runner {n}: {r.name} is not run per case: {r.elsewhere}")
    return list(dict.fromkeys(names))


def main(args: argparse.Namespace) -> int:
    from specparity.cli.case_args import case_from_args
    from specparity.cli.devices import use_device
    from specparity.runners import registry

    names = runner_names(args.runner)
    if args.trace is not None and args.out is not None:  # honoured or refused, never ignored
        raise ValueError("--trace FILE and --out DIR both say where the trace goes: give one of them")
    use_device(args.device)  # --device comes with generate's flags
    case = case_from_args(args)
    from specparity.cli.case_args import check_grammars
    from specparity.cli.kv_args import check_kv_models

    check_kv_models([case])  # before any runner runs, as run and generate refuse it
    check_grammars([case])  # whichever runner records: a grammar that admits nothing is refused
    runners: list[str] = []
    if names == ["all"]:  # every per-case runner usable here that implements the case
        for name, r in registry.all_runners().items():
            if not r.per_case or not registry.run_availability(name)[0]:
                continue
            why = registry.unsupported(r, case)
            if why is not None:
                print(f"record: skipped {why}", file=sys.stderr)
                continue
            runners.append(name)
    else:
        for name in names:
            ok, why = registry.run_availability(name)
            if not ok:
                raise registry.RunnerUnsupported(f"--runner {name}: not available here: {why}")
            why = registry.unsupported(name, case)
            if why is not None:  # never a plain decode (or a dropped option) under the case's label
                raise registry.RunnerUnsupported(f"--runner {why}")
            runners.append(name)
    if args.trace is not None and len(runners) > 1:
        raise ValueError("--trace names one file; with several runners use --out DIR")
    out = args.out if args.out is not None else Path("runs/record")
    from specparity.cli.args import is_trace
    from specparity.cli.outdir import add_outputs, claim_output_file

    with contextlib.ExitStack() as stack:
        claim = None
        if args.trace is None:
            claim = stack.enter_context(add_outputs(out, "specparity record", own_folder=True,
                                                    recognise=is_trace))
        else:
            stack.enter_context(claim_output_file(args.trace, "specparity record", flag="--trace",
                                                  what="trace", ours=is_trace))
        return _record(args, case, runners, out, claim)


def _record(args: argparse.Namespace, case: Any, runners: list[str], out: Path, claim: Any) -> int:
    from specparity.jobs.run import run_task
    from traces.io import write_trace

    failed = recorded = 0
    for r in runners:
        kind, payload = run_task(r, case)
        if kind == "unsupported":  # the backend lacks an op (engine.backend): this runner's verdict
            print(f"{r}: {case.case_id}: {payload['verdict']} — {payload['line']}", file=sys.stderr)
            continue
        if kind == "refused":
            print(f"{r} refused {case.case_id}: {payload}", file=sys.stderr)
            failed += 1
            continue
        path = args.trace if args.trace is not None else claim.track(out / r / f"{case.file_stem}.jsonl")
        write_trace(path, payload)
        footer = payload[-1]
        print(f"{r}: {case.case_id}: {footer['usage']['generation_tokens']} tokens, "
              f"finish={footer['usage']['finish_reason']} -> {path}", file=sys.stderr)
        recorded += 1
    return 1 if failed or not recorded else 0  # nothing recorded (every runner unsupported) is no success
