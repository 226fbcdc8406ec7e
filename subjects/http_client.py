"""The one HTTP client every server-facing check uses (``grade --server`` / ``--serve``).

Every request to an OpenAI-compatible server made by ``subjects/served/`` and
``specparity/grading/http_servers.py`` goes through :class:`HttpClient`; nothing else in the
harness opens a connection to a server. What it promises:

- **A deadline per request**, not per socket read: the whole exchange (connect,
  headers, body, the last byte of a stream) must finish within ``deadline``
  seconds (a streamed response within ``stream_deadline``). A watchdog shuts the
  socket down when the deadline passes, so a server that trickles its headers or
  body a byte at a time, or streams events forever, is cut off on time.
- **Caps** on what it reads: the body (``max_body`` bytes; a larger
  ``Content-Length`` is refused before reading), one line of a stream
  (``max_line`` bytes: a server that never ends a line), and the number of
  events of one stream (``max_events``).
- **No credentials in URLs**: ``http://user:pass@host`` is refused as a usage
  error whose message never repeats them (:func:`parse_url`); the key a server
  wants goes in ``$SPECPARITY_SERVER_API_KEY`` (sent as a bearer token, never
  written). :func:`redact` scrubs any URL userinfo or secret-looking query value
  from text that is printed or written (results, scoreboards, reproduce commands).
- **A stated host policy**: loopback only (``127.0.0.0/8``, ``::1``,
  ``localhost``) unless the caller passes ``allow_remote=True`` (the
  ``--allow-remote`` flag); plain ``http``/``https`` only; the port written out
  (a missing port or port 0 is refused, never silently port 80).

Failures are one-line exceptions: :class:`ServerDown` (refused, reset, or no
complete answer within the deadline: the server is not answering) and
:class:`ServerError` (an answer that is not the API's: an error status, a body
that is not JSON, over a cap, a stream that ends without ``data: [DONE]``).

The response shapes read are those of mlx-lm 0.32.2 ``mlx_lm/server.py``
(``APIHandler.do_POST`` / ``handle_stream``: Server-Sent Events ``data: {json}``
lines ending ``data: [DONE]``). Stdlib only (``http.client``), no retries.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import re
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from traces import env

__all__ = ["HttpClient", "Limits", "Secrets", "ServerDown", "ServerError", "UsageError", "get_json", "hidden_args", "parse_url",
           "redact"]

API_KEY = "specparity-local"  # the default bearer token (override: $SPECPARITY_SERVER_API_KEY)


class UsageError(ValueError):
    """A server URL the client refuses (one line, exit 2; never repeats credentials)."""


class ServerDown(RuntimeError):
    """The server refused, reset, or gave no complete answer within the deadline.

    ``kind``: ``"timeout"`` (no complete answer in time), ``"refused"`` or ``"closed"`` (reset or
    closed without an answer: the caller may ask ``/health`` whether the server is still there)."""

    def __init__(self, msg: str, kind: str = "closed") -> None:
        super().__init__(msg)
        self.kind = kind


class ServerError(RuntimeError):
    """The server answered, but not with the API's shape (``status``: the HTTP status, when one came)."""

    def __init__(self, msg: str, status: int | None = None) -> None:
        super().__init__(msg)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """Bounds of one request (seconds, bytes, events)."""

    deadline: float = 60.0  # a whole non-streamed exchange
    stream_deadline: float = 300.0  # a whole streamed exchange
    max_body: int = 16 << 20
    max_line: int = 1 << 20
    max_events: int = 100_000

    @classmethod
    def per_response(cls, deadline: float) -> Limits:
        """The same deadline for every response, streamed or not (``--server-timeout``)."""
        return cls(deadline=deadline, stream_deadline=deadline)

    def scaled(self, deadline: float) -> Limits:
        """The same caps with ``deadline`` (and a stream deadline at least as long)."""
        return replace(self, deadline=deadline, stream_deadline=max(deadline, self.stream_deadline))


# ------------------------------------------------------------------ URLs


_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]*@")
_SECRET_QUERY = re.compile(r"(?i)([?&](?:api[_-]?key|key|token|access[_-]?token|password|secret)=)[^&\s#]*")


def redact(text: str) -> str:
    """``text`` with every URL's ``user:password@`` and secret-looking query values replaced by ``***``."""
    return _SECRET_QUERY.sub(r"\1***", _USERINFO.sub(r"\1***@", text))


