"""Validated ``argparse`` types shared by every ``specparity`` command.

Each type turns a bad value into one ``argparse.ArgumentTypeError`` line that
says what was expected (argparse names the flag), so no command sees a NaN
temperature, a negative seed, an absurd token budget or a file it cannot read.
Checks here are syntax-level; what needs a model (prompt ids against the
vocabulary, context length) is checked where the model is loaded
(``specparity/cases/prompts.py``) with the same error classes.

Error classes the CLI boundary (``specparity/cli/entry.py``) maps to exit statuses:
:class:`UsageError` (exit 2: the user's input is wrong) and :class:`RunFailed`
(exit 1: the input was fine, the run could not complete).
"""

from __future__ import annotations

import argparse
import math
import os
import stat
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import traces.io as _io
import traces.records as _records
from traces.outdir import UsageError  # bad input: exit 2 (one class for every layer)

MAX_TOKENS_LIMIT = 1_000_000
"""``--max-tokens`` above this is refused (no model here has that context)."""
MAX_TOKENS_WARN = 32_768
"""``--max-tokens`` above this is accepted with a warning on stderr."""


class RunFailed(RuntimeError):
    """Valid input, but the run could not complete (a model produced NaN, ...): exit 1."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by the CLI's handler (``specparity/cli/entry.py``).

    A ``KeyboardInterrupt`` so that every cleanup that runs on Ctrl-C (temp
    files removed, locks released, run markers set to failed) runs on SIGTERM too.
    """


