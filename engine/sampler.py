"""The step sampler shared by plain decode, drafting and the verify walk.

Mirrors mlx-lm 0.32.2 ``mlx_lm/generate.py``: ``generate_step._step`` (plain:
``logits - logsumexp(logits, keepdims=True)`` over a ``[1, V]`` row) and
``speculative_generate_step._process_and_sample`` (window: ``logsumexp`` over
``axis=-1`` of a ``[m, V]`` block, then ONE sampler call for all rows). The two
reductions are kept distinct on purpose: they are different kernels and can
differ by an ulp, which flips greedy picks on knife-edges. The sampler itself
is mlx-lm's ``make_sampler`` and processors are ``make_logits_processors``, so
randomness is consumed in the same order as the reference.

Processor history (mlx-lm 0.32.2 ``generate_step`` ``tokens`` and
``speculative_generate_step`` ``prev_tokens``): a processor sees the prompt
and the EMITTED tokens, then, inside a verify window, the target's own samples
of the earlier rows (equal to the drafts on the accepted prefix, so the
correction/bonus row sees exactly the emitted history); inside a draft lane, the
drafter's earlier drafts of the same round. Rejected drafts never enter it.
mlx-lm's speculative path starts the history at the LAST prompt token only
(its prefill never extends ``prev_tokens``) while ``generate_step`` starts it
at the whole prompt; :attr:`ProcessorParams.history_prompt` names the two
(``known_divergences.toml`` ``mlx-lm-spec-processor-history-omits-prompt``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx

LogitsProcessor = Callable[[mx.array | None, mx.array], mx.array]


def tag_number(v: float) -> str:
    """A finite float in tag form: ``:g`` where that reads back exactly (every value the
    goldens hold keeps its text), else the shortest round-trip ``repr`` with an exponent's
    ``+`` dropped (``1e20``, not ``1e+20``: ``+`` joins a tag's parts). ``float()`` of the
    result is ``v`` for every finite float."""
    text = f"{v:g}"
    if float(text) != v:
        text = repr(float(v))
    return text.replace("e+", "e")


HISTORY_PROMPTS = ("full", "last")


@dataclass(frozen=True)
class ProcessorParams:
    """Logits processors (mlx-lm 0.32.2 ``sample_utils.make_logits_processors`` names).

    ``history_prompt`` says where the processor history starts: ``full`` (the
    whole prompt, mlx-lm ``generate_step`` and the §2 contract: spec and plain
    decode see the same history) or ``last`` (the last prompt token only, as
    mlx-lm ``speculative_generate_step`` does; for round-for-round comparison
    with it).
    """

    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    presence_context_size: int = 20
    frequency_penalty: float | None = None
    frequency_context_size: int = 20
    history_prompt: str = "full"

    def __post_init__(self) -> None:
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):  # nan/inf would reach the model's logits
                raise ValueError(f"{name} must be a finite number, got {v}")
        bias = [v for _, v in self.logit_bias]
        if not all(math.isfinite(v) for v in bias):
            raise ValueError(f"logit_bias values must be finite numbers, got {bias}")
        if self.repetition_penalty is not None and self.repetition_penalty < 0:
            raise ValueError(f"repetition_penalty must be >= 0, got {self.repetition_penalty}")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.history_prompt not in HISTORY_PROMPTS:
            raise ValueError(f"history_prompt must be one of {HISTORY_PROMPTS}, got {self.history_prompt!r}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(t < 0 for t in ids):
            raise ValueError(f"logit_bias token ids must be distinct and >= 0, got {ids}")

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``make_logits_processors`` (mlx-lm's defaults for the rest)."""
        return {
            "logit_bias": {int(t): float(v) for t, v in self.logit_bias} or None,
            "repetition_penalty": self.repetition_penalty,
            "repetition_context_size": self.repetition_context_size,
            "presence_penalty": self.presence_penalty,
            "presence_context_size": self.presence_context_size,
            "frequency_penalty": self.frequency_penalty,
            "frequency_context_size": self.frequency_context_size,
        }

    @property
    def active(self) -> bool:
        """Whether ``make_logits_processors`` builds any processor from these settings."""
        return bool(self.logit_bias) or any(
            p is not None and p != 0
            for p in (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        )

    def tag(self) -> str:
        """Compact text form (``rp1.5c20+pp0.5c20+fp0.2c20+lb5=3+hlast``); '' when inactive.

        :meth:`parse` reads it back; case ids and the CLI use it.
        """
        parts = []
        for key, pen, ctx in (
            ("rp", self.repetition_penalty, self.repetition_context_size),
            ("pp", self.presence_penalty, self.presence_context_size),
            ("fp", self.frequency_penalty, self.frequency_context_size),
        ):
            if pen is not None and pen != 0:
                parts.append(f"{key}{tag_number(pen)}c{ctx}")
        if self.logit_bias:
            parts.append("lb" + ",".join(f"{t}={tag_number(v)}" for t, v in self.logit_bias))
        if parts and self.history_prompt != "full":
            parts.append(f"h{self.history_prompt}")
        return "+".join(parts)

    @classmethod
    def parse(cls, text: str) -> ProcessorParams:
        """Read :meth:`tag`'s form; a ValueError names the bad part (a processor given twice
        too: ``rp1.2+rp1.3`` is refused, never last-wins)."""
        kw: dict[str, Any] = {}
        names = {"rp": "repetition", "pp": "presence", "fp": "frequency"}
        seen: dict[str, str] = {}
        for part in filter(None, text.strip().split("+")):
            key = part[:2] if part[:2] in names or part.startswith("lb") else part[:1]
            if key in seen:
                raise ValueError(f"logits processor {key!r} given twice in {text!r} ({seen[key]!r} and "
                                 f"{part!r}); give each processor once")
            seen[key] = part
            try:
                if part[:2] in names:
                    pen, _, ctx = part[2:].partition("c")
                    kw[f"{names[part[:2]]}_penalty"] = float(pen)
                    if ctx:
                        kw[f"{names[part[:2]]}_context_size"] = int(ctx)
                elif part.startswith("lb"):
                    pairs = [p.split("=") for p in part[2:].split(",")]
                    kw["logit_bias"] = tuple((int(t), float(v)) for t, v in pairs)
                elif part[:1] == "h":
                    kw["history_prompt"] = part[1:]
                else:
                    raise ValueError
            except ValueError:
                raise ValueError(
                    f"bad logits-processor part {part!r} in {text!r}; expected rp<penalty>[c<context>], "
                    "pp..., fp..., lb<id>=<bias>[,<id>=<bias>...] or hfull/hlast joined by '+'"
                ) from None
        return cls(**kw)


@dataclass(frozen=True)
class SamplerParams:
    """Request sampling settings (mlx-lm ``make_sampler`` names)."""

    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None  # shorthand; ``processors`` wins when active
    processors: ProcessorParams = field(default_factory=ProcessorParams)
    # The request's EOS ids are not drawn before this many tokens were generated, counted per
    # output position (engine.pipeline stage 2; vLLM ``SamplingParams.min_tokens``).
    min_tokens: int = 0
    # "stream": one RNG stream seeded once per request (mlx-lm); "position": a key per
    # (seed, output position) (engine.pipeline).
    rng: str = "stream"

    @property
    def effective_processors(self) -> ProcessorParams:
        """The processors a step applies: ``processors``, or the ``repetition_penalty`` shorthand."""
        if not self.processors.active and self.repetition_penalty is not None:
            return ProcessorParams(repetition_penalty=self.repetition_penalty)
        return self.processors

    def __post_init__(self) -> None:
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.rng not in ("stream", "position"):
            raise ValueError(f"rng must be 'stream' or 'position', got {self.rng!r}")
        for name in ("temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:  # mlx-lm apply_min_p's bounds
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
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
        self.draw_fn = sampler
        self._processors = list(processors)
        self.params = params or SamplerParams()
        self._draft_history: mx.array | None = None
        bias = self.params.processors.logit_bias if self._processors else ()
        self._max_bias_id = max((t for t, _ in bias), default=-1)

    @classmethod
    def from_params(cls, params: SamplerParams) -> StepSampler:
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        sampler = make_sampler(
            temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k
        )
        processors = make_logits_processors(**params.effective_processors.kwargs())
        return cls(sampler, cast(list[LogitsProcessor], processors), params)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0

    @property
    def has_processors(self) -> bool:
        return bool(self._processors)

    @property
    def history_prompt(self) -> str:
        """Where the processor history starts (``full``/``last``, see :class:`ProcessorParams`)."""
        return self.params.processors.history_prompt

    @contextmanager
    def drafting(self, history: mx.array | None) -> Iterator[None]:
        """The draft lane: sampling calls without a history see ``history`` plus this
        round's earlier drafts (mlx-lm ``_draft_generate``: ``_step`` extends
        ``prev_tokens`` by its input, then by each draft).

        ``history`` is the request history up to and including the pending token.
        """
        self._draft_history = history if self._processors else None
        try:
            yield
        finally:
            self._draft_history = None

    def process(self, history: mx.array | None, logits: mx.array) -> mx.array:
        if self._max_bias_id >= logits.shape[-1]:
            # MLX does not bounds-check the scatter: a bad id would corrupt memory, not raise
            raise ValueError(f"logit_bias token id {self._max_bias_id} is outside the vocabulary "
                             f"(size {logits.shape[-1]})")
        for processor in self._processors:
            logits = processor(history, logits)
        return logits

    def sample_plain(
        self, logits: mx.array, history: mx.array | None = None, mask: mx.array | None = None
    ) -> mx.array:
        """Sample one token from a ``[1, V]`` row (``generate_step`` shape).

        ``mask`` (bool ``[1, V]``, engine.grammar): disallowed ids get ``-inf`` after the
        processors and before the sampler, the place a logits processor appended last has.
        """
        if self._processors:
            logits = self.process(history, logits)
        if mask is not None:
            logits = mx.where(mask, logits, mx.array(-mx.inf, logits.dtype))
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return self.draw_fn(logprobs)

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
        target's own samples (mlx-lm ``_step`` with ``n_predict > 1``), so
        ``history`` must END BEFORE the window's head (the pending token).
        Called with neither ``history`` nor ``window`` inside :meth:`drafting`,
        the rows see the draft lane's history, which then grows by the samples.
        """
        if not self._processors:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return self.draw_fn(logprobs)
        lane = history is None and not window and self._draft_history is not None
        if lane:
            # draft lane: the history already ends with the feed
            y = mx.array([], mx.uint32)
            history = self._draft_history
        else:
            y = mx.array(list(window[:1]), mx.uint32)
        out = []
        hist: mx.array | None = history
        for i in range(logits.shape[0]):
            hist = y if hist is None else mx.concatenate([hist, y])
            row = self.process(hist, logits[i : i + 1, :])
            logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)
            y = self.draw_fn(logprobs)
            out.append(y)
        if lane:
            self._draft_history = mx.concatenate([hist, y]) if hist is not None else y
        return mx.concatenate(out, axis=0)


def token_ids(a: mx.array) -> list[int]:
    """A token array as Python ints (one host read).

    A 1-D array (every sample and draft array here) is read as it is: a
    ``reshape`` would be a NEW lazy array, evaluated behind whatever the stream
    holds by then — with plain decode's look-ahead that is the next step's whole
    forward, so the host would wait for step t+1 before it could emit step t.
    """
    if a.ndim == 1:
        return [int(t) for t in cast(list, a.tolist())]
    if a.ndim == 0:
        return [int(cast(int, a.item()))]
    return [int(t) for t in cast(list, a.reshape(-1).tolist())]


def margin_array(logits: mx.array) -> mx.array | None:
    """Lazy top-1 minus top-2 logit per row of an ``[m, V]`` block (None when V < 2).

    Lazy so the executor can evaluate it together with the samples: one host
    sync per verify round, as in the reference. Off the CPU the same arithmetic
    runs as one ``mx.compile``'d graph: its elementwise steps fuse, which saves
    about ten kernel launches per verify window and per plain step (measured
    on an H200: each launch costs host time there, and the margins were most
    of the engine's per-token gap to mlx-lm's plain decode). Every step is exact
    (compare, select, max, one fp32 subtraction), so both give the same bits
    (``tests/test_sampler.py`` checks it on the device it runs on).

    On the CPU, where every op costs a dispatch to the stream's thread and nothing fuses,
    :func:`_margins_top2` gives the same bits in about half the ops (``mx.topk``, a
    partition there: no sort), which the per-round margins of the records cost.
    """
    if logits.shape[-1] < 2:
        return None
    x = logits.astype(mx.float32)
    return _margins_top2(x) if mx.default_device() == mx.cpu else _margins_compiled(x)


def _margins(x: mx.array) -> mx.array:
    # Top-1 minus the max of the row with one occurrence of its argmax masked out: the
    # same bits as |topk[0] - topk[1]| without a sort (MLX's CUDA topk sorts the row).
    first = mx.argmax(x, axis=-1, keepdims=True)
    rest = mx.where(mx.arange(x.shape[-1]) == first, -mx.inf, x)
    margin = mx.abs(mx.max(x, axis=-1) - mx.max(rest, axis=-1))
    # A row holding NaN or +inf has no meaningful sample (logsumexp is NaN, argmax
    # picks a fixed id): its margin becomes NaN so margins_list refuses the round.
    broken = mx.any(mx.isnan(x) | mx.isposinf(x), axis=-1)
    return mx.where(broken, mx.array(float("nan")), margin)


def _margins_top2(x: mx.array) -> mx.array:
    """:func:`_margins`'s bits in seven ops, for the CPU (MLX's CPU ``topk`` partitions the
    row; its CUDA ``topk`` sorts it, so the GPU keeps :func:`_margins`).

    The second largest logit counted with multiplicity is the smaller of the top two; the row
    max propagates NaN (MLX reduces NaN to NaN), so ``top < inf`` is False exactly for a row
    holding NaN or +inf: :func:`_margins`'s ``broken``. A row of -inf gives ``-inf - -inf``,
    NaN, in both. ``abs`` keeps a ``-0.0`` top over a ``+0.0`` second at ``+0.0``, as there.
    """
    top = mx.max(x, axis=-1)
    second = mx.min(mx.topk(x, 2, axis=-1), axis=-1)
    return mx.where(top < mx.inf, mx.abs(top - second), mx.array(float("nan")))


# Not used on the CPU: there MLX compiles fused graphs with the system C++ compiler at run
# time, and a CPU op costs no launch.
_margins_compiled = mx.compile(_margins)


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