class Secrets:
    """The values a user hands the harness as a server's settings (``--serve-env`` values, ``--serve-arg``
    values such as ``--api-key=…``, ``$SPECPARITY_SERVER_API_KEY``): :meth:`scrub` replaces each in a
    text (and :func:`redact`'s URL secrets), :meth:`scrub_doc` in every string of a document, so none is
    written anywhere (results, logs, the server's captured output, scoreboards). A value shorter than
    ``MIN`` characters or a plain number is hidden where it is given (:func:`hidden_args`) but not
    searched for in free text (it would erase unrelated words and counts)."""

    MIN = 6

    def __init__(self, values: Sequence[str] = ()) -> None:
        keep = {v for v in values if len(v) >= self.MIN and not re.fullmatch(r"[-+0-9.eE]+", v)}
        self.values = sorted(keep, key=len, reverse=True)

    @classmethod
    def of(cls, serve_args: Sequence[str] = (), serve_env: dict[str, str] | None = None) -> Secrets:
        vals = [*_arg_values(serve_args), *(serve_env or {}).values()]
        key = env.get("SPECPARITY_SERVER_API_KEY")
        if key and key != API_KEY:
            vals.append(key)
        return cls(vals)

    @property
    def longest(self) -> int:
        return len(self.values[0]) if self.values else 0

    def scrub(self, text: str) -> str:
        for v in self.values:
            text = text.replace(v, "…")
        return redact(text)

    def scrub_doc(self, obj: Any) -> Any:
        if isinstance(obj, str):
            return self.scrub(obj)
        if isinstance(obj, dict):
            return {self.scrub_doc(k): self.scrub_doc(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.scrub_doc(v) for v in obj]
        return obj


def _arg_values(args: Sequence[str]) -> list[str]:
    """The values among server arguments: ``v`` of ``--flag=v``, and every item not starting with ``-``."""
    out = []
    for a in args:
        if a.startswith("-"):
            flag, eq, val = a.partition("=")
            if eq:
                out.append(val)
        else:
            out.append(a)
    return out


def hidden_args(args: Sequence[str]) -> list[str]:
    """Server arguments as the harness writes them: flags kept, every value ``…`` (``--api-key=…``)."""
    out = []
    for a in args:
        if a.startswith("-"):
            flag, eq, _ = a.partition("=")
            out.append(f"{flag}=…" if eq else a)
        else:
            out.append("…")
    return out


@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str
    port: int
    prefix: str

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.prefix}"


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_url(url: str, *, allow_remote: bool = False) -> Endpoint:
    """The server's endpoint, or :class:`UsageError` (credentials, a non-loopback host, a bad URL)."""
    if not isinstance(url, str) or not url.strip():
        raise UsageError("empty server URL; expected http://HOST:PORT")
    raw = url.strip()
    try:
        parts = urlsplit(raw if "://" in raw else f"http://{raw}")
        port = parts.port
        user, password = parts.username, parts.password
    except ValueError as exc:
        raise UsageError(f"bad server URL {redact(raw)!r}: {exc}") from None
    shown = redact(raw)
    if user is not None or password is not None or "@" in parts.netloc:
        raise UsageError(f"the server URL {shown!r} carries credentials (user:password@); refused: they would "
                         "travel in clear and end up in results. Give the key in $SPECPARITY_SERVER_API_KEY")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"bad server URL {shown!r}; expected http://HOST:PORT")
    if parts.query or parts.fragment:
        raise UsageError(f"bad server URL {shown!r}: a server URL has no query or fragment")
    host = parts.hostname
    if not allow_remote and not is_loopback(host):
        raise UsageError(f"the server URL {shown!r} is not on this machine (host {host!r}); only loopback "
                         "servers are graded unless you pass --allow-remote")
    if port == 0:
        raise UsageError(f"the server URL {shown!r} names port 0, which no server listens on; give the port "
                         "the server listens on (http://HOST:PORT)")
    if port is None:  # never a silent default: the user writes the port the server listens on
        default = 443 if parts.scheme == "https" else 80
        raise UsageError(f"the server URL {shown!r} gives no port; write the one the server listens on "
                         f"(e.g. {parts.scheme}://{host}:{default} for the {parts.scheme} default)")
    return Endpoint(parts.scheme, host, port, parts.path.rstrip("/"))


# ------------------------------------------------------------------ the client


