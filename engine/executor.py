"""The verify/accept executor and plain decode (§2 of the contract).

Faithful to mlx-lm 0.32.2 ``mlx_lm/generate.py``:

- ``speculative_generate_step`` — per round: draft ``d <= n = min(gamma,
  tokens left)``; ONE target forward over ``[pending, *drafts]``; the accept
  walk over the target's samples (exact token match); trim the target by
  ``d - k`` (the source trims itself, e.g. two-model by ``max(d - k - 1, 0)``);
  re-feed ``[correction]`` or ``[last draft, bonus]`` after an all-accept round.
  Tail-split prefill: both models drained to ``len - 1``, the last prompt token
  heads the first verify window.
- ``generate_step`` — plain decode, one token per forward.
- ``generation_stream`` — both loops run on a stream of their own on the
  default device (``with mx.stream(generation_stream)``).
- ``stream_generate`` — accounting: a stopping EOS is counted once in
  ``generation_tokens`` and never emitted; ``finish_reason`` is ``stop`` for
  EOS, ``length`` for the token budget.
- ``maybe_quantize_kv_cache`` (``kv_bits``, ``kv_group_size``,
  ``quantized_kv_start``) — plain decode converts the caches after every
  forward whose offset reached ``quantized_kv_start``, as ``generate_step``
  does, so position ``p`` attends over quantized K/V iff ``p >=
  quantized_kv_start``. The speculative lane keeps that: the target is
  converted on its committed offset (after the rollback, never on a
  verify window's rejected tail, which ``speculative_generate_step`` counts)
  and a window never straddles the threshold (capped to end at
  ``quantized_kv_start - 1``), so spec == plain under quantized KV. Drafters
  owning their caches quantize them as mlx-lm does (after every drafter
  forward). A source without the ``set_kv_quantization`` hook (it reads the
  target's caches or hidden states) does not speculate: §6 "quantized KV wins
  over spec", plain decode with reason ``quantized-kv`` in the trace.

Every token goes through the request's ``engine.pipeline.SamplingPipeline`` (processors,
min_tokens, the grammar mask, the draw), the same object plain decode, fill and the
numerics witness call; the accept walk is the pipeline's (exact, or constrained under a
grammar). Emission and accounting are ``engine.stream.TokenStream``'s, the chunked
prefill ``engine.stream.prefill_chunks``. Prompt-cache reuse and the audit's observer
are named collaborators with null objects (``engine.hooks``). The executor records one
trace record per prefill, round and plain step (``traces/INTERPRETING.md``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine import caches as cache_ops
from engine.hooks import NO_OBSERVER, NO_REUSE, Reuse, RoundObserver, observing
from engine.params import GenerationParams
from engine.pipeline import SamplingPipeline, WalkResult
from engine.rollback import CacheRollback
from engine.sampler import StepSampler, margin_array, margins_list, token_ids
from engine.seam import (
    DraftProvider,
    DraftSource,
    PrefillMode,
    TapContext,
    TargetView,
)
from engine.stream import (
    PLAIN_PREFILL_STEP,
    SPEC_PREFILL_STEP,
    OnToken,
    TokenStream,
    prefill_chunks,
)
from engine.taps import capture_layers
from engine.telemetry import SpecCounters, Usage, active_profile, cache_arrays

__all__ = ["PLAIN_PREFILL_STEP", "SPEC_PREFILL_STEP", "GenerationParams", "GenerationResult", "OnToken",
           "generation_stream", "plain_generate", "refeed", "spec_generate"]


@dataclass
class GenerationResult:
    output_ids: list[int]
    usage: Usage
    speculation: SpecCounters | None
    records: list[dict[str, Any]]
    wall_s: float

    def footer(self) -> dict[str, Any]:
        return {
            "type": "footer",
            "usage": self.usage.to_dict(),
            "speculation": self.speculation.to_dict() if self.speculation else None,
            "output_ids": list(self.output_ids),
            "wall_s": self.wall_s,
        }


def refeed(drafts: list[int], k_accept: int, next_token: int) -> list[int]:
    """mlx-lm's re-feed rule (generate.py ``draft_y``): ``[correction]``, or
    ``[last draft, bonus]`` after an all-accept round (the drafter never saw its
    own last draft)."""
    if drafts and k_accept == len(drafts):
        return [drafts[-1], next_token]
    return [next_token]


def _digest(params: GenerationParams, caches: list[Any]) -> dict[str, Any] | None:
    return cache_ops.cache_digest(caches) if params.cache_digests else None


class Request:
    """Per-request state shared by every lane: the sampling pipeline, stream, counters, records."""

    def __init__(
        self,
        model: Any,
        caches: list[Any],
        prompt_ids: list[int],
        params: GenerationParams,
        on_token: OnToken | None,
    ) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        self.t0 = time.perf_counter()
        self.model = model
        self.caches = caches
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.kv = params.kv
        self.pipe = SamplingPipeline(params, prompt_ids)  # seeds the request's RNG stream
        self.sampler = self.pipe.sampler  # the drafter lane's sampler (the seam's ``open(sampler, ...)``)
        self.stream = TokenStream(params, len(prompt_ids), on_token)
        self.counters = SpecCounters()
        self.records: list[dict[str, Any]] = []
        self.plain_steps = 0  # index of the next ``plain`` record

    @property
    def grammar(self) -> Any:
        """The request's grammar matcher (None without a grammar)."""
        return self.pipe.matcher

    def quantize(self) -> bool:
        """mlx-lm ``maybe_quantize_kv_cache`` on the target caches (True: some converted)."""
        return cache_ops.quantize_kv(self.caches, self.kv)

    def kv_cap(self, n: int) -> int:
        """The most drafts a window may hold so it does not straddle ``quantized_kv_start``
        (positions below it attend over full-precision K/V in plain decode, the rest over
        quantized K/V; one forward cannot do both)."""
        if self.kv is None or not cache_ops.quantizable(self.caches):
            return n
        offset = next(int(c.offset) for c in self.caches if hasattr(c, "to_quantized"))
        return min(n, max(self.kv.start - 1 - offset, 0))

    def drained(self, mode: PrefillMode) -> list[int]:
        """Tail-split drains ``len - 1`` tokens (the last heads the first window); full all."""
        return self.prompt_ids[:-1] if mode == "tail-split" else list(self.prompt_ids)

    def prefill(self, tokens: list[int], step: int | None, default: int) -> mx.array | None:
        """The target's chunked prefill (``engine.stream.prefill_chunks``); the last logits."""
        return prefill_chunks(self.model, self.caches, tokens, step or default, self.kv)

    def prefill_record(self, drained: list[int], drafter_tokens: list[int] | None, drafter_digest: Any,
                       reuse: Reuse = NO_REUSE) -> None:
        block = reuse.record()
        self.records.append(
            {
                "type": "prefill",
                "target_tokens": list(drained),
                "drafter_tokens": drafter_tokens,
                "target_cache_digest": _digest(self.params, self.caches),
                "drafter_cache_digest": drafter_digest,
                **({} if block is None else {"prompt_cache": block}),
            }
        )

    def first_input(self, mode: PrefillMode, last_logits: mx.array | None) -> int:
        """Tail-split: the last prompt token heads decode; full: the prefill's own sample."""
        return self.prompt_ids[-1] if mode == "tail-split" else self.initial_sample(last_logits)

    def plain_step(self, inp: list[int], row: mx.array, reason: str, detail: str | None, ts: float | None) -> int:
        """Sample one token from a ``[1, V]`` row, emit it and record a ``plain`` record."""
        return self._emit_plain(inp, *self._sample_row(row), reason, detail, ts)

    def _sample_row(self, row: mx.array) -> tuple[mx.array, mx.array | None]:
        """The lazy sample and top-2 margin of a ``[1, V]`` row (read back together: one sync)."""
        return self.pipe.sample(row), margin_array(row)

    def _emit_plain(
        self, inp: list[int], y_arr: mx.array, m_arr: mx.array | None, reason: str, detail: str | None,
        ts: float | None,
    ) -> int:
        mx.eval(y_arr, *([m_arr] if m_arr is not None else []))
        y = token_ids(y_arr)[0]
        margin = margins_list(m_arr, 1)[0]
        self.counters.record_plain()
        stop = self.stream.offer(y)
        index, self.plain_steps = self.plain_steps, self.plain_steps + 1
        rec = _plain_record(index, inp, y, margin, stop, reason, self.caches, self.params, ts)
        if detail is not None:
            rec["detail"] = detail
        matcher = self.pipe.matcher
        if matcher is not None:
            rec["grammar_mask"] = matcher.mask_digest()
        if stop != "eos":
            self.pipe.advance([y])
        if matcher is not None:
            if stop is None and matcher.stopped:
                rec["end"] = self.stream.terminate(self.pipe.grammar.eos_ids)
            rec["grammar_state"] = matcher.state_digest()
        self.records.append(rec)
        return y

    def initial_sample(self, last_logits: mx.array | None) -> int:
        """Full prefill: the first token is the prefill forward's own sample."""
        assert last_logits is not None, "full prefill of an empty prompt"
        return self.plain_step([self.prompt_ids[-1]], last_logits[:, -1, :], "initial", None, None)

    def plain_loop(self, next_input: int, reason: str, detail: str | None = None, *, ahead: bool = False) -> None:
        """Single-token decode until the stream stops (mlx-lm ``generate_step``).

        ``ahead``: queue step t+1's forward on step t's still-lazy sample before
        reading step t back (``generate_step``'s one-step-ahead ``async_eval``),
        so the device never waits for the host between tokens. Taken only when
        nothing a draw reads changes between two steps but the logits
        (``SamplingPipeline.stateless``: no logits processors, grammar, min_tokens
        or position keys), nothing reads the caches (no cache digests) and the
        caller owns the caches: after an EOS or a stop the caches hold one token
        more, as mlx-lm's do. Tokens, margins and records are the same bits either
        way (a test checks it).
        """
        ahead = ahead and self.pipe.stateless and not self.params.cache_digests
        step: tuple[mx.array, mx.array | None] | None = None
        while not self.stream.done:
            ts = time.perf_counter()
            inp = [next_input]
            if step is None:
                step = self._forward_row(mx.array(inp, mx.uint32))
            queued: tuple[mx.array, mx.array | None] | None = None
            if ahead and self.stream.left > 1:
                queued = self._queue_next(step[0])
            next_input = self._emit_plain(inp, *step, reason, detail, ts)
            detail = None  # only on the first record of a fallback
            step = queued

    def _queue_next(self, y_lazy: mx.array) -> tuple[mx.array, mx.array | None]:
        """Step t+1 built on step t's lazy sample and started on the device."""
        queued = self._forward_row(y_lazy.reshape(-1).astype(mx.uint32))
        mx.async_eval(*[a for a in queued if a is not None])
        return queued

    def _forward_row(self, inp: mx.array) -> tuple[mx.array, mx.array | None]:
        logits = self.model(inp[None], cache=self.caches)
        self.quantize()  # after the forward, as generate_step's _step
        return self._sample_row(logits[:, -1, :])

    def result(self, speculative: bool) -> GenerationResult:
        return GenerationResult(
            output_ids=self.stream.output,
            usage=self.stream.usage,
            speculation=self.counters if speculative else None,
            records=self.records,
            wall_s=time.perf_counter() - self.t0,
        )


