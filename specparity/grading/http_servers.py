"""Grade served engines: OpenAI-compatible servers over HTTP, started for real.

``specparity grade --server URL --model PATH [--draft PATH]`` grades a running
server (loopback only unless ``--allow-remote``; credentials in the URL are
refused); ``specparity grade --serve NAME --model PATH [--draft PATH]`` starts
the real server ``NAME`` (``SERVERS``) as a subprocess on 127.0.0.1 with the
model (and drafter), each in its own home/config folder (``HOME``,
``XDG_*_HOME``: settings a user keeps there never reach it), with
``--serve-arg=ARG`` / ``--serve-env K=V`` passed through, waits for
``/health`` and answers one warm-up request built from the model's own
vocabulary (bounded), grades it and always stops it (its own process group:
SIGTERM then SIGKILL, in a ``finally``, at exit, and on SIGTERM / Ctrl-C).
With ``--draft`` the server is graded twice, without the drafter (arm
``plain``) and with it (arm ``spec``). The checks are ``subjects/served/``;
every request goes through ``subjects/http_client.py``; the reference is our
engine's greedy plain decode (``engine.executor.plain_generate``) of the same
weights in this process, on the prompt the server builds (mlx-lm 0.32.2
``mlx_lm/server.py`` ``ResponseGenerator._tokenize``).

**Isolation.** Each arm's checks run on a fresh server with its prompt cache
off where the server has a flag for it (``ServedEngine.cache_off``; mlx-lm:
``--prompt-cache-size 0``), each check on prompts no other check shares; the
``cache`` check gets a fresh server of its own with the cache on. So one root
cause is one cell.

**All drafts rejected.** For a spec arm with a two-model drafter, the ``reject``
check runs on one more fresh server started with :func:`rejecting_drafter` (the
drafter with every weight zero: it proposes token 0 each time).

**Attribution.** A spec-arm cell that fails is rerun where it can tell: fails on
the plain arm too → ``server``; ran with the prompt cache on and passes when
rerun on a fresh spec server with the cache off → ``cache × speculation``;
otherwise ``speculation``.

**Speculation engaged.** The ``speculation`` cell reads the server's draft /
accept counters (``/metrics`` or usage extensions) over the arm; a spec arm
that drafted nothing is ``not-engaged`` in every cell that would have passed.

**Four states and the exit code.** Every cell is pass / fail / cannot-grade /
n/a (plus not-engaged); a server that does not start makes its arm's cells
cannot-grade with the reason and the log line, never fail. Exit 0 when every
gradeable cell passed and each arm graded something; 1 on a finding; 3 when
nothing could be graded (or an arm graded nothing: its server did not start,
or it never speculated); 2 on a usage error (bad or remote URL, credentials in
the URL, refused connection, missing model dir, unknown server, bad flags).

Writes ``DIR/server-<name>--<model>.json`` (the scoreboard's result shape: one
mode per arm; models named by zoo name, a path relative to the working folder
or ``$MODELS/<dir>``, and their digests, never a machine path) and regenerates
``DIR/scoreboard.md`` / ``.html`` (``reports/scoreboard.py``). Entry points:
:func:`grade_served` (one server, all arms, a result document), :func:`grade_arms`
(any launcher: the tests start the fake in process) and :data:`SERVERS`.

Reproduce one check: ``python -m specparity.grading.http_servers --serve NAME --model M
[--draft D] --check CHECK`` (the cell's ``reproduce``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

from subjects.failure_causes import SERVER_ERROR, SETUP, classify_error, error_as_success
from subjects.http_client import (
    HttpClient,
    Limits,
    Secrets,
    ServerDown,
    ServerError,
    UsageError,
    hidden_args,
    redact,
)
from subjects.served import (
    CHECKS,
    CellResult,
    Plan,
    Reference,
    Request,
    SpecCounters,
    check_names,
    dialect,
    make_plan,
    metrics,
    run_checks,
    send,
    speculation_cell,
)
from subjects.server_rows import (  # noqa: F401  (the rows the job grades)
    SERVERS,
    ChatWrap,
    ServedEngine,
    availability,
    server_bin,
)
from subjects.setup_evidence import observe, runtime_versions

DEFAULT_OUT = Path("runs/grade-servers")
STARTUP_TIMEOUT = 180.0
REQUEST_TIMEOUT = 60.0
GREEDY_MAX = 40
N_PROMPTS = 64
EXIT_NOTHING_GRADED = 3
ROOT = Path(__file__).resolve().parents[1]


def _log(msg: str) -> None:
    print(f"[grade] {redact(msg)}", file=sys.stderr, flush=True)


class ServeFailed(RuntimeError):
    """The server process exited, never answered /health, or refused the warm-up request.

    ``log_line``: the last lines of its log (the reason as the server put it)."""

    def __init__(self, msg: str, log_line: str = "") -> None:
        super().__init__(msg)
        self.log_line = log_line


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
    return redact(" | ".join(lines[-n:])[-400:])


def _error_lines(path: Path, n: int = 2) -> str:
    """The first distinct exception lines of a server log (``ValueError: ...``): the reason as it put it."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errs: list[str] = []
    for ln in lines:
        t = ln.strip()
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:", t) and t not in errs:
            errs.append(t)
    return redact(" | ".join(errs[:n])[:400])


def _why(path: Path) -> str:
    """The reason a server gave in its log: its exception lines, else its last lines."""
    return _error_lines(path) or _tail(path)


@dataclass
class Launch:
    """A started server as the grader sees it."""

    client: HttpClient
    log: Path | None = None
    cache: str = "unknown"  # "off" (a flag turned it off), "on", "unknown"
    argv: list[str] = field(default_factory=list)
    spec_method: str | None = None  # the speculation method it runs, as its /metrics label it (None: any)
    observe: tuple[tuple[str, str], ...] = ()  # (setting asked off, regex of a log line showing it on): its row's
    settle: Callable[[], None] | None = None  # waits until its output has reached the log
    _log_at: int = 0

    def log_since(self) -> str:
        """What the server's log gained since the last call ("" without a log): the evidence an error
        returned as success leaves (``subjects/failure_causes.py``)."""
        if self.log is None:
            return ""
        if self.settle is not None:
            self.settle()
        try:
            with open(self.log, "rb") as fh:
                fh.seek(self._log_at)
                data = fh.read(1 << 20)
        except OSError:
            return ""
        self._log_at += len(data)
        return redact(data.decode("utf-8", "replace"))


Launcher = Callable[[str, "str | None", bool], AbstractContextManager[Launch]]


