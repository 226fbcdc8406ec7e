"""Speculation counters a server keeps: ``/metrics`` (Prometheus, any method label), ``/health``, the
usage / timings extensions of each answer; and the ``speculation`` cell an arm gets from them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from subjects.http_client import HttpClient, ServerDown, ServerError, get_json
from subjects.served.cells import CellResult


@dataclass
class SpecCounters:
    """Draft / accept counters a server reports (``/metrics``, or ``usage``/``timings`` extensions)."""

    drafted: float = 0.0
    accepted: float = 0.0
    sources: set[str] = field(default_factory=set)
    other_methods: set[str] = field(default_factory=set)  # counters labelled for a method the arm does not run

    _DRAFT = re.compile(r"draft", re.I)
    _ACCEPT = re.compile(r"accept", re.I)

    def add_doc(self, doc: dict[str, Any] | None) -> None:
        """Counters in one answer: numeric ``*draft*`` / ``*accept*`` keys of ``usage`` or ``timings``
        (llama.cpp ``timings.draft_n`` / ``draft_n_accepted``; mlx-vlm 0.7.10 ``server/schemas.py``
        ``GenerationTimings``: those two and ``draft_rounds``, a count of rounds, not of tokens: left
        out, as every key :func:`not_a_count` names)."""
        if not isinstance(doc, dict):
            return
        for where in ("usage", "timings"):
            block = doc.get(where)
            if not isinstance(block, dict):
                continue
            for k, v in flat_items(block):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not_a_count(k):
                    continue
                if self._ACCEPT.search(k):
                    self.accepted += v
                    self.sources.add(f"{where}.{k}")
                elif self._DRAFT.search(k):
                    self.drafted += v
                    self.sources.add(f"{where}.{k}")

    @staticmethod
    def from_metrics(text: str, method: str | None = None) -> SpecCounters:
        """Counters in a Prometheus ``/metrics`` page: ``*spec*draft*`` and ``*spec*accept*`` totals
        (vLLM's ``vllm:spec_decode_num_draft_tokens_total`` / ``..._accepted_tokens_total``).

        ``method``: the speculation method the arm runs (``suffix``); a sample labelled
        ``method="<another>"`` (qmlx-serve 0.16.0: MTP / DFlash counters only, zero under SuffixDecoding)
        says nothing about it: kept out of the counts, named in ``other_methods``. A ``*_total`` labelled
        ``method="<method>"`` is that method's counter whatever its name (rapid-mlx 0.16.10:
        ``rapid_mlx_suffix_decode_draft_tokens_proposed_total{method="suffix"}``, no "spec" in it)."""
        c = SpecCounters()
        tokens: float | None = None
        rounds = 0.0
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|\+Inf)\s*", line)
            name = m.group(1) if m else ""
            low = name.lower()
            if not m or not low.endswith("_total"):
                continue  # counters only (a ratio gauge is not a count)
            labelled = re.search(r'(?:^|[{,\s])method="([^"]*)"', m.group(2) or "")
            ours = method is not None and labelled is not None and labelled.group(1).lower() == method.lower()
            if "spec" not in low and not ours:
                continue  # not a speculation counter (one labelled with the arm's method is, whatever its name)
            if method is not None and labelled and not ours:
                c.other_methods.add(f"/metrics {name}{{method=\"{labelled.group(1)}\"}}")
                continue
            try:
                v = float(m.group(3))
            except ValueError:
                continue
            if "accept" in low:
                c.accepted += v
                c.sources.add(f"/metrics {name}")
            elif any(w in low for w in ("draft", "propos")):
                tokens = (tokens or 0.0) + v  # drafted tokens, proposals
                c.sources.add(f"/metrics {name}")
            elif any(w in low for w in ("attempt", "verify")):
                rounds += v  # speculation activity: verify rounds
                c.sources.add(f"/metrics {name}")
        # a page with a drafted-token counter: that count (its verify-step counter beside it is not tokens)
        c.drafted = tokens if tokens is not None else rounds
        return c

    def minus(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(self.drafted - other.drafted, self.accepted - other.accepted,
                            self.sources | other.sources, self.other_methods | other.other_methods)

    def plus(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(self.drafted + other.drafted, self.accepted + other.accepted,
                            self.sources | other.sources, self.other_methods | other.other_methods)


def flat_items(d: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The leaves of a nested JSON object as ``("a.b.c", value)`` pairs (a counter's dotted key)."""
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from flat_items(v, key + ".")
        else:
            yield key, v


