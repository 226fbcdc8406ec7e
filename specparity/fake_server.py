"""A small OpenAI-compatible server over real in-process decode, with planted-bug modes.

A test double for the served-engine checks (``subjects/served.py``): it speaks
the API of mlx-lm 0.32.2 ``mlx_lm/server.py`` with the same response shapes
(``APIHandler.generate_response`` / ``handle_completion`` /
``completion_usage_response`` / ``handle_health_check``: ``/v1/completions``,
``/v1/chat/completions``, SSE streaming with ``stream_options.include_usage``,
``/health``, ``/v1/models``, ``max_tokens``, ``stop``, ``logprobs`` /
``top_logprobs`` as ``choices[0].logprobs.content``, ``usage`` with
``prompt_tokens_details.cached_tokens``, ``finish_reason``). Prompts are built
as mlx-lm's ``ResponseGenerator._tokenize`` builds them (the tokenizer's
encoding; its chat template, or ``mlx_lm.server.convert_chat`` without one).
Decoding is our engine's greedy plain decode (``engine.executor.plain_generate``)
or, with ``--draft-model``, its speculative decode (``spec_generate``, two-model);
a prompt cache remembers every prompt + output sequence served and reports the
longest cached prefix as ``cached_tokens``. Stop strings end the text right
before their first occurrence (OpenAI semantics; the token that completes one is
the last generated). The top logprobs come from one forward of prompt + output.

Planted bugs (``--bug NAME``, or ``SPECPARITY_FAKE_SERVER_BUG``), each a
mistake a real server can make:

- ``overrun``: a budget that is not a multiple of 4 (ends inside a round) gets one token too many;
- ``cache-drop``: after a prompt-cache hit the first generated token is dropped;
- ``usage-reencode``: ``completion_tokens`` counted by re-encoding the returned text;
- ``eos-leak``: the EOS token's text is appended when generation ends on EOS;
- ``finish-label``: ``finish_reason`` 'stop' when the budget ends generation;
- ``hang``: stops answering (sleeps) from the 3rd generation request on;
- ``die``: exits from the 3rd generation request on.

``python -m specparity.fake_server --model DIR [--draft-model DIR] [--port N] [--bug NAME]``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

BUGS = ("overrun", "cache-drop", "usage-reencode", "eos-leak", "finish-label", "hang", "die")


class FakeEngine:
    """The model, its tokenizer, the decode and the prompt cache.

    Every MLX call runs on one worker thread (as mlx-lm's server runs its
    generation thread): MLX streams belong to the thread that made them, and
    requests are served one at a time.
    """

    def __init__(self, model: str, draft: str | None = None, num_draft: int = 3, bug: str | None = None) -> None:
        if bug is not None and bug not in BUGS:
            raise ValueError(f"unknown bug {bug!r}; known: {', '.join(BUGS)}")
        self._jobs: queue.Queue[tuple[Any, tuple[Any, ...], Future[Any]]] = queue.Queue()
        threading.Thread(target=self._work, daemon=True).start()
        self.path, self.num_draft, self.bug = model, num_draft, bug
        self.model, self.tok, self.draft = self.call(self._load, model, draft)
        self.eos = tuple(sorted(self.tok.eos_token_ids))
        self.cache: list[tuple[int, ...]] = []
        self.requests = 0

    def _work(self) -> None:
        while True:
            fn, args, fut = self._jobs.get()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
                fut.set_exception(exc)

    def call(self, fn: Any, *args: Any) -> Any:
        fut: Future[Any] = Future()
        self._jobs.put((fn, args, fut))
        return fut.result()

    @staticmethod
    def _load(model: str, draft: str | None) -> tuple[Any, Any, Any]:
        from engine.models import load

        loaded = load(model)
        return loaded.model, loaded.tokenizer, load(draft) if draft else None

    def prompt(self, body: dict[str, Any], chat: bool) -> list[int]:
        if not chat:
            return list(self.tok.encode(body["prompt"]))
        msgs = body["messages"]
        if self.tok.has_chat_template:
            return list(self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        from mlx_lm.server import convert_chat

        return list(self.tok.encode(convert_chat(msgs, body.get("role_mapping"))))

    def _cached(self, prompt: list[int]) -> int:
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
        return self.call(self._generate, prompt, max_tokens, stop)

    def _generate(self, prompt: list[int], max_tokens: int, stop: list[str]) -> dict[str, Any]:
        from engine.executor import GenerationParams, plain_generate, spec_generate

        self.requests += 1
        if self.bug == "hang" and self.requests >= 3:
            time.sleep(3600)
        if self.bug == "die" and self.requests >= 3:
            os._exit(3)
        budget = max_tokens + 1 if self.bug == "overrun" and max_tokens % 4 else max_tokens
        out: list[int] = []

        def on_token(t: int) -> bool:
            out.append(t)
            return not (stop and any(s in self.tok.decode(out) for s in stop))

        params = GenerationParams(max_tokens=budget, gamma=self.num_draft if self.draft else 0,
                                  eos_ids=self.eos, cache_digests=False)
        if self.draft is not None:
            from engine.sources.two_model import TwoModelProvider

            prov = TwoModelProvider(self.draft.model, draft_tokenizer=self.draft.tokenizer)
            res = spec_generate(self.model, prov, prompt, params, on_token=on_token)
        else:
            res = plain_generate(self.model, prompt, params, on_token=on_token)
        ids = list(res.output_ids)
        cached = self._cached(prompt)
        self.cache.append(tuple(prompt + ids))
        del self.cache[:-16]
        if self.bug == "cache-drop" and cached > 0 and ids:
            ids = ids[1:]
        top = self._top(prompt, ids)
        n_gen = res.usage.generation_tokens
        eos_end = res.usage.finish_reason == "stop" and n_gen > len(res.output_ids)
        return {"ids": ids, "finish": res.usage.finish_reason, "n_gen": n_gen, "eos": eos_end,
                "cached": cached, "top": top}

    def _top(self, prompt: list[int], ids: list[int]) -> list[tuple[float, list[tuple[int, float]]]]:
        import mlx.core as mx

        if not ids:
            return []
        logits = self.model(mx.array([prompt + ids]))[0, len(prompt) - 1 : len(prompt) + len(ids) - 1]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        order = mx.argsort(-lp, axis=-1)[:, :11]
        lp_l, order_l = lp.tolist(), order.tolist()
        return [(lp_l[i][t], [(j, lp_l[i][j]) for j in order_l[i]]) for i, t in enumerate(ids)]


def make_handler(engine: FakeEngine) -> type[BaseHTTPRequestHandler]:
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
                self._json(200, {"object": "list", "data": [{"id": engine.path, "object": "model",
                                                             "created": int(time.time())}]})
            else:
                self._json(404, {"error": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802
            chat = self.path in ("/v1/chat/completions", "/chat/completions")
            if not chat and self.path != "/v1/completions":
                self._json(404, {"error": "Not Found"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens", 512))
                stop = body.get("stop") or []
                stop = [stop] if isinstance(stop, str) else list(stop)
                prompt = engine.prompt(body, chat)
            except (ValueError, KeyError, TypeError) as exc:
                self._json(400, {"error": str(exc)})
                return
            r = engine.generate(prompt, max_tokens, stop)
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
            n_out = len(tok.encode(text, add_special_tokens=False)) if engine.bug == "usage-reencode" \
                else len(ids) + (1 if r["eos"] else 0)
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
            sent = ""
            for k in range(1, len(ids) + 1):
                piece = tok.decode(ids[:k])
                cut = min([len(piece)] + [piece.find(s) for s in stop if s in piece])
                new = piece[:cut][len(sent):]
                if new:
                    self._event({**base, "choices": [choice(new, None)]})
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
            self.wfile.write(f"data: {json.dumps(doc)}\n\n".encode())
            self.wfile.flush()

    return Handler


def serve(engine: FakeEngine, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A started server (``.server_address`` has the port); ``shutdown()`` stops it."""
    httpd = ThreadingHTTPServer((host, port), make_handler(engine))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specparity.fake_server", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--bug", choices=BUGS, default=os.environ.get("SPECPARITY_FAKE_SERVER_BUG") or None)
    a = p.parse_args(argv)
    engine = FakeEngine(a.model, a.draft_model, a.num_draft_tokens, a.bug)
    httpd = ThreadingHTTPServer((a.host, a.port), make_handler(engine))
    httpd.daemon_threads = True
    print(f"fake server on http://{a.host}:{httpd.server_address[1]} (bug: {a.bug})", file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