_STREAMS: dict[str, Any] = {}


def generation_stream() -> Any:
    """mlx-lm's ``generation_stream``: a stream of its own on the default device.

    mlx-lm makes one at import; the engine makes one per device on first use,
    because ``--device`` may set the default device after the import. Same
    kernels as the default stream, so the same bits; on an H200 the decode
    loops ran about 4 % faster per token on it (``docs/backends.md``).
    """
    dev = mx.default_device()
    key = str(dev)
    if key not in _STREAMS:
        _STREAMS[key] = mx.new_stream(dev)
    return _STREAMS[key]


def _on_generation_stream(fn: Callable[..., GenerationResult]) -> Callable[..., GenerationResult]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> GenerationResult:
        with mx.stream(generation_stream()):
            return fn(*args, **kwargs)

    return run


def _forward(
    model: Any, caches: list[Any], tokens: list[int], taps: tuple[int, ...]
) -> tuple[mx.array, TapContext | None]:
    if not taps:
        return model(mx.array(tokens, mx.uint32)[None], cache=caches), None
    with capture_layers(model, taps) as captured:
        logits = model(mx.array(tokens, mx.uint32)[None], cache=caches)
        mx.eval(logits, *captured.values())
    return logits, TapContext(tokens=list(tokens), hidden={i: h[0] for i, h in captured.items()})


