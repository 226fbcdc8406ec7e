"""Hidden taps on mlx-lm targets are parity-safe (§4.1 "parity-safe hiddenTap").

``engine.taps.capture_layers`` records decoder-layer outputs from outside the
model code (mlx-lm 0.32.2 ``models/gemma4_text.py``, ``models/qwen3.py``). On
the zoo ``gemma4`` (gemma4_text, sliding window 32) and ``qwen3`` targets,
tapping must not change one output byte: prefill logits, every verify-window
forward's logits and the live cache bytes after each forward are identical with
and without the taps (across the sliding window's wrap too), and a tapped spec
run with the DSpark drafter emits exactly the untapped plain decode.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import zoo
from engine.caches import cache_digest
from engine.taps import capture_layers
from specparity.runners import load_model

TARGETS = ("gemma4", "qwen3")


def _run(model, tokens: list[int], windows: list[list[int]], taps: tuple[int, ...] | None,  # noqa: ANN001
         capture=capture_layers):  # noqa: ANN001
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    out = []
    for chunk in [tokens, *windows]:
        x = mx.array(chunk, mx.uint32)[None]
        if taps is None:
            logits = model(x, cache=caches)
            mx.eval(logits)
        else:
            with capture(model, taps) as cap:
                logits = model(x, cache=caches)
                mx.eval(logits, *cap.values())
            assert set(cap) == {t % len(model.layers) for t in taps}
            assert all(cap[t].shape[1] == len(chunk) for t in cap)
        out.append((np.array(logits).tobytes(), cache_digest(caches)["combined"]))
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_taps_change_no_output_byte(target: str) -> None:
    model = load_model(str(zoo.model_dir(target))).model
    prompt = list(zoo.prompt("nat-00").token_ids)  # 28 tokens: windows cross the gemma4 ring
    windows = [[5, 17, 99, 200], [3], [44, 301, 12], [9, 77, 120, 400, 33]]
    plain = _run(model, prompt, windows, None)
    n = len(model.layers)
    for taps in [(0,), tuple(range(n)), (-1,)]:
        tapped = _run(model, prompt, windows, taps)
        for i, (a, b) in enumerate(zip(plain, tapped, strict=True)):
            assert a[0] == b[0], f"{target} taps {taps}: logits of forward {i} differ"
            assert a[1] == b[1], f"{target} taps {taps}: cache digest after forward {i} differs"


@pytest.mark.parametrize("target", TARGETS)
def test_tapped_dspark_run_equals_plain_decode(target: str) -> None:
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.sources.dspark import DSparkProvider
    from zoo.dspark import artifact_dir

    model = load_model(str(zoo.model_dir(target))).model
    provider = DSparkProvider(artifact_dir(f"{target}-dspark"), confidence_threshold=0.5)
    for pid in ("nat-03", "rnd-14"):
        ids = list(zoo.prompt(pid).token_ids)
        params = GenerationParams(max_tokens=20, gamma=provider.gamma, prefill="full", eos_ids=(zoo.eos_id(),))
        spec = spec_generate(model, provider, ids, params)
        plain = plain_generate(model, ids, params)
        assert spec.output_ids == plain.output_ids, (target, pid)
        assert spec.speculation is not None and spec.speculation.accepted > 0, (target, pid)



def test_a_tap_that_touches_the_output_is_caught() -> None:
    """Negative control: a tap that re-materialises the layer output through
    arithmetic (``(h + 1) - 1``) changes logits bytes, and the comparison sees it."""
    from contextlib import contextmanager

    @contextmanager
    def lossy(m, indices):  # noqa: ANN001
        layer = m.layers[0]
        original = type(layer)
        captured: dict[int, mx.array] = {}

        def call(self, *a, **k):  # noqa: ANN001
            out = (original.__call__(self, *a, **k) + 1.0) - 1.0
            captured[0] = out
            return out

        layer.__class__ = type("Lossy", (original,), {"__call__": call})
        try:
            yield captured
        finally:
            layer.__class__ = original

    model = load_model(str(zoo.model_dir("qwen3"))).model
    prompt = list(zoo.prompt("nat-00").token_ids)
    plain = _run(model, prompt, [[5, 17]], None)
    bad = _run(model, prompt, [[5, 17]], (0,), capture=lossy)
    assert any(a[0] != b[0] for a, b in zip(plain, bad, strict=True)), "a lossy tap went unnoticed"
