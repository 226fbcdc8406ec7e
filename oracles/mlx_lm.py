"""Oracle runner for mlx-lm: ``stream_generate`` with and without a draft model.

Reference: mlx-lm 0.32.2 ``mlx_lm/generate.py`` — ``stream_generate`` (final
accounting ``generation_tokens = n + 1`` and ``finish_reason``), driving
``speculative_generate_step`` (two-model) or ``generate_step`` (plain). The
reference runs UNMODIFIED. The runner wraps both models in call-recording
proxies and passes its own cache list as ``prompt_cache`` (so it can digest the
caches mlx-lm drives), then rebuilds records from the log of forwards/yields:

- the first ``len(prompt) - 1`` tokens each model receives are its prefill;
- spec: each later target forward is one verify window ``[pending, *drafts]``;
  the draft forwards before it are the round's drafting (the first one's input
  is the feed); the responses yielded after it are that round's tokens
  (``from_draft`` marks accepted drafts). The caches are digested right before
  each round's first draft forward, which is after the previous round's
  rewind, and once more after the stream ends (its ``finally`` rewinds);
- plain: ``generate_step`` computes one step ahead, so the i-th decode forward
  produced the i-th token.

Quantized KV (``kv_bits``, ``kv_group_size``, ``quantized_kv_start``) is passed
to mlx-lm unchanged. Its ``maybe_quantize_kv_cache`` replaces caches in the
lists the generator slices from ``prompt_cache``, so the digests read the cache
list each model was last called with (the same objects as ours without
``kv_bits``). mlx-lm errors from the conversion (``RotatingKVCache.to_quantized``
is not implemented; ``mx.quantize`` refuses a head dim the group size does not
divide) are refusals of the case.
"""

from __future__ import annotations

import itertools
import time
from importlib import metadata
from typing import Any

from oracles import OracleUnavailable
from oracles.recording import CallRecorder
from traces.digest import cache_digest
from traces.records import counters_from_rounds
from traces.reference import ReferenceRefused

NAME = "mlx_lm"


def require() -> None:
    try:
        import mlx_lm  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised where mlx-lm is absent
        raise OracleUnavailable("mlx-lm is not installed") from exc


def version() -> str:
    return metadata.version("mlx-lm")