def metrics(client: HttpClient, method: str | None = None) -> SpecCounters | None:
    """The server's speculation counters: its ``/metrics`` page and its ``/health`` body
    (:func:`health_counters`), or None (no such counter anywhere); ``method``: the arm's
    speculation method (``/metrics`` counters labelled for another are not counted)."""
    c: SpecCounters | None = None
    try:
        status, text = client.get("/metrics")
    except (ServerDown, ServerError):
        status, text = 0, ""
    if status == 200:
        m = SpecCounters.from_metrics(text, method)
        c = m if m.sources or m.other_methods else None
    h = health_counters(client)
    if h is not None:
        c = h if c is None else c.plus(h)
    return c

# a leaf key that names a setting, a rate or a derived figure beside the counts (vmlx 1.6.81
# speculative.py get_spec_stats: ``num_draft_tokens`` / ``configured_num_draft_tokens`` are the draft width
# asked for; adaptive_speculative.py snapshot: ``*_width``, ``delivered_draft_tokens`` (the accepted drafts
# again, as delivered), ``verification_allocation_limit``; ``draft_rounds``: rounds, not tokens)
_NOT_A_COUNT = re.compile(r"^(configured|max|min|starting|selected)_|^num_draft_tokens$|width|deliver|limit|"
                          r"rate|ratio|round|size|len|mean|avg")


def not_a_count(key: str) -> bool:
    """Whether the leaf of a dotted counter key (``a.b.leaf``) names a setting or a derived figure, not a count."""
    return bool(_NOT_A_COUNT.search(key.rsplit(".", 1)[-1].lower()))


def health_doc_counters(doc: Any) -> SpecCounters | None:
    """Draft / accept counts in a ``/health`` JSON body (None: none there). The leaf key decides: a
    ``*accept*`` count is accepted tokens, a ``*draft*`` / ``*propos*`` one drafted tokens; settings and
    derived figures (:func:`not_a_count`) are left out. vmlx 1.6.81 keeps its counts there
    (``speculative_decoding.runtime.drafted_tokens`` / ``accepted_draft_tokens``: the LAST request's, reset
    by each request: ``models/llm.py`` ``record_standard_runtime_stats({})``)."""
    if not isinstance(doc, dict):
        return None
    c = SpecCounters()
    for k, v in flat_items(doc):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not_a_count(k):
            continue
        leaf = k.rsplit(".", 1)[-1].lower()
        if "accept" in leaf:
            c.accepted += v
            c.sources.add(f"/health {k}")
        elif "draft" in leaf or "propos" in leaf:
            c.drafted += v
            c.sources.add(f"/health {k}")
    return c if c.sources else None


def health_counters(client: HttpClient) -> SpecCounters | None:
    """Draft / accept counters in the server's ``/health`` JSON body (None: no such body or counters)."""
    return health_doc_counters(get_json(client, "/health"))


def speculation_cell(arm: str, counters: SpecCounters | None, log_off: str | None = None) -> CellResult:
    """The ``speculation`` cell of an arm from the counters gathered over it (None: the server has none)
    and ``log_off``, a line of its log saying speculation is off (``setup_evidence.SPEC_OFF``)."""
    if arm == "spec" and log_off and (counters is None or counters.drafted <= 0):
        return CellResult("speculation", "not-engaged", f"speculation not engaged: the server's log says so: "
                          f"{log_off!r}" + (f" (and 0 drafted tokens per {', '.join(sorted(counters.sources))[:120]})"
                                            if counters is not None and counters.sources else ""))
    if counters is None or not counters.sources:
        if arm != "spec":
            return CellResult("speculation", "unsupported", "plain arm; the server reports no speculation counters")
        if counters is not None and counters.other_methods:
            other = ", ".join(sorted(counters.other_methods))[:200]
            return CellResult("speculation", "cannot-grade", "the server's speculation counters are for methods "
                              f"this arm does not run ({other}): whether it speculated is not known")
        return CellResult("speculation", "cannot-grade", "the server reports no speculation counters (/metrics, "
                          "/health, usage or timings extensions) and its log says nothing of it: whether it "
                          "speculated is not known (every cell of this arm is unverified)")
    src = ", ".join(sorted(counters.sources))[:160]
    if arm != "spec":
        if counters.drafted > 0:
            return CellResult("speculation", "cannot-grade", f"the plain arm speculated ({counters.drafted:g} "
                              f"drafted tokens per {src}): it is not a plain baseline")
        return CellResult("speculation", "unsupported", f"plain arm: 0 drafted tokens ({src})")
    if counters.drafted <= 0 and counters.accepted <= 0:
        return CellResult("speculation", "not-engaged", f"speculation not engaged: 0 drafted tokens over the arm "
                          f"({src})")
    return CellResult("speculation", "pass", f"{counters.drafted:g} tokens drafted, {counters.accepted:g} accepted "
                      f"over the arm ({src})")
