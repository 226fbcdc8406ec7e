"""First-divergence diff of two specparity traces, with numerics/logic classification.

Three comparison levels, strictest first (see ``traces/INTERPRETING.md``):

``round``
    prefill tokens (and cache digests when both present), every round/plain
    record in file order (token fields, ``end``, digests when both present),
    record counts, then the footer (usage, speculation, output_ids).
``tokens``
    footer ``output_ids``, then ``usage`` (generation_tokens, finish_reason,
    prompt_tokens).  Works between a spec and a plain trace.
``acceptance``
    footer ``speculation`` counters only.

The first difference found becomes a :class:`Divergence` with a class and the
basis of that class (``traces/INTERPRETING.md`` "Classification"):

``structural``
    no differing target sample explains it (feed, drafts, digests, counters,
    record counts, a run that stopped): always ``logic``.
``witness``
    a differing target sample (a :class:`Flip`) re-evaluated by a numerics
    witness -- a callback given to :func:`diff_traces` that replays both runs'
    arithmetic paths on the same prefix with the models at hand
    (``engine/witness.py``); ``numerics`` only when each run's own path
    reproduces its own token, ``logic`` otherwise.
``eps``
    a differing sample without a witness (two files from elsewhere): the
    recorded top-1/top-2 margins are checked against ``eps``, an assumed bound
    on the per-logit difference between the two arithmetic paths.  Noise of at
    most ``eps`` per logit can swap two greedy picks only if ``margin_a +
    margin_b <= 2 * eps`` (run A's pick leads run B's by at least ``margin_a``
    on A's logits and trails it by at least ``margin_b`` on B's), so that is
    when the class is ``numerics``; it is labelled ``numerics?`` / ``logic?``
    because nothing was re-evaluated.

``diff_main`` implements ``specparity diff A B [--level L] [--eps E]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from traces.io import Record, Trace, TraceFormatError, read_trace

__all__ = [
    "BASES",
    "DEFAULT_EPS",
    "LEVELS",
    "Divergence",
    "Flip",
    "TokenSite",
    "Witness",
    "WitnessDeclined",
    "WitnessVerdict",
    "batch_context",
    "diff_main",
    "diff_traces",
    "grammar_divergence",
    "grammar_sites",
    "token_origin",
]

LEVELS = ("round", "tokens", "acceptance")
DEFAULT_EPS = 1e-3
BASES = ("witness", "eps", "structural")

ROUND_FIELDS = ("feed", "drafts", "window", "samples", "k_accept", "emitted", "end")
PLAIN_FIELDS = ("input", "sample", "emitted", "end")
ROUND_DIGESTS = ("target_cache_digest", "drafter_cache_digest")
PLAIN_DIGESTS = ("target_cache_digest",)
# Optional grammar fields (grammar-constrained runs): compared only when both records carry them.
ROUND_GRAMMAR = ("grammar_masks", "grammar_state")
PLAIN_GRAMMAR = ("grammar_mask", "grammar_state")
USAGE_FIELDS_ROUND = ("prompt_tokens", "generation_tokens", "finish_reason")
USAGE_FIELDS_TOKENS = ("generation_tokens", "finish_reason", "prompt_tokens")
SPECULATION_FIELDS = (
    "drafted",
    "accepted",
    "rejected",
    "target_calls",
    "rounds",
    "acceptance_lengths",
    "drafted_by_pos",
    "accepted_by_pos",
)


@dataclass(frozen=True)
class TokenSite:
    """Where one run sampled the contested token.

    Attributes:
        event: Index into ``trace.events`` of the record that sampled it.
        record: ``"round 2"`` / ``"plain 5"``.
        position: Window position in that round, or ``None`` for a plain record.
        token: The token the run sampled there (an EOS sample included).
        margin: The recorded top-1/top-2 margin there, if any.
    """

    event: int
    record: str
    position: int | None
    token: int
    margin: float | None


@dataclass(frozen=True)
class Flip:
    """A token-level divergence: the two runs sampled different tokens after the same prefix.

    Attributes:
        output_index: Index of the contested token in the output (tokens
            level), or ``None`` at round level.
        a: Where trace A sampled it.
        b: Where trace B sampled it.
        lane: ``"target"`` (a target sample; ``position`` is the window
            position) or ``"drafter"`` (a draft; ``position`` is the draft
            index in the round, same feed and earlier rounds in both runs).
    """

    output_index: int | None
    a: TokenSite
    b: TokenSite
    lane: str = "target"


@dataclass(frozen=True)
class WitnessVerdict:
    """What a numerics witness found about a :class:`Flip`.

    Attributes:
        klass: ``"numerics"`` (each run's own arithmetic path reproduces its
            own token on the same prefix) or ``"logic"``.
        reason: One line saying why.
        evidence: Lines of evidence (each path's top-2 ids and logits, Δ).
        data: The same evidence as JSON-able data.
    """

    klass: str
    reason: str
    evidence: tuple[str, ...] = ()
    data: dict[str, Any] = field(default_factory=dict)


class WitnessDeclined(Exception):
    """Raised by a witness that cannot judge a flip, with the reason (the diff falls back to eps)."""


Witness = Callable[["Trace", "Trace", Flip], "WitnessVerdict | None"]
"""``witness(a, b, flip)``: a verdict, or ``None`` when it cannot judge (no models, sampling)."""


@dataclass(frozen=True)
class Divergence:
    """The first difference between two traces.

    Attributes:
        level: Comparison level that found it.
        where: ``"prefill"``, ``"round 3"``, ``"plain 0"``, ``"event 4"``,
            ``"output token 17"`` or ``"footer"``.
        field: The differing field, e.g. ``"feed"``, ``"usage.finish_reason"``.
        value_a: The field's value in trace A (``None`` if absent).
        value_b: The field's value in trace B (``None`` if absent).
        klass: ``"numerics"`` or ``"logic"``.
        margin: Margin of the first differing target sample (smaller of the
            two traces'), or ``None`` when no sample differs.
        message: Multi-line human-readable explanation.
        position: Window position (round records) or output token index
            (tokens level) of the first differing sample/token, if any.
        eps: The threshold used by the eps basis.
        basis: ``"witness"``, ``"eps"`` or ``"structural"`` (module docstring).
        flip: The contested token of each run, when samples differ.
        witness: The witness's verdict, when one judged the flip.
    """

    level: str
    where: str
    field: str
    value_a: Any
    value_b: Any
    klass: str
    margin: float | None
    message: str
    position: int | None = None
    eps: float = DEFAULT_EPS
    basis: str = "structural"
    flip: Flip | None = None
    witness: WitnessVerdict | None = None

    @property
    def label(self) -> str:
        """The class as shown to people: ``numerics?`` / ``logic?`` when only eps-based."""
        return self.klass + ("?" if self.basis == "eps" else "")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (class, basis, place, witness evidence)."""
        return {
            "level": self.level, "where": self.where, "field": self.field,
            "class": self.klass, "basis": self.basis, "label": self.label,
            "margin": self.margin, "eps": self.eps if self.basis == "eps" else None,
            "witness": None if self.witness is None else {
                "class": self.witness.klass, "reason": self.witness.reason, **self.witness.data,
            },
        }


def eps_class(margin_a: float | None, margin_b: float | None, eps: float) -> str:
    """``numerics`` when per-logit noise of at most ``eps`` can swap the two greedy picks."""
    if margin_a is None or margin_b is None:
        return "logic"
    return "numerics" if margin_a + margin_b <= 2 * eps else "logic"


class _Ctx:
    """Carries labels, eps and the witness so divergences can be built in one call."""

    def __init__(self, a: Trace, b: Trace, level: str, eps: float, witness: Witness | None) -> None:
        self.a, self.b, self.level, self.eps, self.witness = a, b, level, eps, witness

    def make(
        self,
        where: str,
        fld: str,
        va: Any,
        vb: Any,
        *,
        margin: float | None = None,
        position: int | None = None,
        note: str = "",
        flip: Flip | None = None,
    ) -> Divergence:
        lines = [
            f"traces diverge at {where}, field {fld!r} (level {self.level})",
            f"  a: {_short(va)}    [{self.a.label()}]",
            f"  b: {_short(vb)}    [{self.b.label()}]",
        ]
        if note:
            lines.append(f"  {note}")
        verdict: WitnessVerdict | None = None
        if flip is None:
            klass, basis = "logic", "structural"
            lines.append(f"  class: {klass} (structural: no differing target sample explains it)")
        else:
            failure = ""
            if self.witness is not None:
                try:
                    verdict = self.witness(self.a, self.b, flip)
                except WitnessDeclined as exc:
                    failure = f"witness declined: {exc}; "
                except Exception as exc:  # noqa: BLE001 - reported, then the eps fallback
                    failure = f"witness failed ({type(exc).__name__}: {exc}); "
            ma, mb = flip.a.margin, flip.b.margin
            if verdict is not None:
                klass, basis = verdict.klass, "witness"
                lines.append(f"  class: {klass} (witness: {verdict.reason})")
                lines.extend(f"    {e}" for e in verdict.evidence)
            else:
                klass, basis = eps_class(ma, mb, self.eps), "eps"
                why = failure or ("no witness (models not at hand); " if self.witness is None
                                  else "the witness cannot judge this flip; ")
                if flip.lane == "drafter":
                    rule = "drafts carry no margins"
                elif ma is None or mb is None:
                    rule = "a margin is missing"
                else:
                    cmp = "<=" if klass == "numerics" else ">"
                    rule = f"margins {ma:.6g} + {mb:.6g} {cmp} 2 x eps {self.eps:g}"
                lines.append(f"  class: {klass}? (eps-based, {why}{rule})")
        lines.append(f"  margin: {'n/a' if margin is None else f'{margin:.6g}'}")
        return Divergence(
            level=self.level,
            where=where,
            field=fld,
            value_a=va,
            value_b=vb,
            klass=klass,
            margin=margin,
            message="\n".join(lines),
            position=position,
            eps=self.eps,
            basis=basis,
            flip=flip,
            witness=verdict,
        )


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def common_prefix(x: Sequence[Any], y: Sequence[Any]) -> int:
    """Length of the longest common prefix of ``x`` and ``y`` (compared element by element)."""
    i = _first_diff(x, y)
    return min(len(x), len(y)) if i is None else i


def _first_diff(x: Sequence[Any], y: Sequence[Any]) -> int | None:
    """Index of the first differing element over the common prefix, else None."""
    for i, (p, q) in enumerate(zip(x, y, strict=False)):
        if p != q:
            return i
    return None


def _at(seq: Any, i: int) -> Any:
    return seq[i] if isinstance(seq, list) and 0 <= i < len(seq) else None


def _min_margin(ma: Any, mb: Any) -> float | None:
    vals = [float(m) for m in (ma, mb) if isinstance(m, int | float)]
    return min(vals) if len(vals) == 2 else None


def _site(e: Record, k: int, position: int | None, margin: Any) -> TokenSite:
    token = _at(e.get("samples"), position) if position is not None else e.get("sample")
    return TokenSite(k, _event_name(e, k), position, int(token) if isinstance(token, int) else -1,
                     float(margin) if isinstance(margin, int | float) else None)


def _classify_round(
    ra: Record, rb: Record, k: int
) -> tuple[float | None, int | None, str, Flip | None]:
    """Margin/position/flip of the first differing sample of two rounds (no flip: logic).

    A differing target sample on a common window prefix is a target flip;
    otherwise differing drafts (same feed, same earlier rounds) are a
    drafter flip at the first differing draft.
    """
    if ra.get("feed") != rb.get("feed"):
        return None, None, "feed differs: the drafter was given different input (trim / re-feed)", None
    sa, sb = ra.get("samples") or [], rb.get("samples") or []
    p = _first_diff(sa, sb)
    wa, wb = ra.get("window") or [], rb.get("window") or []
    if p is not None and wa[: p + 1] == wb[: p + 1]:
        mpa, mpb = _at(ra.get("margins"), p), _at(rb.get("margins"), p)
        flip = Flip(None, _site(ra, k, p, mpa), _site(rb, k, p, mpb))
        return _min_margin(mpa, mpb), p, f"first differing sample at window position {p}: {sa[p]} vs {sb[p]}", flip
    da, db = ra.get("drafts") or [], rb.get("drafts") or []
    i = _first_diff(da, db)
    if i is not None:
        flip = Flip(None, _draft_site(ra, k, i), _draft_site(rb, k, i), lane="drafter")
        return None, i, f"first differing draft at index {i}: {da[i]} vs {db[i]} (same feed)", flip
    if p is None:
        return None, None, "samples agree on their common prefix", None
    return None, p, f"samples differ at window position {p}, but the windows differ at or before it", None


def _draft_site(e: Record, k: int, i: int) -> TokenSite:
    return TokenSite(k, _event_name(e, k), i, int(e["drafts"][i]), None)


def _classify_plain(pa: Record, pb: Record, k: int) -> tuple[float | None, str, Flip | None]:
    if pa.get("input") != pb.get("input"):
        return None, "input differs: the target was given different input", None
    if pa.get("sample") == pb.get("sample"):
        return None, "samples agree", None
    flip = Flip(None, _site(pa, k, None, pa.get("margin")), _site(pb, k, None, pb.get("margin")))
    return _min_margin(pa.get("margin"), pb.get("margin")), (
        f"samples differ: {pa.get('sample')} vs {pb.get('sample')}"
    ), flip


def _event_name(e: Record, k: int) -> str:
    return f"{e.get('type')} {e.get('index', k)}"


def _diff_prefill(c: _Ctx) -> Divergence | None:
    pa, pb = c.a.prefill, c.b.prefill
    if pa is None and pb is None:
        return None
    if pa is None or pb is None:
        return c.make("prefill", "prefill", pa is not None, pb is not None,
                      note="one trace has a prefill record and the other does not")
    for fld in ("target_tokens", "drafter_tokens"):
        if pa.get(fld) != pb.get(fld):
            return c.make("prefill", fld, pa.get(fld), pb.get(fld))
    for fld in ROUND_DIGESTS:
        da, db = pa.get(fld), pb.get(fld)
        if da is not None and db is not None and da != db:
            return c.make("prefill", fld, da, db)
    return None


def _diff_events(c: _Ctx) -> Divergence | None:
    for k, (ea, eb) in enumerate(zip(c.a.events, c.b.events, strict=False)):
        ta, tb = ea.get("type"), eb.get("type")
        if ta != tb:
            return c.make(f"event {k}", "type", _event_name(ea, k), _event_name(eb, k),
                          note="the traces interleave round and plain records differently")
        where = _event_name(ea, k)
        fields, digests = (ROUND_FIELDS, ROUND_DIGESTS) if ta == "round" else (PLAIN_FIELDS, PLAIN_DIGESTS)
        diff_field = next((f for f in fields if ea.get(f) != eb.get(f)), None)
        if diff_field is None:
            diff_field = next(
                (
                    f
                    for f in digests
                    if ea.get(f) is not None and eb.get(f) is not None and ea.get(f) != eb.get(f)
                ),
                None,
            )
        if diff_field is None:
            gfields = ROUND_GRAMMAR if ta == "round" else PLAIN_GRAMMAR
            diff_field = next((f for f in gfields if f in ea and f in eb and ea[f] != eb[f]), None)
            if diff_field is not None:
                return _grammar_field(c, where, diff_field, ea, eb)
        if diff_field is None:
            continue
        va, vb = ea.get(diff_field), eb.get(diff_field)
        if ta == "round":
            margin, pos, note, flip = _classify_round(ea, eb, k)
            return c.make(where, diff_field, va, vb, margin=margin, position=pos, note=note, flip=flip)
        margin, note, flip = _classify_plain(ea, eb, k)
        return c.make(where, diff_field, va, vb, margin=margin, note=note, flip=flip)
    for kind, xa, xb in (("round", c.a.rounds, c.b.rounds), ("plain", c.a.plains, c.b.plains)):
        if len(xa) != len(xb):
            return c.make(f"{kind} {min(len(xa), len(xb))}", f"{kind}s", len(xa), len(xb),
                          note=f"the traces have a different number of {kind} records")
    if len(c.a.events) != len(c.b.events):  # pragma: no cover - implied by the counts above
        return c.make(f"event {min(len(c.a.events), len(c.b.events))}", "events",
                      len(c.a.events), len(c.b.events))
    return None


def _grammar_field(c: _Ctx, where: str, fld: str, ea: Record, eb: Record) -> Divergence:
    """Two records equal in every token field whose grammar masks or matcher states differ."""
    va, vb = ea.get(fld), eb.get(fld)
    pos = _first_diff(va, vb) if isinstance(va, list) and isinstance(vb, list) else None
    if fld == "grammar_state":
        note = "the matchers differ after the same emitted tokens (advanced on a different token stream)"
    elif pos is not None:
        note = f"grammar masks differ at window position {pos} (the allowed sets the samples were drawn under)"
    else:
        note = "grammar masks differ (the allowed set the sample was drawn under)"
    return c.make(where, fld, va, vb, position=pos, note=note)


def grammar_sites(trace: Trace) -> list[tuple[str, int | None, int, str]]:
    """One entry per walked position of a grammar-constrained trace, in output order.

    Entry ``j`` is ``(record name, window position or None, sampled token,
    mask digest)`` for output token ``j`` (a terminal EOS sample included).
    Records without grammar fields contribute nothing.
    """
    out: list[tuple[str, int | None, int, str]] = []
    for k, e in enumerate(trace.events):
        name = _event_name(e, k)
        if e.get("type") == "round" and isinstance(e.get("grammar_masks"), list):
            samples = e.get("samples") or []
            for j, digest in enumerate(e["grammar_masks"]):
                out.append((name, j, int(_at(samples, j) if _at(samples, j) is not None else -1), digest))
        elif e.get("type") == "plain" and isinstance(e.get("grammar_mask"), str):
            out.append((name, None, int(e.get("sample", -1)), e["grammar_mask"]))
    return out


def grammar_divergence(a: Trace, b: Trace) -> Divergence | None:
    """The first output position where two grammar-constrained runs' masks or samples differ.

    Works across structures (a speculative trace against a plain one): both
    are read as one walked position per output token (``grammar_sites``), so
    the divergence names the round and window position in each trace where
    the allowed sets (mask digests) or the tokens drawn under them first
    differ. ``None`` when neither carries grammar fields or they agree on
    their common length and have the same length.
    """
    ga, gb = grammar_sites(a), grammar_sites(b)
    if not ga and not gb:
        return None
    c = _Ctx(a, b, "tokens", DEFAULT_EPS, None)

    def at(sites: list[tuple[str, int | None, int, str]], j: int) -> str:
        if j >= len(sites):
            return "no walked position (the run ended)"
        name, pos, tok, dig = sites[j]
        return f"{name}{'' if pos is None else f' window position {pos}'} (token {tok}, mask {dig})"

    for j, (sa, sb) in enumerate(zip(ga, gb, strict=False)):
        if sa[3] != sb[3]:
            return c.make(f"output token {j}", "grammar_mask", sa[3], sb[3], position=j,
                          note=f"masks differ: a at {at(ga, j)}; b at {at(gb, j)}")
        if sa[2] != sb[2]:
            return c.make(f"output token {j}", "sample", sa[2], sb[2], position=j,
                          note=f"same mask, different token: a at {at(ga, j)}; b at {at(gb, j)}")
    if len(ga) != len(gb) and not _forced_eos(a, ga, b, gb):
        j = min(len(ga), len(gb))
        return c.make(f"output token {j}", "grammar_mask", len(ga), len(gb), position=j,
                      note=f"one run walked more positions: a at {at(ga, j)}; b at {at(gb, j)}")
    return None


def _forced_eos(a: Trace, ga: list[tuple[str, int | None, int, str]], b: Trace,
                gb: list[tuple[str, int | None, int, str]]) -> bool:
    """A run that ended on grammar termination (end ``grammar``) equals one that walked one more
    position and sampled EOS there: the EOS its mask forces (INTERPRETING.md "Grammar")."""
    (short, s_sites), (long_, l_sites) = sorted(((a, ga), (b, gb)), key=lambda x: len(x[1]))
    if len(l_sites) != len(s_sites) + 1:
        return False
    ends = [e.get("end") for e in short.events if e.get("end") is not None]
    eos = set(long_.header.get("eos_ids") or ())
    return bool(ends) and ends[-1] == "grammar" and l_sites[-1][2] in eos


def _token_sites(trace: Trace) -> list[TokenSite]:
    """One :class:`TokenSite` per output token, plus the terminal EOS sample if any."""
    out: list[TokenSite] = []
    for k, e in enumerate(trace.events):
        emitted = e.get("emitted") or []
        if e.get("type") == "round":
            margins = e.get("margins")
            n = len(emitted) + (1 if e.get("end") == "eos" else 0)
            out.extend(_site(e, k, j, _at(margins, j)) for j in range(n))
        elif emitted or e.get("end") == "eos":
            out.append(_site(e, k, None, e.get("margin")))
    return out


def token_origin(trace: Trace) -> list[tuple[str, int | None, float | None]]:
    """Where each output token (and a final EOS sample) came from.

    Entry ``j`` describes output token ``j``: ``(record name, window position
    or None, margin)``.  Round ``r`` emitted[j'] has margin ``margins[j']``;
    a plain record's token has ``margin``.  If generation ended on EOS, one
    extra entry describes the EOS sample at index ``len(output_ids)``.

    Args:
        trace: The trace.

    Returns:
        One entry per emitted token, plus the terminal EOS sample if any.
    """
    return [(s.record, s.position, s.margin) for s in _token_sites(trace)]


def _describe_origin(origin: Sequence[tuple[str, int | None, float | None]], j: int, trace: Trace) -> str:
    if j >= len(origin):
        ends = [e.get("end") for e in trace.events]
        last = next((x for x in reversed(ends) if x is not None), None)
        return f"output ended (last end: {last})"
    name, pos, margin = origin[j]
    at = f" window position {pos}" if pos is not None else ""
    return f"{name}{at}, margin {margin}"


def _diff_output(c: _Ctx, where_prefix: str | None = None) -> Divergence | None:
    oa, ob = c.a.output_ids, c.b.output_ids
    if oa == ob:
        return None
    j = _first_diff(oa, ob)
    if j is None:
        j = min(len(oa), len(ob))
    va, vb = _at(oa, j), _at(ob, j)
    sites_a, sites_b = _token_sites(c.a), _token_sites(c.b)
    origin_a = [(s.record, s.position, s.margin) for s in sites_a]
    origin_b = [(s.record, s.position, s.margin) for s in sites_b]
    sa = sites_a[j] if j < len(sites_a) else None
    sb = sites_b[j] if j < len(sites_b) else None
    flip = Flip(j, sa, sb) if sa is not None and sb is not None and sa.token != sb.token else None
    margin = _min_margin(sa.margin if sa else None, sb.margin if sb else None) if flip else None
    note = (
        f"produced by a: {_describe_origin(origin_a, j, c.a)}; "
        f"b: {_describe_origin(origin_b, j, c.b)}"
    )
    where = f"output token {j}"
    return c.make(where, "output_ids", va, vb, margin=margin, position=j, note=note, flip=flip)


def _diff_usage(c: _Ctx, fields: Sequence[str]) -> Divergence | None:
    ua, ub = c.a.footer.get("usage") or {}, c.b.footer.get("usage") or {}
    for fld in fields:
        if ua.get(fld) != ub.get(fld):
            return c.make("footer", f"usage.{fld}", ua.get(fld), ub.get(fld))
    return None


def _diff_speculation(c: _Ctx) -> Divergence | None:
    sa, sb = c.a.footer.get("speculation"), c.b.footer.get("speculation")
    if sa is None and sb is None:
        return None
    if sa is None or sb is None:
        return c.make("footer", "speculation", sa, sb, note="one trace has no speculation counters")
    for fld in SPECULATION_FIELDS:
        if sa.get(fld) != sb.get(fld):
            return c.make("footer", f"speculation.{fld}", sa.get(fld), sb.get(fld))
    return None


def diff_traces(
    a: Trace,
    b: Trace,
    level: str = "round",
    eps: float = DEFAULT_EPS,
    witness: Witness | None = None,
) -> Divergence | None:
    """Find the first divergence between two traces at a comparison level.

    Never compared: ``time_s``, ``wall_s``, ``margins`` / ``margin`` (used only
    to classify), ``confidence``, ``reason``, ``index`` values, and the
    header (platform, runner, model paths, params).

    Args:
        a: First trace.
        b: Second trace.
        level: ``"round"`` (strictest), ``"tokens"`` or ``"acceptance"``.
        eps: Assumed bound on the per-logit difference of the two runs'
            arithmetic, used only when no witness judges a differing sample.
        witness: Optional numerics witness (``engine.witness``) called with
            ``(a, b, flip)`` on a differing target sample.

    Returns:
        The first :class:`Divergence`, or ``None`` if identical at ``level``.

    Raises:
        ValueError: On an unknown level or a negative eps.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; expected one of {LEVELS}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    c = _Ctx(a, b, level, eps, witness)
    if level == "round":
        return batch_context(a, b, (
            _diff_prefill(c)
            or _diff_events(c)
            or _diff_usage(c, USAGE_FIELDS_ROUND)
            or _diff_speculation(c)
            or _diff_output(c)
        ))
    if level == "tokens":
        div = _diff_output(c)
        if div is None and grammar_sites(a) and grammar_sites(b):
            div = grammar_divergence(a, b)
        return batch_context(a, b, div or _diff_usage(c, USAGE_FIELDS_TOKENS))
    return _diff_speculation(c)


# ---------------------------------------------------------------------- batch traces


def _event_of(trace: Trace, where: str) -> Record | None:
    """The round/plain record a divergence's ``where`` points at in ``trace`` (None: none)."""
    kind, _, num = where.rpartition(" ")
    if not num.isdigit():
        return None
    i = int(num)
    if kind == "round":
        return trace.rounds[i] if i < len(trace.rounds) else None
    if kind == "plain":
        return trace.plains[i] if i < len(trace.plains) else None
    if kind == "event":
        return trace.events[i] if i < len(trace.events) else None
    if kind == "output token":
        sites = _token_sites(trace)
        return trace.events[sites[i].event] if i < len(sites) else None
    return None


def batch_context(a: Trace, b: Trace, div: Divergence | None) -> Divergence | None:
    """``div`` with the batch it happened in, when a trace is a row of a batched run (its round
    records carry ``batch``, INTERPRETING.md "Batch traces"): the batch step, the row's slot, the
    forward's width and the other rows present, per trace. Anything else: ``div`` unchanged."""
    if div is None:
        return None
    notes = []
    for label, t in (("a", a), ("b", b)):
        e = _event_of(t, div.where)
        info = e.get("batch") if e is not None else None
        if isinstance(info, dict):
            rows = ", ".join(info.get("neighbours") or []) or "none"
            notes.append(f"  {label} ({info.get('row')}) ran it in batch step {info.get('step')} "
                         f"(slot {info.get('slot')}, width {info.get('width')}); rows present: {rows}")
        elif e is not None and any(isinstance(x.get("batch"), dict) for x in t.rounds):
            notes.append(f"  {label}: not in the batch here (a {e.get('type')} record after the row left it: "
                         f"{e.get('reason', 'serial lane')})")
    if not notes:
        return div
    return replace(div, message=div.message + "\n" + "\n".join(notes))




def diff_main(argv: Sequence[str] | None = None, witness: Witness | None = None) -> int:
    """CLI: ``specparity diff A B [--level round|tokens|acceptance] [--eps E]``.

    Both files are validated first; an invalid or unreadable file is a usage
    error.

    Args:
        argv: Arguments after ``diff``.
        witness: Numerics witness for differing samples (the CLI passes one
            that loads the traces' target models when they are local).

    Returns:
        0 if identical at the level, 1 on a divergence, 2 on usage errors or
        unreadable / invalid traces.
    """
    from traces.validate import validate_file

    parser = argparse.ArgumentParser(
        prog="specparity diff", description="First divergence between two specparity traces."
    )
    parser.add_argument("a", metavar="A")
    parser.add_argument("b", metavar="B")
    parser.add_argument("--level", choices=LEVELS, default="round")
    parser.add_argument("--eps", type=float, default=DEFAULT_EPS)
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if args.eps < 0:
        print("specparity diff: --eps must be >= 0", file=sys.stderr)
        return 2
    traces: list[Trace] = []
    for name in (args.a, args.b):
        errors = validate_file(name)
        if len(errors) == 1:  # e.g. a missing file: one line, naming it
            print(f"specparity diff: not a valid trace: {errors[0].format()}", file=sys.stderr)
            return 2
        if errors:
            shown = "\n".join(f"  {e.format()}" for e in errors[:5])
            more = f"\n  ... and {len(errors) - 5} more" if len(errors) > 5 else ""
            print(f"specparity diff: {name} is not a valid trace:\n{shown}{more}", file=sys.stderr)
            return 2
        try:
            traces.append(read_trace(name))
        except (OSError, TraceFormatError) as exc:
            print(f"specparity diff: cannot read {name}: {exc}", file=sys.stderr)
            return 2
    div = diff_traces(traces[0], traces[1], level=args.level, eps=args.eps, witness=witness)
    if div is None:
        print(f"identical at level {args.level}")
        return 0
    print(div.message)
    return 1