def run(
    target: Any,
    tokenizer: Any,
    prompt_ids: list[int],
    *,
    draft: Any = None,
    gamma: int = 3,
    max_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = 0,
    eos_ids: list[int] | None = None,
    stop_sequences: list[list[int]] | None = None,
    cache_digests: bool = True,
    logits_processors: dict[str, Any] | None = None,
    processor_history: str | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    quantized_kv_start: int | None = None,
) -> list[dict[str, Any]]:
    """Run mlx-lm on one case and return the trace records after the header.

    ``draft=None`` runs plain ``generate_step``; otherwise two-model
    ``speculative_generate_step`` with ``num_draft_tokens=gamma``. ``eos_ids``
    replaces the tokenizer's EOS set for this run (restored afterwards).
    ``stop_sequences`` are matched the way ``mlx_lm/server.py`` does: a
    ``StopSequences`` matcher advanced on every response, the consumer
    breaking (finish reason ``stop``) after the token that completes one.
    ``logits_processors`` are keyword arguments of mlx-lm's own
    ``sample_utils.make_logits_processors`` (repetition/presence/frequency
    penalties with their context sizes, ``logit_bias``); its output is passed
    unmodified to the generate functions, fresh for every run.
    ``processor_history`` (``full``/``last``) is where the case wants the
    processor history to start; mlx-lm starts it at the whole prompt in
    ``generate_step`` and at the LAST prompt token in
    ``speculative_generate_step`` (its ``_prefill`` never extends
    ``prev_tokens``), so a case asking for the other convention with a
    history-dependent processor is refused (known entry
    ``mlx-lm-spec-processor-history-omits-prompt``) rather than run under a
    convention it did not ask for.
    """
    require()
    spec = draft is not None
    own = "last" if spec else "full"
    lp = logits_processors or {}
    history_dependent = any(
        lp.get(k) not in (None, 0) for k in ("repetition_penalty", "presence_penalty", "frequency_penalty")
    )
    if history_dependent and processor_history is not None and processor_history != own:
        raise ReferenceRefused(
            NAME, "", f"mlx-lm {'speculative_generate_step' if spec else 'generate_step'}: "
            f"processor history starts at {'the last prompt token' if spec else 'the whole prompt'} "
            f"(history_prompt {own!r}), not {processor_history!r}; for a round-for-round comparison "
            f"use that convention (--processor-history {own}, case tag {'+hlast' if spec else 'without +hlast'})",
        )
    import mlx.core as mx
    from mlx_lm.generate import StopSequences, stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    log: list[tuple] = []
    t_cache = make_prompt_cache(target)
    d_cache = make_prompt_cache(draft) if spec else []
    n_prefill = len(prompt_ids) - 1
    fed = {"target": 0, "draft": 0}
    snaps: list[tuple[Any, Any]] = []
    live: dict[str, Any] = {"target": t_cache, "draft": d_cache}  # the lists mlx-lm drives

    def snapshot() -> tuple[Any, Any]:
        if not cache_digests:
            return None, None
        return cache_digest(live["target"]), (cache_digest(live["draft"]) if spec else None)

    def before(role: str, tokens: list[int]) -> None:
        decoding = fed[role] >= n_prefill
        fed[role] += len(tokens)
        last_call = next((e for e in reversed(log) if e[0] == "call"), None)
        if spec and role == "draft" and decoding and (last_call is None or last_call[1] == "target"):
            snaps.append(snapshot())

    t_proxy = _CacheTracking(target, log, "target", before, live)
    kwargs: dict[str, Any] = {
        "sampler": make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k),
        "prompt_cache": t_cache + d_cache,
    }
    if logits_processors:
        kwargs["logits_processors"] = make_logits_processors(**logits_processors)
    if spec:
        kwargs["draft_model"] = _CacheTracking(draft, log, "draft", before, live)
        kwargs["num_draft_tokens"] = gamma
    if kv_bits is not None:
        kwargs["kv_bits"] = kv_bits
        if kv_group_size is not None:
            kwargs["kv_group_size"] = kv_group_size
        if quantized_kv_start is not None:
            kwargs["quantized_kv_start"] = quantized_kv_start
    if seed is not None:
        mx.random.seed(seed)

    saved_eos = set(tokenizer.eos_token_ids)
    if eos_ids is not None:
        tokenizer.eos_token_ids = set(eos_ids)
    t0 = time.perf_counter()
    responses = []
    try:
        stream = stream_generate(t_proxy, tokenizer, mx.array(prompt_ids), max_tokens=max_tokens, **kwargs)
        matcher = StopSequences(stop_sequences or []).matcher()
        stopped = False
        try:
            first = next(stream)
        except ValueError as exc:
            raise ReferenceRefused(NAME, "", str(exc)) from exc
        except NotImplementedError as exc:  # e.g. RotatingKVCache Quantization NYI (kv_bits)
            raise ReferenceRefused(NAME, "", f"kv_bits {kv_bits}: {exc}") from exc
        try:
            for resp in itertools.chain([first], stream):
                log.append(("yield", int(resp.token), bool(resp.from_draft)))
                responses.append(resp)
                if matcher.advance(int(resp.token)):
                    stopped = True
                    break
        except (ValueError, NotImplementedError) as exc:
            if kv_bits is None:
                raise
            # the cache conversion once the offset reaches quantized_kv_start
            raise ReferenceRefused(NAME, "", f"kv_bits {kv_bits}: {exc}") from exc
        # Closing the stream closes mlx-lm's generator, whose ``finally``
        # rewinds the caches exactly as a consumer that stops would see.
        stream.close()
        eos = {int(t) for t in tokenizer.eos_token_ids}
    finally:
        tokenizer.eos_token_ids = saved_eos
    wall = time.perf_counter() - t0
    snaps.append(snapshot())
    final = responses[-1]
    usage = {
        "prompt_tokens": len(prompt_ids),
        "generation_tokens": int(final.generation_tokens),
        "finish_reason": "stop" if stopped else final.finish_reason,
    }
    return _rebuild(log, n_prefill, spec, eos, usage, snaps, wall)