@contextlib.contextmanager
def started(engine: ServedEngine, model: str, draft: str | None, log_path: Path, *,
            startup_timeout: float = STARTUP_TIMEOUT, timeout: float = REQUEST_TIMEOUT,
            env: dict[str, str] | None = None, cache_off: bool = False, serve_args: Sequence[str] = (),
            warmup: str = "hello", home: bool = True) -> Iterator[HttpClient]:
    """Start ``engine`` on a free loopback port, wait for health, yield a client, always stop it."""
    with launch_process(engine, model, draft, log_path, startup_timeout=startup_timeout, timeout=timeout,
                        env=env, cache_off=cache_off, serve_args=serve_args, warmup=warmup, home=home) as srv:
        yield srv.client


@contextlib.contextmanager
def launch_process(engine: ServedEngine, model: str, draft: str | None, log_path: Path, *,
                   startup_timeout: float = STARTUP_TIMEOUT, timeout: float = REQUEST_TIMEOUT,
                   env: dict[str, str] | None = None, cache_off: bool = False, serve_args: Sequence[str] = (),
                   warmup: str = "hello", home: bool = True, expect_output: bool = False,
                   secrets: Secrets | None = None) -> Iterator[Launch]:
    """Start ``engine``; its output reaches ``log_path`` through :class:`_LogPump` (every value the user
    handed as its settings scrubbed, ``secrets``: by default those of ``serve_args`` and ``env``)."""
    port = free_port()
    argv = engine.command(model, draft, port, cache_off=cache_off, extra=serve_args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    penv = {**os.environ}
    if engine.test_double:
        penv["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [penv.get("PYTHONPATH")])])
    homedir = Path(tempfile.mkdtemp(prefix=f"specparity-{engine.name}-home-")) if home else None
    if homedir is not None:  # its own home and config folders: nothing a user keeps there reaches it
        for k, sub in (("HOME", ""), ("XDG_CONFIG_HOME", ".config"), ("XDG_CACHE_HOME", ".cache"),
                       ("XDG_DATA_HOME", ".local/share"), ("XDG_STATE_HOME", ".local/state")):
            (homedir / sub).mkdir(parents=True, exist_ok=True)
            penv[k] = str(homedir / sub)
        for rel, text in engine.home_files:  # settings-file-only defaults turned off (the row names them)
            (homedir / rel).parent.mkdir(parents=True, exist_ok=True)
            (homedir / rel).write_text(text)
        penv.setdefault("HF_HUB_OFFLINE", "1")
    penv.update(env or {})
    secrets = secrets if secrets is not None else Secrets.of(serve_args, env)
    shown = [*argv[: len(argv) - len(serve_args)], *hidden_args(serve_args)]  # what is written: no user value
    try:
        with open(log_path, "wb") as logf:
            logf.write(("$ " + secrets.scrub(shlex.join(shown)) + "\n").encode())
            logf.flush()
            try:
                proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True, env=penv)
            except OSError as exc:
                raise ServeFailed(f"{engine.name}: cannot start {argv[0]!r}: {exc}") from exc
            _LIVE.add(proc)
            pump = _LogPump(proc, logf, secrets)
            try:
                client = HttpClient(f"http://127.0.0.1:{port}", limits=Limits.per_response(timeout))
                if engine.request_model_is_path:  # the row's dialect: requests name the model it was started with
                    d = dialect(client)
                    d.model = model
                    d.notes.append("requests name the model by the path it was started with (its row: a request "
                                   "naming another model makes it load that one)")
                _wait_ready(engine, client, proc, log_path, startup_timeout, warmup, expect_output, pump)
                yield Launch(client, log_path, "off" if cache_off and engine.cache_off else
                             ("on" if engine.cache_off else "unknown"), shown,
                             engine.spec_method if draft else None, engine.observe, settle=pump.settle)
            finally:
                _stop(proc)
                pump.drain(5.0)
    finally:
        if homedir is not None:
            shutil.rmtree(homedir, ignore_errors=True)


class _LogPump:
    """Copies a server's output into its log, every secret scrubbed (``Secrets.scrub``) before it is
    written: line by line, or in bounded pieces for output without newlines (the tail a secret could
    straddle is held back)."""

    def __init__(self, proc: subprocess.Popen[bytes], logf: Any, secrets: Secrets) -> None:
        self.proc, self.logf, self.secrets = proc, logf, secrets
        self.last = time.monotonic()
        self.busy = False  # a chunk read from the pipe and not yet in the log
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _write(self, data: bytes) -> None:
        self.logf.write(self.secrets.scrub(data.decode("utf-8", "replace")).encode())
        self.logf.flush()

    def _run(self) -> None:
        assert self.proc.stdout is not None
        fd, buf, keep = self.proc.stdout.fileno(), b"", 4 * max(self.secrets.longest, 1)
        while True:
            self.busy = False
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            self.busy = True
            if not chunk:
                break
            self.last = time.monotonic()
            buf += chunk
            nl = buf.rfind(b"\n")
            if nl >= 0:
                out, buf = buf[: nl + 1], buf[nl + 1:]
            elif len(buf) > 65536:
                out, buf = buf[:-keep], buf[-keep:]
            else:
                continue
            self._write(out)
        if buf:
            self._write(buf)

    def settle(self, quiet: float = 0.05, most: float = 2.0) -> None:
        """Wait (at most ``most`` s) until everything the server wrote so far is in the log (its pipe
        empty, no chunk between the pipe and the log) and it has written nothing for ``quiet`` s. What a
        server printed before it answered is then in the log however late this thread is scheduled."""
        t_end = time.monotonic() + most
        while time.monotonic() < t_end and self.thread.is_alive():
            if not self.busy and self._unread() == 0 and time.monotonic() - self.last >= quiet:
                return
            time.sleep(quiet / 5)

    def _unread(self) -> int:
        """Bytes the server wrote that this thread has not read yet (0 where the pipe cannot tell)."""
        assert self.proc.stdout is not None
        try:
            return struct.unpack("i", fcntl.ioctl(self.proc.stdout.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        except (OSError, ValueError):
            return 0

    def drain(self, timeout: float) -> None:
        """Everything the server wrote, in the log (its output closed: it exited)."""
        self.thread.join(timeout)


def _wait_ready(engine: ServedEngine, client: HttpClient, proc: subprocess.Popen[bytes], log_path: Path,
                startup_timeout: float, warmup: str, expect_output: bool = False,
                pump: _LogPump | None = None) -> None:
    t0 = time.monotonic()
    dialect(client)  # learnt by the warm-up, shared by every copy of the client
    probe = client.with_deadline(5.0)
    while True:
        code = proc.poll()
        if code is not None:
            if pump is not None:
                pump.drain(5.0)
            raise ServeFailed(f"{engine.name} exited with code {code} before answering /health", _why(log_path))
        if probe.healthy()[0]:
            break
        if time.monotonic() - t0 > startup_timeout:
            raise ServeFailed(f"{engine.name} did not answer /health within {startup_timeout:g} s",
                              _why(log_path))
        time.sleep(0.25)
    left = max(5.0, startup_timeout - (time.monotonic() - t0))
    try:  # the first request loads the model in some servers: inside the startup bound
        r = send(client.with_deadline(left), Request(warmup, 1, tag="startup"))
        if expect_output and not r.text and not (r.usage or {}).get("completion_tokens"):
            if pump is not None:
                pump.settle()
            hidden = error_as_success(r.doc, r.text, _read(log_path))
            if hidden is None:  # no exception behind it: this server generates nothing for the model (set-up)
                raise ServeFailed(f"{engine.name}: the warm-up request (a 1-token completion of words from the "
                                  f"model's own vocabulary) came back empty (finish_reason {r.finish_reason!r}, "
                                  f"usage {r.usage}): it generates nothing for this model", _why(log_path))
            # an error returned as success: the server started; the checks' cases it breaks are findings
    except ServerError as exc:  # it answers, but not a plain one-token completion
        cause = classify_error(exc, "/v1/completions")
        if cause.kind == SERVER_ERROR:
            return  # it started and answers with errors: findings in the cells they break, not set-up
        raise ServeFailed(f"{engine.name}: the warm-up request (a 1-token completion of words from the "
                          f"model's own vocabulary) was refused ({cause.kind}): {exc}", _why(log_path)) from exc
    except ServerDown as exc:
        code = proc.poll()
        if pump is not None:
            pump.drain(2.0) if code is not None else pump.settle()
        raise ServeFailed(f"{engine.name}: the warm-up request got no answer ({exc})"
                          + (f"; exited with code {code}" if code is not None else ""), _why(log_path)) from exc


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-(1 << 20):]
    except OSError:
        return ""


# ------------------------------------------------------------------ models and the reference


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


def model_ref(arg: str, mdir: Path) -> str:
    """How a committed row names a model: its zoo name, a path relative to the working folder, or
    ``$MODELS/<dir>`` (never a machine path)."""
    import zoo

    if arg in zoo.model_names():
        return arg
    m = re.match(r"^(.*)-[0-9a-f]{12,16}$", mdir.name)
    if m and m.group(1) in zoo.model_names():
        with contextlib.suppress(OSError, ValueError):
            if mdir.parent.resolve() == zoo.cache_root().resolve():
                return m.group(1)
    with contextlib.suppress(ValueError):
        return str(mdir.resolve().relative_to(Path.cwd().resolve()))
    return f"$MODELS/{mdir.name}"


def model_record(arg: str, mdir: Path) -> dict[str, Any]:
    from specparity.runners import model_identity

    ident = model_identity(mdir)
    return {"name": model_ref(arg, mdir), "weights_sha256": ident["weights_sha256"],
            "config_sha256": ident["config_sha256"]}


@cache
def engine_reference(model_dir: str, prompts: tuple[str, ...] | None = None, wrap: ChatWrap | None = None
                     ) -> Reference:
    """Plain greedy decode of ``model_dir`` by our engine, as the checks' :class:`Reference`.

    ``wrap``: how the server wraps a completions prompt (its row's ``completions_wrap``): the
    reference's completions prompt is that chat (the system message, the prompt as the user's),
    rendered by the model's chat template and the text encoded, and its chat prompt gets the
    system message too where ``wrap.chat_system``."""
    import mlx.core as mx

    from engine.executor import GenerationParams, plain_generate
    from specparity.runners import load_model

    loaded = load_model(model_dir)
    model, tok = loaded.model, loaded.tokenizer
    eos = tuple(sorted(int(e) for e in tok.eos_token_ids))

    def encode(text: str) -> list[int]:
        return list(tok.encode(text))

    def wrapped(text: str, completions: bool) -> list[int]:
        assert wrap is not None
        sys_msg = [{"role": "system", "content": wrap.system}] if wrap.system and (
            completions or wrap.chat_system) else []
        rendered = tok.apply_chat_template([*sys_msg, {"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=wrap.add_generation_prompt)
        return list(tok.encode(rendered))

    def chat_prompt(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        if wrap is not None and tok.has_chat_template:
            return wrapped(text, completions=False)
        if tok.has_chat_template:
            return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        from mlx_lm.server import convert_chat

        return list(tok.encode(convert_chat(msgs)))

    @lru_cache(maxsize=2048)
    def full(ids: tuple[int, ...], n: int) -> tuple[tuple[int, ...], bool]:
        res = plain_generate(model, list(ids), GenerationParams(max_tokens=n, gamma=0, eos_ids=eos,
                                                                cache_digests=False))
        return tuple(res.output_ids), res.usage.finish_reason == "stop"

    def greedy(ids: tuple[int, ...], n: int) -> tuple[list[int], bool]:
        out, hit = full(tuple(ids), max(n, GREEDY_MAX))
        return (list(out[:n]), False) if len(out) >= n else (list(out), hit)

    @lru_cache(maxsize=512)
    def _lp(ids: tuple[int, ...], out: tuple[int, ...], k: int) -> tuple[Any, ...]:
        logits = model(mx.array([list(ids) + list(out)]))[0, len(ids) - 1 : len(ids) + len(out) - 1]
        lp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
        order = mx.argsort(-lp, axis=-1)[:, :k]
        lp_l, order_l = lp.tolist(), order.tolist()
        return tuple((lp_l[i][t], [(j, lp_l[i][j]) for j in order_l[i]]) for i, t in enumerate(out))

    def logprobs(ids: tuple[int, ...], out: tuple[int, ...], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
        return list(_lp(tuple(ids), tuple(out), k)) if out else []

    bos = getattr(tok, "bos_token_id", None)
    with_bos = list(tok.encode("a"))
    return Reference(encode=encode, chat_prompt=chat_prompt, decode=lambda ids: tok.decode(list(ids)),
                     greedy=greedy, logprobs=logprobs, eos_ids=eos,
                     prompts=list(prompts) if prompts else _prompts(tok),
                     eos_text=tuple(str(tok.convert_ids_to_tokens(e)) for e in eos),
                     has_chat_template=bool(tok.has_chat_template),
                     bos_id=bos if bos is not None and with_bos[:1] == [bos] else None,
                     completion_prompt=(lambda text: wrapped(text, completions=True)) if wrap is not None else None,
                     wrap=wrap.describe() if wrap is not None else None)


def _prompts(tok: Any, n: int = N_PROMPTS, seed: int = 24) -> list[str]:
    """Seeded prompts of 6-10 words of the tokenizer's own vocabulary (each word one token), each
    starting with a word no other prompt starts with (so no two share a prefix)."""
    import numpy as np

    special = set(getattr(tok, "all_special_ids", []) or []) | set(tok.eos_token_ids)
    words: list[str] = []
    for i in range(tok.vocab_size if hasattr(tok, "vocab_size") else 0):
        if i in special:
            continue
        w = tok.decode([i]).strip()
        if len(w) >= 2 and w.isalpha() and w.isascii() and list(tok.encode(w, add_special_tokens=False)) == [i]:
            words.append(w)
    words = sorted(set(words))
    if len(words) < 8:
        raise ValueError("the tokenizer has too few plain words to build prompts from")
    rng = np.random.default_rng(seed)
    firsts = list(rng.permutation(words))[: min(n, len(words))]
    return [" ".join([str(f), *rng.choice(words, size=int(rng.integers(5, 10)))]) for f in firsts]


def prompts_from_file(path: str | Path) -> tuple[str, ...]:
    """The text prompts of a prompts file (``specparity/cases/prompts.py`` formats); token-id prompts refused."""
    from specparity.cases.prompts import read_prompts_file

    out = []
    for p in read_prompts_file(path):
        if p.text is None:
            raise ValueError(f"--prompts-file {path}: prompt {p.id!r} is token ids; grade --serve takes text "
                             "prompts (token-id requests are built from them)")
        if p.text.strip():
            out.append(p.text)
    if len(out) < 2:
        raise ValueError(f"--prompts-file {path}: needs at least 2 text prompts")
    return tuple(out)


def rejecting_drafter(draft: str | Path, root: str | Path | None = None) -> Path:
    """A copy of the drafter ``draft`` with every weight zero: its logits are all 0, so greedy
    drafting proposes token 0 every time and the target rejects (all but) every draft; same
    config, tokenizer and vocabulary, so a server takes it as its ``--draft-model``. Built once
    per drafter (keyed by its path, weight sizes and times) under ``root`` (default: the
    temporary folder)."""
    import hashlib

    import mlx.core as mx

    src = Path(draft).resolve()
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{draft}: no *.safetensors weights to zero")
    key = hashlib.sha256("\n".join([str(src)] + [f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}"
                                                   for w in weights]).encode()).hexdigest()[:16]
    dest = Path(root if root is not None else tempfile.gettempdir()) / f"specparity-reject-{src.name}-{key}"
    if (dest / "config.json").is_file():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=f"specparity-reject-{src.name}-", dir=dest.parent))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, tmp / f.name)
    for w in weights:
        arrays = mx.load(str(w))
        mx.save_safetensors(str(tmp / w.name), {k: mx.zeros_like(v) for k, v in arrays.items()},
                            metadata={"format": "mlx"})
    try:
        tmp.rename(dest)
    except OSError:  # built meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


# ------------------------------------------------------------------ grading arms


def _cells(checks: Sequence[str], status: str, detail: str, log: str = "", cause: str | None = None
           ) -> dict[str, CellResult]:
    return {c: CellResult(c, status, detail, log=log or None, cause=cause) for c in checks}


@dataclass
class ArmResult:
    cells: dict[str, CellResult]
    setup: dict[str, Any]
    cache_state: dict[str, str]  # check -> "off" / "on" / "unknown": the prompt cache it ran with


def grade_arm(ref: Reference, launch: Launcher, arm: str, draft: str | None, checks: Sequence[str],
              plan: Plan, *, restartable: bool = True, log: Callable[[str], None] = _log,
              baseline: dict[str, Any] | None = None, reject_draft: str | None = None) -> ArmResult:
    """One arm: its checks on a fresh server with the cache off (where it can be), then ``cache`` on a
    fresh server with the cache on, then (spec arm) ``reject`` on a fresh server whose drafter is
    ``reject_draft`` (every draft rejected), then the ``speculation`` cell from the counters over
    the arm (the rejecting server's counters are its own)."""
    on = {c: CHECKS[c].server if c in CHECKS else "main" for c in checks}  # each check's server, as declared
    main = [c for c in checks if on[c] == "main"]
    cache_on = [c for c in checks if on[c] == "cache-on"]
    rejecting = [c for c in checks if on[c] == "rejecting"]
    groups: list[tuple[list[str], bool, str | None, bool]] = []  # (checks, cache off, drafter, rejecting)
    cells: dict[str, CellResult] = {}
    if restartable:
        if main:
            groups.append((main, True, draft, False))
        if cache_on:
            groups.append((cache_on, False, draft, False))
    else:
        groups.append(([c for c in checks if on[c] in ("main", "cache-on")], False, draft, False))
    if rejecting:
        if arm == "spec" and reject_draft is not None and restartable:
            groups.append((rejecting, True, reject_draft, True))
        else:
            why = ("plain arm: no drafter" if arm != "spec" else
                   "a running server's drafter cannot be swapped for a rejecting one (grade it with --serve)"
                   if not restartable else "the spec arm has no two-model drafter to swap for one whose drafts are "
                   "all rejected (model-free speculation)")
            for c in rejecting:
                cells[c] = CellResult(c, "unsupported", why)
    cache_state: dict[str, str] = {}
    setup: dict[str, Any] = {"servers": []}
    counters = SpecCounters()
    met_total: SpecCounters | None = None
    spec_off: str | None = None  # the log line of a spec arm's server saying its speculation is off
    not_in_effect: dict[str, str] = {}  # a setting asked off that the server's log shows on -> that line
    for names, cache_off, gdraft, rejecting in groups:
        if not names:
            continue
        try:
            with launch(arm, gdraft, cache_off) as srv:
                setup["servers"].append({"checks": names, "prompt_cache": srv.cache,
                                         "argv": [_public_arg(a) for a in srv.argv]}
                                        | ({"drafter": "the spec arm's drafter with zero weights (every draft "
                                                       "rejected)"} if rejecting else {}))
                m0 = None if rejecting else metrics(srv.client, srv.spec_method)
                res = run_checks(srv.client, ref, names, log=lambda m, a=arm: log(f"[{a}] {m}"), plan=plan,
                                 counters=SpecCounters() if rejecting else counters, arm=arm, baseline=baseline,
                                 reject=rejecting, server_log=srv.log_since if srv.log is not None else None)
                learnt = dialect(srv.client).notes
                if learnt:
                    setup["servers"][-1]["dialect"] = list(learnt)
                seen = observe(srv.client, _read(srv.log) if srv.log is not None else "", srv.observe)
                setup["servers"][-1]["observed"] = _public_paths(seen.to_dict())
                if seen.spec_off and not rejecting and arm == "spec":
                    spec_off = spec_off or seen.spec_off
                if not rejecting:
                    not_in_effect.update(seen.not_in_effect)
                m1 = None if rejecting else metrics(srv.client, srv.spec_method)
                if m1 is not None:
                    d = m1.minus(m0) if m0 is not None else m1
                    met_total = d if met_total is None else met_total.plus(d)
                cells.update(res)
                for c in names:
                    cache_state[c] = srv.cache
                    if srv.log is not None and not cells[c].log and (
                            cells[c].status == "cannot-grade" or "stopped answering" in cells[c].detail
                            or (cells[c].status == "fail" and "HTTP 5" in cells[c].detail)):
                        cells[c].log = _error_lines(srv.log) or _tail(srv.log, 2) or None
        except ServeFailed as exc:
            log(f"[{arm}] server did not start: {exc} | {exc.log_line}")
            cells.update(_cells(names, "cannot-grade", f"server did not start: {exc}", exc.log_line, SETUP))
    if "speculation" in checks:
        started_any = any(not c.detail.startswith("server did not start") for c in cells.values()
                          if c.status != "unsupported")
        total = counters if counters.sources else None
        if met_total is not None:
            total = met_total if total is None else total.plus(met_total)
        if not started_any:
            first = next(c for c in cells.values() if c.status != "unsupported")
            cells["speculation"] = CellResult("speculation", "cannot-grade", first.detail, log=first.log)
        else:
            cells["speculation"] = speculation_cell(arm, total, spec_off)
        if cells["speculation"].status == "not-engaged":
            for c in cells.values():
                if c.status == "pass":
                    c.status = "not-engaged"
                    c.detail = f"passed, but speculation was not engaged (see the speculation cell): {c.detail}"
        elif arm == "spec" and cells["speculation"].status == "cannot-grade" and started_any:
            for c in cells.values():  # the arm's claim (it speculates) is not verified: every cell says so
                if c.status == "pass":
                    c.unverified = "speculation unverified (see the speculation cell)"
    if not_in_effect:
        setup["not_in_effect"] = dict(not_in_effect)
        ran = "; ".join(f"{k} ON though asked off (its log: {v!r})" for k, v in sorted(not_in_effect.items()))
        for c in cells.values():
            if c.status in ("fail", "cannot-grade") and c.check != "speculation":
                c.detail = f"{c.detail} [ran with {ran}]"
    return ArmResult({c: cells[c] for c in checks if c in cells}, setup, cache_state)


def grade_arms(ref: Reference, launch: Launcher, arms: Sequence[tuple[str, str | None]], *,
               checks: Sequence[str] | None = None, plan: Plan | None = None, restartable: bool = True,
               can_turn_cache_off: bool = True, log: Callable[[str], None] = _log,
               reject_draft: str | None = None) -> tuple[dict[str, ArmResult], dict[str, str]]:
    """Every arm (in order: the plain arm's tool calls are what the spec arm's are compared with),
    then the attribution of each failing cell (``{check: why}``, spec arm first). ``reject_draft``:
    a drafter whose drafts are all rejected (:func:`rejecting_drafter`), for the spec arm's ``reject``."""
    checks = check_names() if checks is None else checks
    plan = plan if plan is not None else make_plan(ref)
    results: dict[str, ArmResult] = {}
    baseline: dict[str, Any] = {}
    for arm, draft in arms:
        log(f"arm {arm}" + (" (with the drafter)" if draft else ""))
        results[arm] = grade_arm(ref, launch, arm, draft, checks, plan, restartable=restartable, log=log,
                                 baseline=baseline, reject_draft=reject_draft)
    blame = attribute(ref, launch, results, dict(arms), plan, restartable=restartable and can_turn_cache_off,
                      log=log, baseline=baseline)
    return results, blame


def attribute(ref: Reference, launch: Launcher, results: dict[str, ArmResult], drafts: dict[str, str | None],
              plan: Plan, *, restartable: bool, log: Callable[[str], None] = _log,
              baseline: dict[str, Any] | None = None) -> dict[str, str]:
    """Which root cause each failing cell has: the server (plain arm too), speculation, or cache × speculation."""
    out: dict[str, str] = {}
    plain = results.get("plain")
    spec = results.get("spec")
    if plain is not None:
        for c, cell in plain.cells.items():
            if cell.status == "fail":
                cell.attribution = "server: fails without speculation"
                out[c] = cell.attribution
    if spec is None:
        return out
    for c, cell in spec.cells.items():
        if cell.status != "fail":
            continue
        p = plain.cells.get(c) if plain is not None else None
        ran_with = spec.cache_state.get(c, "unknown")
        spec_bad = {k["label"] for k in cell.cases if k["status"] == "fail"}
        plain_bad = {k["label"] for k in (p.cases if p is not None else []) if k["status"] == "fail"}
        also = ""
        if p is not None and p.status == "fail" and plain_bad and spec_bad - plain_bad:
            also = f"server for {len(spec_bad & plain_bad)} case(s) failing on the plain arm too; for the other " \
                   f"{len(spec_bad - plain_bad)}: "
        if p is not None and p.status == "fail" and not also:
            why = "server: fails on the plain arm too"
        elif p is None:
            why = "not attributed: no plain arm to compare with"
        elif p.status not in ("pass", "fail"):  # the plain arm cannot run it (reject: no drafter): nothing to rerun
            why = f"speculation: fails with the prompt cache {ran_with}; n/a on the plain arm ({p.detail[:80]})"
        elif ran_with == "off":
            why = "speculation: fails with the prompt cache off, passes on the plain arm"
        elif restartable and ran_with == "on":
            log(f"[spec] attributing {c}: rerun on a fresh spec server with the prompt cache off")
            try:
                with launch("spec", drafts.get("spec"), True) as srv:
                    if srv.cache != "off":
                        raise ServeFailed("the prompt cache could not be turned off")
                    again = run_checks(srv.client, ref, [c], plan=plan, require_hits=False, arm="spec",
                                       baseline=baseline).get(c)
            except ServeFailed as exc:
                again = None
                why = f"speculation (the cache-off rerun could not start: {exc})"
            if again is not None:
                if again.status == "pass":
                    why = ("cache × speculation: passes when rerun with the prompt cache off, and on the plain "
                           "arm")
                elif again.status == "fail":
                    why = "speculation: fails when rerun with the prompt cache off too, passes on the plain arm"
                else:
                    why = f"speculation (the cache-off rerun could not grade: {again.detail[:120]})"
        else:
            why = ("speculation, or cache × speculation: the server's prompt cache could not be turned off to "
                   "tell them apart")
        cell.attribution = also + why
        out[c] = cell.attribution
    return out


# ------------------------------------------------------------------ the result document


def _doc_name(name: str, model_name: str) -> str:
    return f"server-{name}--{Path(model_name).name}"


def _public_arg(a: str) -> str:
    """An argv item as a committed row shows it: zoo dirs by name, other absolute paths by their last part."""
    a = redact(a)
    if a.startswith("/") and Path(a).exists():
        with contextlib.suppress(OSError, ValueError):
            return model_ref(a, Path(a)) if (Path(a) / "config.json").is_file() else f"<{Path(a).name}>"
    return a


def _public_paths(x: Any) -> Any:
    """``x`` (text, or a JSON value of texts) with every absolute path of an existing file or folder as a
    committed row shows it (:func:`_public_arg`): a server that reports the model it loaded by its path
    (mlx-vlm's ``/health`` and ``/v1/models``) leaves no machine path in the row."""
    if isinstance(x, str):
        return re.sub(r"/[^\s\"'\\,;:{}\[\]()]+", lambda m: _public_arg(m.group(0)), x)
    if isinstance(x, list):
        return [_public_paths(v) for v in x]
    if isinstance(x, dict):
        return {k: _public_paths(v) for k, v in x.items()}
    return x


def reproduce_cmd(name: str, model: str, draft: str | None, arm: str, check: str, url: str | None, *,
                  serve_args: Sequence[str] = (), serve_env: Sequence[str] = ()) -> str:
    where = f"--server {redact(url)}" if url else f"--serve {name}"
    d = f" --draft {draft}" if draft and arm == "spec" else ""
    extra = "".join(f" {shlex.quote('--serve-arg=' + a)}" for a in serve_args)
    extra += "".join(f" --serve-env {shlex.quote(e.split('=', 1)[0] + '=…')}" for e in serve_env)
    cmd = f"python -m specparity.grading.http_servers {where} --model {model}{d} --check {check}{extra}"
    if url or name == "fake":
        return cmd
    return f"tox exec -e {SERVERS[name].tox_env} -- {cmd}"


def _subprocess_launcher(eng: ServedEngine, mdir: Path, out: Path, doc_name: str, *, timeout: float,
                         startup_timeout: float, env: dict[str, str] | None, serve_args: Sequence[str],
                         warmup: str, expect_output: bool = False) -> Launcher:
    counter = {"n": 0}

    @contextlib.contextmanager
    def launch(arm: str, draft: str | None, cache_off: bool) -> Iterator[Launch]:
        from specparity.cli.outdir import track

        counter["n"] += 1
        log_path = track(out / "logs" / f"{doc_name}-{arm}-{counter['n']}.log")
        with launch_process(eng, str(mdir), draft, log_path, startup_timeout=startup_timeout, timeout=timeout,
                            env=env, cache_off=cache_off, serve_args=serve_args, warmup=warmup,
                            expect_output=expect_output, secrets=Secrets.of(serve_args, env)) as srv:
            yield srv

    return launch


def _url_launcher(client: HttpClient) -> Launcher:
    @contextlib.contextmanager
    def launch(arm: str, draft: str | None, cache_off: bool) -> Iterator[Launch]:
        yield Launch(client, None, "unknown", [])

    return launch


def grade_served(*, model: str, draft: str | None = None, serve: str | None = None, url: str | None = None,
                 out: Path = DEFAULT_OUT, checks: Sequence[str] | None = None,
                 timeout: float = REQUEST_TIMEOUT, startup_timeout: float = STARTUP_TIMEOUT,
                 env: dict[str, str] | None = None, serve_args: Sequence[str] = (),
                 prompts: tuple[str, ...] | None = None, allow_remote: bool = False) -> dict[str, Any]:
    """Grade one server (``serve``: started here; ``url``: running) on every check; the result document.

    ``model`` / ``draft`` are the arguments as given (paths or zoo names); with ``serve`` and a
    draft, both arms are graded. Raises ``ValueError`` for a usage error.
    """
    from traces.records import platform_info

    checks = check_names() if checks is None else checks
    mdir = resolve_model(model)
    ddir = resolve_model(draft, "--draft", target=model) if draft else None
    name = serve or "url"
    secrets = Secrets.of(serve_args, env)
    if serve is not None and serve not in SERVERS:
        raise ValueError(f"unknown server {serve!r}; known: {', '.join(SERVERS)}")
    eng = SERVERS.get(serve or "")
    mname = model_ref(model, mdir)
    dname = model_ref(draft, ddir) if draft and ddir else None
    env_keys = sorted((env or {}).keys())
    doc: dict[str, Any] = {
        "engine": name if serve else redact(url or ""), "kind": "server",
        "package": eng.package.split("==")[0] if eng else None, "pinned": eng.package if eng else None,
        "tox_env": eng.tox_env if eng else None, "platform": platform_info(), "modes": {},
        "model": model_record(model, mdir), "draft": model_record(draft, ddir) if draft and ddir else None,
        "available": True, "reason": "ok", "version": None, "checks": list(checks), "checks_version": 2,
        "setup": {"serve_args": [_public_arg(a) for a in hidden_args(serve_args)], "serve_env": env_keys,
                  "defaults_off": list(eng.defaults_off) if eng else [],
                  **({"home_files": dict(eng.home_files)} if eng and eng.home_files else {}),
                  **({"completions_wrap": eng.completions_wrap.describe()} if eng and eng.completions_wrap else {}),
                  "prompt_cache_off_flag": list(eng.cache_off) if eng and eng.cache_off else None,
                  "isolated_home": bool(serve)},
    }
    if eng is not None and eng.spec_without_draft and ddir is not None and url is None:
        # a model-free speculative mode: --draft only switches it on; the draft model is never loaded, so
        # the row names none (no drafter in the spec arm, no all-rejecting drafter for `reject`)
        doc["note"] = f"{eng.name}'s speculation is model-free: the draft model {dname} is not used"
        ddir, dname, doc["draft"] = None, None, None
    if eng is not None:
        doc["version"] = _version(eng)
        # the server's own interpreter (its row's virtualenv), not the grader's: what it runs with
        doc["server_runtime"] = runtime_versions(server_bin("python") if eng.exe is not None and os.environ.get(
            "SPECPARITY_SERVER_BIN") else sys.executable)
        if not eng.available():
            doc.update(available=False, reason=availability(eng.name)[1])
            return secrets.scrub_doc(doc)
    else:
        doc["server_runtime"] = {"note": "a running server (--server): its runtime is not visible to the grader"}
    ref = engine_reference(str(mdir), prompts, eng.completions_wrap if eng is not None else None)
    plan = make_plan(ref, checks)
    doc["setup"]["plan_notes"] = plan.notes
    if url is not None:
        arms: list[tuple[str, str | None]] = [("spec" if ddir else "plain", str(ddir) if ddir else None)]
    else:
        arms = [("plain", None)] + ([("spec", str(ddir))] if ddir else [])
        assert eng is not None
        if eng.spec_without_draft and not ddir:
            arms.append(("spec", str(mdir)))  # a model-free speculative mode: the draft argument only switches it on
        elif ddir and not eng.spec_without_draft and not eng.takes_draft():
            arms = [a for a in arms if a[0] != "spec"]  # no two-model drafter in this server
            doc["note"] = f"{eng.name} takes no two-model draft model: graded without speculation"
    if url is not None:
        client = HttpClient(url, allow_remote=allow_remote, limits=Limits.per_response(timeout))
        launch = _url_launcher(client)
        restartable = False
    else:
        assert eng is not None
        launch = _subprocess_launcher(eng, mdir, out, _doc_name(name, mname), timeout=timeout,
                                      startup_timeout=startup_timeout, env=env, serve_args=serve_args,
                                      warmup=plan.warmup, expect_output=plan.warmup_first is not None)
        restartable = True
    reject_draft = None
    spec_draft = dict(arms).get("spec")
    if "reject" in checks and restartable and ddir is not None and spec_draft == str(ddir):
        reject_draft = str(rejecting_drafter(ddir))  # a two-model drafter: swap it for one always rejected
        doc["setup"]["reject_drafter"] = f"{dname} with every weight zero (proposes token 0: every draft rejected)"
    results, blame = grade_arms(ref, launch, arms, checks=checks, plan=plan, restartable=restartable,
                                can_turn_cache_off=bool(eng and eng.cache_off), reject_draft=reject_draft,
                                log=lambda m: _log(secrets.scrub(m)))
    env_list = [f"{k}=…" for k in env_keys]
    for arm, d in arms:
        r = results[arm]
        mode: dict[str, Any] = {
            "note": (eng.note if eng else redact(url or "")) + (" with the draft model" if d else " without a drafter"),
            "drafter": (dname or "model-free") if d else None, "targets": [mname],
            "checks": {c: cell.to_dict() for c, cell in r.cells.items()}, "setup": r.setup,
            "prompt_cache": r.cache_state,
        }
        for c, cell in r.cells.items():
            if cell.status in ("fail", "cannot-grade", "not-engaged"):
                mode["checks"][c]["reproduce"] = reproduce_cmd(
                    name, mname, dname, arm, c, url, serve_args=[_public_arg(a) for a in hidden_args(serve_args)],
                    serve_env=env_list)
        doc["modes"][arm] = mode
    doc["blame"] = blame
    doc["summary"] = summarise(doc)
    return secrets.scrub_doc(doc)  # no value the user handed as the server's settings, anywhere in it


def summarise(doc: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per arm: how many cells are in each state."""
    out: dict[str, dict[str, int]] = {}
    for arm, m in doc.get("modes", {}).items():
        counts: dict[str, int] = {}
        for r in m["checks"].values():
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        out[arm] = counts
    return out


def exit_code(doc: dict[str, Any]) -> int:
    """0 every gradeable cell passed (each arm graded something), 1 a finding, 3 nothing graded."""
    if not doc.get("available", True):
        return 2
    modes = doc.get("modes", {})
    if any(r["status"] == "fail" for m in modes.values() for r in m["checks"].values()):
        return 1
    if not modes or any(not any(r["status"] == "pass" for r in m["checks"].values()) for m in modes.values()):
        return EXIT_NOTHING_GRADED
    return 0


def blame(doc: dict[str, Any]) -> dict[str, str]:
    """The attribution of each failing check (as written by :func:`grade_served`)."""
    return dict(doc.get("blame") or {})


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
    from subjects.common import dist_version

    v = dist_version(dist)
    return None if v == "unknown" else v


def _err(msg: str) -> int:
    print(f"specparity grade: {redact(msg)}", file=sys.stderr)
    return 2


class _Terminated(SystemExit):
    pass


def _parse_env(items: Sequence[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or ():
        k, sep, v = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ValueError(f"--serve-env {item.split('=', 1)[0]!r}: expected NAME=VALUE")
        if k in out:
            raise ValueError(f"--serve-env {k} given twice")
        out[k] = v
    return out


_BIND_FLAGS = ("--host", "--bind", "--listen", "--address", "--addr", "--hostname", "--ip", "--bind-address",
               "--listen-address")
_BIND_ENV = re.compile(r"(?i)(^|_)(HOST|BIND|LISTEN|ADDR|ADDRESS)($|_)")


def _bind_host(value: str) -> str:
    """The host of a bind value (``0.0.0.0``, ``0.0.0.0:8000``, ``[::]:80``, ``http://h:1``)."""
    v = value.strip()
    if "://" in v:
        v = v.split("://", 1)[1]
    v = v.split("/", 1)[0]
    if v.startswith("["):
        return v[1:].split("]", 1)[0]
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


def remote_bind(serve_args: Sequence[str], env: dict[str, str]) -> str | None:
    """The ``--serve-arg`` / ``--serve-env`` item that binds the server to a non-loopback address
    (``--host=0.0.0.0``, ``--host 0.0.0.0``, ``HOST=0.0.0.0``), shown as given; None: none does."""
    from subjects.http_client import is_loopback

    args = list(serve_args)
    for i, a in enumerate(args):
        flag, eq, val = a.partition("=")
        if flag not in _BIND_FLAGS:
            continue
        if not eq:
            if i + 1 >= len(args):
                continue
            val = args[i + 1]
        host = _bind_host(val)
        if host and not is_loopback(host):
            return f"--serve-arg={a}" + ("" if eq else f" --serve-arg={val}")
    for k, v in env.items():
        host = _bind_host(v)
        if _BIND_ENV.search(k) and host and not is_loopback(host) and re.fullmatch(r"[\w.:\[\]-]+", v.strip()):
            return f"--serve-env {k}=… (a non-loopback address)"
    return None


def grade_server_main(args: argparse.Namespace) -> int:
    """``specparity grade --server URL | --serve NAME --model PATH [--draft PATH] [--out DIR]``."""
    if args.server and args.serve:
        return _err("give --server URL or --serve NAME, not both")
    allow_remote = bool(getattr(args, "allow_remote", False))
    if args.server:
        try:  # refused before anything else: credentials in it are never echoed
            HttpClient(args.server, allow_remote=allow_remote)
        except UsageError as exc:
            return _err(str(exc))
    if not getattr(args, "model", None):
        return _err("--server/--serve need --model PATH (the weights the server serves)")
    serve_args = list(getattr(args, "serve_arg", None) or [])
    try:
        env = _parse_env(getattr(args, "serve_env", None))
    except ValueError as exc:
        return _err(str(exc))
    if args.server and (serve_args or env):
        return _err("--serve-arg/--serve-env start a server: they go with --serve NAME, not --server URL")
    remote = remote_bind(serve_args, env)
    if remote is not None and not allow_remote:
        return _err(f"{remote} binds the started server to an address other machines can reach; refused "
                    "(the harness starts servers on 127.0.0.1): drop it, or pass --allow-remote")
    if args.serve is not None and args.serve not in SERVERS:  # a row is a server (its runner follows from it)
        from specparity.runners.registry import RunnerUnsupported, get

        try:  # the one runner registry: a blank, unknown or non-server name is one line
            get(args.serve, kind="server", what="server")
        except RunnerUnsupported as exc:
            return _err(str(exc))
        return _err(f"{args.serve} is a runner of kind server with no row in subjects/server_rows.py SERVERS: "
                    "declare the server there (docs/runners.md, 'Adding a runner/server')")
    known = check_names()
    checks = list(getattr(args, "check", None) or known)
    bad = [c for c in checks if c not in known]
    if bad:
        return _err(f"unknown check {bad[0]!r}; known: {', '.join(known)}")
    checks = [c for c in known if c in checks]
    prompts = None
    try:
        if getattr(args, "prompts_file", None):
            prompts = prompts_from_file(args.prompts_file)
        mdir = resolve_model(args.model)
        if args.draft:
            resolve_model(args.draft, "--draft", target=args.model)
    except ValueError as exc:
        return _err(str(exc))
    timeout = float(getattr(args, "server_timeout", None) or REQUEST_TIMEOUT)
    if args.server:
        client = HttpClient(args.server, allow_remote=allow_remote, limits=Limits(deadline=min(timeout, 10.0)))
        try:
            client.get("/health")
        except (ServerDown, ServerError) as exc:
            return _err(f"cannot reach the server at {client.url}: {exc}")
    out = Path(args.out) if getattr(args, "out", None) else DEFAULT_OUT
    from specparity.cli.outdir import add_outputs

    path = out / f"{_doc_name(args.serve or 'url', model_ref(args.model, mdir))}.json"
    with add_outputs(out, "specparity grade --serve", recognise=_served_output) as claim:
        for f in (path, out / "scoreboard.md", out / "scoreboard.html"):
            claim.check(f)  # refused before any server starts if not ours
        return _grade_served_into(args, out, path, claim, checks, timeout, serve_args, env, prompts, allow_remote)


def _served_output(p: Path) -> bool:
    """A result, scoreboard or server log this command wrote before output markers existed."""
    from specparity.grading.engines import engine_output

    if engine_output(p):
        return True
    if p.parent.name != "logs" or p.suffix != ".log" or not p.is_file():
        return False
    with open(p, "rb") as fh:
        return fh.read(2) == b"$ "  # our logs start with the server's command line


def _grade_served_into(args: argparse.Namespace, out: Path, path: Path, claim: Any, checks: Any, timeout: float,
                       serve_args: list[str], env: dict[str, str], prompts: tuple[str, ...] | None,
                       allow_remote: bool) -> int:
    prev = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        raise _Terminated(128 + signum)

    signal.signal(signal.SIGTERM, on_term)  # run the finally blocks that stop the server
    try:
        doc = grade_served(model=args.model, draft=args.draft, serve=args.serve, url=args.server, out=out,
                           checks=checks, timeout=timeout, env=env, serve_args=serve_args, prompts=prompts,
                           allow_remote=allow_remote)
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
    for arm, counts in doc.get("summary", {}).items():
        print(f"  {arm}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    for c, who in sorted(doc.get("blame", {}).items()):
        print(f"  {c}: {who}")
    code = exit_code(doc)
    if code == EXIT_NOTHING_GRADED:
        print("  nothing could be graded in at least one arm (exit 3): see the cannot-grade reasons",
              file=sys.stderr)
    return code


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < v <= 86400:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 86400], got {text!r}")
    return v


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The flags ``grade --serve/--server`` adds (shared by ``specparity grade`` and this module)."""
    p.add_argument("--check", action="append", default=None, choices=check_names(),
                   help="grade only this served check (repeat; default: all)")
    p.add_argument("--server-timeout", type=_positive_seconds, default=None, metavar="SECONDS",
                   help=f"the deadline of one response from the server, streamed or not (default "
                        f"{REQUEST_TIMEOUT:g})")
    p.add_argument("--serve-arg", action="append", default=None, metavar="ARG",
                   help="one more argument for the started server (repeat; write --serve-arg=--flag)")
    p.add_argument("--serve-env", action="append", default=None, metavar="NAME=VALUE",
                   help="one more environment variable for the started server (repeat; values are never written)")
    p.add_argument("--prompts-file", default=None, metavar="FILE",
                   help="text prompts to build the served checks' requests from (default: words of the model's "
                        "own vocabulary)")
    p.add_argument("--allow-remote", action="store_true",
                   help="grade a --server URL that is not on this machine (default: loopback only)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specparity.grading.http_servers", description="grade an OpenAI-compatible server")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--server", default=None, metavar="URL")
    g.add_argument("--serve", default=None, metavar="NAME")
    p.add_argument("--model", required=True)
    p.add_argument("--draft", default=None)
    from specparity.cli.args import UsageError, writable_dir
    from specparity.cli.outdir import refusal

    p.add_argument("--out", type=writable_dir, default=None)
    add_server_arguments(p)
    args = p.parse_args(argv)
    try:
        return grade_server_main(args)
    except UsageError as exc:  # --out holding a user's file: one line, before any server starts
        return refusal(p.prog, exc)


if __name__ == "__main__":
    sys.exit(main())