def tap_set(source: DraftSource, num_layers: int) -> tuple[int, ...]:
    taps = tuple(source.tap_layers)
    if source.wants_anchor_hidden and (num_layers - 1) not in taps and -1 not in taps:
        taps = (*taps, num_layers - 1)
    return taps


def _anchor(ctx: TapContext | None, num_layers: int, row: int) -> mx.array | None:
    if ctx is None:
        return None
    h = ctx.hidden.get(num_layers - 1)
    return None if h is None else h[row : row + 1]


@_on_generation_stream
def spec_generate(
    target_model: Any,
    provider: DraftProvider,
    prompt_ids: list[int],
    params: GenerationParams,
    *,
    on_token: OnToken | None = None,
    target_caches: list[Any] | None = None,
    observer: RoundObserver | None = None,
    reuse: Reuse | None = None,
) -> GenerationResult:
    """Speculative decode of ``prompt_ids`` with ``provider`` filling the drafts.

    ``reuse`` (``engine.hooks.Reuse``, e.g. ``engine.prompt_cache``): ``target_caches``
    already hold the first ``reuse.target_prefix`` drained tokens and only the rest is
    prefilled; the prefill record carries ``reuse.record()``. ``observer``
    (``engine.hooks.RoundObserver``, e.g. the serial-replay audit) is told about every
    verify forward. Without them, the null objects: the loop is mlx-lm's.

    Speculation ends early (the rest is plain decode, recorded as ``plain``
    records with the reason) when a target cache can neither trim nor replay
    (reason ``no-rollback``; ``params.on_no_rollback="error"`` raises instead)
    or when a rotating cache's window would wrap during the round (the §2
    ring-wrap guard, reason ``ring-wrap``). With ``params.rotating="exact"``
    rotating caches roll back exactly past the wrap (``engine.rollback.RingRound``)
    and the guard remains only for caches that cannot (reason in the detail).
    """
    from mlx_lm.models.cache import make_prompt_cache

    observer = NO_OBSERVER if observer is None else observer
    reuse = NO_REUSE if reuse is None else reuse
    caches = target_caches if target_caches is not None else make_prompt_cache(target_model)
    req = Request(target_model, caches, prompt_ids, params, on_token)
    ahead = target_caches is None  # plain fallbacks may look one step ahead on caches they own
    plan = CacheRollback(target_model, caches, rotating=params.rotating)
    if not plan.capable:
        if params.on_no_rollback == "error":
            raise cache_ops.CacheRollbackError(f"target: {plan.reason}")
        # No speculation at all for this request: plain decode, reason recorded.
        return _plain_instead(req, reuse, params.prefill or "tail-split", "no-rollback", plan.reason, ahead)

    stream = req.stream
    source = provider.open(req.sampler, TargetView(model=target_model, caches=caches))
    source_skip = reuse.open_source(source)
    if params.rotating != "guard":
        set_rotating(source, params.rotating)
    if req.kv is not None and not _set_kv_quantization(source, req.kv):
        # §6: quantized KV wins over speculation for a source that reads the target's state.
        why = (f"quantized-kv: kv_bits {req.kv.bits}: the {type(source).__name__} source reads the "
               "target's caches or hidden states (no set_kv_quantization); quantized KV wins over "
               "speculation (§6)")
        return _plain_instead(req, reuse, params.prefill or source.prefill_mode, "quantized-kv", why, ahead)
    n_layers = len(target_model.layers)
    taps = tap_set(source, n_layers)
    mode: PrefillMode = params.prefill or source.prefill_mode

    # Prefill: the drafter first, then the target (mlx-lm order); a tapped
    # prefill runs the target first because the drafter consumes its hidden.
    drained = req.drained(mode)
    new = drained[reuse.target_prefix:]
    pre_ctx: TapContext | None = None
    last_logits: mx.array | None
    if taps and drained:
        last_logits, pre_ctx = _forward_chunked_tapped(target_model, caches, new,
                                                       params.prefill_step_size or SPEC_PREFILL_STEP, taps, req.kv)
        pre_ctx = reuse.tap_context(pre_ctx, drained)  # the reused prefix's saved rows, then the new ones
        drafter_tokens = source.prefill(drained, pre_ctx)
    else:
        drafter_tokens = source.prefill(drained[source_skip:], None)
        last_logits = req.prefill(new, params.prefill_step_size, SPEC_PREFILL_STEP)
    if req.kv is not None:
        plan = CacheRollback(target_model, caches, rotating=params.rotating)  # converted caches
    reuse.after_prefill(caches, source, pre_ctx)
    req.prefill_record(new, list(drafter_tokens), source.cache_digest() if params.cache_digests else None,
                       reuse)

    pending = [req.first_input(mode, last_logits)]
    anchor = None if mode == "tail-split" else _anchor(pre_ctx, n_layers, len(drained) - 1)
    feed = list(pending)
    round_index = 0
    prof = active_profile()  # None unless a bench's --profile: then each phase is timed
    lazy = _lazy_drafts(source, observer, taps, req.sampler)  # fixed for the request
    while not stream.done:
        tr0 = time.perf_counter()
        n = req.kv_cap(min(params.gamma, stream.left))
        guard = plan.ring_guard(n) or source_guard(source, feed, n)
        if guard is not None:
            req.plain_loop(pending[-1], guard.split(":")[0], guard, ahead=ahead)
            break
        if prof is not None:
            prof.start()
        drafts, drafts_arr = draft_round(req, source, feed, n, anchor, observer, taps, lazy)
        d = len(drafts) if drafts_arr is None else int(drafts_arr.shape[0])
        if d > n:
            raise RuntimeError(f"draft source returned {d} tokens, more than n={n}")
        if prof is not None:
            prof.lap("draft", drafts_arr)
        confidence = source_confidence(source, d)
        window = pending + drafts
        observer.before_verify(round_index, window, caches)
        with plan.round():  # ONE target forward over [pending, *drafts]
            if drafts_arr is None:
                if prof is not None:
                    prof.lap("window")
                logits, ctx = _forward(target_model, caches, window, taps)
            else:
                inputs = mx.concatenate([mx.array(pending, mx.uint32), drafts_arr.astype(mx.uint32)])
                if prof is not None:
                    prof.lap("window", inputs)
                logits, ctx = target_model(inputs[None], cache=caches), None
            if prof is not None:
                prof.lap("forward", logits)
            block = logits[0, -(d + 1) :, :]
            samples_arr = req.pipe.window_samples(block, window)
            margins_arr = margin_array(block)
            # the round's one sync (samples, lazy drafts and margins in one eval, no op added
            # to join them: each is then read from host memory, mlx-lm's two ``tolist``)
            mx.eval(samples_arr, *[a for a in (drafts_arr, margins_arr) if a is not None])
        samples = token_ids(samples_arr)
        if drafts_arr is not None:
            drafts = token_ids(drafts_arr)
            window = pending + drafts
        observer.after_verify(round_index, window, block, caches)
        margins = margins_list(margins_arr, d + 1)
        if prof is not None:
            prof.lap("sync")

        walk = req.pipe.walk(block, drafts, samples, stream.offer, stream.terminate)
        k = walk.k_accept
        if prof is not None:
            prof.lap("walk")
        plan.rollback(d, k)
        observer.after_rollback(round_index, k, caches)
        if req.quantize():  # on the committed offset: where plain decode converts
            plan = CacheRollback(target_model, caches, rotating=params.rotating)
        if prof is not None:
            prof.lap("rollback", cache_arrays(caches))
        verified = _anchor(ctx, n_layers, k)
        source.commit(d, k, ctx, verified, drafts[:k])
        if prof is not None:
            prof.lap("commit", source_state(source))
        req.counters.record_round(d, k)
        reuse.after_round(ctx, k)  # the tapped rows of the k + 1 kept window positions
        req.records.append(round_record(req, source, round_index, feed, drafts, window, walk, margins,
                                         confidence, tr0))
        if prof is not None:
            prof.lap("records")
            prof.end_round()
        round_index += 1
        if stream.done:
            break
        pending = [walk.walked[k]]
        feed = refeed(drafts, k, walk.walked[k])
        anchor = verified

    return req.result(speculative=True)


