"""Zoo targets that carry their own MTP layers in the checkpoint, built from seeds.

Checkpoint layouts (``engine.sources.native_mtp`` reads them):

- ``glm-mtp``: a tiny mlx-lm 0.32.2 ``glm4_moe`` target (dense MLPs:
  ``first_k_dense_replace`` past the last layer) with ONE MTP layer as
  ``model.layers.{N}.*`` (GLM-4.5/4.7 layout: ``embed_tokens``, ``enorm``,
  ``hnorm``, ``eh_proj``, a decoder layer, ``shared_head.norm``,
  ``shared_head.head``; ``num_nextn_predict_layers: 1``). Stock mlx-lm loads it:
  ``glm4_moe.py`` ``Model.sanitize`` drops ``model.layers.{N}``.
- ``deepseek-mtp``: a tiny mlx-lm ``deepseek_v3`` target (MLA attention, dense
  MLPs) with TWO MTP layers ``model.layers.{N}``, ``model.layers.{N+1}``
  (DeepSeek-V3 layout, ``num_nextn_predict_layers: 2``: the chained-depth
  convention). Stock mlx-lm MISLOADS it: ``deepseek_v3.py`` ``Model.sanitize``
  drops only ``model.layers.61`` (V3's own depth), so the strict load fails on
  the extra layers. Plain decode and the speculative target read
  ``deepseek-mtp-plain`` (the same trunk tensors, MTP tensors dropped);
  the MTP source reads the full checkpoint.
- ``qwen35-native``: the zoo ``qwen35`` target (qwen3_5, gated DeltaNet + full
  attention) carrying the ``qwen35-mtp-self`` head as ``mtp.*`` (Qwen3.5 /
  Qwen3-Next layout, ``mtp_num_hidden_layers: 1``, mlx-format safetensors so the
  ``mtp.*`` norms are stored un-centred, as mlx-vlm 0.7.10's
  ``Qwen3_5MTPSplitter.on_mlx_source`` reads them). Stock mlx-lm loads it:
  ``qwen3_5.py`` ``Model.sanitize`` drops ``mtp.``. mlx-vlm's ``load_drafter``
  loads this directory directly (its splitter registry): the family mlx-vlm
  implements, compared with it draft logit for draft logit.

The MTP layers are "self"-initialised (the target's FIRST layer, final norm,
lm-head and embeddings, ``eh_proj`` = identity on the embedding half plus a
small seeded mix of the hidden: a one-layer model of the next position) so
drafts are accepted (~10 % at γ 3) and partial accepts are exercised. Pinned by sha256 in ``native_mtp_manifest.json`` with
the measured greedy acceptance; ``python -m zoo.native_mtp --update-manifest``
rebuilds (developer-only).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zoo.build import json_bytes

HERE = Path(__file__).resolve().parent
MANIFEST_FILE = HERE / "native_mtp_manifest.json"
_CHECKED = ("model.safetensors", "config.json")


@dataclass(frozen=True)
class NativeRecipe:
    name: str
    arch: str  # mlx-lm model_type
    seed: int
    mtp_layers: int
    strip: bool = False  # the plain-reference variant: MTP tensors dropped

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


RECIPES: dict[str, NativeRecipe] = {
    r.name: r
    for r in (
        NativeRecipe("glm-mtp", "glm4_moe", 7007, 1),
        NativeRecipe("deepseek-mtp", "deepseek_v3", 8008, 2),
        NativeRecipe("deepseek-mtp-plain", "deepseek_v3", 8008, 2, strip=True),
        # the zoo qwen35 trunk + the qwen35-mtp-self head as mtp.* (mlx-format checkpoint)
        NativeRecipe("qwen35-native", "qwen3_5", 5005, 1),
    )
}
NAMES = tuple(RECIPES)
# zoo target name -> (directory plain decode / the speculative target loads, MTP checkpoint)
TARGETS = {"glm-mtp": ("glm-mtp", "glm-mtp"), "deepseek-mtp": ("deepseek-mtp-plain", "deepseek-mtp"),
           "qwen35-native": ("qwen35-native", "qwen35-native")}


class NativeDriftError(RuntimeError):
    """A built native-MTP checkpoint (or its recipe) no longer matches the manifest."""


def config(name: str) -> dict[str, Any]:
    from zoo.build import BOS_ID, EOS_ID, VOCAB_SIZE

    r = RECIPES[name]
    if r.arch == "qwen3_5":
        from zoo.heads import head_config

        return {**head_config("qwen35-mtp-self")["text_config"], "mtp_num_hidden_layers": 1}
    cfg: dict[str, Any] = {
        "model_type": r.arch, "vocab_size": VOCAB_SIZE, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID, "torch_dtype": "float32",
        "num_nextn_predict_layers": r.mtp_layers,
    }  # fmt: skip
    if r.arch == "glm4_moe":
        cfg.update(
            architectures=["Glm4MoeForCausalLM"], head_dim=16, moe_intermediate_size=32,
            norm_topk_prob=True, n_group=1, topk_group=1, n_shared_experts=1, n_routed_experts=4,
            routed_scaling_factor=1.0, num_experts_per_tok=2, first_k_dense_replace=8,
            rope_scaling=None, use_qk_norm=True, attention_bias=False, partial_rotary_factor=0.5,
        )  # fmt: skip
    else:
        cfg.update(
            architectures=["DeepseekV3ForCausalLM"], num_key_value_heads=4, kv_lora_rank=16,
            q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
            moe_intermediate_size=32, first_k_dense_replace=8,
            rope_scaling=None, attention_bias=False,
        )  # fmt: skip
    if r.strip:
        cfg["num_nextn_predict_layers"] = 0
    return cfg


def _trunk(name: str) -> dict[str, np.ndarray]:
    """Trunk tensors (mlx-lm's own parameter names and shapes), seeded per tensor."""
    from mlx_lm.utils import _get_classes

    from engine.models import parameter_shapes
    from zoo.build import seeded_rng

    r = RECIPES[name]
    cfg = config(name)
    model_cls, args_cls = _get_classes(cfg)
    shapes = parameter_shapes(model_cls(args_cls.from_dict(cfg)))
    out = {}
    for k in sorted(shapes):
        shape = shapes[k]
        rng = seeded_rng(r.seed, k)
        if k.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif k.endswith("embed_tokens.weight"):
            w = rng.standard_normal(shape)
        elif k.endswith("lm_head.weight"):
            w = 4.0 * rng.standard_normal(shape) / math.sqrt(shape[-1])
        elif k.endswith(".weight") and len(shape) >= 2:
            w = rng.standard_normal(shape) / math.sqrt(shape[-1])
        else:
            w = np.zeros(shape)
        out[k] = w.astype(np.float32)
    return out


def weights(name: str) -> dict[str, np.ndarray]:
    """All checkpoint tensors: the trunk plus ``model.layers.{N+j}.*`` MTP layers."""
    from zoo.build import seeded_rng

    r = RECIPES[name]
    if r.arch == "qwen3_5":
        from zoo.build import model_weights
        from zoo.heads import head_weights

        head = head_weights("qwen35-mtp-self")
        return {**model_weights("qwen35"), **{f"mtp.{k}": head[k] for k in head}}
    cfg = config(name)
    trunk = _trunk(name)
    if r.strip:
        return trunk
    n, h = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    first = "model.layers.0."
    out = dict(trunk)
    for j in range(r.mtp_layers):
        pre = f"model.layers.{n + j}."
        rng = seeded_rng(r.seed, f"{pre}mtp")
        for k, v in trunk.items():
            if k.startswith(first):
                out[pre + k[len(first):]] = v.copy()
        out[pre + "embed_tokens.weight"] = trunk["model.embed_tokens.weight"].copy()
        out[pre + "shared_head.norm.weight"] = trunk["model.norm.weight"].copy()
        out[pre + "shared_head.head.weight"] = trunk["lm_head.weight"].copy()
        out[pre + "enorm.weight"] = (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        out[pre + "hnorm.weight"] = (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        mix = 0.3 * rng.standard_normal((h, h)) / math.sqrt(h)
        out[pre + "eh_proj.weight"] = np.concatenate([np.eye(h), mix], axis=1).astype(np.float32)
    return out


def write(name: str, out_dir: Path) -> Path:
    from zoo.build import save_checkpoint

    return save_checkpoint(out_dir, weights(name), config(name))


def manifest() -> dict[str, Any]:
    return json.loads(MANIFEST_FILE.read_text()) if MANIFEST_FILE.is_file() else {"format": 1, "models": {}}


def _verify(name: str, d: Path) -> None:
    from zoo import config_digest, weights_digest

    entry = manifest()["models"].get(name)
    if entry is None:
        raise NativeDriftError(f"zoo drift: native-mtp {name}: no entry in {MANIFEST_FILE}")
    if entry["recipe"] != RECIPES[name].to_json():
        raise NativeDriftError(f"zoo drift: native-mtp {name}: recipe differs from the manifest; "
                               "run `python -m zoo.native_mtp --update-manifest` if intended")
    for fname, key, fn in (("model.safetensors", "weights_sha256", weights_digest),
                           ("config.json", "config_sha256", config_digest)):
        got = fn(d)
        if got != entry[key]:
            raise NativeDriftError(f"zoo drift: native-mtp {name}: {fname} in {d} has sha256 {got}, "
                                   f"manifest expects {entry[key]} (delete {d} to rebuild)")


def model_dir(name: str) -> Path:
    """Path of native-MTP checkpoint ``name``, built into the zoo cache on first use and verified."""
    from zoo import cache_root, pinned

    if name not in RECIPES:
        raise ValueError(f"unknown native-mtp zoo model {name!r}; valid: {', '.join(NAMES)}")
    entry = manifest()["models"].get(name)
    if entry is None:
        raise NativeDriftError(f"zoo drift: native-mtp {name}: no entry in {MANIFEST_FILE}")
    return pinned.artifact(cache_root(), f"native-{name}-{entry['weights_sha256'][:12]}{entry['config_sha256'][:4]}",
                           lambda tmp: write(name, tmp), _CHECKED, lambda d: _verify(name, d),
                           lambda m: NativeDriftError(f"zoo drift: native-mtp {name}: {m}"))


def target_paths(target: str) -> tuple[Path, Path]:
    """``(target dir for plain decode and verification, MTP checkpoint dir)`` of a zoo target."""
    if target not in TARGETS:
        raise ValueError(f"unknown native-mtp zoo target {target!r}; valid: {', '.join(TARGETS)}")
    plain, ckpt = TARGETS[target]
    return model_dir(plain), model_dir(ckpt)


# The zoo matrix's native-mtp cases (``specparity run``): each target under its family's
# conventions (drafter ``native``) plus one cross-family preset; few prompts, the default run
# stays fast.
MATRIX = (("glm-mtp", "native"), ("deepseek-mtp", "native"), ("glm-mtp", "native-qwen"))
MATRIX_PROMPTS = 2


def measure(target: str, gamma: int = 3, max_tokens: int = 32, n_prompts: int = 8) -> dict[str, Any]:
    """Greedy acceptance of the checkpoint's MTP head (family default conventions)."""
    from mlx_lm.utils import load_model

    import zoo
    from engine.executor import GenerationParams, spec_generate
    from engine.sources import make_provider

    tpath, cpath = target_paths(target)
    model = load_model(tpath)[0]
    provider = make_provider("native-mtp", path=cpath)
    drafted = accepted = 0
    for p in zoo.prompts()[:n_prompts]:
        res = spec_generate(model, provider, list(p.token_ids),
                            GenerationParams(max_tokens=max_tokens, gamma=gamma, cache_digests=False))
        assert res.speculation is not None
        drafted += res.speculation.drafted
        accepted += res.speculation.accepted
    return {"gamma": gamma, "max_tokens": max_tokens, "prompts": n_prompts, "drafted": drafted,
            "accepted": accepted, "acceptance": round(accepted / drafted, 4) if drafted else None}


def build_manifest() -> dict[str, Any]:
    from zoo import config_digest, weights_digest

    models = {}
    with tempfile.TemporaryDirectory(prefix="specparity-native-") as tmp:
        for name in NAMES:
            p = write(name, Path(tmp) / name)
            models[name] = {"recipe": RECIPES[name].to_json(), "weights_sha256": weights_digest(p),
                            "config_sha256": config_digest(p)}
    return {"format": 1, "models": models}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--update-manifest", action="store_true")
    args = ap.parse_args(argv)
    if args.update_manifest:
        m = build_manifest()
        MANIFEST_FILE.write_bytes(json_bytes(m))
        m["acceptance"] = {t: measure(t) for t in TARGETS}
        MANIFEST_FILE.write_bytes(json_bytes(m))
        print(f"wrote {MANIFEST_FILE}")
    else:
        for name in NAMES:
            print(f"{name}: {model_dir(name)}")


if __name__ == "__main__":
    main()
