"""Deterministic builder for the tiny model zoo (mlx-lm on-disk format).

Each model directory holds ``config.json`` + ``model.safetensors`` (float32) +
tokenizer files, loadable with ``mlx_lm.load(path)``.

References mirrored:
  * mlx-lm 0.32.2 ``mlx_lm/models/llama.py`` ``ModelArgs`` / ``Model`` (parameter
    names come from instantiating ``Model`` and flattening ``parameters()``).
  * mlx-lm 0.32.2 ``mlx_lm/models/qwen3.py`` ``ModelArgs`` / ``Model`` (adds
    ``q_norm`` / ``k_norm``; ``head_dim`` required).
  * mlx-lm 0.32.2 ``mlx_lm/utils.py`` ``load_model`` / ``load_tokenizer`` (reads
    ``config.json``, ``model*.safetensors``, ``eos_token_id`` from config, and the
    tokenizer through ``transformers.AutoTokenizer``).

Every tensor is drawn from ``numpy.random.default_rng`` seeded from
``sha256(f"{seed}:{tensor_name}")``, so bytes do not depend on iteration order.

``python -m zoo.build --update-manifest`` rebuilds all models into a temp
dir and rewrites ``manifest.json`` (developer-only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
TOKENIZER_FILE = HERE / "tokenizer.json"
MANIFEST_FILE = HERE / "manifest.json"

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
VOCAB_SIZE = 512
BOS_ID = 0
EOS_ID = 1


@dataclass(frozen=True)
class Recipe:
    """How to build one zoo model (recorded verbatim in the manifest)."""

    name: str
    arch: str  # "llama" | "qwen3" | "gemma3_text" | "gemma4_text" | "qwen3_5"
    seed: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    embed_std: float = 1.0
    lm_head_std: float = 1.0
    proj_gain: float = 1.0  # multiplies the 1/sqrt(fan_in) std of linear layers
    base: str | None = None  # for twins: the recipe whose weights get noised
    noise_scale: float = 0.0  # twin noise, relative to each tensor's std
    noise_seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = {
            k: getattr(self, k)
            for k in (
                "arch", "seed", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "head_dim", "embed_std",
                "lm_head_std", "proj_gain", "base", "noise_scale", "noise_seed",
            )
        }  # fmt: skip
        d["vocab_size"] = VOCAB_SIZE
        d["dtype"] = "float32"
        return d


_TARGET_DIMS: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)  # fmt: skip
_SMALL_DIMS: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=1, intermediate_size=64,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
)  # fmt: skip
_INIT: dict[str, Any] = dict(embed_std=1.0, lm_head_std=4.0, proj_gain=1.0)

TWIN_NOISE = {"llama": 0.08, "qwen3": 0.075, "gemma3_text": 0.08, "gemma4_text": 0.08, "qwen3_5": 0.08}

# Architecture-specific config keys (mlx-lm 0.32.2 ModelArgs of each model).
# The windowed targets' sliding windows are small enough that a 64-token
# generation wraps the ring; qwen3_5 alternates a gated-DeltaNet layer
# (ArraysCache, not trimmable) with a full-attention layer (KVCache).
ARCH_EXTRA: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {},
    "gemma3_text": dict(
        sliding_window=32, sliding_window_pattern=2, query_pre_attn_scalar=16,
        rope_local_base_freq=10000.0,
    ),
    "gemma4_text": dict(
        global_head_dim=32, vocab_size_per_layer_input=VOCAB_SIZE, hidden_size_per_layer_input=8,
        num_kv_shared_layers=0, sliding_window=32, sliding_window_pattern=2,
        layer_types=["sliding_attention", "full_attention"], use_double_wide_mlp=False,
        final_logit_softcapping=30.0,
    ),
    "qwen3_5": dict(
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         },
    ),
}  # fmt: skip
# The small drafters have one layer; these archs need a full pattern period.
SMALL_LAYERS = {"gemma3_text": 2, "gemma4_text": 2, "qwen3_5": 2}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
}
ARCH_SEEDS = {"llama": 1001, "qwen3": 2002, "gemma3_text": 3003, "gemma4_text": 4004, "qwen3_5": 5005}
ZOO_NAMES = {"gemma3_text": "gemma3", "gemma4_text": "gemma4", "qwen3_5": "qwen35"}

RECIPES: dict[str, Recipe] = {}
for _arch, _seed in ARCH_SEEDS.items():
    _name = ZOO_NAMES.get(_arch, _arch)
    _small = dict(_SMALL_DIMS, num_hidden_layers=SMALL_LAYERS.get(_arch, 1))
    RECIPES[_name] = Recipe(name=_name, arch=_arch, seed=_seed, **_TARGET_DIMS, **_INIT)
    RECIPES[f"{_name}-twin"] = Recipe(
        name=f"{_name}-twin", arch=_arch, seed=_seed, **_TARGET_DIMS, **_INIT,
        base=_name, noise_scale=TWIN_NOISE[_arch], noise_seed=_seed + 7,
    )  # fmt: skip
    RECIPES[f"{_name}-small"] = Recipe(
        name=f"{_name}-small", arch=_arch, seed=_seed + 500, **_small, **_INIT
    )

# The quantized-KV pairs: mx.quantize groups KV along the head dim in 32, 64 or 128, so the
# zoo's head dim 16 cannot be quantized; these llamas have head dim 32 and 64 (2 heads, 1 KV
# head). MLX 0.32.4's CUDA quantized matmul has no kernel for mlx-lm's quantized attention at
# head dim 32 with 2 heads per KV head (``[quantized_matmul] No implementation for problem
# shape ...``, an ``unsupported`` verdict there), while head dim 64 in groups of 32 runs
# (measured on an H200: docs/backends.md "Unsupported on this backend"), so the GPU still
# exercises quantized KV on ``llama-kv64``.
KV_TARGET = "llama-kv"
KV64_TARGET = "llama-kv64"
KV_TARGETS = (KV_TARGET, KV64_TARGET)
_KV_DIMS: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, intermediate_size=128,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32,
)  # fmt: skip
for _kv, _kv_seed, _kv_dims in ((KV_TARGET, 1101, _KV_DIMS), (KV64_TARGET, 1201, dict(_KV_DIMS, head_dim=64))):
    RECIPES[_kv] = Recipe(name=_kv, arch="llama", seed=_kv_seed, **_kv_dims, **_INIT)
    RECIPES[f"{_kv}-twin"] = Recipe(
        name=f"{_kv}-twin", arch="llama", seed=_kv_seed, **_kv_dims, **_INIT,
        base=_kv, noise_scale=TWIN_NOISE["llama"], noise_seed=_kv_seed + 7,
    )  # fmt: skip

MODEL_NAMES: tuple[str, ...] = tuple(RECIPES)


def model_config(r: Recipe) -> dict[str, Any]:
    """The ``config.json`` contents (keys as in the HF/mlx-lm configs)."""
    cfg: dict[str, Any] = {
        "model_type": r.arch,
        "architectures": [ARCHITECTURES[r.arch]],
        "hidden_size": r.hidden_size,
        "num_hidden_layers": r.num_hidden_layers,
        "intermediate_size": r.intermediate_size,
        "num_attention_heads": r.num_attention_heads,
        "num_key_value_heads": r.num_key_value_heads,
        "head_dim": r.head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
    if r.arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, rope_traditional=False)
    cfg.update(ARCH_EXTRA[r.arch])
    if r.arch == "gemma4_text":
        cfg["layer_types"] = (["sliding_attention", "full_attention"] * r.num_hidden_layers)[
            : r.num_hidden_layers
        ]
    return cfg


def _param_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Parameter names/shapes as mlx-lm's own ``Model`` defines them."""
    from mlx_lm.utils import _get_classes

    from engine.models import parameter_shapes

    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    return parameter_shapes(model)


