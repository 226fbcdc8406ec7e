"""Token fast-forwarding: one ``ProposalSource`` interface, two policies, one apply primitive.

Mirrors §7 / §7.1 of ``speculative-decoding.md`` (mlx-bun ``src/fill/proposal.ts``
``ProposalSource`` / ``Proposal``; the apply primitive of ``src/generate.ts``
``generateInner``), over mlx-lm 0.32.2 models and caches
(``mlx_lm/models/cache.py`` ``make_prompt_cache``, ``KVCache.trim``) and the
engine's plain-decode pieces (``engine.executor`` stream accounting, prefill
chunks, ``engine.stream``; the request's ``engine.pipeline.SamplingPipeline``) so that
sampling, EOS, budget and stop sequences behave exactly as in ``plain_generate``; an
appended id advances the pipeline (processor history, generated count) exactly like a
sampled one.

- **assert** — the ids are DETERMINED (a template scaffold): the in-flight
  sample for the next position is dropped unexamined (counted as a wasted
  sample), the span is appended with ONE chunked forward, decode resumes from
  the span's last row. No readback, no rewind.
- **verify** — the ids are LIKELY (a self-copy): position 0 is checked against
  the in-flight sample BEFORE the forward (a mismatch costs nothing); positions
  1..m-1 against the sampler's pick from the same forward's rows (the argmax
  at temperature 0); the rejected tail is trimmed off the caches and decode
  resumes at the first disagreement, so a wrong guess never changes a token.

Invariants the loop asserts: every span is cut at the first EOS id (ending
the turn stays the model's decision); a span shorter than 2 ids is rejected
(it saves no forward); the fill forward carries ONLY the injected ids (the
trigger was already consumed by the normal step) and ``cache.offset ==
prompt + forwarded`` holds on both sides of every append; injected ids are
offered to the stream one at a time AFTER the append, so a stop sequence
fires mid-burst exactly where it would have.

Refused (:class:`FillRefused`): a compiled grammar in the same iteration
(``params.grammar``);
a user-fixed seed at temperature > 0 with a source that may assert. At
temperature > 0 an assert fill is the behaviour-policy deviation §7 names
(:func:`behaviour_deviation`), never a token-identity claim.

This is not the speculative executor (``engine/executor.py``): no draft
source, no verify window, no rollback contract beyond ``trim``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import mlx.core as mx

from engine.executor import GenerationParams, generation_stream
from engine.pipeline import SamplingPipeline
from engine.sampler import token_ids
from engine.stream import PLAIN_PREFILL_STEP, OnToken, TokenStream, prefill_chunks
from engine.telemetry import Usage

Policy = Literal["assert", "verify"]
POLICIES: tuple[Policy, ...] = ("assert", "verify")
MIN_SPAN = 2


class FillRefused(ValueError):
    """Fill is refused for this request (§7 composition rules); the message says why."""


class FillAlignmentError(AssertionError):
    """``cache.offset != prompt + forwarded`` around an append: the KV no longer matches
    the token stream (e.g. the trigger forwarded twice)."""


@dataclass(frozen=True)
class Proposal:
    """The next tokens a source claims to know, with how to apply them."""

    ids: tuple[int, ...]
    policy: Policy
    origin: str  # e.g. "strict:scaffold", "strict:name:get_weather", "strict:close", "echo"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"proposal policy must be one of {POLICIES}, got {self.policy!r}")


@dataclass(frozen=True)
class TokenView:
    """What a source may read: the prompt ids and the ids emitted so far (injected included:
    the model cannot tell them apart, so neither does a source). The last id is the one
    whose KV was written last (the trigger)."""

    prompt: tuple[int, ...]
    emitted: tuple[int, ...]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt + self.emitted


class ProposalSource(Protocol):
    """Every source of known next tokens (strict rows, echo copies) implements this."""

    name: str
    policies: frozenset[str]  # the policies its proposals may carry (refusal rules read it)

    def propose(self, view: TokenView) -> Proposal | None: ...


def cut_at_eos(ids: Sequence[int], eos_ids: Sequence[int]) -> tuple[int, ...]:
    """``ids`` up to (not including) the first EOS id: ending the turn is the model's call."""
    eos = set(eos_ids)
    for i, t in enumerate(ids):
        if t in eos:
            return tuple(ids[:i])
    return tuple(ids)


