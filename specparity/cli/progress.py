"""Progress for long work: a tqdm bar on a terminal, plain periodic lines elsewhere.

``tqdm(disable=None)`` prints nothing when stderr is not a TTY, so a CI log
showed minutes of silence. :func:`progress` returns a tqdm bar when stderr is a
terminal and otherwise a :class:`PlainProgress` that prints one line such as
``run: 12/240 cases (5%), 34 s elapsed, ~10 min left`` at the start, every
``SPECPARITY_PROGRESS_INTERVAL`` seconds (default 20) and at the end.
``SPECPARITY_PROGRESS=0`` silences both. Same ``update(n)`` / context-manager
interface as tqdm, so callers do not care which one they got.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _fmt(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class PlainProgress:
    """Periodic plain-text progress lines (for logs and pipes)."""

    def __init__(self, total: int, desc: str, unit: str = "item", *, file: TextIO | None = None,
                 interval: float | None = None) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.file = file if file is not None else sys.stderr
        from traces import env

        self.interval = interval if interval is not None else float(env.get("SPECPARITY_PROGRESS_INTERVAL"))
        self.n = 0
        self.t0 = self.last = time.monotonic()
        self._line()

    def _line(self) -> None:
        elapsed = time.monotonic() - self.t0
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        eta = ""
        if 0 < self.n < self.total:
            eta = f", ~{_fmt(elapsed / self.n * (self.total - self.n))} left"
        print(f"{self.desc}: {self.n}/{self.total} {self.unit}s{pct}, {_fmt(elapsed)} elapsed{eta}",
              file=self.file, flush=True)
        self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self.total or time.monotonic() - self.last >= self.interval:
            self._line()

    def close(self) -> None:
        if self.n < self.total:
            self._line()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Silent:
    def update(self, n: int = 1) -> None:
        return None

    def close(self) -> None:
        return None

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def progress(total: int, desc: str, unit: str = "item", *, file: TextIO | None = None) -> Any:
    """A progress reporter for ``total`` units: tqdm on a TTY, plain lines otherwise."""
    stream = file if file is not None else sys.stderr
    from traces import env

    if not env.get("SPECPARITY_PROGRESS"):
        return _Silent()
    isatty = getattr(stream, "isatty", lambda: False)
    if isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True)
    return PlainProgress(total, desc, unit, file=stream)


class Progress:
    """``with Progress(total, desc, enabled=...) as bar: bar.update(1)`` over :func:`progress`."""

    def __init__(self, total: int, desc: str, unit: str = "case", *, enabled: bool = True,
                 file: TextIO | None = None) -> None:
        self._impl = progress(total, desc, unit, file=file) if enabled else _Silent()

    def update(self, n: int = 1) -> None:
        self._impl.update(n)

    def close(self) -> None:
        self._impl.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._impl.close()
