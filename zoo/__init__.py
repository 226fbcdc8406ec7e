"""The tiny zoo: deterministic, seed-built mlx-lm models for tests and the CLI.

Targets ``llama`` and ``qwen3`` (mlx-lm 0.32.2 ``mlx_lm/models/llama.py`` and
``mlx_lm/models/qwen3.py``), each with drafters ``self`` (the target itself),
``twin`` (target + seeded Gaussian noise) and ``small`` (independent smaller model
of the same architecture).  All share one byte-level BPE tokenizer
(``tokenizer.json``, see ``build_tokenizer.py``).

Models are built on first use into ``$SPECPARITY_ZOO_DIR`` (default
``~/.cache/specparity/zoo``), one subdir per model name, and verified against the
committed ``manifest.json``; drift raises :class:`ZooDriftError`.

Acceptance is measured with mlx-lm 0.32.2 ``mlx_lm/generate.py``
``speculative_generate_step`` (greedy by default).

This module is import-light: mlx / mlx-lm are imported inside functions only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from zoo import pinned

__all__ = [
    "DRAFTERS",
    "EOS_TOKEN",
    "TARGETS",
    "Prompt",
    "ZooDriftError",
    "cache_root",
    "acceptance_of",
    "clear_verification_cache",
    "config_digest",
    "eos_id",
    "manifest",
    "measure_acceptance",
    "model_dir",
    "model_name",
    "model_names",
    "pair",
    "pairs",
    "prompt",
    "prompts",
    "tokenizer_digest",
    "tokenizer_path",
    "weights_digest",
]

TARGETS: tuple[str, ...] = ("llama", "qwen3", "gemma3", "gemma4", "qwen35")
DRAFTERS: tuple[str, ...] = ("self", "twin", "small")
EOS_TOKEN = "<|eos|>"

_HERE = Path(__file__).resolve().parent
_MANIFEST_FILE = _HERE / "manifest.json"
_PROMPTS_FILE = _HERE / "prompts.json"
_TOKENIZER_FILE = _HERE / "tokenizer.json"
_CHECKED_FILES = ("model.safetensors", "config.json", "tokenizer.json")


class ZooDriftError(RuntimeError):
    """A built zoo model (or the build recipe) no longer matches ``manifest.json``."""


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str  # "natural" | "random"
    text: str | None
    token_ids: tuple[int, ...]


# --------------------------------------------------------------------------- names


# The trained pair (issue "realistic zoo pair"): committed weights, not built
# from seeds; see zoo/train.py. Its drafter is named ``trained``.
TRAINED_TARGET = "llama-trained"
TRAINED_DRAFTER = "trained"

# The quantized-KV pairs (zoo/build.py KV_TARGETS): head dim 32 and 64, so mx.quantize can
# group their KV (the other zoo models have head dim 16). Not in TARGETS: the run's zoo matrix
# adds two quantized-KV cases on each (specparity.jobs.run.zoo_cases), nothing else. MLX's CUDA
# backend runs quantized KV on the head-dim-64 pair only (docs/backends.md).
KV_TARGET = "llama-kv"
KV64_TARGET = "llama-kv64"
KV_TARGETS = (KV_TARGET, KV64_TARGET)
KV_PAIR = (KV_TARGET, f"{KV_TARGET}-twin")
KV64_PAIR = (KV64_TARGET, f"{KV64_TARGET}-twin")


def model_names() -> tuple[str, ...]:
    """All model names: the seeded ones (``llama``, ``llama-twin``, ...) and the trained pair."""
    from zoo.train import PAIR

    return tuple(n for t in TARGETS for n in (t, f"{t}-twin", f"{t}-small")) + KV_PAIR + KV64_PAIR + PAIR


def model_name(target: str, drafter: str) -> str:
    """The zoo model name for ``(target, drafter)``; ``self`` maps to the target."""
    if target == TRAINED_TARGET:
        from zoo.train import DRAFTER_NAME

        if drafter not in ("self", TRAINED_DRAFTER):
            raise ValueError(f"the trained target pairs with 'self' or {TRAINED_DRAFTER!r}, not {drafter!r}")
        return target if drafter == "self" else DRAFTER_NAME
    if target in KV_TARGETS:
        if drafter not in ("self", "twin"):
            raise ValueError(f"the {target} target pairs with 'self' or 'twin', not {drafter!r}")
        return target if drafter == "self" else f"{target}-twin"
    if target not in TARGETS:
        raise ValueError(f"unknown zoo target {target!r}; valid: {', '.join(TARGETS)}")
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown zoo drafter {drafter!r}; valid: {', '.join(DRAFTERS)}")
    return target if drafter == "self" else f"{target}-{drafter}"


def pairs() -> list[tuple[str, str]]:
    """All ``(target, drafter)`` combinations, the trained pair last."""
    return [(t, d) for t in TARGETS for d in DRAFTERS] + [(TRAINED_TARGET, TRAINED_DRAFTER)]


# ------------------------------------------------------------------------ digests


def weights_digest(path: Path | str) -> str:
    """Canonical sha256 of a model's weights (``traces.digest.weights_digest``).

    ``path`` is a model dir or a ``.safetensors`` file; every dtype MLX saves.
    """
    from traces.digest import weights_digest as digest

    return digest(path)


def _file_sha256(p: Path) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def config_digest(path: Path | str) -> str:
    """sha256 of a model dir's configuration file (``traces.digest.config_digest``: the one
    definition every header uses), or of the file ``path`` names."""
    from traces.digest import config_digest as of_dir

    p = Path(path)
    if not p.is_dir():
        return _file_sha256(p)
    got = of_dir(p)
    if got is None:
        raise FileNotFoundError(f"{p}: no config.json (or dspark.json)")
    return got


def tokenizer_path() -> Path:
    """The committed shared ``tokenizer.json``."""
    return _TOKENIZER_FILE


def tokenizer_digest() -> str:
    """sha256 of the committed ``tokenizer.json`` bytes."""
    return _file_sha256(_TOKENIZER_FILE)


@cache
def eos_id() -> int:
    """Token id of :data:`EOS_TOKEN` in the shared tokenizer."""
    data = json.loads(_TOKENIZER_FILE.read_text())
    for tok in data["added_tokens"]:
        if tok["content"] == EOS_TOKEN:
            return int(tok["id"])
    raise ZooDriftError(f"zoo drift: {EOS_TOKEN} missing from {_TOKENIZER_FILE}")


# ----------------------------------------------------------------------- manifest


def manifest() -> dict[str, Any]:
    """The committed pinning manifest (re-read each call; it is tiny)."""
    return json.loads(_MANIFEST_FILE.read_text())


def cache_root() -> Path:
    """``$SPECPARITY_ZOO_DIR`` or ``~/.cache/specparity/zoo``."""
    from traces import env

    root = env.get("SPECPARITY_ZOO_DIR")  # a file, ~nosuchuser: one line naming the variable
    return root if root is not None else Path.home() / ".cache" / "specparity" / "zoo"


def clear_verification_cache() -> None:
    """Forget which model dirs this process has already verified."""
    pinned.clear()


def _stamp(d: Path) -> tuple[Any, ...]:
    return pinned.stamp(d, _CHECKED_FILES)


def _verify(name: str, d: Path) -> None:
    from zoo.build import RECIPES

    entry = manifest()["models"].get(name)
    if entry is None:
        raise ZooDriftError(f"zoo drift: {name}: no entry in {_MANIFEST_FILE}")
    recipe = RECIPES[name].to_json()
    if entry["recipe"] != recipe:
        raise ZooDriftError(
            f"zoo drift: {name}: build recipe differs from manifest "
            f"(manifest {entry['recipe']}, code {recipe}); "
            "run `python -m zoo.build --update-manifest` if intended"
        )
    checks = (
        ("model.safetensors", "weights_sha256", lambda: weights_digest(d)),
        ("config.json", "config_sha256", lambda: config_digest(d)),
        ("tokenizer.json", "tokenizer_sha256", lambda: _file_sha256(d / "tokenizer.json")),
    )
    pinned.check_digests(d, entry, checks, lambda m: ZooDriftError(f"zoo drift: {name}: {m}"),
                         f"a stale cache? delete {d} to rebuild")
    if entry["tokenizer_sha256"] != tokenizer_digest():
        raise ZooDriftError(
            f"zoo drift: {name}: committed tokenizer.json has sha256 {tokenizer_digest()}, "
            f"manifest expects {entry['tokenizer_sha256']}"
        )


def model_dir(name: str) -> Path:
    """Path of zoo model ``name``, building it on first use and verifying digests.

    Raises ``ValueError`` for unknown names and :class:`ZooDriftError` when the
    built files (or the recipe) do not match ``manifest.json``.
    """
    if name not in model_names():
        raise ValueError(f"unknown zoo model {name!r}; valid: {', '.join(model_names())}")
    from zoo.train import PAIR, trained_dir

    if name in PAIR:
        return trained_dir(name)  # committed weights, verified against trained/manifest.json
    root = cache_root()
    # Keyed by the pinned digest: a manifest update builds a new dir instead of
    # tripping over a cache built by older code (tampering is still caught).
    entry = manifest()["models"].get(name)
    if entry is None:
        raise ZooDriftError(f"zoo drift: {name}: no entry in {_MANIFEST_FILE}")
    from zoo.build import write_model

    return pinned.artifact(root, f"{name}-{entry['weights_sha256'][:12]}", lambda tmp: write_model(name, tmp),
                           _CHECKED_FILES, lambda d: _verify(name, d),
                           lambda m: ZooDriftError(f"zoo drift: {name}: {m}"))


def pair(target: str, drafter: str) -> tuple[Path, Path]:
    """``(target_dir, drafter_dir)``; drafter ``self`` gives the target dir twice."""
    drafter_name = model_name(target, drafter)  # validates both names before building
    return model_dir(target), model_dir(drafter_name)


# ------------------------------------------------------------------------ prompts


@cache
def _prompts() -> tuple[Prompt, ...]:
    data = json.loads(_PROMPTS_FILE.read_text())
    return tuple(
        Prompt(id=p["id"], kind=p["kind"], text=p.get("text"), token_ids=tuple(p["token_ids"]))
        for p in data
    )


def prompts() -> list[Prompt]:
    """The committed prompt set (natural ``nat-XX`` and random ``rnd-XX``)."""
    return list(_prompts())


def prompt(id: str) -> Prompt:
    """The prompt with the given id (``KeyError`` if absent)."""
    for p in _prompts():
        if p.id == id:
            return p
    raise KeyError(f"unknown zoo prompt {id!r}")


# --------------------------------------------------------------------- acceptance

_LOADED: dict[tuple[str, tuple[Any, ...]], Any] = {}


def _load_model(path: Path) -> Any:
    key = (str(path), _stamp(path))  # reload if the (verified) files changed
    if key not in _LOADED:
        from mlx_lm.utils import load_model

        _LOADED[key] = load_model(path)[0]
    return _LOADED[key]


def measure_acceptance(
    target: str,
    drafter: str,
    gamma: int = 3,
    max_tokens: int = 32,
    prompt_ids: Sequence[str] | None = None,
) -> float:
    """Greedy acceptance rate of ``drafter`` for ``target`` over the prompt set.

    Uses mlx-lm's ``speculative_generate_step``; acceptance = tokens yielded with
    ``from_draft=True`` / tokens drafted (drafted per round =
    ``min(max_tokens - generated, gamma)``, as in mlx-lm).
    """
    tdir, ddir = pair(target, drafter)
    chosen = prompts() if prompt_ids is None else [prompt(i) for i in prompt_ids]
    return acceptance_of(
        _load_model(tdir), _load_model(ddir), [p.token_ids for p in chosen], gamma, max_tokens
    )


def acceptance_of(
    model: Any,
    draft_model: Any,
    prompt_token_ids: Sequence[Sequence[int]],
    gamma: int = 3,
    max_tokens: int = 32,
) -> float:
    """Greedy acceptance of loaded mlx-lm ``draft_model`` for ``model`` (see above)."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    drafted = accepted = 0
    for ids in prompt_token_ids:
        ntoks = 0
        round_open = False
        for _tok, _lp, from_draft in speculative_generate_step(
            mx.array(list(ids), mx.uint32),
            model,
            draft_model,
            num_draft_tokens=gamma,
            max_tokens=max_tokens,
        ):
            if not round_open:
                drafted += min(max_tokens - ntoks, gamma)
                round_open = True
            ntoks += 1
            if from_draft:
                accepted += 1
            else:
                round_open = False
    return accepted / drafted if drafted else float("nan")
