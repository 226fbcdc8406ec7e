"""The numerics witness for token fast-forwarding: does arithmetic alone explain fill ≠ plain?

A fill run (``engine.fill.proposal``) writes appended spans with ONE multi-token forward
and then samples the next position from that forward's last kept row; plain decode
(``engine.executor.plain_generate``) computes every row with a one-token forward. On a
backend whose multi-token forward is not bit-exact to one-token decode (MLX on Apple
GPUs and CUDA, ``engine.nonexact`` on the CPU) the two may pick different tokens at a
knife-edge. Same rule as ``engine.witness`` (§2.1): ``numerics`` only when each run's
own arithmetic path, replayed here on the same prefix, reproduces its own token;
otherwise ``logic``. A token an assert span FORCED is never arithmetic: if plain decode
gives another one there, the source asserted a wrong id (``logic``).

The fill path is rebuilt from the run's output ids and its append events (each
``{position, ids, kept, policy}``; the apply primitive of ``engine.fill.proposal``):
tail-split prefill; a one-token forward per sampled position; at an append, the span
forwarded at once (a verify span trimmed to its kept ids), its rows giving the tokens
after it. Each sampled row goes through the request's sampling pipeline
(``engine.pipeline.SamplingPipeline``) advanced over the tokens before it, as in the run.
Greedy runs only (a sampled fill run is the §7 behaviour-policy deviation, never a
token-identity claim).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine.pipeline import SamplingPipeline
from engine.sampler import token_ids
from engine.stream import PLAIN_PREFILL_STEP, prefill_chunks
from engine.witness import PathEval, max_row_delta, pair_delta, top2_allowed
from traces.diff import WitnessVerdict

__all__ = ["fill_path", "witness_fill_flip"]


def _sampled(pipe: SamplingPipeline, row: mx.array, prefix: Sequence[int]) -> tuple[int, mx.array]:
    """The pipeline's greedy pick from ``row`` after ``prefix`` was emitted, and the row it saw."""
    pipe.advance(list(prefix[pipe.generated:]))
    view = pipe.view(row)
    return token_ids(pipe.draw(view - mx.logsumexp(view, keepdims=True), pipe.generated))[0], view


def fill_path(model: Any, prompt_ids: Sequence[int], params: Any, fill_ids: Sequence[int],
              events: Sequence[dict[str, Any]], position: int) -> PathEval:
    """Replay the fill run's forwards up to output ``position`` and evaluate the row that gave
    its token there (module docstring); a forced (asserted) token has no row: ``path`` says so
    and ``token`` is the forced id."""
    from mlx_lm.models.cache import make_prompt_cache

    pipe = SamplingPipeline(params, list(prompt_ids), seed_stream=False)
    caches = make_prompt_cache(model)
    prompt = list(prompt_ids)
    prefill_chunks(model, caches, prompt[:-1], params.prefill_step_size or PLAIN_PREFILL_STEP)
    row = model(mx.array(prompt[-1:], mx.uint32)[None], cache=caches)[:, -1, :]
    how = "one-token decode step"
    at = {int(e["position"]): e for e in events}
    ran = int(fill_ids[position]) if position < len(fill_ids) else None
    q = 0
    while True:
        ev = at.get(q)
        if ev is not None:
            ids, kept = [int(t) for t in ev["ids"]], int(ev["kept"])
            if q == position and ev["policy"] == "assert":
                return _forced(ids[0], ran, f"asserted by append {ev['event']} ({ev['origin']})")
            if q == position:  # a verify span's first id is the in-flight sample from ``row``
                break
            span = model(mx.array(ids, mx.uint32)[None], cache=caches)
            if kept < len(ids):
                for c in caches:
                    c.trim(len(ids) - kept)
            if q < position < q + kept:
                if ev["policy"] == "assert":
                    return _forced(ids[position - q], ran, f"asserted by append {ev['event']} ({ev['origin']})")
                row, how = span[:, position - q - 1, :], f"verify span of {len(ids)} (one forward), row {position - q - 1}"
                break
            row, how = span[:, kept - 1, :], f"span of {len(ids)} (one forward, {ev['policy']}), row {kept - 1}"
            q += kept
            if q == position:
                break
            continue
        if q == position:
            break
        row = model(mx.array([int(fill_ids[q])], mx.uint32)[None], cache=caches)[:, -1, :]
        how = "one-token decode step"
        q += 1
    token, view = _sampled(pipe, row, list(fill_ids[:position]))
    r = view[0].astype(mx.float32)
    mx.eval(r)
    return PathEval(f"fill position {position}", how, token, top2_allowed(r), r, ran)


