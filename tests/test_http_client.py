"""The served checks' one HTTP client (subjects/http_client.py) against hostile loopback servers.

Each server misbehaves in one way a real or careless server can (trickles its
headers or body, streams events forever, never ends a line, sends a huge body,
closes mid-body or mid-stream); the client must come back within its bound with
a one-line ServerDown or ServerError, fast. URL policy: credentials refused and
never echoed, loopback only unless allow_remote.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from subjects.http_client import (
    HttpClient,
    Limits,
    ServerDown,
    ServerError,
    UsageError,
    parse_url,
    redact,
)

FAST = Limits(deadline=1.0, stream_deadline=1.0, max_body=64 << 10, max_line=4096, max_events=500)


@contextlib.contextmanager
def hostile(behave: Callable[[socket.socket], None]) -> Iterator[str]:
    """A loopback TCP server that reads the request head and then runs ``behave(conn)``."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            threading.Thread(target=_one, args=(conn,), daemon=True).start()

    def _one(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                piece = conn.recv(4096)
                if not piece:
                    return
                data += piece
            head, _, rest = data.partition(b"\r\n\r\n")
            n = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")), 0)
            while len(rest) < n:
                rest += conn.recv(4096)
            behave(conn)
        with contextlib.suppress(OSError):
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join(2)
        srv.close()


def _forever(conn: socket.socket, chunk: bytes, pause: float, limit: float = 8.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        conn.sendall(chunk)
        time.sleep(pause)


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


def trickle_body(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 50000\r\n\r\n")
    _forever(conn, b" ", 0.05)


def trickle_headers(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    _forever(conn, b"X", 0.05)


def events_forever(conn: socket.socket) -> None:
    conn.sendall(SSE_HEAD)
    _forever(conn, b'data: {"choices": []}\n\n', 0.02)


def event_flood(conn: socket.socket) -> None:
    conn.sendall(SSE_HEAD)
    _forever(conn, b'data: {"choices": []}\n\n' * 200, 0.0, limit=3.0)


def endless_line(conn: socket.socket) -> None:
    conn.sendall(SSE_HEAD + b"data: ")
    _forever(conn, b"x" * 1024, 0.0, limit=3.0)


def huge_declared(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2147483648\r\n\r\n{")
    time.sleep(2)


def huge_undeclared(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
    _forever(conn, b"[" * 65536, 0.0, limit=3.0)


def closes_mid_body(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"choi")


def closes_mid_stream(conn: socket.socket) -> None:
    conn.sendall(SSE_HEAD + b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choi')


def never_answers(conn: socket.socket) -> None:
    time.sleep(5)


CASES = [  # (server, streamed?, exception, words of the one-line reason)
    (trickle_body, False, ServerDown, "no complete answer within 1 s"),
    (trickle_headers, False, ServerDown, "no complete answer within 1 s"),
    (never_answers, False, ServerDown, "no complete answer within 1 s"),
    (never_answers, True, ServerDown, "stream still open after 1 s"),
    (events_forever, True, ServerDown, "stream still open after 1 s"),
    (event_flood, True, ServerError, "more than 500 stream events"),
    (endless_line, True, ServerError, "stream line of more than 4096 bytes"),
    (huge_declared, False, ServerError, "2147483648 bytes is over the 65536-byte cap"),
    (huge_undeclared, False, ServerError, "over the 65536-byte cap"),
    (closes_mid_body, False, ServerError, "closed after 6 bytes"),
    (closes_mid_stream, True, ServerError, "ended without 'data: [DONE]' (after 1 events)"),
]


@pytest.mark.parametrize("behave, stream, exc, words", CASES, ids=[c[0].__name__ + ("-stream" if c[1] else "")
                                                                     for c in CASES])
def test_a_hostile_server_is_cut_off_within_the_bound_with_one_line(behave, stream, exc, words) -> None:
    with hostile(behave) as url:
        client = HttpClient(url, limits=FAST)
        t0 = time.monotonic()
        with pytest.raises(exc) as err:
            if stream:
                client.post_stream("/v1/completions", {"prompt": "x", "stream": True})
            else:
                client.post("/v1/completions", {"prompt": "x"})
        took = time.monotonic() - t0
    msg = str(err.value)
    assert words in msg, msg
    assert "\n" not in msg, msg
    assert took < 2.5, (behave.__name__, took)


def test_a_refused_connection_is_server_down() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServerDown, match="connection refused"):
        HttpClient(f"http://127.0.0.1:{port}", limits=FAST).get("/health")


@pytest.mark.parametrize("url", ["http://alice:s3cr3t@127.0.0.1:8080", "http://s3cr3t@127.0.0.1:8080/v1",
                                 "https://:s3cr3t@localhost"])
def test_credentials_in_a_url_are_refused_and_never_echoed(url) -> None:
    with pytest.raises(UsageError) as err:
        parse_url(url)
    msg = str(err.value)
    assert "credentials" in msg and "s3cr3t" not in msg and "alice" not in msg, msg
    assert "\n" not in msg


def test_loopback_only_unless_allowed() -> None:
    for ok in ("http://127.0.0.1:8080", "http://localhost:1", "http://[::1]:9", "127.0.0.2:80"):
        assert parse_url(ok).port
    for far in ("http://10.0.0.5:8080", "http://example.com:80", "http://192.168.1.2:80"):
        with pytest.raises(UsageError, match="--allow-remote"):
            parse_url(far)
        assert parse_url(far, allow_remote=True).host
    for bad in ("ftp://127.0.0.1", "http://127.0.0.1:8080/?key=x", "", "http://127.0.0.1:99999"):
        with pytest.raises(UsageError):
            parse_url(bad)


@pytest.mark.parametrize("url, msg", [("http://127.0.0.1:0/", "names port 0"),
                                      ("http://127.0.0.1/", "gives no port; write the one the server listens on "
                                                            "(e.g. http://127.0.0.1:80"),
                                      ("https://localhost", "e.g. https://localhost:443")])
def test_port_zero_or_a_missing_port_is_refused_never_silently_port_80(url, msg) -> None:
    with pytest.raises(UsageError, match=re.escape(msg)):
        parse_url(url)


def test_redact_scrubs_userinfo_and_secret_query_values() -> None:
    s = "cmd --server http://bob:pw@host:1/v1 and https://tok@h/x?api_key=abc&n=2 ok"
    r = redact(s)
    assert "pw" not in r and "bob" not in r and "tok@" not in r and "abc" not in r, r
    assert "http://***@host:1/v1" in r and "api_key=***&n=2" in r, r