def _err(msg: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(msg)


def finite_float(text: str) -> float:
    """A finite float (``nan``, ``inf`` refused)."""
    try:
        v = float(text)
    except ValueError:
        raise _err(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise _err(f"must be a finite number, got {text!r}")
    return v


def nonneg_float(text: str) -> float:
    """A finite float >= 0."""
    v = finite_float(text)
    if v < 0:
        raise _err(f"must be >= 0, got {text!r}")
    return v


def probability(text: str) -> float:
    """A finite float in [0, 1]."""
    v = finite_float(text)
    if not 0.0 <= v <= 1.0:
        raise _err(f"must be between 0 and 1, got {text!r}")
    return v


def min_p(text: str) -> float:
    """A finite float in [0, 1) (min-p: 0 is off; 1 would keep only the most likely token)."""
    v = finite_float(text)
    if not 0.0 <= v < 1.0:
        raise _err(f"must be >= 0 and < 1, got {text!r}")
    return v


INT_LIMIT = 2**31 - 1
"""Counts, sizes and ids above this are refused (seeds have their own, larger bound)."""


def _int(text: str, limit: int = INT_LIMIT) -> int:
    try:
        v = int(text.strip())
    except (ValueError, AttributeError):
        raise _err(f"expected an integer, got {text!r}") from None
    if abs(v) > limit:
        raise _err(f"{v} is too large (limit {limit})")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    v = _int(text)
    if v < 1:
        raise _err(f"must be >= 1, got {v}")
    return v


def nonneg_int(text: str) -> int:
    """An integer >= 0 (seeds, top-k)."""
    v = _int(text)
    if v < 0:
        raise _err(f"must be >= 0, got {v}")
    return v


RNG_MODES = ("stream", "position")


def rng_mode(text: str) -> str:
    """``stream`` (one RNG stream per request, mlx-lm) or ``position`` (a key per (seed, output
    position): sampled speculative output equals plain decode; ``engine.pipeline``)."""
    v = str(text).strip()
    if v not in RNG_MODES:
        raise _err(f"must be one of {', '.join(RNG_MODES)}, got {text!r}")
    return v


def _one_of(text: str, allowed: tuple[int, ...]) -> int:
    v = _int(text)
    if v not in allowed:
        raise _err(f"must be one of {', '.join(map(str, allowed))}, got {v}")
    return v


def kv_bits(text: str) -> int:
    """KV cache bits: mlx's affine quantization widths (``engine.caches.KV_BITS``)."""
    from engine.caches import KV_BITS

    return _one_of(text, KV_BITS)


def kv_group_size(text: str) -> int:
    """KV quantization group size (``engine.caches.KV_GROUP_SIZES``; must divide the head dim)."""
    from engine.caches import KV_GROUP_SIZES

    return _one_of(text, KV_GROUP_SIZES)


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**63)."""
    v = _int(text, (1 << 63) - 1)
    if v < 0:
        raise _err(f"must be >= 0, got {v}")
    return v


def max_tokens(text: str) -> int:
    """A token budget: >= 1, refused above :data:`MAX_TOKENS_LIMIT`, warned above :data:`MAX_TOKENS_WARN`."""
    v = positive_int(text)
    if v > MAX_TOKENS_LIMIT:
        raise _err(f"{v} is absurd (limit {MAX_TOKENS_LIMIT}); generation stops at the model's "
                   "context anyway")
    if v > MAX_TOKENS_WARN:
        print(f"specparity: warning: --max-tokens {v} is large; decoding on CPU runs ~100 tok/s "
              "at best and stops at the model's context", file=sys.stderr)
    return v


MAX_CASES = 10_000
"""``run`` refuses more cases than this unless ``--max-cases`` raises it (a 10^6-line prompts file
must not start a million cases without a word); the whole zoo matrix is ~600."""

MAX_GAMMA = _records.MAX_GAMMA
"""γ above this is refused (flags, suites, trace headers; ``traces.records.MAX_GAMMA``)."""


def gamma(text: str) -> int:
    """A draft length γ in ``[1, MAX_GAMMA]``."""
    v = positive_int(text)
    if v > MAX_GAMMA:
        raise _err(f"γ {v} is too large (limit {MAX_GAMMA})")
    return v


def _ints(text: str, minimum: int, what: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise _err(f"expected comma-separated {what} like 1,2,3, got {text!r}")
    out = []
    for p in parts:
        try:
            v = int(p)
        except ValueError:
            raise _err(f"expected comma-separated {what}, {p!r} is not an integer") from None
        if v > INT_LIMIT:
            raise _err(f"{v} is too large (limit {INT_LIMIT})")
        if v < minimum:
            raise _err(f"{what} must be >= {minimum}, got {v}")
        out.append(v)
    return tuple(out)


def positive_int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 1."""
    return _ints(text, 1, "positive integers")


def gamma_list(text: str) -> tuple[int, ...]:
    """Comma-separated γ values, each in ``[1, MAX_GAMMA]``."""
    out = _ints(text, 1, "positive integers")
    for v in out:
        if v > MAX_GAMMA:
            raise _err(f"γ {v} is too large (limit {MAX_GAMMA})")
    return out


def token_id_list(text: str) -> tuple[int, ...]:
    """Comma-separated token ids >= 0 (the vocabulary bound is checked with the model)."""
    return _ints(text, 0, "token ids")


def str_list(text: str) -> list[str]:
    """Comma-separated names (at least one; an empty item like ``a,,b`` is refused, not dropped)."""
    out = [v.strip() for v in text.split(",")]
    if not text.strip() or any(not v for v in out):
        raise _err(f"expected comma-separated names like a,b, got {text!r}")
    return out


def choice_list(known: Callable[[], Iterable[str]], what: str) -> Callable[[str], list[str]]:
    """Comma-separated names, each one of ``known()`` (evaluated lazily, at parse time)."""

    def parse(text: str) -> list[str]:
        names = str_list(text)
        valid = list(known())
        bad = [n for n in names if n not in valid]
        if bad:
            raise _err(f"unknown {what} {', '.join(map(repr, bad))}; known: {', '.join(valid)}")
        return names

    parse.__name__ = f"{what} list"
    return parse


def zoo_targets() -> list[str]:
    """The zoo's target names (``--targets``), the native-MTP targets of the run matrix included."""
    import zoo
    from zoo.native_mtp import MATRIX

    return [*zoo.TARGETS, zoo.TRAINED_TARGET, *zoo.KV_TARGETS, *dict.fromkeys(t for t, _ in MATRIX)]


def zoo_drafters() -> list[str]:
    """The zoo's drafter names (``--drafters``), the native-MTP matrix's included."""
    import zoo
    from zoo.native_mtp import MATRIX

    return [*zoo.DRAFTERS, zoo.TRAINED_DRAFTER, *dict.fromkeys(d for _, d in MATRIX)]


def runner_names() -> list[str]:
    """The references (``--runners``), installed or not (availability is said per run)."""
    from specparity.runners import registry

    return registry.names("reference")


def runner_list(text: str) -> list[str]:
    """``--runners``: comma-separated oracle names (``""``: none, the engine alone)."""
    if not text.strip():
        return []
    return choice_list(lambda: ["engine", *runner_names()], "runner")(text)


def source_names() -> list[str]:
    """The §3 draft-source roster the engine knows (``--source``, suites, trace headers)."""
    from engine.sources import KINDS

    return list(KINDS)


def source(text: str) -> str:
    """One draft-source kind of the §3 roster."""
    known = source_names()
    if text.strip() not in known:
        raise _err(f"unknown source {text!r}; known: {', '.join(known)}")
    return text.strip()


_INT_PARSERS = ("positive_int", "nonneg_int", "seed", "max_tokens", "gamma", "kv_bits", "kv_group_size")
_FLOAT_PARSERS = ("finite_float", "nonneg_float", "probability", "min_p")
_INT_LIST_PARSERS = ("positive_int_list", "token_id_list", "gamma_list")
_OBJECT_PARSERS = ("conventions_block",)


def check_value(parse: Callable[[str], Any], value: Any, where: str) -> Any:
    """``value`` from a file (a TOML suite, a trace header) through the flag's own ``parse``.

    One set of bounds for flags and files: a suite's ``seed = 2**70`` or a
    header's γ of 10^9 is refused with the message ``--seed``/``--gammas`` give.
    Values must have the native type (an int for an integer flag, never a
    bool or a string), so nothing is coerced.

    Raises:
        UsageError: ``"<where>: <the flag's message>"``.
    """
    name = getattr(parse, "__name__", "")
    if name in _OBJECT_PARSERS:  # a JSON object (a header block): the parser checks its shape
        try:
            return parse(value)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"{where}: {exc}") from None
    if name in _INT_LIST_PARSERS:
        if not isinstance(value, list | tuple) or not all(_is_int(x) for x in value):
            raise UsageError(f"{where}: expected a non-empty list of integers, got {value!r}")
        text = ",".join(str(x) for x in value)
    elif name in _INT_PARSERS:
        if not _is_int(value):
            raise UsageError(f"{where}: expected an integer, got {value!r}")
        text = str(value)
    elif name in _FLOAT_PARSERS:
        if not (_is_int(value) or isinstance(value, float)):
            raise UsageError(f"{where}: expected a number, got {value!r}")
        text = repr(float(value)) if isinstance(value, float) else str(value)
    else:
        if not isinstance(value, str):
            raise UsageError(f"{where}: expected a string, got {value!r}")
        text = value
    try:
        return parse(text)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"{where}: {exc}") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _no_nul(text: str) -> None:
    if "\x00" in text:
        raise _err(f"{text!r}: a path cannot contain a NUL byte")