class _CacheTracking(CallRecorder):
    """``CallRecorder`` that also keeps the cache list each model is called with."""

    def __init__(self, model: Any, log: list[tuple], role: str, before: Any, live: dict[str, Any]) -> None:
        super().__init__(model, log, role, before)
        self._live = live

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cache") is not None:
            self._live[self._role] = kwargs["cache"]
        return super().__call__(inputs, *args, **kwargs)


def _split_prefill(log: list[tuple], n_prefill: int) -> tuple[dict[str, list[int]], list[tuple]]:
    pre: dict[str, list[int]] = {"target": [], "draft": []}
    events: list[tuple] = []
    for entry in log:
        if entry[0] == "call":
            _, role, tokens, margins = entry
            take = min(len(tokens), n_prefill - len(pre[role]))
            if take > 0:
                pre[role].extend(tokens[:take])
                tokens, margins = tokens[take:], margins[take:]
                if not tokens:
                    continue
            entry = ("call", role, tokens, margins)
        events.append(entry)
    return pre, events


def _rebuild(
    log: list[tuple],
    n_prefill: int,
    spec: bool,
    eos: set[int],
    usage: dict[str, Any],
    snaps: list[tuple[Any, Any]],
    wall: float,
) -> list[dict[str, Any]]:
    pre, events = _split_prefill(log, n_prefill)
    t_snap, d_snap = snaps[0] if spec else (None, None)
    records: list[dict[str, Any]] = [
        {
            "type": "prefill",
            "target_tokens": pre["target"],
            "drafter_tokens": pre["draft"] if spec else None,
            "target_cache_digest": t_snap,
            "drafter_cache_digest": d_snap,
        }
    ]
    produced = [(e[1], e[2]) for e in events if e[0] == "yield"]
    n_total = len(produced)
    # How the last produced token ended the stream when it was not an EOS.
    last_end = "stop" if usage["finish_reason"] == "stop" else "budget"
    output: list[int] = []

    if not spec:
        calls = [e for e in events if e[0] == "call"]
        for i, (tok, _) in enumerate(produced):
            _, _, inp, margins = calls[i]
            end = "eos" if tok in eos else (last_end if i == n_total - 1 else None)
            emitted = [] if tok in eos else [tok]
            output.extend(emitted)
            records.append({
                "type": "plain", "index": i, "input": inp, "sample": tok, "margin": margins[-1],
                "emitted": emitted, "end": end, "reason": "baseline",
                "target_cache_digest": None, "time_s": None,
            })
        records.append(_footer(usage, None, output, wall))
        return records

    seen = 0
    feed: list[int] | None = None
    current: dict[str, Any] | None = None
    rounds: list[dict[str, Any]] = []
    for ev in events:
        if ev[0] == "call" and ev[1] == "draft":
            if feed is None:
                feed = ev[2]
        elif ev[0] == "call":
            window, margins = ev[2], ev[3]
            current = {
                "type": "round", "index": len(rounds), "feed": feed or [], "drafts": window[1:],
                "window": window, "samples": [], "k_accept": 0, "emitted": [], "end": None,
                "margins": margins, "confidence": None,
                "target_cache_digest": None, "drafter_cache_digest": None, "time_s": None,
            }
            rounds.append(current)
            feed = None
        else:
            assert current is not None, "a token was yielded before any verify forward"
            tok, from_draft = ev[1], ev[2]
            seen += 1
            current["samples"].append(tok)
            current["k_accept"] += int(from_draft)
            if tok in eos:
                current["end"] = "eos"
                continue
            current["emitted"].append(tok)
            output.append(tok)
            if seen == n_total:
                current["end"] = last_end
    for r, rec in enumerate(rounds):
        d, k = len(rec["drafts"]), rec["k_accept"]
        if rec["end"] is None:
            rec["end"] = "correction" if k < d else "bonus"
        if r + 1 < len(snaps):
            rec["target_cache_digest"], rec["drafter_cache_digest"] = snaps[r + 1]
    records.extend(rounds)
    records.append(_footer(usage, counters_from_rounds(rounds), output, wall))
    return records


def _footer(usage: dict[str, Any], spec: dict[str, Any] | None, output: list[int], wall: float) -> dict[str, Any]:
    return {"type": "footer", "usage": usage, "speculation": spec, "output_ids": output, "wall_s": wall}
