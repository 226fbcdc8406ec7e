"""The token stream and the chunked prefill: shared by the executor, fill and the witness.

Mirrors mlx-lm 0.32.2 ``mlx_lm/generate.py``:

- :class:`TokenStream` — ``stream_generate``'s accounting: a stopping EOS is
  counted once in ``generation_tokens`` and never emitted; ``finish_reason`` is
  ``stop`` for EOS (and a stop sequence), ``length`` for the token budget. Stop
  sequences follow ``server.py``'s token-level ``StopSequences`` matcher over the
  generated tokens: the consumer breaks after the token that completes a
  sequence, that token included, and the finish reason is ``stop`` even when the
  budget is reached on the same token.
- :func:`prefill_chunks` — ``_prefill``: the drained prompt through the model in
  chunks of ``prefill_step_size``, the caches evaluated after each chunk (and
  converted to quantized KV where ``maybe_quantize_kv_cache`` would).

Every decode loop of the engine (``engine.executor`` plain and speculative,
``engine.fill``) emits through one :class:`TokenStream` and prefills through
:func:`prefill_chunks`; the numerics witness (``engine.witness``) replays a
trace's prefill with the same function, so the chunk shapes it replays are the
ones the run used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import mlx.core as mx

from engine import caches as cache_ops
from engine.telemetry import Usage

OnToken = Callable[[int], bool | None]

# mlx-lm 0.32.2 defaults: speculative_generate_step 512, generate_step 2048.
SPEC_PREFILL_STEP = 512
PLAIN_PREFILL_STEP = 2048


class StreamParams(Protocol):
    """What the stream reads of a request's settings (``engine.executor.GenerationParams``)."""

    @property
    def max_tokens(self) -> int: ...

    @property
    def eos_ids(self) -> tuple[int, ...]: ...

    @property
    def stop_sequences(self) -> tuple[tuple[int, ...], ...]: ...


class TokenStream:
    """Emission + accounting: one token at a time, EOS never emitted (module docstring)."""

    def __init__(self, params: StreamParams, prompt_len: int, on_token: OnToken | None):
        self.params = params
        self.eos = set(params.eos_ids)
        self.on_token = on_token
        self.output: list[int] = []
        self.usage = Usage(prompt_tokens=prompt_len)
        self.done = False

    def offer(self, token: int) -> str | None:
        """Emit ``token``; return the stop kind (``eos``/``budget``/``stop``) or None."""
        if token in self.eos:
            self.usage.generation_tokens += 1
            self.usage.finish_reason = "stop"
            self.done = True
            return "eos"
        self.output.append(token)
        self.usage.generation_tokens += 1
        if self.on_token is not None and self.on_token(token) is False:
            self.usage.finish_reason = "stop"
            self.done = True
            return "stop"
        if any(
            len(self.output) >= len(seq) and tuple(self.output[-len(seq) :]) == seq
            for seq in self.params.stop_sequences
        ):
            self.usage.finish_reason = "stop"
            self.done = True
            return "stop"
        if len(self.output) == self.params.max_tokens:
            self.usage.finish_reason = "length"
            self.done = True
            return "budget"
        return None

    @property
    def left(self) -> int:
        return self.params.max_tokens - len(self.output)

    def terminate(self, grammar_eos: Sequence[int] = ()) -> str:
        """Grammar termination (``engine.grammar``): the stream ends; the EOS the grammar's mask
        would force is counted like a stopping EOS when it is one of the request's EOS ids."""
        if self.eos & set(grammar_eos):
            self.usage.generation_tokens += 1
        self.usage.finish_reason = "stop"
        self.done = True
        return "grammar"


def prefill_chunks(
    model: Any, caches: list[Any], tokens: Sequence[int], step: int,
    kv: cache_ops.KVQuantization | None = None,
) -> mx.array | None:
    """Run ``tokens`` through ``model`` in chunks (mlx-lm ``_prefill``); return the last logits."""
    logits = None
    pos = 0
    while pos < len(tokens):
        chunk = list(tokens[pos : pos + step])
        logits = model(mx.array(chunk, mx.uint32)[None], cache=caches)
        cache_ops.quantize_kv(caches, kv)
        mx.eval([c.state for c in caches])
        pos += len(chunk)
    return logits
