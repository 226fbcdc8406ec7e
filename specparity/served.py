"""Grade served engines: OpenAI-compatible servers over HTTP, started for real.

``specparity grade --server URL --model PATH [--draft PATH]`` grades a running
server; ``specparity grade --serve NAME --model PATH [--draft PATH]`` starts
the real server ``NAME`` (``SERVERS``) as a subprocess on 127.0.0.1 with the
model (and drafter), waits for ``/health`` (bounded), grades it and always
stops it (its own process group: SIGTERM then SIGKILL, in a ``finally``, at
exit, and on SIGTERM / Ctrl-C). With ``--draft`` the server is graded twice,
without the drafter (arm ``plain``) and with it (arm ``spec``), so a failure in
both arms is the server's own and one only with speculation is speculative
(``blame``). The checks are ``subjects/served.py``; the reference is our
engine's greedy plain decode (``engine.executor.plain_generate``) of the same
weights in this process, on the prompt the server builds (mlx-lm 0.32.2
``mlx_lm/server.py`` ``ResponseGenerator._tokenize``: the tokenizer's encoding,
its chat template, or ``convert_chat``).

Writes ``DIR/server-<name>--<model dir>.json`` (the scoreboard's result shape:
one mode per arm) and regenerates ``DIR/scoreboard.md`` / ``.html``
(``reports/scoreboard.py``). Exit 0 when every check passed, 1 when one failed,
2 on a usage error (bad URL, refused connection, missing model dir, unknown
server). Entry points for a runner registry: :func:`grade_served` (one server,
all arms, a result document) and :data:`SERVERS` (name, package, tox env,
command line).

Reproduce one check: ``python -m specparity.served --serve NAME --model PATH
[--draft PATH] --check CHECK``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from subjects.served import SERVER_CHECKS, Client, Reference, ServerDown, run_checks

DEFAULT_OUT = Path("runs/grade-servers")
STARTUP_TIMEOUT = 180.0
REQUEST_TIMEOUT = 60.0
GREEDY_MAX = 40
N_PROMPTS = 16


def _log(msg: str) -> None:
    print(f"[grade] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ servers


@dataclass(frozen=True)
class ServedEngine:
    """A server ``--serve`` can start: its package, how to start it, where it runs."""

    name: str
    package: str  # the pip requirement of its tox environment
    module: str  # importable when installed here
    tox_env: str
    argv: Callable[[str, str | None, int], list[str]]
    note: str = ""
    exe: str | None = None  # a console script (in $SPECPARITY_SERVER_BIN when set), else ``module`` is imported
    spec_without_draft: bool = False  # a model-free speculative mode: the spec arm runs without --draft

    def available(self) -> bool:
        if self.exe is not None:
            return shutil.which(server_bin(self.exe)) is not None
        return importlib.util.find_spec(self.module) is not None

    def command(self, model: str, draft: str | None, port: int) -> list[str]:
        return self.argv(model, draft, port)


def _mlx_lm(model: str, draft: str | None, port: int) -> list[str]:
    extra = ["--draft-model", draft, "--num-draft-tokens", "3"] if draft else []
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "WARNING", *extra]


def _fake(model: str, draft: str | None, port: int) -> list[str]:
    extra = ["--draft-model", draft] if draft else []
    return [sys.executable, "-m", "specparity.fake_server", "--model", model, "--port", str(port), *extra]


def server_bin(exe: str) -> str:
    """``exe`` from ``$SPECPARITY_SERVER_BIN`` (the server's own virtualenv: its pins conflict with ours)."""
    d = os.environ.get("SPECPARITY_SERVER_BIN")
    return str(Path(d) / exe) if d else exe


def _model_dir(model: str) -> str:
    """A fresh folder whose one subdirectory ``default_model`` links to ``model`` (servers that
    serve every subdirectory of ``--model-dir`` by its name)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="specparity-models-"))
    (d / "default_model").symlink_to(Path(model).resolve(), target_is_directory=True)
    atexit.register(shutil.rmtree, d, ignore_errors=True)  # the link only, never the model
    return str(d)


def _cli(exe: str, *serve: str, plain: Sequence[str] = (), spec: Sequence[str] = (),
         model_dir: bool = False) -> Callable[[str, str | None, int], list[str]]:
    """``EXE SERVE... MODEL --host 127.0.0.1 --port P`` + the plain arm's or the speculative arm's flags
    (``spec``: ``{draft}`` is replaced by the draft path); ``model_dir``: ``--model-dir DIR`` instead
    of ``MODEL``, the model linked as ``DIR/default_model``."""
    def argv(model: str, draft: str | None, port: int) -> list[str]:
        extra = [a.replace("{draft}", draft) for a in spec] if draft else list(plain)
        m = ["--model-dir", _model_dir(model)] if model_dir else [model]
        return [server_bin(exe), *serve, *m, "--host", "127.0.0.1", "--port", str(port), *extra]

    return argv


KEY = ["--api-key", "specparity-local"]  # the bearer token subjects.served.Client sends
SUFFIX = '{"method":"suffix","num_speculative_tokens":4}'

SERVERS: dict[str, ServedEngine] = {
    s.name: s for s in (
        ServedEngine("mlx-lm", "mlx-lm==0.32.2", "mlx_lm.server", "server-mlx-lm", _mlx_lm,
                     note="mlx_lm.server (BatchGenerator without a drafter; stream_generate with --draft-model)"),
        ServedEngine("vllm-mlx", "vllm-mlx==0.6.0", "vllm_mlx", "server-vllm-mlx",
                     _cli("vllm-mlx", "serve", plain=["--served-model-name", "default_model"]), exe="vllm-mlx",
                     note="vllm-mlx serve (no two-model drafter: plain arm only)"),
        ServedEngine("fusion-mlx", "fusion-mlx==0.10.24", "fusion_mlx", "server-fusion-mlx",
                     _cli("fusion-mlx", "serve", model_dir=True, plain=[*KEY, "--no-spec-decode"]),
                     exe="fusion-mlx",
                     note="fusion-mlx serve --model-dir (speculation needs MTP/DFlash/DSpark drafters: plain arm only)"),
        ServedEngine("qmlx-serve", "qmlx-serve==0.16.0", "vllm_mlx", "server-qmlx-serve",
                     _cli("qmlx", "serve", plain=["--served-model-name", "default_model", "--no-spec-decode"],
                          spec=["--served-model-name", "default_model", "--speculative-config", SUFFIX]),
                     exe="qmlx", spec_without_draft=True,
                     note="qmlx serve; spec arm: model-free SuffixDecoding (--speculative-config suffix, 4 tokens)"),
        ServedEngine("flyto-mlx", "flyto-mlx==0.7.0", "omlx", "server-flyto-mlx",
                     _cli("omlx", "serve", model_dir=True), exe="omlx",
                     note="omlx serve --model-dir (flyto-mlx's oMLX server; no two-model drafter: plain arm only)"),
        ServedEngine("fake", "specparity", "specparity.fake_server", "py311", _fake,
                     note="specparity.fake_server: the test double (SPECPARITY_FAKE_SERVER_BUG plants a bug)"),
    )
}


def availability(name: str) -> tuple[bool, str]:
    """(available, reason) for ``--serve name``: what a runner registry needs to list it."""
    eng = SERVERS.get(name)
    if eng is None:
        return False, f"unknown server {name!r}; known: {', '.join(SERVERS)}"
    if not eng.available():
        return False, f"{eng.package} is not installed here; run: tox -e {eng.tox_env}"
    return True, "ok"


class ServeFailed(RuntimeError):
    """The server process exited or never answered /health."""


_LIVE: set[subprocess.Popen[bytes]] = set()


def _stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived the leader
    _LIVE.discard(proc)


@atexit.register
def _stop_all() -> None:
    for p in list(_LIVE):
        _stop(p, grace=3.0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 3) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-400:]


@contextlib.contextmanager
def started(engine: ServedEngine, model: str, draft: str | None, log_path: Path, *,
            startup_timeout: float = STARTUP_TIMEOUT, timeout: float = REQUEST_TIMEOUT,
            env: dict[str, str] | None = None) -> Iterator[Client]:
    """Start ``engine`` on a free loopback port, wait for health, yield a client, always stop it."""
    port = free_port()
    argv = engine.command(model, draft, port)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as logf:
        logf.write(("$ " + shlex.join(argv) + "\n").encode())
        logf.flush()
        try:
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, **(env or {})})
        except OSError as exc:
            raise ServeFailed(f"{engine.name}: cannot start {argv[0]!r}: {exc}") from exc
        _LIVE.add(proc)
        try:
            client = Client(f"http://127.0.0.1:{port}", timeout=timeout)
            _wait_ready(engine, client, proc, log_path, startup_timeout)
            yield client
        finally:
            _stop(proc)


def _wait_ready(engine: ServedEngine, client: Client, proc: subprocess.Popen[bytes], log_path: Path,
                startup_timeout: float) -> None:
    t0 = time.monotonic()
    while True:
        code = proc.poll()
        if code is not None:
            raise ServeFailed(f"{engine.name} exited with code {code} before answering /health "
                              f"(log {log_path}: {_tail(log_path)})")
        if client.healthy()[0]:
            break
        if time.monotonic() - t0 > startup_timeout:
            raise ServeFailed(f"{engine.name} did not answer /health within {startup_timeout:g} s "
                              f"(log {log_path}: {_tail(log_path)})")
        time.sleep(0.25)
    from subjects.served import Request, ServerError, send

    left = max(5.0, startup_timeout - (time.monotonic() - t0))
    warm = Client(client.url, timeout=left)
    try:  # the first request loads the model in some servers: inside the startup bound
        send(warm, Request("warm up", 1, tag="startup"))
    except ServerError as exc:  # it answers: the checks report what is wrong with its answers
        _log(f"{engine.name}: the warm-up request got {exc}")
    except Exception as exc:  # noqa: BLE001 - reported as a startup failure with the server's log
        code = proc.poll()
        raise ServeFailed(f"{engine.name}: first request failed ({exc})"
                          + (f"; exited with code {code}" if code is not None else "")
                          + f" (log {log_path}: {_tail(log_path)})") from exc


# ------------------------------------------------------------------ the reference


def resolve_model(path: str, what: str = "--model", target: str | None = None) -> Path:
    """A model directory: a path, or a zoo name (``llama``; a drafter ``twin`` with a zoo target)."""
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{what} {path}: no config.json (not an mlx-lm model directory)")
        return p.resolve()
    import zoo

    name = path
    if target is not None and target in zoo.model_names():
        with contextlib.suppress(ValueError):
            name = zoo.model_name(target, path)
    if name in zoo.model_names():
        return zoo.model_dir(name)
    raise ValueError(f"{what} {path}: no such model directory (nor a zoo model name)")


@cache
def engine_reference(model_dir: str) -> Reference:
    """Plain greedy decode of ``model_dir`` by our engine, as the checks' :class:`Reference`."""
    import mlx.core as mx

    from engine.executor import GenerationParams, plain_generate
    from specparity.runners import load_model

    loaded = load_model(model_dir)
    model, tok = loaded.model, loaded.tokenizer
    eos = tuple(sorted(int(e) for e in tok.eos_token_ids))

    def encode(text: str) -> list[int]:
        return list(tok.encode(text))

    def chat_prompt(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        if tok.has_chat_template:
            return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        from mlx_lm.server import convert_chat

        return list(tok.encode(convert_chat(msgs)))

    @lru_cache(maxsize=512)
    def full(ids: tuple[int, ...], n: int) -> tuple[tuple[int, ...], bool]:
        res = plain_generate(model, list(ids), GenerationParams(max_tokens=n, gamma=0, eos_ids=eos,
                                                                cache_digests=False))
        return tuple(res.output_ids), res.usage.finish_reason == "stop"

    def greedy(ids: tuple[int, ...], n: int) -> tuple[list[int], bool]:
        out, hit = full(tuple(ids), max(n, GREEDY_MAX))
        return (list(out[:n]), False) if len(out) >= n else (list(out), hit)

    def logprobs(ids: tuple[int, ...], out: tuple[int, ...], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
        if not out:
            return []
        logits = model(mx.array([list(ids) + list(out)]))[0, len(ids) - 1 : len(ids) + len(out) - 1]
        lp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
        order = mx.argsort(-lp, axis=-1)[:, :k]
        lp_l, order_l = lp.tolist(), order.tolist()
        return [(lp_l[i][t], [(j, lp_l[i][j]) for j in order_l[i]]) for i, t in enumerate(out)]

    return Reference(encode=encode, chat_prompt=chat_prompt, decode=lambda ids: tok.decode(list(ids)),
                     greedy=greedy, logprobs=logprobs, eos_ids=eos, prompts=_prompts(tok),
                     eos_text=tuple(str(tok.convert_ids_to_tokens(e)) for e in eos))


def _prompts(tok: Any, n: int = N_PROMPTS, seed: int = 24) -> list[str]:
    """Seeded prompts of 6-10 words of the tokenizer's own vocabulary (each word one token)."""
    import numpy as np

    special = set(getattr(tok, "all_special_ids", []) or []) | set(tok.eos_token_ids)
    words: list[str] = []
    for i in range(tok.vocab_size if hasattr(tok, "vocab_size") else 0):
        if i in special:
            continue
        w = tok.decode([i]).strip()
        if len(w) >= 2 and w.isalpha() and w.isascii() and list(tok.encode(w, add_special_tokens=False)) == [i]:
            words.append(w)
    if len(words) < 8:
        raise ValueError("the tokenizer has too few plain words to build prompts from")
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, size=int(rng.integers(6, 11)))) for _ in range(n)]


