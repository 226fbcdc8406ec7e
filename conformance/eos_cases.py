"""Derived-EOS cases: place a stopping EOS at a known output position and arrival kind.

Reference: ``../shared/reference/speculative-decoding.md`` §2 step 3 ("EOS is
never emitted as content") and §4.7 (a stopping EOS from the initial sample,
an accepted draft, the correction, the bonus or a plain-decode step is counted
once; ``finish_reason`` ``stop``); mlx-lm 0.32.2 ``stream_generate``
(``generation_tokens = n + 1``).

The zoo tokenizer's EOS never shows up in a short greedy run, so the EOS id is
*derived*: from a plain run, the token emitted at position ``j`` (its first
occurrence) becomes the EOS, which makes ``j`` the first EOS position. A spec
probe of the same pair tells which kind of walk step produces position ``j``
(accepted draft, correction, bonus). The kind is a prediction only; the tests
measure the real arrival kind from the EOS run's trace (:func:`arrival_kind`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from specparity.cases.case import Case
from traces.io import Trace

SPEC_KINDS = ("accepted-draft", "correction", "bonus")
ARRIVAL_KINDS = ("initial", *SPEC_KINDS, "plain-step")
BUDGETS = ("before", "at", "after")  # max_tokens = j, j + 1, j + 2 for an EOS at index j
STOP_MODES = ("nostop", "xround", "burst")

# Drafters tried per kind, most likely first: ``self`` accepts everything
# (accepted drafts and bonuses), ``small`` rejects the first draft (corrections),
# ``twin`` has partial rounds.
PREFERRED_DRAFTERS = {
    "accepted-draft": ("self", "twin"),
    "bonus": ("self", "twin"),
    "correction": ("small", "twin"),
}
PROBE_TOKENS = 28
MIN_EOS_INDEX = 3


def run(runner: str, case: Case) -> Trace:
    from specparity.runners import run_case

    return Trace.from_records(run_case(runner, case))


@cache
def plain_output(target: str, prompt_id: str, max_tokens: int = PROBE_TOKENS) -> tuple[int, ...]:
    """Greedy plain output of ``target`` on ``prompt_id`` with no EOS at all."""
    tr = run("engine", Case(target, None, prompt_id, 0, max_tokens, eos_ids=()))
    return tuple(tr.footer["output_ids"])


@cache
def probe(target: str, drafter: str, prompt_id: str, gamma: int) -> Trace:
    """Engine spec trace with no EOS, used to see which walk step emits each position."""
    return run("engine", Case(target, drafter, prompt_id, gamma, PROBE_TOKENS, eos_ids=()))


def is_first_occurrence(output: tuple[int, ...] | list[int], j: int) -> bool:
    return output[j] not in output[:j]


def eos_at(output: tuple[int, ...] | list[int], j: int) -> int:
    """The EOS id that makes ``j`` the first EOS position of ``output``."""
    if not is_first_occurrence(output, j):
        raise ValueError(
            f"token {output[j]} at index {j} already occurs at index {list(output).index(output[j])}"
        )
    return int(output[j])


def extra_eos(output: tuple[int, ...] | list[int], j: int, vocab: int = 512) -> int:
    """A second EOS id that cannot fire before index ``j``: a token first seen after ``j``
    when there is one (a realistic additional stop id), else one never emitted."""
    seen = set(output[: j + 1])
    for t in output[j + 1 :]:
        if t not in seen:
            return int(t)
    return next(t for t in range(vocab - 1, -1, -1) if t not in set(output))


def walk_steps(trace: Trace) -> list[tuple[str, int, int]]:
    """``(kind, event index, window position)`` of every walked sample, in order.

    Kinds: ``initial`` (full-prefill first sample), ``plain-step`` (a plain
    record or a zero-length-draft round), ``accepted-draft``, ``correction``,
    ``bonus``.
    """
    steps: list[tuple[str, int, int]] = []
    for e, ev in enumerate(trace.events):
        if ev["type"] == "plain":
            steps.append(("initial" if ev.get("reason") == "initial" else "plain-step", e, 0))
            continue
        drafts = ev["drafts"]
        for p, t in enumerate(ev["samples"]):
            if not drafts:
                kind = "plain-step"
            elif p < len(drafts):
                kind = "accepted-draft" if t == drafts[p] else "correction"
            else:
                kind = "bonus"
            steps.append((kind, e, p))
    return steps


def arrival_kind(trace: Trace) -> str | None:
    """How the stopping EOS arrived, measured from the trace; ``None`` if no EOS ended it."""
    last = trace.events[-1] if trace.events else None
    if last is None or last["end"] != "eos":
        return None
    kind, _, _ = walk_steps(trace)[-1]
    return kind


def eos_reached(trace: Trace) -> bool:
    return bool(trace.events) and trace.events[-1]["end"] == "eos"


def accounting_problems(trace: Trace) -> list[str]:
    """Violations of the EOS/usage contract in one trace (empty when it holds)."""
    cid = trace.header.get("case_id", "?")
    eos = set(trace.header["eos_ids"])
    out = trace.footer["output_ids"]
    usage = trace.footer["usage"]
    reached = eos_reached(trace)
    problems = []
    leaked = [(i, t) for i, t in enumerate(out) if t in eos]
    if leaked:
        problems.append(f"{cid}: EOS emitted as content at (index, id) {leaked}")
    want = len(out) + (1 if reached else 0)
    if usage["generation_tokens"] != want:
        problems.append(
            f"{cid}: generation_tokens {usage['generation_tokens']} != len(output) {len(out)}"
            f" + {int(reached)} (EOS reached: {reached})"
        )
    last_end = trace.events[-1]["end"] if trace.events else None
    want_reason = "length" if last_end == "budget" else "stop"
    if usage["finish_reason"] != want_reason:
        problems.append(
            f"{cid}: finish_reason {usage['finish_reason']!r} but generation ended by {last_end!r}"
        )
    return problems


@dataclass(frozen=True)
class EosCase:
    """A spec (or plain) case with a derived EOS at output index ``j``.

    ``stop_at`` is the output index where the stop sequence completes (None:
    no stop sequence), ``stop_mode`` how its two tokens sit in the probe's
    rounds (``xround``: across a round boundary; ``burst``: inside one burst).
    """

    kind: str
    case: Case
    j: int
    output: tuple[int, ...]
    stop_mode: str = "nostop"
    stop_at: int | None = None

    def with_budget(self, budget: str) -> Case:
        return replace(self.case, max_tokens=self.j + BUDGETS.index(budget))

    def expected(self, budget: str) -> tuple[list[int], int, str, bool]:
        """``(output, generation_tokens, finish_reason, eos_reached)`` that plain decode gives."""
        max_tokens = self.j + BUDGETS.index(budget)
        if self.stop_at is not None and self.stop_at < max_tokens:
            out = list(self.output[: self.stop_at + 1])
            return out, len(out), "stop", False
        out = list(self.output[: min(self.j, max_tokens)])
        if max_tokens > self.j:
            return out, len(out) + 1, "stop", True
        return out, len(out), "length", False


def _round_of(steps: list[tuple[str, int, int]], trace: Trace) -> list[int]:
    """Event index of each *emitted* output position of a no-EOS trace."""
    return [e for (_, e, _) in steps][: len(trace.footer["output_ids"])]


def _stop_position(rounds_of: list[int], output: tuple[int, ...], j: int, mode: str) -> int | None:
    """Latest ``m < j`` where the pair ``output[m-1:m+1]`` first completes, placed per ``mode``."""
    for m in range(j - 1, 0, -1):
        pair = output[m - 1 : m + 1]
        if any(output[i - 1 : i + 1] == pair for i in range(1, m)):
            continue
        across = rounds_of[m - 1] != rounds_of[m]
        if (mode == "xround") == across:
            return m
    return None


@cache
def derive_spec_case(
    kind: str,
    gamma: int,
    stop_mode: str = "nostop",
    target: str = "llama",
    prompt_ids: tuple[str, ...] = ("nat-00", "nat-01", "nat-02", "rnd-00", "rnd-01"),
) -> EosCase:
    """The first (drafter, prompt, j) whose probe emits position ``j`` by ``kind``."""
    for drafter in PREFERRED_DRAFTERS[kind]:
        for pid in prompt_ids:
            output = plain_output(target, pid)
            tr = probe(target, drafter, pid, gamma)
            if tuple(tr.footer["output_ids"]) != output[: len(tr.footer["output_ids"])]:
                raise AssertionError(
                    f"{tr.header['case_id']}: spec probe differs from plain decode"
                )
            steps = walk_steps(tr)
            rounds_of = _round_of(steps, tr)
            # the rounds before the EOS must exist, so prefer a late j
            for j in range(MIN_EOS_INDEX, len(output) - 2):
                if steps[j][0] != kind or not is_first_occurrence(output, j) or steps[j][1] == 0:
                    continue
                stop_at = None
                stops: tuple[tuple[int, ...], ...] = ()
                if stop_mode != "nostop":
                    stop_at = _stop_position(rounds_of, output, j, stop_mode)
                    if stop_at is None:
                        continue
                    stops = (tuple(output[stop_at - 1 : stop_at + 1]),)
                case = Case(
                    target,
                    drafter,
                    pid,
                    gamma,
                    j + 1,
                    eos_ids=(eos_at(output, j),),
                    stop_sequences=stops,
                )
                return EosCase(kind, case, j, output, stop_mode, stop_at)
    raise LookupError(f"no zoo case puts an EOS at a {kind} for gamma={gamma}, stop={stop_mode}")


@cache
def derive_plain_case(
    stop_mode: str = "nostop", target: str = "llama", prompt_id: str = "nat-01"
) -> EosCase:
    """A plain-decode case (every token a plain step); ``stop_mode`` ``xround``
    puts the stop sequence on the two tokens just before the EOS."""
    output = plain_output(target, prompt_id)
    j = next(j for j in range(6, len(output)) if is_first_occurrence(output, j))
    stop_at = None
    stops: tuple[tuple[int, ...], ...] = ()
    if stop_mode != "nostop":
        stop_at = _stop_position(list(range(len(output))), output, j, "xround")
        assert stop_at is not None
        stops = (tuple(output[stop_at - 1 : stop_at + 1]),)
    case = Case(
        target, None, prompt_id, 0, j + 1, eos_ids=(eos_at(output, j),), stop_sequences=stops
    )
    return EosCase("plain-step", case, j, output, stop_mode, stop_at)


def describe(ec: EosCase, extra: dict[str, Any] | None = None) -> str:
    bits = [f"{ec.kind} EOS={ec.output[ec.j]} at index {ec.j}", ec.case.case_id]
    if ec.stop_at is not None:
        bits.append(f"stop {ec.stop_mode} completes at index {ec.stop_at}")
    if extra:
        bits.extend(f"{k}={v}" for k, v in extra.items())
    return "; ".join(bits)


def result_trace(result: Any, case_id: str, eos_ids: tuple[int, ...], mode: str = "spec") -> Trace:
    """A :class:`Trace` over an engine ``GenerationResult`` run outside ``run_case``
    (e.g. full prefill), with just the header fields the EOS checks read."""
    header = {"type": "header", "case_id": case_id, "mode": mode, "eos_ids": list(eos_ids)}
    return Trace.from_records([header, *result.records, result.footer()])
