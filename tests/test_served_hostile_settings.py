"""Hostile server settings and servers (issue 41): each class planted, one clear line, the right exit code,
nothing secret written anywhere.

- secrets: ``--serve-env`` values and ``--serve-arg`` values (``--api-key=…``) the fake server echoes in its
  log are in no file the grader writes (row JSON, server logs, scoreboard) nor in its output;
- a server bound to every interface (``--serve-arg=--host=0.0.0.0``, ``--serve-env HOST=0.0.0.0``) is
  refused without ``--allow-remote``, before anything starts;
- ``--server http://127.0.0.1:0/`` and a URL without a port are refused (never silently port 80);
- reads without an end (SSE without ``[DONE]``, bytes without a newline) end within ``--server-timeout``
  with their cause in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specparity.grading.http_servers import remote_bind
from subjects.http_client import Secrets, hidden_args
from tests.helpers import cli

ROOT = Path(__file__).resolve().parents[1]
CLI = "import sys; from specparity.cli import main; sys.exit(main(sys.argv[1:]))"
SECRET_ENV = "env-s3cr3t-Value-91"
SECRET_ARG = "arg-s3cr3t-Value-72"


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", CLI, "grade", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _everything_written(root: Path) -> str:
    return "\n".join(p.read_bytes().decode("utf-8", "replace") for p in root.rglob("*") if p.is_file())


def test_settings_handed_to_a_server_are_written_nowhere(pair, tmp_path) -> None:
    out = tmp_path / "out"
    p = _cli("--serve", "fake", "--model", str(pair[0]), "--out", str(out), "--check", "liveness",
             f"--serve-arg=--api-key={SECRET_ARG}", "--serve-env", f"MY_TOKEN={SECRET_ENV}")
    assert p.returncode == 0, p.stderr
    logs = list((out / "logs").glob("*.log"))
    assert logs and any("ignoring unknown arguments: --api-key=…" in x.read_text() for x in logs)  # echoed, scrubbed
    assert any("MY_TOKEN=… is set" in x.read_text() for x in logs)
    written = _everything_written(out) + p.stdout + p.stderr
    assert SECRET_ARG not in written and SECRET_ENV not in written
    assert "--api-key=…" in (out / next(iter(sorted(x.name for x in out.glob("server-fake--*.json"))))).read_text()


def test_secrets_and_hidden_args_units() -> None:
    s = Secrets.of(["--api-key=abcdefgh", "--port", "8080", "--name", "tok-123456"], {"K": "zzzzzzzz", "N": "1"})
    assert s.scrub("x abcdefgh y tok-123456 zzzzzzzz 8080 1") == "x … y … … 8080 1"
    assert hidden_args(["--api-key=abc", "--flag", "value", "--bare"]) == ["--api-key=…", "--flag", "…", "--bare"]
    assert s.scrub_doc({"a": ["abcdefgh"], "abcdefgh": 1}) == {"a": ["…"], "…": 1}


@pytest.mark.parametrize("args, env, bad", [
    (["--host=0.0.0.0"], {}, "--serve-arg=--host=0.0.0.0"),
    (["--host", "0.0.0.0"], {}, "--serve-arg=--host --serve-arg=0.0.0.0"),
    (["--bind", "[::]:8080"], {}, "--serve-arg=--bind --serve-arg=[::]:8080"),
    ([], {"HOST": "0.0.0.0"}, "--serve-env HOST=… (a non-loopback address)"),
    (["--host=127.0.0.1"], {"HOST": "localhost"}, None),
    (["--api-key", "0.0.0.0"], {"API_TOKEN": "10.0.0.1"}, None),
])
def test_a_non_loopback_bind_is_named(args, env, bad) -> None:
    assert remote_bind(args, env) == bad


def test_serve_refuses_a_non_loopback_bind_without_allow_remote(pair, tmp_path) -> None:
    p = _cli("--serve", "fake", "--model", str(pair[0]), "--out", str(tmp_path / "o"), "--check", "liveness",
             "--serve-arg=--host=0.0.0.0", timeout=60)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "--serve-arg=--host=0.0.0.0 binds the started server to an address other machines can reach" in lines[0]
    assert "--allow-remote" in lines[0] and not (tmp_path / "o").exists()


@pytest.mark.parametrize("url, words", [("http://127.0.0.1:0/", "names port 0"),
                                        ("http://127.0.0.1/", "gives no port")])
def test_server_url_without_a_real_port_is_refused(url, words) -> None:
    p = _cli("--server", url, "--model", "llama", timeout=60)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and words in lines[0], p.stderr


class _Endless(BaseHTTPRequestHandler):
    """/health answers; every POST streams without an end: SSE events without [DONE] (``stream``), or
    bytes without a newline."""

    mode = "events"

    def log_message(self, *a) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        raw = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_POST(self) -> None:  # noqa: N802
        import json

        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        if not body.get("stream"):  # a plain answer: the streamed one is the hostile part
            raw = json.dumps({"choices": [{"text": "a", "finish_reason": "length", "index": 0}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        t0 = time.monotonic()
        try:
            if self.mode == "bytes":
                self.wfile.write(b"data: ")
            while time.monotonic() - t0 < 30:
                self.wfile.write(b'data: {"choices": [{"text": "a", "index": 0}]}\n\n' if self.mode == "events"
                                 else b"x")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass


@pytest.mark.parametrize("mode, words", [("events", "stream still open after 2 s"),
                                         ("bytes", "stream still open after 2 s (0 events, no 'data: [DONE]')")])
def test_a_read_without_an_end_ends_within_the_deadline_with_its_cause(mode, words, pair, tmp_path, capsys) -> None:
    """In process (``tests.helpers.cli``): the grader's own deadline ends the read, not a subprocess timeout."""
    handler = type("H", (_Endless,), {"mode": mode})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        t0 = time.monotonic()
        rc, _out, err = cli(["grade", "--server", f"http://127.0.0.1:{srv.server_address[1]}", "--model", pair[0],
                             "--out", tmp_path / "o", "--check", "stream", "--server-timeout", "2"], capsys)
        took = time.monotonic() - t0
    finally:
        srv.shutdown()
        srv.server_close()
    assert rc == 1, (rc, err[-2000:])
    assert words in err, err[-2000:]
    assert took < 60, took
