"""A test double of an OpenAI-compatible server over real in-process decode, with planted bugs.

Not a server users grade (it lives under ``tests/``): the served checks
(``subjects/served/``) and the grader (``specparity/grading/http_servers.py``) are tested
against it. It speaks the API of mlx-lm 0.32.2 ``mlx_lm/server.py`` with the same
response shapes (``APIHandler.generate_response`` / ``handle_completion`` /
``completion_usage_response`` / ``handle_health_check``: ``/v1/completions`` with
a text or token-id prompt, ``/v1/chat/completions``, SSE streaming with
``stream_options.include_usage``, ``/health``, ``/v1/models``, ``max_tokens``,
``stop``, ``logprobs`` / ``top_logprobs`` as ``choices[0].logprobs.content``,
``usage`` with ``prompt_tokens_details.cached_tokens``, ``finish_reason``), and
vLLM's ``/metrics`` speculation counters (``vllm:spec_decode_num_draft_tokens_total``
/ ``..._accepted_tokens_total``). Prompts are built as mlx-lm's
``ResponseGenerator._tokenize`` builds them (the tokenizer's encoding; its chat
template, or ``mlx_lm.server.convert_chat`` without one).

A real server's double, not a perfect one:

- decoding is our engine's greedy plain decode (``engine.executor.plain_generate``)
  or, with ``--draft-model``, its two-model speculative decode (``spec_generate``);
- requests are **batched**: the worker takes every request that arrives within
  ``batch_window`` seconds of the first and answers them together, so requests
  are in flight together (``stats['max_inflight']`` / ``stats['max_batch']``);
- streamed text comes from a streaming detokenizer that holds back a
  multi-byte character split across tokens (byte-level models: the bytes of one
  character in two deltas), as mlx-lm's ``BPEStreamingDetokenizer`` does;
- logprobs are rounded to bf16 (8 significant bits), as a bf16 model's are;
- a prompt cache (``--prompt-cache-size``, 0 = off) remembers each prompt + output
  and reports the longest cached prefix as ``cached_tokens``;
- sampling: ``temperature``, ``seed`` (unseeded: a random one), ``logit_bias``
  (engine.sampler ``SamplerParams`` / ``ProcessorParams``);
- under speculation, streamed deltas carry a round's block of tokens (several per delta);
- tool calls (chat ``tools``, a model with a chat template only: the template renders
  them): the double's tool format is the whole output as one call of the first tool,
  ``{"text": output}`` (``finish_reason`` ``tool_calls``), streamed as OpenAI deltas
  (the name, then the arguments in pieces).

Planted bugs (``--bug NAME`` or ``SPECPARITY_FAKE_SERVER_BUG``; each names the
check meant to catch it, and only that check):

- ``system-prompt`` (identity): chat requests get an injected system message;
- ``stream-drop-byte`` (stream): the second streamed delta loses its last byte;
- ``overrun`` (budget): a budget that is not a multiple of 4 gets one token too many;
- ``finish-label`` (finish_reason): 'stop' when the budget ends generation;
- ``stop-label`` (finish_reason): 'length' when a stop string ends it;
- ``usage-reencode`` (usage): ``completion_tokens`` counted by re-encoding the text
  (visible on a byte-level model only);
- ``chat-usage-off`` (usage): a chat reply's ``completion_tokens`` counts one token more than it
  returned (an end-of-turn token it does not hold); completions replies are right;
- ``stop-cut-out`` (stop): a stop string does not stop generation: it is cut out of the text, which
  goes on to the budget;
- ``eos-leak`` (eos): the EOS token's text is appended when generation ends on EOS;
- ``stop-trailing-logprob`` (stop): a stop inside a speculative block leaves the
  block's next token in ids/logprobs (text and usage trimmed right);
- ``logprob-off`` (logprobs): logprobs off beyond tolerance (×1.03 − 0.02);
- ``cache-drop`` (cache): after a prompt-cache hit the first generated token is dropped;
- ``cache-every-tenth`` (cache): every tenth request that hits the prompt cache drops its first
  generated token (a wrong output 1 request in 10);
- ``cache-no-logprobs`` (cache): after a prompt-cache hit, a request WITHOUT logprobs drops its first
  generated token (the logprobs path is right: a check that always asks for logprobs misses it);
- ``cache-short-save`` (cache, spec arm only): a cache entry saved under speculation
  is one token short, so a hit decodes as if the last reused token were missing;
- ``batch-leak`` (concurrency): a request batched behind another decodes on a prompt
  whose last token is its batch-mate's;
- ``seed-batch`` (seeded): a seeded request batched with others draws from a generator
  seeded by its seed and the batch's size (alone it is reproducible);
- ``tool-spec-mangle`` (tools): with speculation on, the streaming tool-call parser keeps
  only the last token's text of a delta that carries a block of several tokens;
- ``reject-placeholder`` (reject): id 0 is the server's draft-padding placeholder, so a
  rejected window whose drafts are all 0 is taken for padding and its first slot is emitted
  (and counted in usage) before the target's token; only a drafter that proposes nothing but
  0 (the zero-weight drafter of the all-reject arm) gets there;
- ``reject-usage`` (reject): the drafts of such rejected all-placeholder windows are counted
  in ``usage.completion_tokens`` (the ids are right);
- ``logit-bias-leak`` (leak): a request's ``logit_bias`` stays in the sampler and applies to
  every later request that sends none;
- ``models-500`` (liveness): ``GET /v1/models`` answers 500;
- ``spec-off`` (speculation): the draft model is loaded and never used;
- ``metrics-other-method`` (none: a limitation): ``/metrics`` has only zero counters labelled
  ``method="mtp"`` (qmlx-serve 0.16.0 under SuffixDecoding): an arm of another method cannot tell
  whether it speculated (cannot grade, never not-engaged);
- ``metrics-method-named`` (none: a limitation of the page, read right): ``/metrics`` has zero
  ``*spec_decode*`` counters labelled ``method="mtp"`` and the arm's real counts under names
  without "spec", labelled ``method="suffix"`` (rapid-mlx 0.16.10 under SuffixDecoding): an arm of
  method suffix reads those (speculation passes, never not-engaged);
- ``no-template`` (a set-up failure: cannot grade): chat requests are refused with
  transformers' "no chat template" error;
- ``no-token-ids`` (none: a limitation): token-id prompts are refused with HTTP 404 and an error
  body, as mlx_lm.server 0.32.2 refuses them (every generation error is its 404: "text input must
  be of type `str`"); the checks fall back to text where the ids round-trip, through
  ``/v1/completions`` still (the 404 is not a missing route);
- ``seed-ignored`` (none: a limitation): ``seed`` is ignored (every sampled request draws
  afresh), so seeded sampling cannot be judged: cannot grade, never a finding;
- ``no-tool-parser`` (none: a limitation): ``tools`` reach the chat template but no tool
  call is parsed from the output (plain content): n/a;
- ``wrap-system`` (identity, once: every check judged against plain decode of the prompt cannot
  grade; none where the row declares the wrapping): a completions text prompt is run as the one
  user message of a chat after the injected system message ``WRAP_SYSTEM`` (the chat template's
  rendered text encoded), chat requests without a system message get it too, token-id prompts are
  refused (fusion-mlx 0.10.24's ``/v1/completions``); it combines with another plant,
  ``wrap-system+stop-label`` (the other one's finding stays);
- ``legacy-logprobs`` (none: a dialect the harness speaks): ``/v1/completions`` takes OpenAI's legacy
  integer ``logprobs`` (the number of top entries; ``true`` reads as 1) and ignores ``top_logprobs``,
  as vmlx 1.6.81's CompletionRequest does: learnt from its one-entry answer, one line in the row;
- ``chat-only`` (none: a dialect the harness speaks): no ``/v1/completions`` (HTTP 404, mlx-vlm's
  server): every request is graded through chat, against the chat prompt;
- ``model-name`` (none: a dialect the harness speaks): a model name other than ``SERVED_NAME`` is
  refused (HTTP 400 "model ... not found"); ``/v1/models`` lists ``SERVED_NAME``;
- ``empty-error`` (an error returned as success, in the cells it breaks): the first generation
  request (the warm-up) and every one whose prompt has an odd length raise inside the engine: the
  exception is printed to the log and the answer is HTTP 200 with an empty text and
  ``finish_reason`` 'stop';
- ``health-counters`` (none: evidence read where the server keeps it): no ``/metrics`` counters; the
  draft / accept counts are in the ``/health`` body (vmlx's place): speculation passes;
- ``draft-disabled`` (speculation, from the log): the draft model is loaded, never used, its log says
  "draft model disabled under continuous batching" and no counter exists anywhere: not-engaged;
- ``no-counters`` (none: an unverifiable arm): speculates, but keeps no counter anywhere and logs
  nothing of it: the speculation cell cannot grade and every pass of the arm says "unverified";
- ``cache-on-anyway`` (none: a setting not in effect): the log says its prefix cache is on whatever
  the flags (an adaptive default): a row that observes it quotes the line;
- ``crash-start`` (a set-up failure: cannot grade): exits at start with a log line;
- ``slow`` (none: a correct but slow server, must pass): 0.2 s per answer, 10 ms per event;
- ``hang`` / ``die``: stops answering (sleeps) / exits from the 3rd generation request on.

``python -m tests.fake_server --model DIR [--draft-model DIR] [--port N] [--bug NAME]
[--prompt-cache-size N]``. Like servers users run, it echoes what it is handed: unknown arguments,
and environment variables whose names say they hold a token, key, secret or password.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import struct
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

BUGS = ("system-prompt", "stream-drop-byte", "overrun", "finish-label", "stop-label", "usage-reencode", "eos-leak",
        "stop-trailing-logprob", "logprob-off", "cache-drop", "cache-short-save", "batch-leak", "seed-batch",
        "tool-spec-mangle", "reject-placeholder", "reject-usage", "logit-bias-leak", "models-500", "spec-off", "no-template",
        "no-token-ids", "seed-ignored", "no-tool-parser", "crash-start", "slow", "hang", "die", "metrics-other-method",
        "metrics-method-named", "wrap-system", "chat-only", "model-name", "empty-error",
        "health-counters", "draft-disabled", "no-counters", "cache-on-anyway", "chat-usage-off", "cache-every-tenth",
        "cache-no-logprobs", "stop-cut-out", "legacy-logprobs")
class IdsRefused(ValueError):
    """The no-token-ids plant's refusal of a token-id prompt (answered HTTP 404, as mlx_lm.server does)."""


