"""Out-of-zoo fixture models: architectures the zoo lacks, with their own tokenizer.

Built inside the tests (never downloaded): ``phi3``, ``granite``, ``starcoder2``
and ``olmo2`` targets of mlx-lm 0.32.2 (``mlx_lm/models/<arch>.py`` ``ModelArgs``
/ ``Model``: parameter names come from instantiating ``Model``), each with a
``twin`` drafter (target weights + seeded noise) and a word-level tokenizer
built with ``tokenizers`` (``WordLevel`` + ``WhitespaceSplit``;
(not ``qwen2``: transformers 5 loads any ``qwen2`` dir with its own byte-level
``Qwen2Tokenizer`` pre-tokenizer, whatever ``tokenizer_class`` says); vocabulary of
syllable words, ``<unk>`` = 0, ``</s>`` = 1 = EOS) — a different tokenizer,
vocabulary size and context length (``max_position_embeddings`` 192) from the
zoo's. Each model directory holds ``config.json`` + ``model.safetensors`` +
``tokenizer.json`` / ``tokenizer_config.json`` so ``mlx_lm.load`` works.

``python -m tests.foreign OUT_DIR`` writes them (and ``prompts.jsonl``) for a
hand run of the README's "Your own models and engine" commands, plus ``phi3-chat64``
(+ twin, :func:`build_chat64`): phi3 with the same tokenizer and a chat template, head
dim 64, the served fixture for servers that phi3-tiny's missing template or head dim 12
stops (``tox -e server-fusion-mlx``, ``server-yunshu``).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

ARCHS = ("phi3", "granite", "starcoder2", "olmo2")
CONTEXT = 192
UNK, EOS = "<unk>", "</s>"
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
WORDS = [c + v for c in _CONSONANTS for v in _VOWELS] + [
    c + v + "n" for c in _CONSONANTS[:8] for v in _VOWELS
]  # 70 + 40 = 110 words
VOCAB = [UNK, EOS, *WORDS]
VOCAB_SIZE = len(VOCAB)
TWIN_NOISE = 0.15

_COMMON = {
    "hidden_size": 48, "num_hidden_layers": 2, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": CONTEXT, "rope_theta": 10000.0, "eos_token_id": 1,
    "bos_token_id": None, "pad_token_id": None,
    "torch_dtype": "float32",
}
_EXTRA: dict[str, dict[str, Any]] = {
    "phi3": {"architectures": ["Phi3ForCausalLM"], "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
             "original_max_position_embeddings": CONTEXT},
    "granite": {"architectures": ["GraniteForCausalLM"], "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                "logits_scaling": 2.0, "attention_multiplier": 0.25, "embedding_multiplier": 1.0,
                "residual_multiplier": 0.5, "attention_bias": False, "mlp_bias": False},
    "starcoder2": {"architectures": ["Starcoder2ForCausalLM"], "norm_epsilon": 1e-5,
                   "tie_word_embeddings": True},
    "olmo2": {"architectures": ["Olmo2ForCausalLM"], "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "head_dim": 12},
}
PROMPTS = [
    {"id": "p-zero", "token_ids": [0, 5, 9, 14, 22, 5, 9]},  # id 0 (<unk>) is a valid id
    {"id": "p-words", "text": "ba de fi go ku la me ni po ru sa te"},
    {"id": "p-repeat", "text": "ban den ban den ban den ba de ba de"},
    {"id": "p-ids", "token_ids": [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]},
]


def _rng(seed: str) -> np.random.Generator:
    d = hashlib.sha256(seed.encode()).digest()
    return np.random.default_rng([int.from_bytes(d[i : i + 4], "little") for i in range(0, 32, 4)])


def config(arch: str) -> dict[str, Any]:
    return {"model_type": arch, **_COMMON, **_EXTRA[arch]}


def _shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}


def weights(arch: str, drafter: bool = False, cfg: dict[str, Any] | None = None,
            key: str | None = None) -> dict[str, np.ndarray]:
    """Seeded weights of ``arch`` (``cfg``: another shape; ``key``: the seed prefix, ``arch`` by default)."""
    key = key or arch
    out = {}
    for name, shape in sorted(_shapes(cfg or config(arch)).items()):
        rng = _rng(f"{key}:{name}")
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name:
            w = rng.standard_normal(shape)
        elif name.endswith(".weight") and len(shape) == 2:
            w = 1.5 * rng.standard_normal(shape) / math.sqrt(shape[-1])
        else:
            w = 0.02 * rng.standard_normal(shape)
        if drafter:
            scale = 0.1 * TWIN_NOISE if name.endswith("norm.weight") else TWIN_NOISE * float(w.std() or 1.0)
            w = w + scale * _rng(f"{key}:twin:{name}").standard_normal(shape)
        out[name] = w.astype(np.float32)
    return out


def tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens([EOS])
    return tok.to_str()


def write_model(arch: str, out: Path, *, drafter: bool = False, cfg: dict[str, Any] | None = None,
                key: str | None = None, chat_template: str | None = None) -> Path:
    """``arch``'s seeded model in ``out`` (``cfg``/``key``: another shape and seed, :func:`weights`;
    ``chat_template``: written into ``tokenizer_config.json``)."""
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    cfg = cfg or config(arch)
    w = weights(arch, drafter, cfg, key)
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in w.items()},
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(tokenizer_json())
    tok_cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "unk_token": UNK,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT}
    if chat_template is not None:
        tok_cfg["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out


def build(root: Path, archs: tuple[str, ...] = ARCHS) -> dict[str, tuple[Path, Path]]:
    """``{arch: (target dir, twin drafter dir)}`` under ``root``, plus ``root/prompts.jsonl``."""
    root = Path(root)
    out = {}
    for arch in archs:
        t, d = root / f"{arch}-tiny", root / f"{arch}-tiny-twin"
        if not (t / "model.safetensors").exists():
            write_model(arch, t)
        if not (d / "model.safetensors").exists():
            write_model(arch, d, drafter=True)
        out[arch] = (t, d)
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return out


# ---------------------------------------------------------------- checkpoint shapes (issue 22)

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ {'system': 'sa', 'user': 'ku', 'assistant': 'la'}[m['role']] }} "
    "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}la{% endif %}"
)  # role markers are vocabulary words, so a rendered prompt encodes without <unk>


def write_padded(arch: str, out: Path, pad_to: int, *, drafter: bool = False) -> Path:
    """``write_model`` with a padded vocabulary: ``vocab_size`` ``pad_to`` > the tokenizer's.

    The embedding (and an untied ``lm_head``) gain zero rows past the tokenizer's
    ``VOCAB_SIZE`` ids, as real Qwen checkpoints pad theirs (0.5B: 151936 rows,
    7B: 152064, one tokenizer of 151665). A zero head row's logit is 0, below the
    real ids' greedy maximum, so greedy decode never picks a padding id.
    """
    import mlx.core as mx

    write_model(arch, out, drafter=drafter)
    w = {k: np.array(v) for k, v in mx.load(str(out / "model.safetensors")).items()}
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        if k in w:
            w[k] = np.concatenate([w[k], np.zeros((pad_to - w[k].shape[0], w[k].shape[1]),
                                                  w[k].dtype)])
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in w.items()},
                        metadata={"format": "mlx"})
    cfg = {**config(arch), "vocab_size": pad_to}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def add_chat_template(model_dir: Path, template: str = CHAT_TEMPLATE) -> Path:
    """Give a model dir's tokenizer a ``chat_template`` (in ``tokenizer_config.json``)."""
    p = Path(model_dir) / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["chat_template"] = template
    p.write_text(json.dumps(cfg, indent=2) + "\n")
    return Path(model_dir)