def _plain_instead(req: Request, reuse: Reuse, mode: PrefillMode, reason: str, detail: str | None,
                   ahead: bool) -> GenerationResult:
    """A speculative request that does not speculate: plain decode, ``reason`` on every record."""
    new = req.drained(mode)[reuse.target_prefix:]
    last = req.prefill(new, req.params.prefill_step_size, SPEC_PREFILL_STEP)
    req.prefill_record(new, None, None, reuse)
    req.plain_loop(req.first_input(mode, last), reason, detail, ahead=ahead)
    return req.result(speculative=True)


_UNSET: Any = object()


def draft_round(req: Request, source: DraftSource, feed: list[int], n: int, anchor: mx.array | None,
                observer: RoundObserver, taps: tuple[int, ...], lazy: Any = _UNSET) -> tuple[list[int], mx.array | None]:
    """The source's drafts for this round: host ids, or a lazy device array kept until the
    verify's one sync (mlx-lm) where the source offers one (:func:`_lazy_drafts`; ``lazy``:
    its answer for this request, looked up once by the caller)."""
    if lazy is _UNSET:
        lazy = _lazy_drafts(source, observer, taps, req.sampler)
    with req.sampler.drafting(req.pipe.history):
        if lazy is not None:
            return [], lazy(list(feed), n, len(req.stream.output), anchor)
        return [int(t) for t in source.draft(list(feed), n, len(req.stream.output), anchor)], None


