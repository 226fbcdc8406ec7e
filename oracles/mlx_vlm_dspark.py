"""Oracle runner for mlx-vlm's DSpark drafters: the second DSpark reference.

Reference: mlx-vlm 0.7.10 (own environment: ``tox -e vlm-dspark``):
``mlx_vlm/generate/ar.py`` ``generate_step`` with ``draft_kind="dflash"``
(full prefill, the first token from the prefill, hidden taps via
``capture_layer_ids``) → ``mlx_vlm/speculative/dflash.py`` ``_dflash_rounds``
(draft → verify → ``_speculative_walk`` → ``commit_speculative_round``), with
the drafters ``speculative/drafters/gemma4_dspark`` (``Gemma4DSparkDraftModel``,
their port of DeepSpec's ``Gemma4DSparkModel``) and ``drafters/dspark``
(``DSparkDraftModel``, the generic DSpark drafter over a Qwen-style DFlash
backbone), loaded by ``speculative.drafters.load_drafter``. The loop and the
drafters run UNMODIFIED. Instrumentation from outside:

- ``dflash._speculative_walk`` (a module global the loop calls once per round)
  is wrapped to record each round's drafts, the target's greedy tokens, the
  accepted count and the new tokens;
- the adapted target (below) records every forward's logits, for the
  top-1/top-2 margins (``generate_step`` runs at temperature 0, mlx-vlm's
  greedy path: ``_dflash_verify_greedy`` + ``_speculative_walk``);
- the TARGET is the zoo target loaded by mlx-lm, adapted to the protocol
  mlx-vlm's DSpark loop requires of a target language model (mlx-vlm's own
  ``gemma4_text`` has neither ``capture_layer_ids`` nor
  ``rollback_speculative_cache``, and its ``gemma4`` language model ties the
  lm-head, which the zoo target does not): ``__call__(…, capture_layer_ids)``
  returns the logits and the tapped layer outputs (``engine``-free taps,
  below), ``rollback_speculative_cache`` trims the mlx-lm caches to the
  accepted prefix, and ``embed_tokens`` / ``embed_scale`` / ``lm_head`` are
  the target's own.

mlx-vlm's loop applies no confidence-scheduled pruning (the confidence head is
loaded but never consulted), so its rounds are comparable at threshold 0 only;
``confidence`` is recorded as null. EOS is the consumer's business in mlx-vlm
(``stream_generate`` stops on it); the runner stops where the engine does.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

from oracles import OracleUnavailable
from oracles.recording import accept_walk
from traces.records import counters_from_rounds

NAME = "mlx_vlm_dspark"


def require() -> None:
    try:
        import mlx_vlm.speculative.dflash  # noqa: F401
        import mlx_vlm.speculative.drafters  # noqa: F401
    except ImportError as exc:
        raise OracleUnavailable("mlx-vlm is not installed") from exc


def version() -> str:
    return metadata.version("mlx-vlm")


@contextmanager
def _taps(model: Any, ids: list[int]):  # noqa: ANN202
    """Record ``model.layers[i]`` outputs (a class swap, as ``engine.taps`` does; no import of engine)."""
    captured: dict[int, Any] = {}
    swapped = []
    try:
        for i in ids:
            layer = model.layers[i]
            original = type(layer)

            def call(self: Any, *a: Any, _i: int = i, _c: type = original, **k: Any) -> Any:
                out = _c.__call__(self, *a, **k)
                captured[_i] = out[0] if isinstance(out, tuple) else out
                return out

            layer.__class__ = type(f"Tapped{original.__name__}", (original,), {"__call__": call})
            swapped.append((layer, original))
        yield captured
    finally:
        for layer, original in swapped:
            layer.__class__ = original


def _adapt(target: Any, logits_log: list[Any]) -> Any:
    """The zoo target (mlx-lm) behind the target interface mlx-vlm's DSpark loop calls."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.models.base import InputEmbeddingsFeatures, LanguageModelOutput

    class Config(dict):  # hidden_size / num_hidden_layers / vocab_size lookups
        __getattr__ = dict.get

    args = target.args
    cfg = Config(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                 vocab_size=args.vocab_size, eos_token_id=None)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = cfg
            self.target = target
            self.model = target.model  # embed_tokens, embed_scale, layers
            if hasattr(target, "lm_head"):
                self.lm_head = target.lm_head

        @property
        def layers(self) -> Any:
            return target.layers

        def make_cache(self) -> list[Any]:
            return make_prompt_cache(target)

        def __call__(self, inputs: Any = None, cache: Any = None, capture_layer_ids: Any = None, **kw: Any) -> Any:
            if inputs is None:
                inputs = kw.get("input_ids")
            ids = list(capture_layer_ids or [])
            with _taps(target, ids) as cap:
                logits = target(inputs, cache=cache)
            logits_log.append(logits)
            out = LanguageModelOutput(logits=logits, hidden_states=[cap[i] for i in ids] if ids else None)
            out.gdn_states = None  # type: ignore[attr-defined]
            return out

        def rollback_speculative_cache(self, caches: list[Any], gdn_states: Any, accepted: Any, block_size: int) -> int:
            a = int(accepted if isinstance(accepted, int) else mx.array(accepted).max().item())
            trim = block_size - (a + 1)
            for c in caches:
                if trim > 0:
                    c.trim(trim)
            return trim

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.language_model = LM()
            self.config = cfg

        def __call__(self, input_ids: Any, pixel_values: Any = None, mask: Any = None, cache: Any = None,
                     **kw: Any) -> Any:
            return self.language_model(input_ids, cache=cache, **kw)

        def get_input_embeddings(self, input_ids: Any = None, pixel_values: Any = None, **kw: Any) -> Any:
            # the target embeds its own token ids (LM.__call__ ignores inputs_embeds)
            return InputEmbeddingsFeatures(inputs_embeds=target.model.embed_tokens(input_ids))

        @property
        def layers(self) -> Any:
            return target.layers

    return Model()


