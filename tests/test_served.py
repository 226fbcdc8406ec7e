"""Served engines (subjects/served.py, specparity/served.py) on the fake server, loopback only.

The fake server (``specparity/fake_server.py``) runs as a real subprocess
started by ``--serve fake`` on a user-style model (``tests/foreign.py`` phi3
with its twin drafter). The correct fake passes every check in both arms; each
planted bug is caught by the default checks with the request named; a server
that hangs or dies is a finding within the request timeout; ``--serve``
leaves no process behind (also when the server fails to start or the grader
is sent SIGTERM).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specparity.served import SERVERS, ServedEngine, ServeFailed, grade_served, started
from subjects.served import SERVER_CHECKS
from tests.helpers import cli_command, cli_env, cli_process


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.foreign import build

    return build(tmp_path_factory.mktemp("served-models"), ("phi3",))["phi3"]


def _pids_with(needle: str) -> list[int]:
    """Live processes whose command line mentions ``needle`` (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = next((ln for ln in (d / "status").read_text().splitlines() if ln.startswith("State:")), "")
            except OSError:
                continue
            if needle in cmd and "zombie" not in state:
                out.append(int(d.name))
    return out


def _statuses(doc: dict, arm: str) -> dict[str, str]:
    return {c: r["status"] for c, r in doc["modes"][arm]["checks"].items()}


def test_correct_fake_server_passes_every_check_with_and_without_the_drafter(pair, tmp_path) -> None:
    target, twin = pair
    doc = grade_served(model=str(target), draft=str(twin), serve="fake", out=tmp_path, timeout=30)
    for arm in ("plain", "spec"):
        bad = {c: r["detail"] for c, r in doc["modes"][arm]["checks"].items() if r["status"] != "pass"}
        assert not bad, (arm, bad)
    assert set(doc["modes"]["plain"]["checks"]) == set(SERVER_CHECKS)
    assert doc["blame"] == {}
    assert not _pids_with(str(target))


PLANTS = {  # bug -> (the check that must catch it, words its finding must carry)
    "overrun": ("budget", "max_tokens="),
    "cache-drop": ("cache", "warm != cold"),
    "usage-reencode": ("usage", "completion_tokens"),
    "eos-leak": ("eos", "EOS text '</s>'"),
    "finish-label": ("finish_reason", "finish_reason 'stop', expected 'length'"),
}


@pytest.mark.parametrize("bug", list(PLANTS))
def test_each_planted_bug_is_caught_with_the_request_named(bug, pair, tmp_path) -> None:
    target, _ = pair
    check, words = PLANTS[bug]
    doc = grade_served(model=str(target), serve="fake", out=tmp_path, timeout=30,
                       env={"SPECPARITY_FAKE_SERVER_BUG": bug})
    res = doc["modes"]["plain"]["checks"][check]
    assert res["status"] == "fail", (bug, res)
    assert words in res["detail"], res["detail"]
    assert res["case"] and "POST /v1/" in res["case"], res  # the request, with its parameters
    assert res["reproduce"].startswith("python -m specparity.served --serve fake"), res
    assert doc["blame"][check].startswith("server"), doc["blame"]


@pytest.mark.parametrize("bug", ["hang", "die"])
def test_a_server_that_stops_answering_is_a_finding_not_a_hang(bug, pair, tmp_path) -> None:
    target, _ = pair
    doc = grade_served(model=str(target), serve="fake", out=tmp_path, timeout=3,
                       env={"SPECPARITY_FAKE_SERVER_BUG": bug})
    checks = doc["modes"]["plain"]["checks"]
    first = checks["identity"]
    assert first["status"] == "fail" and "server stopped answering" in first["detail"], first
    assert "POST /v1/completions" in first["detail"]
    later = [r for c, r in checks.items() if c != "identity"]
    assert all(r["status"] == "fail" and "not run: the server stopped answering in check 'identity'"
               in r["detail"] for r in later), later
    assert not _pids_with(str(target))


def test_serve_stops_a_server_that_never_answers_or_exits_at_once(tmp_path) -> None:
    marker = f"specparity-test-{os.getpid()}"
    never = ServedEngine("never", "x", "x", "x", lambda m, d, p: [sys.executable, "-c",
                         f"import time; time.sleep(600)  # {marker}"])
    with pytest.raises(ServeFailed, match=r"did not answer /health within 2 s"):
        with started(never, "m", None, tmp_path / "never.log", startup_timeout=2):
            pass
    assert not _pids_with(marker)
    dies = ServedEngine("dies", "x", "x", "x", lambda m, d, p: [sys.executable, "-c",
                        f"import sys; print('cannot bind'); sys.exit(3)  # {marker}"])
    with pytest.raises(ServeFailed, match=r"exited with code 3 .*cannot bind"):
        with started(dies, "m", None, tmp_path / "dies.log", startup_timeout=30):
            pass
    assert not _pids_with(marker)


def test_serve_failing_to_start_is_a_finding_for_every_check(pair, tmp_path, monkeypatch) -> None:
    target, _ = pair
    bad = ServedEngine("fake", "x", "specparity.fake_server", "py311",
                       lambda m, d, p: [sys.executable, "-m", "specparity.fake_server", "--model", m,
                                        "--port", str(p), "--bug", "no-such-bug"])
    monkeypatch.setitem(SERVERS, "fake", bad)
    doc = grade_served(model=str(target), serve="fake", out=tmp_path, startup_timeout=60)
    res = doc["modes"]["plain"]["checks"]
    assert all(r["status"] == "fail" and "server did not start" in r["detail"] for r in res.values()), res
    assert not _pids_with(str(target))


def test_cli_serve_writes_the_result_and_scoreboard_and_leaves_nothing_running(pair, tmp_path) -> None:
    target, _ = pair
    p = cli_process(["grade", "--serve", "fake", "--model", target, "--out", tmp_path])
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads((tmp_path / f"server-fake--{target.name}.json").read_text())
    assert doc["kind"] == "server" and doc["modes"]["plain"]["checks"]["identity"]["status"] == "pass"
    md = (tmp_path / "scoreboard.md").read_text()
    assert "## Served engines" in md and "server:fake" in md
    assert not _pids_with(str(target))


def test_sigterm_to_the_grader_stops_the_server(pair, tmp_path) -> None:
    target, _ = pair
    proc = subprocess.Popen(cli_command("grade", "--serve", "fake", "--model", target, "--out", tmp_path),
                            env=cli_env(SPECPARITY_FAKE_SERVER_BUG="hang"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # the server is up once a check has started (it hangs from request 3)
            if [p for p in _pids_with(str(target)) if p != proc.pid] and (tmp_path / "logs").exists():
                break
            time.sleep(0.1)
        time.sleep(1.0)
        server = [p for p in _pids_with("specparity.fake_server") if p != proc.pid and
                  str(target) in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        assert server, "the fake server never started"
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert not _pids_with(str(target))


@pytest.mark.parametrize("args, msg", [
    (["--server", "ftp://host", "--model", "llama"], "bad server URL 'ftp://host'"),
    (["--server", "http://127.0.0.1:1", "--model", "llama"], "cannot reach the server at http://127.0.0.1:1: "
                                                               "connection refused"),
    (["--serve", "mlx-lm", "--model", "/no/such/dir"], "--model /no/such/dir: no such model directory"),
    (["--serve", "nope", "--model", "llama"], "unknown server 'nope'"),
    (["--serve", "mlx_lm", "--model", "llama"], "mlx_lm is a runner of kind reference"),
    (["--serve", " ", "--model", "llama"], "empty server name"),
    (["--serve", "fake"], "need --model PATH"),
])
def test_cli_usage_errors_are_one_line(args, msg) -> None:
    p = cli_process(["grade", *args])
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and msg in lines[0], p.stderr


def test_every_server_is_a_registry_runner_of_kind_server() -> None:
    """One registry: `grade --serve` takes exactly the registry's servers, graded elsewhere (not per case)."""
    from specparity.runners import registry
    from specparity.served import SERVERS, availability

    assert registry.names("server") == list(SERVERS)
    for name in SERVERS:
        r = registry.get(name, kind="server")
        assert not r.per_case and f"--serve {name}" in (r.elsewhere or ""), r
        assert r.available() == availability(name)


def test_scoreboard_renders_server_rows_with_blame_and_reproduction(tmp_path) -> None:
    from reports.scoreboard import failures, render_markdown

    doc = {"engine": "server:fake", "kind": "server", "version": "1", "tox_env": "py311", "available": True,
           "platform": {}, "model": {"path": "/m/phi3-tiny"}, "checks": list(SERVER_CHECKS),
           "blame": {"budget": "speculative (fails only with the draft model)"},
           "modes": {"spec": {"note": "n", "targets": ["/m/phi3-tiny"], "checks": {
               "budget": {"status": "fail", "detail": "max_tokens=2: 3 tokens", "case": "budget: POST /v1/x",
                          "reproduce": "python -m specparity.served --serve fake --check budget"}}}}}
    md = render_markdown([doc])
    assert "| server:fake 1 | phi3-tiny | spec |" in md
    f = failures([doc])
    assert f[0]["reproduce"].endswith("--check budget") and "speculative" in f[0]["detail"]


def test_blame_tells_the_servers_own_failures_from_speculative_ones() -> None:
    from specparity.served import availability, blame

    def mode(**st: str) -> dict:
        return {"checks": {c: {"status": v} for c, v in st.items()}}

    doc = {"modes": {"plain": mode(identity="pass", stop="fail", usage="fail", cache="pass"),
                     "spec": mode(identity="fail", stop="fail", usage="pass", cache="pass")}}
    assert blame(doc) == {"identity": "speculative (fails only with the draft model)",
                          "stop": "server (fails with and without the draft model)",
                          "usage": "server without a drafter only"}
    assert availability("fake") == (True, "ok")
    ok, why = availability("nope")
    assert not ok and "unknown server 'nope'" in why


def test_a_server_without_a_health_route_is_alive_when_its_models_route_answers() -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from subjects.served import Client

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            code = 200 if self.path == "/v1/models" else 404
            self.send_response(code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        ok, why = Client(f"http://127.0.0.1:{httpd.server_address[1]}", timeout=5).healthy()
        assert ok and why.startswith("no /health (404)"), why
    finally:
        httpd.shutdown()
        httpd.server_close()
    ok, why = Client(f"http://127.0.0.1:{httpd.server_address[1]}", timeout=5).healthy()
    assert not ok and "connection refused" in why, why
