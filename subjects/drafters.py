"""Tiny drafters in each subject's own checkpoint format, built from the zoo targets.

- :func:`deepspec_drafter`: a DeepSpec-layout DSpark drafter (``config.json`` +
  ``model.safetensors``, the layout of ``zoo/dspark.py``: DeepSpec
  ``deepspec/modeling/dspark/gemma4``), bigram-seeded so that it accepts, with
  target taps ``(0, 1)``: mlx-dspark 0.20.3 (``target.py`` ``_body_mlxlm``)
  taps layer indices ``i in tapset`` and never matches DeepSpec's ``-1``
  (embedding) tap, so the zoo artifacts with taps ``(-1, 0)`` cannot be fed.
- :func:`module_checkpoint`: any subject drafter class instantiated from a tiny
  config with its own seeded random init and saved with its own parameter
  names (``mlx.utils.tree_flatten``), so the subject's loader reads back
  exactly what its model defines (DFlash/DFly/dspark-mlx formats).

Everything is written under ``<zoo cache>/subjects/`` and rebuilt only when missing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zoo


def subjects_dir() -> Path:
    d = zoo.cache_root() / "subjects"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _done(d: Path) -> bool:
    return (d / ".complete").exists()


def deepspec_drafter(target: str, layer_ids: tuple[int, ...] = (0, 1)) -> Path:
    """A DeepSpec-format DSpark drafter for zoo ``target`` tapping ``layer_ids``."""
    import mlx.core as mx

    from zoo.dspark import bigram_table, deepspec_config, deepspec_weights, recipe

    d = subjects_dir() / f"{target}-deepspec-taps{''.join(map(str, layer_ids))}"
    if _done(d):
        return d
    d.mkdir(parents=True, exist_ok=True)
    try:
        bigrams = recipe(f"{target}-deepspec")["bigrams"]
    except ValueError:
        bigrams = None
    if bigrams is None:  # no pinned artifact for this target: its greedy bigrams, computed
        bigrams = bigram_table(target)
    w = deepspec_weights(target, bigrams, layer_ids)
    mx.save_safetensors(str(d / "model.safetensors"), {k: mx.array(v) for k, v in w.items()},
                        metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(deepspec_config(target, layer_ids), indent=2, sort_keys=True))
    (d / ".complete").write_text("")
    return d


def module_checkpoint(name: str, build: Callable[[], Any], config: dict[str, Any], seed: int = 0) -> Path:
    """Save ``build()``'s parameters (its own seeded random init) with ``config`` as ``config.json``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    d = subjects_dir() / name
    if _done(d):
        return d
    d.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = build()
    params = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(d / "model.safetensors"), params, metadata={"format": "mlx"})
    (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (d / ".complete").write_text("")
    return d