def round_record(req: Request, source: DraftSource, index: int, feed: list[int], drafts: list[int],
                  window: list[int], walk: WalkResult, margins: list[float], confidence: list[float] | None,
                  tr0: float) -> dict[str, Any]:
    params = req.params
    rec: dict[str, Any] = {
        "type": "round",
        "index": index,
        "feed": list(feed),
        "drafts": drafts,
        "window": window,
        "samples": walk.walked,
        "k_accept": walk.k_accept,
        "emitted": walk.emitted,
        "end": walk.end,
        "margins": margins,
        "confidence": confidence,
        "target_cache_digest": _digest(params, req.caches),
        "drafter_cache_digest": source.cache_digest() if params.cache_digests else None,
        "time_s": time.perf_counter() - tr0,
    }
    if walk.masks is not None:
        assert req.grammar is not None
        rec["grammar_masks"] = walk.masks
        rec["grammar_state"] = req.grammar.state_digest()
    return rec


def lazy_drafts(source: DraftSource, observer: RoundObserver, taps: tuple[int, ...],
                sampler: StepSampler) -> Any:
    """A source's ``draft_array`` (drafts as a lazy device array), when the round may use it.

    Optional hook, used only while the source's ``draft`` is the one that reads it
    (marked ``via_draft_array``; a subclass or instance overriding ``draft`` keeps the
    list path). Not with an observer (it sees the window before the verify), tap
    layers, or logits processors (their history needs the drafts' values).
    """
    hook = getattr(source, "draft_array", None)
    own = getattr(type(source), "draft", None)
    if (hook is None or not getattr(own, "via_draft_array", False)
            or "draft" in getattr(source, "__dict__", {})):
        return None
    if observing(observer) or taps or sampler.has_processors:
        return None
    return hook


