"""One comparison contract: every comparison a job emits, declared once, and the result type.

Every comparison kind the jobs can produce is declared in :data:`KINDS` with the job(s) that
produce it and how it is judged; a :class:`Comparison` of an undeclared kind is refused at
construction, so a check added next time is declared here (and reached by
``tests/test_comparison_kinds.py``, which enumerates :data:`KINDS` and runs each one's job under
the CPU double of a non-bit-exact backend, ``engine/nonexact.py``).

How every kind is judged (issue 39), one path that knows the backend
(``engine.backend.arithmetic``): byte and token equality where the backend is bit-exact;
elsewhere the fields that are pure arithmetic (cache digests, margins, confidence) are set
aside, a token flip goes through the numerics witness (each run's own pipeline replayed; for a
batched row, in its own batch: ``engine.batched_check.classify_row``) and cache bytes are held
within the bound calibrated on this device (``engine.cache_compare``); a structural difference
stays ``logic``. A missing op is ``unsupported`` (``engine.backend.run_supported``), never a
crash and never a failure.

Used by ``specparity.jobs.run`` (the main job), ``specparity.jobs.batched`` (the batched
cases) and ``specparity.grading.trace_folders`` (``grade DIR``); they import it, not each other.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from traces.diff import Divergence
from traces.reference import ReferenceRefused, compare_with_reference, refusal_verdict

__all__ = ["ARITHMETIC_KINDS", "KINDS", "Comparison", "Kind", "compare_supported", "kind_of", "not_compared",
           "numerics_witness", "reference_comparison", "tokens_comparison", "unsupported_comparison"]

_TOKENS = ("tokens: equal where the backend is bit-exact; elsewhere a flip is numerics only when the numerics "
           "witness replays each run's own pipeline to its own token (traces.diff + engine.witness)")
_ROUNDS = ("round for round: every record field byte-equal where bit-exact; elsewhere arithmetic fields set "
           "aside, flips through the witness, anything structural logic")


@dataclass(frozen=True)
class Kind:
    """One comparison kind: ``name`` (``<oracle>``, ``<runner>``: any registered name), the jobs
    producing it (``run``, ``grade``, ``sessions``, ``bench-batched``), ``judged``: how, and
    ``arithmetic``: two lanes of our engine on one device, which may differ by arithmetic alone
    (a witnessed ``numerics`` is reported, never failed). ``conditional``: produced only in the
    situation named (not by a default job)."""

    name: str
    jobs: tuple[str, ...]
    judged: str
    arithmetic: bool = False
    conditional: str | None = None

    def matches(self, kind: str) -> bool:
        pattern = re.escape(self.name).replace(re.escape("<oracle>"), r"[\w.-]+").replace(
            re.escape("<runner>"), r"[\w.-]+")
        return re.fullmatch(pattern, kind) is not None


KINDS: tuple[Kind, ...] = (
    Kind("spec-vs-plain", ("run", "grade"), _TOKENS, arithmetic=True),
    Kind("engine-vs-<oracle>", ("run", "grade"),
         "round for round against a reference (traces.reference: known divergences, refusals); a flip through "
         "the witness, numerics only after the engine's fallback"),
    Kind("verify-path", ("run",),
         "off a bit-exact backend only: which arithmetic produced the verify rows (engine.witness.verify_path); "
         "serial is logic"),
    Kind("fill-vs-plain", ("run",), _TOKENS + "; fill's appends replayed as one forward (engine/fill/witness.py)",
         arithmetic=True),
    Kind("batched-vs-serial", ("run",), _ROUNDS + "; engine.batched_check.classify_row: the row replayed in its "
         "own batch, its caches after every batched round within the calibrated bound"),
    Kind("batched-M", ("run",), "verify rows vs one-token decode: 0 ULP where bit-exact; elsewhere within the "
         "stated bound or 2 × the measured logit spread, caches within the calibrated bound"),
    Kind("batched-B", ("run",), "a row alone vs in the mixed batch, token for token; a flip weighed with both "
         "blocks (reproduced, within the bound, each run's own pick or draw)"),
    Kind("batched-seeded", ("run",), "sampled rows batched vs alone (and plain decode where bit-exact), token "
         "for token; a flip weighed as for B"),
    Kind("warm-vs-cold", ("grade", "sessions"),
         "records byte-equal where bit-exact; elsewhere engine.cache_compare.judge_request: caches at start, "
         "after prefill and at the end within the calibrated bound, flips witnessed from the warm caches"),
    Kind("bench-identity", ("bench-batched",),
         "each batched row vs its serial run through engine.batched_check.classify_row; throughput over "
         "identical-or-numerics rows, a logic row refuses the figure"),
    Kind("reference", ("run", "grade"), "not compared: a sampled speculative case no available reference "
         "implements", conditional="a sampled case no reference implements"),
    Kind("<runner> run", ("run",), "unsupported: a run the backend could not make that no comparison needed",
         conditional="a missing op on a run no comparison needs"),
)

# Comparisons of two lanes of the engine on one device, which may differ only by arithmetic
# (a multi-token forward vs one-token decode, §2.1): a witnessed ``numerics`` flip is reported,
# never failed.
ARITHMETIC_KINDS = tuple(k.name for k in KINDS if k.arithmetic)


def kind_of(kind: str) -> Kind:
    """The declaration of ``kind`` (a ValueError naming it when it is not declared in :data:`KINDS`)."""
    for k in KINDS:
        if k.matches(kind):
            return k
    raise ValueError(f"comparison kind {kind!r} is not declared in specparity.jobs.comparison.KINDS")


@dataclass
class Comparison:
    kind: str  # a kind declared in KINDS ("engine-vs-<oracle>", "spec-vs-plain", ...)
    case_id: str
    level: str
    divergence: Divergence | None
    known: str | None = None  # id of a known reference behaviour that explains it
    status: str | None = None  # reference verdict status ("refused", "known", "unsupported", ...)
    detail: str = ""
    # a trace it needs was not made: the backend lacks an op (engine/backend.py unsupported_payload + runner)
    unsupported: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        kind_of(self.kind)

    @property
    def verdict(self) -> str:
        if self.status == "unsupported" and self.unsupported is not None:
            return str(self.unsupported["verdict"])
        if self.status == "not-compared":
            return "not compared"
        if self.known is not None:
            return f"{self.status}: {self.known}"
        if self.status == "divergent" and self.divergence is None:
            return "unexplained refusal"
        if self.divergence is None:
            return "identical"
        return self.divergence.label  # "numerics?"/"logic?": eps-based, no witness

    @property
    def fails(self) -> bool:
        if self.status == "unsupported":  # a fact about the backend, not a finding
            return False
        if self.known is not None:
            return False
        if self.status == "divergent" and self.divergence is None:
            return True
        if self.divergence is None:
            return False
        # Against a reference every difference is a failure, except a witnessed
        # arithmetic flip after the engine's fallback (status "numerics"); spec (or
        # fill) vs plain may differ only by arithmetic (batched vs serial, §2.1).
        if self.divergence.klass == "logic":
            return True
        return self.kind not in ARITHMETIC_KINDS and self.status != "numerics"

    @property
    def message(self) -> str | None:
        if self.divergence is not None:
            return self.divergence.message
        return self.detail or None


def not_compared(case: Any, case_id: str | None = None) -> Comparison:
    """The entry of a sampled speculative case that no available reference implements.

    Said as such (never counted as identical, never failed) so a report does not
    read it as conforming or as a run that stopped early.
    """
    return Comparison("reference", case_id or case.case_id, "none", None, status="not-compared",
                      detail=f"no available reference implements the {case.source} source, and "
                             "sampled speculative output is not token-identical to plain decode")


def unsupported_comparison(kind: str, case_id: str, runners: list[str], info: dict[str, Any]) -> Comparison:
    """The entry of a comparison whose traces by ``runners`` the backend could not make (``info``:
    :func:`engine.backend.unsupported_payload` of the first): ``unsupported on <device>: <op>``,
    MLX's error line as its message; never failed, never identical."""
    return Comparison(kind, case_id, "none", None, status="unsupported",
                      detail=f"{', '.join(runners)}: {info['line']}",
                      unsupported={**info, "runner": runners[0], "runners": list(runners)})


