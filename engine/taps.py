"""Hidden-state taps on mlx-lm models, captured from outside the model code.

§1 ``tapLayers`` / §4.1 "parity-safe ``model.hiddenTap``": the executor captures
the output of selected decoder layers on prefill and on every verify forward.
The tap swaps the layer object's class for a subclass whose ``__call__`` calls
the original and records its output, so the computation is the same graph,
op for op (tests assert the logits are byte-identical with and without taps).
Works on any mlx-lm model exposing ``model.layers`` (mlx-lm 0.32.2
``models/llama.py`` ``Model.layers``, ``models/qwen3.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx


@contextmanager
def capture_layers(model: Any, indices: Sequence[int]) -> Iterator[dict[int, mx.array]]:
    """Record the output of ``model.layers[i]`` for each ``i`` while active.

    Yields a dict that maps each tapped index to its latest output (``[B, T, H]``).
    Negative indices count from the end.
    """
    layers = model.layers
    captured: dict[int, mx.array] = {}
    swapped: list[tuple[Any, type]] = []
    n = len(layers)
    try:
        for raw in dict.fromkeys(indices):
            i = raw if raw >= 0 else n + raw
            if not 0 <= i < n:
                raise IndexError(f"tap layer {raw} out of range for a {n}-layer model")
            layer = layers[i]
            original = type(layer)

            def tapped_call(self: Any, *args: Any, _i: int = i, _cls: type = original, **kw: Any) -> Any:
                out = _cls.__call__(self, *args, **kw)
                captured[_i] = out[0] if isinstance(out, tuple) else out
                return out

            layer.__class__ = type(f"Tapped{original.__name__}", (original,), {"__call__": tapped_call})
            swapped.append((layer, original))
        yield captured
    finally:
        for layer, original in swapped:
            layer.__class__ = original