_lazy_drafts = lazy_drafts  # the executor's own call sites (tests/test_verify_path.py patches this name)


def source_state(source: DraftSource | None) -> list[Any]:
    """The arrays a source's own caches hold (the profile's commit boundary): read from the
    instance's attributes, not a seam hook; none for a model-free source."""
    caches = vars(source).get("caches") if source is not None and hasattr(source, "__dict__") else None
    return cache_arrays(caches) if isinstance(caches, list) else []


def source_confidence(source: DraftSource, d: int) -> list[float] | None:
    """Per-position draft confidence of the last ``draft()`` call, where the source has one.

    Optional hook: a source sets ``last_confidence`` (one float per proposed
    position, possibly more than ``d`` when it truncated its block).
    """
    conf = getattr(source, "last_confidence", None)
    return None if conf is None else [float(c) for c in conf]


def set_rotating(source: DraftSource, mode: str) -> None:
    """Tell a source with rotating drafter caches how to roll them back (optional hook)."""
    hook = getattr(source, "set_rotating", None)
    if hook is not None:
        hook(mode)


def _set_kv_quantization(source: DraftSource, q: cache_ops.KVQuantization) -> bool:
    """Tell a source about quantized KV (optional hook); False: it cannot speculate over it."""
    hook = getattr(source, "set_kv_quantization", None)
    if hook is None:
        return False
    hook(q)
    return True


