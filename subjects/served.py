"""Black-box checks of an OpenAI-compatible server (a served engine) over HTTP.

The request and response shapes are those of mlx-lm 0.32.2 ``mlx_lm/server.py``
(``APIHandler.do_POST``, ``generate_response``, ``handle_completion``,
``completion_usage_response``, ``handle_health_check``): ``POST /v1/completions``
and ``/v1/chat/completions`` (``stream`` as Server-Sent Events ``data: {json}``
ending ``data: [DONE]``; ``stream_options.include_usage``), ``max_tokens``,
``stop``, ``logprobs`` / ``top_logprobs`` (``choices[0].logprobs.content[i]`` =
``{id, token, logprob, top_logprobs: [...]}``; the legacy completions shape
``{tokens, token_logprobs, top_logprobs}`` is read too), ``usage``
(``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
``prompt_tokens_details.cached_tokens``), ``finish_reason``; ``GET /health`` and
``/v1/models``.

A server exposes no rounds, so it is judged against a :class:`Reference`
computed in process by the grader (``specparity/served.py``: plain greedy decode
of the same weights, on the prompt the server builds — the tokenizer's encoding
for completions, its chat template, or mlx-lm's ``convert_chat`` when it has
none). Output ids are compared when the server returns them (non-streaming
requests ask for ``logprobs``); text otherwise (``decode`` of the reference ids;
runs of U+FFFD collapsed, as a byte-level tokenizer's split characters decode
differently token by token). The checks (``SERVER_CHECKS``), each naming the
request of its first failure:

- ``identity``: greedy output = plain decode, completions and chat, non-streaming
  and streamed (chunks reassembled);
- ``budget``: ``max_tokens`` in 1, 2, 5, 9, 17, 33 (ending inside a speculative
  round): exactly that output, finish ``length``;
- ``finish_reason``: ``length`` at the budget, ``stop`` on EOS and on a stop string;
- ``usage``: ``prompt_tokens`` = the built prompt's length, ``completion_tokens``
  = tokens generated (+ at most the one EOS), ``total_tokens`` the sum, the same
  in the streamed usage chunk; a request whose output re-encodes to another
  token count is included when one exists;
- ``eos``: the EOS never appears in the text, generation ends there;
- ``stop``: stop strings (a whole token's text, and one that falls inside a
  token): the text ends right before the first occurrence, finish ``stop``;
- ``logprobs``: the emitted token's logprob and the top_logprobs (sorted
  descending, the greedy token first) agree with the reference (``LOGPROB_TOL``);
- ``cache``: a repeated identical request, a shared-prefix follow-up and an exact
  continuation (prompt + the server's own output) equal cold plain decode;
- ``concurrency``: a few requests sent at once each equal plain decode (a
  request's tokens must not depend on its batch-mates);
- ``liveness``: ``/health`` answers 200 before and after, ``/v1/models`` answers.

Every request has a timeout: a server that dies or stops answering fails the
check in progress (``ServerDown``) and every later check says so without
waiting again.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from subjects.checks import CheckResult, first_divergence

SERVER_CHECKS = ("identity", "budget", "finish_reason", "usage", "eos", "stop", "logprobs", "cache",
                 "concurrency", "liveness")
BUDGETS = (1, 2, 5, 9, 17, 33)
MAX_BUDGET = max(BUDGETS)
LOGPROB_TOL = 2e-3
TOP_K = 5
CONCURRENT = 4


API_KEY = "specparity-local"  # sent as a bearer token (override: $SPECPARITY_SERVER_API_KEY)


class ServerDown(RuntimeError):
    """The server refused, reset or did not answer within the timeout."""


class ServerError(RuntimeError):
    """The server answered with an error status or a body that is not the API's shape."""


# ------------------------------------------------------------------ client


