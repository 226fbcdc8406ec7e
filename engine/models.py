"""Loading target/drafter models from local mlx-lm directories.

Uses mlx-lm 0.32.2 ``mlx_lm.utils.load`` unchanged (``model*.safetensors`` +
``config.json`` + tokenizer files). Nothing is ever downloaded: a path that is
not an existing local directory is refused before mlx-lm sees it.
"""

from __future__ import annotations

import hashlib
import os
import re
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
        for key in ("quantization", "quantization_config"):
            q = cfg.get(key)
            if q is not None and not isinstance(q, dict):
                raise ModelLoadError(f"{where}: '{prefix}{key}' must be an object (e.g. {{\"group_size\": 64, "
                                     f"\"bits\": 4}}), got {q!r}")
        q = cfg.get("quantization")
        if isinstance(q, dict):  # mlx-lm reads quantization["group_size"] and ["bits"]
            for key in ("group_size", "bits"):
                v = q.get(key)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ModelLoadError(f"{where}: '{prefix}quantization.{key}' must be a positive "
                                         f"integer, got {v!r}")
        eos = cfg.get("eos_token_id")
        if eos is not None and not (
                (isinstance(eos, int) and not isinstance(eos, bool) and eos >= 0)
                or (isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool)
                                                  and e >= 0 for e in eos))):
            raise ModelLoadError(f"{where}: '{prefix}eos_token_id' must be a token id or a list of "
                                 f"them, got {eos!r}")
    return data


def check_model_dir(path: str | os.PathLike[str]) -> Path:
    """A local model directory, checked before MLX sees any of it: ``config.json``
    (:func:`check_config`), every weights file's header (``traces.digest.safetensors_header``)
    and the config against the weights (:func:`check_weights`). The one check on every loader
    path (:func:`load`, ``specparity.cli.args.check_model_dir`` for the flags)."""

    try:
        p = Path(path).expanduser()
    except RuntimeError:
        raise ModelLoadError(f"model path {str(path)!r}: cannot expand "
                             f"{str(path).split('/', 1)[0]!r}: no such user") from None
    if not p.is_dir():
        raise ModelLoadError(f"model path {str(p)!r} is not a local directory (nothing is downloaded)")
    cfg = p / "config.json"
    if cfg.is_symlink() and not cfg.exists():
        raise ModelLoadError(f"{cfg}: a symbolic link to nothing (or a link loop); give the real "
                             "config.json")
    if not cfg.exists():
        raise ModelLoadError(f"{p}: no config.json; expected an mlx-lm model directory")
    check_model_files(p)  # FIFOs, devices, oversized configs: refused before any open()
    data = _read_json(cfg)
    check_config(data, cfg)
    check_tokenizer(p)
    if not list(p.glob("model*.safetensors")):
        raise ModelLoadError(f"{p}: no model*.safetensors; mlx-lm needs safetensors weights")
    check_weights(p, data)
    return p


def _read_json(path: Path) -> Any:
    """A model directory's JSON file (``config.json``, ``tokenizer.json``); unreadable, not UTF-8,
    not JSON or nested too deeply is one line naming it."""
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ModelLoadError(f"{path}: unreadable {path.name} (JSON nested too deeply)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: unreadable {path.name} ({exc})") from None


def check_tokenizer(path: Path) -> None:
    """``tokenizer.json``, when present, has the fields every Hugging Face ``tokenizers`` file
    has (``model`` an object, ``added_tokens`` a list): ``{}`` or a truncated file is one line
    naming it, not a ``KeyError`` from inside mlx-lm's tokenizer wrapper."""

    tok = path / "tokenizer.json"
    if not tok.exists():
        return
    data = _read_json(tok)
    if not isinstance(data, dict):
        raise ModelLoadError(f"{tok}: not a tokenizer (a JSON {type(data).__name__}, expected an object)")
    for key, typ, what in (("model", dict, "an object"), ("added_tokens", list, "a list")):
        if not isinstance(data.get(key), typ):
            raise ModelLoadError(f"{tok}: not a Hugging Face tokenizers file: '{key}' "
                                 f"{'missing' if key not in data else 'is not ' + what}")


