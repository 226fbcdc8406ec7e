"""The step sampler shared by plain decode, drafting and the verify walk.

Mirrors mlx-lm 0.32.2 ``mlx_lm/generate.py``: ``generate_step._step`` (plain:
``logits - logsumexp(logits, keepdims=True)`` over a ``[1, V]`` row) and
``speculative_generate_step._process_and_sample`` (window: ``logsumexp`` over
``axis=-1`` of a ``[m, V]`` block, then ONE sampler call for all rows). The two
reductions are kept distinct on purpose: they are different kernels and can
differ by an ulp, which flips greedy picks on knife-edges. The sampler itself
is mlx-lm's ``make_sampler`` and processors are ``make_logits_processors``, so
randomness is consumed in the same order as the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import mlx.core as mx

LogitsProcessor = Callable[[mx.array | None, mx.array], mx.array]


@dataclass(frozen=True)
class SamplerParams:
    """Request sampling settings (mlx-lm ``make_sampler`` names)."""

    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


class StepSampler:
    """One sampler for every lane: plain steps, draft steps and verify windows."""

    def __init__(
        self,
        sampler: Callable[[mx.array], mx.array],
        processors: Sequence[LogitsProcessor] = (),
        params: SamplerParams | None = None,
    ) -> None:
        self._sampler = sampler
        self._processors = list(processors)
        self.params = params or SamplerParams()

    @classmethod
    def from_params(cls, params: SamplerParams) -> StepSampler:
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        sampler = make_sampler(
            temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k
        )
        processors = make_logits_processors(repetition_penalty=params.repetition_penalty)
        return cls(sampler, cast(list[LogitsProcessor], processors), params)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0

    @property
    def has_processors(self) -> bool:
        return bool(self._processors)

    def _process(self, history: mx.array | None, logits: mx.array) -> mx.array:
        for processor in self._processors:
            logits = processor(history, logits)
        return logits

    def sample_plain(self, logits: mx.array, history: mx.array | None = None) -> mx.array:
        """Sample one token from a ``[1, V]`` row (``generate_step`` shape)."""
        if self._processors:
            logits = self._process(history, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return self._sampler(logprobs)

    def sample_window(
        self,
        logits: mx.array,
        history: mx.array | None = None,
        window: Sequence[int] = (),
    ) -> mx.array:
        """Sample every row of an ``[m, V]`` block (``_process_and_sample`` shape).

        Without processors this is ONE sampler call over all rows, as in
        mlx-lm's verify step. With processors each row is processed in order,
        the history growing by the window's head token and then by the
        target's own samples (mlx-lm ``_step`` with ``n_predict > 1``).
        """
        if not self._processors:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return self._sampler(logprobs)
        out = []
        y = mx.array(list(window[:1]), mx.uint32)
        hist: mx.array | None = history
        for i in range(logits.shape[0]):
            hist = y if hist is None else mx.concatenate([hist, y])
            row = self._process(hist, logits[i : i + 1, :])
            logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)
            y = self._sampler(logprobs)
            out.append(y)
        return mx.concatenate(out, axis=0)


def token_ids(a: mx.array) -> list[int]:
    """A 1-D token array as Python ints (one host read)."""
    return [int(t) for t in cast(list, a.reshape(-1).tolist())]


def margin_array(logits: mx.array) -> mx.array | None:
    """Lazy top-1 minus top-2 logit per row of an ``[m, V]`` block (None when V < 2).

    Lazy so the executor can evaluate it together with the samples: one host
    sync per verify round, as in the reference.
    """
    if logits.shape[-1] < 2:
        return None
    x = logits.astype(mx.float32)
    top = mx.topk(x, 2, axis=-1)
    # A row holding NaN or +inf has no meaningful sample (logsumexp is NaN, argmax
    # picks a fixed id): its margin becomes NaN so margins_list refuses the round.
    broken = mx.any(mx.isnan(x) | mx.isposinf(x), axis=-1)
    return mx.where(broken, mx.array(float("nan")), mx.abs(top[:, 0] - top[:, 1]))


class NonFiniteLogits(FloatingPointError):
    """The model produced NaN/+inf logits: nothing sampled from them is meaningful."""


def margins_list(margins: mx.array | None, rows: int) -> list[float]:
    if margins is None:
        return [float("inf")] * rows
    out = [float(m) for m in cast(list, margins.tolist())]
    bad = [i for i, m in enumerate(out) if m != m]
    if bad:
        raise NonFiniteLogits(f"the model produced non-finite logits (NaN or +inf) in row {bad[0]} "
                              "of a step: its weights or inputs are broken; no output is produced "
                              "from them")
    return out


def top2_margins(logits: mx.array) -> list[float]:
    """Top-1 minus top-2 logit for every row of an ``[m, V]`` block."""
    return margins_list(margin_array(logits), logits.shape[0])