def source_guard(source: DraftSource, feed: list[int], n: int) -> str | None:
    """A source that cannot roll back a round of ``n`` drafts says why (optional hook)."""
    guard = getattr(source, "rollback_guard", None)
    return guard(feed, n) if guard is not None else None


def _forward_chunked_tapped(
    model: Any, caches: list[Any], tokens: list[int], step: int, taps: tuple[int, ...],
    kv: cache_ops.KVQuantization | None = None,
) -> tuple[mx.array, TapContext]:
    """Chunked prefill that also captures the tap layers over every position."""
    hidden: dict[int, list[mx.array]] = {i: [] for i in taps}
    logits = None
    for pos in range(0, len(tokens), step):
        logits, ctx = _forward(model, caches, tokens[pos : pos + step], taps)
        assert ctx is not None
        for i, h in ctx.hidden.items():
            hidden.setdefault(i, []).append(h)
        cache_ops.quantize_kv(caches, kv)
        mx.eval([c.state for c in caches])
    assert logits is not None
    joined = {i: mx.concatenate(parts, axis=0) for i, parts in hidden.items() if parts}
    return logits, TapContext(tokens=list(tokens), hidden=joined)


def _plain_record(
    index: int,
    inp: list[int],
    sample: int,
    margin: float,
    stop: str | None,
    reason: str,
    caches: list[Any],
    params: GenerationParams,
    t0: float | None = None,
) -> dict[str, Any]:
    return {
        "type": "plain",
        "index": index,
        "input": list(inp),
        "sample": sample,
        "margin": margin,
        "emitted": [] if stop == "eos" else [sample],
        "end": stop,
        "reason": reason,
        "target_cache_digest": _digest(params, caches),
        "time_s": None if t0 is None else time.perf_counter() - t0,
    }


@_on_generation_stream
def plain_generate(
    target_model: Any,
    prompt_ids: list[int],
    params: GenerationParams,
    *,
    on_token: OnToken | None = None,
    target_caches: list[Any] | None = None,
    reuse: Reuse | None = None,
) -> GenerationResult:
    """Plain (non-speculative) decode through the same sampling pipeline (mlx-lm ``generate_step``).

    ``target_caches`` / ``reuse`` (``engine.hooks.Reuse``, e.g.
    ``engine.prompt_cache.PlainPromptCacheSession``): as for ``spec_generate``, the caches
    already hold the first ``reuse.target_prefix`` drained tokens and only the rest is
    prefilled; ``reuse.after_prefill(caches, None)`` sees the prefill boundary and the
    prefill record carries ``reuse.record()``.
    """
    from mlx_lm.models.cache import make_prompt_cache

    reuse = NO_REUSE if reuse is None else reuse
    caches = target_caches if target_caches is not None else make_prompt_cache(target_model)
    req = Request(target_model, caches, prompt_ids, params, on_token)
    mode: PrefillMode = params.prefill or "tail-split"
    new = req.drained(mode)[reuse.target_prefix:]
    last = req.prefill(new, params.prefill_step_size, PLAIN_PREFILL_STEP)
    reuse.after_prefill(caches, None)
    req.prefill_record(new, None, None, reuse)
    req.plain_loop(req.first_input(mode, last), "baseline", ahead=target_caches is None)
    return req.result(speculative=False)
