"""Pinned zoo artifacts in the cache dir: atomic build, then verify once per file state.

:func:`artifact` is the one getter of the seeded models (``zoo.model_dir``), the MTP/assistant
heads (``zoo.heads.head_dir``), the native-MTP checkpoints (``zoo.native_mtp.model_dir``) and
the DSpark/DeepSpec drafters (``zoo.dspark.artifact_dir``); :func:`check_digests` compares
files with their pinned sha256 (also for the committed trained pair, ``zoo.train``). An
artifact is built into a temp dir
beside its final name and renamed into place (a killed build leaves nothing
under the final name; a concurrent build's result is kept), then its files
are checked against the pinned digests. Concurrent builders (parallel test workers) take a
file lock beside the artifact, so one builds and the others wait for its result. The check is repeated whenever a
file's size, mtime or inode changes, so tampering after a build is caught.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

MARKER = "model.safetensors"

_LOCK = threading.RLock()
_VERIFIED: dict[str, tuple[Any, ...]] = {}


def clear() -> None:
    """Forget which artifact dirs this process has verified."""
    with _LOCK:
        _VERIFIED.clear()


def stamp(d: Path, files: Sequence[str]) -> tuple[Any, ...]:
    """Size, mtime and inode of each file (raises FileNotFoundError when one is missing)."""
    out: list[Any] = []
    for f in files:
        st = (d / f).stat()
        out.append((f, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


@contextlib.contextmanager
def _build_lock(root: Path, dirname: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``root/.dirname.lock`` across processes (parallel test workers,
    two runs at once): one builds, the others wait and find its result. Where ``fcntl`` is
    missing the atomic rename below still keeps a concurrent build safe (only slower)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    root.mkdir(parents=True, exist_ok=True)
    lock = root / f".{dirname}.lock"
    with open(lock, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if (root / dirname / MARKER).exists():  # built: waiters holding this inode find it;
                lock.unlink(missing_ok=True)  # nothing is left beside the artifact
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def build(root: Path, dirname: str, write: Callable[[Path], Any]) -> Path:
    """``root/dirname``, written by ``write(tmp_dir)`` and renamed into place if absent."""
    d = root / dirname
    if (d / MARKER).exists():
        return d
    with _LOCK, _build_lock(root, dirname):
        if (d / MARKER).exists():  # built by another process while we waited
            return d
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dirname}.tmp-", dir=root))
        try:
            write(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes 0700
            if d.exists() and not (d / MARKER).exists():
                shutil.rmtree(d)  # a stale dir without weights (never left by us)
            try:
                os.rename(tmp, d)
            except OSError:  # another process won the race: keep theirs
                if not (d / MARKER).exists():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return d


def verify_once(
    d: Path,
    files: Sequence[str],
    verify: Callable[[], None],
    missing: Callable[[FileNotFoundError], Exception],
) -> None:
    """Run ``verify()`` unless ``d``'s ``files`` are unchanged since it last passed."""
    with _LOCK:
        try:
            st = stamp(d, files)
        except FileNotFoundError as exc:
            raise missing(exc) from exc
        key = str(d.resolve())
        if _VERIFIED.get(key) != st:
            verify()
            _VERIFIED[key] = st


def artifact(
    root: Path,
    dirname: str,
    write: Callable[[Path], Any],
    files: Sequence[str] | Callable[[Path], Sequence[str]],
    verify: Callable[[Path], None],
    drift: Callable[[str], Exception],
) -> Path:
    """The pinned artifact ``root/dirname``: built by ``write(tmp_dir)`` when absent
    (:func:`build`), then ``verify(d)`` once per state of its ``files`` (a list, or a function
    of the built dir) (:func:`verify_once`). A missing file raises
    ``drift("missing file in D: ...")``; ``drift`` turns a message into the caller's error."""
    d = build(root, dirname, write)
    names = files(d) if callable(files) else files
    verify_once(d, names, lambda: verify(d), lambda exc: drift(f"missing file in {d}: {exc}"))
    return d


def check_digests(
    d: Path,
    entry: Mapping[str, Any],
    checks: Sequence[tuple[str, str, Callable[[], str]]],
    drift: Callable[[str], Exception],
    advice: str,
) -> None:
    """Each ``(file name, manifest key, digest function)`` of ``checks`` against ``entry[key]``;
    an unreadable file is drift too. Raises ``drift(message)``; ``advice`` ends a mismatch's."""
    for fname, key, compute in checks:
        try:
            got = compute()
        except Exception as exc:  # unreadable/corrupt file is drift too
            raise drift(f"{fname} in {d} unreadable ({exc}); expected sha256 {entry[key]}") from exc
        if got != entry[key]:
            raise drift(f"{fname} in {d} has sha256 {got}, manifest expects {entry[key]} ({advice})")
