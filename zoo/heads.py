"""Zoo draft heads: MTP heads and Gemma assistant drafters, built from seeds.

Each head belongs to a zoo target and is written in the on-disk format its
reference loads:

- ``qwen35-mtp*``: a ``qwen3_5_mtp`` head for the ``qwen35`` target, mlx-vlm
  0.7.10 layout (``speculative/drafters/qwen3_5_mtp``: ``config.json`` with
  ``model_type``, ``block_size`` and the target's ``text_config`` plus
  ``mtp_num_hidden_layers``; tensors ``fc.weight``, ``pre_fc_norm_embedding``,
  ``pre_fc_norm_hidden``, ``layers.0.*`` (one full-attention qwen3_5 decoder
  layer), ``norm.weight``).
- ``gemma4-assistant*``: a ``gemma4_assistant`` drafter for the ``gemma4``
  target, HF layout as loaded by mlx-optiq 0.7.7
  (``optiq/runtime/spec/drafters/gemma_assistant.py``) and mlx-vlm
  (``speculative/drafters/gemma4_assistant``): ``model.embed_tokens``,
  ``model.layers.N.self_attn.{q_proj,o_proj,q_norm}`` (Q-only),
  ``model.layers.N.mlp.*``, four norms and ``layer_scalar`` per layer,
  ``model.norm``, ``pre_projection``, ``post_projection``; the centroid
  variants add ``masked_embedding.centroids.weight`` and
  ``masked_embedding.token_ordering``. The head is picked by TENSOR PRESENCE.

Variants: ``random`` (seeded; accepts ~nothing) and ``self`` (initialised
from the target's own layers, final norm and lm-head so that drafts are
accepted sometimes). Each head is pinned by sha256 in ``heads_manifest.json``
with its measured greedy acceptance (engine source, γ = 3, 32 tokens, the
first 8 prompts). ``python -m zoo.heads --update-manifest`` rebuilds
and re-measures (developer-only).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zoo.build import json_bytes

HERE = Path(__file__).resolve().parent
MANIFEST_FILE = HERE / "heads_manifest.json"
_CHECKED = ("model.safetensors", "config.json")


@dataclass(frozen=True)
class HeadRecipe:
    name: str
    kind: str  # "mtp" | "assistant"
    target: str  # zoo target name
    init: str  # "random" | "self"
    seed: int
    head: str = ""  # assistant: "tied" | "centroid"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


RECIPES: dict[str, HeadRecipe] = {
    r.name: r
    for r in (
        HeadRecipe("qwen35-mtp", "mtp", "qwen35", "random", 5905),
        HeadRecipe("qwen35-mtp-self", "mtp", "qwen35", "self", 5906),
        HeadRecipe("gemma4-assistant", "assistant", "gemma4", "random", 4905, "tied"),
        HeadRecipe("gemma4-assistant-self", "assistant", "gemma4", "self", 4906, "tied"),
        HeadRecipe("gemma4-assistant-centroid", "assistant", "gemma4", "random", 4907, "centroid"),
        HeadRecipe("gemma4-assistant-centroid-self", "assistant", "gemma4", "self", 4908, "centroid"),
    )
}
HEAD_NAMES = tuple(RECIPES)

# Assistant geometry: Q-only heads must match the target's K/V head dims.
ASSISTANT_RANDOM_HIDDEN = 32
ASSISTANT_CENTROIDS = 8
ASSISTANT_TOP_K = 4


class HeadDriftError(RuntimeError):
    """A built head (or its recipe) no longer matches ``heads_manifest.json``."""


def _rng(seed: int, name: str) -> np.random.Generator:
    from zoo.build import seeded_rng

    return seeded_rng(seed, name)


def _target_cfg(target: str) -> dict[str, Any]:
    from zoo.build import RECIPES as TARGETS
    from zoo.build import model_config

    return model_config(TARGETS[target])


def _target_weights(target: str) -> dict[str, np.ndarray]:
    from zoo.build import model_weights

    return model_weights(target)


def _random(seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = _rng(seed, name)
    if name.endswith("norm.weight") or name.endswith("layer_scalar"):
        w = 1.0 + 0.1 * rng.standard_normal(shape)
    elif name.endswith("embed_tokens.weight") or name.endswith("centroids.weight"):
        w = rng.standard_normal(shape)
    else:
        w = rng.standard_normal(shape) / np.sqrt(shape[-1])
    return w.astype(np.float32)


# ------------------------------------------------------------------------ MTP


def _mtp_config(r: HeadRecipe) -> dict[str, Any]:
    text = dict(_target_cfg(r.target))
    text["mtp_num_hidden_layers"] = 1
    # HF Qwen3.5 rope block (mlx-vlm requires mrope_section; text-only = one section).
    rot = int(text["head_dim"] * text["rope_parameters"]["partial_rotary_factor"]) // 2
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [rot, 0, 0]}
    return {
        "model_type": "qwen3_5_mtp",
        "architectures": ["Qwen3_5MTPDraftModel"],
        "block_size": 3,
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
        "text_config": text,
    }


def _mtp_weights(r: HeadRecipe, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    from engine.models import parameter_shapes
    from engine.sources.mtp import MTPHead

    shapes = parameter_shapes(MTPHead(cfg["text_config"]))
    out = {k: _random(r.seed, k, shapes[k]) for k in sorted(shapes)}
    if r.init == "self":
        # The target's last (full-attention) layer reads the next token's
        # embedding; its final norm closes the head. The target hidden enters
        # only faintly, so the head is a "skip the DeltaNet layer" model of it.
        tw = _target_weights(r.target)
        n = cfg["text_config"]["num_hidden_layers"]
        src = f"language_model.model.layers.{n - 1}."
        for k in out:
            if k.startswith("layers.0."):
                out[k] = tw[src + k[len("layers.0.") :]].copy()
        h = cfg["text_config"]["hidden_size"]
        fc = np.zeros((h, 2 * h), np.float32)
        fc[:, :h] = np.eye(h, dtype=np.float32)
        fc[:, h:] = 0.05 * np.eye(h, dtype=np.float32)
        out["fc.weight"] = fc
        out["pre_fc_norm_embedding.weight"] = np.ones(h, np.float32)
        out["pre_fc_norm_hidden.weight"] = np.ones(h, np.float32)
        out["norm.weight"] = tw["language_model.model.norm.weight"].copy()
    return out


# ------------------------------------------------------------------ assistant


def _assistant_config(r: HeadRecipe) -> dict[str, Any]:
    t = _target_cfg(r.target)
    backbone = int(t["hidden_size"])
    selfish = r.init == "self"
    hidden = backbone if selfish else ASSISTANT_RANDOM_HIDDEN
    layer_types = list(t["layer_types"]) if selfish else [
        "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"
    ]  # fmt: skip
    centroid = r.head == "centroid"
    text = {
        "model_type": "gemma4_text",
        "hidden_size": hidden,
        "intermediate_size": int(t["intermediate_size"]) if selfish else 2 * hidden,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": int(t["num_attention_heads"]),
        "num_key_value_heads": int(t["num_key_value_heads"]),
        "head_dim": int(t["head_dim"]),
        "global_head_dim": int(t["global_head_dim"]),
        "rms_norm_eps": float(t["rms_norm_eps"]),
        "layer_types": layer_types,
        "sliding_window": int(t["sliding_window"]),
        "max_position_embeddings": int(t["max_position_embeddings"]),
        "vocab_size": int(t["vocab_size"]),
        "tie_word_embeddings": True,
        "num_kv_shared_layers": len(layer_types),
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": int(t["vocab_size"]),
        "final_logit_softcapping": None,
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                               "partial_rotary_factor": 0.25},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    }  # fmt: skip
    return {
        "model_type": "gemma4_assistant",
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": backbone,
        "use_ordered_embeddings": centroid,
        "num_centroids": ASSISTANT_CENTROIDS if centroid else 0,
        "centroid_intermediate_top_k": ASSISTANT_TOP_K if centroid else 0,
        "tie_word_embeddings": True,
        "block_size": 4,
        "text_config": text,
    }


def _assistant_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    text = cfg["text_config"]
    h, inter, nh = text["hidden_size"], text["intermediate_size"], text["num_attention_heads"]
    b, v = cfg["backbone_hidden_size"], text["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "pre_projection.weight": (h, 2 * b),
        "post_projection.weight": (b, h),
    }
    for i, lt in enumerate(text["layer_types"]):
        hd = text["global_head_dim"] if lt == "full_attention" else text["head_dim"]
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (nh * hd, h),
            p + "self_attn.o_proj.weight": (h, nh * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "pre_feedforward_layernorm.weight": (h,),
            p + "post_feedforward_layernorm.weight": (h,),
            p + "layer_scalar": (1,),
        })  # fmt: skip
    if cfg["use_ordered_embeddings"]:
        shapes["masked_embedding.centroids.weight"] = (cfg["num_centroids"], h)
    return shapes


def _assistant_weights(r: HeadRecipe, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    shapes = _assistant_shapes(cfg)
    out: dict[str, Any] = {k: _random(r.seed, k, shapes[k]) for k in sorted(shapes)}
    v = cfg["text_config"]["vocab_size"]
    if r.init == "self":
        # The drafter's layers are the target's own (Q-only: they attend the
        # target's K/V of the same layer type), fed the scaled token embedding;
        # its tied head is the target's lm-head.
        tw = _target_weights(r.target)
        h = cfg["text_config"]["hidden_size"]
        for k in list(out):
            if k.startswith("model.layers."):
                out[k] = tw[k].copy()
        pre = np.zeros((h, 2 * h), np.float32)
        pre[:, :h] = np.eye(h, dtype=np.float32)
        out["pre_projection.weight"] = pre
        out["post_projection.weight"] = np.eye(h, dtype=np.float32)
        out["model.norm.weight"] = tw["model.norm.weight"].copy()
        out["model.embed_tokens.weight"] = tw["lm_head.weight"].copy()
    if cfg["use_ordered_embeddings"]:
        out["masked_embedding.token_ordering"] = _rng(r.seed, "token_ordering").permutation(v).astype(np.int64)
        if r.init == "self":
            # Centroids: the mean lm-head row of each centroid's token slice.
            emb = out["model.embed_tokens.weight"]
            order = out["masked_embedding.token_ordering"].reshape(cfg["num_centroids"], -1)
            out["masked_embedding.centroids.weight"] = emb[order].mean(axis=1).astype(np.float32)
    return out


# ---------------------------------------------------------------------- build


def head_config(name: str) -> dict[str, Any]:
    r = _recipe(name)
    return _mtp_config(r) if r.kind == "mtp" else _assistant_config(r)


def head_weights(name: str) -> dict[str, np.ndarray]:
    r = _recipe(name)
    cfg = head_config(name)
    return _mtp_weights(r, cfg) if r.kind == "mtp" else _assistant_weights(r, cfg)


def _recipe(name: str) -> HeadRecipe:
    if name not in RECIPES:
        raise ValueError(f"unknown zoo head {name!r}; valid: {', '.join(HEAD_NAMES)}")
    return RECIPES[name]


def write_head(name: str, out_dir: Path) -> Path:
    from zoo.build import save_checkpoint

    return save_checkpoint(out_dir, head_weights(name), head_config(name), tokenizer=False)


def manifest() -> dict[str, Any]:
    return json.loads(MANIFEST_FILE.read_text())


def _verify(name: str, d: Path) -> None:
    from zoo import config_digest, weights_digest

    entry = manifest()["heads"].get(name)
    if entry is None:
        raise HeadDriftError(f"zoo drift: head {name}: no entry in {MANIFEST_FILE}")
    if entry["recipe"] != RECIPES[name].to_json():
        raise HeadDriftError(f"zoo drift: head {name}: recipe differs from the manifest; "
                             "run `python -m zoo.heads --update-manifest` if intended")
    for fname, key, fn in (("model.safetensors", "weights_sha256", weights_digest),
                           ("config.json", "config_sha256", config_digest)):
        try:
            got = fn(d)
        except Exception as exc:  # unreadable is drift too
            raise HeadDriftError(f"zoo drift: head {name}: {fname} in {d} unreadable ({exc})") from exc
        if got != entry[key]:
            raise HeadDriftError(f"zoo drift: head {name}: {fname} in {d} has sha256 {got}, "
                                 f"manifest expects {entry[key]} (delete {d} to rebuild)")


def head_dir(name: str) -> Path:
    """Path of zoo head ``name``, built into the zoo cache on first use and verified."""
    from zoo import cache_root

    _recipe(name)
    entry = manifest()["heads"].get(name)
    if entry is None:
        raise HeadDriftError(f"zoo drift: head {name}: no entry in {MANIFEST_FILE}")
    from zoo import pinned

    return pinned.artifact(cache_root(), f"head-{name}-{entry['weights_sha256'][:8]}{entry['config_sha256'][:4]}",
                           lambda tmp: write_head(name, tmp), _CHECKED, lambda d: _verify(name, d),
                           lambda m: HeadDriftError(f"zoo drift: head {name}: {m}"))


def case_paths(target: str, drafter: str) -> tuple[Path, Path]:
    """``(target dir, head dir)`` of a zoo case: the locator the ``mtp`` and ``assistant``
    kinds name (``SourceKind.zoo``); ``drafter`` is the head's name."""
    from zoo import model_dir

    return model_dir(target), head_dir(drafter)


