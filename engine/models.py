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


def check_model_dir(path: str | os.PathLike[str]) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelLoadError(f"model path {str(p)!r} is not a local directory (nothing is downloaded)")
    if not (p / "config.json").exists():
        raise ModelLoadError(f"{p}: no config.json; expected an mlx-lm model directory")
    check_model_files(p)
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
