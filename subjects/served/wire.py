"""The wire format of an OpenAI-compatible server: requests, replies, the server's dialect, ``send``.

Shapes of mlx-lm 0.32.2 ``mlx_lm/server.py`` (``APIHandler.do_POST``, ``generate_response``,
``handle_completion``): ``/v1/completions`` (a text or token-id prompt) and ``/v1/chat/completions``,
streamed as Server-Sent Events ending ``data: [DONE]``; logprobs as ``choices[0].logprobs.content``
(the legacy completions shape read too). Every request goes through ``subjects/http_client.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from subjects.http_client import HttpClient, ServerError, get_json, model_ids
from subjects.served.counters import SpecCounters


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
    return next((i for i in model_ids(get_json(client, "/v1/models")) if isinstance(i, str) and i), None)


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
            if _top_read_as_one(sent, reply, d):
                return _legacy_retry(client, sent, reply, d, counters)
            return reply
        except ServerError as exc:
            d.probed = True
            text = str(exc)
            # a 404 to a token-id prompt is no evidence of a missing route: mlx_lm.server answers every request
            # its generator refuses (a token-id prompt: "text input must be of type `str`") with HTTP 404; the
            # caller falls back to text (ctx.ask_ids) and a text prompt's 404 teaches the route is missing
            if no_route(exc.status) and not sent.chat and not sent.by_ids and not d.chat_only:
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


def _top_read_as_one(sent: Request, reply: Reply, d: Dialect) -> bool:
    """A completions answer with exactly one top entry per token where ``top_logprobs`` > 1 was asked: a
    server taking OpenAI's legacy integer ``logprobs`` (vmlx 1.6.81's CompletionRequest: ``logprobs: int``,
    no ``top_logprobs``) reads ``logprobs: true`` as 1 and ignores ``top_logprobs``."""
    return (not sent.chat and not d.legacy_logprobs and sent.top_logprobs > 1 and bool(reply.logprobs)
            and all(len(t.top) == 1 for t in reply.logprobs or ()))


def _legacy_retry(client: HttpClient, sent: Request, reply: Reply, d: Dialect,
                  counters: SpecCounters | None) -> Reply:
    """``sent`` again with the legacy integer ``logprobs``; kept (and learnt, one line) only where that answer
    has more top entries than the first, else the first answer stands (a server that gives one entry either
    way is judged on it)."""
    d.legacy_logprobs = True
    try:
        again = _send(client, sent, d, counters)
    except ServerError:
        again = None
    if again is not None and again.logprobs and any(len(t.top) > 1 for t in again.logprobs):
        d.notes.append(f"legacy completions logprobs (an integer `logprobs`): `logprobs: true` with top_logprobs="
                       f"{sent.top_logprobs} came back with 1 top entry per token (read as `logprobs: 1`)")
        return again
    d.legacy_logprobs = False
    return reply


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
