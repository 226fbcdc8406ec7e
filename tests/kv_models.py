"""A model pair whose KV mlx can quantize: llama with head_dim 32 (the zoo's is 16).

``mx.quantize`` (mlx 0.32) takes group sizes 32, 64 and 128 and needs the last
axis (the head dim) divisible by the group size, so no zoo model's KV cache can
be quantized. Built from seeds like ``tests/foreign.py`` (its tokenizer and
initialiser; nothing downloaded): a ``llama`` target (mlx-lm 0.32.2
``models/llama.py``, 2 layers, 2 heads x 32, one KV head) and a twin drafter
(target + seeded noise).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from tests import foreign

CONFIG: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
    "vocab_size": foreign.VOCAB_SIZE, "max_position_embeddings": foreign.CONTEXT,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "eos_token_id": 1, "bos_token_id": None, "pad_token_id": None, "torch_dtype": "float32",
}


def weights(drafter: bool = False) -> dict[str, np.ndarray]:
    out = {}
    for name, shape in sorted(foreign._shapes(CONFIG).items()):
        rng = foreign._rng(f"kv-llama:{name}")
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name:
            w = rng.standard_normal(shape)
        elif name.endswith(".weight") and len(shape) == 2:
            w = 1.5 * rng.standard_normal(shape) / math.sqrt(shape[-1])
        else:
            w = 0.02 * rng.standard_normal(shape)
        if drafter:
            w = w + foreign.TWIN_NOISE * float(w.std() or 1.0) * foreign._rng(
                f"kv-llama:twin:{name}").standard_normal(shape)
        out[name] = w.astype(np.float32)
    return out


def write_model(out: Path, *, drafter: bool = False) -> Path:
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: mx.array(v) for k, v in weights(drafter).items()}, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(foreign.tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": foreign.EOS, "unk_token": foreign.UNK,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": foreign.CONTEXT}, indent=2) + "\n")
    return out


def build(root: Path) -> tuple[Path, Path]:
    """``(target dir, twin drafter dir)`` under ``root``."""
    t, d = Path(root) / "kvllama", Path(root) / "kvllama-twin"
    if not (t / "model.safetensors").exists():
        write_model(t)
    if not (d / "model.safetensors").exists():
        write_model(d, drafter=True)
    return t, d