SERVED_NAME = "fake/served-model"  # the model-name plant's one model name (its /v1/models lists it)
WRAP_SYSTEM = "You are a helpful assistant."  # wrap-system's system message (fusion-mlx 0.10.24's)
NO_TEMPLATE = ("Cannot use chat template functions because tokenizer.chat_template is not set and no template "
               "argument was passed!")


def bf16(x: float) -> float:
    """``x`` rounded to bfloat16 (round to nearest even), as a float."""
    (u,) = struct.unpack("<I", struct.pack("<f", x))
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return float(struct.unpack("<f", struct.pack("<I", u))[0])


def _wants_logprobs(body: dict[str, Any]) -> bool:
    """Whether a non-streamed reply to ``body`` carries logprobs (only then is their forward pass run)."""
    if body.get("stream"):
        return False
    try:
        return bool(body.get("logprobs")) or int(body.get("top_logprobs", -1) or -1) > 0
    except (TypeError, ValueError):
        return True


class Job:
    def __init__(self, prompt: list[int], max_tokens: int, stop: list[str], sampling: dict[str, Any] | None = None,
                 want_top: bool = True) -> None:
        self.prompt, self.max_tokens, self.stop = prompt, max_tokens, stop
        self.sampling = sampling or {}  # temperature, seed, logit_bias ({id: bias})
        self.want_top = want_top  # the reply carries logprobs: their forward pass is run (else skipped)
        self.future: Future[dict[str, Any]] = Future()


