"""Builders for trace records shared by the engine, the oracles and tests.

``make_header`` fills the platform block and the optional runner keys;
``counters_from_rounds`` derives the footer ``speculation`` counters from
round records with the same definitions as ``engine/telemetry.py``
(``SpecCounters``): by-position lists have no trailing zeros.
"""

from __future__ import annotations

import math
import numbers
import platform as _platform
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from traces.io import SCHEMA_VERSION, Record

__all__ = [
    "MAX_GAMMA",
    "RecordValueError",
    "counters_from_rounds",
    "make_header",
    "platform_info",
    "strict_float",
    "strict_floats",
    "strict_int",
    "strict_ints",
]

MAX_GAMMA = 1024
"""The largest γ a trace header may state (and ``--gammas``/``--gamma`` accept): a draft
window is γ + 1 tokens through the target, and per-γ work (report axes, counters by
position) grows with it, so a header γ of 10^9 is refused at validation."""


class RecordValueError(TypeError, ValueError):
    """A value given to a record builder has the wrong type (one line naming the field)."""


def _scalar(v: object) -> object:
    # numpy / mlx 0-d values: their Python value (an mlx int32 scalar is not numbers.Integral)
    if getattr(v, "ndim", None) == 0 and callable(getattr(v, "item", None)):
        return v.item()  # type: ignore[attr-defined]
    return v


def strict_int(field: str, v: object) -> int:
    """``v`` as a token id / count: an int (numpy and mlx integer scalars too), never a bool,
    a float (``187.7``) or a string (``"496"``), which ``int()`` would silently coerce."""
    x = _scalar(v)
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise RecordValueError(f"{field}: expected an integer token id, got {v!r} "
                               f"({type(v).__name__})")
    return int(x)


def strict_ints(field: str, values: Sequence[object]) -> list[int]:
    """:func:`strict_int` of every item; the error names ``field[i]``."""
    if isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
        raise RecordValueError(f"{field}: expected a list of integer token ids, got {values!r}")
    return [strict_int(f"{field}[{i}]", v) for i, v in enumerate(values)]


def strict_float(field: str, v: object) -> float:
    """``v`` as a finite float (ints and numpy/mlx scalars too), never a bool or a string."""
    x = _scalar(v)
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
        raise RecordValueError(f"{field}: expected a finite number, got {v!r} ({type(v).__name__})")
    return float(x)


def strict_floats(field: str, values: Sequence[object]) -> list[float]:
    """:func:`strict_float` of every item; the error names ``field[i]``."""
    if isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
        raise RecordValueError(f"{field}: expected a list of numbers, got {values!r}")
    return [strict_float(f"{field}[{i}]", v) for i, v in enumerate(values)]


def platform_info() -> dict[str, str]:
    """``{"mlx", "device", "python"}`` for the running interpreter.

    Off the CPU, ``backend`` (``cuda`` / ``metal``) is added: ``Device(gpu, 0)``
    alone does not say which kernels ran. CPU headers are unchanged.
    """
    try:
        mlx_version = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        mlx_version = "unavailable"
    device = "unknown"
    backend = None
    try:
        import mlx.core as mx

        dev = mx.default_device()
        device = str(dev)
        if dev.type == mx.gpu:
            backend = "cuda" if mx.cuda.is_available() else "metal" if mx.metal.is_available() else "gpu"
    except Exception:  # noqa: BLE001 - mlx missing or without a device is not fatal here
        pass
    py = f"{_platform.python_implementation()} {sys.version.split()[0]}"
    info = {"mlx": mlx_version, "device": device, "python": py}
    if backend is not None:
        info["backend"] = backend
    return info


def make_header(
    *,
    runner: dict[str, Any],
    mode: str,
    source: str | None,
    case_id: str,
    target: dict[str, Any],
    drafter: dict[str, Any] | None,
    tokenizer_sha256: str | None,
    params: dict[str, Any],
    prompt_id: str,
    prompt_ids: Sequence[int],
    eos_ids: Sequence[int],
    platform: dict[str, Any] | None = None,
) -> Record:
    """A schema_version 1 header record.

    Args:
        runner: ``{"name", "package", "version"}``; ``commit`` defaults to None
            and ``package`` to ``"specparity"``.
        mode: ``"spec"`` or ``"plain"``.
        source: Draft source kind, or None.
        case_id: Conformance case id.
        target: Model identity ``{"path", "weights_sha256", "config_sha256"}``.
        drafter: Drafter identity, or None.
        tokenizer_sha256: Tokenizer digest, or None.
        params: The ``params`` block (see ``traces/INTERPRETING.md``).
        prompt_id: Prompt id.
        prompt_ids: Prompt token ids.
        eos_ids: EOS token ids.
        platform: Override the detected ``{"mlx", "device", "python"}``.

    Returns:
        The header dict.
    """
    run = {"package": "specparity", "commit": None, **runner}
    return {
        "type": "header",
        "schema_version": SCHEMA_VERSION,
        "runner": run,
        "mode": mode,
        "source": source,
        "case_id": case_id,
        "target": dict(target),
        "drafter": dict(drafter) if drafter is not None else None,
        "tokenizer_sha256": tokenizer_sha256,
        "params": dict(params),
        "prompt": {"id": prompt_id, "token_ids": strict_ints("prompt.token_ids", prompt_ids)},
        "eos_ids": strict_ints("eos_ids", eos_ids),
        "platform": dict(platform) if platform is not None else platform_info(),
    }


def counters_from_rounds(rounds: Sequence[Record], n_plain: int = 0) -> dict[str, Any]:
    """Footer ``speculation`` counters derived from round records.

    Args:
        rounds: Round records (``drafts`` and ``k_accept`` are used).
        n_plain: Plain records in the same run (each is one target call).

    Returns:
        ``{"drafted", "accepted", "rejected", "target_calls", "rounds",
        "acceptance_lengths", "drafted_by_pos", "accepted_by_pos"}``.
    """
    lens = [len(r["drafts"]) for r in rounds]
    ks = [strict_int("round.k_accept", r["k_accept"]) for r in rounds]
    drafted, accepted = sum(lens), sum(ks)
    return {
        "drafted": drafted,
        "accepted": accepted,
        "rejected": drafted - accepted,
        "target_calls": len(rounds) + n_plain,
        "rounds": len(rounds),
        "acceptance_lengths": ks,
        "drafted_by_pos": [sum(d > i for d in lens) for i in range(max(lens, default=0))],
        "accepted_by_pos": [sum(k > i for k in ks) for i in range(max(ks, default=0))],
    }
