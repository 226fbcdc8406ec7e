"""Tiny DSpark drafter artifacts for the zoo targets, built from seeds.

Pinned by sha256 in ``dspark_manifest.json`` (beside this file) and built on
first use into ``$SPECPARITY_ZOO_DIR`` like the zoo models
(:func:`artifact_dir`). Artifacts:

- ``gemma4-deepspec`` — a DeepSpec-format ``Gemma4DSparkModel`` drafter for the
  zoo ``gemma4`` target (``config.json`` with ``architectures:
  ["Gemma4DSparkModel"]``, bf16 tensors without a key prefix, exactly the
  layout DeepSpec's ``from_pretrained`` loads): 2 layers, hidden 64, 4 Q heads
  × head_dim 32, one KV head with K≡V, partial RoPE 0.25 θ=1e6, softcap 30,
  block 4, taps ``[-1, 0]`` (the target's scaled embedding and layer 0: a
  2-layer target has no other non-final layer), vanilla Markov head (r = 64)
  and a confidence head over ``[h; W1[prev]]``.
- ``gemma4-deepspec-q8`` / ``-q4`` — its mlx affine-quantized siblings
  (``engine.dspark.deepspec_module.quantize_dir``, group 64).
- ``gemma4-hf`` — the zoo ``gemma4`` target in Hugging Face format (same
  weights; a config transformers' ``Gemma4ForCausalLM`` reads with the RoPE
  parameters mlx-lm defaults to), for DeepSpec's torch loop.
- ``gemma4-dspark`` / ``qwen3-dspark`` — our DSpark drafter (§4.1) in its
  ``dspark.json`` format (``engine.dspark.module``).

The drafters are not trained. To give them a realistic acceptance the Markov
head encodes the target's greedy bigram table (the most frequent successor of
each token over the zoo prompts' 24-token greedy continuations), with random
unit codes of rank r (so crosstalk and the random backbone still move the
argmax), and the confidence head scores whether the previous token is in that
table. The table is part of the pinned recipe; ``python -m
zoo.dspark --update-manifest`` recomputes it and the digests.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

import zoo
from engine.dspark import module as dspark_module
from traces.digest import config_digest
from zoo.build import json_bytes

_HERE = Path(__file__).resolve().parent
MANIFEST_FILE = _HERE / "dspark_manifest.json"

DEEPSPEC_SEED = 8008
DSPARK_SEED = 9009
MASK_TOKEN_ID = 511
BIGRAM_TOKENS = 24

DEEPSPEC_TARGETS = ("gemma4",)  # DeepSpec torch oracle (HF Gemma4 target export)
AB_TARGETS = ("gemma4", "qwen3")  # DeepSpec-format drafters + quantized siblings (the A/B)
DSPARK_TARGETS = ("gemma4", "qwen3")
QUANT_BITS = (8, 4)

ARTIFACTS: tuple[str, ...] = (
    *(f"{t}-deepspec" for t in AB_TARGETS),
    *(f"{t}-deepspec-q{b}" for t in AB_TARGETS for b in QUANT_BITS),
    *(f"{t}-deepspec-l0" for t in DEEPSPEC_TARGETS),
    *(f"{t}-deepspec-kv" for t in DEEPSPEC_TARGETS),
    *(f"{t}-hf" for t in DEEPSPEC_TARGETS),
    *(f"{t}-dspark" for t in DSPARK_TARGETS),
)
WITH_BIGRAMS = ("deepspec", "deepspec-l0", "deepspec-kv", "dspark")


# ------------------------------------------------------------------ recipe


def bigram_table(target: str) -> list[list[int]]:
    """``[[prev, next], ...]``: the most frequent greedy successor of each token."""
    from engine.executor import GenerationParams, plain_generate
    from engine.models import load

    model = load(zoo.model_dir(target)).model
    counts: dict[int, Counter[int]] = defaultdict(Counter)
    for p in zoo.prompts():
        ids = list(p.token_ids)
        out = plain_generate(model, ids, GenerationParams(max_tokens=BIGRAM_TOKENS, prefill="full", cache_digests=False))
        seq = [ids[-1], *out.output_ids]
        for a, b in zip(seq, seq[1:], strict=False):
            counts[a][b] += 1
    return [[a, counts[a].most_common(1)[0][0]] for a in sorted(counts)]


def _rng(seed: int, name: str) -> np.random.Generator:
    from zoo.build import seeded_rng

    return seeded_rng(seed, name)


def _target_config(target: str) -> dict[str, Any]:
    return json.loads((zoo.model_dir(target) / "config.json").read_text())


def deepspec_config(target: str, target_layer_ids: tuple[int, ...] = (-1, 0), k_eq_v: bool = True) -> dict[str, Any]:
    """The drafter ``config.json``: the target's text config + DeepSpec's fields
    (``deepspec/modeling/dspark/gemma4/config.py`` ``build_draft_config``)."""
    t = _target_config(target)
    return {
        "architectures": ["Gemma4DSparkModel"],
        "model_type": "gemma4_text",
        "target_model_type": "gemma4",
        "target_text_model_type": "gemma4_text",
        "vocab_size": t["vocab_size"],
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"],
        "num_hidden_layers": 2,
        "num_target_layers": t["num_hidden_layers"],
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "num_global_key_value_heads": 1,
        "head_dim": t.get("head_dim", 16),
        "global_head_dim": t.get("global_head_dim", 32),
        "attention_k_eq_v": k_eq_v,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "enable_moe_block": False,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": t["vocab_size"],
        "initializer_range": 0.02,
        "max_position_embeddings": t["max_position_embeddings"],
        "num_kv_shared_layers": 0,
        "rms_norm_eps": t["rms_norm_eps"],
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": t.get("sliding_window", 32),
        "use_double_wide_mlp": False,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": False,
        "block_size": 4,
        "mask_token_id": MASK_TOKEN_ID,
        "target_layer_ids": list(target_layer_ids),
        "num_anchors": 8,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "markov_rank": 64,
        "markov_head_type": "vanilla",
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }


def _unit_codes(seed: int, vocab: int, rank: int) -> np.ndarray:
    u = _rng(seed, "markov_codes").standard_normal((vocab, rank))
    return u / np.linalg.norm(u, axis=1, keepdims=True)


def bigram_heads(codes: np.ndarray, bigrams: list[list[int]], conf_noise: np.ndarray) -> dict[str, np.ndarray]:
    """Markov and confidence heads seeded with the target's greedy bigrams (untrained drafters
    that still accept): ``markov_w2[next] += 8 · code[prev]``; the confidence read-out is the
    least-squares linear fit of "prev has a table entry" from its code (random codes are not
    separable, so it is informative, not exact), beside ``0.5 · conf_noise / √h`` on the hidden."""
    w2 = np.zeros(codes.shape)
    for a, b in bigrams:
        w2[b] += 8.0 * codes[a]
    y = np.full(codes.shape[0], -2.0)
    y[[a for a, _ in bigrams]] = 2.0
    read_out = np.linalg.lstsq(codes, y, rcond=None)[0]
    conf = np.concatenate([0.5 * conf_noise / math.sqrt(conf_noise.shape[0]), read_out])
    return {
        "markov_head.markov_w1.weight": codes,
        "markov_head.markov_w2.weight": w2,
        "confidence_head.proj.weight": conf[None, :],
        "confidence_head.proj.bias": np.array([0.3]),
    }


def deepspec_weights(target: str, bigrams: list[list[int]], target_layer_ids: tuple[int, ...] = (-1, 0),
                     k_eq_v: bool = True) -> dict[str, np.ndarray]:
    """Seeded float32 tensors in DeepSpec's key layout (no prefix)."""
    cfg = deepspec_config(target, target_layer_ids, k_eq_v)
    h, v, r = cfg["hidden_size"], cfg["vocab_size"], cfg["markov_rank"]
    nkv = cfg["num_global_key_value_heads"] if k_eq_v else cfg["num_key_value_heads"]
    nh, hd, inter = cfg["num_attention_heads"], cfg["global_head_dim"], cfg["intermediate_size"]
    m = len(cfg["target_layer_ids"])
    seed = DEEPSPEC_SEED

    def lin(name: str, out_dim: int, in_dim: int, gain: float = 1.0) -> np.ndarray:
        return gain * _rng(seed, name).standard_normal((out_dim, in_dim)) / math.sqrt(in_dim)

    def norm(name: str, dim: int) -> np.ndarray:
        return 1.0 + 0.1 * _rng(seed, name).standard_normal(dim)

    w: dict[str, np.ndarray] = {
        "embed_tokens.weight": 0.05 * _rng(seed, "embed").standard_normal((v, h)),
        "fc.weight": lin("fc", h, m * h),
        "hidden_norm.weight": norm("hidden_norm", h),
        "norm.weight": norm("norm", h),
        "lm_head.weight": lin("lm_head", v, h, gain=1.0),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w[p + "self_attn.q_proj.weight"] = lin(p + "q", nh * hd, h)
        w[p + "self_attn.k_proj.weight"] = lin(p + "k", nkv * hd, h)
        if not k_eq_v:
            w[p + "self_attn.v_proj.weight"] = lin(p + "v", nkv * hd, h)
        w[p + "self_attn.o_proj.weight"] = lin(p + "o", h, nh * hd)
        w[p + "self_attn.q_norm.weight"] = norm(p + "qn", hd)
        w[p + "self_attn.k_norm.weight"] = norm(p + "kn", hd)
        w[p + "mlp.gate_proj.weight"] = lin(p + "gate", inter, h)
        w[p + "mlp.up_proj.weight"] = lin(p + "up", inter, h)
        w[p + "mlp.down_proj.weight"] = lin(p + "down", h, inter)
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            w[p + n + ".weight"] = norm(p + n, h)
        w[p + "layer_scalar"] = _rng(seed, p + "scalar").uniform(0.6, 1.4, (1,))
    w.update(bigram_heads(_unit_codes(seed, v, r), bigrams, _rng(seed, "conf_h").standard_normal(h)))
    return {k: np.asarray(a, np.float32) for k, a in sorted(w.items())}


def recipe(name: str) -> dict[str, Any]:
    """The pinned recipe of artifact ``name`` (bigram tables come from the manifest)."""
    target, _, kind = name.partition("-")
    entry = manifest().get("artifacts", {}).get(name, {})
    if kind in ("deepspec", "deepspec-l0", "deepspec-kv"):
        # -l0: taps [0] only (mlx-vlm's gemma4_dspark refuses DeepSpec's -1 embedding tap);
        # -kv: also attention_k_eq_v False (v_proj + v_norm), which mlx-vlm can load
        rec = {"kind": "deepspec", "target": target, "seed": DEEPSPEC_SEED, "dtype": "bfloat16",
               "target_layer_ids": [-1, 0] if kind == "deepspec" else [0],
               "bigrams": entry.get("recipe", {}).get("bigrams")}
        if kind == "deepspec-kv":
            rec["attention_k_eq_v"] = False
        return rec
    if kind.startswith("deepspec-q"):
        return {"kind": "deepspec-quantized", "base": f"{target}-deepspec", "bits": int(kind[len("deepspec-q"):]), "group_size": 64}
    if kind == "hf":
        return {"kind": "hf-target", "target": target}
    if kind == "dspark":
        return {"kind": "dspark", "target": target, "seed": DSPARK_SEED,
                "bigrams": entry.get("recipe", {}).get("bigrams")}
    raise ValueError(f"unknown dspark zoo artifact {name!r}; valid: {', '.join(ARTIFACTS)}")


# ------------------------------------------------------------------- writing


def _write_safetensors(path: Path, arrays: dict[str, np.ndarray], dtype: str) -> None:
    import mlx.core as mx

    dt = {"bfloat16": mx.bfloat16, "float32": mx.float32}[dtype]
    mx.save_safetensors(str(path), {k: mx.array(arrays[k]).astype(dt) for k in sorted(arrays)}, metadata={"format": "pt"})


def write_artifact(name: str, out_dir: Path, bigrams: list[list[int]] | None = None) -> Path:
    """Write artifact ``name`` into ``out_dir``."""
    rec = recipe(name)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = rec["kind"]
    if kind == "deepspec":
        table = bigrams if bigrams is not None else rec["bigrams"]
        if table is None:
            raise zoo.ZooDriftError(f"zoo drift: {name}: no bigram table in {MANIFEST_FILE}")
        ids = tuple(rec["target_layer_ids"])
        kv = bool(rec.get("attention_k_eq_v", True))
        _write_safetensors(out_dir / "model.safetensors", deepspec_weights(rec["target"], table, ids, kv), rec["dtype"])
        (out_dir / "config.json").write_bytes(json_bytes(deepspec_config(rec["target"], ids, kv)))
    elif kind == "deepspec-quantized":
        from engine.dspark.deepspec_module import quantize_dir

        quantize_dir(artifact_dir(rec["base"]), out_dir, bits=rec["bits"], group_size=rec["group_size"])
    elif kind == "hf-target":
        src = zoo.model_dir(rec["target"])
        cfg = json.loads((src / "config.json").read_text())
        cfg.pop("rope_theta", None)
        cfg["rope_parameters"] = deepspec_config(rec["target"])["rope_parameters"]
        cfg.update(hidden_activation="gelu_pytorch_tanh", attention_k_eq_v=False, pad_token_id=1)
        for f in sorted(src.iterdir()):
            if f.name != "config.json":
                shutil.copyfile(f, out_dir / f.name)
        (out_dir / "config.json").write_bytes(json_bytes(cfg))
    elif kind == "dspark":

        table = bigrams if bigrams is not None else rec["bigrams"]
        if table is None:
            raise zoo.ZooDriftError(f"zoo drift: {name}: no bigram table in {MANIFEST_FILE}")
        write_zoo_dspark(rec["target"], out_dir, table, seed=rec["seed"])
    return out_dir


def tensors_digest(path: Path | str) -> str:
    """sha256 over sorted tensor names, dtypes, shapes and raw bytes (``traces.digest.weights_digest``)."""
    from traces.digest import weights_digest

    return weights_digest(path)


def manifest() -> dict[str, Any]:
    return json.loads(MANIFEST_FILE.read_text()) if MANIFEST_FILE.exists() else {}


def artifact_dir(name: str) -> Path:
    """Path of artifact ``name``, built on first use and checked against the manifest."""
    entry = manifest().get("artifacts", {}).get(name)
    if entry is None:
        raise zoo.ZooDriftError(f"zoo drift: {name}: no entry in {MANIFEST_FILE}")
    from zoo import pinned

    def verify(d: Path) -> None:
        got_w, got_c = tensors_digest(d), config_digest(d)
        if (got_w, got_c) != (entry["weights_sha256"], entry["config_sha256"]):
            raise zoo.ZooDriftError(
                f"zoo drift: {name}: {d} has weights {got_w[:12]} config {got_c[:12]}, manifest expects "
                f"{entry['weights_sha256'][:12]} / {entry['config_sha256'][:12]} (delete {d} to rebuild, or "
                "`python -m zoo.dspark --update-manifest` if the recipe changed on purpose)"
            )

    return pinned.artifact(zoo.cache_root(), f"{name}-{entry['weights_sha256'][:12]}",
                           lambda tmp: write_artifact(name, tmp),
                           lambda d: [f.name for f in sorted(d.iterdir()) if f.suffix in (".safetensors", ".json")],
                           verify, lambda m: zoo.ZooDriftError(f"zoo drift: {name}: {m}"))


def case_paths(target: str, drafter: str) -> tuple[Path, Path]:
    """``(target dir, artifact dir)`` of a zoo case: the locator the ``deepspec`` and ``dspark``
    kinds name (``SourceKind.zoo``); ``drafter`` is ``<variant>-t<threshold>``, the artifact
    ``<target>-<variant>``."""
    variant = drafter.rpartition("-t")[0] or drafter
    return zoo.model_dir(target), artifact_dir(f"{target}-{variant}")


def buildmanifest() -> dict[str, Any]:
    tables = {t: bigram_table(t) for t in sorted(set(AB_TARGETS) | set(DSPARK_TARGETS))}
    out: dict[str, Any] = {"format": 1, "artifacts": {}}
    with tempfile.TemporaryDirectory(prefix="specparity-dspark-") as tmp:
        for name in ARTIFACTS:
            target, _, kind = name.partition("-")
            table = tables[target] if kind in WITH_BIGRAMS else None
            if kind.startswith("deepspec-q"):
                # quantized siblings are built from the freshly written base
                path = Path(tmp) / name
                from engine.dspark.deepspec_module import quantize_dir

                quantize_dir(Path(tmp) / f"{target}-deepspec", path, bits=int(kind[len("deepspec-q"):]))
            else:
                path = write_artifact(name, Path(tmp) / name, bigrams=table)
            rec = recipe(name)
            if table is not None:
                rec["bigrams"] = table
            out["artifacts"][name] = {"recipe": rec, "weights_sha256": tensors_digest(path), "config_sha256": config_digest(path)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="tiny DSpark/DeepSpec drafter artifacts for the zoo")
    ap.add_argument("--update-manifest", action="store_true", help=f"rewrite {MANIFEST_FILE.name}")
    ap.add_argument("--only", nargs="*", default=None, help="artifacts to print the paths of")
    args = ap.parse_args(argv)
    if args.update_manifest:
        m = buildmanifest()
        MANIFEST_FILE.write_text(json.dumps(m, sort_keys=True) + "\n")
        from zoo import pinned

        pinned.clear()
    for name in args.only if args.only is not None else ARTIFACTS:
        print(name, artifact_dir(name))


if __name__ == "__main__":
    main()


# ------------------------------------------- our DSpark drafter (engine.dspark.module format)


def zoo_dspark_json(target_cfg: dict[str, Any], tap_layers: list[int]) -> dict[str, Any]:
    h = int(target_cfg["hidden_size"])
    return {
        "variant": dspark_module.VARIANT,
        "format": dspark_module.FORMAT,
        "gamma": 4,
        "tap_layers": tap_layers,
        "mask_token_id": 511,
        "vocab_size": int(target_cfg["vocab_size"]),
        "seq_head": "markov",
        "markov_rank": 64,
        "confidence_with_markov": True,
        "share_target_embeddings": True,
        "final_logit_softcapping": target_cfg.get("final_logit_softcapping"),
        "thresholds": None,
        "min_conf": None,
        "backbone": {
            "hidden_size": h, "intermediate_size": 2 * h, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        },
        "target": {"model_type": target_cfg["model_type"], "num_hidden_layers": int(target_cfg["num_hidden_layers"])},
    }


def mlx_vlm_config(d: dict[str, Any]) -> dict[str, Any]:
    """The same drafter described for mlx-vlm's generic DSpark loader (``Qwen3DSparkModel``)."""
    b = d["backbone"]
    return {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
        "hidden_size": b["hidden_size"], "intermediate_size": b["intermediate_size"],
        "num_hidden_layers": b["num_hidden_layers"], "num_attention_heads": b["num_attention_heads"],
        "num_key_value_heads": b["num_key_value_heads"], "head_dim": b["head_dim"], "hidden_act": "silu",
        "rms_norm_eps": b["rms_norm_eps"], "vocab_size": d["vocab_size"], "max_position_embeddings": 2048,
        "rope_theta": b["rope_theta"], "tie_word_embeddings": True,
        "final_logit_softcapping": d["final_logit_softcapping"],
        "dflash_config": {
            "projector_type": "dspark", "block_size": d["gamma"], "mask_token_id": d["mask_token_id"],
            "target_layer_ids": d["tap_layers"], "num_target_layers": d["target"]["num_hidden_layers"],
            "markov_rank": d["markov_rank"], "markov_head_type": "vanilla", "enable_confidence_head": True,
            "confidence_head_with_markov": d["confidence_with_markov"], "block_size_policy": "fixed",
            "sample_from_anchor": True,
        },
    }


def zoo_dspark_weights(d: dict[str, Any], bigrams: list[list[int]], seed: int) -> dict[str, np.ndarray]:
    b = d["backbone"]
    h, inter, hd, nh, nkv = b["hidden_size"], b["intermediate_size"], b["head_dim"], b["num_attention_heads"], b["num_key_value_heads"]
    v, r, m = d["vocab_size"], d["markov_rank"], len(d["tap_layers"])

    def lin(name: str, o: int, i: int, gain: float = 1.0) -> np.ndarray:
        return gain * _rng(seed, name).standard_normal((o, i)) / np.sqrt(i)

    def norm(name: str, n: int) -> np.ndarray:
        return 1.0 + 0.1 * _rng(seed, name).standard_normal(n)

    w: dict[str, np.ndarray] = {"fc.weight": lin("fc", h, m * h), "hidden_norm.weight": norm("hn", h), "norm.weight": norm("n", h)}
    for i in range(b["num_hidden_layers"]):
        p = f"layers.{i}."
        w[p + "self_attn.q_proj.weight"] = lin(p + "q", nh * hd, h)
        w[p + "self_attn.k_proj.weight"] = lin(p + "k", nkv * hd, h)
        w[p + "self_attn.v_proj.weight"] = lin(p + "v", nkv * hd, h)
        w[p + "self_attn.o_proj.weight"] = lin(p + "o", h, nh * hd)
        w[p + "self_attn.q_norm.weight"] = norm(p + "qn", hd)
        w[p + "self_attn.k_norm.weight"] = norm(p + "kn", hd)
        w[p + "mlp.gate_proj.weight"] = lin(p + "g", inter, h)
        w[p + "mlp.up_proj.weight"] = lin(p + "u", inter, h)
        w[p + "mlp.down_proj.weight"] = lin(p + "d", h, inter)
        w[p + "input_layernorm.weight"] = norm(p + "iln", h)
        w[p + "post_attention_layernorm.weight"] = norm(p + "paln", h)
    codes = _rng(seed, "codes").standard_normal((v, r))
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    w.update(bigram_heads(codes, bigrams, _rng(seed, "ch").standard_normal(h)))
    return {k: np.asarray(a, np.float32) for k, a in sorted(w.items())}


def write_zoo_dspark(target: str, out_dir: Path, bigrams: list[list[int]], seed: int) -> Path:
    tcfg = json.loads((zoo.model_dir(target) / "config.json").read_text())
    n = int(tcfg["num_hidden_layers"])
    d = zoo_dspark_json(tcfg, list(range(n)))
    w = zoo_dspark_weights(d, bigrams, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), {k: mx.array(w[k]) for k in sorted(w)}, metadata={"format": "mlx"})
    (out_dir / "dspark.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    (out_dir / "config.json").write_text(json.dumps(mlx_vlm_config(d), indent=2, sort_keys=True) + "\n")
    return out_dir