def span_input(trigger: int, ids: Sequence[int]) -> list[int]:
    """The fill forward's input: the injected ids ONLY. ``trigger`` (the last consumed id)
    already has its KV written; forwarding ``[trigger, *ids]`` would duplicate a position."""
    del trigger
    return list(ids)


def check_refusals(sources: Sequence[ProposalSource], params: GenerationParams, *, user_seed: bool = False) -> None:
    """Raise :class:`FillRefused` where §7 refuses fill for this request."""
    if not sources:
        return
    if params.grammar is not None:
        raise FillRefused("fill refused: a compiled grammar is active in the same iteration "
                          "(forced tokens are the grammar's job; §7)")
    asserting = [s.name for s in sources if "assert" in s.policies]
    if user_seed and params.sampler.temperature > 0 and asserting:
        raise FillRefused(f"fill refused: a user-fixed seed at temperature {params.sampler.temperature} "
                          f"with asserting source(s) {', '.join(asserting)} (injected positions skip "
                          "the sampler, so the seed would not reproduce the unfilled draw; §7)")


@dataclass
class FillStats:
    """Per-request fill telemetry (``usage.fill`` of the reference)."""

    forwards: int = 0  # model calls after the prefill (one per sample, one per append)
    samples: int = 0  # sampler calls whose row came from a one-token step or a span's last row
    appends: int = 0
    injected: int = 0  # ids written by appends and kept
    asserted: int = 0  # ids kept from assert spans
    wasted_samples: int = 0  # in-flight samples dropped by an assert append
    proposals: int = 0
    rejected_short: int = 0  # spans shorter than 2 ids after the EOS cut and the budget cap
    eos_cuts: int = 0
    verify_first_rejected: int = 0  # position 0 disagreed with the in-flight sample (free)
    verify_accepted: int = 0
    verify_rejected: int = 0  # span positions forwarded then trimmed off
    verify_unsupported: int = 0  # verify proposals dropped: a cache cannot trim
    by_origin: dict[str, int] = field(default_factory=dict)  # injected ids per origin kind

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FillResult:
    output_ids: list[int]
    usage: Usage
    stats: FillStats
    events: list[dict[str, Any]]  # one per append: origin, policy, position, ids, kept, offsets
    wall_s: float


def behaviour_deviation(params: GenerationParams, stats: FillStats) -> str | None:
    """The deviation §7 names, or None. At temperature > 0 an asserted id never went
    through the sampler: the filled reply is not the draw an unfilled one would have been.
    A behaviour-policy deviation, not a numerics one; never compared as token identity."""
    if params.sampler.temperature > 0 and stats.asserted > 0:
        return (f"behaviour-policy deviation: {stats.asserted} asserted id(s) bypassed the sampler at "
                f"temperature {params.sampler.temperature} (§7); not a token-identity comparison")
    return None


def check_events(events: Sequence[dict[str, Any]], eos_ids: Sequence[int]) -> list[str]:
    """The span gates over a run's appends: no appended id is an EOS id (every span cut at
    the first EOS), no span shorter than 2 ids. Each problem names the append, the span
    index and the output position."""
    eos = set(eos_ids)
    problems = []
    for ev in events:
        ids = list(ev["ids"])
        if len(ids) < MIN_SPAN:
            problems.append(f"append {ev['event']} ({ev['origin']}) at output position {ev['position']}: "
                            f"span of {len(ids)} id(s) {ids} is shorter than {MIN_SPAN} (saves no forward)")
        for i, t in enumerate(ids):
            if t in eos:
                problems.append(f"append {ev['event']} ({ev['origin']}) appended EOS id {t} at span index {i} "
                                f"(output position {ev['position'] + i}): the span was not cut at the first "
                                "EOS, so the fill ended the turn for the model")
                break
    return problems


