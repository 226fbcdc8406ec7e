"""The ``specparity`` command line.

Each subcommand is a module of ``specparity.commands`` (``run``, ``generate``,
``zoo``, ``trace``, ``diff``, ...). Exit status: 0 success / conformance, 1
divergence, invalid trace or a run that could not complete, 2 usage error.

This is the boundary where every expected failure becomes ONE line on stderr
naming the flag or file and what to do (``specparity: error: ...``): argparse
errors (without the usage dump), :class:`specparity.cli.args.UsageError` and the
other ``ValueError`` subclasses (bad files, JSON, traces) and missing files
exit 2; :class:`specparity.cli.args.RunFailed` and ``OSError`` while writing
(disk full, permission) exit 1. Anything else is a bug: one ``internal error``
line asking for ``--debug``. ``--debug`` (or ``SPECPARITY_DEBUG=1``) re-raises
with the full traceback.

SIGTERM (and Ctrl-C) unwind like an exception (:class:`specparity.cli.args.Terminated`
is a ``KeyboardInterrupt``): temp files are removed, locks released, a run's
marker and summary say it did not finish; then one line says what was
interrupted and what was kept, and the exit status is 143 (130 for Ctrl-C),
as a shell reports a process ended by that signal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

from specparity.cli.args import RunFailed, Terminated, UsageError
from specparity.commands import discover


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (the usage dump is what ``--help`` is for)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specparity", description="Conformance harness for speculative decoding on MLX.")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for mod in discover():
        mod.add_arguments(sub.add_parser(mod.NAME, help=mod.HELP, description=mod.__doc__))
    return p


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


def _os_error(exc: OSError) -> str:
    where = f"{exc.filename}: " if exc.filename else ""
    what = exc.strerror or _one_line(exc)
    hint = {28: "; free some space and run again", 13: "; choose a writable location",
            30: "; choose a writable location", 24: "; raise the open-file limit (ulimit -n)"}
    return f"{where}{what}{hint.get(exc.errno or 0, '')}"


def main(argv: list[str] | None = None) -> int:
    from traces import env

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]  # accepted anywhere on the line
    try:  # every SPECPARITY_* variable that is set, parsed before anything reads it (traces.env)
        debug = debug or bool(env.get("SPECPARITY_DEBUG"))
        env.check_all()
    except env.EnvError as exc:
        if debug:
            raise
        print(f"specparity: error: {exc}", file=sys.stderr)
        return 2
    for i, arg in enumerate(argv):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes the locale could not decode (surrogateescape)
            bad = arg.encode("utf-8", "surrogateescape")[exc.start:exc.start + 4]
            print(f"specparity: error: argument {i + 1} ({arg[:exc.start][:40]!r}...) is not valid "
                  f"UTF-8 text (bytes {bad!r}); pass text in UTF-8", file=sys.stderr)
            return 2
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or one error line (2)
        return int(exc.code) if isinstance(exc.code, int) else 2
    except Exception as exc:  # a flag type that raised something argparse does not catch
        if debug:
            raise
        code, line = _classify(exc)
        print(f"specparity: {line}", file=sys.stderr)
        return 2 if code == 1 and not line.startswith("internal") else code
    commands = {m.NAME: m for m in discover()}
    if "specparity.cli.outdir" in sys.modules:  # a second command in one process (tests, embedding)
        sys.modules["specparity.cli.outdir"].interrupt_notes(clear=True)
    try:
        with _sigterm_raises():
            return int(commands[args.command].main(args))
    except KeyboardInterrupt as exc:
        return _interrupted(args.command, exc)
    except BrokenPipeError:
        # stdout closed early (`specparity ... | head`): not an error worth a line.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the exit-time flush
        except OSError:
            pass
        return 0
    except Exception as exc:
        if debug:
            raise
        code, line = _classify(exc)
        print(f"specparity: {line}", file=sys.stderr)
        return code


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` in the main thread (once; a second one kills)."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield  # someone else (a test runner, an embedding program) handles SIGTERM
        return

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _interrupted(command: str, exc: BaseException) -> int:
    """One line: what was interrupted, what was kept; 143 for SIGTERM, 130 for Ctrl-C."""
    from specparity.cli.outdir import interrupt_notes

    sig, code = ("SIGTERM", 143) if isinstance(exc, Terminated) else ("Ctrl-C", 130)
    notes = interrupt_notes(clear=True)
    kept = "; ".join(notes) if notes else "no output was written (or only whole files)"
    print(f"specparity {command}: interrupted by {sig}; {kept}", file=sys.stderr)
    return code


def _classify(exc: Exception) -> tuple[int, str]:
    """(exit status, message) of an exception that reached the CLI boundary."""
    from engine.backend import unsupported_text

    missing = unsupported_text(exc, "nothing made")  # a job whose one unit hit an op the backend lacks
    if missing is not None:
        return 1, missing
    if isinstance(exc, UsageError):
        return 2, f"error: {_one_line(exc)}"
    if isinstance(exc, RunFailed | ArithmeticError) or type(exc).__name__ == "ReportError":
        # ReportError (reports.report): a run's files could not be read or the report written.
        # ArithmeticError: engine.sampler.NonFiniteLogits (a model producing NaN/inf).
        return 1, f"error: {_one_line(exc)}"
    if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return 2, f"error: {_os_error(exc)}"
    if isinstance(exc, OSError):
        return 1, f"error: {_os_error(exc)}"
    if isinstance(exc, UnicodeDecodeError):
        return 2, f"error: input is not UTF-8 text ({exc.reason} at byte {exc.start})"
    if isinstance(exc, ValueError):
        # ValueError subclasses: bad values/files (TraceFormatError, JSONDecodeError, ...).
        return 2, f"error: {_one_line(exc)}"
    if isinstance(exc, RecursionError):
        return 2, "error: input nested too deeply (refused)"
    if isinstance(exc, MemoryError):
        return 1, "error: out of memory (input too large?)"
    return 1, (f"internal error: {type(exc).__name__}: {_one_line(exc)[:300]} "
               "(run with --debug for the traceback, and please report it)")