INDEX = "model.safetensors.index.json"
_LAYER = re.compile(r"^(?:language_model\.)?(?:model\.)?(?:language_model\.)?layers\.(\d+)\.")
_EMBED = re.compile(r"^(?:language_model\.)?(?:model\.)?(?:language_model\.)?embed_tokens\.weight$")
_NORM = re.compile(r"^(?:language_model\.)?(?:model\.)?(?:language_model\.)?norm\.weight$")


def check_weights(path: str | os.PathLike[str], config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The weights of model dir ``path`` checked against their own headers and ``config``.

    Before MLX builds anything: every ``*.safetensors`` header describes its file
    (``traces.digest.safetensors_header``: offsets vs shape and dtype, no negative offsets or
    shapes, known dtypes); every shard ``model.safetensors.index.json`` names exists; and the
    config does not describe a model beyond its weights (mlx-lm builds the model from the
    config first: a ``num_hidden_layers`` of a million builds for minutes, a ``vocab_size`` of
    10^9 allocates an embedding that cannot fit, before the load finds the mismatch):
    ``num_hidden_layers`` at most the layers the weights hold (``layers.N.``), ``vocab_size``
    at most the embedding's rows, ``hidden_size`` at most the final norm's width. Each refusal
    names the file and the field. Returns the tensor entries by name.
    """
    import json

    from traces.digest import WeightsError, safetensors_header
    from traces.io import InputFileError, regular_file

    p = Path(path)
    index = p / INDEX
    if index.exists() or index.is_symlink():
        try:
            doc = json.loads(regular_file(index).read_text(encoding="utf-8"))
        except (InputFileError, OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ModelLoadError(f"{index}: unreadable index ({exc})") from None
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ModelLoadError(f"{index}: 'weight_map' must be an object of tensor name -> shard file")
        for shard in sorted(set(wm.values())):
            if "/" in shard or "\\" in shard or shard in ("", ".", ".."):
                raise ModelLoadError(f"{index}: weight_map names shard {shard!r}, not a file name in {p}")
            if not (p / shard).is_file():
                raise ModelLoadError(f"{index}: weight_map names shard {shard!r}, which {p} lacks (an "
                                     "incomplete download); re-download it")
    tensors: dict[str, dict[str, Any]] = {}
    for f in sorted(p.glob("*.safetensors")):
        try:
            tensors.update(safetensors_header(f))
        except WeightsError as exc:
            raise ModelLoadError(str(exc)) from None
    cfg_path = p / "config.json"
    packed = sorted(n[: -len(".scales")] for n in tensors if n.endswith(".scales")
                    and tensors.get(n[: -len(".scales")] + ".weight", {}).get("dtype") == "U32")
    text_cfg = config.get("text_config")
    nested_cfg: dict[str, Any] = text_cfg if isinstance(text_cfg, dict) else {}
    if packed and not any(k in c for c in (config, nested_cfg) for k in ("quantization", "quantization_config")):
        raise ModelLoadError(f"{cfg_path}: no 'quantization' block, but the weights are quantized "
                             f"({len(packed)} packed tensor(s) with scales, e.g. {packed[0]}.weight): mlx-lm "
                             "would build an unquantized model; restore the config's quantization "
                             "(bits, group_size)")
    layers = {int(m.group(1)) for n in tensors for m in [_LAYER.search(n)] if m}
    embed = next((t for n, t in sorted(tensors.items()) if _EMBED.match(n) and len(t["shape"]) == 2), None)
    norm = next((t for n, t in sorted(tensors.items()) if _NORM.match(n) and len(t["shape"]) == 1), None)
    nested = config.get("text_config")
    for cfg, prefix in ((config, ""), (nested if isinstance(nested, dict) else {}, "text_config.")):
        n = cfg.get("num_hidden_layers")
        # (a head's directory, e.g. an MTP head with its target's config, holds no embedding)
        if isinstance(n, int) and layers and embed is not None and n > max(layers) + 1:
            raise ModelLoadError(f"{cfg_path}: '{prefix}num_hidden_layers' is {n}, the weights hold "
                                 f"{max(layers) + 1} layer(s): the config does not describe these weights")
        v = cfg.get("vocab_size")
        if isinstance(v, int) and embed is not None and v > embed["shape"][0]:
            raise ModelLoadError(f"{cfg_path}: '{prefix}vocab_size' is {v}, the embedding holds "
                                 f"{embed['shape'][0]} rows: the config does not describe these weights")
        h = cfg.get("hidden_size")
        if isinstance(h, int) and norm is not None and h > norm["shape"][0]:
            raise ModelLoadError(f"{cfg_path}: '{prefix}hidden_size' is {h}, the final norm is "
                                 f"{norm['shape'][0]} wide: the config does not describe these weights")
    return tensors


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


def native_mtp_layers(config: dict[str, Any], tensors: dict[str, Any]) -> tuple[str, ...]:
    """The ``model.layers.{i}.`` prefixes of a checkpoint's native MTP layers: indices at or past
    ``num_hidden_layers`` (GLM-4.x / DeepSeek-V3 layout, ``engine.sources.native_mtp``)."""
    n = config.get("num_hidden_layers")
    if not isinstance(n, int):
        return ()
    extra = sorted({int(m.group(1)) for k in tensors for m in [re.match(r"^model\.layers\.(\d+)\.", k)]
                    if m and int(m.group(1)) >= n})
    return tuple(f"model.layers.{i}." for i in extra)


def load(path: str | os.PathLike[str]) -> LoadedModel:
    """Load a local mlx-lm model directory (offline), checked first (:func:`check_model_dir`).

    A checkpoint carrying native MTP layers (``model.layers.{N+j}``, :func:`native_mtp_layers`)
    is loaded as its trunk: those tensors are dropped before mlx-lm's own ``sanitize`` and its
    strict load (mlx-lm 0.32.2 ``glm4_moe.py`` ``Model.sanitize`` drops ``model.layers.{N}``
    itself, but ``deepseek_v3.py`` drops only ``model.layers.61``, so a DeepSeek-V3 checkpoint
    of another depth failed with "Received ... parameters not in model"). The MTP source reads
    the layers from the checkpoint itself (``engine.sources.native_mtp``); this is the same
    trunk the zoo's stripped ``deepseek-mtp-plain`` holds, for any user's checkpoint.
    """
    p = check_model_dir(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import json

    config = json.loads((p / "config.json").read_text(encoding="utf-8"))
    from traces.digest import safetensors_header

    drop = native_mtp_layers(config, {k: None for f in sorted(p.glob("*.safetensors"))
                                      for k in safetensors_header(f)})
    if not drop:
        from mlx_lm.utils import load as mlx_load

        loaded = mlx_load(str(p))
        return LoadedModel(path=p, model=loaded[0], tokenizer=loaded[1])
    from mlx_lm.utils import _get_classes, load_model, load_tokenizer

    def classes(config: dict[str, Any]) -> tuple[Any, Any]:
        model_cls, args_cls = _get_classes(config=config)

        def build(args: Any) -> Any:  # the family's own class; only this instance's sanitize wrapped
            model = model_cls(args)
            own = getattr(model, "sanitize", None)

            def sanitize(weights: dict[str, Any]) -> dict[str, Any]:
                kept = {k: v for k, v in weights.items() if not k.startswith(drop)}
                return own(kept) if own is not None else kept

            object.__setattr__(model, "sanitize", sanitize)
            return model

        return build, args_cls

    model, cfg = load_model(p, get_model_classes=classes)
    try:
        object.__delattr__(model, "sanitize")
    except AttributeError:
        pass
    tokenizer = load_tokenizer(p, None, eos_token_ids=cfg.get("eos_token_id", None))
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
