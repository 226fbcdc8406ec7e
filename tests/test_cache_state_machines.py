"""Hypothesis state machines for the cache rollback contract (§2).

One ``RuleBasedStateMachine`` per cache class — ``KVCache``,
``RotatingKVCache`` (before and after the ring wraps) and ``ArraysCache``
under the spec-round trio — driven through ``engine.rollback.CacheRollback``
exactly as the executor drives it: prefill, verify-window append, accept k
(rollback), plain single-token steps. The invariant compares the live state
(``traces.digest.live_state``: offset and live bytes) with a FRESH cache fed
only the accepted positions, in the same call structure (prefill, then each
round's kept segment as one call) — what the cache would hold had the
rejected tokens never been seen.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from engine.audit import compare_caches
from engine.rollback import CacheRollback

HEADS, DIM = 2, 4


def _kv(rng: np.random.Generator, n: int) -> tuple[mx.array, mx.array]:
    k = rng.standard_normal((1, HEADS, n, DIM)).astype(np.float32)
    v = rng.standard_normal((1, HEADS, n, DIM)).astype(np.float32)
    return mx.array(k), mx.array(v)


def _assert_same(live: Any, fresh: Any, what: str) -> None:
    bad = [(layer, name, d.describe()) for layer, name, d in compare_caches([live], [fresh]) if not d.equal]
    assert not bad, f"{what}: live cache differs from a fresh cache fed only accepted positions: {bad}"


class KVMachine(RuleBasedStateMachine):
    """KVCache / RotatingKVCache: append windows, trim rejected tails, plain steps."""

    def make(self) -> Any:
        return KVCache()

    @initialize(seed=st.integers(0, 2**16), n=st.integers(1, 6))
    def prefill(self, seed: int, n: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.cache = self.make()
        self.plan = CacheRollback(SimpleNamespace(layers=[object()]), [self.cache])
        self.segments: list[tuple[mx.array, mx.array]] = []  # accepted calls, in order
        k, v = _kv(self.rng, n)
        self.cache.update_and_fetch(k, v)
        self.segments.append((k, v))

    @rule(d=st.integers(0, 4), data=st.data())
    def verify_round(self, d: int, data: st.DataObject) -> None:
        if self.plan.ring_guard(d) is not None:
            return  # the executor stops speculating here (checked in ring_guard_rule)
        k, v = _kv(self.rng, d + 1)
        with self.plan.round():
            self.cache.update_and_fetch(k, v)
        k_accept = data.draw(st.integers(0, d), label="k_accept")
        self.plan.rollback(d, k_accept)
        self.segments.append((k[:, :, : k_accept + 1], v[:, :, : k_accept + 1]))

    @rule()
    def plain_step(self) -> None:
        k, v = _kv(self.rng, 1)
        self.cache.update_and_fetch(k, v)
        self.segments.append((k, v))

    @invariant()
    def matches_fresh_cache(self) -> None:
        fresh = self.make()
        for k, v in self.segments:
            fresh.update_and_fetch(k, v)
        _assert_same(self.cache, fresh, type(self.cache).__name__)


class RotatingMachine(KVMachine):
    """RotatingKVCache: speculation only while the §2 guard allows; plain steps wrap the ring."""

    def make(self) -> Any:
        return RotatingKVCache(max_size=8)

    @rule(d=st.integers(0, 4))
    def ring_guard_rule(self, d: int) -> None:
        guard = self.plan.ring_guard(d)
        wraps = self.cache.offset + d + 1 >= self.cache.max_size
        assert (guard is not None) == wraps, (self.cache.offset, d, guard)
        if self.cache.offset >= self.cache.max_size:
            assert not self.cache.is_trimmable()  # why the guard exists


class ArraysMachine(RuleBasedStateMachine):
    """ArraysCache of a gated-DeltaNet layer under the spec-round trio (begin/commit/rollback)."""

    mixer: Any = None

    @classmethod
    def _mixer(cls) -> Any:
        if cls.mixer is None:
            import zoo
            from specparity.runners import load_model

            model = load_model(str(zoo.model_dir("qwen35"))).model
            cls.mixer = model.layers[0].linear_attn
        return cls.mixer

    def _feed(self, cache: Any, x: mx.array) -> None:
        self.layer.linear_attn(x, None, cache)
        mx.eval([a for a in cache.cache if a is not None])

    @initialize(seed=st.integers(0, 2**16), n=st.integers(1, 6))
    def prefill(self, seed: int, n: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.layer = SimpleNamespace(linear_attn=self._mixer())
        self.cache = ArraysCache(size=2)
        self.plan = CacheRollback(SimpleNamespace(layers=[self.layer]), [self.cache])
        assert self.plan.capable and self.plan.recurrent, self.plan.reason
        self.segments: list[mx.array] = []
        x = self._x(n)
        self._feed(self.cache, x)
        self.segments.append(x)

    def _x(self, n: int) -> mx.array:
        return mx.array(self.rng.standard_normal((1, n, 64)).astype(np.float32))

    @rule(d=st.integers(0, 4), data=st.data())
    def verify_round(self, d: int, data: st.DataObject) -> None:
        x = self._x(d + 1)
        with self.plan.round():
            self._feed(self.cache, x)
        k_accept = data.draw(st.integers(0, d), label="k_accept")
        self.plan.rollback(d, k_accept)
        self.segments.append(x[:, : k_accept + 1])

    @rule()
    def plain_step(self) -> None:
        x = self._x(1)
        self._feed(self.cache, x)
        self.segments.append(x)

    @invariant()
    def matches_fresh_cache(self) -> None:
        fresh = ArraysCache(size=2)
        for x in self.segments:
            self._feed(fresh, x)
        _assert_same(self.cache, fresh, "ArraysCache")


TestKVCache = KVMachine.TestCase
TestRotatingKVCache = RotatingMachine.TestCase
TestArraysCacheSpecRound = ArraysMachine.TestCase
TestArraysCacheSpecRound.settings = settings(max_examples=30, stateful_step_count=12, deadline=None)

PLANT = settings(max_examples=50, stateful_step_count=10, deadline=None, database=None)


def test_machine_catches_short_trim(short_target_trim: None) -> None:
    with pytest.raises(AssertionError, match="live cache differs"):
        run_state_machine_as_test(KVMachine, settings=PLANT)


def test_machine_catches_forgotten_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    def restore_only(self: Any, r: Any, keep: int) -> None:
        c = r.cache
        c.cache, c.lengths, c.left_padding = list(r.snapshot[0]), r.snapshot[1], r.snapshot[2]

    monkeypatch.setattr(CacheRollback, "_replay", restore_only)
    with pytest.raises(AssertionError, match="live cache differs"):
        run_state_machine_as_test(ArraysMachine, settings=PLANT)


def test_machine_catches_replay_of_one_too_many(monkeypatch: pytest.MonkeyPatch) -> None:
    real = CacheRollback._replay
    monkeypatch.setattr(CacheRollback, "_replay", lambda self, r, keep: real(self, r, keep + 1))
    with pytest.raises(AssertionError, match="live cache differs"):
        run_state_machine_as_test(ArraysMachine, settings=PLANT)
