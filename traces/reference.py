"""Comparing an engine trace with a reference trace, under the known-divergence manifest.

The policy every caller uses (the main job, the conformance suite, the golden
comparison), so a reference bug is classified the same way everywhere:

1. If the engine stopped speculating (a ``plain`` record with reason
   ``ring-wrap``/``no-rollback``), the rounds BEFORE that point are compared
   round for round (they must be identical) and the whole run at the token
   level; otherwise the whole traces are compared round for round.
2. A divergence that matches an entry of ``traces/known_divergences.toml``
   (runner, target family, and the entry's signature — e.g. the first
   divergent output token lies after the engine's ring-wrap point) is
   ``known`` with that entry's id; any other divergence is ``divergent``.
3. A token-level flip after the engine's fallback that the numerics witness
   attributes to arithmetic (the engine decodes plainly there, the reference
   still verifies in windows: different arithmetic paths by design, §2.1) is
   ``numerics``: reported, not failed. Without a witness it stays ``divergent``.
4. A reference that refused the case (``ReferenceRefused``) is ``refused``
   with the matching refusal entry's id, or ``divergent`` when no entry
   explains the refusal.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from traces.diff import Divergence, Witness, diff_traces
from traces.io import Trace

KNOWN_FILE = Path(__file__).with_name("known_divergences.toml")
FALLBACK_REASONS = ("ring-wrap", "no-rollback")


class ReferenceRefused(RuntimeError):
    """A reference implementation refused to run a case (e.g. raised ValueError)."""

    def __init__(self, runner: str, case_id: str, message: str) -> None:
        super().__init__(f"{runner} refused {case_id}: {message}")
        self.runner = runner
        self.case_id = case_id
        self.message = message


@dataclass(frozen=True)
class KnownEntry:
    id: str
    runner: str
    targets: tuple[str, ...]
    kind: str  # "divergence" | "refusal"
    reason: str
    reproduce: str
    signature: str | None = None
    klass: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class Verdict:
    status: str  # "identical" | "known" | "numerics" | "refused" | "divergent"
    divergence: Divergence | None = None
    known: KnownEntry | None = None
    detail: str = ""

    @property
    def fails(self) -> bool:
        return self.status == "divergent"

    def format(self) -> str:
        if self.status == "identical":
            return "identical" + (f" ({self.detail})" if self.detail else "")
        if self.known is not None:
            return f"{self.status}: known reference behaviour {self.known.id!r}" + (
                f"\n{self.divergence.message}" if self.divergence else ""
            )
        if self.divergence is not None:
            return self.divergence.message
        return self.detail


@cache
def known_entries(path: str = str(KNOWN_FILE)) -> tuple[KnownEntry, ...]:
    data = tomllib.loads(Path(path).read_text())
    out = []
    for e in data.get("entry", []):
        out.append(
            KnownEntry(
                id=e["id"], runner=e["runner"], targets=tuple(e.get("targets", ())), kind=e["kind"],
                reason=e["reason"].strip(), reproduce=e["reproduce"], signature=e.get("signature"),
                klass=e.get("class"), message=e.get("message"),
            )
        )
    return tuple(out)


def _target(trace: Trace) -> str:
    return str(trace.header["case_id"]).split("/")[0]


def applies_to(entry: KnownEntry, target: str) -> bool:
    """An entry names zoo targets, or ``"*"``: a behaviour of the reference's own
    code that its signature/message pins down on any model (a user's too)."""
    return "*" in entry.targets or target in entry.targets


def fallback_point(trace: Trace) -> tuple[int, int] | None:
    """``(rounds before, output tokens before)`` the engine's first fallback plain step."""
    emitted = 0
    rounds = 0
    for ev in trace.events:
        if ev["type"] == "plain" and ev.get("reason") in FALLBACK_REASONS:
            return rounds, emitted
        if ev["type"] == "round":
            rounds += 1
        emitted += len(ev["emitted"])
    return None


def _prefix(trace: Trace, n_rounds: int, footer: dict[str, Any]) -> Trace:
    records = [trace.header]
    if trace.prefill is not None:
        records.append(trace.prefill)
    records += trace.rounds[:n_rounds]
    records.append(footer)
    return Trace.from_records(records)


def _first_output_divergence(a: Trace, b: Trace) -> int | None:
    oa, ob = a.footer["output_ids"], b.footer["output_ids"]
    for i, (x, y) in enumerate(zip(oa, ob, strict=False)):
        if x != y:
            return i
    return None if len(oa) == len(ob) else min(len(oa), len(ob))


def _match_divergence(engine: Trace, ref: Trace, runner: str, div: Divergence) -> KnownEntry | None:
    target = _target(engine)
    point = fallback_point(engine)
    for e in known_entries():
        if e.kind != "divergence" or e.runner != runner or not applies_to(e, target):
            continue
        if e.klass is not None and div.klass != e.klass:
            continue
        if e.signature == "after-ring-wrap":
            first = _first_output_divergence(engine, ref)
            if point is None or first is None or first < point[1]:
                continue
        return e
    return None


def compare_with_reference(
    engine: Trace, ref: Trace, runner: str, eps: float | None = None, witness: Witness | None = None
) -> Verdict:
    """The verdict for an engine trace against a reference trace of the same case.

    ``witness`` (``engine.witness``) judges a differing target sample when the
    models are at hand; without it the diff's eps fallback classifies it.
    """
    kw: dict[str, Any] = {"witness": witness}
    if eps is not None:
        kw["eps"] = eps
    point = fallback_point(engine)
    if point is None:
        div = diff_traces(engine, ref, level="round", **kw)
        detail = "round for round"
    else:
        n_rounds = point[0]
        footer = engine.footer
        div = diff_traces(_prefix(engine, n_rounds, footer), _prefix(ref, n_rounds, footer), level="round", **kw)
        if div is None:
            div = diff_traces(engine, ref, level="tokens", **kw)
        detail = f"round for round over the {n_rounds} rounds before the engine's fallback, then tokens"
    if div is None:
        return Verdict("identical", detail=detail)
    known = _match_divergence(engine, ref, runner, div)
    if known is not None:
        return Verdict("known", div, known)
    if point is not None and div.level == "tokens" and div.basis == "witness" and div.klass == "numerics":
        # After the engine's fallback it decodes one token per forward while the
        # reference keeps verifying windows: two arithmetic paths by design (§2.1).
        return Verdict("numerics", div, detail=f"{detail}; a witnessed arithmetic flip after the fallback")
    return Verdict("divergent", div)


def refusal_verdict(engine: Trace, refused: ReferenceRefused) -> Verdict:
    target = _target(engine)
    for e in known_entries():
        if (
            e.kind == "refusal"
            and e.runner == refused.runner
            and applies_to(e, target)
            and e.message is not None
            and e.message in refused.message
        ):
            return Verdict("refused", known=e, detail=refused.message)
    return Verdict("divergent", detail=f"unexplained refusal: {refused}")
