"""Reading and writing specparity JSONL traces (schema_version 1).

A trace file holds one JSON object per line: a ``header``, then ``prefill`` /
``round`` / ``plain`` events, then a ``footer``.  :class:`TraceWriter` writes a
trace atomically (temp file + ``os.replace``) so a crashed run never leaves a
truncated file under the final name.  :func:`iter_records` streams records
with their line numbers; :func:`read_trace` loads a whole file into a
:class:`Trace`.

Hostile input is bounded here, once, for every reader: :func:`iter_lines`
reads at most :data:`MAX_LINE_BYTES` per line (``SPECPARITY_MAX_LINE_BYTES``
overrides), refuses non-regular files (``/dev/zero``, FIFOs), non-UTF-8 lines
and over-deep JSON nesting with a ``FILE:LINE`` error, and never holds more than
one line in memory. Every published file (traces and the atomic text/JSON
writers :func:`atomic_write_text` / :func:`atomic_write_json` used by the
reports and jobs) is written to a hidden temp file, fsynced and renamed, with
the mode an ordinary ``open()`` would give (``0666 & ~umask``, not mkstemp's
``0600``).

Full validation (schema + cross-record invariants) lives in
:mod:`traces.validate`; this module only checks what it needs to do its job.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "RECORD_TYPES",
    "SCHEMA_VERSION",
    "Record",
    "Trace",
    "TraceFormatError",
    "TraceWriter",
    "InputFileError",
    "MAX_INPUT_BYTES",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "dumps_record",
    "iter_lines",
    "loads_line",
    "iter_records",
    "read_trace",
    "regular_file",
    "write_trace",
]

SCHEMA_VERSION = 1
"""The trace schema version this module reads and writes."""

RECORD_TYPES = frozenset({"header", "prefill", "round", "plain", "footer"})
"""Every valid value of a record's ``"type"`` field."""

Record = dict[str, Any]
"""One decoded trace line."""

MAX_LINE_BYTES = 4 << 20
"""Longest trace line read (bytes) unless ``SPECPARITY_MAX_LINE_BYTES`` says otherwise
(:func:`line_limit`). A header with a 100k-token prompt is < 1 MiB."""


def line_limit() -> int:
    """The longest trace line read: ``SPECPARITY_MAX_LINE_BYTES`` (``traces.env``) or
    :data:`MAX_LINE_BYTES`."""
    from traces import env

    return int(env.get("SPECPARITY_MAX_LINE_BYTES", MAX_LINE_BYTES))


MAX_INPUT_BYTES = 256 << 20
"""Input files read whole (prompts, suites, configs, tokenizer files) above this are refused."""


class InputFileError(ValueError):
    """A user's input file is missing, not a regular file, or too large (one line naming it)."""