def _plain_path(model: Any, prompt_ids: Sequence[int], params: Any, prefix: list[int]) -> PathEval:
    """Plain decode's path on ``prompt + prefix`` (``engine.witness.serial_path`` with the
    request's own pipeline): tail-split prefill, then one token per forward."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    prompt = list(prompt_ids)
    prefill_chunks(model, caches, prompt[:-1], params.prefill_step_size or PLAIN_PREFILL_STEP)
    row = None
    for tok in [prompt[-1], *prefix]:
        row = model(mx.array([tok], mx.uint32)[None], cache=caches)[:, -1, :]
    assert row is not None
    token, view = _sampled(SamplingPipeline(params, prompt, seed_stream=False), row, prefix)
    r = view[0].astype(mx.float32)
    mx.eval(r)
    return PathEval("plain", f"plain one-token decode of the {len(prefix)}-token prefix", token, top2_allowed(r), r)


def _forced(token: int, ran: int | None, why: str) -> PathEval:
    r = mx.full((max(token, 1) + 1,), -mx.inf)
    return PathEval("fill", f"forced: {why}", token, ((token, 0.0), (-1, float("-inf"))), r, ran)


def witness_fill_flip(model: Any, prompt_ids: Sequence[int], params: Any, fill_ids: Sequence[int],
                      events: Sequence[dict[str, Any]], plain_ids: Sequence[int], position: int) -> WitnessVerdict:
    """Judge a fill ≠ plain difference at output ``position`` (module docstring)."""
    if params.sampler.temperature:
        raise ValueError("the fill witness judges greedy runs only")
    if list(fill_ids[:position]) != list(plain_ids[:position]):
        raise ValueError(f"fill and plain differ before output position {position}")
    pf = fill_path(model, prompt_ids, params, fill_ids, events, position)
    ps = _plain_path(model, prompt_ids, params, list(plain_ids[:position]))
    xa = int(fill_ids[position]) if position < len(fill_ids) else None
    xb = int(plain_ids[position]) if position < len(plain_ids) else None
    ps.ran = xb
    evidence = [pf.format(), ps.format()]
    data: dict[str, Any] = {"paths": [pf.to_dict(), ps.to_dict()], "device": str(mx.default_device()),
                            "prefix_len": position}
    if pf.path.startswith("forced"):
        reason = (f"fill forced {xa} at output position {position} ({pf.path[8:]}) where plain decode's path "
                  f"gives {ps.token}: the source asserted an id the model does not pick")
        return WitnessVerdict("logic", reason, tuple(evidence), data)
    if xa is None or xb is None:
        return WitnessVerdict("logic", f"one run ended at output position {position} and the other did not",
                              tuple(evidence), data)
    delta = f"Δ = logit[{xa}] - logit[{xb}]: fill {pair_delta(pf, xa, xb):+.4g}, plain {pair_delta(ps, xa, xb):+.4g}"
    evidence.append(f"{delta}; max |row fill - row plain| {max_row_delta(pf.row, ps.row):.3g}")
    if pf.reproduced and ps.token == xb:
        return WitnessVerdict("numerics", f"on the same {position}-token prefix, fill's path gives {xa} and plain's "
                              f"gives {xb}: arithmetic alone", tuple(evidence), data)
    bad = []
    if not pf.reproduced:
        bad.append(f"fill emitted {xa} but its path gives {pf.token}")
    if ps.token != xb:
        bad.append(f"plain emitted {xb} but its path gives {ps.token}")
    return WitnessVerdict("logic", "; ".join(bad) + ": the arithmetic does not explain it", tuple(evidence), data)
