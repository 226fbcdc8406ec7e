"""Seeded bf16 llama pairs at sizes where speculation can pay (issue 13 item 6): layer-skip drafters.

The target is an mlx-lm 0.32.2 ``llama`` (``mlx_lm/models/llama.py``) whose
deeper layers ``2 .. L-1`` have their residual branches scaled down (``o_proj``
and ``down_proj`` × ``DEEP_SCALE`` = 0.02), so its first ``DRAFT_LAYERS`` = 2
layers carry most of the computation. The drafter is the SAME weights cut to
those layers + the final norm + the head (a model dir with
``num_hidden_layers = 2``): an ordinary two-model pair (§3 ``two-model``),
LayerSkip-style self-speculation without any special source. Greedy acceptance
is measured, not promised: on the ``1b`` (H200, MLX 0.32.4 CUDA) 0.02 gives
82 / 77 / 66 % at γ 2 / 4 / 6; issue 13's ×0.008 gives 93–96 % with this
initialisation (fan-in normal projections, unit embeddings, head gain 4).

Nothing is downloaded: every tensor is drawn from ``mx.random`` with a key
derived from ``sha256(f"{seed}:{name}")`` on the default device and cast to
bfloat16, written once into ``$SPECPARITY_ZOO_DIR/big/<size>-s<seed>-<recipe
digest>/{target,draft}`` with the zoo tokenizer (vocab ids < 512 are text; the
rest are valid ids without text). These pairs are pinned by recipe, not in
``zoo/manifest.json``: ``recipe.json`` in each dir records the recipe, the mlx
version, the device that drew the weights (CPU and GPU draws may differ in the
last bit) and the weights' sha256.

``python -m zoo.big --size 1b`` builds (or finds) a pair and prints its dirs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEEP_SCALE = 0.02
DRAFT_LAYERS = 2
FORMAT = 1


@dataclass(frozen=True)
class BigRecipe:
    size: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    seed: int = 0
    deep_scale: float = DEEP_SCALE
    draft_layers: int = DRAFT_LAYERS
    embed_std: float = 1.0
    lm_head_gain: float = 4.0  # × 1/sqrt(hidden)
    dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def digest(self) -> str:
        blob = json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def parameters(self) -> int:
        h, i, v, kv = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_key_value_heads
        per_layer = 2 * h * h + 2 * h * kv * self.head_dim + 3 * h * i + 2 * h
        return self.num_hidden_layers * per_layer + 2 * v * h + h


# ``1b``: TinyLlama-1.1B's shape (1.1 B parameters). ``tiny``: a CI smoke size.
SIZES: dict[str, BigRecipe] = {
    "tiny": BigRecipe("tiny", 64, 4, 176, 4, 2, 512),
    "small": BigRecipe("small", 512, 8, 1408, 8, 4, 32000),
    "1b": BigRecipe("1b", 2048, 22, 5632, 32, 4, 32000),
}


def recipe(size: str, seed: int = 0) -> BigRecipe:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} (known: {', '.join(SIZES)})")
    from dataclasses import replace

    return replace(SIZES[size], seed=seed)


def config(r: BigRecipe, layers: int | None = None) -> dict[str, Any]:
    """The mlx-lm ``llama`` ``config.json`` (``layers``: the drafter's cut)."""
    from zoo.build import BOS_ID, EOS_ID

    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": r.hidden_size, "num_hidden_layers": layers or r.num_hidden_layers,
        "intermediate_size": r.intermediate_size, "num_attention_heads": r.num_attention_heads,
        "num_key_value_heads": r.num_key_value_heads, "head_dim": r.head_dim,
        "rms_norm_eps": 1e-5, "vocab_size": r.vocab_size, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "rope_traditional": False, "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID, "torch_dtype": r.dtype,
    }  # fmt: skip


def _key(seed: int, name: str) -> Any:
    import mlx.core as mx

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return mx.random.key(int.from_bytes(digest[:4], "little"))


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else None


