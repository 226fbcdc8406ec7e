"""``engine.batched._roll_rows``: every row rolled exactly as mlx-lm 0.32.2's ``dynamic_roll``
(``mlx_lm/models/cache.py``) rolls it, the offsets and left padding moved by the same amounts."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import dynamic_roll

from engine import batched as eb


def _cache(b: int) -> SimpleNamespace:
    rng = np.random.default_rng(b)
    k = mx.array(rng.normal(size=(b, 2, 9, 4)).astype(np.float32))
    v = mx.array(rng.normal(size=(b, 2, 9, 4)).astype(np.float32))
    return SimpleNamespace(keys=k, values=v, offset=mx.array([9] * b), left_padding=mx.array([0] * b))


def _first_differing_row(a: mx.array, b: mx.array) -> int | None:
    na, nb = np.array(a), np.array(b)
    return next((i for i in range(na.shape[0]) if na[i].tobytes() != nb[i].tobytes()), None)


@pytest.mark.parametrize("extra", [[0, 2, 0, 0], [1, 0, 0, 3], [0, 0, 0, 1], [2, 1, 3, 0], [1, 1, 1, 1], [0, 5]])
def test_roll_rows_is_mlx_lms_roll(extra: list[int]) -> None:
    c = _cache(len(extra))
    want_k = dynamic_roll(c.keys, mx.array(extra)[:, None], axis=2)
    want_v = dynamic_roll(c.values, mx.array(extra)[:, None], axis=2)
    eb._roll_rows(c, extra)
    assert _first_differing_row(c.keys, want_k) is None
    assert _first_differing_row(c.values, want_v) is None
    assert c.offset.tolist() == [9 - x for x in extra] and c.left_padding.tolist() == extra


def test_a_wrong_shift_is_caught() -> None:
    """Not vacuous: a row rolled by one position too many differs at that row."""
    c = _cache(4)
    want = dynamic_roll(c.keys, mx.array([0, 2, 0, 0])[:, None], axis=2)
    eb._roll_rows(c, [0, 3, 0, 0])
    assert _first_differing_row(c.keys, want) == 1
