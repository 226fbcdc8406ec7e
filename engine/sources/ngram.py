"""The ``ngram`` draft source: model-free prompt lookup over the token history.

Roster row ``ngram`` of ``../shared/reference/speculative-decoding.md`` §3
(mlx-bun ``src/spec/ngram-source.ts``; ported from Prompt Lookup Decoding,
Saxena, and vLLM ``ngram``): the longest trailing k-gram of the history, k from
``ngram_max`` down to ``ngram_min``, is matched at its FIRST earlier occurrence
that does not overlap the trailing k-gram itself; the tokens after that
occurrence are the draft, at most ``n`` and clipped at the history end. No
match drafts nothing and the executor takes one plain target step.

The history is rebuilt from the seam's calls (§1): ``prefill`` gets the drained
prompt, accepted drafts arrive through ``commit(accepted_tokens=...)``, and each
``draft(feed)`` appends the feed (mlx-lm's re-feed rule): ``[correction]``, or
``[last draft, bonus]`` after an all-accept round, whose first token was already
committed as an accepted draft. At every ``draft`` call the history is the
prompt followed by every emitted token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.sampler import StepSampler
from engine.seam import DraftSourceBase, PrefillMode, TapContext, TargetView
from engine.sources.kind import OpenOptions, SourceKind

KIND = "ngram"
PREFILL: PrefillMode = "tail-split"  # §2.1; the source and its descriptor share it
DEFAULT_GAMMA = 10  # Saxena ``num_pred_tokens``
DEFAULT_NGRAM_MAX = 3
DEFAULT_NGRAM_MIN = 1


def lookup(history: list[int], n: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """The §3 prompt-lookup proposal for ``history``: at most ``n`` tokens.

    For k = ``ngram_max`` .. ``ngram_min`` (longest first), the trailing k-gram
    ``history[L-k:]`` is searched from the start; the first occurrence
    ``history[i:i+k]`` with ``i + k <= L - k`` (not overlapping the trailing
    k-gram) wins and the draft is ``history[i+k : i+k+n]``. Such a continuation
    is never empty, so the first k with any occurrence decides.
    """
    if ngram_min < 1 or ngram_max < ngram_min:
        raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
    size = len(history)
    if n <= 0:
        return []
    if size >= VECTOR_MIN:
        return _lookup_vector(history, n, ngram_max, ngram_min)
    return _lookup_scan(history, n, ngram_max, ngram_min)


VECTOR_MIN = 64
"""From this history length on, :func:`lookup` compares every candidate start at once (numpy)
instead of slice by slice: the same first occurrence, in C (a 600-token history: ~170 µs per
call scanned, a few tens vectorized), which is host time every n-gram row pays per round."""


def _lookup_scan(history: list[int], n: int, ngram_max: int, ngram_min: int) -> list[int]:
    """:func:`lookup` slice by slice (the definition)."""
    size = len(history)
    for k in range(min(ngram_max, size // 2), ngram_min - 1, -1):
        tail = history[size - k :]
        for i in range(0, size - 2 * k + 1):
            if history[i : i + k] == tail:
                return list(history[i + k : i + k + n])
    return []


def _lookup_vector(history: list[int], n: int, ngram_max: int, ngram_min: int) -> list[int]:
    """:func:`lookup` with every candidate start ``i`` of a k-gram compared at once: ``ok[i]``
    holds while ``history[i + j] == tail[j]`` for every ``j < k``; the first ``i`` wins, as in
    :func:`_lookup_scan`."""
    import numpy as np

    size = len(history)
    arr = np.asarray(history, dtype=np.int64)
    for k in range(min(ngram_max, size // 2), ngram_min - 1, -1):
        span = size - 2 * k + 1  # candidate starts 0 .. size - 2k (no overlap with the tail)
        if span <= 0:
            continue
        tail = arr[size - k :]
        ok = arr[:span] == tail[0]
        for j in range(1, k):
            ok &= arr[j : j + span] == tail[j]
        hits = np.flatnonzero(ok)
        if hits.size:
            i = int(hits[0])
            return [int(t) for t in history[i + k : i + k + n]]
    return []


class NgramSource(DraftSourceBase):
    prefill_mode: PrefillMode = PREFILL
    tap_layers: tuple[int, ...] = ()
    wants_anchor_hidden = False
    weights_bytes = 0

    def __init__(self, ngram_max: int, ngram_min: int) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.history: list[int] = []
        self._last_drafts: list[int] = []
        # After an all-accept round the feed's head is the last accepted draft.
        self._skip = 0

    def set_kv_quantization(self, q: Any) -> None:
        """Quantized KV (executor hook): model-free, nothing to convert."""

    def prefill(self, prompt_ids: list[int], ctx: TapContext | None) -> list[int]:
        self.history = list(prompt_ids)
        self._skip = 0
        return []

    def draft(
        self, feed: list[int], n: int, step_base: int, anchor_hidden: Any = None
    ) -> list[int]:
        if self._skip:
            if not self.history or feed[:1] != self.history[-1:]:
                raise RuntimeError(
                    f"ngram: feed {feed} after an all-accept round must start with the "
                    f"last accepted draft {self.history[-1:]}"
                )
            feed = feed[1:]
        self.history.extend(int(t) for t in feed)
        self._skip = 0
        self._last_drafts = lookup(self.history, n, self.ngram_max, self.ngram_min)
        return list(self._last_drafts)

    def commit(
        self,
        d: int,
        k_accept: int,
        ctx: TapContext | None = None,
        verified_hidden: Any = None,
        accepted_tokens: list[int] | None = None,
    ) -> None:
        accepted = (
            self._last_drafts[:k_accept] if accepted_tokens is None else list(accepted_tokens)
        )
        if accepted != self._last_drafts[:k_accept]:
            raise RuntimeError(
                f"ngram: accepted {accepted} is not the drafted prefix {self._last_drafts[:k_accept]}"
            )
        self.history.extend(accepted)
        self._skip = 1 if d > 0 and k_accept == d else 0
        self._last_drafts = []

    def cache_digest(self) -> dict[str, Any] | None:
        return None


class NgramProvider:
    """Model-free provider: owns no weights; opens one ``NgramSource`` per request."""

    kind = KIND

    def __init__(
        self,
        *,
        gamma: int = DEFAULT_GAMMA,
        ngram_max: int = DEFAULT_NGRAM_MAX,
        ngram_min: int = DEFAULT_NGRAM_MIN,
    ) -> None:
        if ngram_min < 1 or ngram_max < ngram_min:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        self.gamma = gamma
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def open(self, sampler: StepSampler, target: TargetView) -> NgramSource:
        return NgramSource(self.ngram_max, self.ngram_min)


# ---------------------------------------------------------------- the kind (engine.sources.kind)


def _open(draft_dir: Path | None, opts: OpenOptions) -> NgramProvider:
    return NgramProvider(gamma=opts.gamma, ngram_max=opts.ngram_max, ngram_min=opts.ngram_min)


SOURCE = SourceKind(
    name=KIND, provider=NgramProvider, open=_open, prefill=PREFILL, reuse="reread", roster=1,
    takes_dir=False,  # model-free: never detected, refuses a drafter directory
    options=frozenset({"ngram"}),
    hint="model-free, no --draft",
)