def _tensor(r: BigRecipe, name: str, shape: tuple[int, ...]) -> Any:
    import mlx.core as mx

    dtype = getattr(mx, r.dtype)
    if name.endswith("norm.weight"):
        return mx.ones(shape, dtype)
    if name == "model.embed_tokens.weight":
        std = r.embed_std
    elif name == "lm_head.weight":
        std = r.lm_head_gain / math.sqrt(shape[-1])
    else:
        std = 1.0 / math.sqrt(shape[-1])
        layer = _layer_index(name)
        if layer is not None and layer >= r.draft_layers and name.endswith(("o_proj.weight", "down_proj.weight")):
            std *= r.deep_scale
    w = mx.random.normal(shape, mx.float32, key=_key(r.seed, name)) * std
    return w.astype(dtype)


def _shapes(r: BigRecipe) -> dict[str, tuple[int, ...]]:
    from mlx_lm.utils import _get_classes

    from engine.models import parameter_shapes

    cfg = config(r)
    cfg["num_hidden_layers"] = 1  # shapes repeat per layer; no need to allocate L layers here
    model_cls, args_cls = _get_classes(cfg)
    one = parameter_shapes(model_cls(args_cls.from_dict(cfg)))
    out = {}
    for name, shape in one.items():
        if _layer_index(name) == 0:
            for i in range(r.num_hidden_layers):
                out[name.replace("layers.0.", f"layers.{i}.", 1)] = shape
        else:
            out[name] = shape
    return out


def root() -> Path:
    from zoo import cache_root

    return cache_root() / "big"


def pair_dirs(r: BigRecipe) -> tuple[Path, Path]:
    base = root() / f"{r.size}-s{r.seed}-{r.digest()}"
    return base / "target", base / "draft"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _complete(d: Path, r: BigRecipe) -> bool:
    meta = d / "recipe.json"
    if not (meta.is_file() and (d / "model.safetensors").is_file()):
        return False
    try:
        return json.loads(meta.read_text()).get("recipe") == asdict(r)
    except ValueError:
        return False


def build(size: str = "1b", seed: int = 0, log: Any = None) -> tuple[Path, Path]:
    """The ``(target_dir, draft_dir)`` of a big pair, built on first use (atomic rename)."""
    import mlx.core as mx

    from zoo.build import tokenizer_files

    r = recipe(size, seed)
    tdir, ddir = pair_dirs(r)
    if _complete(tdir, r) and _complete(ddir, r):
        return tdir, ddir
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    say(f"zoo.big: building {size} (seed {seed}, {r.parameters() / 1e9:.2f} B parameters, {r.dtype}) "
        f"on {mx.default_device()} into {tdir.parent}")
    base = tdir.parent
    base.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{base.name}.", dir=base.parent))
    try:
        shapes = _shapes(r)
        weights = {}
        for name in sorted(shapes):
            weights[name] = _tensor(r, name, shapes[name])
            mx.eval(weights[name])
        draft = {k: v for k, v in weights.items()
                 if _layer_index(k) is None or (_layer_index(k) or 0) < r.draft_layers}
        for sub, ws, layers in (("target", weights, None), ("draft", draft, r.draft_layers)):
            d = tmp / sub
            d.mkdir()
            mx.save_safetensors(str(d / "model.safetensors"), ws, metadata={"format": "mlx"})
            (d / "config.json").write_text(json.dumps(config(r, layers), indent=2, sort_keys=True) + "\n")
            for fname, data in tokenizer_files().items():
                (d / fname).write_bytes(data)
            meta = {"recipe": asdict(r), "role": sub, "layers": layers or r.num_hidden_layers,
                    "mlx": mx.__version__, "drawn_on": str(mx.default_device()),
                    "weights_sha256": _sha256(d / "model.safetensors")}
            (d / "recipe.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        del weights, draft
        tmp.chmod(0o755)
        if base.exists():
            shutil.rmtree(base)
        os.replace(tmp, base)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"zoo.big: built {tdir} and {ddir}")
    return tdir, ddir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zoo.big", description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=tuple(SIZES), default="1b")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t, d = build(args.size, args.seed)
    print(t)
    print(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
