"""Named, documented accounting normalizations between references.

A normalization maps one reference's accounting convention onto the engine's
(``traces/INTERPRETING.md``) and NOTHING else, so a comparison after it still
fails on any other difference. Each one refuses records it does not apply to
rather than guessing.

``optiq-stopping-eos``
    mlx-optiq 0.7.7 (through mlx-lm 0.32.2 ``stream_generate``) yields the
    stopping EOS as the last token of its response stream, so a recorder sees
    it as an emitted token; ``generation_tokens`` counts it, as the engine's
    does. The engine never emits EOS (§2 step 3). The normalization drops that
    ONE trailing EOS from ``output_ids`` and from the last record's
    ``emitted``, only when the run stopped on it (``finish_reason == "stop"``,
    last record ``end == "eos"``); ``generation_tokens`` is left as it is.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

NORMALIZATIONS = ("optiq-stopping-eos",)


class NotApplicable(ValueError):
    """The records do not have the shape the normalization is defined for."""


def optiq_stopping_eos(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy of ``records`` with optiq's stopping EOS removed from the emitted stream."""
    out = [copy.deepcopy(r) for r in records]
    header = next((r for r in out if r["type"] == "header"), None)
    footer = out[-1]
    if footer["type"] != "footer":
        raise NotApplicable("no footer")
    body = [r for r in out if r["type"] in ("round", "plain")]
    if footer["usage"]["finish_reason"] != "stop":
        return out
    eos = set(header["eos_ids"]) if header is not None else None
    last = body[-1] if body else None
    ids = footer["output_ids"]
    if last is None or last["end"] != "eos" or not ids or not last["emitted"]:
        raise NotApplicable("finish_reason stop without a trailing EOS record")
    if eos is not None and ids[-1] not in eos:
        raise NotApplicable(f"last output token {ids[-1]} is not an EOS id {sorted(eos)}")
    if last["emitted"][-1] != ids[-1]:
        raise NotApplicable("last record's emitted does not end with the output's last token")
    footer["output_ids"] = ids[:-1]
    last["emitted"] = last["emitted"][:-1]
    return out


def apply(name: str, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    if name == "optiq-stopping-eos":
        return optiq_stopping_eos(records)
    raise ValueError(f"unknown normalization {name!r}; known: {', '.join(NORMALIZATIONS)}")
