"""Building trace records shared by every runner (header, counters).

The header layout and the counters' meaning are normative in
``traces/INTERPRETING.md``; the counters follow §2 "Telemetry" of
``speculative-decoding.md`` (drafted, accepted, rejected, target_calls, rounds,
acceptance_lengths, drafted_by_pos, accepted_by_pos).
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from importlib import metadata
from typing import Any

SCHEMA_VERSION = 1


def platform_info() -> dict[str, str]:
    try:
        mlx_version = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        mlx_version = "absent"
    device = "cpu"
    try:
        import mlx.core as mx

        device = str(mx.default_device())
    except Exception:  # pragma: no cover - mlx missing
        pass
    return {"mlx": mlx_version, "device": device, "python": platform.python_version()}


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
    prompt_ids: list[int],
    eos_ids: Iterable[int],
) -> dict[str, Any]:
    """A schema-version-1 header record."""
    return {
        "type": "header",
        "schema_version": SCHEMA_VERSION,
        "runner": {"commit": None, **runner},
        "mode": mode,
        "source": source,
        "case_id": case_id,
        "target": target,
        "drafter": drafter,
        "tokenizer_sha256": tokenizer_sha256,
        "params": params,
        "prompt": {"id": prompt_id, "token_ids": list(prompt_ids)},
        "eos_ids": sorted(int(t) for t in eos_ids),
        "platform": platform_info(),
    }


def counters_from_rounds(rounds: Iterable[dict[str, Any]], plain_steps: int = 0) -> dict[str, Any]:
    """The footer ``speculation`` counters implied by a sequence of round records."""
    out: dict[str, Any] = {
        "drafted": 0,
        "accepted": 0,
        "rejected": 0,
        "target_calls": plain_steps,
        "rounds": 0,
        "acceptance_lengths": [],
        "drafted_by_pos": [],
        "accepted_by_pos": [],
    }
    for rec in rounds:
        d, k = len(rec["drafts"]), int(rec["k_accept"])
        out["drafted"] += d
        out["accepted"] += k
        out["rejected"] += d - k
        out["target_calls"] += 1
        out["rounds"] += 1
        out["acceptance_lengths"].append(k)
        for key, upto in (("drafted_by_pos", d), ("accepted_by_pos", k)):
            arr = out[key]
            arr.extend([0] * max(0, upto - len(arr)))
            for p in range(upto):
                arr[p] += 1
    return out
