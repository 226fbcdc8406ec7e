"""Builders for trace records shared by the engine, the oracles and tests.

``make_header`` fills the platform block and the optional runner keys;
``counters_from_rounds`` derives the footer ``speculation`` counters from
round records with the same definitions as ``engine/telemetry.py``
(``SpecCounters``): by-position lists have no trailing zeros.
"""

from __future__ import annotations

import platform as _platform
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from traces.io import SCHEMA_VERSION, Record

__all__ = ["counters_from_rounds", "make_header", "platform_info"]


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
        "prompt": {"id": prompt_id, "token_ids": [int(t) for t in prompt_ids]},
        "eos_ids": [int(t) for t in eos_ids],
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
    ks = [int(r["k_accept"]) for r in rounds]
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