NAME_MAX = 255
"""Longest file-name component in bytes (Linux, macOS): a longer one is ENAMETOOLONG."""
PATH_MAX = 4096
"""Longest path in bytes (Linux)."""
OUT_HEADROOM = 512
"""Bytes an output directory leaves for what is written under it (``traces/<runner>/<stem>.jsonl``)."""


def _short(text: str) -> str:
    return text if len(text) <= 80 else f"{text[:40]}...{text[-30:]}"


def user_path(text: str, *, headroom: int = 0) -> Path:
    """The one path type: no NUL, ``~``/``~user`` expanded, lengths within the OS limits.

    ``headroom``: bytes that must stay free below :data:`PATH_MAX` (an output
    directory gets files under it). Every path flag goes through this, so an
    unknown user or an over-long name is one usage line, never an ``OSError``
    traceback from inside the work.
    """
    _no_nul(text)
    if not text.strip():
        raise _err("an empty path")
    p = Path(text)
    if text.startswith("~"):
        try:
            p = p.expanduser()
        except RuntimeError:
            raise _err(f"{_short(text)}: cannot expand {text.split('/', 1)[0]!r}: no such user "
                       "(or no home directory)") from None
    for part in p.parts:
        n = len(os.fsencode(part))
        if n > NAME_MAX:
            raise _err(f"{_short(text)}: a path component is {n} bytes long (limit {NAME_MAX}): "
                       f"{_short(part)}")
    try:
        full = len(os.fsencode(p.absolute()))
    except OSError as exc:  # the working directory was removed
        raise _err(f"{_short(text)}: cannot resolve ({exc.strerror})") from None
    if full + headroom >= PATH_MAX:
        room = f" with {headroom} bytes for the files under it" if headroom else ""
        raise _err(f"{_short(text)}: path too long ({full} bytes{room}; limit {PATH_MAX - 1})")
    return p


