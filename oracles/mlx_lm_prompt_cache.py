"""Reference: mlx-lm 0.32.2's own prompt-cache path with a draft model, driven in process.

Mirrors ``mlx_lm/server.py`` ``ResponseGenerator._serve_single`` exactly, unmodified
pieces only: ``LRUPromptCache`` (``mlx_lm/models/cache.py``) keyed by
``(model, tokens)``; ``fetch_nearest_cache(model_key, prompt)`` gives a deep copy
of the nearest entry and the tokens still to process (``rest``); a miss makes
``make_prompt_cache(model) + make_prompt_cache(draft_model)`` — target and draft
caches in ONE list, as the server does; ``stream_generate(model, tokenizer, rest,
prompt_cache=cache, draft_model=..., num_draft_tokens=γ)``; every yielded token
(the final EOS response included) is appended to the key; then
``insert_cache(model_key, prompt + generated, cache)``.

The same session is graded against COLD runs (a fresh cache list, the whole
prompt): a warm request must emit the same tokens and leave the same target and
draft cache bytes (``traces.digest.cache_digest``). ``plain=True`` runs the same
path without the draft model (the server's plain lane) as the control.

No engine import (oracles are independent witnesses); the session's request
kinds come in as a ``next_prompt`` callable from the harness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from typing import Any

from oracles import OracleUnavailable

NextPrompt = Callable[[str, Sequence[int], Sequence[int], Sequence[int]], list[int]]


def require() -> None:
    try:
        from mlx_lm.models.cache import LRUPromptCache  # noqa: F401
    except ImportError as exc:  # pragma: no cover - where mlx-lm is absent or older
        raise OracleUnavailable("mlx-lm with LRUPromptCache is not installed") from exc


def version() -> str:
    return metadata.version("mlx-lm")


@dataclass
class Served:
    """One request as the server ran it: tokens, the cache bytes after it, the reused count."""

    tokens: list[int]
    finish: str | None
    cached: int  # prompt tokens the fetched cache claimed to hold (server: prompt_cache_count)
    target_digest: str
    draft_digest: str | None
    error: str | None = None


@cache
def _load(path: str) -> tuple[Any, Any]:
    from mlx_lm import load

    return load(path)  # type: ignore[return-value]


def _digest(caches: list[Any]) -> str:
    from traces.digest import cache_digest

    return str(cache_digest(caches)["combined"])


def serve(model: Any, tokenizer: Any, draft: Any | None, prompt_cache: Any, model_key: Any,
          prompt: Sequence[int], *, gamma: int, max_tokens: int, temperature: float, seed: int | None,
          warm: bool = True) -> Served:
    """One request through ``_serve_single``'s cache steps (``warm=False``: a fresh cache, no insert)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp=temperature)
    cache_key = list(prompt)
    cache, rest = (prompt_cache.fetch_nearest_cache(model_key, cache_key) if warm
                   else (None, cache_key))
    count = len(prompt) - len(rest)
    rest = list(prompt[count:])
    if cache is None:
        cache = make_prompt_cache(model)
        if draft is not None:
            cache += make_prompt_cache(draft)
    n_target = len(model.layers)
    out: list[int] = []
    finish = None
    error = None
    try:
        for gen in stream_generate(model=model, tokenizer=tokenizer, prompt=rest, max_tokens=max_tokens,
                                   sampler=sampler, prompt_cache=cache, draft_model=draft,
                                   num_draft_tokens=gamma):
            finish = gen.finish_reason
            cache_key.append(gen.token)
            if finish is None or finish == "length":
                out.append(int(gen.token))
            if finish is not None:
                break
    except Exception as exc:  # the server answers it as an error; recorded, never hidden
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if warm and error is None:
        prompt_cache.insert_cache(model_key, cache_key, cache)
    return Served(out, finish, count, _digest(cache[:n_target]),
                  _digest(cache[n_target:]) if draft is not None else None, error)


def run_session(target_dir: str, draft_dir: str | None, kinds: Sequence[str], first: Sequence[int],
                turns: Sequence[Sequence[int]], next_prompt: NextPrompt, *, gamma: int = 3,
                max_tokens: int = 16, temperature: float = 0.0, seed: int | None = 0,
                plain: bool = False) -> list[dict[str, Any]]:
    """Run a session warm through one ``LRUPromptCache`` and each request cold; one row per request.

    ``plain=True``: the same prompt-cache path without the draft model (the control).
    """
    from mlx_lm.models.cache import LRUPromptCache

    model, tokenizer = _load(str(target_dir))
    draft = None if plain or draft_dir is None else _load(str(draft_dir))[0]
    pc = LRUPromptCache()
    key = ("target", None, None if draft is None else "draft")
    rows: list[dict[str, Any]] = []
    prompt: list[int] = list(first)
    stream: list[int] = []
    for i, kind in enumerate(kinds):
        if i:
            prompt = next_prompt(kind, prompt, stream, turns[(i - 1) % len(turns)] if turns else first)
        kw = dict(gamma=gamma, max_tokens=max_tokens + i, temperature=temperature, seed=seed)
        w = serve(model, tokenizer, draft, pc, key, prompt, warm=True, **kw)  # type: ignore[arg-type]
        c = serve(model, tokenizer, draft, pc, key, prompt, warm=False, **kw)  # type: ignore[arg-type]
        why = None
        if w.error or c.error:
            why = f"error: warm {w.error} / cold {c.error}"
        elif w.tokens != c.tokens:
            j = next((k for k, (a, b) in enumerate(zip(w.tokens, c.tokens, strict=False)) if a != b),
                     min(len(w.tokens), len(c.tokens)))
            why = f"tokens differ at output position {j}"
        elif w.target_digest != c.target_digest:
            why = "target cache bytes differ"
        elif w.draft_digest != c.draft_digest:
            why = "draft cache bytes differ"
        rows.append({"index": i, "kind": kind, "prompt_tokens": len(prompt), "cached": w.cached,
                     "cold_error": c.error,
                     "identical": why is None, "divergence": why,
                     "tokens_identical": w.tokens == c.tokens and not (w.error or c.error)})
        stream = [*prompt, *w.tokens]
    return rows
