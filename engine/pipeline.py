"""The sampling pipeline: every stage applied to a logits row before a token is drawn.

One object per request, built from its ``GenerationParams`` and prompt, called by
every lane that turns target logits into an output token — plain decode and the
speculative executor (``engine.executor``), token fast-forwarding
(``engine.fill``) — and by the numerics witness (``engine.witness``) when it
replays a run. So a replay cannot forget a stage: the witness builds the same
pipeline from the same parameters and evaluates the contested row through it.

Stages, in order (mlx-lm 0.32.2 ``mlx_lm/generate.py`` ``generate_step._step`` and
``speculative_generate_step._process_and_sample``; the grammar mask sits where a
logits processor appended last would):

1. **logits processors** on the request history (``engine.sampler.StepSampler``,
   mlx-lm ``make_logits_processors``: repetition / presence / frequency penalties,
   logit bias). The history is the prompt (or its last token) plus the EMITTED
   tokens; inside a verify window row ``i`` also sees the window's head and the
   target's own samples of rows ``0..i-1``.
2. **min_tokens**: the request's EOS ids at ``-inf`` while fewer than
   ``min_tokens`` tokens were generated, counted per output POSITION (row ``i``
   of a window whose round starts after ``g`` generated tokens is position
   ``g + i``), never per step (vLLM 0.11 ``MinTokensLogitsProcessor`` semantics;
   the class of bug where a verify step counts as one token).
3. **the grammar mask** (``engine.grammar``) from the matcher state after every
   token emitted before this position; no mask before the reasoning-end marker.
4. **normalisation and the draw**: ``logits - logsumexp`` then mlx-lm's
   ``make_sampler``: top-p, min-p, top-k on the log-probabilities, in that order, then the
   categorical draw at the temperature (min-p's threshold is on the unscaled log-probabilities,
   not the tempered ones as in HF transformers' warpers). Randomness: one stream
   seeded once per request, consumed in order (``rng="stream"``: mlx-lm), or a
   key per (seed, output position) (``rng="position"``: the draw at position
   ``p`` is a function of the row and ``(seed, p)`` only, so a rejected round's
   draws are rewound to the emitted boundary and speculative output equals
   plain decode at temperature > 0 too; vLLM's per-request generator with an
   offset).

The state (history, matcher, generated count) advances only on emitted tokens
(:meth:`SamplingPipeline.advance`): a rejected draft never reaches it, and a
fill append (``engine.fill`` assert spans) advances it like sampled tokens.

The two verify-window shapes of the accept walk (:meth:`SamplingPipeline.walk`):
*exact* — every row sampled up front (ONE sampler call over the block without
processors, as mlx-lm) and the walk compares; *constrained* — under a grammar
each row is sampled in the walk, its mask from the state after the tokens the
round emitted before it (``engine.grammar.constrained_walk``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np

from engine.sampler import StepSampler, token_ids

RNG_MODES = ("stream", "position")


def position_seed(seed: int, position: int) -> int:
    """The RNG seed of the draw at output ``position`` of a request seeded ``seed`` (``rng="position"``)."""
    h = hashlib.sha256(f"specparity-rng:{seed}:{position}".encode()).digest()
    return int.from_bytes(h[:8], "little") & 0x7FFFFFFFFFFFFFFF


@dataclass
class WalkResult:
    """One accept walk: what the executor records for the round.

    ``masks``: the grammar mask digest of every walked position (None without a grammar).
    """

    walked: list[int]
    emitted: list[int]
    k_accept: int
    end: str
    masks: list[str] | None = None


class SamplingPipeline:
    """One request's sampling pipeline (module docstring).

    Args:
        params: the request's ``engine.executor.GenerationParams`` (``sampler``, ``seed``,
            ``eos_ids``, ``grammar``).
        prompt_ids: the prompt (where the processor history starts).
        seed_stream: seed MLX's global RNG with ``params.seed`` now (the request start);
            the witness, replaying a position, passes False.
    """

    def __init__(self, params: Any, prompt_ids: Sequence[int], *, seed_stream: bool = True) -> None:
        sp = params.sampler
        self.params = params
        self.sampler = StepSampler.from_params(sp)
        self.eos_ids = tuple(int(t) for t in params.eos_ids)
        self.min_tokens = int(sp.min_tokens)
        self.rng = sp.rng
        self.seed = params.seed
        self.grammar = params.grammar
        self.matcher = params.grammar.matcher() if params.grammar is not None else None
        start = list(prompt_ids) if self.sampler.history_prompt == "full" else list(prompt_ids[-1:])
        self.history: mx.array | None = mx.array(start, mx.uint32) if self.sampler.has_processors else None
        self.generated = 0  # tokens emitted so far (the output position of the next draw)
        if seed_stream and params.seed is not None:
            mx.random.seed(params.seed)

    # ------------------------------------------------------------------ properties
    @property
    def greedy(self) -> bool:
        return self.sampler.greedy

    @property
    def positional(self) -> bool:
        """Draws keyed per output position (and not greedy: a greedy draw reads no RNG)."""
        return self.rng == "position" and not self.greedy and self.seed is not None

    @property
    def row_wise(self) -> bool:
        """A verify window's rows are sampled in the walk, one at a time (the grammar mask
        depends on the tokens the round emitted before each row)."""
        return self.matcher is not None

    @property
    def stateless(self) -> bool:
        """Nothing a draw reads changes between steps but the logits (plain decode may then
        queue step t+1 on step t's lazy sample)."""
        return (self.history is None and self.matcher is None and not self._eos_blocked(0)
                and not self.positional)

    def _eos_blocked(self, position: int) -> bool:
        return bool(self.eos_ids) and position < self.min_tokens

    # ------------------------------------------------------------------ stages
    def processors(self, row: mx.array, history: mx.array | None) -> mx.array:
        """Stage 1 on a ``[1, V]`` row (no-op without processors)."""
        return self.sampler.process(history, row) if self.sampler.has_processors else row

    def min_tokens_block(self, rows: mx.array, position: int) -> mx.array:
        """Stage 2 on ``[m, V]`` rows whose first is output ``position``."""
        m = int(rows.shape[0])
        blocked = [self._eos_blocked(position + i) for i in range(m)]
        if not any(blocked):
            return rows
        eos = np.zeros((m, int(rows.shape[-1])), dtype=bool)
        ids = np.array([t for t in self.eos_ids if 0 <= t < eos.shape[1]], dtype=np.int64)
        eos[np.ix_(np.flatnonzero(blocked), ids)] = True
        return mx.where(mx.array(eos), mx.array(-mx.inf, rows.dtype), rows)

    def mask(self, width: int) -> mx.array | None:
        """Stage 3: the grammar's allowed set at the current state (None: no mask)."""
        return None if self.matcher is None else self.matcher.mask(width)

    def _apply_mask(self, row: mx.array, mask: mx.array | None) -> mx.array:
        return row if mask is None else mx.where(mask, row, mx.array(-mx.inf, row.dtype))

    def draw(self, logprobs: mx.array, position: int) -> mx.array:
        """Stage 4's draw from normalised rows, output ``position`` for the first row."""
        if self.positional:
            assert self.seed is not None
            mx.random.seed(position_seed(self.seed, position))
        return self.sampler.draw_fn(logprobs)

    # ------------------------------------------------------------------ one position
    def view(self, row: mx.array, *, history: mx.array | None = None, position: int | None = None,
             mask: Any = True) -> mx.array:
        """The ``[1, V]`` logits the draw at this position sees (stages 1-3, before normalising).

        ``history``: the processor history for this row (default: the request's);
        ``position``: its output position (default: the next one); ``mask``: True for the
        matcher's current mask, or the mask to apply (None: none).
        """
        hist = self.history if history is None else history
        pos = self.generated if position is None else position
        x = self.processors(row, hist)
        x = self.min_tokens_block(x, pos)
        return self._apply_mask(x, self.mask(int(row.shape[-1])) if mask is True else mask)

    def sample(self, row: mx.array, *, history: mx.array | None = None, position: int | None = None,
               mask: Any = True) -> mx.array:
        """Sample one token from a ``[1, V]`` row (``generate_step``'s shape: one-token decode,
        a constrained walk's row, a fill step)."""
        x = self.view(row, history=history, position=position, mask=mask)
        pos = self.generated if position is None else position
        return self.draw(x - mx.logsumexp(x, keepdims=True), pos)

    # ------------------------------------------------------------------ a verify window
    def history_before_pending(self) -> mx.array | None:
        """The history a verify window's rows start from (mlx-lm ``prev_tokens``: the window's
        head, the pending token, is appended by the window sampler)."""
        return None if self.history is None else self.history[:-1]

    def window_history(self, window: Sequence[int], row: int, samples: Sequence[int]) -> mx.array | None:
        """Row ``row``'s processor history: before the pending token, the head, then the
        target's own samples of the earlier rows."""
        base = self.history_before_pending()
        if base is None:
            return None
        return mx.concatenate([base, mx.array([int(window[0]), *map(int, samples[:row])], mx.uint32)])

    def sample_window(self, block: mx.array, window: Sequence[int]) -> mx.array:
        """Every row of an ``[m, V]`` verify block up front (``_process_and_sample``'s shape).

        Without processors, position keys or min_tokens in reach this is ONE sampler call over
        all rows, as mlx-lm's verify step; otherwise row by row, each row through the stages
        with its own history and output position.
        """
        m = int(block.shape[0])
        if not self.positional and not any(self._eos_blocked(self.generated + i) for i in range(m)):
            # stages 1 and 4 alone: the step sampler's window call (mlx-lm's shape)
            return self.sampler.sample_window(block, self.history_before_pending(), window)
        if not self.sampler.has_processors and not self.positional:
            x = self.min_tokens_block(block, self.generated)
            return self.sampler.draw_fn(x - mx.logsumexp(x, axis=-1, keepdims=True))
        out: list[mx.array] = []
        hist = self.history_before_pending()
        y = mx.array(list(window[:1]), mx.uint32)
        for i in range(m):
            if self.sampler.has_processors:
                hist = y if hist is None else mx.concatenate([hist, y])
            row = self.processors(block[i : i + 1, :], hist)
            row = self.min_tokens_block(row, self.generated + i)
            y = self.draw(row - mx.logsumexp(row, axis=-1, keepdims=True), self.generated + i)
            out.append(y)
        return mx.concatenate(out, axis=0)

    def window_samples(self, block: mx.array, window: Sequence[int]) -> mx.array:
        """The exact walk's samples (lazy, evaluated with the round's one sync); empty when the
        rows are sampled in the walk (:attr:`row_wise`)."""
        if self.row_wise:
            return mx.array([], mx.uint32)
        return self.sample_window(block, window)

    def walk(self, block: mx.array, drafts: Sequence[int], samples: Sequence[int],
             offer: Callable[[int], str | None], terminate: Callable[[Sequence[int]], str]) -> WalkResult:
        """The accept walk of §2 (exact token-match acceptance), the pipeline advancing on every
        emitted token: over ``samples`` (exact) or sampling each row in the walk (constrained).

        ``offer`` emits a token to the stream and returns its stop kind; ``terminate`` ends the
        stream on grammar termination (given the grammar's EOS ids) and returns the round's end.
        """
        if self.row_wise:
            return self._constrained(block, drafts, offer, terminate)
        return self._exact(drafts, samples, offer)

    def _exact(self, drafts: Sequence[int], samples: Sequence[int],
               offer: Callable[[int], str | None]) -> WalkResult:
        d = len(drafts)
        walked: list[int] = []
        emitted: list[int] = []
        k, end = 0, "bonus"
        for i in range(d + 1):
            t = int(samples[i])
            walked.append(t)
            matched = i < d and t == drafts[i]
            k += matched
            stop = offer(t)
            if stop != "eos":
                emitted.append(t)
            if stop is not None:
                end = stop
                break
            if not matched:
                end = "correction" if i < d else "bonus"
                break
        self.advance(emitted)
        return WalkResult(walked, emitted, k, end)

    def _constrained(self, block: mx.array, drafts: Sequence[int], offer: Callable[[int], str | None],
                     terminate: Callable[[Sequence[int]], str]) -> WalkResult:
        from engine import grammar as eg

        assert self.matcher is not None and self.grammar is not None
        start = self.generated

        def sample_row(row: mx.array, i: int, mask: mx.array | None) -> mx.array:
            # the history and position move with every token the walk emits (advance, below)
            return self.sample(row, position=start + i, mask=mask)

        def emit(t: int) -> str | None:
            stop = offer(t)
            if stop != "eos":
                self.advance([t], grammar=False)  # the walk advances the matcher itself
            return stop

        res = eg.constrained_walk(sample_row, emit, self.matcher, block, drafts,
                                  lambda: terminate(self.grammar.eos_ids))
        return WalkResult(res.walked, res.emitted, res.k_accept, res.end, res.masks)

    # ------------------------------------------------------------------ state
    def advance(self, tokens: Sequence[int], *, grammar: bool = True) -> None:
        """Tokens were emitted (sampled, accepted or appended by fill; never a stopping EOS): the
        history, the matcher (``grammar``) and the generated count move past them."""
        if not tokens:
            return
        if self.history is not None:
            self.history = mx.concatenate([self.history, mx.array(list(tokens), mx.uint32)])
        if grammar and self.matcher is not None:
            for t in tokens:
                self.matcher.consume(int(t))
        self.generated += len(tokens)

    def token_at(self, block: mx.array, window: Sequence[int], row: int) -> tuple[int, mx.array]:
        """Replay (the witness): the token the run's walk draws at window ``row`` of a round
        starting at the current state, and the logits that draw sees, assuming rows
        ``0..row-1`` were accepted (they were, for a token emitted at ``row``). Advances the
        state past the accepted rows."""
        if self.row_wise:
            self.advance(list(window[1 : row + 1]))
            x = self.view(block[row : row + 1, :])
            return token_ids(self.draw(x - mx.logsumexp(x, keepdims=True), self.generated))[0], x
        samples = token_ids(self.sample_window(block, window))
        hist = self.window_history(window, row, samples)
        x = self.processors(block[row : row + 1, :], hist)
        x = self.min_tokens_block(x, self.generated + row)
        self.advance(list(window[1 : row + 1]))
        return samples[row], x


def allowed_top2(view: mx.array) -> tuple[tuple[int, float], tuple[int, float] | None]:
    """Top-1 and top-2 ``(id, logit)`` among the candidates a pipeline view allows (finite
    entries); the second is None when only one candidate is allowed."""
    r = view.reshape(-1).astype(mx.float32)
    finite = mx.isfinite(r)
    n_allowed = int(cast(int, mx.sum(finite).item()))
    r = mx.where(finite, r, mx.array(-mx.inf, mx.float32))
    k = min(2, max(n_allowed, 1))
    idx = token_ids(mx.argpartition(-r, kth=k - 1)[:k]) if r.shape[0] > 1 else [0]
    vals = [float(v) for v in cast(list, r[mx.array(idx)].tolist())]
    ranked = sorted(zip(idx, vals, strict=True), key=lambda t: (-t[1], t[0]))
    first = ranked[0]
    second = ranked[1] if n_allowed >= 2 and len(ranked) > 1 else None
    return first, second


# The trace-header codec lives in engine/params.py beside GenerationParams; re-exported here for
# specparity.runners (its source is digested by every golden: it keeps this import path).
from engine.params import (  # noqa: E402, F401
    header_params,
    params_from_header,
    processors_block,
    processors_from_block,
    sampler_from_header,
)
