"""Tests for traces.records (header / counters builders) and traces.digest."""

from __future__ import annotations

import numpy as np
import pytest

from traces.digest import cache_digest, layer_digest
from traces.io import Trace
from traces.records import counters_from_rounds, make_header
from traces.testing import make_spec_trace
from traces.validate import validate_trace


def test_make_header_is_valid_and_fills_defaults() -> None:
    base = make_spec_trace([(None, [], [5], 0, [5], "budget")])
    header = make_header(
        runner={"name": "engine", "package": "specparity", "version": "0.1.0"},
        mode="spec",
        source="two-model",
        case_id="c",
        target={"path": "t", "weights_sha256": None, "config_sha256": None},
        drafter={"path": "d", "weights_sha256": None, "config_sha256": None},
        tokenizer_sha256=None,
        params=base.header["params"],
        prompt_id="p",
        prompt_ids=base.header["prompt"]["token_ids"],
        eos_ids=[np.int64(2)],  # type: ignore[list-item]
    )
    assert header["runner"]["commit"] is None
    assert set(header["platform"]) >= {"mlx", "device", "python"}
    assert header["eos_ids"] == [2] and type(header["eos_ids"][0]) is int
    trace = Trace.from_records([header, *base.records()[1:]])
    assert validate_trace(trace) == []


def test_counters_from_rounds_matches_engine_definition() -> None:
    rounds = [
        {"drafts": [1, 2, 3], "k_accept": 1},
        {"drafts": [1], "k_accept": 1},
        {"drafts": [], "k_accept": 0},
    ]
    c = counters_from_rounds(rounds, n_plain=2)
    assert c == {
        "drafted": 4,
        "accepted": 2,
        "rejected": 2,
        "target_calls": 5,
        "rounds": 3,
        "acceptance_lengths": [1, 1, 0],
        "drafted_by_pos": [2, 1, 1],
        "accepted_by_pos": [2],
    }
    assert counters_from_rounds([])["drafted_by_pos"] == []


mx = pytest.importorskip("mlx.core")
cache_mod = pytest.importorskip("mlx_lm.models.cache")


def _kv(n: int, seed: int = 0) -> object:
    c = cache_mod.KVCache()
    mx.random.seed(seed)
    k = mx.random.normal((1, 2, n, 4)).astype(mx.bfloat16)
    c.update_and_fetch(k, k * 2)
    return c


def test_digest_live_region_only() -> None:
    a, b = _kv(5), _kv(5)
    assert cache_digest([a]) == cache_digest([b])
    b.update_and_fetch(*(mx.ones((1, 2, 2, 4), mx.bfloat16),) * 2)  # type: ignore[attr-defined]
    assert cache_digest([a]) != cache_digest([b])
    b.trim(2)  # type: ignore[attr-defined]
    assert cache_digest([a]) == cache_digest([b])  # garbage past offset is ignored
    b.trim(1)  # type: ignore[attr-defined]
    assert cache_digest([a]) != cache_digest([b])


def test_digest_shape() -> None:
    d = cache_digest([_kv(3), _kv(3, seed=1)])
    assert len(d["layers"]) == 2 and d["layers"][0] != d["layers"][1]
    assert all(len(h) == 64 for h in [d["combined"], *d["layers"]])
    assert cache_digest([_kv(3)])["layers"][0] == d["layers"][0]


def test_digest_other_cache_kinds() -> None:
    r = cache_mod.RotatingKVCache(max_size=4)
    for i in range(6):
        r.update_and_fetch(*(mx.full((1, 1, 1, 2), float(i)),) * 2)
    r2 = cache_mod.RotatingKVCache(max_size=4)
    for i in range(6):
        r2.update_and_fetch(*(mx.full((1, 1, 1, 2), float(i)),) * 2)
    assert layer_digest(r) == layer_digest(r2)
    ac = cache_mod.ArraysCache(2)
    ac[0] = mx.ones((1, 3))
    ac2 = cache_mod.ArraysCache(2)
    ac2[0] = mx.zeros((1, 3))
    assert layer_digest(ac) != layer_digest(ac2)
    assert layer_digest(cache_mod.KVCache()) == layer_digest(cache_mod.KVCache())
