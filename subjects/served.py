"""Black-box checks of an OpenAI-compatible server (a served engine) over HTTP.

The request and response shapes are those of mlx-lm 0.32.2 ``mlx_lm/server.py``
(``APIHandler.do_POST``, ``generate_response``, ``handle_completion``,
``completion_usage_response``, ``handle_health_check``): ``POST /v1/completions``
(a text prompt, or a token-id array as the OpenAI completions API allows) and
``/v1/chat/completions`` (``stream`` as Server-Sent Events ending
``data: [DONE]``; ``stream_options.include_usage``), ``max_tokens``, ``stop``,
``logprobs`` / ``top_logprobs`` (``choices[0].logprobs.content[i]`` =
``{id, token, logprob, top_logprobs}``; the legacy completions shape
``{tokens, token_logprobs, top_logprobs}`` is read too), ``usage``
(``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
``prompt_tokens_details.cached_tokens``), ``finish_reason``; ``GET /health``,
``/v1/models`` and, where a server has it, ``/metrics``. Every request goes
through the one bounded client, ``subjects/http_client.py``.

A server exposes no rounds, so it is judged against a :class:`Reference`
computed in process by the grader (``specparity/grading/http_servers.py``: plain greedy decode
of the same weights on the prompt the server builds — the tokenizer's encoding,
the token ids sent, its chat template or mlx-lm's ``convert_chat``).

**Four states per cell.** Each check runs every one of its cases (none stops at
its first failing case) and each case is ``pass``, ``fail`` (a finding: the
request and the first divergence), ``cannot-grade`` (the case could not be set
up: a chat endpoint refused for a model without a chat template, a cache hit the
server did not make, a stop string the output lacks) or ``n/a``. A cell is
``fail`` when a case failed, else ``pass`` when one passed, else
``cannot-grade``, else ``n/a`` (``unsupported``); a set-up failure never reads
fail. A spec arm whose server never speculated is ``not-engaged`` (set by the
grader from the ``speculation`` cell), never ``pass``.

**One root cause, one cell.** Each check owns one property and uses prompts no
other check uses (first words distinct, :func:`make_plan`); the properties:

- ``identity``: greedy output ids = plain decode (completions; chat through the
  template the server builds), prefix only (lengths belong to the budget/EOS checks);
- ``stream``: streamed deltas concatenated = the non-streamed text = decode of the
  server's own ids (byte-level models: at split multi-byte characters), the same
  finish_reason and usage (the server against itself, no reference);
- ``budget``: ``max_tokens`` 1, 2, 5, 9, 17, 33 (ending inside a speculative
  round): exactly that output;
- ``finish_reason``: ``length`` at the budget, ``stop`` on EOS, on a stop string,
  and when the stop or EOS lands in the same block as the budget (the stop wins);
- ``usage``: ``prompt_tokens`` = the built prompt, ``completion_tokens`` = the ids
  returned (+ at most the EOS), trimmed at a stop to the token that completed it,
  ``total_tokens`` the sum, ``cached_tokens`` within the prompt; on a byte-level
  model a case whose text re-encodes to another count;
- ``eos``: the EOS never in the text, generation ends where plain decode's does
  (also when the EOS is the budget's last token or inside a block past it);
- ``stop``: the text ends right before the first occurrence of the stop string
  (a whole token, inside a token, in a block that crosses ``max_tokens``), and
  the returned ids / logprobs are trimmed to the token that completed it;
- ``logprobs``: each emitted token's logprob and the sorted top_logprobs agree with
  the reference teacher-forced on the server's own ids (tolerance
  ``LOGPROB_ATOL + LOGPROB_RTOL·|lp|``: bf16-like rounding passes);
- ``cache``: a repeated identical request, a shared-prefix follow-up and an exact
  continuation (prompt ids + the server's completion ids, sent as a token-id
  prompt where the server takes one; as text only when the ids round-trip),
  each = cold plain decode and credited only when the server's own
  ``usage.prompt_tokens`` / ``cached_tokens`` show the hit meant was made;
- ``concurrency``: requests in flight together (asserted: all sent before any
  answered) each = plain decode; reported in the B-invariance words of docs/batched.md
  (``engine.batched_check``: holds / identical, or ``logic``: over HTTP there is no
  numerics witness, so a flip is never called ``numerics``);
- ``seeded``: a seeded sampled request (temperature 1, ``seed``) with batch-mates in
  flight together (asserted, 3 bursts) draws what it draws alone (server against
  itself; cannot-grade when the seed is not reproducible alone, when temperature is
  ignored, or when its logprobs show batch-mates moved the computation itself, which
  is ``concurrency``'s finding); the seeded invariance's words, as ``concurrency``'s;
- ``tools``: the tool calls a server parses (chat ``tools``; streamed deltas
  reassembled) under speculation = without (the plain arm's, request for request);
  on the plain arm streamed = non-streamed; n/a where the model has no chat template
  or the server parses no tool call;
- ``reject``: on a server started with the spec arm's drafter zeroed (it proposes
  token 0 every time: every draft rejected, confirmed by the server's counters),
  exactly plain decode's tokens, no stray or placeholder id, usage = those tokens;
  n/a on the plain arm and for model-free speculation;
- ``leak``: the same request (greedy with logprobs; and seeded) as the fresh server's
  first request = after every other check's requests and unrelated ones with
  ``logit_bias``, a seed, a stop, a stream, a chat and a long prompt;
- ``liveness``: ``/health`` (or ``/v1/models``) answers, and ``/v1/models``;
- ``speculation``: the spec arm drafted tokens (the server's ``/metrics``
  counters, or draft/accept counters in ``usage``/``timings``); 0 drafted =
  ``not-engaged``; no counters = ``cannot-grade``.

**Prompt fidelity.** Before the checks (:func:`prompt_fidelity`), two completions prompts:
where the server's ``usage.prompt_tokens`` differs from the prompt's length for both, it does
not complete the prompt as sent (a chat template, an injected system message): ONE finding, in
the ``identity`` cell, and every check of ``GATED`` (judged against plain decode of the prompt)
reads ``cannot-grade`` pointing there. A row that declares the server's wrapping
(``Reference.completion_prompt`` / ``wrap``, from ``ServedEngine.completions_wrap``) is judged
against plain decode of the wrapped prompt, while ``usage.prompt_tokens`` agrees with it.

A server that stops answering fails the case in progress (``ServerDown``) and
every later check of the arm is ``cannot-grade`` without waiting again.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from subjects.checks import first_divergence
from subjects.failure_causes import (
    SETUP,
    TRANSPORT,
    WRONG_OUTPUT,
    classify_error,
    error_as_success,
)
from subjects.http_client import HttpClient, ServerDown, ServerError
from traces.diff import common_prefix

__all__ = ["SERVER_CHECKS", "CellResult", "HttpClient", "Reference", "Request", "ServerDown", "ServerError",
           "SpecCounters", "make_plan", "run_checks", "send"]

SERVER_CHECKS = ("identity", "stream", "budget", "finish_reason", "usage", "eos", "stop", "logprobs", "cache",
                 "concurrency", "seeded", "tools", "reject", "leak", "liveness", "speculation")
STATUSES = ("pass", "fail", "cannot-grade", "unsupported", "not-engaged")
BUDGETS = (1, 2, 5, 9, 17, 33)
MAX_BUDGET = max(BUDGETS)
LOGPROB_ATOL = 1e-3
LOGPROB_RTOL = 2.0**-7  # one bf16 ulp, relative: a bf16 logprob rounds within half of it
TOP_K = 5
CONCURRENT = 4
SEED = 1234  # the seeded requests' seed (temperature SEED_TEMPERATURE)
SEED_TEMPERATURE = 1.0
SEED_BURSTS = 3  # the seeded request sent with its batch-mates this many times
TOOL = "lookup"  # the one function the tool-call requests offer
REJECT_MAX_ACCEPT = 0.1  # the all-reject arm: more than this share of drafts accepted is not "all rejected"

Client = HttpClient  # the name older callers use


# ------------------------------------------------------------------ requests and replies


@dataclass(frozen=True)
class Request:
    """One request to the server; ``label`` names it in every finding.

    ``prompt``: text, or a tuple of token ids (the OpenAI completions token-array prompt).
    """

    prompt: str | tuple[int, ...]
    max_tokens: int
    chat: bool = False
    stream: bool = False
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    tag: str = ""
    temperature: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    tools: tuple[str, ...] = ()  # function names offered (chat: OpenAI ``tools``)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def by_ids(self) -> bool:
        return isinstance(self.prompt, tuple)

    def body(self, legacy_logprobs: bool = False, model: str = "default_model") -> dict[str, Any]:
        b: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens,
                             "temperature": self.temperature, "stream": self.stream}
        if self.seed is not None:
            b["seed"] = self.seed
        if self.logit_bias:
            b["logit_bias"] = {str(t): v for t, v in self.logit_bias}
        if self.tools:
            b["tools"] = [tool_schema(n) for n in self.tools]
        if self.chat:
            b["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            b["prompt"] = list(self.prompt) if isinstance(self.prompt, tuple) else self.prompt
        if self.stop:
            b["stop"] = list(self.stop)
        if self.stream:
            b["stream_options"] = {"include_usage": True}
        if legacy_logprobs and not self.chat and (self.logprobs or self.top_logprobs):
            b["logprobs"] = max(self.top_logprobs, 1)  # the OpenAI legacy completions field: an int
            return b
        if self.logprobs or self.top_logprobs:
            b["logprobs"] = True
        if self.top_logprobs:
            b["top_logprobs"] = self.top_logprobs
        return b

    @property
    def label(self) -> str:
        opts = [f"max_tokens={self.max_tokens}"]
        if self.stream:
            opts.append("stream")
        if self.stop:
            opts.append(f"stop={list(self.stop)!r}")
        if self.logprobs:
            opts.append("logprobs")
        if self.top_logprobs:
            opts.append(f"top_logprobs={self.top_logprobs}")
        if self.temperature:
            opts.append(f"temperature={self.temperature:g}")
        if self.seed is not None:
            opts.append(f"seed={self.seed}")
        if self.logit_bias:
            opts.append("logit_bias={" + ", ".join(f"{t}: {v:g}" for t, v in self.logit_bias) + "}")
        if self.tools:
            opts.append(f"tools={list(self.tools)!r}")
        if isinstance(self.prompt, tuple):
            ids = list(self.prompt)
            short = f"ids {ids}" if len(ids) <= 12 else f"ids [{', '.join(map(str, ids[:10]))}, …] ({len(ids)})"
        else:
            short = repr(self.prompt if len(self.prompt) <= 40 else self.prompt[:37] + "...")
        tag = f"{self.tag}: " if self.tag else ""
        return f"{tag}POST {self.path} {short} " + " ".join(opts)


def tool_schema(name: str) -> dict[str, Any]:
    """The OpenAI ``tools`` entry of one function taking one string argument ``text``."""
    return {"type": "function", "function": {
        "name": name, "description": "Look the text up.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


@dataclass
class TokenLogprob:
    id: int | None
    token: str | None
    logprob: float
    top: list[tuple[int | None, str | None, float]] = field(default_factory=list)


@dataclass
class Reply:
    text: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    logprobs: list[TokenLogprob] | None
    chunks: int = 0
    doc: dict[str, Any] | None = None  # the non-streamed answer, as sent
    tool_calls: list[dict[str, Any]] | None = None  # [{"name", "arguments"}] (streamed ones reassembled)

    @property
    def ids(self) -> list[int] | None:
        if not self.logprobs or any(t.id is None for t in self.logprobs):
            return None
        return [int(t.id) for t in self.logprobs if t.id is not None]


def _choice(doc: dict[str, Any]) -> dict[str, Any]:
    ch = doc.get("choices")
    if not isinstance(ch, list) or not ch or not isinstance(ch[0], dict):
        raise ServerError(f"no choices[0] in {json.dumps(doc)[:160]}")
    return ch[0]


def _num(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ServerError(f"a logprob that is not a number: {x!r}")
    return float(x)


def _parse_logprobs(lp: Any) -> list[TokenLogprob] | None:
    if not isinstance(lp, dict):
        return None
    out: list[TokenLogprob] = []
    if isinstance(lp.get("content"), list):  # chat shape (mlx-lm uses it for both endpoints)
        for item in lp["content"]:
            if not isinstance(item, dict):
                continue
            top = [(t.get("id"), t.get("token"), _num(t.get("logprob"))) for t in item.get("top_logprobs") or []
                   if isinstance(t, dict)]
            out.append(TokenLogprob(item.get("id"), item.get("token"), _num(item.get("logprob")), top))
        return out
    if isinstance(lp.get("token_logprobs"), list):  # legacy completions shape
        toks = lp.get("tokens") or [None] * len(lp["token_logprobs"])
        tops = lp.get("top_logprobs") or [None] * len(lp["token_logprobs"])
        for tok, g, top in zip(toks, lp["token_logprobs"], tops, strict=False):
            entries = [(None, k, _num(v)) for k, v in (top or {}).items()] if isinstance(top, dict) else []
            out.append(TokenLogprob(None, tok, _num(g), entries))
        return out
    return None


@dataclass
class SpecCounters:
    """Draft / accept counters a server reports (``/metrics``, or ``usage``/``timings`` extensions)."""

    drafted: float = 0.0
    accepted: float = 0.0
    sources: set[str] = field(default_factory=set)
    other_methods: set[str] = field(default_factory=set)  # counters labelled for a method the arm does not run

    _DRAFT = re.compile(r"draft", re.I)
    _ACCEPT = re.compile(r"accept", re.I)

    def add_doc(self, doc: dict[str, Any] | None) -> None:
        """Counters in one answer: numeric ``*draft*`` / ``*accept*`` keys of ``usage`` or ``timings``
        (llama.cpp ``timings.draft_n`` / ``draft_n_accepted``; any server's usage extension)."""
        if not isinstance(doc, dict):
            return
        for where in ("usage", "timings"):
            block = doc.get(where)
            if not isinstance(block, dict):
                continue
            for k, v in _flat(block):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                if self._ACCEPT.search(k):
                    self.accepted += v
                    self.sources.add(f"{where}.{k}")
                elif self._DRAFT.search(k):
                    self.drafted += v
                    self.sources.add(f"{where}.{k}")

    @staticmethod
    def from_metrics(text: str, method: str | None = None) -> SpecCounters:
        """Counters in a Prometheus ``/metrics`` page: ``*spec*draft*`` and ``*spec*accept*`` totals
        (vLLM's ``vllm:spec_decode_num_draft_tokens_total`` / ``..._accepted_tokens_total``).

        ``method``: the speculation method the arm runs (``suffix``); a sample labelled
        ``method="<another>"`` (qmlx-serve 0.16.0: MTP / DFlash counters only, zero under SuffixDecoding)
        says nothing about it: kept out of the counts, named in ``other_methods``. A ``*_total`` labelled
        ``method="<method>"`` is that method's counter whatever its name (rapid-mlx 0.16.10:
        ``rapid_mlx_suffix_decode_draft_tokens_proposed_total{method="suffix"}``, no "spec" in it)."""
        c = SpecCounters()
        tokens: float | None = None
        rounds = 0.0
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|\+Inf)\s*", line)
            name = m.group(1) if m else ""
            low = name.lower()
            if not m or not low.endswith("_total"):
                continue  # counters only (a ratio gauge is not a count)
            labelled = re.search(r'(?:^|[{,\s])method="([^"]*)"', m.group(2) or "")
            ours = method is not None and labelled is not None and labelled.group(1).lower() == method.lower()
            if "spec" not in low and not ours:
                continue  # not a speculation counter (one labelled with the arm's method is, whatever its name)
            if method is not None and labelled and not ours:
                c.other_methods.add(f"/metrics {name}{{method=\"{labelled.group(1)}\"}}")
                continue
            try:
                v = float(m.group(3))
            except ValueError:
                continue
            if "accept" in low:
                c.accepted += v
                c.sources.add(f"/metrics {name}")
            elif any(w in low for w in ("draft", "propos")):
                tokens = (tokens or 0.0) + v  # drafted tokens, proposals
                c.sources.add(f"/metrics {name}")
            elif any(w in low for w in ("attempt", "verify")):
                rounds += v  # speculation activity: verify rounds
                c.sources.add(f"/metrics {name}")
        # a page with a drafted-token counter: that count (its verify-step counter beside it is not tokens)
        c.drafted = tokens if tokens is not None else rounds
        return c

    def minus(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(self.drafted - other.drafted, self.accepted - other.accepted,
                            self.sources | other.sources, self.other_methods | other.other_methods)

    def plus(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(self.drafted + other.drafted, self.accepted + other.accepted,
                            self.sources | other.sources, self.other_methods | other.other_methods)


def _flat(d: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _flat(v, key + ".")
        else:
            yield key, v


def metrics(client: HttpClient, method: str | None = None) -> SpecCounters | None:
    """The server's speculation counters: its ``/metrics`` page and its ``/health`` body
    (``subjects/setup_evidence.py``), or None (no such counter anywhere); ``method``: the arm's
    speculation method (``/metrics`` counters labelled for another are not counted)."""
    from subjects.setup_evidence import health_counters

    c: SpecCounters | None = None
    try:
        status, text = client.get("/metrics")
    except (ServerDown, ServerError):
        status, text = 0, ""
    if status == 200:
        m = SpecCounters.from_metrics(text, method)
        c = m if m.sources or m.other_methods else None
    h = health_counters(client)
    if h is not None:
        c = h if c is None else c.plus(h)
    return c


@dataclass
class Dialect:
    """What a server's API takes, learnt from its own answers (kept on its client, ``client.dialect``):
    the model name it serves (``default_model`` until it refuses that name: then the first one its
    ``GET /v1/models`` lists), whether it has ``/v1/completions`` (a chat-only server: every request
    is sent through chat, graded against its chat prompt), whether it wants OpenAI's legacy integer
    ``logprobs``. ``notes``: each thing learnt, one line each (the row's set-up records them)."""

    model: str = "default_model"
    chat_only: bool = False
    legacy_logprobs: bool = False
    probed: bool = False  # a first request was answered (or refused) with this dialect
    notes: list[str] = field(default_factory=list)

    def adapt(self, req: Request) -> Request:
        """``req`` as this server takes it (a chat-only server: a text prompt through chat)."""
        if self.chat_only and not req.chat:
            if req.by_ids:
                raise ServerError("the server has no /v1/completions (HTTP 404): a token-id prompt cannot be "
                                  "sent through chat", 404)
            return replace(req, chat=True)
        return req


def dialect(client: HttpClient) -> Dialect:
    """The client's :class:`Dialect` (a fresh one the first time)."""
    d = getattr(client, "dialect", None)
    if not isinstance(d, Dialect):
        d = Dialect()
        client.dialect = d  # type: ignore[attr-defined]
    return d


def served_model_name(client: HttpClient) -> str | None:
    """The first model id the server lists at ``GET /v1/models`` (None: none, or no such route)."""
    try:
        status, text = client.get("/v1/models")
        doc = json.loads(text) if status == 200 else None
    except (ServerDown, ServerError, ValueError, RecursionError):
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    return next((i for i in ids if isinstance(i, str) and i), None)


def send(client: HttpClient, req: Request, counters: SpecCounters | None = None) -> Reply:
    """Send ``req`` in the server's dialect (learnt from its refusals, one retry each: a completions
    route it lacks, a model name it does not serve, the legacy logprobs field); the reply reassembled
    (streamed chunks concatenated)."""
    from subjects.failure_causes import no_route, refuses_model_name

    d = dialect(client)
    for _ in range(4):
        sent = d.adapt(req)
        try:
            reply = _send(client, sent, d, counters)
            d.probed = True
            return reply
        except ServerError as exc:
            d.probed = True
            text = str(exc)
            if no_route(exc.status) and not sent.chat and not d.chat_only:
                d.chat_only = True
                d.notes.append(f"no /v1/completions ({text[:80]}): every request sent through "
                               "/v1/chat/completions and graded against the chat prompt")
                continue
            if refuses_model_name(exc.status, text, d.model):
                name = served_model_name(client)
                if name is not None and name != d.model:
                    d.notes.append(f"the model name {d.model!r} was refused ({text[:80]}): sent as {name!r}, "
                                   "the name its /v1/models reports")
                    d.model = name
                    continue
            if (not sent.chat and not d.legacy_logprobs and (sent.logprobs or sent.top_logprobs)
                    and "logprobs" in text):
                d.legacy_logprobs = True  # it wants OpenAI's legacy `logprobs: N`
                d.notes.append("legacy completions logprobs (an integer `logprobs`)")
                continue
            raise
    raise ServerError("the server refused every dialect tried for this request")


def _send(client: HttpClient, req: Request, d: Dialect, counters: SpecCounters | None) -> Reply:
    body = req.body(d.legacy_logprobs, d.model)
    if not req.stream:
        doc = client.post(req.path, body)
        ch = _choice(doc)
        msg = ch.get("message") if isinstance(ch.get("message"), dict) else {}
        text = msg.get("content") if req.chat else ch.get("text")
        if text is not None and not isinstance(text, str):
            raise ServerError(f"choices[0] text is not a string: {text!r:.80}")
        if counters is not None:
            counters.add_doc(doc)
        usage = doc.get("usage") if isinstance(doc.get("usage"), dict) else None
        calls = _ToolCalls()
        calls.add(msg.get("tool_calls") if req.chat else None)
        return Reply(text or "", ch.get("finish_reason"), usage, _parse_logprobs(ch.get("logprobs")), doc=doc,
                     tool_calls=calls.done())
    events = client.post_stream(req.path, body)
    text, finish, usage = [], None, None
    calls = _ToolCalls()
    for ev in events:
        if isinstance(ev.get("usage"), dict):
            usage = ev["usage"]
            if counters is not None:
                counters.add_doc(ev)
        for ch in ev.get("choices") or []:
            if not isinstance(ch, dict):
                continue
            delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
            piece = delta.get("content") if req.chat else ch.get("text")
            if isinstance(piece, str) and piece:
                text.append(piece)
            if req.chat:
                calls.add(delta.get("tool_calls"))
            if ch.get("finish_reason") is not None:
                finish = ch["finish_reason"]
    return Reply("".join(text), finish, usage, None, chunks=len(events), tool_calls=calls.done())


class _ToolCalls:
    """OpenAI ``tool_calls`` (a message's, or streamed deltas by ``index``: the name and the
    arguments' pieces concatenated) as ``[{"name", "arguments"}]``; None when there were none."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, str]] = {}

    def add(self, items: Any) -> None:
        if not isinstance(items, list):
            return
        for n, item in enumerate(items):
            if not isinstance(item, dict):
                continue
            idx = item.get("index", n)
            fn = item.get("function") if isinstance(item.get("function"), dict) else {}
            call = self.calls.setdefault(idx if isinstance(idx, int) else n, {"name": "", "arguments": ""})
            for k in ("name", "arguments"):
                v = fn.get(k)
                if isinstance(v, str):
                    call[k] += v
                elif v is not None:
                    call[k] += json.dumps(v)

    def done(self) -> list[dict[str, Any]] | None:
        return [self.calls[i] for i in sorted(self.calls)] if self.calls else None


# ------------------------------------------------------------------ the reference


@dataclass
class Reference:
    """Plain greedy decode of the served weights, in process (built by the grader).

    ``encode``: the tokenizer's encoding of a text (the ids a token-id prompt sends);
    ``chat_prompt``: the prompt ids the server builds for a chat request;
    ``completion_prompt``: the prompt ids the server builds for a completions text prompt where a
    row declares that it wraps it (``wrap``, its description; None: ``encode``, the prompt as sent);
    ``greedy(ids, n)``: (output ids without EOS, ended on EOS);
    ``logprobs(ids, out, k)``: per output position the emitted token's logprob and the
    top-k ``(id, logprob)`` sorted descending, teacher-forced on ``out``; ``prompts``:
    prompt texts to use (each check takes its own, :func:`make_plan`).
    """

    encode: Callable[[str], list[int]]
    chat_prompt: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    greedy: Callable[[tuple[int, ...], int], tuple[list[int], bool]]
    logprobs: Callable[[tuple[int, ...], tuple[int, ...], int], list[tuple[float, list[tuple[int, float]]]]]
    eos_ids: tuple[int, ...]
    prompts: list[str]
    eos_text: tuple[str, ...] = ()
    has_chat_template: bool = True
    bos_id: int | None = None
    completion_prompt: Callable[[str], list[int]] | None = None
    wrap: str | None = None  # the declared wrapping of a completions prompt, in words (None: sent as is)

    def through_chat(self) -> Reference:
        """This reference for a server without ``/v1/completions``: every text prompt is sent as a chat
        message, so the prompt it completes is the chat prompt."""
        return replace(self, completion_prompt=self.chat_prompt,
                       wrap="sent through /v1/chat/completions (the server has no /v1/completions): the "
                            "reference is plain decode of the chat prompt")

    def completion_ids(self, text: str) -> list[int]:
        """The prompt the server builds for a completions request of ``text``."""
        return list(self.completion_prompt(text) if self.completion_prompt is not None else self.encode(text))

    def prompt_ids(self, req: Request) -> list[int]:
        if isinstance(req.prompt, tuple):
            return list(req.prompt)
        return list(self.chat_prompt(req.prompt) if req.chat else self.completion_ids(req.prompt))

    def expect(self, req: Request) -> tuple[list[int], bool]:
        return self.greedy(tuple(self.prompt_ids(req)), req.max_tokens)

    def text_for(self, ids: Sequence[int]) -> str | None:
        """Text whose encoding is exactly ``ids`` (a leading BOS added back by ``encode``), or None."""
        body = list(ids[1:]) if self.bos_id is not None and ids and ids[0] == self.bos_id else list(ids)
        text = self.decode(body)
        return text if list(self.encode(text)) == list(ids) else None


def norm_text(s: str) -> str:
    return re.sub("\ufffd+", "\ufffd", s)


def loose(s: str) -> str:
    """``s`` without U+FFFD: invalid UTF-8 bytes (a byte-level model's garbage, or a character cut by
    the budget) may be replaced or dropped by a server; neither is judged."""
    return s.replace("\ufffd", "")


def _nows(s: str) -> str:
    return re.sub(r"\s+", "", loose(s))


def stop_view(s: str) -> str:
    """What the stop checks judge of a text: where it ends, its non-space characters (whitespace and
    U+FFFD are the detokenizer's, judged by the stream check)."""
    return _nows(s)


def token_at(ref: Reference, ids: Sequence[int], char: int) -> int:
    """The index of the reference token whose text covers character ``char``."""
    for k in range(len(ids)):
        if len(norm_text(ref.decode(ids[: k + 1]))) > char:
            return k
    return len(ids)


def splits_utf8(ref: Reference, ids: Sequence[int]) -> bool:
    """Whether some prefix of ``ids`` ends inside a character the whole output decodes (byte-level
    tokenizers: a streamed delta must hold those bytes back)."""
    full = ref.decode(ids)
    for k in range(1, len(ids)):
        pre = ref.decode(ids[:k])
        if pre.endswith("\ufffd"):
            head = pre.rstrip("\ufffd")
            if full.startswith(head) and len(full) > len(head) and full[len(head)] != "\ufffd":
                return True
    return False


def strip_eos(ref: Reference, ids: list[int] | None) -> list[int] | None:
    if ids and ids[-1] in ref.eos_ids:
        return ids[:-1]  # mlx-lm lists the EOS it stopped on (its text is judged by the eos check)
    return ids


def compare(ref: Reference, reply: Reply, ids: list[int], *, exact: bool) -> str | None:
    """Why ``reply`` is not the reference output ``ids`` (None when it is).

    The server's ids when it returned them, else its text against ``decode(ids)``
    (runs of U+FFFD collapsed). ``exact``: the whole output must match; otherwise
    only the common prefix is judged (a length difference belongs to the budget/EOS checks).
    """
    got_ids = strip_eos(ref, reply.ids)
    if not exact and ids and (got_ids == [] or (got_ids is None and not reply.text)):
        return f"no output where plain decode emits {len(ids)} tokens (finish_reason {reply.finish_reason!r})"
    if got_ids is not None:
        i = first_divergence(got_ids, ids) if exact else first_divergence(got_ids[: len(ids)], ids[: len(got_ids)])
        if i is None:
            return None
        a = got_ids[i] if i < len(got_ids) else "<end>"
        b = ids[i] if i < len(ids) else "<end>"
        return f"output token {i}: server id {a} vs plain decode {b} (server {len(got_ids)} tokens, plain {len(ids)})"
    want = _nows(ref.decode(ids))  # no ids: the text, whitespace and U+FFFD aside (the stream check owns those)
    got = _nows(reply.text)
    if not exact:
        n = min(len(want), len(got))
        want, got = want[:n], got[:n]
    if got == want:
        return None
    i = next((k for k, (x, y) in enumerate(zip(got, want, strict=False)) if x != y), min(len(got), len(want)))
    tok = next((k for k in range(len(ids)) if len(_nows(ref.decode(ids[: k + 1]))) > i), len(ids))
    return (f"text differs at non-space character {i} (plain token {tok}): server {got[max(0, i - 12): i + 12]!r} "
            f"vs plain {want[max(0, i - 12): i + 12]!r} (server {len(got)}, plain {len(want)} non-space characters; "
            "no ids came back)")


def _text_diff(a: str, b: str, an: str, bn: str) -> str:
    """Where two texts first differ, with a little context (U+FFFD removed by the caller)."""
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return (f"at character {i}: {an} {a[max(0, i - 8): i + 8]!r} vs {bn} {b[max(0, i - 8): i + 8]!r} "
            f"({len(a)} vs {len(b)} chars)")


def _tail(s: str, n: int = 24) -> str:
    return repr(s if len(s) <= n else "…" + s[-n:]) + f" ({len(s)} chars)"


# ------------------------------------------------------------------ cells and cases


class Finding(Exception):
    """A case failed: the server's answer is wrong (``req`` names the request; ``cause``: what the
    failure is, ``subjects/failure_causes.py``; None: wrong output unless the reply hid an error)."""

    def __init__(self, req: Request | None, msg: str, cause: str | None = None) -> None:
        super().__init__(msg)
        self.req = req
        self.cause = cause


class CannotGrade(Exception):
    """A case could not be set up (not the server's fault as far as this check can tell)."""

    def __init__(self, msg: str, cause: str = SETUP) -> None:
        super().__init__(msg)
        self.cause = cause


class Unsupported(Exception):
    """A case that does not apply (n/a)."""


@dataclass
class CaseResult:
    label: str
    status: str
    detail: str
    cause: str | None = None  # a fail's or cannot-grade's class (``failure_causes.CAUSES``)


@dataclass
class CellResult:
    """One check's cell: its status (``STATUSES``), a one-line detail, and every case's result."""

    check: str
    status: str
    detail: str
    case: str | None = None  # the first failing request
    cases: list[dict[str, str]] = field(default_factory=list)
    attribution: str | None = None
    log: str | None = None  # a server log line that explains a cannot-grade
    cause: str | None = None  # what the first failing (else ungradeable) case's failure is
    unverified: str | None = None  # a pass on an arm whose set-up claim the server did not prove (why)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: v for k, v in d.items() if v is not None}


def cell_from_cases(check: str, cases: list[CaseResult], summary: str) -> CellResult:
    by = {s: [c for c in cases if c.status == s] for s in ("pass", "fail", "cannot-grade", "unsupported")}
    rows = [{"label": c.label, "status": c.status, "detail": c.detail} | ({"cause": c.cause} if c.cause else {})
            for c in cases]
    counts = ", ".join(f"{len(v)} {k}" for k, v in by.items() if v)
    if by["fail"]:
        f = by["fail"][0]
        more = f" ({len(by['fail'])} of {len(cases)} cases fail)" if len(cases) > 1 else ""
        return CellResult(check, "fail", f"{f.detail}{more}", case=f.label, cases=rows, cause=f.cause or WRONG_OUTPUT)
    note = ""
    if by["cannot-grade"]:
        g = by["cannot-grade"][0]
        note = f"; {len(by['cannot-grade'])} case(s) could not be graded: {g.detail}"
    if by["pass"]:
        return CellResult(check, "pass", f"{summary} [{counts}]{note}", cases=rows)
    if by["cannot-grade"]:
        g = by["cannot-grade"][0]
        return CellResult(check, "cannot-grade", f"{g.detail} [{counts}]", case=g.label, cases=rows, cause=g.cause)
    why = by["unsupported"][0].detail if by["unsupported"] else "no case applies"
    return CellResult(check, "unsupported", why, cases=rows)


class Ctx:
    """What a check works with: the client, the reference, its prompts, and its cases so far."""

    def __init__(self, client: HttpClient, ref: Reference, plan: Plan, counters: SpecCounters,
                 require_hits: bool = True, *, arm: str = "plain", baseline: dict[str, Any] | None = None,
                 reject: bool = False, server_log: Callable[[], str] | None = None) -> None:
        self.client, self.ref, self.plan, self.counters = client, ref, plan, counters
        self.server_log = server_log  # what the server's log gained since the last call ("" without a log)
        self.last: Reply | None = None  # the last reply of the case in progress
        self.require_hits = require_hits  # False: an attribution rerun judges outputs only
        self.cases: list[CaseResult] = []
        self.token_prompts: bool | None = None  # learnt: does /v1/completions take token-id prompts?
        self.sent: list[str] = []  # the requests sent in the case in progress
        self.arm = arm  # "plain" (no speculation) or "spec"
        self.baseline = baseline if baseline is not None else {}  # what the plain arm saw (tools), by request
        self.reject = reject  # this server's drafter has zero weights: its drafts are (all but) always rejected
        self.fresh: dict[str, Reply | BaseException] | None = None  # leak: the probes on the fresh server
        self.fresh_at = 0  # leak: requests answered when the probes were sent
        self.n_requests = 0  # requests sent to this server so far (by the checks)
        self.fidelity: CaseResult | None = None  # the prompt-fidelity finding (prompt_fidelity), else None
        self.fidelity_as = "as sent"  # or "as its row declares it wraps it"
        self.gate: str | None = None  # why a check judged against plain decode of the prompt cannot grade

    @contextlib.contextmanager
    def case(self, what: Request | str) -> Iterator[None]:
        """Run one case: a Finding is ``fail``, CannotGrade ``cannot-grade``, Unsupported ``n/a``."""
        label = self.label(what) if isinstance(what, Request) else what
        self.sent: list[str] = []
        self.last = None
        if self.server_log is not None:
            self.server_log()  # what the log said before this case is not this case's evidence
        try:
            yield
        except Finding as f:
            detail, cause = str(f), f.cause
            if cause is None:
                hidden = self.hidden_error()
                cause = hidden.kind if hidden is not None else WRONG_OUTPUT
                if hidden is not None:
                    detail = f"{detail} ({hidden.kind}: {hidden.evidence})"
            self.cases.append(CaseResult(self.label(f.req) if f.req is not None else label, "fail", detail, cause))
        except CannotGrade as g:
            self.cases.append(CaseResult(label, "cannot-grade", str(g), g.cause))
        except Unsupported as u:
            self.cases.append(CaseResult(label, "unsupported", str(u)))
        else:
            self.cases.append(CaseResult(self.sent[-1] if self.sent and not isinstance(what, Request) else label,
                                         "pass", "ok"))

    def label(self, req: Request) -> str:
        """``req``'s label as the server is sent it (a chat-only server's: through chat)."""
        try:
            return dialect(self.client).adapt(req).label
        except ServerError:
            return req.label

    def hidden_error(self) -> Any:
        """An error the last reply hid behind HTTP 200 (``failure_causes.error_as_success``), or None."""
        if self.last is None:
            return None
        return error_as_success(self.last.doc, self.last.text, self.server_log() if self.server_log else "")

    def ask(self, req: Request, optional: str | None = None) -> Reply:
        """Send ``req``: its reply, or the case's verdict raised (``optional``: what a 4xx refusal
        means the server does not take, e.g. ``"tools"``: that case is n/a, not a finding)."""
        self.sent.append(self.label(req))
        self.n_requests += 1
        try:
            self.last = send(self.client, req, self.counters)
            return self.last
        except ServerDown as exc:
            raise self._on_down(req, exc) from None
        except ServerError as exc:
            raise self._refused(req, exc, optional) from None

    def verdict_on(self, req: Request, exc: BaseException) -> Exception:
        """The case's verdict on an exception a request sent outside :meth:`ask` raised (sent together)."""
        if isinstance(exc, ServerError):
            return self._refused(req, exc)
        if isinstance(exc, ServerDown):
            return self._on_down(req, exc)
        cause = classify_error(exc, req.path)
        return Finding(req, f"bad response: {exc}", cause.kind)

    def _refused(self, req: Request, exc: ServerError, optional: str | None = None) -> Exception:
        """The case's verdict on an error answer, classified (``failure_causes.classify_error``): a
        set-up or dialect refusal cannot grade, a 5xx or a non-API answer is a finding."""
        cause = classify_error(exc, req.path)
        if not self.ref.has_chat_template and exc.status is not None and exc.status >= 400 and (
                req.chat or _TEMPLATE.search(str(exc))):
            where = "the chat endpoint" if req.chat else "the server (it routes this through a chat template)"
            return CannotGrade(f"{where} refused ({exc}); the model has no chat template, so the server "
                               "cannot build a chat prompt")
        if optional and exc.status is not None and 400 <= exc.status < 500:
            return Unsupported(f"the server refuses {optional}: {exc}")
        if cause.kind == SETUP or (exc.status in (404, 405)):
            return CannotGrade(f"{cause.kind}: {cause.evidence}", cause.kind)
        if exc.status is None:  # the connection closed mid-answer: is the server still there?
            alive, why = self.client.healthy()
            if not alive:
                return _down(req, f"{exc} ({why})")
        return Finding(req, f"bad response: {exc}", cause.kind)

    def _on_down(self, req: Request, exc: ServerDown) -> Exception:
        """A Finding when the connection closed without an answer but the server is still up (it
        crashed on this request), else ServerDown (it stopped answering: the arm stops here)."""
        if getattr(exc, "kind", "closed") == "closed":
            alive, why = self.client.healthy()
            if alive:
                return Finding(req, f"no answer: {exc} (the server is still up)", TRANSPORT)
            return _down(req, f"{exc} ({why})")
        return _down(req, exc)

    def ask_ids(self, ids: Sequence[int], max_tokens: int, tag: str, **kw: Any) -> tuple[Request, Reply]:
        """A completions request for exactly ``ids``: a token-id prompt where the server takes one,
        else the text whose encoding round-trips to ``ids`` (CannotGrade when none does)."""
        req = Request(tuple(int(i) for i in ids), max_tokens, tag=tag, **kw)
        if self.token_prompts is not False:
            self.sent.append(req.label)
            self.n_requests += 1
            try:
                reply = self.last = send(self.client, req, self.counters)
                pt = (reply.usage or {}).get("prompt_tokens")
                if pt is not None and pt != len(ids):
                    raise CannotGrade(f"the server counted {pt} prompt tokens for a token-id prompt of "
                                      f"{len(ids)}: it did not take the ids as sent")
                self.token_prompts = True
                return req, reply
            except ServerDown as exc:
                raise self._on_down(req, exc) from None
            except ServerError as exc:
                if self.token_prompts or exc.status is None or exc.status < 400 or exc.status >= 500:
                    raise self._refused(req, exc) from None
                self.token_prompts = False  # it refuses token-id prompts: text, where the ids round-trip
        text = self.ref.text_for(ids)
        if text is None:
            raise CannotGrade("the server takes no token-id prompt and these ids do not round-trip through "
                              "text (decode then encode gives other ids)")
        treq = Request(text, max_tokens, tag=tag + " (as text: the ids round-trip)", **kw)
        return treq, self.ask(treq)


_TEMPLATE = re.compile(r"chat[ _-]?template|chat_generation", re.I)


def _down(req: Request, why: object) -> ServerDown:
    exc = ServerDown(f"server stopped answering: {req.label}: {why}")
    exc.label = req.label  # type: ignore[attr-defined]
    return exc


# ------------------------------------------------------------------ the plan: prompts per check


@dataclass
class PromptInfo:
    text: str
    ids: tuple[int, ...]  # the text's encoding (a token-id prompt sends these)
    out: list[int]  # plain greedy output of the completions prompt built from ``text``, up to MAX_BUDGET, no EOS
    eos: bool  # plain decode ends on EOS within MAX_BUDGET


NEEDS: dict[str, tuple[int, int]] = {  # check -> (prompts without EOS, prompts ending on EOS)
    "identity": (3, 0), "stream": (3, 1), "budget": (len(BUDGETS), 0), "finish_reason": (4, 2),
    "usage": (4, 1), "eos": (0, 3), "stop": (5, 0), "logprobs": (2, 0), "cache": (2, 0),
    "concurrency": (CONCURRENT, 0), "seeded": (CONCURRENT, 0), "tools": (2, 0), "reject": (3, 1), "leak": (5, 0),
}


@dataclass
class Plan:
    """Each check's own prompts (first words distinct across all of them, so a prompt cache
    cannot carry one check's state into another), and the warm-up prompt."""

    by_check: dict[str, tuple[list[PromptInfo], list[PromptInfo]]]
    warmup: str
    notes: list[str] = field(default_factory=list)
    warmup_first: int | None = None  # plain decode's first token for the warm-up prompt (None: EOS)
    reencode: PromptInfo | None = None  # output whose text re-encodes to another token count

    def no_eos(self, check: str) -> list[PromptInfo]:
        return self.by_check.get(check, ([], []))[0]

    def eos(self, check: str) -> list[PromptInfo]:
        return self.by_check.get(check, ([], []))[1]


def make_plan(ref: Reference, checks: Sequence[str] = SERVER_CHECKS) -> Plan:
    """Classify ``ref.prompts`` by plain decode and give each check its own (always in
    ``SERVER_CHECKS`` order, so ``--check X`` alone sends the same requests as a full run)."""
    infos: list[PromptInfo] = []
    firsts: set[str] = set()
    for p in ref.prompts:
        first = p.split()[0] if p.split() else p
        if first in firsts:
            continue  # a shared first word would let a prompt cache carry state across checks
        firsts.add(first)
        ids = tuple(ref.encode(p))
        out, hit = ref.greedy(tuple(ref.completion_ids(p)), MAX_BUDGET)  # what the server completes
        infos.append(PromptInfo(p, ids, list(out), bool(hit and len(out) >= 2)))
    if len(infos) < 2:
        raise ValueError("fewer than 2 usable prompts (each needs its own first word)")
    warm = infos.pop()
    no_eos = [i for i in infos if not i.eos and len(i.out) >= MAX_BUDGET]
    eos = [i for i in infos if i.eos]
    notes: list[str] = []
    # stream: prefer outputs that split a multi-byte character across tokens
    split = [i for i in no_eos if splits_utf8(ref, i.out[:24])]
    reenc = next((i for i in no_eos if len(ref.encode(ref.decode(i.out[:17]))) != len(ref.encode("")) + 17), None)
    pools = {"no_eos": list(no_eos), "eos": list(eos)}
    reused = {"no_eos": False, "eos": False}

    def take(kind: str, n: int, prefer: Sequence[PromptInfo] = ()) -> list[PromptInfo]:
        got: list[PromptInfo] = []
        for i in prefer:
            if i in pools[kind] and len(got) < n:
                pools[kind].remove(i)
                got.append(i)
        while len(got) < n and pools[kind]:
            got.append(pools[kind].pop(0))
        src = no_eos if kind == "no_eos" else eos
        k = 0
        while len(got) < n and src:
            got.append(src[k % len(src)])  # the pool ran out: shared with another check
            reused[kind] = True
            k += 1
        return got

    by_check: dict[str, tuple[list[PromptInfo], list[PromptInfo]]] = {}
    reenc_taken = take("no_eos", 1, [reenc]) if reenc is not None else []
    for c in SERVER_CHECKS:
        if c not in NEEDS:
            continue
        n, e = NEEDS[c]
        by_check[c] = (take("no_eos", n, split if c == "stream" else ()), take("eos", e))
    for kind, r in reused.items():
        if r:
            notes.append(f"too few {'EOS-ending' if kind == 'eos' else 'long'} prompts: some are shared by "
                         "two checks (a prompt cache can carry state between them)")
    if not eos:
        notes.append(f"no prompt reaches EOS within {MAX_BUDGET} tokens of plain decode")
    return Plan(by_check, warm.text, notes, reencode=reenc_taken[0] if reenc_taken else None,
                warmup_first=warm.out[0] if warm.out else None)


# ------------------------------------------------------------------ checks


def check_identity(ctx: Ctx) -> str:
    ps = ctx.plan.no_eos("identity")
    gated = ctx.fidelity is not None
    if gated:  # the one finding (prompt_fidelity); the completions cases would only repeat it
        ctx.cases.append(ctx.fidelity)
    for p in ps[:2]:
        req = Request(p.text, 24, logprobs=True, tag="identity")
        with ctx.case(req):
            if gated:
                raise CannotGrade(f"not sent: the server does not complete the prompt {ctx.fidelity_as} (the "
                                  "prompt-fidelity case of this cell): its output cannot be compared with plain "
                                  "decode of it")
            why = compare(ctx.ref, ctx.ask(req), p.out[:24], exact=False)
            if why:
                raise Finding(req, why)
    for p in ps[2:3]:
        req = Request(p.text, 24, chat=True, logprobs=True, tag="identity (chat)")
        with ctx.case(req):
            ids, _ = ctx.ref.expect(req)
            r = ctx.ask(req)
            pt = (r.usage or {}).get("prompt_tokens")
            if gated and pt is not None and pt != len(ctx.ref.prompt_ids(req)):
                raise CannotGrade(f"the server counted {pt} prompt tokens for a chat prompt of "
                                  f"{len(ctx.ref.prompt_ids(req))} (as the prompt-fidelity case of this cell): its "
                                  "output cannot be compared with plain decode of the chat prompt")
            why = compare(ctx.ref, r, ids, exact=False)
            if why:
                raise Finding(req, f"{why} (the chat prompt the server builds, or its decode)")
    if gated:
        return ""
    return "greedy output = plain decode (completions and chat)"


def _stream_pair(ctx: Ctx, req: Request, *, ids_check: bool) -> None:
    """The streamed reply = the non-streamed reply to the same request (text, finish, usage)."""
    plain_req = Request(req.prompt, req.max_tokens, chat=req.chat, stop=req.stop, logprobs=not req.chat,
                        tag=req.tag)
    sreq = Request(req.prompt, req.max_tokens, chat=req.chat, stream=True, stop=req.stop, tag=req.tag)
    with ctx.case(sreq):
        full = ctx.ask(plain_req)
        streamed = ctx.ask(sreq)
        if loose(streamed.text) != loose(full.text):
            raise Finding(sreq, f"streamed deltas concatenated differ from the non-streamed text: "
                                f"{_text_diff(loose(streamed.text), loose(full.text), 'stream', 'non-stream')} "
                                f"({streamed.chunks} events)")
        ids = strip_eos(ctx.ref, full.ids)
        whose = "the ids it returned"
        if ids is None and ids_check and isinstance(req.prompt, str):
            # no ids came back: plain decode's, when the text is theirs whitespace aside (else identity judges)
            want_ids, _ = ctx.ref.expect(plain_req)
            if _nows(ctx.ref.decode(want_ids)) == _nows(full.text):
                ids, whose = want_ids, "its tokens (plain decode's ids: it returned none)"
        if ids_check and ids is not None and loose(ctx.ref.decode(ids)) != loose(full.text):
            raise Finding(plain_req, f"the text is not the decode of {whose}: "
                                     + _text_diff(loose(full.text), loose(ctx.ref.decode(ids)), "text",
                                                  "decode(ids)"))
        if streamed.finish_reason != full.finish_reason:
            raise Finding(sreq, f"streamed finish_reason {streamed.finish_reason!r}, not the non-streamed "
                                f"{full.finish_reason!r}")
        if streamed.usage is None:
            raise Finding(sreq, "no usage chunk although stream_options.include_usage was asked")
        keys = ("prompt_tokens", "completion_tokens", "total_tokens")
        su, fu = ({k: (u or {}).get(k) for k in keys} for u in (streamed.usage, full.usage))
        if full.usage is not None and su != fu:
            raise Finding(sreq, f"streamed usage {su} differs from the non-streamed {fu}")


def check_stream(ctx: Ctx) -> str:
    ref, ps = ctx.ref, ctx.plan.no_eos("stream")
    split = sum(splits_utf8(ref, p.out[:24]) for p in ps[:2])
    for p in ps[:2]:
        _stream_pair(ctx, Request(p.text, 24, tag="stream"), ids_check=True)
    for p in ps[2:3]:
        _stream_pair(ctx, Request(p.text, 24, chat=True, tag="stream (chat)"), ids_check=False)
    for p in ctx.plan.eos("stream")[:1]:
        _stream_pair(ctx, Request(p.text, MAX_BUDGET, tag="stream (EOS)"), ids_check=False)
    cases = _stop_cases(ref, ps[1]) if len(ps) > 1 else []
    for s, kind, _ in cases[:1]:
        _stream_pair(ctx, Request(ps[1].text, MAX_BUDGET, stop=(s,), tag=f"stream (stop {kind})"), ids_check=False)
    return ("streamed deltas = non-streamed text = decode(ids), same finish_reason and usage"
            + (f"; {split} output(s) split a multi-byte character across tokens" if split else ""))


def check_budget(ctx: Ctx) -> str:
    for m, p in zip(BUDGETS, ctx.plan.no_eos("budget"), strict=False):
        req = Request(p.text, m, logprobs=True, tag="budget")
        with ctx.case(req):
            why = compare(ctx.ref, ctx.ask(req), p.out[:m], exact=True)
            if why:
                raise Finding(req, f"max_tokens={m}: {why}")
    return f"exactly the budget at max_tokens {list(BUDGETS)}"


def _stop_cases(ref: Reference, p: PromptInfo) -> list[tuple[str, str, int]]:
    """(stop string, kind, index of the token that completes it) in ``p``'s plain output."""
    ids = p.out
    text = ref.decode(ids)
    out: list[tuple[str, str, int]] = []
    for j in range(3, len(ids)):
        piece = ref.decode(ids[j : j + 1]).strip()
        if piece and piece not in ref.decode(ids[:j]) and "\ufffd" not in piece:
            out.append((piece, "a whole token", j))
            break
    for j in range(3, len(ids)):
        piece = ref.decode(ids[j : j + 1]).strip()
        if len(piece) >= 2 and "\ufffd" not in piece:
            inner = piece[1:] if len(piece) == 2 else piece[1:-1]
            first = text.find(inner)
            if first >= 0 and first > len(ref.decode(ids[:3])):
                k = token_at(ref, ids, first + len(inner) - 1)
                if ref.decode(ids[k : k + 1]).strip() != inner:
                    out.append((inner, "inside a token", k))
                    break
    return out


def _stop_case(ref: Reference, ps: Sequence[PromptInfo], kind: str, skip: int = 0
               ) -> tuple[PromptInfo, str, int] | None:
    """The ``skip``-th prompt of ``ps`` with a stop case of ``kind`` ('' = any)."""
    n = 0
    for p in ps:
        for s, k, j in _stop_cases(ref, p):
            if not kind or k == kind:
                if n == skip:
                    return p, s, j
                n += 1
                break
    return None


def _stopped(ctx: Ctx, req: Request, reply: Reply, full_text: str, s: str) -> None:
    """CannotGrade unless the server's text is plain decode's up to the stop string."""
    want = full_text[: full_text.find(s)]
    if stop_view(reply.text) != stop_view(want):
        raise CannotGrade(f"the server's text {_tail(reply.text)} is not plain decode's up to the stop {s!r} "
                          f"{_tail(want)} (the stop check judges that)")


def check_finish_reason(ctx: Ctx) -> str:
    ref, ps, es = ctx.ref, ctx.plan.no_eos("finish_reason"), ctx.plan.eos("finish_reason")
    if ps:
        req = Request(ps[0].text, 5, tag="finish_reason (budget)")
        with ctx.case(req):
            r = ctx.ask(req)
            if r.finish_reason != "length":
                raise Finding(req, f"finish_reason {r.finish_reason!r} at the budget, expected 'length'")
    for i, p in enumerate(es[:2]):
        m = MAX_BUDGET if i == 0 else len(p.out) + 1  # the EOS is the budget's last token: EOS wins
        req = Request(p.text, m, tag="finish_reason (EOS)" + ("" if i == 0 else " as the budget's last token"))
        with ctx.case(req):
            r = ctx.ask(req)
            if r.finish_reason != "stop":
                raise Finding(req, f"finish_reason {r.finish_reason!r} on EOS, expected 'stop'")
    for kind, extra, tag in (("", None, "stop string"), ("", 1, "stop string in the budget's last block")):
        found = _stop_case(ref, ps[1:], kind, skip=0 if extra is None else 1)
        label = f"finish_reason ({tag})"
        if found is None:
            with ctx.case(label):
                raise Unsupported("no stop string found in the plain output")
            continue
        p, s, k = found
        m = MAX_BUDGET if extra is None else k + 1 + extra
        req = Request(p.text, m, stop=(s,), tag=label)
        with ctx.case(req):
            r = ctx.ask(req)
            _stopped(ctx, req, r, ref.decode(p.out), s)
            if r.finish_reason != "stop":
                raise Finding(req, f"the stop string {s!r} ended the text but finish_reason is "
                                   f"{r.finish_reason!r}, not 'stop'")
    return "'length' at the budget, 'stop' on EOS and on stop strings (also in the budget's last block)"


def _completion_count(ctx: Ctx, req: Request, r: Reply) -> None:
    u = r.usage
    if not isinstance(u, dict):
        raise Finding(req, f"no usage in the response (got {u!r})")
    pt, ct, tt = u.get("prompt_tokens"), u.get("completion_tokens"), u.get("total_tokens")
    n_prompt = len(ctx.ref.prompt_ids(req))
    if pt != n_prompt:
        raise Finding(req, f"usage.prompt_tokens {pt}, the prompt the server builds has {n_prompt} tokens")
    if tt != (pt or 0) + (ct or 0):
        raise Finding(req, f"usage.total_tokens {tt} != prompt_tokens {pt} + completion_tokens {ct}")
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None and not (isinstance(cached, int) and 0 <= cached <= n_prompt):
        raise Finding(req, f"usage cached_tokens {cached!r} outside 0..prompt_tokens {n_prompt}")
    details = u.get("completion_tokens_details") if isinstance(u.get("completion_tokens_details"), dict) else {}
    for k, v in details.items():  # reasoning_tokens, accepted/rejected_prediction_tokens: parts of the count
        if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= (ct or 0):
            raise Finding(req, f"usage completion_tokens_details.{k} {v} outside 0..completion_tokens {ct}")


def check_usage(ctx: Ctx) -> str:
    ref, ps, es = ctx.ref, ctx.plan.no_eos("usage"), ctx.plan.eos("usage")
    plain = [(Request(ps[0].text, 9, logprobs=True, tag="usage"), False)] if ps else []
    plain += [(Request(p.text, MAX_BUDGET, logprobs=True, tag="usage (EOS)"), True) for p in es[:1]]
    if ctx.plan.reencode is not None:
        plain.append((Request(ctx.plan.reencode.text, 17, logprobs=True,
                              tag="usage (output re-encodes to another count)"), False))
    for req, eos in plain:
        with ctx.case(req):
            r = ctx.ask(req)
            _completion_count(ctx, req, r)
            ct = r.usage.get("completion_tokens") if r.usage else None
            ids = strip_eos(ref, r.ids)
            n = len(ids) if ids is not None else len(ref.expect(req)[0])
            allowed = (n, n + 1) if eos else (n,)
            if ct not in allowed:
                raise Finding(req, f"usage.completion_tokens {ct}, the server returned {n} token(s)"
                                   + (" (+ at most the EOS)" if eos else ""))
    for kind, extra in (("", None), ("", 1)):
        found = _stop_case(ref, ps[1:], kind, skip=0 if extra is None else 1)
        tag = "usage (stop)" if extra is None else "usage (stop in the budget's last block)"
        if found is None:
            with ctx.case(tag):
                raise Unsupported("no stop string found in the plain output")
            continue
        p, s, k = found
        req = Request(p.text, MAX_BUDGET if extra is None else k + 1 + extra, stop=(s,), tag=tag)
        with ctx.case(req):
            r = ctx.ask(req)
            _completion_count(ctx, req, r)
            _stopped(ctx, req, r, ref.decode(p.out), s)
            ct = r.usage.get("completion_tokens") if r.usage else None
            if ct != k + 1:
                raise Finding(req, f"usage.completion_tokens {ct}, but the stop {s!r} was completed by token {k} "
                                   f"(so {k + 1} tokens)")
    return "prompt, completion (trimmed at a stop) and total token counts exact"


def check_eos(ctx: Ctx) -> str:
    ref, es = ctx.ref, ctx.plan.eos("eos")
    if not es:
        with ctx.case("eos"):
            raise Unsupported(f"no prompt reaches EOS within {MAX_BUDGET} tokens of plain decode")
        return ""
    plans = [(es[0], MAX_BUDGET, "eos")]
    if len(es) > 1:
        plans.append((es[1], len(es[1].out) + 1, "eos (the budget's last token)"))
    if len(es) > 2:
        plans.append((es[2], len(es[2].out) + 3, "eos (inside a block past the budget's end)"))
    for p, m, tag in plans:
        req = Request(p.text, m, logprobs=True, tag=tag)
        with ctx.case(req):
            r = ctx.ask(req)
            for et in ref.eos_text:
                if et and et in r.text:
                    raise Finding(req, f"EOS text {et!r} in the output at character {r.text.index(et)}: "
                                       f"{_tail(r.text)}")
            why = compare(ref, r, p.out, exact=True)
            if why:
                raise Finding(req, f"plain decode ends on EOS after {len(p.out)} tokens: {why}")
    return "the EOS never in the text, nothing after it"


def check_stop(ctx: Ctx) -> str:
    ref, ps = ctx.ref, ctx.plan.no_eos("stop")
    wanted = [("a whole token", None), ("inside a token", None), ("", 0), ("", 1)]
    for n, (kind, extra) in enumerate(wanted):
        found = _stop_case(ref, ps[n:] + ps[:n], kind)
        tag = f"stop ({kind or 'any'}" + ("" if extra is None else
                                          f", max_tokens {'at' if extra == 0 else 'one past'} its token") + ")"
        if found is None:
            with ctx.case(tag):
                raise Unsupported(f"no stop string {kind or ''} found in the plain output".replace("  ", " "))
            continue
        p, s, k = found
        req = Request(p.text, MAX_BUDGET if extra is None else k + 1 + extra, stop=(s,), logprobs=True, tag=tag)
        with ctx.case(req):
            r = ctx.ask(req)
            full = ref.decode(p.out)
            want = full[: full.find(s)]
            if stop_view(r.text) != stop_view(want):
                extra_s = " (the stop string is in the text)" if s in r.text else ""
                raise Finding(req, f"stop {s!r}: text {_tail(r.text)} vs expected {_tail(want)}{extra_s}")
            if r.logprobs is not None and len(r.logprobs) not in (k, k + 1):
                raise Finding(req, f"stop {s!r} was completed by token {k}, but {len(r.logprobs)} logprob entries "
                                   f"came back (ids and logprobs not trimmed where the text was)")
    return "the text ends before the stop string (whole token, inside a token, at the budget's end), ids trimmed"


def _lp_close(a: float, b: float) -> bool:
    return abs(a - b) <= LOGPROB_ATOL + LOGPROB_RTOL * abs(b)


def check_logprobs(ctx: Ctx) -> str:
    ref, ps = ctx.ref, ctx.plan.no_eos("logprobs")
    for n, p in enumerate(ps[:2]):
        kw = {"logprobs": True, "top_logprobs": TOP_K}
        if n == 0:
            req = Request(p.text, 9, tag="logprobs", **kw)
        label = f"logprobs: {p.text[:30]!r}" + (" by token ids" if n else "")
        with ctx.case(label):
            if n == 0:
                r = ctx.ask(req)
            else:
                req, r = ctx.ask_ids(p.ids, 9, tag="logprobs (token-id prompt)", **kw)
            pids = tuple(ref.prompt_ids(req))
            if not r.logprobs:
                raise Finding(req, "no logprobs in the response")
            got_ids = r.ids
            ids = got_ids if got_ids is not None else ref.expect(req)[0][: len(r.logprobs)]
            want = ref.logprobs(pids, tuple(ids), TOP_K)
            for i, (g, (lp, top)) in enumerate(zip(r.logprobs, want, strict=False)):
                if not _lp_close(g.logprob, lp):
                    raise Finding(req, f"token {i} (id {ids[i]}): logprob {g.logprob:.5f} vs plain {lp:.5f} "
                                       f"(tolerance {LOGPROB_ATOL:g} + {LOGPROB_RTOL:.4g}·|lp|)")
                vals = [v for _, _, v in g.top]
                if len(vals) != TOP_K:
                    raise Finding(req, f"token {i}: {len(vals)} top_logprobs, asked for {TOP_K}")
                if vals != sorted(vals, reverse=True):
                    raise Finding(req, f"token {i}: top_logprobs not sorted by logprob: "
                                       f"{[(t[0], round(t[2], 4)) for t in g.top]}")
                if vals and not g.logprob >= vals[0] - (LOGPROB_ATOL + LOGPROB_RTOL * abs(vals[0])):
                    raise Finding(req, f"token {i}: the emitted (greedy) token's logprob {g.logprob:.5f} is below "
                                       f"the top entry's {vals[0]:.5f}")
                for k, ((_, _, v), (tid, w)) in enumerate(zip(g.top, top, strict=False)):
                    if not _lp_close(v, w):
                        raise Finding(req, f"token {i}: top_logprobs[{k}] {v:.5f} vs plain {w:.5f} (id {tid})")
    return (f"emitted-token logprobs and sorted top_logprobs = plain decode teacher-forced on the server's ids "
            f"(tol {LOGPROB_ATOL:g} + {LOGPROB_RTOL:.4g}·|lp|)")


def _hit(ctx: Ctx, req: Request, r: Reply, n_prompt: int, need: int, what: str) -> str | None:
    """CannotGrade when the server's usage shows the hit meant was not made; a note when unverifiable."""
    if not ctx.require_hits:
        return None
    u = r.usage or {}
    pt = u.get("prompt_tokens")
    if pt is not None and pt != n_prompt:
        raise CannotGrade(f"{what}: the server counted {pt} prompt tokens, {n_prompt} were sent: not the request "
                          "meant")
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        return "hit unverified (no cached_tokens)"
    if not isinstance(cached, int) or cached < need:
        raise CannotGrade(f"{what}: the server reused {cached!r} cached tokens, the case needs ≥ {need}: the warm "
                          "path was not exercised")
    return None


def check_cache(ctx: Ctx) -> str:
    ref, ps = ctx.ref, ctx.plan.no_eos("cache")
    if not ps:
        with ctx.case("cache"):
            raise Unsupported("no unused prompt for a cold request")
        return ""
    p = ps[0]
    notes: set[str] = set()
    cold_reply: Reply | None = None
    cold_built = list(p.ids)
    with ctx.case("cache: cold"):
        req, cold_reply = ctx.ask_ids(p.ids, 17, tag="cache: cold", logprobs=True)
        cold_built = ref.prompt_ids(req)  # the prompt the server completed (a declared wrapping applied)
        why = compare(ref, cold_reply, ref.expect(req)[0], exact=False)
        if why:
            raise Finding(req, f"first (cold) request: {why}")
    if cold_reply is None:
        return ""
    out = strip_eos(ref, cold_reply.ids) or p.out[:17]
    other = ps[1].ids if len(ps) > 1 else p.out[17:20]
    body = list(other[1:]) if ref.bos_id is not None and other and other[0] == ref.bos_id else list(other)
    plan = [  # (case, ids sent, the cached tokens it needs given the prompt the server builds from them)
        ("cache: repeated identical request", list(p.ids), lambda b: len(b) - 1),
        ("cache: shared-prefix follow-up", list(p.ids) + body, lambda b: max(1, common_prefix(b, cold_built) - 1)),
        ("cache: exact continuation (prompt ids + the server's completion ids)", list(p.ids) + list(out),
         lambda b: len(cold_built) + 1),  # more than the cold prompt: its generated tokens reused
    ]
    for tag, ids, need in plan:
        with ctx.case(tag):
            req, r = ctx.ask_ids(ids, 17, tag=tag, logprobs=True)
            built = ref.prompt_ids(req)
            note = _hit(ctx, req, r, len(built), need(built), tag)
            if note:
                notes.add(note)
            want, _ = ref.greedy(tuple(built), 17)
            why = compare(ref, r, want, exact=False)  # lengths are the budget check's
            if why:
                raise Finding(req, f"warm != cold plain decode: {why}")
    warm = ctx.cases[-len(plan):]
    if all(c.status == "cannot-grade" for c in warm) and ctx.cases[-len(plan) - 1].status == "pass":
        ctx.cases.pop(-len(plan) - 1)  # the cold request alone tests no cache: not credited
    return "repeated, shared-prefix and continuation requests (by token id) = cold plain decode" + (
        "; " + "; ".join(sorted(notes)) if notes else "")


def _together(client: HttpClient, reqs: Sequence[Request]
              ) -> tuple[dict[int, Reply | BaseException], dict[int, tuple[float, float]]]:
    """Send ``reqs`` from one thread each, released together; each reply and its (sent, answered) times."""
    results: dict[int, Reply | BaseException] = {}
    times: dict[int, tuple[float, float]] = {}
    gate = threading.Barrier(len(reqs))

    def go(i: int, req: Request) -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            gate.wait(10)
        t0 = time.monotonic()
        try:
            results[i] = send(client, req)
        except BaseException as exc:  # noqa: BLE001 - reported with its request
            results[i] = exc
        times[i] = (t0, time.monotonic())

    threads = [threading.Thread(target=go, args=(i, r), daemon=True) for i, r in enumerate(reqs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(client.limits.deadline + 15)
    return results, times


def _overlapping(ctx: Ctx, reqs: Sequence[Request], what: str) -> dict[int, Reply | BaseException] | None:
    """``reqs`` sent together until they were in flight together (every one sent before any was
    answered; 3 tries): their replies, or None (a cannot-grade case recorded as ``what``)."""
    for _try in range(3):
        results, times = _together(ctx.client, reqs)
        ctx.n_requests += len(reqs)
        for i, req in enumerate(reqs):
            res = results.get(i)
            if res is None or isinstance(res, ServerDown):
                raise _down(req, res or "no answer")
        if len(times) == len(reqs) and max(t[0] for t in times.values()) < min(t[1] for t in times.values()):
            return results
    with ctx.case(what):
        raise CannotGrade(f"the {len(reqs)} requests were not in flight together (one was answered before the "
                          "last was sent, 3 tries)")
    return None


def check_concurrency(ctx: Ctx) -> str:
    ref, ps = ctx.ref, ctx.plan.no_eos("concurrency")
    reqs = [Request(p.text, 17, logprobs=True, tag=f"concurrent {i + 1}/{len(ps)}") for i, p in enumerate(ps)]
    if len(reqs) < 2:
        with ctx.case("concurrency"):
            raise Unsupported("fewer than 2 prompts")
        return ""
    results = _overlapping(ctx, reqs, "concurrency: requests in flight together")
    if results is None:
        return ""
    for i, req in enumerate(reqs):
        with ctx.case(req):
            res = results[i]
            if isinstance(res, BaseException):
                raise ctx.verdict_on(req, res)
            ctx.last = res
            why = compare(ref, res, ps[i].out[:17], exact=False)
            if why:
                raise Finding(req, f"B-invariance: logic (no numerics witness over HTTP): sent with {len(reqs) - 1} "
                                   f"others in flight: {why}")
    return f"B-invariance holds (identical): {len(reqs)} requests in flight together: each = plain decode"


def _out(ref: Reference, r: Reply) -> list[int] | str:
    """A reply's output: its ids (without a final EOS) where it returned them, else its text."""
    ids = strip_eos(ref, r.ids)
    return ids if ids is not None else loose(r.text)


def same_reply(ref: Reference, a: Reply, b: Reply, an: str, bn: str, *, logprobs: bool = True) -> str | None:
    """Why two of the server's replies to the same request differ (None when they agree): the
    output (ids where both have them, else the text), finish_reason, and each emitted token's
    logprob within the logprobs check's tolerance."""
    oa, ob = _out(ref, a), _out(ref, b)
    if isinstance(oa, list) and isinstance(ob, list):
        i = first_divergence(oa, ob)
        if i is not None:
            x = oa[i] if i < len(oa) else "<end>"
            y = ob[i] if i < len(ob) else "<end>"
            return f"output token {i}: {an} id {x} vs {bn} id {y} ({an} {len(oa)} tokens, {bn} {len(ob)})"
    elif loose(a.text) != loose(b.text):
        return "text " + _text_diff(loose(a.text), loose(b.text), an, bn)
    if a.finish_reason != b.finish_reason:
        return f"finish_reason {an} {a.finish_reason!r} vs {bn} {b.finish_reason!r}"
    if logprobs and a.logprobs and b.logprobs:
        for i, (x, y) in enumerate(zip(a.logprobs, b.logprobs, strict=False)):
            if not _lp_close(x.logprob, y.logprob):
                return (f"token {i}: logprob {an} {x.logprob:.5f} vs {bn} {y.logprob:.5f} (tolerance "
                        f"{LOGPROB_ATOL:g} + {LOGPROB_RTOL:.4g}·|lp|)")
    return None


def _logits_moved(ctx: Ctx, req: Request, r: Reply) -> str | None:
    """Why ``r``'s logprobs for its own (sampled) tokens are not the reference's teacher-forced on
    them (None when they agree, or cannot be told: no ids or logprobs came back). At temperature 1
    a logprob is the model's: a difference means the computation moved, not the draw."""
    ids = r.ids
    if not ids or not r.logprobs:
        return None
    want = ctx.ref.logprobs(tuple(ctx.ref.prompt_ids(req)), tuple(ids), 1)
    for i, (g, (lp, _)) in enumerate(zip(r.logprobs, want, strict=False)):
        if not _lp_close(g.logprob, lp):
            return f"token {i} (id {ids[i]}): logprob {g.logprob:.5f} vs the reference {lp:.5f}"
    return None


def check_seeded(ctx: Ctx) -> str:
    """The same seeded request (temperature SEED_TEMPERATURE) alone = with batch-mates in flight:
    the same draws. A burst whose logprobs show the computation itself moved (the concurrency
    check's finding) cannot be graded here."""
    ref, ps = ctx.ref, ctx.plan.no_eos("seeded")
    if len(ps) < 2:
        with ctx.case("seeded"):
            raise Unsupported("fewer than 2 prompts")
        return ""
    kw: dict[str, Any] = {"logprobs": True, "temperature": SEED_TEMPERATURE}
    alone = Request(ps[0].text, 17, seed=SEED, tag="seeded (alone)", **kw)
    a1: Reply | None = None
    with ctx.case("seeded: the request alone, twice"):
        try:
            a1 = ctx.ask(alone, optional="seeded sampling (temperature, seed)")
        except Finding as f:  # logprobs are the logprobs check's: without them, text only
            if "bad response" not in str(f):
                raise
            kw["logprobs"] = False
            alone = Request(ps[0].text, 17, seed=SEED, tag="seeded (alone, no logprobs)", **kw)
            a1 = ctx.ask(alone, optional="seeded sampling (temperature, seed)")
        a2 = ctx.ask(alone, optional="seeded sampling (temperature, seed)")
        why = same_reply(ref, a2, a1, "second", "first", logprobs=False)
        if why:
            raise CannotGrade(f"two identical seeded requests sent alone came back different ({why}): the server's "
                              "seeded sampling is not reproducible, so batch-mates cannot be judged")
        if _out(ref, a1) in (ps[0].out[: len(_out(ref, a1))], loose(ref.decode(ps[0].out[:17]))):
            raise CannotGrade(f"the seeded request at temperature {SEED_TEMPERATURE:g} came back as greedy decode: "
                              "the server ignores temperature (nothing sampled to compare)")
    if a1 is None or ctx.cases[-1].status != "pass":
        return ""
    ctx.cases.pop()  # the request alone tests nothing by itself: not credited
    mates = [Request(p.text, 17, seed=SEED + 1 + i, tag=f"seeded batch-mate {i + 1}", **kw)
             for i, p in enumerate(ps[1:CONCURRENT])]
    for burst in range(SEED_BURSTS):  # several bursts: a server need not batch every one of them
        probe = Request(ps[0].text, 17, seed=SEED, tag=f"seeded (with {len(mates)} batch-mates in flight, burst "
                                                      f"{burst + 1}/{SEED_BURSTS})", **kw)
        results = _overlapping(ctx, [probe, *mates], f"seeded: burst {burst + 1}: requests in flight together")
        if results is None:
            continue
        with ctx.case(probe):
            res = results[0]
            if isinstance(res, BaseException):
                raise ctx.verdict_on(probe, res)
            why = same_reply(ref, res, a1, "with batch-mates", "alone", logprobs=False)
            if why:
                moved = _logits_moved(ctx, probe, res)
                if moved:
                    raise CannotGrade(f"with batch-mates the output differs ({why}), but so do the logprobs of its own "
                                      f"tokens ({moved}): batch-mates changed the computation itself (the concurrency "
                                      "check's finding), so the draws cannot be judged")
                raise Finding(probe, f"seeded invariance: logic: the same seeded request (seed {SEED}, temperature "
                                     f"{SEED_TEMPERATURE:g}) with "
                                     f"{len(mates)} batch-mates in flight draws other tokens than alone (the "
                                     f"logprobs are the model's): {why}")
    return (f"seeded invariance holds (identical): a seeded sampled request with {len(mates)} batch-mates in flight "
            f"({SEED_BURSTS} bursts) = the same request alone")


def _calls(r: Reply) -> list[tuple[str, Any]]:
    """A reply's tool calls as (name, parsed arguments); arguments that are not JSON stay a string."""
    out: list[tuple[str, Any]] = []
    for c in r.tool_calls or []:
        try:
            args: Any = json.loads(c["arguments"]) if c["arguments"] else {}
        except ValueError:
            args = ("not JSON", c["arguments"])
        out.append((c["name"], args))
    return out


def _calls_diff(a: list[tuple[str, Any]], b: list[tuple[str, Any]], an: str, bn: str) -> str | None:
    if a == b:
        return None
    if len(a) != len(b):
        return f"{len(a)} tool call(s) {an} vs {len(b)} {bn}: {a!r:.120} vs {b!r:.120}"
    i = next(k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    (na, xa), (nb, xb) = a[i], b[i]
    if na != nb:
        return f"tool call {i}: name {na!r} {an} vs {nb!r} {bn}"
    sa, sb = json.dumps(xa, sort_keys=True), json.dumps(xb, sort_keys=True)
    return f"tool call {i} ({na}) arguments " + _text_diff(sa, sb, an, bn)


def check_tools(ctx: Ctx) -> str:
    """Tool calls the server parses under speculation = without (the plain arm's, request for request),
    streamed (deltas reassembled) and not; on the plain arm, streamed = non-streamed."""
    ref, ps = ctx.ref, ctx.plan.no_eos("tools")
    if not ref.has_chat_template:
        with ctx.case("tools"):
            raise Unsupported("the model has no chat template: a server builds no tool-call prompt for it")
        return ""
    compared = 0
    for p in ps[:2]:
        same_gen: bool | None = None
        own: list[tuple[str, Any]] | None = None
        for stream in (False, True):
            req = Request(p.text, 17, chat=True, stream=stream, logprobs=not stream, tools=(TOOL,), tag="tools")
            with ctx.case(req):
                r = ctx.ask(req, optional="tools")
                calls = _calls(r)
                if not calls:
                    raise Unsupported(f"no tool call parsed (content {_tail(r.text)}): the server has no tool parser, "
                                      "or the output holds no call")
                key = f"tools: {req.label}"
                base = ctx.baseline.get(key) if ctx.arm != "plain" else None
                if ctx.arm == "plain":
                    ctx.baseline[key] = (calls, strip_eos(ref, r.ids))
                if not stream:
                    own = calls
                if base is not None:
                    bcalls, bids = base
                    ids = strip_eos(ref, r.ids)
                    if not stream and ids is not None and bids is not None:
                        same_gen = ids == bids
                    if same_gen is False:
                        raise CannotGrade("the spec arm generated other tokens than the plain arm for this request "
                                          "(the identity check's finding): its tool calls cannot be compared")
                    why = _calls_diff(calls, bcalls, "with speculation", "without")
                    if why:
                        raise Finding(req, f"the tool call parsed under speculation differs from the one without: "
                                           f"{why}")
                    compared += 1
                elif stream and own is not None:
                    why = _calls_diff(calls, own, "streamed", "non-streamed")
                    if why:
                        raise Finding(req, f"streamed tool-call deltas reassembled differ from the non-streamed "
                                           f"tool call: {why}")
    if ctx.arm == "plain":
        return "tool calls parsed; streamed = non-streamed (the spec arm is compared with these)"
    if not compared:
        return "tool calls parsed; streamed = non-streamed (no plain arm to compare with)"
    return f"{compared} tool call(s) parsed under speculation = without (streamed and not)"


def check_reject(ctx: Ctx) -> str:
    """On a server whose drafter's every draft is rejected (rounds that emit only the target's own
    token): exactly plain decode's tokens (no stray, placeholder or rejected-draft id), usage
    counting exactly those tokens; the server's counters confirm the drafts were rejected."""
    ref = ctx.ref
    if not ctx.reject:
        with ctx.case("reject"):
            raise Unsupported("only on a server started with a drafter whose drafts are all rejected (the grader "
                              "starts one for a spec arm with a two-model drafter)")
        return ""
    m0 = metrics(ctx.client)
    c0 = SpecCounters(ctx.counters.drafted, ctx.counters.accepted)
    plans = [(p, MAX_BUDGET, False) for p in ctx.plan.no_eos("reject")[:3]]
    plans += [(p, MAX_BUDGET, True) for p in ctx.plan.eos("reject")[:1]]
    for p, m, eos in plans:
        req = Request(p.text, m, logprobs=True, tag="all drafts rejected" + (" (EOS)" if eos else ""))
        with ctx.case(req):
            r = ctx.ask(req)
            why = compare(ref, r, p.out[:m], exact=True)
            if why:
                raise Finding(req, f"with every draft rejected: {why}")
            ct = (r.usage or {}).get("completion_tokens")
            ids = strip_eos(ref, r.ids)
            n = len(ids) if ids is not None else len(p.out[:m])
            if ct not in ((n, n + 1) if eos else (n,)):
                raise Finding(req, f"with every draft rejected: usage.completion_tokens {ct}, plain decode emits {n}"
                                   + (" (+ the EOS)" if eos else ""))
    with ctx.case("all drafts rejected: the server's counters"):
        m1 = metrics(ctx.client)
        got = m1.minus(m0) if m1 is not None and m0 is not None else m1
        used = ctx.counters.minus(c0)
        if got is None or not got.sources:
            got = used if ctx.counters.sources else None
        if got is None:
            raise Unsupported("the server reports no speculation counters: that the drafts were rejected is not "
                              "confirmed (the outputs above are judged all the same)")
        if got.drafted <= 0:
            raise CannotGrade(f"the server drafted nothing with the rejecting drafter ({', '.join(sorted(got.sources))}"
                              "): the cases above judged plain decode, not rejected drafts")
        if got.accepted > REJECT_MAX_ACCEPT * got.drafted:
            raise CannotGrade(f"{got.accepted:g} of {got.drafted:g} drafts accepted: the drafter was not rejected")
    confirmed = ctx.cases[-1].status == "pass"
    return ("every draft rejected: exactly plain decode's tokens, no stray id, usage = the tokens"
            + ("" if confirmed else " (the rejection is not confirmed: the server reports no speculation counters)"))


def _leak_probes(p: PromptInfo) -> tuple[Request, Request]:
    """The leak check's two requests: greedy with logprobs, and seeded sampled."""
    return (Request(p.text, 17, logprobs=True, tag="leak (greedy)"),
            Request(p.text, 17, logprobs=True, temperature=SEED_TEMPERATURE, seed=SEED, tag="leak (seeded)"))


def fresh_probes(ctx: Ctx) -> None:
    """The leak check's probes on the fresh server (before any other check): the greedy request,
    then the seeded one twice (is seeded sampling reproducible at all?)."""
    ps = ctx.plan.no_eos("leak")
    ctx.fresh = {}
    if not ps:
        return
    g, sd = _leak_probes(ps[0])
    for key, req in (("greedy", g), ("seeded", sd), ("seeded again", sd)):
        ctx.n_requests += 1
        try:
            ctx.fresh[key] = send(ctx.client, req, ctx.counters)
        except (ServerDown, ServerError) as exc:
            ctx.fresh[key] = exc
    ctx.fresh_at = ctx.n_requests


def check_leak(ctx: Ctx) -> str:
    """The same request on the fresh server = after N unrelated ones (other prompts, shapes and
    sampling parameters: logit_bias, a seed, a stop, a stream, a chat, a long prompt): the same
    ids, finish_reason and logprobs (within the logprobs check's tolerance)."""
    ref, ps = ctx.ref, ctx.plan.no_eos("leak")
    if len(ps) < 3:
        with ctx.case("leak"):
            raise Unsupported("fewer than 3 prompts")
        return ""
    if ctx.fresh is None:
        fresh_probes(ctx)
    assert ctx.fresh is not None
    g, sd = _leak_probes(ps[0])
    others = ps[1:]
    seen = set(ps[0].out[:17]) | set(ref.eos_ids)
    bias_tok = next((t for p in others for t in p.out if t not in seen), None)
    unrelated = [
        Request(others[0].text, 5, tag="leak: unrelated (logit_bias)",
                logit_bias=((bias_tok, 100.0),) if bias_tok is not None else ()),
        Request(others[1].text, 9, temperature=SEED_TEMPERATURE, seed=SEED + 99, tag="leak: unrelated (seeded)"),
        Request(" ".join(p.text for p in others), MAX_BUDGET, stream=True, tag="leak: unrelated (long, streamed)"),
        Request(others[-1].text, 9, chat=True, tag="leak: unrelated (chat)"),
    ]
    if len(others) > 2:
        found = _stop_cases(ref, others[2])
        if found:
            unrelated.append(Request(others[2].text, MAX_BUDGET, stop=(found[0][0],), top_logprobs=TOP_K,
                                     logprobs=True, tag="leak: unrelated (stop, top_logprobs)"))
    refused = 0
    for u in unrelated:  # not judged here: each is another check's business
        try:
            ctx.ask(u)
        except (Finding, CannotGrade, Unsupported):
            refused += 1
    n = ctx.n_requests - ctx.fresh_at
    for key, req in (("greedy", g), ("seeded", sd)):
        again = Request(req.prompt, req.max_tokens, logprobs=True, temperature=req.temperature, seed=req.seed,
                        tag=f"leak ({key}, after the other requests)")  # N in the detail: arms compare labels
        with ctx.case(again):
            first = ctx.fresh.get(key)
            if isinstance(first, BaseException) or first is None:
                why = f"{classify_error(first, g.path).kind}: {first}" if first is not None else "no answer"
                raise CannotGrade(f"the request on the fresh server got no usable answer ({why}): nothing to "
                                  "compare with", TRANSPORT if first is None else classify_error(first).kind)
            if key == "seeded":
                second = ctx.fresh.get("seeded again")
                if isinstance(second, BaseException) or second is None or same_reply(
                        ref, second, first, "second", "first", logprobs=False):
                    raise CannotGrade("the seeded request sent twice back to back on the fresh server came back "
                                      "different: the server's seeded sampling is not reproducible")
            r = ctx.ask(again, optional="seeded sampling" if key == "seeded" else None)
            why = same_reply(ref, r, first, "now", "on the fresh server")
            if why:
                raise Finding(again, f"the same request after {n} unrelated requests differs from its answer on "
                                     f"the fresh server: {why}")
    return (f"the same request (greedy, and seeded) on the fresh server = after {n} unrelated requests"
            + (f" ({refused} unrelated request(s) refused)" if refused else ""))


def check_liveness(ctx: Ctx) -> str:
    with ctx.case("GET /health"):
        ok, why = ctx.client.healthy()
        if not ok:
            raise ServerDown(f"server not healthy: {why}")
    with ctx.case("GET /v1/models"):
        status, text = ctx.client.get("/v1/models")
        if status != 200:
            raise Finding(None, f"GET /v1/models: HTTP {status} {' '.join(text.split())[:80]}")
    return "/health (or /v1/models) and /v1/models answer"


CHECK_FNS: dict[str, Callable[[Ctx], str]] = {
    "identity": check_identity, "stream": check_stream, "budget": check_budget,
    "finish_reason": check_finish_reason, "usage": check_usage, "eos": check_eos, "stop": check_stop,
    "logprobs": check_logprobs, "cache": check_cache, "concurrency": check_concurrency, "seeded": check_seeded,
    "tools": check_tools, "reject": check_reject, "leak": check_leak, "liveness": check_liveness,
}


def speculation_cell(arm: str, counters: SpecCounters | None, log_off: str | None = None) -> CellResult:
    """The ``speculation`` cell of an arm from the counters gathered over it (None: the server has none)
    and ``log_off``, a line of its log saying speculation is off (``setup_evidence.SPEC_OFF``)."""
    if arm == "spec" and log_off and (counters is None or counters.drafted <= 0):
        return CellResult("speculation", "not-engaged", f"speculation not engaged: the server's log says so: "
                          f"{log_off!r}" + (f" (and 0 drafted tokens per {', '.join(sorted(counters.sources))[:120]})"
                                            if counters is not None and counters.sources else ""))
    if counters is None or not counters.sources:
        if arm != "spec":
            return CellResult("speculation", "unsupported", "plain arm; the server reports no speculation counters")
        if counters is not None and counters.other_methods:
            other = ", ".join(sorted(counters.other_methods))[:200]
            return CellResult("speculation", "cannot-grade", "the server's speculation counters are for methods "
                              f"this arm does not run ({other}): whether it speculated is not known")
        return CellResult("speculation", "cannot-grade", "the server reports no speculation counters (/metrics, "
                          "/health, usage or timings extensions) and its log says nothing of it: whether it "
                          "speculated is not known (every cell of this arm is unverified)")
    src = ", ".join(sorted(counters.sources))[:160]
    if arm != "spec":
        if counters.drafted > 0:
            return CellResult("speculation", "cannot-grade", f"the plain arm speculated ({counters.drafted:g} "
                              f"drafted tokens per {src}): it is not a plain baseline")
        return CellResult("speculation", "unsupported", f"plain arm: 0 drafted tokens ({src})")
    if counters.drafted <= 0 and counters.accepted <= 0:
        return CellResult("speculation", "not-engaged", f"speculation not engaged: 0 drafted tokens over the arm "
                          f"({src})")
    return CellResult("speculation", "pass", f"{counters.drafted:g} tokens drafted, {counters.accepted:g} accepted "
                      f"over the arm ({src})")


# checks judged against plain decode of the prompt the server builds: ungradeable where it builds another
GATED = ("budget", "finish_reason", "usage", "eos", "stop", "logprobs", "cache", "concurrency", "reject")


def prompt_fidelity(ctx: Ctx) -> None:
    """Does the server complete the completions prompt it is sent (or, where its row declares a
    wrapping, the wrapped one)? Two text prompts (the warm-up prompt and its first half: no check's
    words), ``max_tokens`` 1: when the server's ``usage.prompt_tokens`` differs from the prompt's
    length for both, that is one finding, ``ctx.fidelity`` (the identity cell's), and ``ctx.gate`` the
    reason every check of ``GATED`` reads cannot-grade. No usage, an error or a server that stopped
    answering: no verdict here (the checks meet it)."""
    words = ctx.plan.warmup.split()
    texts = [ctx.plan.warmup] + ([" ".join(words[: len(words) // 2])] if len(words) > 1 else [])
    seen: list[tuple[Request, int, int]] = []
    for text in texts:
        req = Request(text, 1, tag="identity (prompt fidelity)")
        ctx.n_requests += 1
        try:
            r = send(ctx.client, req, ctx.counters)
        except (ServerDown, ServerError):
            return
        pt = (r.usage or {}).get("prompt_tokens")
        if isinstance(pt, bool) or not isinstance(pt, int):
            return
        seen.append((req, pt, len(ctx.ref.prompt_ids(req))))
    if not seen or any(pt == n for _, pt, n in seen):
        return
    req, pt, n = seen[0]
    more = "".join(f" (and {p} for one of {k})" for _, p, k in seen[1:])
    if ctx.ref.wrap:
        ctx.fidelity_as = "as its row declares it wraps it"
        short = f"usage.prompt_tokens {pt} where the declared wrapping builds {n}{more}"
        detail = (f"the server does not complete the prompt as its row declares it wraps it: {short} "
                  f"(declared: {ctx.ref.wrap}); every check judged against plain decode of the prompt cannot grade")
    else:
        short = f"usage.prompt_tokens {pt} for a completions prompt of {n} tokens{more}"
        detail = (f"the server does not complete the prompt as sent: {short}: it builds another prompt around it (a "
                  "chat template, a system message); every check judged against plain decode of the prompt as sent "
                  "cannot grade (a row may declare the wrapping: ServedEngine.completions_wrap)")
    ctx.fidelity = CaseResult(req.label, "fail", detail)
    ctx.gate = (f"the server does not complete the prompt {ctx.fidelity_as} ({short}): its output cannot be "
                "compared with plain decode of it; see identity")


def learn_dialect(client: HttpClient, text: str) -> None:
    """One 1-token request of ``text`` (a prompt no check uses) unless the server already answered
    one: what it refuses teaches its dialect (``Dialect``) before any check is judged."""
    d = dialect(client)
    if d.probed:
        return
    with contextlib.suppress(ServerDown, ServerError):
        send(client, Request(text, 1, tag="dialect"))


def run_checks(client: HttpClient, ref: Reference, checks: Sequence[str] = SERVER_CHECKS,
               log: Callable[[str], None] | None = None, plan: Plan | None = None,
               counters: SpecCounters | None = None, require_hits: bool = True, *, arm: str = "plain",
               baseline: dict[str, Any] | None = None, reject: bool = False,
               server_log: Callable[[], str] | None = None) -> dict[str, CellResult]:
    """Every check in order (``speculation`` is the grader's: it needs the whole arm);
    once the server stops answering, the rest are ``cannot-grade`` with that reason.

    ``arm``: ``plain`` or ``spec``; ``baseline``: shared by the arms of one grading (the plain
    arm's tool calls, compared on the spec arm); ``reject``: this server's drafts are all rejected.
    With ``leak`` among the checks, its probes are the server's first requests after the one that
    learns its dialect (:func:`learn_dialect`); a chat-only server is graded through chat, against
    its chat prompt. ``server_log``: what the server's log gained since the last call (the evidence
    of an error returned as success)."""
    plan = plan if plan is not None else make_plan(ref)
    counters = counters if counters is not None else SpecCounters()
    out: dict[str, CellResult] = {}
    down: str | None = None
    ok, why = client.healthy()
    if not ok:
        down = f"the server was not answering before the first check: {why}"
    else:
        learn_dialect(client, plan.warmup)
        if dialect(client).chat_only:
            ref = ref.through_chat()
            plan = make_plan(ref, checks)
    ctx = Ctx(client, ref, plan, counters, require_hits, arm=arm, baseline=baseline, reject=reject,
              server_log=server_log)
    if "leak" in checks and down is None:
        fresh_probes(ctx)
    if down is None and any(c in checks for c in ("identity", *GATED)) and not any(
            isinstance(v, ServerDown) for v in (ctx.fresh or {}).values()):
        prompt_fidelity(ctx)
    for name in checks:
        if name not in CHECK_FNS:
            continue
        if down is not None:
            out[name] = CellResult(name, "cannot-grade", f"not graded: {down}")
            continue
        if ctx.gate is not None and name in GATED:
            out[name] = CellResult(name, "cannot-grade", ctx.gate)
            if log is not None:
                log(f"{name}: cannot-grade - {ctx.gate}")
            continue
        t0 = time.monotonic()
        ctx.cases = []
        try:
            summary = CHECK_FNS[name](ctx)
            out[name] = cell_from_cases(name, ctx.cases, summary)
        except ServerDown as d:
            ctx.cases.append(CaseResult(getattr(d, "label", name), "fail", str(d), TRANSPORT))
            out[name] = cell_from_cases(name, ctx.cases, "")
            _, health = client.healthy()
            down = f"the server stopped answering in check {name!r} ({health})"
        if log is not None:
            r = out[name]
            log(f"{name}: {r.status} ({time.monotonic() - t0:.1f}s)" + ("" if r.status == "pass" else f" - {r.detail}")
                + (f" [{r.case}]" if r.case else ""))
    return out
