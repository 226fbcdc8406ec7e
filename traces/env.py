"""The one reader of ``SPECPARITY_*`` environment variables.

Every variable specparity reads is declared once in :data:`VARIABLES` (its
kind, its default, what it does) and read through :func:`get`, which parses
it by its kind and refuses a malformed value with ONE line naming the
variable, its value and what is expected (:class:`EnvError`, a ``ValueError``:
the CLI prints it as a usage error, exit 2), e.g.::

    SPECPARITY_PROGRESS_INTERVAL='fast': expected a number of seconds > 0, e.g. 20 (unset it or fix it)
    SPECPARITY_ZOO_DIR='/etc/passwd': exists and is not a directory (unset it or give a directory)
    SPECPARITY_ZOO_DIR='~nosuchuser/zoo': cannot expand '~nosuchuser': no such user (unset it or fix it)

:func:`check_all` parses every variable that is set; the CLI calls it before
any command runs, so a typo is refused before any work, never a traceback
from deep inside it (a module-level ``float(os.environ[...])`` at import time).

This module lives in ``traces`` because every layer (``traces.io``,
``engine``, ``zoo``, ``specparity``) reads one of them and ``traces`` is the
bottom layer (``pyproject.toml`` import contracts). No reference is mirrored.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["VARIABLES", "EnvError", "Variable", "check_all", "get", "user_path"]


class EnvError(ValueError):
    """A ``SPECPARITY_*`` variable holds a value specparity cannot use (one line naming it)."""


def _fail(name: str, value: str, what: str, fix: str = "unset it or fix it") -> EnvError:
    shown = value if len(value) <= 80 else f"{value[:40]}...{value[-30:]}"
    return EnvError(f"{name}={shown!r}: {what} ({fix})")


def user_path(text: str, name: str) -> Path:
    """``text`` as a path: ``~``/``~user`` expanded (an unknown user is one line), no NUL."""
    if "\x00" in text:
        raise _fail(name, text, "a path cannot contain a NUL byte")
    p = Path(text)
    if text.startswith("~"):
        try:
            p = p.expanduser()
        except RuntimeError:
            raise _fail(name, text, f"cannot expand {text.split('/', 1)[0]!r}: no such user "
                                    "(or no home directory)") from None
    return p


def _number(name: str, text: str, *, integer: bool, minimum: float, strict: bool, example: str,
            unit: str, maximum: float | None = None) -> float:
    try:
        v: float = int(text) if integer else float(text)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise _fail(name, text, f"expected {kind}{unit}, e.g. {example}") from None
    if not math.isfinite(v):
        raise _fail(name, text, f"must be a finite number{unit}, e.g. {example}")
    if v < minimum or (strict and v == minimum):
        raise _fail(name, text, f"must be {'>' if strict else '>='} {minimum:g}, e.g. {example}")
    if maximum is not None and v > maximum:
        raise _fail(name, text, f"must be <= {maximum:g}, e.g. {example}")
    return v


@dataclass(frozen=True)
class Variable:
    """One ``SPECPARITY_*`` variable: how its text is parsed (``parse(name, text)``), its default."""

    name: str
    parse: Callable[[str, str], Any]
    default: Any
    doc: str


def _flag(name: str, text: str) -> bool:
    v = text.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise _fail(name, text, "expected 0 or 1")


def _positive_bytes(name: str, text: str) -> int:
    return int(_number(name, text.strip(), integer=True, minimum=1024, strict=False,
                       example=str(4 << 20), unit=" of bytes", maximum=1 << 40))


def _seconds(name: str, text: str) -> float:
    return _number(name, text.strip(), integer=False, minimum=0.0, strict=True, example="20",
                   unit=" of seconds > 0", maximum=1e9)


def _tolerance(name: str, text: str) -> float:
    return _number(name, text.strip(), integer=False, minimum=0.0, strict=False, example="1e-6",
                   unit=" >= 0", maximum=1.0)


def _directory(name: str, text: str) -> Path | None:
    """A directory specparity may create: absent, or an existing directory (never a file)."""
    if not text.strip():
        return None
    p = user_path(text, name)
    try:
        st = p.stat()
    except FileNotFoundError:
        q = p.absolute().parent
        while not q.exists() and q != q.parent:
            q = q.parent
        if not q.is_dir():
            raise _fail(name, text, f"cannot be created ({q} is not a directory)",
                        "unset it or give a directory") from None
        return p
    except OSError as exc:
        raise _fail(name, text, f"cannot access ({exc.strerror})") from None
    import stat as st_mod

    if not st_mod.S_ISDIR(st.st_mode):
        raise _fail(name, text, "exists and is not a directory", "unset it or give a directory")
    return p


def _existing_dir(name: str, text: str) -> Path | None:
    if not text.strip():
        return None
    p = user_path(text, name)
    if not p.is_dir():
        raise _fail(name, text, "no such directory", "unset it or give an existing directory")
    return p


def _nonexact(name: str, text: str) -> tuple[float, int, float] | None:
    """``SCALE[:SEED[:KV_SCALE]]`` (``engine.nonexact.from_env``)."""
    v = text.strip()
    if not v:
        return None
    scale_s, _, rest = v.partition(":")
    seed_s, _, kv_s = rest.partition(":")
    example = "0.01, 0.01:7 or 0.01:7:0.001"
    try:
        scale, seed, kv = float(scale_s), int(seed_s or 0), float(kv_s or 0)
    except ValueError:
        raise _fail(name, text, f"expected SCALE[:SEED[:KV_SCALE]], e.g. {example}") from None
    if not (math.isfinite(scale) and math.isfinite(kv)) or scale < 0 or kv < 0 or seed < 0:
        raise _fail(name, text, f"SCALE and KV_SCALE must be finite numbers >= 0 and SEED an "
                                f"integer >= 0, e.g. {example}")
    return scale, seed, kv


def _missing_op(name: str, text: str) -> str | None:
    v = text.strip()
    if not v:
        return None
    if v != "quantized_matmul":
        raise _fail(name, text, "the one emulated missing op is 'quantized_matmul'")
    return v


def _text(name: str, text: str) -> str | None:
    return text or None  # free text (an environment value cannot hold a NUL)


def _crash_seed(name: str, text: str) -> int:
    return int(_number(name, text.strip(), integer=True, minimum=0, strict=False, example="7",
                       unit=""))


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("SPECPARITY_DEBUG", _flag, False, "1: Python tracebacks instead of one-line errors"),
    Variable("SPECPARITY_PROGRESS", lambda n, t: _flag(n, t or "1"), True,
             "0: no progress lines"),
    Variable("SPECPARITY_PROGRESS_INTERVAL", _seconds, 20.0,
             "seconds between plain progress lines (logs, pipes)"),
    Variable("SPECPARITY_MAX_LINE_BYTES", _positive_bytes, 4 << 20,
             "longest trace line read (bytes)"),
    Variable("SPECPARITY_ZOO_DIR", _directory, None,
             "where the zoo's models are built (default ~/.cache/specparity/zoo)"),
    Variable("SPECPARITY_CACHE_DIR", _directory, None,
             "digest and grammar caches (default ~/.cache/specparity)"),
    Variable("SPECPARITY_WITNESS_TOL", _tolerance, 1e-6,
             "replayed vs recorded margins a numerics witness accepts"),
    Variable("SPECPARITY_EMULATE_NONEXACT", _nonexact, None,
             "SCALE[:SEED[:KV_SCALE]]: emulate a backend that is not bit-exact"),
    Variable("SPECPARITY_EMULATE_MISSING_OP", _missing_op, None,
             "quantized_matmul: emulate a backend lacking that op"),
    # the served-engine checks' variables (read in specparity/grading/http_servers.py, subjects/served/,
    # tests/fake_server.py): checked here at start-up like the others
    Variable("SPECPARITY_SERVER_BIN", _existing_dir, None, "where served engines' executables are"),
    Variable("SPECPARITY_SERVER_API_KEY", _text, None, "API key sent to a served engine"),
    Variable("SPECPARITY_FAKE_SERVER_BUG", _text, None, "the fake server's planted bug"),
    # the test suite's own knobs (tests/, conftest.py)
    Variable("SPECPARITY_PROMPTS", _text, None, "tests: 'all' runs the whole matrix"),
    Variable("SPECPARITY_CRASH_SEED", _crash_seed, None, "tests: replay a crash-test kill point"),
    Variable("SPECPARITY_CRASH_SWEEP", _flag, False, "tests: the slow crash sweep"),
)}


_UNSET: Any = object()


def get(name: str, default: Any = _UNSET) -> Any:
    """The parsed value of ``name``; unset (or empty where the kind allows it): ``default``,
    else its declared default. :class:`EnvError` if malformed."""
    var = VARIABLES[name]
    fallback = var.default if default is _UNSET else default
    text = os.environ.get(name)
    if text is None:
        return fallback
    value = var.parse(name, text)
    return fallback if value is None else value


def check_all() -> None:
    """Parse every declared variable that is set (the CLI's start-up check)."""
    for name in VARIABLES:
        get(name)
