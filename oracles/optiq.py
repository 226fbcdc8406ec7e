"""Oracle runner for mlx-optiq: n-gram prompt-lookup speculation and plain decode.

Reference: mlx-optiq 0.7.7 ``optiq/runtime/ngram_spec.py`` ``ngram_generate_step``
(``NgramIndex.propose_detail``, ``AcceptanceGate``), wired the way
``optiq/serve.py`` ``install_ngram_speculation`` wires it: mlx-lm 0.32.2
``mlx_lm.generate.stream_generate`` with the module-level ``generate_step``
swapped for the n-gram generator for the duration of one request (restored
afterwards). Plain mode is the same ``stream_generate`` left unswapped
(optiq's ``_PLAIN_GENERATE_STEP``). optiq runs UNMODIFIED; ``adaptive=False``
turns its wall-clock acceptance gate off (a documented argument) so that runs
are deterministic.

Recorded from outside: a call-recording proxy over the target and the
response stream. Every decode forward over ``[cur, *drafts]`` is one round
(window); the tokens yielded after it are its accepted drafts, and the next
forward's head is its correction/bonus (optiq feeds a token before yielding
it). optiq runs ONE pass ahead: the last forward fed the final yielded token
and its samples are never consumed; it is reported in ``info["trailing_forwards"]``
and not recorded as a round. ``feed`` is derived with mlx-lm's re-feed rule.

Accounting is optiq's own, recorded raw: the response stream carries the
stopping EOS as the last token (``output_ids`` ends with it) and
``generation_tokens`` counts it. ``traces/normalize.py`` holds the named
normalization that maps this onto the engine's convention.
"""

from __future__ import annotations

import time
from importlib import metadata
from typing import Any

from oracles import OracleUnavailable
from oracles.recording import CallRecorder, top2_margins
from traces.records import counters_from_rounds

NAME = "optiq"


def require() -> None:
    try:
        import optiq.runtime.ngram_spec  # noqa: F401
    except ImportError as exc:
        raise OracleUnavailable("mlx-optiq is not installed") from exc


def version() -> str:
    return metadata.version("mlx-optiq")


def run(target: Any, tokenizer: Any, prompt_ids: list[int], **kwargs: Any) -> list[dict[str, Any]]:
    """``run_detailed`` without the side information."""
    return run_detailed(target, tokenizer, prompt_ids, **kwargs)[0]


