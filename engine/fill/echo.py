"""The echo tier: copy a repeated span of the request's own history (§7.2).

Mirrors mlx-bun ``src/fill/echo-index.ts`` (the TS port of ``GrowingMatcher``
from the corpus study) as §7.2 of ``speculative-decoding.md`` describes it:

- a growing k-gram index over the prompt ids plus everything emitted (injected
  ids included), appended incrementally; the lookup scans the NEAREST
  occurrences of the current k-gram (capped at ``candidates``);
- **branch-point stopping**: a span extends only while every nearby occurrence
  continues the same way and stops where they disagree;
- **corroboration decides the policy**: ``assert`` needs at least two
  occurrences agreeing over the whole span and a span ending at a
  delimiter-class id (the span is clamped to its last delimiter; the branch
  point lies after it); everything else is ``verify``. A single occurrence is a
  copy, not a pattern.

The EOS cut and the 2-id minimum are the apply primitive's
(:mod:`engine.fill.proposal`), so they hold for every source.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from engine.fill.proposal import Policy, Proposal, TokenView


class EchoSource:
    """Proposes the continuation of the current k-gram's earlier occurrences."""

    name = "echo"

    def __init__(self, k: int = 3, candidates: int = 4, max_span: int = 16,
                 delimiters: Iterable[int] = (), assert_corroborated: bool = True) -> None:
        if k < 1 or candidates < 1 or max_span < 1:
            raise ValueError("k, candidates and max_span must be >= 1")
        self.k = k
        self.candidates = candidates
        self.max_span = max_span
        self.delimiters = frozenset(delimiters)
        self.assert_corroborated = assert_corroborated
        self.policies = frozenset({"assert", "verify"} if assert_corroborated else {"verify"})
        self._seq: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = defaultdict(list)  # k-gram -> end positions

    def _sync(self, tokens: tuple[int, ...]) -> None:
        if tokens[: len(self._seq)] != tuple(self._seq):  # a new request: rebuild
            self._seq, self._index = [], defaultdict(list)
        for i in range(len(self._seq), len(tokens)):
            self._seq.append(tokens[i])
            if i + 1 >= self.k:
                self._index[tuple(self._seq[i + 1 - self.k : i + 1])].append(i)

    def propose(self, view: TokenView) -> Proposal | None:
        self._sync(view.tokens)
        n = len(self._seq)
        if n < self.k:
            return None
        ends = self._index.get(tuple(self._seq[n - self.k :]), [])
        # earlier occurrences only (the last one is the current context), nearest first
        starts = [e + 1 for e in reversed(ends) if e < n - 1][: self.candidates]
        if not starts:
            return None
        span: list[int] = []
        branched = False
        while len(span) < self.max_span:
            j = len(span)
            conts = {self._seq[s + j] for s in starts if s + j < n}
            if len(conts) != 1 or any(s + j >= n for s in starts):
                branched = len(conts) > 1
                break
            span.append(conts.pop())
        if not span:
            return None
        policy: Policy = "verify"
        if self.assert_corroborated and len(starts) >= 2:
            last = max((i for i, t in enumerate(span) if t in self.delimiters), default=-1)
            if last >= 0:
                span = span[: last + 1]
                policy = "assert"
        del branched  # the asserted span ends at its last delimiter, before any branch point
        return Proposal(tuple(span), policy, f"echo:{len(starts)}")