def seeded_rng(seed: int, name: str) -> np.random.Generator:
    """A generator seeded from ``sha256(f"{seed}:{name}")``: each tensor's bytes depend only
    on (seed, name), never on build order. Shared by every zoo artifact builder."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.random.default_rng([int.from_bytes(digest[i : i + 4], "little") for i in range(0, 32, 4)])


_rng = seeded_rng


def _init_tensor(r: Recipe, name: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = _rng(r.seed, name)
    if name.endswith("norm.weight"):
        w = 1.0 + 0.1 * rng.standard_normal(shape)
    elif name.endswith("model.embed_tokens.weight"):
        w = r.embed_std * rng.standard_normal(shape)
    elif name.endswith("lm_head.weight"):
        w = r.lm_head_std * rng.standard_normal(shape) / math.sqrt(shape[-1])
    elif name.endswith(".weight") and len(shape) == 2:
        w = r.proj_gain * rng.standard_normal(shape) / math.sqrt(shape[-1])
    elif name.endswith("conv1d.weight"):  # depthwise [C, K, 1] (gated DeltaNet)
        w = rng.standard_normal(shape) / math.sqrt(shape[1])
    elif name.endswith("layer_scalar"):  # gemma4 per-layer output scale
        w = np.ones(shape)
    elif name.endswith("A_log"):  # gated DeltaNet decay: A in [1, 16)
        w = np.log(rng.uniform(1.0, 16.0, shape))
    elif name.endswith("dt_bias"):
        w = np.ones(shape)
    else:  # biases
        w = np.zeros(shape)
    return w.astype(np.float32)


def model_weights(name: str) -> dict[str, np.ndarray]:
    """All tensors of zoo model ``name`` as float32 numpy arrays, keyed by name."""
    r = RECIPES[name]
    if r.base is not None:
        base = model_weights(r.base)
        out = {}
        for k in sorted(base):
            w = base[k].astype(np.float64)
            scale = r.noise_scale * float(w.std() if w.size > 1 else 1.0)
            if k.endswith("norm.weight"):
                scale = r.noise_scale * 0.1
            out[k] = (w + scale * _rng(r.noise_seed, k).standard_normal(w.shape)).astype(np.float32)
        return out
    shapes = _param_shapes(model_config(r))
    return {k: _init_tensor(r, k, shapes[k]) for k in sorted(shapes)}


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def tokenizer_files() -> dict[str, bytes]:
    """Tokenizer files copied into every model dir."""
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    return {
        "tokenizer.json": TOKENIZER_FILE.read_bytes(),
        "tokenizer_config.json": json_bytes(tok_cfg),
        "special_tokens_map.json": json_bytes(special),
    }


def save_checkpoint(out_dir: Path, weights: dict[str, np.ndarray], config: dict[str, Any],
                    *, tokenizer: bool = True) -> Path:
    """Write an mlx-format checkpoint: ``model.safetensors`` (tensors in name order),
    ``config.json`` and, with ``tokenizer``, the zoo tokenizer's files; byte-reproducible."""
    import mlx.core as mx

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arrays = {k: mx.array(weights[k]) for k in sorted(weights)}
    mx.save_safetensors(str(out_dir / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (out_dir / "config.json").write_bytes(json_bytes(config))
    if tokenizer:
        for fname, data in tokenizer_files().items():
            (out_dir / fname).write_bytes(data)
    return out_dir


def write_model(name: str, out_dir: Path) -> Path:
    """Write model ``name`` into ``out_dir`` (created; must not hold other files)."""
    return save_checkpoint(out_dir, model_weights(name), model_config(RECIPES[name]))


def manifest_entry(name: str, model_path: Path) -> dict[str, Any]:
    from zoo import config_digest, tokenizer_digest, weights_digest

    return {
        "recipe": RECIPES[name].to_json(),
        "weights_sha256": weights_digest(model_path),
        "config_sha256": config_digest(model_path),
        "tokenizer_sha256": tokenizer_digest(),
    }


def build_manifest() -> dict[str, Any]:
    from zoo import tokenizer_digest

    models = {}
    with tempfile.TemporaryDirectory(prefix="specparity-zoo-") as tmp:
        for name in MODEL_NAMES:
            path = write_model(name, Path(tmp) / name)
            models[name] = manifest_entry(name, path)
    return {"format": 1, "tokenizer_sha256": tokenizer_digest(), "models": models}


PROG = "python -m zoo.build"


def main(argv: list[str] | None = None) -> int:
    from traces.outdir import UsageError, add_outputs, output_dir_arg, publish_tree

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--update-manifest", action="store_true", help="rewrite manifest.json")
    ap.add_argument("--out", type=output_dir_arg,
                    help="build all models into this dir (a new folder, or one this command wrote)")
    args = ap.parse_args(argv)
    if args.update_manifest:
        MANIFEST_FILE.write_bytes(json_bytes(build_manifest()))
        print(f"wrote {MANIFEST_FILE}")
    if args.out:
        try:  # the ownership mechanism: a folder holding files nobody of ours wrote is refused first
            with add_outputs(args.out, PROG, flag="--out", own_folder=True) as claim:
                for name in MODEL_NAMES:
                    with tempfile.TemporaryDirectory(prefix=f"specparity-zoo-{name}-") as tmp:
                        publish_tree(claim, write_model(name, Path(tmp) / name), args.out / name)
                    print(f"built {args.out / name}")
        except UsageError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
    if not (args.update_manifest or args.out):
        from zoo import model_dir

        for name in MODEL_NAMES:
            print(f"{name}: {model_dir(name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