def run_detailed(
    target: Any,
    tokenizer: Any,
    prompt_ids: list[int],
    *,
    ngram: bool = True,
    gamma: int = 10,
    ngram_min: int = 3,
    ngram_max: int = 3,
    max_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = 0,
    eos_ids: list[int] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run optiq on one case: (trace records after the header, side info).

    ``ngram=False`` runs the plain path. Side info: optiq's own ``NgramStats``
    (``stats``) and the number of trailing forwards not recorded as rounds.
    """
    require()
    import importlib

    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler
    from optiq.runtime.ngram_spec import _PLAIN_GENERATE_STEP, NgramStats, ngram_generate_step

    gen_mod = importlib.import_module("mlx_lm.generate")
    log: list[tuple] = []
    cache = make_prompt_cache(target)
    stats = NgramStats()

    def generate_step(p: Any, m: Any, *rest: Any, **kw: Any) -> Any:
        kw.pop("input_embeddings", None)
        kw.pop("stream", None)
        yield from ngram_generate_step(
            p,
            m,
            context_tokens=None,
            num_draft_tokens=gamma,
            ngram_min=ngram_min,
            ngram_max=ngram_max,
            stats=stats,
            adaptive=False,
            **kw,
        )

    if seed is not None:
        mx.random.seed(seed)
    saved_eos = set(tokenizer.eos_token_ids)
    if eos_ids is not None:
        tokenizer.eos_token_ids = set(eos_ids)
    if ngram:
        gen_mod.generate_step = generate_step
    t0 = time.perf_counter()
    responses = []
    try:
        stream = stream_generate(
            CallRecorder(target, log),
            tokenizer,
            mx.array(prompt_ids),
            max_tokens=max_tokens,
            sampler=make_sampler(temp=temperature, top_p=top_p, top_k=top_k),
            prompt_cache=cache,
        )
        for resp in stream:
            log.append(("yield", int(resp.token)))
            responses.append(resp)
        stream.close()
        eos = {int(t) for t in tokenizer.eos_token_ids}
    finally:
        gen_mod.generate_step = _PLAIN_GENERATE_STEP
        tokenizer.eos_token_ids = saved_eos
    wall = time.perf_counter() - t0
    final = responses[-1]
    usage = {
        "prompt_tokens": len(prompt_ids),
        "generation_tokens": int(final.generation_tokens),
        "finish_reason": final.finish_reason,
    }
    records, trailing = _rebuild(log, len(prompt_ids) - 1, ngram, eos, usage, wall)
    info = {"stats": dict(stats.__dict__), "trailing_forwards": trailing}
    return records, info


def _rebuild(
    log: list[tuple], n_prefill: int, ngram: bool, eos: set[int], usage: dict[str, Any], wall: float
) -> tuple[list[dict[str, Any]], int]:
    prefill: list[int] = []
    calls: list[tuple[list[int], list[float]]] = []
    for entry in log:
        if entry[0] != "call":
            continue
        tokens, margins = entry[2], entry[3]
        take = min(len(tokens), n_prefill - len(prefill))
        prefill.extend(tokens[:take])
        if len(tokens) > take:
            calls.append((tokens[take:], margins[take:]))
    produced = [e[1] for e in log if e[0] == "yield"]
    records: list[dict[str, Any]] = [
        {
            "type": "prefill",
            "target_tokens": prefill,
            "drafter_tokens": [] if ngram else None,
            "target_cache_digest": None,
            "drafter_cache_digest": None,
        }
    ]
    stop_end = "eos" if usage["finish_reason"] == "stop" else "budget"
    output = list(produced)  # raw: optiq's stream carries the stopping EOS
    if not ngram:
        for i, tok in enumerate(produced):
            inp, margins = calls[i]
            last = i == len(produced) - 1
            records.append(
                {
                    "type": "plain",
                    "index": i,
                    "input": inp,
                    "sample": tok,
                    "margin": margins[-1],
                    "emitted": [tok],
                    "end": stop_end if last else None,
                    "reason": "baseline",
                    "target_cache_digest": None,
                    "time_s": None,
                }
            )
        records.append(_footer(usage, None, output, wall))
        return records, len(calls) - len(produced)

    rounds: list[dict[str, Any]] = []
    pos = 0  # next unconsumed index into ``produced``
    for i, (window, margins) in enumerate(calls):
        if pos >= len(produced):
            break  # the pass that fed the final token: run one ahead, never consumed
        drafts = window[1:]
        k = 0
        while k < len(drafts) and pos + k < len(produced) and produced[pos + k] == drafts[k]:
            k += 1
        if i + 1 < len(calls) and pos + k < len(produced):
            nxt = calls[i + 1][0][0]
            if produced[pos + k] != nxt:
                raise RuntimeError(
                    f"optiq round {i}: yielded {produced[pos + k]} but fed {nxt} next"
                )
        emitted = produced[pos : pos + k + 1]
        pos += len(emitted)
        samples = list(emitted)
        if pos == len(produced):
            end = stop_end
        else:
            end = "correction" if k < len(drafts) else "bonus"
        prev = rounds[-1] if rounds else None
        if prev is None:
            feed = window[:1]
        elif prev["drafts"] and prev["k_accept"] == len(prev["drafts"]):
            feed = [prev["drafts"][-1], window[0]]
        else:
            feed = window[:1]
        rounds.append(
            {
                "type": "round",
                "index": len(rounds),
                "feed": feed,
                "drafts": drafts,
                "window": window,
                "samples": samples,
                "k_accept": k,
                "emitted": emitted,
                "end": end,
                "margins": margins,
                "confidence": None,
                "target_cache_digest": None,
                "drafter_cache_digest": None,
                "time_s": None,
            }
        )
    records.extend(rounds)
    records.append(_footer(usage, counters_from_rounds(rounds), output, wall))
    return records, len(calls) - len(rounds)


def _footer(
    usage: dict[str, Any], spec: dict[str, Any] | None, output: list[int], wall: float
) -> dict[str, Any]:
    return {
        "type": "footer",
        "usage": usage,
        "speculation": spec,
        "output_ids": output,
        "wall_s": wall,
    }


# ----------------------------------------------------------------- assistant
# mlx-optiq 0.7.7 ``optiq/runtime/spec/runtime.py`` ``spec_generate`` with
# ``GemmaAssistantDrafter.from_pretrained`` (``drafters/gemma_assistant.py``),
# run UNMODIFIED. Recorded from outside: a proxy over the target whose
# ``model`` (the inner model optiq calls for hidden + logits) logs every forward,
# and a tokenizer proxy whose ``encode`` returns the case's prompt ids (optiq
# takes a prompt string). The first forward is the full-prompt prefill (its
# sample is the first token, a plain ``initial`` record); each later forward is
# one verify window ``[next_token, *drafts]``; the SpecEvents yielded after it
# are that round's tokens (``from_draft`` marks accepted drafts). Accounting is
# optiq's own, recorded raw: every round drafts γ (even with fewer tokens
# left) and the stopping EOS is yielded; ``traces/normalize.py`` holds the two
# named normalizations (``optiq-spec-budget-drafts``, ``optiq-stopping-eos``).


class _InnerRecorder:
    def __init__(self, inner: Any, log: list[tuple]) -> None:
        self._inner = inner
        self._log = log
        self._owner: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        out = self._inner(inputs, *args, **kwargs)
        # Margins (diagnostic, never compared) from the model's own head over this hidden.
        head = getattr(self._owner, "lm_head", None) or self._inner.embed_tokens.as_linear
        tokens = [int(t) for t in inputs[0].tolist()]
        self._log.append(("call", "target", tokens, top2_margins(head(out)[0])))
        return out


class _TargetProxy:
    def __init__(self, model: Any, log: list[tuple]) -> None:
        self._model = model
        self.model = _InnerRecorder(model.model, log)
        self.model._owner = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class _PromptTokenizer:
    def __init__(self, ids: list[int], eos: int) -> None:
        self._ids = list(ids)
        self.eos_token_id = eos

    def encode(self, _prompt: str) -> list[int]:
        return list(self._ids)

    def decode(self, ids: list[int]) -> str:
        return ""


def require_assistant() -> None:
    require()
    try:
        import optiq.runtime.spec  # noqa: F401
    except ImportError as exc:
        raise OracleUnavailable("mlx-optiq without optiq.runtime.spec") from exc


def run_assistant(
    target: Any,
    drafter_path: str,
    prompt_ids: list[int],
    *,
    gamma: int = 3,
    max_tokens: int = 32,
    eos_id: int,
    draft_logits: list[list[dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """optiq ``spec_generate`` (greedy) on one case: the raw trace records after the header.

    ``draft_logits``, when given, receives per round record the
    ``oracles.drafts.logits_digest`` of every draft's logits, read by wrapping
    the drafter instance's ``forward`` (``spec_generate`` drafts with
    ``argmax(drafter.forward(...)[0])``); a round's drafts are the forwards
    between the previous target call and its verify call.
    """
    require_assistant()
    from optiq.runtime.spec import GemmaAssistantDrafter, SpecConfig, spec_generate

    drafter = GemmaAssistantDrafter.from_pretrained(str(drafter_path))
    log: list[tuple] = []
    steps: list[tuple[int, dict[str, Any]]] = []
    if draft_logits is not None:
        from oracles.drafts import logits_digest

        forward = drafter.forward

        def recording_forward(*a: Any, **k: Any) -> Any:
            out = forward(*a, **k)
            steps.append((sum(1 for e in log if e[0] == "call"), logits_digest(out[0])))
            return out

        drafter.forward = recording_forward
    t0 = time.perf_counter()
    cfg = SpecConfig(gamma=gamma, max_tokens=max_tokens, eos_token_id=eos_id)
    for ev in spec_generate(_TargetProxy(target, log), drafter, _PromptTokenizer(prompt_ids, eos_id), "", cfg):
        if ev.kind == "token":
            log.append(("yield", int(ev.token_id), bool(ev.from_draft)))
    records = _rebuild_assistant(log, prompt_ids, eos_id, max_tokens, time.perf_counter() - t0)
    if draft_logits is not None:
        rounds = [r for r in records if r["type"] == "round"]
        for i, r in enumerate(rounds):  # round i is target call i + 1 (call 0 is the prefill)
            rows = [d for n, d in steps if n == i + 1]
            if len(rows) != len(r["drafts"]):
                raise RuntimeError(f"optiq assistant round {i}: {len(rows)} drafter forwards for "
                                   f"{len(r['drafts'])} drafts")
            draft_logits.append(rows)
    return records


def _rebuild_assistant(
    log: list[tuple], prompt_ids: list[int], eos_id: int, max_tokens: int, wall: float
) -> list[dict[str, Any]]:
    calls = [e[2] for e in log if e[0] == "call"]
    margins = [e[3] for e in log if e[0] == "call"]
    if not calls or calls[0] != list(prompt_ids):
        raise RuntimeError(f"optiq assistant: first forward {calls[:1]} is not the full prompt prefill")
    groups: list[list[tuple[int, bool]]] = [[]]
    for e in log[1:]:
        if e[0] == "call":
            groups.append([])
        else:
            groups[-1].append((e[1], e[2]))
    produced = [t for g in groups for t, _ in g]
    if len(groups[0]) != 1:
        raise RuntimeError(f"optiq assistant: prefill yielded {len(groups[0])} tokens")
    first = groups[0][0][0]
    last_end = "eos" if produced[-1] == eos_id else "budget"
    records: list[dict[str, Any]] = [
        {"type": "prefill", "target_tokens": list(prompt_ids), "drafter_tokens": [],
         "target_cache_digest": None, "drafter_cache_digest": None},
        {"type": "plain", "index": 0, "input": [prompt_ids[-1]], "sample": first, "margin": margins[0][-1],
         "emitted": [first], "end": last_end if len(produced) == 1 else None, "reason": "initial",
         "target_cache_digest": None, "time_s": None},
    ]  # fmt: skip
    rounds: list[dict[str, Any]] = []
    prev_tok = first
    for i, (window, toks, mrg) in enumerate(zip(calls[1:], groups[1:], margins[1:], strict=True)):
        drafts = window[1:]
        if window[0] != prev_tok:
            raise RuntimeError(f"optiq assistant round {i}: window head {window[0]} != last token {prev_tok}")
        emitted = [t for t, _ in toks]
        k = sum(1 for _, fd in toks if fd)
        if i + 1 == len(calls) - 1:
            end = last_end
        else:
            end = "correction" if k < len(drafts) else "bonus"
        if not rounds:
            feed = [window[0]]
        elif rounds[-1]["k_accept"] == len(rounds[-1]["drafts"]):
            feed = [rounds[-1]["drafts"][-1], window[0]]
        else:
            feed = [window[0]]
        rounds.append({
            "type": "round", "index": i, "feed": feed, "drafts": drafts, "window": window,
            "samples": list(emitted), "k_accept": k, "emitted": emitted, "end": end,
            "margins": mrg, "confidence": None, "target_cache_digest": None,
            "drafter_cache_digest": None, "time_s": None,
        })  # fmt: skip
        if emitted:
            prev_tok = emitted[-1]
    records.extend(rounds)
    usage = {"prompt_tokens": len(prompt_ids), "generation_tokens": len(produced),
             "finish_reason": "stop" if produced[-1] == eos_id else "length"}
    records.append(_footer(usage, counters_from_rounds(rounds, n_plain=1), list(produced), wall))
    return records
