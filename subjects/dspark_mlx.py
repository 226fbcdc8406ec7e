"""dspark-mlx 0.1.0 (PyPI ``dspark-mlx``), driven unmodified through its Python API.

Reference: ``dspark_mlx/loader.py`` ``load_draft`` (drafter from a local
checkpoint dir, keys through the arch's ``key_map``) and ``load_host`` (an
mlx-lm host for non-Gemma drafters: ``hosts/mlx_lm.py`` ``MlxLmHostAdapter``;
Gemma 4 through mlx-vlm), and ``dspark_mlx/generate.py`` ``generate(adapter,
drafter, prompt_tokens, max_new_tokens, eos_id)``: a generator of
``TokenEvent(token, n_accepted)`` events (greedy, lossless accept).

Drafter: a tiny Qwen3 DSpark drafter in dspark-mlx's own checkpoint format,
built by instantiating its ``arch/qwen3.py`` ``Qwen3DSparkDrafter`` from a
config derived from the zoo ``qwen3`` target (taps 0, 1; block 4) and saving
its seeded random parameters under the checkpoint keys ``qwen3_key_map`` reads
back (``backbone.`` prefix dropped). A random drafter still exercises reject
(and occasional accept) paths. On the zoo ``gemma4`` target the drafter is the
DeepSpec-layout Gemma 4 DSpark drafter of ``subjects/drafters.py`` (dspark-mlx's
``arch/gemma4.py`` reads that layout) and the host is its mlx-vlm
``Gemma4UnifiedHostAdapter``. EOS: the single ``eos_id``. No stop ids, no
temperature, no finish reason. Counters: the ``TokenEvent.n_accepted`` of a
round is reported on every token of that round; the stream is cut into rounds
of ``n_accepted + 1`` tokens (``block_size - 1`` drafts each), and the counters
check holds those reports against the stream. Trace level: token.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import zoo
from subjects import Mode
from subjects.base import RoundReport, SubjectCase, SubjectRun, timed
from subjects.common import case_mode, dist_version, eos_for, prompt_ids, require_module

NAME = "dspark-mlx"
_NO_STOP = "generate() takes one eos_id, no stop ids"
_GREEDY = "generate() is greedy only (no temperature parameter)"
MODES = {
    "dspark": Mode(targets=("qwen3",), drafter="qwen3-dspark-mlx-random",
                   note="dspark_mlx.generate with a tiny random Qwen3 DSpark drafter in its own format",
                   unsupported={"stop": _NO_STOP, "distribution": _GREEDY}),
    "dspark-gemma4": Mode(targets=("gemma4",), drafter="gemma4-deepspec-taps01",
                          note="dspark_mlx.generate, Gemma 4 host (mlx-vlm load), DeepSpec-format zoo "
                               "drafter (taps 0,1)",
                          unsupported={"stop": _NO_STOP, "distribution": _GREEDY}),
}


def require() -> None:
    require_module("dspark_mlx.loader", NAME)


def version() -> str:
    return dist_version("dspark-mlx")


def _config(target: str) -> dict[str, Any]:
    t = json.loads((zoo.model_dir(target) / "config.json").read_text())
    return {
        "model_type": "qwen3", "vocab_size": t["vocab_size"], "hidden_size": t["hidden_size"],
        "num_hidden_layers": 1, "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"], "head_dim": t.get("head_dim", 16),
        "intermediate_size": t["intermediate_size"], "rms_norm_eps": t["rms_norm_eps"],
        "rope_theta": t.get("rope_theta", 1000000.0), "target_layer_ids": [0, 1],
        "num_target_layers": t["num_hidden_layers"], "block_size": 4, "mask_token_id": t["vocab_size"] - 1,
        "markov_rank": 16, "enable_confidence_head": True, "confidence_head_with_markov": True,
        "max_position_embeddings": 512,
    }


@cache
def drafter_dir(target: str) -> str:
    import mlx.core as mx
    from dspark_mlx.arch.qwen3 import build
    from mlx.utils import tree_flatten

    from subjects.drafters import subjects_dir

    d = subjects_dir() / f"dspark-mlx-{version()}-{target}-random"
    if not (d / ".complete").exists():
        d.mkdir(parents=True, exist_ok=True)
        cfg = _config(target)
        mx.random.seed(0)
        drafter = build(cfg, max_seq_len=512)
        params = {}
        for k, v in tree_flatten(drafter.parameters()):
            key = k[len("backbone."):] if k.startswith("backbone.") else k
            params[key] = v
        mx.save_safetensors(str(d / "model.safetensors"), params)
        (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        (d / ".complete").write_text("")
    return str(d)


def drafter_path(case: SubjectCase) -> str | None:
    return _drafter_for(case.target)


def _drafter_for(target: str) -> str:
    if target == "gemma4":  # DeepSpec's own Gemma 4 layout, which dspark-mlx's gemma4 arch reads
        from subjects.drafters import deepspec_drafter

        return str(deepspec_drafter(target))
    return drafter_dir(target)


@cache
def _loaded(target: str) -> tuple[Any, Any, Any]:
    from dspark_mlx.loader import load_draft, load_host

    drafter, cfg = load_draft(_drafter_for(target), max_seq_len=512)
    _model, _tok, adapter = load_host(str(zoo.model_dir(target)), cfg)
    return drafter, adapter, cfg


def generate(case: SubjectCase) -> SubjectRun:
    import importlib

    case_mode(case, MODES, "dspark-mlx", stop=_NO_STOP, greedy=_GREEDY, single_eos=True)
    eos = eos_for(case.eos_ids)
    gen_mod = importlib.import_module("dspark_mlx.generate")
    drafter, adapter, _cfg = _loaded(case.target)
    # the loaders build fresh state per load; reload so every request starts from empty caches
    _loaded.cache_clear()
    drafter, adapter, _cfg = _loaded(case.target)
    events, wall = timed(lambda: list(gen_mod.generate(adapter, drafter, list(prompt_ids(case.prompt_id)),
                                                       case.max_tokens, eos_id=next(iter(eos)) if eos else None)))
    toks = [e for e in events if hasattr(e, "token")]
    stream = [int(e.token) for e in toks]
    return SubjectRun(stream=stream, finish_reason=None, hooks=["dspark_mlx.generate.generate (TokenEvent)",
                                                                "dspark_mlx.loader.load_draft/load_host"],
                      rounds=_rounds(toks, int(_cfg["block_size"]) - 1) or None, wall_s=wall)


def _rounds(toks: list[Any], drafted: int) -> list[RoundReport]:
    """Rounds from ``TokenEvent.n_accepted`` (the round's accepted count, on each of its tokens).

    A round emits its accepted drafts + one target token, so a run of ``m + 1`` tokens carrying
    ``n_accepted == m`` is one round (the last may be cut by the budget or an EOS).
    """
    out: list[RoundReport] = []
    i = 0
    while i < len(toks):
        m = int(toks[i].n_accepted)
        j = i
        while j < len(toks) and j - i < m + 1 and int(toks[j].n_accepted) == m:
            j += 1
        out.append(RoundReport(drafted=drafted, accepted=m, committed=j - i))
        i = j
    return out