# Quantizations mlx-lm writes: name -> (bits, group size, mode); None: unquantized.
QUANTS: dict[str, tuple[int, int, str] | None] = {
    "none": None, "q4g32": (4, 32, "affine"), "q4g64": (4, 64, "affine"),
    "q8g32": (8, 32, "affine"), "q8g64": (8, 64, "affine"), "mxfp4": (4, 32, "mxfp4"),
}
DTYPES = ("float32", "float16", "bfloat16")
# Every quantized layer's input width must divide by the group size (64): the fixtures'
# 48-wide layers would be left unquantized by mlx-lm's predicate.
QUANTIZABLE = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16}


def write_quantizable(arch: str, out: Path, *, drafter: bool = False) -> Path:
    """``write_model`` with 64/128-wide layers (:data:`QUANTIZABLE`), fp32."""
    cfg = {**config(arch), **QUANTIZABLE}
    write_model(arch, out, drafter=drafter)
    import mlx.core as mx

    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: mx.array(v) for k, v in weights(arch, drafter, cfg).items()},
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def convert_checkpoint(src: Path, out: Path, *, dtype: str, quant: str = "none",
                       sharded: bool = False) -> Path:
    """``mlx_lm.convert`` of a local fp32 model dir to ``dtype`` / ``quant`` (:data:`QUANTS`).

    ``sharded``: mlx-lm's own ``save_model`` / ``make_shards`` with a 0-byte shard
    limit, so every tensor gets a shard (``model-0000i-of-0000n.safetensors`` and the
    index), as a checkpoint over ``MAX_FILE_SIZE_GB`` is written. Nothing is downloaded.
    """
    import contextlib
    import io

    import mlx_lm.utils as mu
    from mlx_lm.convert import convert

    q = QUANTS[quant]
    real = mu.make_shards
    if sharded:
        mu.make_shards = lambda weights, max_file_size_gb=0: real(weights, 0)  # type: ignore[assignment]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            convert(str(src), str(out), quantize=q is not None, q_bits=q[0] if q else None,
                    q_group_size=q[1] if q else None, q_mode=q[2] if q else "affine", dtype=dtype)
    finally:
        mu.make_shards = real
    return out