class FakeEngine:
    """The model, its tokenizer, the decode, the prompt cache and the batching worker.

    Every MLX call runs on one worker thread (as mlx-lm's server runs its
    generation thread): MLX streams belong to the thread that made them.
    """

    def __init__(self, model: str, draft: str | None = None, num_draft: int = 3, bug: str | None = None,
                 prompt_cache_size: int = 16, batch_window: float = 0.05) -> None:
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self.arriving = 0  # connections accepted whose request is not yet counted in flight (:class:`_Server`)
        threading.Thread(target=self._work, daemon=True).start()
        self.path, self.num_draft = model, num_draft
        self.batch_window = batch_window
        self.model, self.tok, self.draft = self._call(self._load, model, draft)
        self.eos = tuple(sorted(self.tok.eos_token_ids))
        self.reset(bug, prompt_cache_size)

    def reset(self, bug: str | None = None, prompt_cache_size: int = 16) -> None:
        """A fresh server state (as a new process would have): cache, counters and stats cleared."""
        parts = bug.split("+") if bug else []
        for b in parts:
            if b not in BUGS:
                raise ValueError(f"unknown bug {b!r}; known: {', '.join(BUGS)}")
        self.wrap = "wrap-system" in parts  # combines with one other plant
        rest = [b for b in parts if b != "wrap-system"]
        if len(rest) > 1:
            raise ValueError(f"one plant besides wrap-system at a time, not {bug!r}")
        self.bug, self.cache_size = (rest[0] if rest else None), prompt_cache_size
        self.cache: list[tuple[int, ...]] = []
        self.requests = 0
        self.drafted = self.accepted = 0
        self.sticky_bias: dict[int, float] = {}  # logit-bias-leak: the last logit_bias seen
        self.stats = {"inflight": 0, "max_inflight": 0, "max_batch": 0, "batches": 0}


    # -- the worker

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if not isinstance(item, list):  # a plain call (loading)
                fn, args, fut = item
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                    fut.set_exception(exc)
                continue
            batch = item
            t0 = time.monotonic()
            t_end, t_tick = t0 + self.batch_window, t0 + 0.002
            while True:  # batching: the requests in flight or accepted now (or arriving within a 2 ms tick)
                wait_for = t_end if len(batch) < self.stats["inflight"] + self.arriving else t_tick
                if time.monotonic() >= wait_for:
                    break
                try:
                    more = self._jobs.get(timeout=max(0.0, wait_for - time.monotonic()))
                except queue.Empty:
                    break
                if isinstance(more, list):
                    batch.extend(more)
                else:
                    self._jobs.put(more)
                    break
            self.stats["max_batch"] = max(self.stats["max_batch"], len(batch))
            self.stats["batches"] += 1
            results: list[dict[str, Any] | BaseException] = []
            for k, job in enumerate(batch):
                try:
                    results.append(self._generate(job, batch[0] if k else None, len(batch)))
                except BaseException as exc:  # noqa: BLE001
                    results.append(exc)
            for job, res in zip(batch, results, strict=True):  # answered together, as one batch step
                if isinstance(res, BaseException):
                    job.future.set_exception(res)
                else:
                    job.future.set_result(res)

    def _call(self, fn: Any, *args: Any) -> Any:
        fut: Future[Any] = Future()
        self._jobs.put((fn, args, fut))
        return fut.result()

    @staticmethod
    def _load(model: str, draft: str | None) -> tuple[Any, Any, Any]:
        from engine.models import load

        loaded = load(model)
        return loaded.model, loaded.tokenizer, load(draft) if draft else None

    # -- requests

    def prompt(self, body: dict[str, Any], chat: bool) -> list[int]:
        if self.wrap:
            return self._wrapped(body, chat)
        if not chat:
            p = body["prompt"]
            if isinstance(p, list) and self.bug == "no-token-ids":
                raise IdsRefused("text input must be of type `str` (single example), `list[str]` (batch)")
            if isinstance(p, list):
                if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab for t in p):
                    raise ValueError("a token-id prompt must be a list of ids within the vocabulary")
                return list(p)
            if not isinstance(p, str):
                raise ValueError("prompt must be a string or a list of token ids")
            return list(self.tok.encode(p))
        msgs = list(body["messages"])
        if self.bug == "no-template":
            raise LookupError(NO_TEMPLATE)
        if self.bug == "system-prompt":
            msgs = [{"role": "system", "content": "You are a helpful assistant."}, *msgs]
        if self.tok.has_chat_template:
            kw = {"tools": body["tools"]} if body.get("tools") else {}
            return list(self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **kw))
        from mlx_lm.server import convert_chat

        return list(self.tok.encode(convert_chat(msgs, body.get("role_mapping"))))

    def _wrapped(self, body: dict[str, Any], chat: bool) -> list[int]:
        """wrap-system: every prompt through the chat template, the system message injected."""
        if chat:
            msgs = list(body["messages"])
        else:
            p = body["prompt"]
            if not isinstance(p, str):
                raise ValueError("prompt must be a string")
            msgs = [{"role": "user", "content": p}]
        if not msgs or msgs[0].get("role") != "system":
            msgs = [{"role": "system", "content": WRAP_SYSTEM}, *msgs]
        kw = {"tools": body["tools"]} if chat and body.get("tools") else {}
        return list(self.tok.encode(self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                                                 **kw)))

    @property
    def vocab(self) -> int:
        return int(self.model.args.vocab_size) if hasattr(self.model, "args") else 1 << 30

    def _cached(self, prompt: list[int]) -> int:
        if self.cache_size <= 0:
            return 0
        best = 0
        for seq in self.cache:
            n = 0
            for a, b in zip(seq, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, min(n, len(prompt) - 1))
        return best

    def generate(self, prompt: list[int], max_tokens: int, stop: list[str], sampling: dict[str, Any] | None = None,
                 want_top: bool = True) -> dict[str, Any]:
        job = Job(prompt, max_tokens, stop, sampling, want_top)
        self._jobs.put([job])
        return job.future.result()

    def _sampler(self, job: Job, batch: int) -> tuple[Any, int]:
        """The request's sampler settings and seed (engine.sampler names)."""
        import random

        from engine.sampler import ProcessorParams, SamplerParams

        sm = job.sampling
        bias = {int(k): float(v) for k, v in (sm.get("logit_bias") or {}).items()}
        if self.bug == "logit-bias-leak":
            if bias:
                self.sticky_bias = dict(bias)
            else:
                bias = dict(self.sticky_bias)  # the last request's bias never left the sampler
        seed = sm.get("seed")
        seed = int(seed) if isinstance(seed, int) and not isinstance(seed, bool) and self.bug != "seed-ignored" \
            else random.getrandbits(31)
        if self.bug == "seed-batch" and batch > 1:
            seed = seed * 1000003 + batch  # one generator per batch, not per request
        proc = ProcessorParams(logit_bias=tuple(sorted(bias.items())))
        return SamplerParams(temperature=float(sm.get("temperature") or 0.0), processors=proc), seed

    def _generate(self, job: Job, first: Job | None, batch: int = 1) -> dict[str, Any]:
        from engine.executor import GenerationParams, plain_generate, spec_generate

        prompt, max_tokens, stop = list(job.prompt), job.max_tokens, job.stop
        self.requests += 1
        if self.bug == "hang" and self.requests >= 3:
            time.sleep(3600)
        if self.bug == "die" and self.requests >= 3:
            os._exit(3)
        cached = self._cached(prompt)
        spec = self.draft is not None and self.bug not in ("spec-off", "draft-disabled")
        run_prompt = prompt
        if self.bug == "cache-short-save" and spec and cached >= 2:
            run_prompt = prompt[: cached - 1] + prompt[cached:]  # the entry lacks the last reused token's KV
        if self.bug == "batch-leak" and first is not None and first.prompt:
            run_prompt = prompt[:-1] + [first.prompt[-1]]
        budget = max_tokens + 1 if self.bug == "overrun" and max_tokens % 4 else max_tokens
        out: list[int] = []
        hit_at: list[int] = []

        def on_token(t: int) -> bool:
            out.append(t)
            if hit_at:  # the one token past the stop that a speculative block carries (planted)
                return False
            if stop and self.bug != "stop-cut-out" and any(s in self.tok.decode(out) for s in stop):
                hit_at.append(len(out))
                return self.bug == "stop-trailing-logprob"
            return True

        sampler, seed = self._sampler(job, batch)
        params = GenerationParams(max_tokens=budget, gamma=self.num_draft if spec else 0, eos_ids=self.eos,
                                  cache_digests=False, sampler=sampler, seed=seed)
        blocks: list[int] = []  # tokens per streamed delta (under speculation: each round's block)
        miscounted = 0  # reject-usage: rejected drafts counted as completion tokens
        leak: tuple[int, int] | None = None  # reject-placeholder: (position, the rejected draft id)
        if spec:
            from engine.sources.two_model import TwoModelProvider

            prov = TwoModelProvider(self.draft.model, draft_tokenizer=self.draft.tokenizer)
            res = spec_generate(self.model, prov, run_prompt, params, on_token=on_token)
            if res.speculation is not None:
                self.drafted += res.speculation.drafted
                self.accepted += res.speculation.accepted
            pos = 0
            for rec in res.records:
                if rec.get("type") != "round":
                    continue
                blocks.append(len(rec["emitted"]))
                if rec["k_accept"] == 0 and rec["drafts"] and not any(rec["drafts"]):  # all-placeholder, rejected
                    if self.bug == "reject-placeholder" and leak is None:
                        leak = (pos, 0)  # its first slot goes out
                    if self.bug == "reject-usage":
                        miscounted += len(rec["drafts"])
                pos += len(rec["emitted"])
        else:
            res = plain_generate(self.model, run_prompt, params, on_token=on_token)
        ids = list(res.output_ids)
        if sum(blocks) < len(ids):
            blocks = []  # a plain fallback inside the request: one token per delta
        n_gen = res.usage.generation_tokens
        eos_end = res.usage.finish_reason == "stop" and n_gen > len(res.output_ids) and not hit_at
        if self.cache_size > 0:
            self.cache.append(tuple(prompt + ids))
            del self.cache[: -self.cache_size]
        if self.bug == "cache-drop" and cached >= 2 and ids:
            ids = ids[1:]
        if self.bug == "cache-every-tenth" and cached >= 2 and ids:
            self.stats["hits"] = self.stats.get("hits", 0) + 1
            if self.stats["hits"] % 10 == 0:
                ids = ids[1:]
        if self.bug == "cache-no-logprobs" and cached >= 2 and ids and not (job.sampling or {}).get("logprobs"):
            ids = ids[1:]
        n_usage = hit_at[0] if hit_at else len(ids)
        n_usage += miscounted
        if leak is not None and leak[0] <= len(ids):
            ids.insert(leak[0], leak[1])
            n_usage += 1
            blocks = []
        return {"ids": ids, "finish": "stop" if hit_at else res.usage.finish_reason, "eos": eos_end,
                "cached": cached, "top": self._top(run_prompt, ids) if job.want_top else [], "n_usage": n_usage, "stopped": bool(hit_at),
                "blocks": blocks or [1] * len(ids), "spec": spec}

    def _top(self, prompt: list[int], ids: list[int]) -> list[tuple[float, list[tuple[int, float]]]]:
        import mlx.core as mx

        if not ids:
            return []
        logits = self.model(mx.array([prompt + ids]))[0, len(prompt) - 1 : len(prompt) + len(ids) - 1]
        lp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
        order = mx.argsort(-lp, axis=-1)[:, :11]
        lp_l, order_l = lp.tolist(), order.tolist()

        def r(v: float) -> float:
            return bf16(v * 1.03 - 0.02) if self.bug == "logprob-off" else bf16(v)

        return [(r(lp_l[i][t]), [(j, r(lp_l[i][j])) for j in order_l[i]]) for i, t in enumerate(ids)]


