"""Loading target/drafter models from local mlx-lm directories.

Uses mlx-lm 0.32.2 ``mlx_lm.utils.load`` unchanged (``model*.safetensors`` +
``config.json`` + tokenizer files). Nothing is ever downloaded: a path that is
not an existing local directory is refused before mlx-lm sees it.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from traces.io import MAX_INPUT_BYTES


class ModelLoadError(ValueError):
    """A model directory is missing or is not in mlx-lm format."""


@dataclass
class LoadedModel:
    path: Path
    model: Any
    tokenizer: Any

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(sorted(int(t) for t in self.tokenizer.eos_token_ids))


CONFIG_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "max_position_embeddings", "head_dim",
               "sliding_window")
"""config.json keys that mlx-lm's ``ModelArgs`` read as positive integers (when present)."""
CONFIG_FLOATS = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "rope_theta")


def check_config(data: Any, where: str | os.PathLike[str]) -> dict[str, Any]:
    """The one check of a model's parsed ``config.json``: required keys and their types.

    mlx-lm 0.32.2 (``mlx_lm/utils.py`` ``load_model``/``_get_classes``) needs
    ``model_type`` to pick the architecture and reads the sizes below as
    integers; a missing or mistyped one would otherwise surface as a
    ``KeyError``/``TypeError`` deep inside the loader. Nested ``text_config``
    (multimodal checkpoints) is checked by the same rules.

    Raises:
        ModelLoadError: naming ``where`` (the config file) and the key.
    """
    if not isinstance(data, dict):
        raise ModelLoadError(f"{where}: config.json is not a JSON object")
    nested = data.get("text_config")
    mt = data.get("model_type")
    if not isinstance(mt, str) or not mt.strip():
        if mt is None:
            raise ModelLoadError(f"{where}: no 'model_type' (mlx-lm needs it to pick the "
                                 "architecture); not an mlx-lm model config")
        raise ModelLoadError(f"{where}: 'model_type' must be a non-empty string, got {mt!r}")
    for cfg, prefix in ((data, ""), (nested if isinstance(nested, dict) else {}, "text_config.")):
        for key in CONFIG_INTS:
            v = cfg.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ModelLoadError(f"{where}: '{prefix}{key}' must be a positive integer, "
                                     f"got {v!r}")
        for key in CONFIG_FLOATS:
            v = cfg.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)
                                  or v != v or v in (float("inf"), float("-inf"))):
                raise ModelLoadError(f"{where}: '{prefix}{key}' must be a finite number, got {v!r}")
        eos = cfg.get("eos_token_id")
        if eos is not None and not (
                (isinstance(eos, int) and not isinstance(eos, bool) and eos >= 0)
                or (isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool)
                                                  and e >= 0 for e in eos))):
            raise ModelLoadError(f"{where}: '{prefix}eos_token_id' must be a token id or a list of "
                                 f"them, got {eos!r}")
    return data


def check_model_dir(path: str | os.PathLike[str]) -> Path:
    """A local model directory: ``config.json`` (checked by :func:`check_config`) + safetensors."""
    import json

    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelLoadError(f"model path {str(p)!r} is not a local directory (nothing is downloaded)")
    cfg = p / "config.json"
    if not cfg.exists():
        raise ModelLoadError(f"{p}: no config.json; expected an mlx-lm model directory")
    check_model_files(p)  # FIFOs, devices, oversized configs: refused before any open()
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ModelLoadError(f"{cfg}: unreadable config.json ({exc})") from None
    check_config(data, cfg)
    if not list(p.glob("model*.safetensors")):
        raise ModelLoadError(f"{p}: no model*.safetensors; mlx-lm needs safetensors weights")
    return p


# What mlx-lm / transformers open in a model dir: config, tokenizer and weight files.
_READ_SUFFIXES = (".json", ".safetensors", ".model", ".tiktoken", ".txt", ".jinja")


def check_model_files(path: str | os.PathLike[str]) -> None:
    """Every file mlx-lm's loader may open in ``path`` is a regular file (``traces.io.regular_file``).

    A FIFO named ``model.safetensors`` or ``tokenizer.json`` would block the
    loader's ``open()`` forever and ``/dev/zero`` linked as ``config.json``
    would be read forever: refused here, by ``stat``, before anything opens them.
    Weights have no size bound; the other files the bound of every whole-file read.
    """
    from traces.io import InputFileError, regular_file

    for f in sorted(Path(path).iterdir()):
        if f.name.endswith(_READ_SUFFIXES):
            try:
                regular_file(f, max_bytes=None if f.suffix == ".safetensors" else MAX_INPUT_BYTES)
            except InputFileError as exc:
                raise ModelLoadError(str(exc)) from None


def load(path: str | os.PathLike[str]) -> LoadedModel:
    """Load a local mlx-lm model directory (offline)."""
    p = check_model_dir(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from mlx_lm.utils import load as mlx_load

    loaded = mlx_load(str(p))
    model, tokenizer = loaded[0], loaded[1]
    return LoadedModel(path=p, model=model, tokenizer=tokenizer)


def file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def parameters(module: Any) -> dict[str, Any]:
    """A module's parameters flattened to ``{"a.b.weight": array}`` (mlx ``tree_flatten``)."""
    from mlx.utils import tree_flatten

    return dict(cast(list[tuple[str, Any]], tree_flatten(module.parameters())))


def parameter_shapes(module: Any) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of a module's parameters."""
    return {k: tuple(v.shape) for k, v in parameters(module).items()}