# ---------------------------------------------------------------- a served fixture servers can serve (issue 32)

CHAT64 = "phi3-chat64"
# phi3 with a head dim of 64 (hidden 128 = 2 heads x 64): servers that quantize their KV cache in groups
# of 64 (yunshu 0.1.5) can run it, where phi3-tiny's head dim of 12 fails them.
CHAT64_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
                "num_key_value_heads": 2}


def chat64_config() -> dict[str, Any]:
    return {**config("phi3"), **CHAT64_SHAPE}


def build_chat64(root: Path) -> tuple[Path, Path]:
    """``(target, twin)``: :data:`CHAT64` and its twin drafter under ``root``.

    phi3-tiny's word-level tokenizer and vocabulary WITH a chat template (:data:`CHAT_TEMPLATE`,
    role markers that are vocabulary words) for servers that route every request, completions
    included, through one (fusion-mlx 0.10.24); head dim 64 (:data:`CHAT64_SHAPE`). Seeded like
    the others, under the key ``phi3-chat64``: the same files on every machine.
    """
    root = Path(root)
    t, d = root / CHAT64, root / f"{CHAT64}-twin"
    for out, drafter in ((t, False), (d, True)):
        if not (out / "model.safetensors").exists():
            write_model("phi3", out, drafter=drafter, cfg=chat64_config(), key=CHAT64,
                        chat_template=CHAT_TEMPLATE)
    return t, d


if __name__ == "__main__":
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else "foreign-models")
    for arch, (t, d) in build(dest).items():
        print(f"{arch}: {t} {d}")
    t, d = build_chat64(dest)
    print(f"{CHAT64}: {t} {d}")
    print(f"prompts: {dest / 'prompts.jsonl'}")