def compare_supported(kind: str, case_id: str, runners: list[str], fn: Callable[[], Comparison]) -> Comparison:
    """``fn()`` (a comparison that replays: the witness, a calibration), or its ``unsupported`` entry
    when the replay hits an op the backend lacks (``engine.backend.run_supported``)."""
    from engine.backend import Unsupported, run_supported

    got = run_supported(fn, f"{kind} {case_id}")
    return unsupported_comparison(kind, case_id, runners, got.info) if isinstance(got, Unsupported) else got


def tokens_comparison(kind: str, case_id: str, a: Any, b: Any, witness: Any = None) -> Comparison:
    """Traces ``a`` and ``b`` token for token (``traces.diff.diff_traces``, a flip through ``witness``)."""
    from traces.diff import diff_traces

    return Comparison(kind, case_id, "tokens", diff_traces(a, b, level="tokens", witness=witness))


def numerics_witness() -> Any:
    """The numerics witness of a run's comparisons (``specparity.runners.numerics_witness``)."""
    from specparity.runners import numerics_witness as witness

    return witness()


def reference_comparison(
    oracle: str, case_id: str, eng: Any, ref: Any, witness: Any = None
) -> Comparison:
    """The engine's trace ``eng`` against reference ``oracle``'s trace (or its refusal), as
    ``traces.reference`` judges it (known divergences, the witness)."""
    if isinstance(ref, ReferenceRefused):
        v = refusal_verdict(eng, ref)
    else:
        v = compare_with_reference(eng, ref, oracle, witness=witness)
    return Comparison(
        f"engine-vs-{oracle}", case_id, "round", v.divergence,
        known=v.known.id if v.known is not None else None, status=v.status, detail=v.detail,
    )