# ----------------------------------------------------------------- acceptance


def measure(name: str, path: Path, gamma: int = 3, max_tokens: int = 32, n_prompts: int = 8) -> dict[str, Any]:
    """Greedy acceptance and tokens per target forward of head ``name`` with the engine source."""
    from mlx_lm.utils import load_model

    import zoo
    from engine.executor import GenerationParams, spec_generate
    from engine.sources import make_provider

    r = RECIPES[name]
    target = load_model(zoo.model_dir(r.target))[0]
    provider = make_provider(r.kind, path=path)
    drafted = accepted = calls = tokens = 0
    for p in zoo.prompts()[:n_prompts]:
        res = spec_generate(target, provider, list(p.token_ids),
                            GenerationParams(max_tokens=max_tokens, gamma=gamma, cache_digests=False))
        s = res.speculation
        assert s is not None
        drafted += s.drafted
        accepted += s.accepted
        calls += s.target_calls
        tokens += res.usage.generation_tokens
    return {"gamma": gamma, "max_tokens": max_tokens, "prompts": n_prompts, "drafted": drafted,
            "accepted": accepted, "acceptance": round(accepted / drafted, 4) if drafted else None,
            "tokens_per_forward": round(tokens / calls, 4) if calls else None}


def build_manifest() -> dict[str, Any]:
    from zoo import config_digest, weights_digest

    heads = {}
    with tempfile.TemporaryDirectory(prefix="specparity-heads-") as tmp:
        for name in HEAD_NAMES:
            p = write_head(name, Path(tmp) / name)
            heads[name] = {"recipe": RECIPES[name].to_json(), "weights_sha256": weights_digest(p),
                           "config_sha256": config_digest(p), "acceptance": measure(name, p)}
    return {"format": 1, "heads": heads}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--update-manifest", action="store_true")
    args = ap.parse_args(argv)
    if args.update_manifest:
        MANIFEST_FILE.write_bytes(json_bytes(build_manifest()))
        print(f"wrote {MANIFEST_FILE}")
    else:
        for name in HEAD_NAMES:
            print(f"{name}: {head_dir(name)}")


if __name__ == "__main__":
    main()
