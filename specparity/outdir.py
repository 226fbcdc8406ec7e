"""Output directories: writability before work, one writer per directory, atomic files.

- :func:`prepare_dir` creates an output directory and probes it with a real
  write, so an unwritable ``--out`` fails in one line before any measurement.
- :class:`DirLock` is an exclusive ``fcntl.flock`` on ``DIR/.specparity.lock``
  (the holder's pid and command written into it). A second writer is refused
  with one line naming the holder; the kernel drops the lock when the holder
  dies, even by ``kill -9``, so a crash never leaves a stale lock.
- :func:`claim_run_dir` gives a run directory to one run: it takes the lock,
  moves the outputs an earlier run left to ``DIR/.previous-run/`` (so no stale
  rows reach the report; removed once the new run completes, kept if it fails)
  and writes a marker (``.specparity-run.json``: run id, command, pid, state).
  The state becomes ``complete`` only when the run finishes; a killed run leaves
  ``running`` and ``specparity report`` then says INCOMPLETE.
- Files are published with :func:`traces.io.atomic_write_text` /
  :func:`traces.io.atomic_write_json` (temp file, fsync, rename, mode
  ``0666 & ~umask``): never a 0-byte or partial file under a final name.

References: ``fcntl.flock(2)`` advisory locks (Python ``fcntl`` module); the
lock-file-then-check-inode pattern guards against a lock file unlinked by the
previous holder between our ``open`` and our ``flock``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reports.tables import RUN_MARKER
from specparity.args import UsageError
from traces.io import atomic_write_bytes, atomic_write_json, atomic_write_text

__all__ = [
    "LOCK_NAME",
    "RUN_MARKER",
    "Busy",
    "DirLock",
    "RunClaim",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "claim_run_dir",
    "prepare_dir",
]

LOCK_NAME = ".specparity.lock"

RUN_OUTPUTS = ("traces", "comparisons.json", "summary.md", "report.md", "report.html", "report_files")
"""What a ``specparity run`` writes into its directory (cleared before a new run)."""


class Busy(UsageError):
    """Another specparity process holds the directory's lock."""


def prepare_dir(path: Path | str, flag: str = "--out") -> Path:
    """Create ``path`` (and parents) and prove it writable with a real write; else one line."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {p}: exists and is not a directory; give a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".specparity-probe-{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {p}: not writable ({exc.strerror or exc}); give a writable "
                         "directory") from None
    return p


def _describe_holder(lock_path: Path) -> str:
    try:
        info = json.loads(lock_path.read_text())
        return f"pid {info.get('pid')}, `{info.get('command')}`, since {info.get('started')}"
    except (OSError, ValueError):
        return "another process"


class DirLock:
    """Exclusive, non-blocking lock on a directory (``DIR/.specparity.lock``)."""

    def __init__(self, directory: Path | str, command: str, *, flag: str = "--out",
                 what: str = "output directory") -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.command, self.flag, self.what = command, flag, what
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise Busy(f"{self.flag} {self.directory}: another specparity process is writing "
                           f"this {self.what} ({_describe_holder(self.path)}); wait for it to "
                           "finish or choose another directory") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder unlinked it between our open and flock
        info = {"pid": os.getpid(), "command": self.command,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(info).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class RunClaim:
    directory: Path
    run_id: str
    command: str
    marker: dict[str, Any]

    def finish(self, state: str = "complete", **extra: Any) -> None:
        self.marker.update(state=state, finished=time.strftime("%Y-%m-%dT%H:%M:%S"), **extra)
        atomic_write_json(self.directory / RUN_MARKER, self.marker)


PREVIOUS = ".previous-run"
"""Where an earlier run's outputs wait until the new run completes (then removed)."""


def _set_aside(directory: Path, names: tuple[str, ...]) -> list[str]:
    """Move an earlier run's outputs into ``DIR/.previous-run`` (replacing an older one)."""
    present = [n for n in names if (directory / n).exists() or (directory / n).is_symlink()]
    if not present:
        return []
    prev = directory / PREVIOUS
    if prev.exists():
        shutil.rmtree(prev)
    prev.mkdir()
    for name in present:
        os.replace(directory / name, prev / name)
    marker = directory / RUN_MARKER
    if marker.exists():
        os.replace(marker, prev / RUN_MARKER)
    return present


@contextlib.contextmanager
def claim_run_dir(path: Path | str, command: str, *, flag: str = "--out",
                  outputs: tuple[str, ...] = RUN_OUTPUTS,
                  extra: dict[str, Any] | None = None) -> Iterator[RunClaim]:
    """Own ``path`` for one run: writable, locked, earlier outputs set aside, marker written.

    The marker's state is ``complete`` on a normal exit, ``failed`` when the
    block raises, and stays ``running`` if the process is killed.
    """
    directory = prepare_dir(path, flag)
    with DirLock(directory, command, flag=flag, what="run directory"):
        moved = _set_aside(directory, outputs)
        if moved:
            print(f"specparity: {flag} {directory}: the earlier run's {', '.join(moved)} moved to "
                  f"{PREVIOUS}/ (removed when this run completes)", file=sys.stderr)
        (directory / RUN_MARKER).unlink(missing_ok=True)
        claim = RunClaim(directory, uuid.uuid4().hex[:12], command, {})
        claim.marker = {"run_id": claim.run_id, "command": command, "pid": os.getpid(),
                        "state": "running", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        **(extra or {})}
        atomic_write_json(directory / RUN_MARKER, claim.marker)
        try:
            yield claim
        except BaseException as exc:
            with contextlib.suppress(OSError):
                claim.finish("failed", error=f"{type(exc).__name__}: {exc}"[:500])
            if (directory / PREVIOUS).exists():
                print(f"specparity: {flag} {directory}: this run did not complete; the earlier "
                      f"run's outputs are kept in {directory / PREVIOUS}/", file=sys.stderr)
            raise
        claim.finish("complete")
        shutil.rmtree(directory / PREVIOUS, ignore_errors=True)


def lock_dir(path: Path | str, command: str, *, flag: str, what: str) -> DirLock:
    """:class:`DirLock` on an existing-or-created, writable directory (e.g. a golden dir)."""
    directory = prepare_dir(path, flag)
    return DirLock(directory, command, flag=flag, what=what)