def run(
    target: Any,
    drafter_dir: Path | str,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    eos_ids: list[int],
) -> list[dict[str, Any]]:
    """mlx-vlm's DSpark loop on one prompt; the trace records after the header."""
    require()
    import mlx.core as mx
    import mlx_vlm.speculative.dflash as dfl
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.drafters import load_drafter

    t0 = time.perf_counter()
    draft, kind = load_drafter(str(drafter_dir))
    logits_log: list[Any] = []  # every target forward's logits (prefill chunks, verify windows)
    model = _adapt(target, logits_log)

    walks: list[dict[str, Any]] = []
    original_walk = dfl._speculative_walk

    def walk(draft_tokens: Any, target_tokens: Any, budget: int) -> Any:
        accepted, new_tokens = original_walk(draft_tokens, target_tokens, budget)
        walks.append({"drafts": [int(t) for t in draft_tokens.reshape(-1).tolist()],
                      "targets": [int(t) for t in target_tokens.reshape(-1).tolist()],
                      "accepted": int(accepted), "new": [int(t) for t in new_tokens],
                      "logits": logits_log[-1]})
        return accepted, new_tokens

    eos = set(eos_ids)
    stream: list[int] = []
    dfl._speculative_walk = walk
    try:
        gen = generate_step(mx.array([list(prompt_ids)]), model, None, None, max_tokens=max_tokens,
                            draft_model=draft, draft_kind=kind, temperature=0.0)
        for tok, _ in gen:
            t = int(tok if isinstance(tok, int) else mx.array(tok).reshape(-1)[0].item())
            stream.append(t)
            if t in eos or len(stream) >= max_tokens:
                break
        gen.close()
    finally:
        dfl._speculative_walk = original_walk
    first_logits = logits_log[len(logits_log) - len(walks) - 1]  # the forward before the first verify
    return _rebuild(prompt_ids, first_logits, walks, stream, max_tokens, eos, time.perf_counter() - t0)