class Client:
    """A minimal HTTP client for an OpenAI-compatible server (stdlib ``http.client``).

    ``timeout`` bounds every socket operation; a streamed response is also
    bounded as a whole (``stream_deadline``).
    """

    def __init__(self, url: str, timeout: float = 60.0, stream_deadline: float = 300.0) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"bad server URL {url!r}; expected http://HOST:PORT")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"bad server URL {url!r}: {exc}") from exc
        self.url = f"{parts.scheme}://{parts.hostname}:{port or (443 if parts.scheme == 'https' else 80)}"
        self.host, self.port, self.https = parts.hostname, port or (443 if parts.scheme == "https" else 80), \
            parts.scheme == "https"
        self.prefix = parts.path.rstrip("/")
        self.timeout, self.stream_deadline = timeout, stream_deadline
        # /v1/completions logprobs: a bool (mlx-lm) or the OpenAI legacy int; learnt from a 400
        self.legacy_logprobs = False
        self.api_key = os.environ.get("SPECPARITY_SERVER_API_KEY", API_KEY)

    def _conn(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, bytes]:
        conn = self._conn()
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            headers["Authorization"] = f"Bearer {self.api_key}"
            conn.request(method, self.prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ServerDown(_why(exc, self.timeout)) from exc
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, str]:
        status, raw = self._request("GET", path, None)
        return status, raw.decode("utf-8", "replace")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, raw = self._request("POST", path, body)
        if status != 200:
            raise ServerError(f"HTTP {status}: {raw[:200].decode('utf-8', 'replace')}")
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise ServerError(f"response is not JSON: {raw[:120]!r}") from exc
        if not isinstance(doc, dict):
            raise ServerError(f"response is not a JSON object: {raw[:120]!r}")
        return doc

    def post_stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The ``data:`` events of a streamed response, up to ``[DONE]``."""
        conn = self._conn()
        t0 = time.monotonic()
        events: list[dict[str, Any]] = []
        try:
            conn.request("POST", self.prefix + path, body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise ServerError(f"HTTP {resp.status}: {resp.read()[:200].decode('utf-8', 'replace')}")
            while True:
                if time.monotonic() - t0 > self.stream_deadline:
                    raise ServerDown(f"stream still open after {self.stream_deadline:g} s")
                line = resp.readline()
                if not line:
                    raise ServerError("stream ended without 'data: [DONE]'")
                text = line.decode("utf-8", "replace").strip()
                if not text.startswith("data:"):
                    continue  # blank separators and ': keepalive' comments
                payload = text[5:].strip()
                if payload == "[DONE]":
                    return events
                try:
                    events.append(json.loads(payload))
                except ValueError as exc:
                    raise ServerError(f"stream event is not JSON: {payload[:120]!r}") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise ServerDown(_why(exc, self.timeout)) from exc
        finally:
            conn.close()

    def healthy(self) -> tuple[bool, str]:
        """``/health`` answers 200 (a server without that route: ``/v1/models`` answers 200)."""
        try:
            status, text = self.get("/health")
            if status == 404:
                status2, text2 = self.get("/v1/models")
                return status2 == 200, f"no /health (404); /v1/models: HTTP {status2} {text2[:60]}"
        except ServerDown as exc:
            return False, str(exc)
        return status == 200, f"/health: HTTP {status} {text[:80]}"


def _why(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    return f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------ requests and replies


@dataclass(frozen=True)
class Request:
    """One request to the server; ``label`` names it in every finding."""

    prompt: str
    max_tokens: int
    chat: bool = False
    stream: bool = False
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    tag: str = ""

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, legacy_logprobs: bool = False) -> dict[str, Any]:
        b: dict[str, Any] = {"model": "default_model", "max_tokens": self.max_tokens, "temperature": 0.0,
                             "stream": self.stream}
        if self.chat:
            b["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            b["prompt"] = self.prompt
        if self.stop:
            b["stop"] = list(self.stop)
        if legacy_logprobs and not self.chat and (self.logprobs or self.top_logprobs):
            b["logprobs"] = max(self.top_logprobs, 1)  # the OpenAI legacy completions field: an int
            return b
        if self.logprobs:
            b["logprobs"] = True
        if self.top_logprobs:
            b["top_logprobs"] = self.top_logprobs
        if self.stream:
            b["stream_options"] = {"include_usage": True}
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
        short = self.prompt if len(self.prompt) <= 40 else self.prompt[:37] + "..."
        tag = f"{self.tag}: " if self.tag else ""
        return f"{tag}POST {self.path} {short!r} " + " ".join(opts)


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


def _parse_logprobs(lp: Any) -> list[TokenLogprob] | None:
    if not isinstance(lp, dict):
        return None
    out: list[TokenLogprob] = []
    if isinstance(lp.get("content"), list):  # chat shape (mlx-lm uses it for both endpoints)
        for item in lp["content"]:
            if not item:
                continue
            top = [(t.get("id"), t.get("token"), float(t["logprob"])) for t in item.get("top_logprobs") or []]
            out.append(TokenLogprob(item.get("id"), item.get("token"), float(item["logprob"]), top))
        return out
    if isinstance(lp.get("token_logprobs"), list):  # legacy completions shape
        toks = lp.get("tokens") or [None] * len(lp["token_logprobs"])
        tops = lp.get("top_logprobs") or [None] * len(lp["token_logprobs"])
        for tok, g, top in zip(toks, lp["token_logprobs"], tops, strict=False):
            entries = [(None, k, float(v)) for k, v in (top or {}).items()]
            out.append(TokenLogprob(None, tok, float(g), entries))
        return out
    return None


def send(client: Client, req: Request) -> Reply:
    """Send ``req``; the reply reassembled (streamed chunks concatenated)."""
    try:
        return _send(client, req)
    except ServerError as exc:
        if req.chat or client.legacy_logprobs or not req.logprobs or "logprobs" not in str(exc):
            raise
        client.legacy_logprobs = True  # the server wants OpenAI's legacy `logprobs: N` on completions
        return _send(client, req)


def _send(client: Client, req: Request) -> Reply:
    if not req.stream:
        doc = client.post(req.path, req.body(client.legacy_logprobs))
        ch = _choice(doc)
        text = (ch.get("message") or {}).get("content") if req.chat else ch.get("text")
        return Reply(text or "", ch.get("finish_reason"), doc.get("usage"), _parse_logprobs(ch.get("logprobs")))
    events = client.post_stream(req.path, req.body(client.legacy_logprobs))
    text, finish, usage = [], None, None
    for ev in events:
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content") if req.chat else ch.get("text")
            if piece:
                text.append(piece)
            if ch.get("finish_reason") is not None:
                finish = ch["finish_reason"]
    return Reply("".join(text), finish, usage, None, chunks=len(events))


# ------------------------------------------------------------------ the reference


@dataclass
class Reference:
    """Plain greedy decode of the served weights, in process (built by the grader).

    ``encode`` / ``chat_prompt``: the prompt ids the server builds for a completions /
    chat request; ``greedy(ids, n)``: (output ids without EOS, ended on EOS);
    ``logprobs(ids, out, k)``: per output position the emitted token's logprob and the
    top-k ``(id, logprob)`` sorted descending; ``prompts``: prompt texts to use.
    """

    encode: Callable[[str], list[int]]
    chat_prompt: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    greedy: Callable[[tuple[int, ...], int], tuple[list[int], bool]]
    logprobs: Callable[[tuple[int, ...], tuple[int, ...], int], list[tuple[float, list[tuple[int, float]]]]]
    eos_ids: tuple[int, ...]
    prompts: list[str]
    eos_text: tuple[str, ...] = ()

    def prompt_ids(self, req: Request) -> list[int]:
        return list(self.chat_prompt(req.prompt) if req.chat else self.encode(req.prompt))

    def expect(self, req: Request) -> tuple[list[int], bool]:
        return self.greedy(tuple(self.prompt_ids(req)), req.max_tokens)


def norm_text(s: str) -> str:
    return re.sub("\ufffd+", "\ufffd", s)


def token_at(ref: Reference, ids: Sequence[int], char: int) -> int:
    """The index of the reference token whose text covers character ``char``."""
    for k in range(len(ids)):
        if len(norm_text(ref.decode(ids[: k + 1]))) > char:
            return k
    return len(ids)


def compare(ref: Reference, req: Request, reply: Reply, ids: list[int], *, exact: bool,
            text: str | None = None) -> str | None:
    """Why ``reply`` is not the reference output ``ids`` (None when it is).

    ``exact``: the whole output must match; otherwise only the common prefix is
    judged (a length difference belongs to the budget/EOS checks).
    """
    got_ids = reply.ids
    if got_ids and got_ids[-1] in ref.eos_ids:
        got_ids = got_ids[:-1]  # mlx-lm lists the EOS it stopped on (its text is judged by the eos check)
    if got_ids is not None and text is None:
        i = first_divergence(got_ids, ids) if exact else first_divergence(got_ids[: len(ids)], ids[: len(got_ids)])
        if i is not None:
            a = got_ids[i] if i < len(got_ids) else "<end>"
            b = ids[i] if i < len(ids) else "<end>"
            return (f"output token {i}: server id {a} vs plain decode {b} (server {len(got_ids)} tokens, "
                    f"plain {len(ids)})")
    want = norm_text(ref.decode(ids) if text is None else text)
    got = norm_text(reply.text)
    if not exact:
        n = min(len(want), len(got))
        want, got = want[:n], got[:n]
    if got == want:
        return None
    i = next((k for k, (x, y) in enumerate(zip(got, want, strict=False)) if x != y), min(len(got), len(want)))
    tok = token_at(ref, ids, i)
    return (f"text differs at character {i} (plain token {tok}): server {got[max(0, i - 12): i + 12]!r} vs "
            f"plain {want[max(0, i - 12): i + 12]!r} (server {len(got)} chars, plain {len(want)})")


# ------------------------------------------------------------------ checks


class Finding(Exception):
    def __init__(self, req: Request, msg: str) -> None:
        super().__init__(msg)
        self.req = req


def _ask(client: Client, req: Request) -> Reply:
    try:
        return send(client, req)
    except ServerDown as exc:
        raise ServerDown(f"server stopped answering: {req.label}: {exc}") from exc
    except ServerError as exc:
        raise Finding(req, f"bad response: {exc}") from exc


@dataclass
class Plan:
    """The prompts each check uses, chosen once from the reference (``make_plan``)."""

    main: list[str]
    no_eos: str  # greedy runs to MAX_BUDGET without EOS
    eos: str | None  # greedy ends on EOS within MAX_BUDGET
    reencode: str | None  # output whose text re-encodes to another token count
    fresh: list[str]  # prompts not sent elsewhere (cache check: cold first)


def make_plan(ref: Reference) -> Plan:
    """Pick the prompts from ``ref.prompts`` (the reference decides which ones reach EOS)."""
    ps = list(ref.prompts)
    no_eos = eos = reenc = None
    for p in ps:
        out, hit = ref.greedy(tuple(ref.encode(p)), MAX_BUDGET)
        if hit and eos is None and 2 <= len(out):
            eos = p
        if not hit and no_eos is None:
            no_eos = p
        if not hit and reenc is None and len(ref.encode(ref.decode(out))) != len(ref.encode("")) + len(out):
            reenc = p
    main = ps[:2]
    used = {*main, no_eos, eos, reenc}
    fresh = [p for p in ps if p not in used]
    return Plan(main=main, no_eos=no_eos or ps[0], eos=eos, reencode=reenc, fresh=fresh)


def _no_template(exc: Finding) -> bool:
    return "chat template" in str(exc) or "chat_template" in str(exc)


def _ask_or_no_template(client: Client, req: Request) -> Reply | None:
    """``_ask``, or None when a chat request is refused for a model without a chat template."""
    try:
        return _ask(client, req)
    except Finding as exc:
        if req.chat and _no_template(exc):
            return None
        raise


def check_identity(client: Client, ref: Reference, plan: Plan) -> str:
    n, chat_refused = 0, ""
    for p in plan.main:
        for chat in (False, True):
            for stream in (False, True):
                if chat and chat_refused:
                    continue
                req = Request(p, 24, chat=chat, stream=stream, logprobs=not stream, tag="identity")
                ids, _ = ref.expect(req)
                try:
                    reply = _ask(client, req)
                except Finding as exc:
                    if not (chat and _no_template(exc)):
                        raise
                    chat_refused = f"; chat not graded: refused for a model without a chat template ({exc})"
                    continue
                why = compare(ref, req, reply, ids, exact=False)
                n += 1
                if why:
                    raise Finding(req, why)
    return f"{n} requests (completions + chat, streamed + not) = plain greedy decode{chat_refused[:200]}"


def check_budget(client: Client, ref: Reference, plan: Plan) -> str:
    n = 0
    for m in BUDGETS:
        for stream in (False, True):
            req = Request(plan.no_eos, m, stream=stream, logprobs=not stream, tag="budget")
            ids, hit = ref.expect(req)
            r = _ask(client, req)
            n += 1
            why = compare(ref, req, r, ids, exact=True)
            if why:
                raise Finding(req, f"max_tokens={m}: {why}")
            if r.finish_reason != "length":
                raise Finding(req, f"max_tokens={m} reached but finish_reason is {r.finish_reason!r}, not 'length'")
    return f"{n} requests at max_tokens {list(BUDGETS)}: exactly the budget, finish 'length'"


def _stop_cases(ref: Reference, prompt: str) -> list[tuple[str, str, int]]:
    """(stop string, kind, index of the token that completes it) from the reference output."""
    ids, _ = ref.greedy(tuple(ref.encode(prompt)), MAX_BUDGET)
    text = ref.decode(ids)
    out: list[tuple[str, str, int]] = []
    for j in range(3, len(ids)):
        piece = ref.decode(ids[j : j + 1]).strip()
        before = ref.decode(ids[:j])
        if len(piece) >= 1 and piece not in before and "\ufffd" not in piece and not out:
            out.append((piece, "a whole token", j))
    for j in range(3, len(ids)):
        piece = ref.decode(ids[j : j + 1]).strip()
        if len(piece) >= 2 and "\ufffd" not in piece:
            inner = piece[1:] if len(piece) == 2 else piece[1:-1]
            first = text.find(inner)
            if first >= 0 and first > len(ref.decode(ids[:3])):
                k = token_at(ref, ids, first + len(inner) - 1)
                if not ref.decode(ids[k : k + 1]).strip() == inner:
                    out.append((inner, "inside a token", k))
                    break
    return out


def check_stop(client: Client, ref: Reference, plan: Plan) -> str:
    cases = _stop_cases(ref, plan.no_eos)
    if not cases:
        raise Unsupported("no stop string found in the reference output")
    n = 0
    for s, kind, _ in cases:
        for stream in (False, True):
            req = Request(plan.no_eos, MAX_BUDGET, stream=stream, stop=(s,), tag=f"stop ({kind})")
            ids, _ = ref.expect(req)
            full = ref.decode(ids)
            want = full[: full.find(s)]
            r = _ask(client, req)
            n += 1
            if norm_text(r.text) != norm_text(want):
                extra = " (the stop string is in the text)" if s in r.text else ""
                raise Finding(req, f"stop {s!r} ({kind}): text {_tail(r.text)} vs expected {_tail(want)}{extra}")
            if r.finish_reason != "stop":
                raise Finding(req, f"stop {s!r} ({kind}) matched but finish_reason is {r.finish_reason!r}")
    return f"{n} requests: text ends before the stop string (whole token and inside a token), finish 'stop'"


def _tail(s: str, n: int = 24) -> str:
    return repr(s if len(s) <= n else "…" + s[-n:]) + f" ({len(s)} chars)"


class Unsupported(Exception):
    pass


def check_eos(client: Client, ref: Reference, plan: Plan) -> str:
    if plan.eos is None:
        raise Unsupported(f"no prompt reaches EOS within {MAX_BUDGET} tokens of plain decode")
    n = 0
    for stream in (False, True):
        req = Request(plan.eos, MAX_BUDGET, stream=stream, tag="eos")
        ids, hit = ref.expect(req)
        r = _ask(client, req)
        n += 1
        for et in ref.eos_text:
            if et and et in r.text:
                raise Finding(req, f"EOS text {et!r} in the output at character {r.text.index(et)}: "
                              f"{_tail(r.text)}")
        why = compare(ref, req, r, ids, exact=True, text=ref.decode(ids))
        if why:
            raise Finding(req, f"plain decode ends on EOS after {len(ids)} tokens: {why}")
    return f"{n} requests ending on EOS: never in the text, nothing after it"


def check_finish_reason(client: Client, ref: Reference, plan: Plan) -> str:
    reqs: list[tuple[Request, str]] = []
    for stream in (False, True):
        reqs.append((Request(plan.no_eos, 5, stream=stream, tag="finish_reason"), "length"))
        if plan.eos is not None:
            reqs.append((Request(plan.eos, MAX_BUDGET, stream=stream, tag="finish_reason (EOS)"), "stop"))
    for req, want in reqs:
        r = _ask(client, req)
        if r.finish_reason != want:
            raise Finding(req, f"finish_reason {r.finish_reason!r}, expected {want!r}")
    return f"{len(reqs)} requests: 'length' at the budget" + (", 'stop' on EOS" if plan.eos else "")


def check_usage(client: Client, ref: Reference, plan: Plan) -> str:
    reqs = [Request(plan.no_eos, 9, tag="usage"), Request(plan.no_eos, 9, stream=True, tag="usage"),
            Request(plan.main[0], 9, chat=True, tag="usage")]
    if plan.eos:
        reqs.append(Request(plan.eos, MAX_BUDGET, tag="usage (EOS)"))
    if plan.reencode:
        reqs.append(Request(plan.reencode, 17, tag="usage (output re-encodes to another count)"))
    stops = _stop_cases(ref, plan.no_eos)
    for s, kind, _ in stops[:1]:
        reqs.append(Request(plan.no_eos, MAX_BUDGET, stop=(s,), tag=f"usage (stop {kind})"))
    for req in reqs:
        ids, hit = ref.expect(req)
        got = _ask_or_no_template(client, req)
        if got is None:
            continue
        r = got
        u = r.usage
        if not isinstance(u, dict):
            raise Finding(req, f"no usage in the response (got {u!r})")
        pt, ct, tt = u.get("prompt_tokens"), u.get("completion_tokens"), u.get("total_tokens")
        n_prompt = len(ref.prompt_ids(req))
        if pt != n_prompt:
            raise Finding(req, f"usage.prompt_tokens {pt}, the prompt the server builds has {n_prompt} tokens")
        if req.stop:
            full = ref.decode(ids)
            if norm_text(r.text) != norm_text(full[: full.find(req.stop[0])]):
                continue  # the stop string was not honoured: the stop check reports it
            k = token_at(ref, ids, full.find(req.stop[0]) + len(req.stop[0]) - 1)
            allowed: tuple[int, ...] = (k + 1,)
        elif hit:
            allowed = (len(ids), len(ids) + 1)
        else:
            allowed = (len(ids),)
        if ct not in allowed:
            raise Finding(req, f"usage.completion_tokens {ct}, generated {allowed[-1]} token(s)"
                          + (" (+ at most the EOS)" if hit and not req.stop else ""))
        if tt != (pt or 0) + (ct or 0):
            raise Finding(req, f"usage.total_tokens {tt} != prompt_tokens {pt} + completion_tokens {ct}")
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None and not 0 <= cached <= n_prompt:
            raise Finding(req, f"usage cached_tokens {cached} outside 0..prompt_tokens {n_prompt}")
    return f"{len(reqs)} requests: prompt, completion and total token counts exact"


def check_logprobs(client: Client, ref: Reference, plan: Plan) -> str:
    n = 0
    for chat in (False, True):
        req = Request(plan.no_eos, 9, chat=chat, logprobs=True, top_logprobs=TOP_K, tag="logprobs")
        pids = tuple(ref.prompt_ids(req))
        ids, _ = ref.expect(req)
        got = _ask_or_no_template(client, req)
        if got is None:
            continue
        r = got
        n += 1
        if not r.logprobs:
            raise Finding(req, "no logprobs in the response")
        if len(r.logprobs) != len(ids):
            raise Finding(req, f"{len(r.logprobs)} logprob entries for {len(ids)} output tokens")
        want = ref.logprobs(pids, tuple(ids), TOP_K)
        for i, (got, (lp, top)) in enumerate(zip(r.logprobs, want, strict=True)):
            if got.id is not None and got.id != ids[i]:
                raise Finding(req, f"token {i}: logprobs entry names id {got.id}, the emitted token is {ids[i]}")
            if abs(got.logprob - lp) > LOGPROB_TOL:
                raise Finding(req, f"token {i} (id {ids[i]}): logprob {got.logprob:.5f} vs plain {lp:.5f}")
            vals = [g for _, _, g in got.top]
            if len(vals) != TOP_K:
                raise Finding(req, f"token {i}: {len(vals)} top_logprobs, asked for {TOP_K}")
            if vals != sorted(vals, reverse=True):
                raise Finding(req, f"token {i}: top_logprobs not sorted by logprob: "
                              f"{[(t[0], round(t[2], 4)) for t in got.top]}")
            if got.top[0][0] is not None and got.top[0][0] != ids[i] and vals[0] - lp > LOGPROB_TOL:
                raise Finding(req, f"token {i}: greedy token {ids[i]} is not first in top_logprobs "
                              f"({[t[0] for t in got.top]})")
            for k, ((_, _, g), (tid, w)) in enumerate(zip(sorted(got.top, key=lambda t: -t[2]), top, strict=False)):
                if abs(g - w) > LOGPROB_TOL:
                    raise Finding(req, f"token {i}: top_logprobs[{k}] {g:.5f} vs plain {w:.5f} (id {tid})")
    return f"{n} requests: emitted-token logprobs and sorted top_logprobs = plain decode (tol {LOGPROB_TOL})"


def check_cache(client: Client, ref: Reference, plan: Plan) -> str:
    if not plan.fresh:
        raise Unsupported("no unused prompt for a cold request")
    p = plan.fresh[0]
    cold = Request(p, 17, logprobs=True, tag="cache: cold")
    ids, _ = ref.expect(cold)
    r1 = _ask(client, cold)
    why = compare(ref, cold, r1, ids, exact=True)
    if why:
        raise Finding(cold, f"first (cold) request: {why}")
    reqs = [Request(p, 17, logprobs=True, tag="cache: repeated identical request")]
    ext = plan.fresh[1] if len(plan.fresh) > 1 else plan.main[0]
    reqs.append(Request(p + " " + ext, 17, logprobs=True, tag="cache: shared-prefix follow-up"))
    reqs.append(Request(p + r1.text, 17, logprobs=True, tag="cache: exact continuation"))
    for req in reqs:
        ids, _ = ref.expect(req)
        why = compare(ref, req, _ask(client, req), ids, exact=True)
        if why:
            raise Finding(req, f"warm != cold plain decode: {why}")
    return f"{len(reqs) + 1} requests: repeated, shared-prefix and continuation requests = cold plain decode"


def check_concurrency(client: Client, ref: Reference, plan: Plan) -> str:
    prompts = (plan.main + plan.fresh + [plan.no_eos])[:CONCURRENT]
    reqs = [Request(p, 17, logprobs=True, tag=f"concurrent {i + 1}/{len(prompts)}") for i, p in enumerate(prompts)]
    results: dict[int, Reply | BaseException] = {}

    def go(i: int, req: Request) -> None:
        try:
            results[i] = send(client, req)
        except BaseException as exc:  # noqa: BLE001 - reported below with its request
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i, r), daemon=True) for i, r in enumerate(reqs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(client.timeout * 2 + 5)
    for i, req in enumerate(reqs):
        res = results.get(i)
        if res is None:
            raise ServerDown(f"server stopped answering: {req.label}: no answer within {client.timeout * 2 + 5:g} s")
        if isinstance(res, ServerDown):
            raise ServerDown(f"server stopped answering: {req.label}: {res}")
        if isinstance(res, BaseException):
            raise Finding(req, f"bad response: {res}")
        ids, _ = ref.expect(req)
        why = compare(ref, req, res, ids, exact=True)
        if why:
            raise Finding(req, f"sent with {len(reqs) - 1} others at once: {why}")
    return f"{len(reqs)} requests sent at once: each = plain decode"


def check_liveness(client: Client, ref: Reference, plan: Plan) -> str:
    ok, why = client.healthy()
    if not ok:
        raise ServerDown(f"server not healthy: {why}")
    status, text = client.get("/v1/models")
    if why.startswith("no /health"):
        return "no /health route (404); /v1/models answered"
    if status != 200:
        raise Finding(Request("", 0, tag="GET /v1/models"), f"GET /v1/models: HTTP {status} {text[:80]}")
    return "/health 200 and /v1/models answered"


CHECK_FNS: dict[str, Callable[[Client, Reference, Plan], str]] = {
    "identity": check_identity, "budget": check_budget, "finish_reason": check_finish_reason,
    "usage": check_usage, "eos": check_eos, "stop": check_stop, "logprobs": check_logprobs,
    "cache": check_cache, "concurrency": check_concurrency, "liveness": check_liveness,
}


def run_checks(client: Client, ref: Reference, checks: Sequence[str] = SERVER_CHECKS,
               log: Callable[[str], None] | None = None) -> dict[str, CheckResult]:
    """Every check in order; once the server stops answering, the rest fail at once with that reason."""
    plan = make_plan(ref)
    out: dict[str, CheckResult] = {}
    down: str | None = None
    ok, why = client.healthy()
    if not ok:
        down = f"server not answering before the first check: {why}"
    for name in checks:
        if down is not None:
            out[name] = CheckResult(name, "fail", f"not run: {down}")
            continue
        t0 = time.monotonic()
        try:
            out[name] = CheckResult(name, "pass", CHECK_FNS[name](client, ref, plan))
        except Finding as f:
            out[name] = CheckResult(name, "fail", str(f), case=f.req.label)
        except Unsupported as u:
            out[name] = CheckResult(name, "unsupported", str(u))
        except ServerDown as d:
            out[name] = CheckResult(name, "fail", str(d))
            alive, health = client.healthy()
            down = f"the server stopped answering in check {name!r} ({health})"
        if log is not None:
            r = out[name]
            log(f"{name}: {r.status} ({time.monotonic() - t0:.1f}s)" + ("" if r.status == "pass" else f" - {r.detail}")
                + (f" [{r.case}]" if r.case else ""))
    return out