def regular_file(path: str | os.PathLike[str], *, max_bytes: int | None = MAX_INPUT_BYTES,
                 what: str = "") -> Path:
    """``path`` if it is an existing regular file of at most ``max_bytes`` (None: any size).

    The one bounded regular-file check of every read of a user's file (traces,
    prompts files, suites, ``config.json``, tokenizer files, weights): a FIFO
    would block ``open()`` forever and ``/dev/zero`` would be read forever, so
    both are refused by ``stat`` before anything opens them.

    Raises:
        InputFileError: naming ``what`` (e.g. ``"prompts file"``) and the path.
    """
    name = f"{what} {path}" if what else str(path)
    if "\x00" in os.fspath(path):
        raise InputFileError(f"{name!r}: a path cannot contain a NUL byte")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputFileError(f"{name}: no such file") from None
    except OSError as exc:
        raise InputFileError(f"{name}: cannot access ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError(f"{name}: not a regular file (a device, FIFO or directory)")
    if max_bytes is not None and st.st_size > max_bytes:
        raise InputFileError(f"{name}: {st.st_size} bytes is too large (limit {max_bytes})")
    return Path(path)


def _destination(path: str | os.PathLike[str]) -> tuple[Path, bool]:
    """``(where to publish, atomically?)``.

    A symlink is followed (the link stays, its target is replaced); an existing
    non-regular file (``/dev/stdout``, ``/dev/null``, a FIFO) is written in
    place, never renamed over: replacing a device node would destroy it.
    """
    p = Path(path)
    if p.is_symlink():
        p = Path(os.path.realpath(p))
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return p, True
    return p, stat.S_ISREG(st.st_mode)


def _file_mode() -> int:
    """The mode ``open(path, "w")`` would create: 0666 minus the process umask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


class TraceFormatError(ValueError):
    """A trace file (or in-memory record list) cannot be parsed into a trace.

    Attributes:
        path: File the problem is in (``"<memory>"`` for in-memory traces).
        line_no: 1-based line number, or ``None`` when it concerns the whole file.
        message: What is wrong.
    """

    def __init__(self, path: str | os.PathLike[str], line_no: int | None, message: str) -> None:
        self.path = str(path)
        self.line_no = line_no
        self.message = message
        where = f"{self.path}:{line_no}" if line_no is not None else self.path
        super().__init__(f"{where}: {message}")


def _json_default(obj: Any) -> Any:
    """Convert numpy / mlx scalars and arrays (anything with ``tolist``)."""
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


def dumps_record(record: Record) -> str:
    """Serialise one record as a single strict-JSON line (no trailing newline).

    Args:
        record: The record; numpy/mlx values are converted with ``tolist()``.

    Returns:
        Compact JSON text.

    Raises:
        ValueError: If the record holds NaN or infinity (not valid JSON).
        TypeError: If it holds something that is not JSON serialisable.
    """
    return json.dumps(record, separators=(",", ":"), allow_nan=False, default=_json_default)


def _check_shape(record: Any) -> str:
    """Cheap shape check: a dict with a known ``type``. Returns the type."""
    if not isinstance(record, dict):
        raise TypeError(f"trace record must be a dict, got {type(record).__name__}")
    rtype = record.get("type")
    if rtype not in RECORD_TYPES:
        raise ValueError(f"trace record has unknown type {rtype!r}; expected one of {sorted(RECORD_TYPES)}")
    return str(rtype)


class TraceWriter:
    """Atomic, streaming trace writer (a context manager).

    Records go to a hidden temp file in the destination directory.  On a clean
    exit the file is flushed, fsynced and renamed over ``path``; if the block
    raises (or the trace has no footer) the temp file is deleted and ``path`` is
    neither created nor touched.

    Example:
        >>> with TraceWriter("run.jsonl") as w:  # doctest: +SKIP
        ...     w.write(header)
        ...     w.write(footer)

    Args:
        path: Final destination of the trace.
        require_footer: Refuse to publish a trace whose last record is not a footer.
    """

    def __init__(self, path: str | os.PathLike[str], *, require_footer: bool = True) -> None:
        self.path = Path(path)
        self.require_footer = require_footer
        self._fh: Any = None
        self._tmp: Path | None = None
        self._count = 0
        self._closed = False
        self._saw_footer = False

    def __enter__(self) -> TraceWriter:
        self.path, atomic = _destination(self.path)
        if not atomic:  # a device or FIFO: stream into it (see _destination)
            self._fh = open(self.path, "w", encoding="utf-8", newline="\n")  # noqa: SIM115
            self._tmp = None
            return self
        directory = self.path.parent
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{self.path.name}.", suffix=".tmp")
        os.fchmod(fd, _file_mode())
        self._tmp = Path(tmp)
        self._fh = os.fdopen(fd, "w", encoding="utf-8", newline="\n")
        return self

    def write(self, record: Record) -> None:
        """Append one record.

        Args:
            record: A dict with a known ``"type"``.  The first record must be the
                header and nothing may follow the footer.

        Raises:
            TypeError / ValueError: On a malformed record or out-of-order write.
            RuntimeError: If the writer is not open.
        """
        if self._fh is None or self._closed:
            raise RuntimeError("TraceWriter is not open (use it as a context manager)")
        rtype = _check_shape(record)
        if self._count == 0 and rtype != "header":
            raise ValueError(f"first trace record must be the header, got {rtype!r}")
        if self._count > 0 and rtype == "header":
            raise ValueError("header written twice")
        if self._saw_footer:
            raise ValueError(f"{rtype!r} record written after the footer")
        line = dumps_record(record)
        if len(line.encode("utf-8")) > line_limit():  # never a trace the validator would refuse
            raise ValueError(f"{rtype} record of {len(line.encode('utf-8'))} bytes is longer than a "
                             f"trace line may be ({line_limit()} bytes; SPECPARITY_MAX_LINE_BYTES)")
        self._fh.write(line)
        self._fh.write("\n")
        self._count += 1
        self._saw_footer = rtype == "footer"

    def _discard(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            finally:
                self._fh = None
        if self._tmp is not None:
            try:
                self._tmp.unlink()
            except FileNotFoundError:
                pass
            self._tmp = None
        self._closed = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self._discard()
            return
        if self.require_footer and not self._saw_footer:
            self._discard()
            raise TraceFormatError(self.path, None, "trace closed without a footer; not written")
        assert self._fh is not None
        if self._tmp is None:  # streamed into a device/FIFO
            self._fh.close()
            self._fh = None
            self._closed = True
            return
        try:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None
            os.replace(self._tmp, self.path)
            self._tmp = None
        except BaseException:
            self._discard()
            raise
        self._closed = True
        _fsync_dir(self.path.parent)


def _fsync_dir(directory: Path) -> None:
    """Best-effort fsync of a directory so the rename is durable."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Publish ``data`` at ``path`` atomically: hidden temp file, fsync, rename.

    A crash or a full disk leaves either the old file or none under ``path``,
    never a partial or 0-byte one; the temp file is removed on failure.
    """
    path, atomic = _destination(path)
    if not atomic:  # a device or FIFO: write in place (see _destination)
        with open(path, "wb") as out:
            out.write(data)
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _file_mode())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """:func:`atomic_write_bytes` of UTF-8 ``text``."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _nan_to_null(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: _nan_to_null(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_nan_to_null(v) for v in obj]
    return obj


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 1,
                      sort_keys: bool = False, nan_as_null: bool = False) -> None:
    """Strict JSON, published atomically.

    NaN/inf are refused before anything is written, or written as ``null``
    with ``nan_as_null`` (measurements whose statistic is undefined).
    """
    if nan_as_null:
        obj = _nan_to_null(obj)
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, allow_nan=False,
                      default=_json_default, ensure_ascii=False)
    atomic_write_text(path, text + "\n")


