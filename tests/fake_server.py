"""A test double of an OpenAI-compatible server over real in-process decode, with planted bugs.

Not a server users grade (it lives under ``tests/``): the served checks
(``subjects/served.py``) and the grader (``specparity/served.py``) are tested
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
  and reports the longest cached prefix as ``cached_tokens``.

Planted bugs (``--bug NAME`` or ``SPECPARITY_FAKE_SERVER_BUG``; each names the
check meant to catch it, and only that check):

- ``system-prompt`` (identity): chat requests get an injected system message;
- ``stream-drop-byte`` (stream): the second streamed delta loses its last byte;
- ``overrun`` (budget): a budget that is not a multiple of 4 gets one token too many;
- ``finish-label`` (finish_reason): 'stop' when the budget ends generation;
- ``stop-label`` (finish_reason): 'length' when a stop string ends it;
- ``usage-reencode`` (usage): ``completion_tokens`` counted by re-encoding the text
  (visible on a byte-level model only);
- ``eos-leak`` (eos): the EOS token's text is appended when generation ends on EOS;
- ``stop-trailing-logprob`` (stop): a stop inside a speculative block leaves the
  block's next token in ids/logprobs (text and usage trimmed right);
- ``logprob-off`` (logprobs): logprobs off beyond tolerance (×1.03 − 0.02);
- ``cache-drop`` (cache): after a prompt-cache hit the first generated token is dropped;
- ``cache-short-save`` (cache, spec arm only): a cache entry saved under speculation
  is one token short, so a hit decodes as if the last reused token were missing;
- ``batch-leak`` (concurrency): a request batched behind another decodes on a prompt
  whose last token is its batch-mate's;
- ``models-500`` (liveness): ``GET /v1/models`` answers 500;
- ``spec-off`` (speculation): the draft model is loaded and never used;
- ``no-template`` (a set-up failure: cannot grade): chat requests are refused with
  transformers' "no chat template" error;
- ``no-token-ids`` (none: a limitation): token-id prompts are refused (HTTP 400), as
  mlx-lm's server refuses them; the checks fall back to text where the ids round-trip;
- ``crash-start`` (a set-up failure: cannot grade): exits at start with a log line;
- ``slow`` (none: a correct but slow server, must pass): 0.2 s per answer, 10 ms per event;
- ``hang`` / ``die``: stops answering (sleeps) / exits from the 3rd generation request on.

``python -m tests.fake_server --model DIR [--draft-model DIR] [--port N] [--bug NAME]
[--prompt-cache-size N]``.
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
        "stop-trailing-logprob", "logprob-off", "cache-drop", "cache-short-save", "batch-leak", "models-500",
        "spec-off", "no-template", "no-token-ids", "crash-start", "slow", "hang", "die")
NO_TEMPLATE = ("Cannot use chat template functions because tokenizer.chat_template is not set and no template "
               "argument was passed!")


def bf16(x: float) -> float:
    """``x`` rounded to bfloat16 (round to nearest even), as a float."""
    (u,) = struct.unpack("<I", struct.pack("<f", x))
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return float(struct.unpack("<f", struct.pack("<I", u))[0])


class Job:
    def __init__(self, prompt: list[int], max_tokens: int, stop: list[str]) -> None:
        self.prompt, self.max_tokens, self.stop = prompt, max_tokens, stop
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
        threading.Thread(target=self._work, daemon=True).start()
        self.path, self.num_draft = model, num_draft
        self.batch_window = batch_window
        self.model, self.tok, self.draft = self._call(self._load, model, draft)
        self.eos = tuple(sorted(self.tok.eos_token_ids))
        self.reset(bug, prompt_cache_size)

    def reset(self, bug: str | None = None, prompt_cache_size: int = 16) -> None:
        """A fresh server state (as a new process would have): cache, counters and stats cleared."""
        if bug is not None and bug not in BUGS:
            raise ValueError(f"unknown bug {bug!r}; known: {', '.join(BUGS)}")
        self.bug, self.cache_size = bug, prompt_cache_size
        self.cache: list[tuple[int, ...]] = []
        self.requests = 0
        self.drafted = self.accepted = 0
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
            t_end = time.monotonic() + self.batch_window
            while len(batch) < self.stats["inflight"]:  # batching, crudely: the requests in flight now
                try:
                    more = self._jobs.get(timeout=max(0.0, t_end - time.monotonic()))
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
                    results.append(self._generate(job, batch[0] if k else None))
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
        if not chat:
            p = body["prompt"]
            if isinstance(p, list) and self.bug == "no-token-ids":
                raise ValueError("prompt must be a string")
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
            return list(self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        from mlx_lm.server import convert_chat

        return list(self.tok.encode(convert_chat(msgs, body.get("role_mapping"))))

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

    def generate(self, prompt: list[int], max_tokens: int, stop: list[str]) -> dict[str, Any]:
        job = Job(prompt, max_tokens, stop)
        self._jobs.put([job])
        return job.future.result()

    def _generate(self, job: Job, first: Job | None) -> dict[str, Any]:
        from engine.executor import GenerationParams, plain_generate, spec_generate

        prompt, max_tokens, stop = list(job.prompt), job.max_tokens, job.stop
        self.requests += 1
        if self.bug == "hang" and self.requests >= 3:
            time.sleep(3600)
        if self.bug == "die" and self.requests >= 3:
            os._exit(3)
        cached = self._cached(prompt)
        spec = self.draft is not None and self.bug != "spec-off"
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
            if stop and any(s in self.tok.decode(out) for s in stop):
                hit_at.append(len(out))
                return self.bug == "stop-trailing-logprob"
            return True

        params = GenerationParams(max_tokens=budget, gamma=self.num_draft if spec else 0, eos_ids=self.eos,
                                  cache_digests=False)
        if spec:
            from engine.sources.two_model import TwoModelProvider

            prov = TwoModelProvider(self.draft.model, draft_tokenizer=self.draft.tokenizer)
            res = spec_generate(self.model, prov, run_prompt, params, on_token=on_token)
            if res.speculation is not None:
                self.drafted += res.speculation.drafted
                self.accepted += res.speculation.accepted
        else:
            res = plain_generate(self.model, run_prompt, params, on_token=on_token)
        ids = list(res.output_ids)
        n_gen = res.usage.generation_tokens
        eos_end = res.usage.finish_reason == "stop" and n_gen > len(res.output_ids) and not hit_at
        if self.cache_size > 0:
            self.cache.append(tuple(prompt + ids))
            del self.cache[: -self.cache_size]
        if self.bug == "cache-drop" and cached >= 2 and ids:
            ids = ids[1:]
        n_usage = hit_at[0] if hit_at else len(ids)
        return {"ids": ids, "finish": "stop" if hit_at else res.usage.finish_reason, "eos": eos_end,
                "cached": cached, "top": self._top(run_prompt, ids), "n_usage": n_usage, "stopped": bool(hit_at)}

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
                self._json(200, {"status": "ok"})
            elif self.path.startswith("/v1/models"):
                if engine.bug == "models-500":
                    self._json(500, {"error": "internal error"})
                    return
                self._json(200, {"object": "list", "data": [{"id": "default_model", "object": "model",
                                                             "created": int(time.time())}]})
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
            if not chat and self.path != "/v1/completions":
                self._json(404, {"error": "Not Found"})
                return
            with engine._lock:
                engine.stats["inflight"] += 1
                engine.stats["max_inflight"] = max(engine.stats["max_inflight"], engine.stats["inflight"])
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
                prompt = engine.prompt(body, chat)
            except LookupError as exc:
                self._json(500, {"error": str(exc)})
                return
            except (ValueError, KeyError, TypeError) as exc:
                self._json(400, {"error": str(exc)})
                return
            r = engine.generate(prompt, max_tokens, stop)
            if engine.bug == "slow":
                time.sleep(0.2)
            self._respond(body, chat, prompt, r, stop)

        def _respond(self, body: dict[str, Any], chat: bool, prompt: list[int], r: dict[str, Any],
                     stop: list[str]) -> None:
            tok = engine.tok
            ids = r["ids"]
            text = tok.decode(ids)
            for s in stop:
                if s in text:
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

            if not stream:
                lp = None
                top_n = int(body.get("top_logprobs", -1) or -1)
                if top_n > 0:
                    lp = {"content": [
                        {"id": t, "token": tok.convert_ids_to_tokens(t), "logprob": g,
                         "top_logprobs": [{"id": j, "token": tok.convert_ids_to_tokens(j), "logprob": v}
                                          for j, v in top[:top_n]]}
                        for t, (g, top) in zip(ids, r["top"], strict=True)]}
                elif body.get("logprobs"):
                    lp = {"content": [{"id": t, "logprob": g} for t, (g, _) in zip(ids, r["top"], strict=True)]}
                self._json(200, {**base, "choices": [choice(text, finish, lp)], "usage": usage})
                return
            self.send_response(200)
            self.send_header("Content-type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            st = StreamText(tok.decode)
            sent, n_delta = "", 0
            for k in range(1, len(ids) + 1):
                new = st.delta(ids[:k], final=k == len(ids))
                if not new or len(sent) >= len(text):
                    continue
                new = new[: max(0, len(text) - len(sent))]  # never past a stop string
                n_delta += 1
                piece = new
                if engine.bug == "stream-drop-byte" and n_delta == 2:
                    piece = new.encode("utf-8")[:-1].decode("utf-8", "replace")
                self._event({**base, "choices": [choice(piece, None)]})
                sent += new
            if len(text) > len(sent):  # e.g. the leaked EOS text
                self._event({**base, "choices": [choice(text[len(sent):], None)]})
            self._event({**base, "choices": [choice("", finish)]})
            if (body.get("stream_options") or {}).get("include_usage"):
                self._event({**base, "object": "chat.completion", "choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

        def _event(self, doc: dict[str, Any]) -> None:
            if engine.bug == "slow":
                time.sleep(0.01)
            self.wfile.write(f"data: {json.dumps(doc)}\n\n".encode())
            self.wfile.flush()

    return Handler


def serve(engine: FakeEngine, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A started server (``.server_address`` has the port); ``shutdown()`` + ``server_close()`` stop it."""
    httpd = ThreadingHTTPServer((host, port), make_handler(engine))
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
    a = p.parse_args(argv)
    if a.bug == "crash-start":
        print("RuntimeError: quantized KV cache needs mlx-vlm, which is not installed", file=sys.stderr, flush=True)
        return 1
    engine = FakeEngine(a.model, a.draft_model, a.num_draft_tokens, a.bug, a.prompt_cache_size)
    httpd = ThreadingHTTPServer((a.host, a.port), make_handler(engine, a.control))
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
    """A launcher for ``specparity.served.grade_arms`` over long-lived fake server processes.

    One ``python -m tests.fake_server --control`` process per (model, draft) is started once
    and kept (a model loads in seconds; MLX streams belong to a thread, so the fake cannot share
    the grader's process); each launch resets it through its control route (a fresh server
    state: empty prompt cache, counters and stats, ``bug`` planted, the prompt cache off when
    asked). ``launches`` records (arm, cache_off) per launch and ``stats`` each launch's stats
    (``max_inflight``, ``max_batch``). A ``crash-start`` plant fails every launch as a server
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

        from specparity.served import free_port

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

        from specparity.served import Launch, ServeFailed
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
