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

``optiq-spec-budget-drafts``
    mlx-optiq 0.7.7 ``spec_generate`` (the Gemma assistant loop) drafts γ every
    round even when fewer tokens are left; see ``optiq_spec_budget_drafts``.

``mlx-vlm-stopping-eos``
    mlx-vlm 0.7.10 ``generate_step`` / ``_mtp_rounds`` yield the stopping EOS
    like any token (EOS is ``stream_generate``'s business), so the
    ``oracles.mlx_vlm.run_mtp`` recorder, which stops at the first EOS as the
    engine does, sees it emitted. Same mapping, same refusals as
    ``optiq-stopping-eos`` (one trailing EOS dropped from ``output_ids`` and
    the last record's ``emitted``; ``generation_tokens`` kept).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

NORMALIZATIONS = ("optiq-stopping-eos", "optiq-spec-budget-drafts", "mlx-vlm-stopping-eos")


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


def mlx_vlm_stopping_eos(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``mlx-vlm-stopping-eos``: a copy of ``records`` with mlx-vlm's stopping EOS removed (module doc)."""
    return optiq_stopping_eos(records)


def apply(name: str, records: Sequence[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
    if name == "mlx-vlm-stopping-eos":
        return mlx_vlm_stopping_eos(records)
    if name == "optiq-stopping-eos":
        return optiq_stopping_eos(records)
    if name == "optiq-spec-budget-drafts":
        return optiq_spec_budget_drafts(records, **kw)
    raise ValueError(f"unknown normalization {name!r}; known: {', '.join(NORMALIZATIONS)}")


def optiq_spec_budget_drafts(records: Sequence[dict[str, Any]], max_tokens: int) -> list[dict[str, Any]]:
    """``optiq-spec-budget-drafts``: a copy of ``records`` with every round's drafts cut to the tokens left.

    mlx-optiq 0.7.7 ``optiq/runtime/spec/runtime.py`` ``spec_generate`` drafts
    ``gamma`` tokens every round, even when fewer than ``gamma`` tokens are left
    in the budget; mlx-lm and the engine draft ``min(gamma, tokens left)``
    (§2 step 1). Drafts are a greedy chain, so the first ``left`` drafts are
    the same either way; the normalization cuts ``drafts`` and ``window`` to
    ``left`` positions, ``k_accept`` to ``min(k, left)`` and recomputes the
    footer counters. Emitted tokens, samples and usage are left as they are:
    a round that EMITTED more than ``left`` tokens is refused.
    """
    from traces.records import counters_from_rounds

    out = [copy.deepcopy(r) for r in records]
    if out[-1]["type"] != "footer":
        raise NotApplicable("no footer")
    emitted = 0
    rounds = []
    for r in out:
        if r["type"] == "round":
            left = max_tokens - emitted
            if len(r["emitted"]) > left:
                raise NotApplicable(f"round {r['index']} emitted {len(r['emitted'])} > {left} tokens left")
            if len(r["drafts"]) > left:
                r["drafts"] = r["drafts"][:left]
                r["window"] = r["window"][: left + 1]
                r["k_accept"] = min(r["k_accept"], left)
                if r.get("margins") is not None:
                    r["margins"] = r["margins"][: left + 1]
            rounds.append(r)
        if r["type"] in ("round", "plain"):
            emitted += len(r["emitted"])
    n_plain = sum(1 for r in out if r["type"] == "plain")
    if out[-1].get("speculation") is not None:
        out[-1]["speculation"] = counters_from_rounds(rounds, n_plain=n_plain)
    return out