def _margins(logits: Any) -> list[float]:
    import mlx.core as mx

    row = logits.reshape(-1, logits.shape[-1]).astype(mx.float32)
    top = mx.sort(row, axis=-1)[:, -2:]
    return [float(x) for x in (top[:, 1] - top[:, 0]).tolist()]


def _rebuild(prompt_ids: list[int], first_logits: Any, walks: list[dict[str, Any]], stream: list[int],
             max_tokens: int, eos: set[int], wall: float) -> list[dict[str, Any]]:
    body: list[dict[str, Any]] = [{"type": "prefill", "target_tokens": list(prompt_ids), "drafter_tokens": [],
                                   "target_cache_digest": None, "drafter_cache_digest": None}]
    first = stream[0]
    end0 = "eos" if first in eos else ("budget" if max_tokens == 1 else None)
    body.append({"type": "plain", "index": 0, "input": [prompt_ids[-1]], "sample": first,
                 "margin": _margins(first_logits[..., -1:, :])[-1], "emitted": [] if first in eos else [first],
                 "end": end0, "reason": "initial", "target_cache_digest": None, "time_s": None})
    out = [] if first in eos else [first]
    pending = first
    feed = [first]
    rounds = []
    for i, w in enumerate(walks):
        if end0 is not None:
            break
        drafts, targets = w["drafts"], w["targets"]
        samples, emitted, k, end = accept_walk(drafts, targets, eos, len(out), max_tokens)
        expected = (drafts[:k] + targets[k : k + 1])
        if end not in ("eos", "budget") and (k != w["accepted"] or w["new"] != expected):
            raise RuntimeError(f"mlx-vlm round {i}: rebuilt k={k} but its walk accepted {w['accepted']} → {w['new']}")
        rounds.append({"type": "round", "index": i, "feed": list(feed), "drafts": drafts,
                       "window": [pending, *drafts], "samples": samples, "k_accept": k, "emitted": emitted,
                       "end": end, "margins": _margins(w["logits"])[: len(drafts) + 1], "confidence": None,
                       "target_cache_digest": None, "drafter_cache_digest": None, "time_s": None})
        out += emitted
        if end in ("eos", "budget"):
            break
        pending = samples[-1]
        feed = [drafts[-1], pending] if drafts and k == len(drafts) else [pending]
    body += rounds
    if [t for t in stream if t not in eos] != out:
        raise RuntimeError(f"mlx-vlm: rebuilt output {out} differs from its stream {stream}")
    gen = len(out) + (1 if body[-1].get("end") == "eos" else 0)
    body.append({"type": "footer",
                 "usage": {"prompt_tokens": len(prompt_ids), "generation_tokens": gen,
                           "finish_reason": "stop" if body[-1].get("end") == "eos" else "length"},
                 "speculation": counters_from_rounds(rounds, n_plain=1), "output_ids": out, "wall_s": wall})
    return body


def draft_logits(target: Any, drafter_dir: Path | str, context: Any, anchor: int, float32: bool = True) -> Any:
    """mlx-vlm's drafter on one block: ``[B, V]`` base logits (before the Markov bias).

    ``context`` is the ``[L, m*H]`` tapped target rows the block attends to,
    ``anchor`` the block's first token; a fresh draft cache. For the draft-logit
    parity check of the port (``conformance/test_dspark_references.py``).
    """
    require()
    import mlx.core as mx
    from mlx_vlm.speculative.drafters import load_drafter

    draft, _kind = load_drafter(str(drafter_dir))
    if float32:
        draft.set_dtype(mx.float32)  # the stored bf16 values, computed in float32 (as the port and DeepSpec)
    draft.bind(_adapt(target, []))
    cache = draft.make_cache()
    c = draft.config
    inputs = mx.array([[anchor] + [int(c.mask_token_id)] * (int(c.proposal_length) - 1)])
    hidden = draft._hidden(inputs, context[None], cache)
    return draft._logits(hidden)[0]