class _Watchdog:
    """Shuts a connection's socket down when the deadline passes (unblocks any read)."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float) -> None:
        self.conn, self.fired = conn, False
        self.timer = threading.Timer(max(0.0, seconds), self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self) -> None:
        self.fired = True
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self) -> None:
        self.timer.cancel()


class HttpClient:
    """A bounded client for one OpenAI-compatible server (see the module doc for the bounds)."""

    def __init__(self, url: str, *, allow_remote: bool = False, limits: Limits | None = None,
                 api_key: str | None = None) -> None:
        self.endpoint = parse_url(url, allow_remote=allow_remote)
        self.allow_remote = allow_remote
        self.limits = limits or Limits()
        self.api_key = api_key if api_key is not None else env.get("SPECPARITY_SERVER_API_KEY", API_KEY)
        self.dialect: Any = None  # what the server's API takes, learnt from its answers (subjects/served/ Dialect)

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def timeout(self) -> float:
        return self.limits.deadline

    def with_deadline(self, deadline: float) -> HttpClient:
        """The same server with another request deadline (e.g. a warm-up that loads the model)."""
        c = HttpClient.__new__(HttpClient)
        c.endpoint, c.allow_remote, c.api_key = self.endpoint, self.allow_remote, self.api_key
        c.limits = self.limits.scaled(deadline)
        c.dialect = self.dialect  # learnt once per server, whatever the deadline
        return c

    # -- plumbing

    def _conn(self, deadline: float) -> http.client.HTTPConnection:
        ep = self.endpoint
        cls = http.client.HTTPSConnection if ep.scheme == "https" else http.client.HTTPConnection
        return cls(ep.host, ep.port, timeout=max(0.05, deadline))

    def _headers(self, body: bytes | None) -> dict[str, str]:
        h = {"Authorization": f"Bearer {self.api_key}", "Accept-Encoding": "identity"}
        if body is not None:
            h["Content-Type"] = "application/json"
        return h

    def _open(self, seconds: float) -> tuple[http.client.HTTPConnection, _Watchdog, float]:
        conn = self._conn(seconds)
        return conn, _Watchdog(conn, seconds), time.monotonic() + seconds

    def _send(self, conn: http.client.HTTPConnection, method: str, path: str,
              body: dict[str, Any] | None) -> http.client.HTTPResponse:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, self.endpoint.prefix + path, body=data, headers=self._headers(data))
        return conn.getresponse()

    def _down(self, exc: BaseException, dog: _Watchdog, seconds: float, what: str = "answer") -> ServerDown:
        if dog.fired or isinstance(exc, (socket.timeout, TimeoutError)):
            return ServerDown(f"no complete {what} within {seconds:g} s", "timeout")
        if isinstance(exc, ConnectionRefusedError):
            return ServerDown("connection refused", "refused")
        return ServerDown(f"{type(exc).__name__}: {_one_line(str(exc))}".rstrip(": "))

    @staticmethod
    def _read_some(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, t_end: float,
                   dog: _Watchdog) -> bytes:
        """At most one read of the socket, within what is left of the deadline."""
        left = t_end - time.monotonic()
        if left <= 0 or dog.fired:
            raise TimeoutError
        if conn.sock is not None:
            conn.sock.settimeout(left)
        b = resp.read1(65536)
        if not b and dog.fired:
            raise TimeoutError  # the watchdog shut the socket down: EOF is not the server's end
        return b

    def _body(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, t_end: float,
              dog: _Watchdog) -> bytes:
        cap = self.limits.max_body
        declared = resp.getheader("Content-Length")
        if declared is not None and declared.strip().isdigit() and int(declared) > cap:
            raise ServerError(f"response body of {int(declared)} bytes is over the {cap}-byte cap", resp.status)
        out, n = [], 0
        while True:
            b = self._read_some(conn, resp, t_end, dog)
            if not b:
                if resp.length:  # Content-Length promised more
                    raise ServerError(f"the connection closed after {n} bytes of the body, {resp.length} "
                                      "short of its Content-Length", resp.status)
                return b"".join(out)
            n += len(b)
            if n > cap:
                raise ServerError(f"response body over the {cap}-byte cap", resp.status)
            out.append(b)

    # -- requests

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        """(status, body bytes) of one bounded exchange."""
        seconds = self.limits.deadline
        conn, dog, t_end = self._open(seconds)
        try:
            resp = self._send(conn, method, path, body)
            return resp.status, self._body(conn, resp, t_end, dog)
        except ServerError:
            raise
        except http.client.IncompleteRead as exc:
            if dog.fired:
                raise self._down(exc, dog, seconds) from None
            raise ServerError(f"the connection closed after {len(exc.partial)} bytes of the body, "
                              "before the response ended") from None
        except (OSError, http.client.HTTPException) as exc:
            raise self._down(exc, dog, seconds) from None
        finally:
            dog.cancel()
            conn.close()

    def get(self, path: str) -> tuple[int, str]:
        status, raw = self.request("GET", path)
        return status, raw.decode("utf-8", "replace")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The JSON object a 200 answer carries; :class:`ServerError` for anything else."""
        status, raw = self.request("POST", path, body)
        if status != 200:
            raise ServerError(f"HTTP {status}: {_snippet(raw)}", status)
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            raise ServerError(f"response is not JSON: {_snippet(raw, 120)}", status) from None
        if not isinstance(doc, dict):
            raise ServerError(f"response is not a JSON object: {_snippet(raw, 120)}", status)
        return doc

    def post_stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The ``data:`` events of a streamed (SSE) answer, up to ``data: [DONE]``."""
        lim = self.limits
        seconds = lim.stream_deadline
        events: list[dict[str, Any]] = []
        conn, dog, t_end = self._open(seconds)
        try:
            resp = self._send(conn, "POST", path, body)
            if resp.status != 200:
                raise ServerError(f"HTTP {resp.status}: {_snippet(self._body(conn, resp, t_end, dog))}", resp.status)
            buf, total = b"", 0
            while True:
                chunk = self._read_some(conn, resp, t_end, dog)
                if not chunk:
                    raise ServerError(f"the stream ended without 'data: [DONE]' (after {len(events)} events)",
                                      resp.status)
                total += len(chunk)
                if total > lim.max_body:
                    raise ServerError(f"stream over the {lim.max_body}-byte cap ({len(events)} events)",
                                      resp.status)
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if len(buf) > lim.max_line:
                    raise ServerError(f"a stream line of more than {lim.max_line} bytes without a newline",
                                      resp.status)
                for line in lines:
                    if len(line) > lim.max_line:
                        raise ServerError(f"a stream line of {len(line)} bytes (cap {lim.max_line})", resp.status)
                    text = line.decode("utf-8", "replace").strip()
                    if not text.startswith("data:"):
                        continue  # blank separators, 'event:' lines and ': keepalive' comments
                    payload = text[5:].strip()
                    if payload == "[DONE]":
                        return events
                    try:
                        ev = json.loads(payload)
                    except (ValueError, RecursionError):
                        raise ServerError(f"stream event is not JSON: {payload[:120]!r}", resp.status) from None
                    if not isinstance(ev, dict):
                        raise ServerError(f"stream event is not a JSON object: {payload[:120]!r}", resp.status)
                    events.append(ev)
                    if len(events) > lim.max_events:
                        raise ServerError(f"more than {lim.max_events} stream events without 'data: [DONE]'",
                                          resp.status)
        except ServerError:
            raise
        except (OSError, http.client.HTTPException) as exc:
            if dog.fired or isinstance(exc, (socket.timeout, TimeoutError)):
                raise ServerDown(f"stream still open after {seconds:g} s ({len(events)} events, no 'data: [DONE]')",
                                 "timeout") from None
            if isinstance(exc, http.client.IncompleteRead):
                raise ServerError(f"the connection closed mid-stream (after {len(events)} events)") from None
            raise self._down(exc, dog, seconds) from None
        finally:
            dog.cancel()
            conn.close()

    def healthy(self) -> tuple[bool, str]:
        """``/health`` answers 200 (a server without that route: ``/v1/models`` answers 200)."""
        try:
            status, text = self.get("/health")
            if status == 404:
                status2, text2 = self.get("/v1/models")
                return status2 == 200, f"no /health (404); /v1/models: HTTP {status2} {_one_line(text2)[:60]}"
        except (ServerDown, ServerError) as exc:
            return False, str(exc)
        return status == 200, f"/health: HTTP {status} {_one_line(text)[:80]}"


def get_json(client: HttpClient, path: str) -> Any:
    """The JSON body of a 200 answer to ``GET path`` (``/health``, ``/v1/models``); None for any
    other status, no answer, or a body that is not JSON."""
    try:
        status, text = client.get(path)
        return json.loads(text) if status == 200 else None
    except (ServerDown, ServerError, ValueError, RecursionError):
        return None


def model_ids(doc: Any) -> list[Any]:
    """The ``id`` of each model entry of a ``GET /v1/models`` body (``{"data": [{"id": ...}]}``)."""
    data = doc.get("data") if isinstance(doc, dict) else None
    return [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []


def _one_line(s: str) -> str:
    return " ".join(s.split())


def _snippet(raw: bytes, n: int = 200) -> str:
    return _one_line(raw[:n].decode("utf-8", "replace"))
