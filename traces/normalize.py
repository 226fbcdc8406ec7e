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

DeepSpec (``deepspec/eval/base_evaluator.py`` at commit afdfa7c,
``generate_decoding_sample`` / ``verify_draft_tokens``). These act on the
DeepSpec LOG the ``oracles.deepspec`` runner records (not on trace records:
DeepSpec's counters have no trace field): ``{"max_tokens", "eos_ids",
"rounds": [{"drafts", "accepted", "next", "committed", "stop",
"proposal_length"}], "counters": {"verify_count", "committed_total",
"acceptance_lengths", "proposal_lengths", "accepted_draft_lengths"},
"output_ids"}`` (``committed_total`` = ``sum(acceptance_lengths)``; the
output is DeepSpec's own, after its trim, EOS included). Each returns a new
log with ``"applied"`` extended by its name when the pattern was there, leaves
a log without the pattern as it is, and raises :class:`NotApplicable` on any
other shape. They are applied in :data:`DEEPSPEC_ORDER`.

``deepspec-extra-verify-round``
    The loop runs ``while start < max_length``: when the rounds so far have
    produced EXACTLY ``max_new_tokens`` tokens (prefill token included) it
    proposes and verifies once more, and the final trim
    (``output_ids[:, :min(start + 1, max_length)]``) discards that round's
    tokens. The normalization moves that round (it must be the last, must
    start at exactly the budget, and none of its tokens may be in the output)
    to ``"discarded_rounds"``. A round that starts past the budget, or an
    at-budget round that is not the last, is refused.

``deepspec-counters-count-discarded``
    DeepSpec's counters count what the trim discards: ``verify_count`` counts
    the extra round, ``committed_total`` (and ``acceptance_lengths``) count
    the extra round's tokens and the over-budget tail of the last round
    (DeepSpec drafts whole blocks past the budget,
    ``deepspec-block-past-budget``). Mapped to the engine's accounting:
    ``verify_count`` = kept rounds, ``committed_total`` = tokens the kept
    rounds added to the output (EOS included: ``generation_tokens - 1``).
    Refused unless ``verify_count == len(acceptance_lengths) == rounds +
    discarded rounds`` and ``committed_total - discarded == len(output) - 1``.

``deepspec-eos-unused-next-token``
    A round whose accepted drafts contain an EOS stops there
    (``terminated_by_stop_token``), but ``verify_draft_tokens`` has already
    sampled ``next_token`` after the EOS and appended it to
    ``committed_tokens``, which the loop never writes. The normalization drops
    that last committed token, only when ``committed == drafts[:accepted] +
    [next]`` and ``drafts[accepted - 1]`` is the first EOS of the drafts;
    every other round must have ``committed == drafts[:accepted] + [next]``
    with no EOS among the accepted drafts.

``deepspec-eos-proposal-cut``
    In that stop round ``effective_proposal_length`` (what
    ``proposal_lengths`` records) is cut to the EOS position + 1, though the
    round drafted and verified ``len(drafts)``; the engine counts the drafts
    it verified. Mapped to ``len(drafts)`` when it equals ``accepted`` in a
    stop round; any other round's proposal length must already be
    ``len(drafts)``.

DeepSpec's ``acceptance_lengths`` count the target's token too (``k + 1``
per round, ``k`` in a stop round); the engine's ``acceptance_lengths`` are
``k_accept`` (``traces/INTERPRETING.md``); documented as
``deepspec-acceptance-length-counts-bonus`` in ``known_divergences.toml``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

DEEPSPEC_ORDER = (
    "deepspec-eos-unused-next-token",
    "deepspec-eos-proposal-cut",
    "deepspec-extra-verify-round",
    "deepspec-counters-count-discarded",
)
NORMALIZATIONS = ("optiq-stopping-eos", "optiq-spec-budget-drafts", "mlx-vlm-stopping-eos", *DEEPSPEC_ORDER)


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
    if name in _DEEPSPEC:
        return _DEEPSPEC[name](records)  # type: ignore[arg-type,return-value]  # a DeepSpec log, not records
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


# ----------------------------------------------------------------------------- DeepSpec


def _applied(log: dict[str, Any], name: str) -> dict[str, Any]:
    log["applied"] = [*log.get("applied", []), name]
    return log


def _eos_at(drafts: Sequence[int], eos: set[int]) -> int | None:
    return next((i for i, t in enumerate(drafts) if t in eos), None)


def deepspec_eos_unused_next_token(log: dict[str, Any]) -> dict[str, Any]:
    """``deepspec-eos-unused-next-token`` (module doc)."""
    out = copy.deepcopy(log)
    eos = set(out["eos_ids"])
    hit = False
    for i, r in enumerate(out["rounds"]):
        acc, drafts = r["accepted"], r["drafts"]
        if r["committed"] != [*drafts[:acc], r["next"]]:
            raise NotApplicable(f"deepspec round {i}: committed {r['committed']} is not the accepted drafts "
                                f"{drafts[:acc]} + next {r['next']}")
        at = _eos_at(drafts[:acc], eos)
        if not r["stop"]:
            if at is not None:
                raise NotApplicable(f"deepspec round {i}: accepted EOS at draft {at} without a stop")
            continue
        if at is None or at != acc - 1:
            raise NotApplicable(f"deepspec round {i}: stopped, but the accepted drafts {drafts[:acc]} "
                                f"do not end at their first EOS")
        r["committed"] = r["committed"][:-1]
        hit = True
    return _applied(out, "deepspec-eos-unused-next-token") if hit else out


def deepspec_eos_proposal_cut(log: dict[str, Any]) -> dict[str, Any]:
    """``deepspec-eos-proposal-cut`` (module doc)."""
    out = copy.deepcopy(log)
    eos = set(out["eos_ids"])
    hit = False
    for i, r in enumerate(out["rounds"]):
        d, pl = len(r["drafts"]), r["proposal_length"]
        if r["stop"]:
            at = _eos_at(r["drafts"], eos)
            if at is None or pl != at + 1 or pl != r["accepted"]:
                raise NotApplicable(f"deepspec round {i}: stop round's proposal length {pl} is not "
                                    f"the EOS position + 1 ({None if at is None else at + 1})")
            if pl != d:
                r["proposal_length"] = d
                hit = True
        elif pl != d:
            raise NotApplicable(f"deepspec round {i}: proposal length {pl} != {d} drafts without a stop")
    if hit:
        out["counters"]["proposal_lengths"] = [r["proposal_length"] for r in out["rounds"]]
        return _applied(out, "deepspec-eos-proposal-cut")
    return out


def _produced_before(rounds: Sequence[dict[str, Any]], first: int = 1) -> list[int]:
    """Tokens produced before each round: the prefill's token plus every committed token."""
    out, n = [], first
    for r in rounds:
        out.append(n)
        n += len(r["committed"])
    return out


def deepspec_extra_verify_round(log: dict[str, Any]) -> dict[str, Any]:
    """``deepspec-extra-verify-round`` (module doc)."""
    out = copy.deepcopy(log)
    budget = out["max_tokens"]
    rounds = out["rounds"]
    before = _produced_before(rounds)
    late = [i for i, n in enumerate(before) if n >= budget]
    if not late:
        return out
    i = late[0]
    if before[i] != budget or i != len(rounds) - 1:
        raise NotApplicable(f"deepspec round {i} starts after {before[i]} tokens "
                            f"(budget {budget}) and is not the one extra verify round at the budget")
    if len(out["output_ids"]) > budget:
        raise NotApplicable(f"deepspec output has {len(out['output_ids'])} tokens > budget {budget}")
    out["discarded_rounds"] = [*out.get("discarded_rounds", []), rounds.pop()]
    return _applied(out, "deepspec-extra-verify-round")


def deepspec_counters_count_discarded(log: dict[str, Any]) -> dict[str, Any]:
    """``deepspec-counters-count-discarded`` (module doc)."""
    out = copy.deepcopy(log)
    c = out["counters"]
    rounds, dropped = out["rounds"], out.get("discarded_rounds", [])
    every = [*rounds, *dropped]
    if not (c["verify_count"] == len(c["acceptance_lengths"]) == len(every)):
        raise NotApplicable(f"deepspec verify_count {c['verify_count']}, {len(c['acceptance_lengths'])} "
                            f"acceptance lengths, {len(every)} recorded rounds")
    if c["committed_total"] != sum(c["acceptance_lengths"]):
        raise NotApplicable(f"deepspec committed_total {c['committed_total']} != sum(acceptance_lengths)")
    committed = sum(len(r["committed"]) for r in every)
    if committed != c["committed_total"]:
        raise NotApplicable(f"deepspec committed_total {c['committed_total']} != {committed} tokens "
                            "the recorded rounds committed")
    kept = len(out["output_ids"]) - 1
    if kept < 0 or kept > committed:
        raise NotApplicable(f"deepspec output of {len(out['output_ids'])} tokens vs {committed} committed")
    if c["verify_count"] == len(rounds) and c["committed_total"] == kept:
        return out
    c["verify_count"] = len(rounds)
    c["committed_total"] = kept
    c["discarded_tokens"] = committed - kept
    return _applied(out, "deepspec-counters-count-discarded")


_DEEPSPEC = {
    "deepspec-eos-unused-next-token": deepspec_eos_unused_next_token,
    "deepspec-eos-proposal-cut": deepspec_eos_proposal_cut,
    "deepspec-extra-verify-round": deepspec_extra_verify_round,
    "deepspec-counters-count-discarded": deepspec_counters_count_discarded,
}


def deepspec_log(log: dict[str, Any]) -> dict[str, Any]:
    """Every DeepSpec normalization, in :data:`DEEPSPEC_ORDER`; ``"applied"`` names those that mapped something."""
    out = {**log, "applied": list(log.get("applied", []))}
    for name in DEEPSPEC_ORDER:
        out = _DEEPSPEC[name](out)
    return out