class StreamText:
    """Deltas of a growing id list: text up to the last complete character (a trailing U+FFFD is
    held back until the next token completes it, or the stream ends)."""

    def __init__(self, decode: Any) -> None:
        self.decode, self.sent = decode, ""

    def delta(self, ids: list[int], final: bool = False) -> str:
        text = self.decode(ids)
        if not final:
            text = text.rstrip("\ufffd")
        if not text.startswith(self.sent):
            return ""  # the decode of a longer prefix changed what was sent: wait for the end
        new = text[len(self.sent):]
        self.sent = text
        return new


def make_handler(engine: FakeEngine, control: bool = False) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        counted = False  # this connection's arrival taken off ``FakeEngine.arriving`` (:class:`_Server`)

        def _arrived(self) -> None:
            if not self.counted:
                self.counted = True
                engine.arriving -= 1

        def parse_request(self) -> bool:
            ok = super().parse_request()
            if not ok or self.command != "POST":  # only a generation request is counted in flight
                with engine._lock:
                    self._arrived()
            return ok

        def finish(self) -> None:
            with engine._lock:
                self._arrived()  # a connection closed before any request
            super().finish()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's signature
            pass

        def _json(self, status: int, doc: Any) -> None:
            raw = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/health":
                self._json(200, {"status": "ok"} | ({"speculative": {
                    "draft_tokens": engine.drafted, "accepted_tokens": engine.accepted, "acceptance_rate": 0.5}}
                    if engine.bug == "health-counters" else {}))
            elif self.path.startswith("/v1/models"):
                if engine.bug == "models-500":
                    self._json(500, {"error": "internal error"})
                    return
                name = SERVED_NAME if engine.bug == "model-name" else "default_model"
                self._json(200, {"object": "list", "data": [{"id": name, "object": "model",
                                                             "created": int(time.time())}]})
            elif self.path == "/metrics" and engine.bug == "metrics-other-method":
                raw = (b'spec_decode_attempts_total{family="x",method="mtp"} 0\n'  # qmlx-serve 0.16.0's page
                       b'spec_decode_accepts_total{family="x",method="mtp"} 0\n')
                self.send_response(200)
                self.send_header("Content-type", "text/plain")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            elif self.path == "/metrics" and engine.bug == "metrics-method-named":
                lbl = 'family="x",method="suffix"'  # rapid-mlx 0.16.10's page (rapid_mlx/routes/metrics.py)
                raw = (f'rapid_mlx_spec_decode_attempts_total{{family="x",method="mtp"}} 0\n'
                       f'rapid_mlx_spec_decode_accepts_total{{family="x",method="mtp"}} 0\n'
                       f'rapid_mlx_spec_decode_verify_calls_total{{family="x",method="mtp"}} 0\n'
                       f"rapid_mlx_suffix_decode_verify_steps_total{{{lbl}}} {engine.drafted}\n"
                       f"rapid_mlx_suffix_decode_draft_tokens_proposed_total{{{lbl}}} {engine.drafted}\n"
                       f"rapid_mlx_suffix_decode_draft_tokens_accepted_total{{{lbl}}} {engine.accepted}\n"
                       f"rapid_mlx_suffix_decode_accept_ratio{{{lbl}}} 1.0\n").encode()
                self.send_response(200)
                self.send_header("Content-type", "text/plain")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            elif self.path == "/metrics" and engine.bug in ("health-counters", "draft-disabled", "no-counters"):
                self._json(404, {"error": "Not Found"})
            elif self.path == "/metrics":
                raw = (f"# TYPE vllm:spec_decode_num_draft_tokens_total counter\n"
                       f"vllm:spec_decode_num_draft_tokens_total{{model_name=\"default_model\"}} {engine.drafted}\n"
                       f"vllm:spec_decode_num_accepted_tokens_total{{model_name=\"default_model\"}} "
                       f"{engine.accepted}\n").encode() if engine.draft is not None else b"# no speculation\n"
                self.send_response(200)
                self.send_header("Content-type", "text/plain")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            else:
                self._json(404, {"error": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802
            if control and self.path == "/fake/reset":  # the tests' control route: a fresh server state
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                stats = {**engine.stats, "drafted": engine.drafted, "accepted": engine.accepted}
                try:
                    engine.reset(body.get("bug"), int(body.get("prompt_cache_size", 16)))
                except ValueError as exc:
                    self._json(400, {"error": str(exc)})
                    return
                self._json(200, stats)
                return
            chat = self.path in ("/v1/chat/completions", "/chat/completions")
            if not chat and (self.path != "/v1/completions" or engine.bug == "chat-only"):
                self._json(404, {"error": "Not Found"})
                return
            with engine._lock:
                engine.stats["inflight"] += 1
                engine.stats["max_inflight"] = max(engine.stats["max_inflight"], engine.stats["inflight"])
                self._arrived()
            try:
                self._post(chat)
            finally:
                with engine._lock:
                    engine.stats["inflight"] -= 1

        def _post(self, chat: bool) -> None:
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens", 512))
                stop = body.get("stop") or []
                stop = [stop] if isinstance(stop, str) else list(stop)
                if engine.bug == "model-name" and body.get("model") != SERVED_NAME:
                    self._json(400, {"error": {"message": f"model {body.get('model')!r} not found"}})
                    return
                prompt = engine.prompt(body, chat)
            except IdsRefused as exc:  # mlx_lm.server's answer to any request its generator refuses
                self._json(404, {"error": str(exc)})
                return
            except LookupError as exc:
                self._json(500, {"error": str(exc)})
                return
            except (ValueError, KeyError, TypeError) as exc:
                self._json(400, {"error": str(exc)})
                return
            sampling = {k: body.get(k) for k in ("temperature", "seed", "logit_bias") if body.get(k) is not None}
            if engine.bug == "cache-no-logprobs":
                sampling["logprobs"] = bool(body.get("logprobs"))
            try:
                for k, v in (sampling.get("logit_bias") or {}).items():
                    if not -100 <= float(v) <= 100 or not 0 <= int(k) < engine.vocab:
                        raise ValueError(f"logit_bias {k}: {v} out of range")
                if float(sampling.get("temperature", 0.0)) < 0:
                    raise ValueError("temperature must be >= 0")
            except (ValueError, TypeError, AttributeError) as exc:
                self._json(400, {"error": str(exc)})
                return
            engine.stats["generated"] = engine.stats.get("generated", 0) + 1
            if engine.bug == "empty-error" and (engine.stats["generated"] == 1 or len(prompt) % 2):
                print("Traceback (most recent call last):\n  File \"engine.py\", line 1, in step\n"
                      f"IndexError: index {len(prompt)} is out of bounds for axis 0", file=sys.stderr, flush=True)
                r = {"ids": [], "finish": "stop", "eos": False, "stopped": False, "n_usage": 0, "cached": 0,
                     "blocks": [], "top": [], "spec": False}
                self._respond(body, chat, prompt, r, stop)
                return
            r = engine.generate(prompt, max_tokens, stop, sampling, want_top=_wants_logprobs(body))
            if engine.bug == "slow":
                time.sleep(0.2)
            self._respond(body, chat, prompt, r, stop)

        def _respond(self, body: dict[str, Any], chat: bool, prompt: list[int], r: dict[str, Any],
                     stop: list[str]) -> None:
            tok = engine.tok
            ids = r["ids"]
            text = tok.decode(ids)
            for s in stop:
                if s in text and engine.bug == "stop-cut-out":
                    text = text.replace(s, "", 1)
                elif s in text:
                    text = text[: text.find(s)]
            finish = r["finish"]
            if engine.bug == "eos-leak" and r["eos"]:
                text += tok.convert_ids_to_tokens(engine.eos[0])
            if engine.bug == "finish-label" and finish == "length":
                finish = "stop"
            if engine.bug == "stop-label" and r["stopped"]:
                finish = "length"
            n_out = len(tok.encode(text, add_special_tokens=False)) if engine.bug == "usage-reencode" \
                else r["n_usage"] + (1 if r["eos"] else 0)
            if engine.bug == "chat-usage-off" and chat:
                n_out += 1
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n_out,
                     "total_tokens": len(prompt) + n_out,
                     "prompt_tokens_details": {"cached_tokens": r["cached"]}}
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4()}"
            stream = bool(body.get("stream", False))
            obj = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
            base = {"id": rid, "system_fingerprint": "specparity-fake", "object": obj,
                    "model": body.get("model", "default_model"), "created": int(time.time())}

            def choice(piece: str, fin: str | None, lp: dict[str, Any] | None = None) -> dict[str, Any]:
                c: dict[str, Any] = {"index": 0, "finish_reason": fin}
                if lp is not None:
                    c["logprobs"] = lp
                if chat:
                    key = "delta" if stream else "message"
                    c[key] = {"role": "assistant"}
                    if not stream:
                        c[key]["content"] = piece or None
                    elif piece:
                        c[key]["content"] = piece
                else:
                    c["text"] = piece
                return c

            tools = body.get("tools") if chat and tok.has_chat_template and engine.bug != "no-tool-parser" else None
            call: dict[str, Any] | None = None
            if tools:  # the double's tool format: the whole output is one call of the first tool
                call = {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                        "function": {"name": tools[0]["function"]["name"], "arguments": json.dumps({"text": text})}}
                finish = "tool_calls" if finish == "stop" else finish

            if not stream:
                lp = None
                top_n = int(body.get("top_logprobs", -1) or -1)
                if engine.bug == "legacy-logprobs" and not chat:  # the legacy int field; top_logprobs ignored
                    top_n = int(body.get("logprobs") or 0) or -1
                if top_n > 0:
                    lp = {"content": [
                        {"id": t, "token": tok.convert_ids_to_tokens(t), "logprob": g,
                         "top_logprobs": [{"id": j, "token": tok.convert_ids_to_tokens(j), "logprob": v}
                                          for j, v in top[:top_n]]}
                        for t, (g, top) in zip(ids, r["top"], strict=True)]}
                elif body.get("logprobs"):
                    lp = {"content": [{"id": t, "logprob": g} for t, (g, _) in zip(ids, r["top"], strict=True)]}
                c = choice(text, finish, lp)
                if call is not None:
                    c["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
                self._json(200, {**base, "choices": [c], "usage": usage})
                return
            self.send_response(200)
            self.send_header("Content-type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            if call is not None:
                fn = call["function"]
                self._event({**base, "choices": [{"index": 0, "finish_reason": None, "delta": {
                    "role": "assistant", "tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                                         "function": {"name": fn["name"], "arguments": ""}}]}}]})

                def arg(piece: str) -> None:
                    self._event({**base, "choices": [{"index": 0, "finish_reason": None, "delta": {
                        "tool_calls": [{"index": 0, "function": {"arguments": piece}}]}}]})

                arg('{"text": "')
                mangle = engine.bug == "tool-spec-mangle" and r["spec"]
                for piece in self._pieces(ids, r["blocks"], text, last_token_only=mangle):
                    arg(json.dumps(piece)[1:-1])
                arg('"}')
            else:
                for n_delta, piece in enumerate(self._pieces(ids, r["blocks"], text), 1):
                    if engine.bug == "stream-drop-byte" and n_delta == 2:
                        piece = piece.encode("utf-8")[:-1].decode("utf-8", "replace")
                    self._event({**base, "choices": [choice(piece, None)]})
            self._event({**base, "choices": [choice("", finish)]})
            if (body.get("stream_options") or {}).get("include_usage"):
                self._event({**base, "object": "chat.completion", "choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

        def _pieces(self, ids: list[int], blocks: list[int], text: str, last_token_only: bool = False) -> Any:
            """The streamed deltas of ``text``: one per block of tokens (under speculation a round's
            block, else one token), a character split across tokens held back, never past a stop
            string; then what is left (e.g. a leaked EOS text). ``last_token_only`` (planted): a
            multi-token block's delta is its last token's text alone."""
            if engine.bug == "stop-cut-out" and text != engine.tok.decode(ids):
                yield text  # the text with the stop string cut out, streamed as it is answered
                return
            st = StreamText(engine.tok.decode)
            sent, k = "", 0
            for b in blocks:
                parts = [st.delta(ids[:j], final=j == len(ids)) for j in range(k + 1, min(k + b, len(ids)) + 1)]
                k += b
                new = "".join(parts)
                if not new or len(sent) >= len(text):
                    continue
                new = new[: max(0, len(text) - len(sent))]  # never past a stop string
                yield parts[-1][: len(new)] if last_token_only and len(parts) > 1 else new
                sent += new
            if len(text) > len(sent):
                yield text[len(sent):]

        def _event(self, doc: dict[str, Any]) -> None:
            if engine.bug == "slow":
                time.sleep(0.01)
            self.wfile.write(f"data: {json.dumps(doc)}\n\n".encode())
            self.wfile.flush()

    return Handler


class _Server(ThreadingHTTPServer):
    """Counts each accepted connection in ``FakeEngine.arriving`` until its handler counts its request in
    flight (or sees it is no generation request): the worker waits for batch-mates the server has
    accepted but not yet parsed, so requests sent together are batched together without every lone
    request waiting out a tick."""

    def __init__(self, address: tuple[str, int], engine: FakeEngine, control: bool = False) -> None:
        self.engine = engine
        super().__init__(address, make_handler(engine, control))

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.engine._lock:
            self.engine.arriving += 1
        super().process_request(request, client_address)


def serve(engine: FakeEngine, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A started server (``.server_address`` has the port); ``shutdown()`` + ``server_close()`` stop it."""
    httpd = _Server((host, port), engine)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fake_server", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--prompt-cache-size", type=int, default=16)
    p.add_argument("--bug", choices=BUGS, default=os.environ.get("SPECPARITY_FAKE_SERVER_BUG") or None)
    p.add_argument("--control", action="store_true", help="the tests' POST /fake/reset route (bug, cache size)")
    a, unknown = p.parse_known_args(argv)
    if unknown:  # echoed, as servers warn about flags they do not know (secrets in them included)
        print(f"warning: ignoring unknown arguments: {' '.join(unknown)}", file=sys.stderr, flush=True)
    for k, v in sorted(os.environ.items()):  # echoed, as a server warns about its environment
        if any(w in k for w in ("TOKEN", "SECRET", "PASSWORD", "API_KEY")):
            print(f"warning: {k}={v} is set in the environment", file=sys.stderr, flush=True)
    if a.bug == "crash-start":
        print("RuntimeError: quantized KV cache needs mlx-vlm, which is not installed", file=sys.stderr, flush=True)
        return 1
    if a.bug == "draft-disabled" and a.draft_model:
        print("WARNING: draft model disabled under continuous batching; serving without it", file=sys.stderr,
              flush=True)
    if a.bug == "cache-on-anyway":
        print("INFO: prefix cache: enabled (adaptive default)", file=sys.stderr, flush=True)
    engine = FakeEngine(a.model, a.draft_model, a.num_draft_tokens, a.bug, a.prompt_cache_size)
    httpd = _Server((a.host, a.port), engine, a.control)
    httpd.daemon_threads = True
    print(f"fake server on http://{a.host}:{httpd.server_address[1]} (bug: {a.bug})", file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())



class Shared:
    """A launcher for ``specparity.grading.http_servers.grade_arms`` over long-lived fake server processes.

    One ``python -m tests.fake_server --control`` process per (model, draft) is started once
    and kept (a model loads in seconds; MLX streams belong to a thread, so the fake cannot share
    the grader's process); each launch resets it through its control route (a fresh server
    state: empty prompt cache, counters and stats, ``bug`` planted, the prompt cache off when
    asked); a launch with another drafter (the all-reject arm's zeroed one) gets its own
    process. ``launches`` records (arm, cache_off) per launch and ``stats`` each launch's stats
    (``max_inflight``, ``max_batch``, ``drafted``, ``accepted``). A ``crash-start`` plant fails every launch as a server
    that does not start (the grader's process path is tested with the real subprocess).
    """

    def __init__(self, procs: dict[tuple[str, str | None], tuple[Any, int]], model: str, draft: str | None = None,
                 bug: str | None = None, deadline: float = 30.0) -> None:
        self.procs, self.model, self.draft, self.bug = procs, model, draft, bug
        self.deadline = deadline
        self.launches: list[tuple[str, bool]] = []
        self.stats: list[dict[str, Any]] = []

    def port(self, draft: str | None) -> int:
        import subprocess

        from specparity.grading.http_servers import free_port

        key = (self.model, draft)
        if key not in self.procs:
            port = free_port()
            argv = [sys.executable, "-m", "tests.fake_server", "--model", self.model, "--port", str(port),
                    "--control", *(["--draft-model", draft] if draft else [])]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            self.procs[key] = (proc, port)
            from subjects.http_client import HttpClient, Limits

            c = HttpClient(f"http://127.0.0.1:{port}", limits=Limits(deadline=2.0))
            for _ in range(600):
                if proc.poll() is not None:
                    raise RuntimeError(f"the fake server exited with {proc.returncode}")
                if c.healthy()[0]:
                    break
                time.sleep(0.1)
        return self.procs[key][1]

    def __call__(self, arm: str, draft: str | None, cache_off: bool) -> Any:
        import contextlib

        from specparity.grading.http_servers import Launch, ServeFailed
        from subjects.http_client import HttpClient, Limits

        @contextlib.contextmanager
        def launch() -> Any:
            self.launches.append((arm, cache_off))
            if self.bug == "crash-start":
                raise ServeFailed("fake exited with code 1 before answering /health",
                                  "RuntimeError: quantized KV cache needs mlx-vlm, which is not installed")
            url = f"http://127.0.0.1:{self.port(draft)}"
            client = HttpClient(url, limits=Limits(deadline=self.deadline))
            client.post("/fake/reset", {"bug": self.bug, "prompt_cache_size": 0 if cache_off else 16})
            try:
                yield Launch(client, None, "off" if cache_off else "on", ["fake", self.model])
            finally:
                self.stats.append(client.post("/fake/reset", {"bug": None, "prompt_cache_size": 16}))

        return launch()

    @staticmethod
    def stop_all(procs: dict[tuple[str, str | None], tuple[Any, int]]) -> None:
        import signal

        for proc, _ in procs.values():
            with __import__("contextlib").suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        procs.clear()
