"""Output directories: writability before work, one writer per directory, only our own files.

The project's one ownership mechanism for everything it writes, in the lowest layer so that
every writer of every layer goes through it: the CLI's subcommands and ``python -m`` modules
(through ``specparity.cli.outdir``, which adds the registries of writers and the recognisers
of older runs' outputs), ``reports.scoreboard`` and the ``zoo`` builders (directly).

- :func:`prepare_dir` creates an output directory and probes it with a real
  write, so an unwritable ``--out`` fails in one line before any measurement.
- :class:`DirLock` is an exclusive ``fcntl.flock`` on ``DIR/.specparity.lock``
  (the holder's pid, command and run id written into it). A second writer is
  refused with one line naming the holder; the kernel drops the lock when the
  holder dies, even by ``kill -9``, so a crash never leaves a stale lock.
- Ownership: ``DIR/.specparity-run.json`` (the marker) lists every file a
  specparity command wrote in ``DIR`` — ``files``, the outputs of the run that
  owns the directory, and ``added``, what other commands (``bench``, ``ab``,
  ``record``, ...) put there. A writer registers a file (:meth:`Claim.track`)
  *before* creating it, in the append-only journal ``DIR/.specparity-run.files``,
  so even a ``kill -9`` leaves every file it wrote listed. Nothing that is not
  listed is ever moved, deleted or overwritten:

  * :func:`claim_output_dir` (``run``, ``grade``) owns a whole directory: it is
    refused in one line if ``DIR`` holds any file no specparity command wrote;
    the earlier run's listed files are moved to ``DIR/.previous-run/`` and
    removed only once the new run completes. The last *finished* run is never
    lost: an unfinished run's files are dropped rather than replace a finished
    run already kept there.
  * :func:`add_outputs` writes named files into a directory, listed as added:
    with ``own_folder`` (``bench``, ``ab``, ``record --out``, ``regen --report``)
    the folder is refused like a run's if it holds a file no specparity command
    wrote; without (``report DIR``, ``grade --engine/--serve --out``: files
    beside the folder's own) a file it would replace must be absent or listed.
  * :func:`claim_output_file` owns one file (``--trace FILE``, ``audit --json
    FILE``): a lock beside it, its content its marker (a trace, an audit JSON).

  Every command that writes uses one of these three (``tests/test_hostile_outdir.py``
  sweeps every writing flag of the CLI parser: ``specparity.cli.outdir.WRITERS``), and so
  does every ``python -m`` module and tool (``specparity.cli.outdir.MODULE_WRITERS``, swept
  by ``tests/test_hostile_module_writers.py`` from the modules' own parsers).
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
import stat
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from traces.io import atomic_write_bytes, atomic_write_json, atomic_write_text

__all__ = [
    "JOURNAL",
    "LOCK_NAME",
    "PREVIOUS",
    "RUN_MARKER",
    "Busy",
    "Claim",
    "DirLock",
    "add_outputs",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "output_dir_arg",
    "publish_tree",
    "claim_output_dir",
    "claim_output_file",
    "claim_run_dir",
    "interrupt_notes",
    "LEGACY_RUN_OUTPUT",
    "UsageError",
    "note_interrupt",
    "prepare_dir",
    "track",
]

RUN_MARKER = ".specparity-run.json"
"""The ownership marker of an output directory (``reports.tables`` reads run directories by it)."""


class UsageError(ValueError):
    """Bad input from the user (a flag, a file, a directory): exit status 2.

    Defined here, the lowest layer that writes output folders, so every writer of every layer
    (``zoo`` builders, ``reports.scoreboard``, the CLI) refuses with the same class;
    ``specparity.cli.args.UsageError`` is this class."""


LEGACY_RUN_OUTPUT: list[Callable[[Path, str], bool]] = []
"""Recognisers of an older specparity's run outputs by content (``DIR``, relative path) -> bool,
for run directories written before markers listed their files (``specparity.cli.outdir``
registers its own; a lower layer's writer needs none)."""

LOCK_NAME = ".specparity.lock"
FILE_LOCK = ".{}.specparity.lock"
"""The lock of a single output file ``DIR/NAME`` (``--trace``, ``--json``): ``DIR/.NAME.specparity.lock``."""
JOURNAL = ".specparity-run.files"
"""Append-only list of the files a command is writing (``F rel`` run output, ``A rel`` added)."""
PREVIOUS = ".previous-run"
"""Where an earlier run's outputs wait until the new run completes (then removed)."""
PROBE_PREFIX = ".specparity-probe-"
BOOKKEEPING = frozenset({LOCK_NAME, RUN_MARKER, JOURNAL, PREVIOUS})

_NOTES: list[str] = []
_ACTIVE: list[Claim] = []


def note_interrupt(text: str) -> None:
    """Add what a command kept to the CLI's one interrupt line."""
    _NOTES.append(text)


def interrupt_notes(clear: bool = False) -> list[str]:
    """What the output directories of an interrupted command kept (for the CLI's one line)."""
    notes = list(_NOTES)
    if clear:
        _NOTES.clear()
    return notes


class Busy(UsageError):
    """Another specparity process holds the directory's lock."""


def prepare_dir(path: Path | str, flag: str = "--out") -> Path:
    """Create ``path`` (and parents) and prove it writable with a real write; else one line."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {p}: exists and is not a directory; give a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f"{PROBE_PREFIX}{os.getpid()}"
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
                 what: str = "output directory", run_id: str | None = None,
                 name: str = LOCK_NAME, shown: Path | None = None) -> None:
        self.directory = Path(directory)
        self.path = self.directory / name
        self.shown = shown if shown is not None else self.directory  # what the refusal names
        self.command, self.flag, self.what, self.run_id = command, flag, what, run_id
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise Busy(f"{self.flag} {self.shown}: another specparity process is writing "
                           f"this {self.what} ({_describe_holder(self.path)}); wait for it to "
                           "finish or choose another directory") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder unlinked it between our open and flock
        info = {"pid": os.getpid(), "command": self.command, "run_id": self.run_id,
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


# ---------------------------------------------------------------- ownership


def _regular(p: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(p).st_mode)
    except OSError:
        return False


def _read_marker(directory: Path) -> dict[str, Any] | None:
    path = directory / RUN_MARKER
    if not (path.exists() or path.is_symlink()):
        return None
    if not _regular(path):  # a FIFO or device: never opened
        return {"state": "unreadable", "files": [], "added": []}
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError):
        return {"state": "unreadable", "files": [], "added": []}
    return m if isinstance(m, dict) else {"state": "unreadable", "files": [], "added": []}


def _listed(marker: dict[str, Any] | None, directory: Path) -> tuple[set[str], set[str]]:
    """``(run outputs, added outputs)`` the marker and the journal list (relative paths)."""
    files: set[str] = set()
    added: set[str] = set()
    if marker is not None:
        for key, into in (("files", files), ("added", added)):
            v = marker.get(key)
            if isinstance(v, list):
                into.update(x for x in v if isinstance(x, str))
    try:
        journal = directory / JOURNAL
        lines = (journal.read_text(encoding="utf-8", errors="replace").splitlines()
                 if _regular(journal) else [])
    except OSError:
        lines = []
    for line in lines:
        kind, _, rel = line.partition(" ")
        if rel:
            (files if kind == "F" else added).add(rel)
    return files, added


def _inventory(directory: Path) -> Iterator[str]:
    """Every file (any non-directory) under ``directory`` except our bookkeeping, probe files
    and nested specparity output directories (a folder with its own marker), walk order."""
    for root, dirs, files in os.walk(directory):
        here = Path(root)
        if here != directory and (here / RUN_MARKER).exists():
            dirs[:] = []
            continue
        top = here == directory
        keep = []
        for d in dirs:
            if top and d in BOOKKEEPING:
                continue
            if (here / d).is_symlink():
                files.append(d)  # a link to a directory is a file for us: never followed
                continue
            keep.append(d)
        dirs[:] = keep
        dirs.sort()
        for f in sorted(files):
            if top and (f in BOOKKEEPING or f.startswith(PROBE_PREFIX)):
                continue
            yield (here / f).relative_to(directory).as_posix()


def _ours(rel: str, listed: set[str]) -> bool:
    """Listed, or the hidden temp file of a listed file (``.NAME.xxxx.tmp``, a killed writer's)."""
    if rel in listed:
        return True
    parent, _, name = rel.rpartition("/")
    if name.startswith(".") and name.endswith(".tmp"):
        stem = name[1:].rsplit(".", 2)[0]
        return (f"{parent}/{stem}" if parent else stem) in listed
    return False


FOREIGN_SCAN_LIMIT = 1000
"""Foreign files counted before a refusal (``--out ~`` must not walk a whole home folder)."""


def _foreign(directory: Path, listed: set[str], limit: int = FOREIGN_SCAN_LIMIT) -> list[str]:
    out = []
    for rel in _inventory(directory):
        if not _ours(rel, listed):
            out.append(rel)
            if len(out) >= limit:
                break
    return out


def file_head(p: Path, n: int = 200) -> str:
    if not _regular(p):
        return ""
    try:
        with open(p, encoding="utf-8") as fh:
            return fh.read(n)
    except (OSError, UnicodeDecodeError):
        return ""


def _legacy(marker: dict[str, Any] | None) -> bool:
    """A marker from before markers listed files (it has a run id, no ``files``)."""
    return marker is not None and "run_id" in marker and "files" not in marker


def _owned_or_refuse(directory: Path, marker: dict[str, Any] | None, files: set[str], added: set[str],
                     flag: str) -> set[str]:
    """The files of ``directory`` a specparity command wrote (an older specparity's run outputs
    recognised by content where its marker lists none); refuses, in one line, a folder holding
    any other file."""
    owned = set(files)
    if _legacy(marker):  # an older specparity's run: its outputs recognised by content
        everything = _foreign(directory, owned | added, limit=1 << 62)
        owned |= {rel for rel in everything if any(f(directory, rel) for f in LEGACY_RUN_OUTPUT)}
    foreign = _foreign(directory, owned | added)
    if foreign:
        _refuse_foreign(directory, flag, foreign)
    return owned


def _refuse_foreign(directory: Path, flag: str, foreign: list[str]) -> None:
    more = "+" if len(foreign) >= FOREIGN_SCAN_LIMIT else ""
    shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3}{more} more" if len(foreign) > 3 else "")
    raise UsageError(f"{flag} {directory}: not empty and not a specparity output directory: "
                     f"{len(foreign)}{more} file(s) no specparity command wrote ({shown}); nothing was "
                     "moved or deleted: give a new or empty directory, or move them away")


def _remove_empty_parents(directory: Path, rels: list[str]) -> None:
    for rel in sorted(rels, key=lambda r: -r.count("/")):
        parent = (directory / rel).parent
        while parent != directory and directory in parent.parents:
            try:
                parent.rmdir()  # only an empty directory
            except OSError:
                break
            parent = parent.parent


def _previous_is_ours(prev: Path) -> bool:
    if not (prev.exists() or prev.is_symlink()):
        return True
    if prev.is_symlink() or not prev.is_dir():
        return False
    marker = _read_marker(prev)
    if marker is None:
        return False
    files, added = _listed(marker, prev)
    return not _foreign(prev, files | added)


def _delete_listed(directory: Path, rels: list[str]) -> None:
    for rel in rels:
        p = directory / rel
        if p.is_symlink() or p.is_file():
            p.unlink()
    _remove_empty_parents(directory, rels)


def _set_aside(directory: Path, marker: dict[str, Any] | None, files: set[str],
               flag: str) -> str | None:
    """Move the earlier run's outputs away (see the module doc); a line saying what happened."""
    present = [r for r in sorted(files) if (directory / r).exists() or (directory / r).is_symlink()]
    temps = [rel for rel in _inventory(directory) if _ours(rel, files) and rel not in files]
    if not present and not temps:
        return None
    prev = directory / PREVIOUS
    finished = marker is not None and marker.get("state") == "complete"
    prev_finished = (_read_marker(prev) or {}).get("state") == "complete" if prev.is_dir() else False
    _delete_listed(directory, temps)
    if not finished and prev_finished:
        _delete_listed(directory, present)
        return (f"the unfinished earlier run's {len(present)} file(s) removed; the last finished "
                f"run stays in {PREVIOUS}/ until this run completes")
    if prev.exists() or prev.is_symlink():
        if not _previous_is_ours(prev):
            raise UsageError(f"{flag} {directory}: {PREVIOUS}/ holds files no specparity run "
                             "wrote; move it away")
        shutil.rmtree(prev)
    prev.mkdir()
    for rel in present:
        (prev / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(directory / rel, prev / rel)
    old = dict(marker or {})
    old["files"], old["added"] = present, []
    atomic_write_json(prev / RUN_MARKER, old)
    _remove_empty_parents(directory, present)
    tops = sorted({r.split("/")[0] for r in present})
    what = "earlier run's" if finished else "unfinished earlier run's"
    return f"the {what} {', '.join(tops)} moved to {PREVIOUS}/ (removed when this run completes)"


@dataclass
class Claim:
    """A directory this process writes into; every file goes through :meth:`track` first."""

    directory: Path
    run_id: str
    command: str
    marker: dict[str, Any]
    kind: str = "F"  # "F": the run's own outputs, "A": added to someone's directory
    written: list[str] = field(default_factory=list)
    guard_existing: bool = False
    listed: set[str] = field(default_factory=set)
    stage: str = "starting"
    note: str = ""
    recognise: Callable[[Path], bool] | None = None

    def check(self, path: Path | str) -> Path:
        """Refuse (one line) to replace ``path`` if it exists and no specparity command wrote it."""
        p = Path(path)
        rel = self._rel(p)
        if self.guard_existing and p.is_symlink() and not (self.recognise and self.recognise(p)):
            raise UsageError(f"{p}: is a symbolic link; refusing to write through it to a file "
                             "specparity may not have written: remove the link")
        if (self.guard_existing and (p.exists() or p.is_symlink()) and rel not in self.listed
                and rel not in self.written and not (self.recognise and self.recognise(p))):
            raise UsageError(f"{p}: exists and was not written by specparity; refusing to "
                             "overwrite it: move it away or choose another directory")
        return p

    def _rel(self, path: Path | str) -> str:
        p = Path(path)
        rel = os.path.relpath(p.absolute(), self.directory.absolute())
        if rel == "." or rel.startswith(".."):
            raise ValueError(f"{p} is not under the output directory {self.directory}")
        return Path(rel).as_posix()

    def track(self, path: Path | str) -> Path:
        """Register ``path`` (under the directory) before it is written; create its parents."""
        p = Path(path)
        rel = self._rel(p)
        if rel in self.written:
            return p
        self.check(p)
        fd = os.open(self.directory / JOURNAL,  # O_NONBLOCK: a FIFO planted there fails, never blocks
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK, 0o644)
        try:
            os.write(fd, f"{self.kind} {rel}\n".encode())
        finally:
            os.close(fd)
        self.written.append(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def finish(self, state: str | None = "complete", **extra: Any) -> None:
        """Write the marker: the files listed, the state (``None``: unchanged)."""
        files, added = _listed(self.marker, self.directory)

        def present(rels: set[str]) -> list[str]:  # a refused or failed write lists nothing
            return sorted(r for r in rels
                          if (self.directory / r).exists() or (self.directory / r).is_symlink())

        self.marker["files"], self.marker["added"] = present(files), present(added - files)
        if state is not None:
            self.marker.update(state=state, finished=time.strftime("%Y-%m-%dT%H:%M:%S"), **extra)
        path = self.directory / RUN_MARKER
        if (path.exists() or path.is_symlink()) and (path.is_symlink() or not _regular(path)):
            path.unlink()  # our marker's name: never written through a link, FIFO or device
        atomic_write_json(path, self.marker)
        (self.directory / JOURNAL).unlink(missing_ok=True)


def track(path: Path | str) -> Path:
    """:meth:`Claim.track` on the innermost active claim holding ``path`` (else just mkdir)."""
    p = Path(path)
    for claim in reversed(_ACTIVE):
        if claim.directory.absolute() in p.absolute().parents:
            return claim.track(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def set_stage(path: Path | str, stage: str) -> None:
    """Say what the active claim of ``path`` is doing (named if it is interrupted)."""
    p = Path(path).absolute()
    for claim in reversed(_ACTIVE):
        if claim.directory.absolute() == p:
            claim.stage = stage


@contextlib.contextmanager
def claim_output_dir(path: Path | str, command: str, *, flag: str = "--out",
                     extra: dict[str, Any] | None = None) -> Iterator[Claim]:
    """Own ``path`` for one run: writable, locked, only our files in it, earlier run set aside.

    The marker's state is ``complete`` on a normal exit, ``failed`` when the
    block raises (an interrupt too), and stays ``running`` if the process is killed.
    """
    directory = prepare_dir(path, flag)
    run_id = uuid.uuid4().hex[:12]
    with DirLock(directory, command, flag=flag, what="run directory", run_id=run_id):
        marker = _read_marker(directory)
        files, added = _listed(marker, directory)
        files |= _owned_or_refuse(directory, marker, files, added, flag)
        note = _set_aside(directory, marker, files, flag)
        if note:
            print(f"specparity: {flag} {directory}: {note}", file=sys.stderr)
        kept = sorted(r for r in added if (directory / r).exists())
        claim = Claim(directory, run_id, command, {
            "run_id": run_id, "command": command, "pid": os.getpid(), "state": "running",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": [], "added": kept,
            **(extra or {})})
        (directory / JOURNAL).unlink(missing_ok=True)
        atomic_write_json(directory / RUN_MARKER, claim.marker)
        _ACTIVE.append(claim)
        try:
            yield claim
        except BaseException as exc:
            with contextlib.suppress(OSError):
                claim.finish("failed", error=f"{type(exc).__name__}: {exc}"[:500])
            kept_prev = (directory / PREVIOUS).exists()
            _NOTES.append(f"{directory}: " + (claim.note or f"stopped while {claim.stage}; the "
                                              "files written so far are kept, marked unfinished")
                          + (f"; the earlier run is kept in {PREVIOUS}/" if kept_prev else ""))
            if kept_prev and not isinstance(exc, KeyboardInterrupt):
                print(f"specparity: {flag} {directory}: this run did not complete; the earlier "
                      f"run's outputs are kept in {directory / PREVIOUS}/", file=sys.stderr)
            raise
        finally:
            _ACTIVE.remove(claim)
        claim.finish("complete")
        shutil.rmtree(directory / PREVIOUS, ignore_errors=True)


claim_run_dir = claim_output_dir
"""The name ``run`` and ``grade`` used before the ownership rules (same function)."""


@contextlib.contextmanager
def add_outputs(path: Path | str, command: str, *, flag: str = "--out",
                what: str = "output directory", run_output: bool = False,
                create: bool = True, own_folder: bool = False,
                recognise: Callable[[Path], bool] | None = None) -> Iterator[Claim]:
    """Write some named files into a directory (locked, listed in its marker).

    ``own_folder`` (``bench``, ``ab``, ``record --out``, ``regen --report``: the
    folder is the command's ``--out``): a folder holding any file no specparity
    command wrote is refused in one line, as :func:`claim_output_dir` refuses it
    (a run's folder is ours: the files are added beside the run's and a later run
    keeps them). Without it (``report DIR``, ``grade --engine/--serve --out``:
    files written beside what the folder holds), the folder may hold anything.
    Either way each file goes through :meth:`Claim.track`, which refuses one that
    exists and that no specparity command wrote; the files are then listed in the
    directory's marker (as the run's outputs with ``run_output``, e.g. a rebuilt
    report; else as added outputs that a later run keeps).
    """
    directory = prepare_dir(path, flag) if create else Path(path)
    if not create and not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {directory}: not writable; give a writable directory")
    with DirLock(directory, command, flag=flag, what=what):
        marker = _read_marker(directory)
        files, added = _listed(marker, directory)
        if own_folder:
            files |= _owned_or_refuse(directory, marker, files, added, flag)
        new = marker is None
        if marker is None:
            marker = {"command": command, "state": "outputs", "files": [], "added": []}
        claim = Claim(directory, str(marker.get("run_id") or ""), command, marker,
                      kind="F" if run_output else "A", guard_existing=True, listed=files | added,
                      recognise=recognise)
        _ACTIVE.append(claim)
        try:
            yield claim
        finally:
            _ACTIVE.remove(claim)
            if claim.written:
                with contextlib.suppress(OSError):
                    if new and not any((directory / r).exists() for r in claim.written):
                        (directory / JOURNAL).unlink(missing_ok=True)  # nothing of ours here
                    else:
                        claim.finish(None)


def refuse_unowned_file(path: Path, flag: str, what: str, ours: Callable[[Path], bool]) -> None:
    """One line (exit 2) if ``path`` is a non-empty regular file (a symlink's target counts)
    that ``ours`` does not recognise as a ``what`` specparity wrote."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_size > 0 and not ours(path):
        raise UsageError(f"{flag} {path}: exists and is not a {what} written by specparity; refusing "
                         "to overwrite it: give a new file name")


@contextlib.contextmanager
def claim_output_file(path: Path | str, command: str, *, flag: str, what: str,
                      ours: Callable[[Path], bool]) -> Iterator[Path]:
    """Own one output file (``generate``/``record --trace FILE``, ``audit --json FILE``).

    The same rules as a directory's, for one file: its lock is
    ``DIR/.NAME.specparity.lock`` (:data:`FILE_LOCK`; a second writer of the same
    file is refused naming the holder), its ownership marker is its own content (a
    trace header, an audit's ``"kind": "audit"``): an existing file that is not
    recognisably ours is refused in one line before any work and again when the
    lock is taken (it may have appeared since), never overwritten. A symlink's
    target is what is replaced (the link is kept); a device or FIFO
    (``/dev/null``, ``/dev/stdout``) is written in place, with no lock.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise UsageError(f"{flag} {p}: cannot access ({exc.strerror})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{flag} {p}: is a directory; give a file path")
        yield p  # a device or FIFO: written in place
        return
    real = p.resolve() if p.is_symlink() else p
    refuse_unowned_file(p, flag, what, ours)
    parent = real.parent  # writable: checked by the flag's type (specparity.cli.args.writable_file)
    parent.mkdir(parents=True, exist_ok=True)
    with DirLock(parent, command, flag=flag, what=what, name=FILE_LOCK.format(real.name), shown=p):
        refuse_unowned_file(p, flag, what, ours)
        yield p


def lock_dir(path: Path | str, command: str, *, flag: str, what: str) -> DirLock:
    """:class:`DirLock` on an existing-or-created, writable directory (e.g. a golden dir)."""
    directory = prepare_dir(path, flag)
    return DirLock(directory, command, flag=flag, what=what)


def output_dir_arg(text: str) -> Path:
    """An argparse type for a lower layer's output folder flag (``zoo`` builders): not a file,
    and writable or creatable; the ownership rules are checked by :func:`add_outputs` before
    the work. (The CLI's flags use ``specparity.cli.args.writable_dir``, the same checks.)"""
    import argparse

    p = Path(text).expanduser()
    q = p.absolute()
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a directory; give a directory")
    while not q.exists() and q != q.parent:
        q = q.parent
    if not q.is_dir() or not os.access(q, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: not writable ({q}); give a writable directory")
    return p


output_dir_arg.output = "dir"  # type: ignore[attr-defined]  # a writing flag (MODULE_WRITERS)


def publish_tree(claim: Claim, src: Path, dest: Path) -> list[Path]:
    """Copy every file of a directory built elsewhere (a temp dir) to ``dest`` under ``claim``:
    each registered (:meth:`Claim.track`: refused if it would replace a file no specparity
    command wrote) before it is written atomically. The files written, in order."""
    out = []
    for f in sorted(Path(src).rglob("*")):
        if f.is_file() and not f.is_symlink():
            target = claim.track(Path(dest) / f.relative_to(src))
            atomic_write_bytes(target, f.read_bytes())
            out.append(target)
    return out