def _trimmable(caches: list[Any]) -> bool:
    return all(getattr(c, "is_trimmable", lambda: False)() for c in caches)


class _FillLoop:
    def __init__(self, model: Any, prompt_ids: list[int], params: GenerationParams,
                 sources: Sequence[ProposalSource], on_token: OnToken | None, check_alignment: bool):
        from mlx_lm.models.cache import make_prompt_cache

        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if params.kv is not None:
            raise FillRefused("fill refused: quantized KV (post-conversion multi-token append is "
                              "unvalidated; §7.2)")
        self.model = model
        self.caches = make_prompt_cache(model)
        self.prompt = tuple(prompt_ids)
        self.params = params
        self.sources = list(sources)
        self.pipe = SamplingPipeline(params, prompt_ids)  # seeds the request's RNG stream
        self.stream = TokenStream(params, len(prompt_ids), on_token)
        self.stats = FillStats()
        self.events: list[dict[str, Any]] = []
        self.check = check_alignment
        self.prefilled = 0  # the prompt ids in the cache (all of them once decode starts)
        self.forwarded: list[int] = []  # every id forwarded after the prompt

    # ---------------------------------------------------------------- pieces
    def offset(self) -> int:
        """The first positional cache's offset (recurrent ``ArraysCache`` layers have none)."""
        return int(next(c.offset for c in self.caches if hasattr(c, "offset")))

    def aligned(self, side: str, event: int, origin: str, position: int) -> None:
        if not self.check:
            return
        want = self.prefilled + len(self.forwarded)
        got = self.offset()
        if got != want:
            raise FillAlignmentError(
                f"fill cache alignment broken {side} append {event} ({origin}, output position "
                f"{position}): cache offset {got} != prompt {self.prefilled} + forwarded "
                f"{len(self.forwarded)} = {want}")

    def forward(self, ids: list[int]) -> mx.array:
        self.stats.forwards += 1
        return self.model(mx.array(ids, mx.uint32)[None], cache=self.caches)

    def sample_row(self, row: mx.array, *, history: mx.array | None = None, position: int | None = None) -> int:
        """The pipeline's draw from a ``[1, V]`` row: at the next output position on the
        request's history, or (a verify span's row) at ``position`` on ``history``."""
        self.stats.samples += 1
        y = self.pipe.sample(row, history=history, position=position)
        mx.eval(y)
        return token_ids(y)[0]

    def view(self) -> TokenView:
        return TokenView(self.prompt, tuple(self.stream.output))

    def emit(self, token: int) -> None:
        stop = self.stream.offer(token)
        if stop != "eos":
            self.pipe.advance([token])

    def step(self, token: int) -> int:
        logits = self.forward([token])
        self.forwarded.append(token)
        return self.sample_row(logits[:, -1, :])

    def propose(self) -> Proposal | None:
        view = self.view()
        for src in self.sources:
            prop = src.propose(view)
            if prop is not None:
                return prop
        return None

    # ---------------------------------------------------------------- the apply primitive
    def apply(self, prop: Proposal, y: int) -> int | None:
        """Apply ``prop`` at the position whose in-flight sample is ``y``; return the next
        in-flight sample, or None when the proposal was not applied (emit ``y`` normally)."""
        self.stats.proposals += 1
        ids = cut_at_eos(prop.ids, self.params.eos_ids)
        if len(ids) < len(prop.ids):
            self.stats.eos_cuts += 1
        ids = ids[: self.stream.left]
        if len(ids) < MIN_SPAN:
            self.stats.rejected_short += 1
            return None
        if prop.policy == "verify":
            if not _trimmable(self.caches):
                self.stats.verify_unsupported += 1
                return None
            if ids[0] != y:
                self.stats.verify_first_rejected += 1
                return None
        event = len(self.events)
        position = len(self.stream.output)
        trigger = self.view().tokens[-1]
        self.aligned("before", event, prop.origin, position)
        logits = self.forward(span_input(trigger, ids))
        self.forwarded.extend(ids)
        self.aligned("after", event, prop.origin, position)
        self.stats.appends += 1
        if prop.policy == "assert":
            kept = len(ids)
            self.stats.wasted_samples += 1
            self.stats.asserted += kept
            nxt_row = logits[:, -1, :]
            picks: list[int] = []
        else:
            # rows 0..m-2 predict positions 1..m-1, each drawn on the history and at the output
            # position it would have had (the pipeline advances only when the ids are emitted)
            picks = []
            kept = 1
            base = self.pipe.history
            while kept < len(ids):
                hist = None if base is None else mx.concatenate([base, mx.array(list(ids[:kept]), mx.uint32)])
                pick = self.sample_row(logits[:, kept - 1, :], history=hist, position=self.pipe.generated + kept)
                picks.append(pick)
                if pick != ids[kept]:
                    break
                kept += 1
            drop = len(ids) - kept
            if drop:
                for c in self.caches:
                    c.trim(drop)
                del self.forwarded[len(self.forwarded) - drop :]
                self.aligned("after rewinding", event, prop.origin, position)
            self.stats.verify_accepted += kept
            self.stats.verify_rejected += drop
            nxt_row = logits[:, kept - 1, :]
        kind = prop.origin.split(":")[0] if prop.origin.startswith("echo") else ":".join(prop.origin.split(":")[:2])
        self.stats.by_origin[kind] = self.stats.by_origin.get(kind, 0) + kept
        self.stats.injected += kept
        self.events.append({"event": event, "origin": prop.origin, "policy": prop.policy,
                            "position": position, "trigger": trigger, "ids": list(ids), "kept": kept,
                            "picks": picks, "offset_after": self.offset()})
        # the append happened BEFORE any of the burst's yields: a stop mid-burst leaves
        # ``forwarded`` describing the cache exactly
        for t in ids[:kept]:
            self.emit(t)
            if self.stream.done:
                return -1
        if prop.policy == "verify" and kept < len(ids):
            return picks[-1]  # the sampler's own pick at the first disagreement
        return self.sample_row(nxt_row)

    def run(self) -> None:
        drained = list(self.prompt[:-1])
        prefill_chunks(self.model, self.caches, drained, self.params.prefill_step_size or PLAIN_PREFILL_STEP)
        # tail-split: the prompt's last id heads decode; from here the cache holds the prompt
        logits = self.forward([self.prompt[-1]])
        self.prefilled = len(self.prompt)
        y = self.sample_row(logits[:, -1, :])
        while True:
            prop = self.propose() if self.sources else None
            if prop is not None:
                nxt = self.apply(prop, y)
                if nxt == -1:
                    return
                if nxt is not None:
                    y = nxt
                    continue
            self.emit(y)
            if self.stream.done:
                return
            y = self.step(y)


def fill_generate(
    model: Any,
    prompt_ids: list[int],
    params: GenerationParams,
    sources: Sequence[ProposalSource],
    *,
    user_seed: bool = False,
    on_token: OnToken | None = None,
    check_alignment: bool = True,
) -> FillResult:
    """Decode ``prompt_ids`` with fill sources (tail-split prefill, as ``plain_generate``).

    With no sources this is plain single-token decode through the same sampler and stream.
    """
    check_refusals(sources, params, user_seed=user_seed)
    if params.prefill not in (None, "tail-split"):
        raise FillRefused("fill runs with the tail-split prefill only")
    t0 = time.perf_counter()
    with mx.stream(generation_stream()):
        loop = _FillLoop(model, prompt_ids, params, sources, on_token, check_alignment)
        loop.run()
    return FillResult(output_ids=list(loop.stream.output), usage=loop.stream.usage, stats=loop.stats,
                      events=loop.events, wall_s=time.perf_counter() - t0)