def _stat(p: Path, text: str) -> os.stat_result | None:
    """``os.stat`` or None when absent; any other OS error is one usage line."""
    try:
        return p.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _err(f"{_short(text)}: cannot access ({exc.strerror})") from None


MAX_INPUT_BYTES = _io.MAX_INPUT_BYTES
"""Input files (prompts, suites) larger than this are refused, not read into memory."""


def readable_file(text: str) -> Path:
    """An existing, readable regular file of at most :data:`MAX_INPUT_BYTES`.

    Regular files only: ``/dev/zero`` or a FIFO would be read forever. The check
    is :func:`traces.io.regular_file`, the one every read of a user file uses.
    """
    p = user_path(text)
    try:
        _io.regular_file(p)
    except _io.InputFileError as exc:
        raise _err(str(exc).replace(str(p), text, 1)) from None
    if not os.access(p, os.R_OK):
        raise _err(f"{text}: not readable (permission denied)")
    return p


def existing_dir(text: str) -> Path:
    """An existing, readable directory."""
    p = user_path(text)
    st = _stat(p, text)
    if st is None:
        raise _err(f"{text}: no such directory")
    if not stat.S_ISDIR(st.st_mode):
        raise _err(f"{text}: not a directory")
    if not os.access(p, os.R_OK | os.X_OK):
        raise _err(f"{text}: not readable (permission denied)")
    return p


def _nearest_existing(p: Path) -> Path:
    q = p.absolute()
    while not q.exists() and q != q.parent:
        q = q.parent
    return q


