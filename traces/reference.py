"""Comparing an engine trace with a reference trace, under the known-divergence manifest.

The policy every caller uses (the main job, the conformance suite, the golden
comparison), so a reference bug is classified the same way everywhere:

1. If the engine stopped speculating (a ``plain`` record with reason
   ``ring-wrap``/``no-rollback``/``quantized-kv``), the rounds BEFORE that point are compared
   round for round (they must be identical) and the whole run at the token
   level; otherwise the whole traces are compared round for round.
2. A divergence that matches an entry of ``traces/known_divergences.toml``
   (runner, target family, and the entry's signature — e.g. the first
   divergence lies at or after the engine's ring-wrap point) is
   ``known`` with that entry's id; any other divergence is ``divergent``.
   The ring-wrap point is the guard's fallback (``--rotating guard``) or, for
   a trace that speculates past the wrap (``params.rotating`` ``exact``), the
   first round whose window could reach ``params.sliding_window`` — the same
   round the guard would have stopped at. The quantized-KV point is the first
   round whose window could reach ``params.quantized_kv_start`` (where mlx-lm
   converts its caches on an offset that counts the window's drafts).
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
FALLBACK_REASONS = ("ring-wrap", "no-rollback", "quantized-kv")


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


def fallback_reason(trace: Trace) -> str | None:
    """The reason of the engine's first fallback plain step (None: it never fell back)."""
    return next((ev.get("reason") for ev in trace.events
                 if ev["type"] == "plain" and ev.get("reason") in FALLBACK_REASONS), None)


def _round_points(trace: Trace) -> list[tuple[int, int, int]]:
    """``(target offset before, output tokens before, window reach)`` of every round.

    The target's committed offset is the prefill's plus ``k_accept + 1`` per round; the
    reach is the offset after a window of ``min(gamma, tokens left) + 1`` positions,
    the window the round could have (the guards' ``offset + n + 1``).
    """
    p = trace.header.get("params") or {}
    gamma, budget = int(p.get("gamma") or 0), int(p.get("max_tokens") or 0)
    offset = len(trace.prefill["target_tokens"]) if trace.prefill is not None else 0
    emitted = 0
    out = []
    for ev in trace.events:
        if ev["type"] == "round":
            out.append((offset, emitted, offset + min(gamma, budget - emitted) + 1))
            offset += int(ev["k_accept"]) + 1
        emitted += len(ev["emitted"])
    return out


def _first_round_reaching(trace: Trace, limit: int) -> tuple[int, int] | None:
    for r, (_, emitted, reach) in enumerate(_round_points(trace)):
        if reach >= limit:
            return r, emitted
    return None


def wrap_point(trace: Trace) -> tuple[int, int] | None:
    """``(rounds before, output tokens before)`` the engine's ring-wrap point (module doc)."""
    if fallback_reason(trace) == "ring-wrap":
        return fallback_point(trace)
    p = trace.header.get("params") or {}
    if p.get("rotating") != "exact" or not p.get("sliding_window"):
        return None
    return _first_round_reaching(trace, int(p["sliding_window"]))


def kv_quantization_point(trace: Trace) -> tuple[int, int] | None:
    """``(rounds before, output tokens before)`` the first round whose window could reach
    ``quantized_kv_start`` (None: no ``kv_bits``, or the prefill already converted)."""
    p = trace.header.get("params") or {}
    if p.get("kv_bits") is None:
        return None
    start = int(p.get("quantized_kv_start", 5000))
    points = _round_points(trace)
    if points and points[0][0] >= start and points[0][0] > 0:
        return None  # converted after the prefill, in both
    if fallback_reason(trace) == "quantized-kv":
        return fallback_point(trace)
    return _first_round_reaching(trace, start)


def _at_or_after(div: Divergence, point: tuple[int, int] | None, engine: Trace, ref: Trace) -> bool:
    """Whether the first divergence lies at or after ``point`` (round index or output token)."""
    if point is None:
        return False
    where = div.where.split()
    if where[0] == "round" and len(where) == 2 and where[1].isdigit():
        return int(where[1]) >= point[0]
    first = _first_output_divergence(engine, ref)
    return first is not None and first >= point[1]


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
    for e in known_entries():
        if e.kind != "divergence" or e.runner != runner or not applies_to(e, target):
            continue
        if e.klass is not None and div.klass != e.klass:
            continue
        if e.signature == "after-ring-wrap" and not _at_or_after(div, wrap_point(engine), engine, ref):
            continue
        if e.signature == "after-kv-quantization" and not _at_or_after(
                div, kv_quantization_point(engine), engine, ref):
            continue
        if e.signature == "grammar-spec" and not (
                engine.header.get("mode") == "spec" and (engine.header.get("params") or {}).get("grammar")):
            continue
        if e.signature not in (None, "after-ring-wrap", "after-kv-quantization", "grammar-spec"):
            continue  # a signature this code does not know never excuses anything
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
    if (engine.header.get("params") or {}).get("grammar"):
        # Grammar cases: the engine's drafter runs free (§2) while a processor-based reference
        # masks its drafts too, and the engine ends on grammar termination where the reference
        # samples the EOS the mask forces, so the records differ by design: the emitted tokens,
        # usage and, position by position, the masks they were drawn under must not
        # (INTERPRETING.md "Grammar").
        div = diff_traces(engine, ref, level="tokens", **kw)
        detail = "tokens and grammar masks, position by position"
    elif point is None:
        div = diff_traces(engine, ref, level="round", **kw)
        detail = "round for round"
    elif point[0] == 0 and fallback_reason(engine) in ("quantized-kv", "no-rollback"):
        # The engine never opened speculation (no drafter prefill): only the tokens compare.
        div = diff_traces(engine, ref, level="tokens", **kw)
        detail = f"tokens (the engine did not speculate: {fallback_reason(engine)})"
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