def write_trace(path: str | os.PathLike[str], records: Iterable[Record]) -> None:
    """Write ``records`` to ``path`` atomically with :class:`TraceWriter`.

    Args:
        path: Destination file.
        records: Header first, footer last.
    """
    with TraceWriter(path) as writer:
        for record in records:
            writer.write(record)


def iter_lines(path: str | os.PathLike[str], *,
               max_line_bytes: int | None = None) -> Iterator[tuple[int, str]]:
    """Stream the lines of a text file with bounded memory.

    Yields:
        ``(line_no, text)`` with 1-based line numbers (newline stripped).

    Raises:
        TraceFormatError: On a non-regular file, a line longer than
            ``max_line_bytes`` (default :data:`MAX_LINE_BYTES`) or a line that is
            not UTF-8. The file is never read past the offending line.
        OSError: If the file cannot be opened.
    """
    limit = line_limit() if max_line_bytes is None else max_line_bytes
    if not stat.S_ISREG(os.stat(path).st_mode):  # before open(): a FIFO would block there
        raise TraceFormatError(path, None, "not a regular file (a device, FIFO or directory); "
                                           "give a trace file")
    with open(path, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise TraceFormatError(path, None, "not a regular file (a device, FIFO or directory); "
                                               "give a trace file")
        line_no = 0
        while True:
            raw = fh.readline(limit + 1)
            if not raw:
                return
            line_no += 1
            if len(raw) > limit:
                raise TraceFormatError(
                    path, line_no, f"line longer than {limit} bytes; refused (a trace line is a "
                    "few KiB; raise SPECPARITY_MAX_LINE_BYTES if this is a genuine trace)")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise TraceFormatError(path, line_no, f"not UTF-8 text (byte {err.start}): "
                                                      "is this a trace file?") from None
            yield line_no, text.rstrip("\r\n")


def loads_line(path: str | os.PathLike[str], line_no: int, text: str) -> Any:
    """``json.loads`` of one line, every failure as a ``FILE:LINE`` :class:`TraceFormatError`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise TraceFormatError(path, line_no, f"invalid JSON: {err.msg} (column {err.colno})") from None
    except RecursionError:
        raise TraceFormatError(path, line_no, "JSON nested too deeply; refused") from None


def iter_records(path: str | os.PathLike[str]) -> Iterator[tuple[int, Record]]:
    """Stream the records of a trace file (bounded lines, see :func:`iter_lines`).

    Blank lines are skipped.  Records are not validated beyond being JSON
    objects.

    Args:
        path: The JSONL file.

    Yields:
        ``(line_no, record)`` with 1-based line numbers.

    Raises:
        TraceFormatError: On a line that is not a JSON object (or is refused
            by :func:`iter_lines`).
        OSError: If the file cannot be opened.
    """
    for line_no, line in iter_lines(path):
        if not line.strip():
            continue
        record = loads_line(path, line_no, line)
        if not isinstance(record, dict):
            raise TraceFormatError(path, line_no, f"expected a JSON object, got {type(record).__name__}")
        yield line_no, record


@dataclass
class Trace:
    """A parsed trace.

    Attributes:
        header: The header record.
        prefill: The prefill record, or ``None``.
        rounds: ``round`` records in file order.
        plains: ``plain`` records in file order.
        footer: The footer record.
        events: ``round`` and ``plain`` records interleaved in file order.
        path: Where it was read from (``None`` for in-memory traces).
    """

    header: Record
    prefill: Record | None
    rounds: list[Record]
    plains: list[Record]
    footer: Record
    events: list[Record] = field(default_factory=list)
    path: str | None = None

    @classmethod
    def from_records(cls, records: Iterable[Record], *, path: str | None = None) -> Trace:
        """Build a trace from records in file order.

        Args:
            records: Header, optional prefill, events, footer.
            path: Optional source name used in error messages.

        Returns:
            The trace.

        Raises:
            TraceFormatError: On unknown types or a missing / duplicated /
                misplaced header, prefill or footer.
        """
        where = path or "<memory>"
        header: Record | None = None
        prefill: Record | None = None
        footer: Record | None = None
        events: list[Record] = []
        for i, record in enumerate(records, start=1):
            try:
                rtype = _check_shape(record)
            except (TypeError, ValueError) as err:
                raise TraceFormatError(where, i, str(err)) from err
            if footer is not None:
                raise TraceFormatError(where, i, f"{rtype!r} record after the footer")
            if rtype == "header":
                if i != 1:
                    raise TraceFormatError(where, i, "header is not the first record")
                header = record
            elif header is None:
                raise TraceFormatError(where, i, "first record is not a header")
            elif rtype == "prefill":
                if prefill is not None or events:
                    raise TraceFormatError(where, i, "prefill must appear once, before any round/plain")
                prefill = record
            elif rtype == "footer":
                footer = record
            else:
                events.append(record)
        if header is None:
            raise TraceFormatError(where, None, "empty trace (no header)")
        if footer is None:
            raise TraceFormatError(where, None, "trace has no footer")
        return cls(
            header=header,
            prefill=prefill,
            rounds=[e for e in events if e["type"] == "round"],
            plains=[e for e in events if e["type"] == "plain"],
            footer=footer,
            events=events,
            path=path,
        )

    def records(self) -> list[Record]:
        """All records in file order (header, prefill, events, footer)."""
        out: list[Record] = [self.header]
        if self.prefill is not None:
            out.append(self.prefill)
        out.extend(self.events)
        out.append(self.footer)
        return out

    @property
    def eos_ids(self) -> list[int]:
        """The header's EOS token ids."""
        return list(self.header.get("eos_ids", []))

    @property
    def output_ids(self) -> list[int]:
        """The footer's output token ids."""
        return list(self.footer.get("output_ids", []))

    def label(self) -> str:
        """Short human label: path, else ``runner.name/case_id``."""
        if self.path:
            return self.path
        runner = self.header.get("runner") or {}
        return f"{runner.get('name', '?')}/{self.header.get('case_id', '?')}"


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a whole trace file.

    Args:
        path: The JSONL file.

    Returns:
        The parsed :class:`Trace` (not schema-validated; see :mod:`traces.validate`).

    Raises:
        TraceFormatError: On bad JSON or a structurally broken file.
        OSError: If the file cannot be read.
    """
    lines: list[int] = []
    records: list[Record] = []
    for line_no, record in iter_records(path):
        lines.append(line_no)
        records.append(record)
    try:
        return Trace.from_records(records, path=str(path))
    except TraceFormatError as err:
        # Map the record ordinal back to the real line number.
        line = lines[err.line_no - 1] if err.line_no is not None else None
        raise TraceFormatError(path, line, err.message) from None