def writable_dir(text: str) -> Path:
    """An output directory that exists and is writable, or can be created.

    Nothing is created here; :func:`specparity.cli.outdir.prepare_dir` creates it
    and probes it with a real write before any work starts, and
    :mod:`specparity.cli.outdir` refuses a directory holding files no specparity
    command wrote.
    """
    p = user_path(text, headroom=OUT_HEADROOM)
    st = _stat(p, text)
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise _err(f"{text}: exists and is not a directory; give a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise _err(f"{text}: not writable (permission denied); give a writable directory")
        return p
    try:
        base = _nearest_existing(p)
    except OSError as exc:
        raise _err(f"{_short(text)}: cannot access ({exc.strerror})") from None
    if not base.is_dir():
        raise _err(f"{text}: cannot be created ({base} is not a directory)")
    if not os.access(base, os.W_OK | os.X_OK):
        raise _err(f"{text}: cannot be created ({base} is not writable)")
    return p


writable_dir.output = "dir"  # type: ignore[attr-defined]  # a writing flag (specparity.cli.outdir.WRITERS)


def report_dir(text: str) -> Path:
    """``report DIR``: an existing, readable and writable directory the report is written into
    (beside the traces it holds; ``specparity.cli.outdir.add_outputs``)."""
    p = existing_dir(text)
    if not os.access(p, os.W_OK | os.X_OK):
        raise _err(f"{text}: not writable (permission denied); the report is written into it")
    return p


report_dir.output = "beside"  # type: ignore[attr-defined]


def writable_file(text: str) -> Path:
    """An output file path whose directory is (or can be made) writable; not a directory."""
    p = user_path(text)
    st = _stat(p, text)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise _err(f"{text}: is a directory; give a file path")
    if st is not None and not os.access(p, os.W_OK):
        raise _err(f"{text}: exists and is not writable")
    writable_dir(str(p.parent) if str(p.parent) else ".")
    return p


def _is_regular(p: Path) -> bool:
    """A regular file (a FIFO or device is never opened: it could block or never end)."""
    try:
        return stat.S_ISREG(os.stat(p).st_mode)
    except OSError:
        return False


def _first_line(p: Path, limit: int = 1 << 20) -> bytes:
    if not _is_regular(p):
        return b""
    with open(p, "rb") as fh:
        return fh.readline(limit)


def is_trace(p: Path) -> bool:
    """Whether the file at ``p`` is a specparity trace (its first line a trace header)."""
    import json

    try:
        head = json.loads(_first_line(p))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(head, dict) and head.get("type") == "header" and "schema_version" in head


def read_small_json(p: Path, limit: int = 64 << 20) -> object:
    """A JSON file's value, or None if it is unreadable, not JSON or larger than ``limit``."""
    import json

    try:
        if not _is_regular(p) or p.stat().st_size > limit:
            return None
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def output_file(ours: Callable[[Path], bool], what: str) -> Callable[[str], Path]:
    """:func:`writable_file` that replaces an existing regular file only if ``ours(path)``.

    A device (``/dev/null``, ``/dev/stdout``) or FIFO is written in place; a
    regular file that specparity did not write (``ours`` is False) is refused:
    no flag can overwrite a file the project did not write.
    """

    def parse(text: str) -> Path:
        p = writable_file(text)
        try:
            st = os.stat(p)  # follows a symlink: its target is what would be replaced
        except OSError:
            return p
        if stat.S_ISREG(st.st_mode) and st.st_size > 0 and not ours(p):
            raise _err(f"{text}: exists and is not a {what} written by specparity; refusing to "
                       "overwrite it: give a new file name")
        return p

    parse.__name__ = f"{what} file"
    parse.output = "file"  # type: ignore[attr-defined]  # a writing flag (specparity.cli.outdir.WRITERS)
    return parse


def check_model_dir(path: str | os.PathLike[str], flag: str = "model") -> Path:
    """A local model directory whose ``config.json`` parses and whose safetensors are whole
    (``engine.models.check_model_dir``, with the flag's name on the line).

    Reads only the safetensors headers (8-byte length + JSON; ``engine.models.check_weights``,
    the check every loader path runs), so a truncated download, a corrupt or lying header, a
    missing shard or a config beyond its weights is one clear line here naming the file and
    the field, instead of a loader traceback (or a segfault, or minutes building) later.

    Raises:
        UsageError: naming the flag, the file and what is wrong with it.
    """

    p = Path(path)
    if str(p).startswith("~"):
        try:
            p = p.expanduser()
        except RuntimeError:
            raise UsageError(f"{flag} {p}: cannot expand {str(p).split('/', 1)[0]!r}: no such "
                             "user") from None
    if not p.is_dir():
        raise UsageError(f"{flag} {p}: " + ("not a directory" if p.exists() else "no such directory"))
    cfg = p / "config.json"
    if not (cfg.exists() or cfg.is_symlink()):
        raise UsageError(f"{flag} {p}: no config.json (not an mlx-lm model directory)")
    from engine.models import ModelLoadError
    from engine.models import check_model_dir as check

    try:  # the one check every loader path runs: files, config, headers, config vs weights
        check(p)
    except ModelLoadError as exc:
        text = str(exc)
        if text.startswith(f"{cfg}: unreadable"):
            text += "; re-download or rebuild the model"
        raise UsageError(f"{flag} {text}") from None
    return p


def model_dir(text: str) -> str:
    """argparse type: :func:`check_model_dir` of a local model directory (returns the path)."""
    p = user_path(text)
    try:
        check_model_dir(p, "")
    except UsageError as exc:
        raise _err(str(exc).lstrip()) from None
    return str(p)


def model_ref(text: str) -> str:
    """A zoo/trained model name, or a local model directory (checked like :func:`model_dir`)."""
    p = user_path(text)
    if "/" in text or os.sep in text or text.startswith("~") or p.is_dir():
        return model_dir(text)
    return text


def reasoning_end(text: str) -> str:
    """``--reasoning-end``: the marker text that ends a reasoning model's free part (non-empty, at
    most 256 characters, no NUL); encoded with the target tokenizer (engine.grammar.marker_ids)."""
    if not text or len(text) > 256 or "\x00" in text:
        raise _err(f"--reasoning-end: expected a non-empty marker text of at most 256 characters "
                   f"without NUL, got {text[:40]!r}")
    return text


def mtp_conventions(text: str) -> str:
    """``--mtp-conventions NAME=VALUE,...``: each name a convention of
    ``engine.sources.native_mtp.Conventions``, given once (a repeated name is refused, never
    "last wins"), its value one of that convention's."""
    from engine.sources.native_mtp import Conventions

    items = [kv.strip() for kv in str(text).split(",")]
    if not str(text).strip() or any(not kv for kv in items):
        raise _err(f"expected NAME=VALUE[,NAME=VALUE...], got {text!r} (an empty item)")
    bad = [kv for kv in items if "=" not in kv or not kv.split("=", 1)[1].strip()]
    if bad:
        raise _err(f"{bad[0]!r}: expected NAME=VALUE (e.g. hidden=pre-norm)")
    names = [kv.split("=", 1)[0].strip().replace("-", "_") for kv in items]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise _err(f"{', '.join(dup)} given more than once in {text!r}; give each convention once")
    try:
        Conventions.parse(text)
    except (TypeError, ValueError) as exc:
        raise _err(str(exc)) from None
    return str(text)


def conventions_block(value: Any) -> dict[str, Any]:
    """A trace header's ``params.mtp_conventions`` object (``engine.sources.native_mtp.describe``),
    checked as ``--mtp-conventions`` is: every convention known, each value one of its choices
    (native JSON types), plus the checkpoint's ``family``, ``layout`` and ``depth_layers``."""
    from engine.sources.native_mtp import FAMILY_DEFAULTS, Conventions

    if not isinstance(value, dict):
        raise _err(f"expected an object of conventions, got {value!r}")
    described = {"family": tuple(FAMILY_DEFAULTS), "layout": ("layers", "mtp")}
    for key, allowed in described.items():
        if key in value and value[key] not in allowed:
            raise _err(f"{key} {value[key]!r}; valid: {', '.join(allowed)}")
    depth = value.get("depth_layers")
    if depth is not None and (not _is_int(depth) or depth < 1 or depth > 64):
        raise _err(f"depth_layers must be an integer in [1, 64], got {depth!r}")
    try:
        Conventions.parse({k: v for k, v in value.items() if k not in (*described, "depth_layers")})
    except (TypeError, ValueError) as exc:
        raise _err(str(exc)) from None
    return value


MAX_GRAMMAR_BYTES = 1 << 20
"""A ``--grammar`` file above this is refused up front: the header of every trace made under
it carries its text (``zoo.grammars``), and the trace validator refuses lines past
``traces.io.line_limit()`` (4 MiB), escaping included."""


def grammar_ref(text: str) -> str:
    """``--grammar``: a zoo grammar name, or a readable ``.json``/``.regex``/``.lark`` file that
    compiles as that kind of grammar text (resolved to an absolute path); else one line, exit 2."""
    from zoo.grammars import GRAMMARS, spec

    if text in GRAMMARS:
        return text
    p = readable_file(text)
    size = p.stat().st_size
    if size > MAX_GRAMMAR_BYTES:
        raise _err(f"{text}: {size / (1 << 20):.1f} MiB; a grammar may be at most "
                   f"{MAX_GRAMMAR_BYTES >> 20} MiB (every trace header carries its text so grade can "
                   "re-run it, and a trace line is at most 4 MiB)")
    try:
        spec(str(p))
    except ValueError as exc:  # engine.grammar.GrammarError: suffix, unreadable, not a JSON object
        raise _err(str(exc)) from None
    return str(p.resolve())