# ------------------------------------------------------------------ grading


def _doc_name(name: str, model: Path) -> str:
    return f"server-{name}--{model.name}"


def reproduce_cmd(name: str, model: str, draft: str | None, arm: str, check: str, url: str | None) -> str:
    where = f"--server {url}" if url else f"--serve {name}"
    d = f" --draft {draft}" if draft and arm == "spec" else ""
    cmd = f"python -m specparity.served {where} --model {model}{d} --check {check}"
    if url or name == "fake":
        return cmd
    return f"tox exec -e {SERVERS[name].tox_env} -- {cmd}"


def grade_served(*, model: str, draft: str | None = None, serve: str | None = None, url: str | None = None,
                 out: Path = DEFAULT_OUT, checks: Sequence[str] = SERVER_CHECKS,
                 timeout: float = REQUEST_TIMEOUT, startup_timeout: float = STARTUP_TIMEOUT,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
    """Grade one server (``serve``: started here; ``url``: running) on every check; the result document.

    ``model`` / ``draft`` are the arguments as given (paths or zoo names); with ``serve`` and a
    draft, both arms are graded. Raises ``ValueError`` for a usage error.
    """
    from specparity.runners import model_identity
    from traces.records import platform_info

    mdir = resolve_model(model)
    ddir = resolve_model(draft, "--draft", target=model) if draft else None
    name = serve or "url"
    if serve is not None and serve not in SERVERS:
        raise ValueError(f"unknown server {serve!r}; known: {', '.join(SERVERS)}")
    eng = SERVERS.get(serve or "")
    doc: dict[str, Any] = {
        "engine": f"server:{name}" if serve else f"server:{url}", "kind": "server",
        "package": eng.package.split("==")[0] if eng else None, "pinned": eng.package if eng else None,
        "tox_env": eng.tox_env if eng else None, "platform": platform_info(), "modes": {},
        "model": model_identity(mdir), "draft": model_identity(ddir) if ddir else None,
        "available": True, "reason": "ok", "version": None, "checks": list(checks),
        "reproduce": {},
    }
    if eng is not None:
        doc["version"] = _version(eng)
        if not eng.available():
            why = f"{eng.package} is not installed here; run: tox -e {eng.tox_env}"
            doc.update(available=False, reason=why)
            return doc
    ref = engine_reference(str(mdir))
    arms: list[tuple[str, Path | None]] = [("spec" if ddir else "plain", ddir)] if url else \
        [("plain", None)] + ([("spec", ddir)] if ddir else [])
    if eng is not None and eng.spec_without_draft and not ddir:
        arms.append(("spec", mdir))  # a model-free speculative mode: the draft argument only switches it on
    elif eng is not None and eng.exe is not None and ddir and not eng.spec_without_draft and "spec" in dict(arms):
        arms = [a for a in arms if a[0] != "spec"]  # no two-model drafter in this server
        doc["note"] = f"{eng.name} takes no two-model draft model: graded without speculation"
    for arm, d in arms:
        _log(f"{doc['engine']} [{arm}] model {mdir}" + (f", draft {d}" if d else ""))
        mode = {"note": (eng.note if eng else url or "") + (" with the draft model" if d else " without a drafter"),
                "drafter": str(d) if d else None, "targets": [str(mdir)]}
        try:
            if url is not None:
                results = run_checks(Client(url, timeout=timeout), ref, checks,
                                     log=lambda m, a=arm: _log(f"[{a}] {m}"))
            else:
                assert eng is not None
                from specparity.outdir import track

                log_path = track(out / "logs" / f"{_doc_name(name, mdir)}-{arm}.log")
                with started(eng, str(mdir), str(d) if d else None, log_path, startup_timeout=startup_timeout,
                             timeout=timeout, env=env) as client:
                    results = run_checks(client, ref, checks, log=lambda m, a=arm: _log(f"[{a}] {m}"))
        except ServeFailed as exc:
            from subjects.checks import CheckResult

            results = {c: CheckResult(c, "fail", f"server did not start: {exc}") for c in checks}
            _log(f"[{arm}] {exc}")
        mode["checks"] = {c: r.to_dict() for c, r in results.items()}
        for c, r in results.items():
            if r.status == "fail":
                mode["checks"][c]["reproduce"] = reproduce_cmd(name, model, draft, arm, c, url)
        doc["modes"][arm] = mode
    doc["blame"] = blame(doc)
    return doc


def blame(doc: dict[str, Any]) -> dict[str, str]:
    """Per failing check: the server's own (fails without the drafter too) or speculative (spec arm only)."""
    modes = doc.get("modes", {})
    plain, spec = modes.get("plain", {}).get("checks", {}), modes.get("spec", {}).get("checks", {})
    out = {}
    for c in set(plain) | set(spec):
        p, s = plain.get(c, {}).get("status"), spec.get(c, {}).get("status")
        if p == "fail" and s == "fail":
            out[c] = "server (fails with and without the draft model)"
        elif s == "fail" and p in ("pass", "unsupported"):
            out[c] = "speculative (fails only with the draft model)"
        elif p == "fail" and s in ("pass", "unsupported"):
            out[c] = "server without a drafter only"
        elif p == "fail" or s == "fail":
            out[c] = "server"
    return out


def _version(eng: ServedEngine) -> str | None:
    """The installed version of the server's package (in its own virtualenv when it has one)."""
    dist = eng.package.split("==")[0]
    if eng.exe is not None and os.environ.get("SPECPARITY_SERVER_BIN"):
        py = server_bin("python")
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([py, "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                                 capture_output=True, text=True, timeout=60)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        return None
    from subjects._common import dist_version

    v = dist_version(dist)
    return None if v == "unknown" else v


def _failed(doc: dict[str, Any]) -> bool:
    return any(r["status"] == "fail" for m in doc.get("modes", {}).values() for r in m["checks"].values())


def _err(msg: str) -> int:
    print(f"specparity grade: {msg}", file=sys.stderr)
    return 2


class _Terminated(SystemExit):
    pass


def grade_server_main(args: argparse.Namespace) -> int:
    """``specparity grade --server URL | --serve NAME --model PATH [--draft PATH] [--out DIR]``."""
    if args.server and args.serve:
        return _err("give --server URL or --serve NAME, not both")
    if not getattr(args, "model", None):
        return _err("--server/--serve need --model PATH (the weights the server serves)")
    if args.serve is not None:
        from specparity.runners.registry import RunnerUnsupported, get

        try:  # the one runner registry: a blank, unknown or non-server name is one line
            get(args.serve, kind="server", what="server")
        except RunnerUnsupported as exc:
            return _err(str(exc))
    checks = list(getattr(args, "check", None) or SERVER_CHECKS)
    bad = [c for c in checks if c not in SERVER_CHECKS]
    if bad:
        return _err(f"unknown check {bad[0]!r}; known: {', '.join(SERVER_CHECKS)}")
    try:
        mdir = resolve_model(args.model)
        if args.draft:
            resolve_model(args.draft, "--draft", target=args.model)
    except ValueError as exc:
        return _err(str(exc))
    timeout = float(getattr(args, "server_timeout", None) or REQUEST_TIMEOUT)
    if args.server:
        try:
            client = Client(args.server, timeout=min(timeout, 10.0))
        except ValueError as exc:
            return _err(str(exc))
        try:
            client.get("/health")
        except ServerDown as exc:
            return _err(f"cannot reach the server at {client.url}: {exc}")
    out = Path(args.out) if getattr(args, "out", None) else DEFAULT_OUT
    from specparity.outdir import add_outputs

    path = out / f"{_doc_name(args.serve or 'url', mdir)}.json"
    with add_outputs(out, "specparity grade --serve", recognise=_served_output) as claim:
        for f in (path, out / "scoreboard.md", out / "scoreboard.html"):
            claim.check(f)  # refused before any server starts if not ours
        return _grade_served_into(args, out, path, claim, checks, timeout)


def _served_output(p: Path) -> bool:
    """A result, scoreboard or server log this command wrote before output markers existed."""
    from specparity.engines import _engine_output

    if _engine_output(p):
        return True
    if p.parent.name != "logs" or p.suffix != ".log" or not p.is_file():
        return False
    with open(p, "rb") as fh:
        return fh.read(2) == b"$ "  # our logs start with the server's command line


def _grade_served_into(args: argparse.Namespace, out: Path, path: Path, claim: Any,
                       checks: Any, timeout: float) -> int:
    prev = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        raise _Terminated(128 + signum)

    signal.signal(signal.SIGTERM, on_term)  # run the finally blocks that stop the server
    try:
        doc = grade_served(model=args.model, draft=args.draft, serve=args.serve, url=args.server, out=out,
                           checks=checks, timeout=timeout)
    except ValueError as exc:
        return _err(str(exc))
    finally:
        signal.signal(signal.SIGTERM, prev)
    from traces.io import atomic_write_json

    if not doc["available"]:
        _log(f"{doc['engine']}: not available here: {doc['reason']}")
    atomic_write_json(claim.track(path), doc, indent=2)
    from reports.scoreboard import write_scoreboard

    md, html = write_scoreboard(out, track=claim.track)
    print(f"{path}\nscoreboard: {md} {html}")
    for c, who in sorted(doc.get("blame", {}).items()):
        print(f"  {c}: {who}")
    if _failed(doc):
        return 1
    return 0 if doc["available"] else 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specparity.served", description="grade an OpenAI-compatible server")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--server", default=None, metavar="URL")
    g.add_argument("--serve", default=None, metavar="NAME")
    p.add_argument("--model", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--check", action="append", default=None, choices=SERVER_CHECKS)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--server-timeout", type=float, default=None)
    return grade_server_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
