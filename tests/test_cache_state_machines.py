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

``ExactRotatingMachine`` drives ``RotatingKVCache`` with ``rotating="exact"``
(``engine.rollback.RingRound``) PAST the wrap: windows 1-8 (1-3 often),
``keep`` > 0, verify windows longer than the ring (γ up to 8), target rounds
(one concat call) and drafter rounds (``engine/sources/two_model.py``: a
1- or 2-token feed, then single-token in-place calls that overwrite ring
slots, trimmed by ``max(d - k - 1, 0)``, or — replay mode — restored to the
round's start with ``rollback(0)`` and re-fed, checked before the re-feed). Besides the live state it checks the
future: clones of both caches take the same next single-token and
multi-token updates and must still agree (a wrong ``_idx`` shows there).
With ``keep`` > 0 the plan keeps the guard (a multi-token verify is not plain
decode there, ``engine.rollback.ring_unsupported``); the machine then drives
``RingRound`` itself with the plan's steps, since its restore is exact anyway.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from engine import caches as cache_ops
from engine.audit import clone_caches, compare_caches
from engine.rollback import CacheRollback, RingRound

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


class ExactRotatingMachine(RuleBasedStateMachine):
    """RotatingKVCache under exact ring rollback: speculation never stops at the wrap."""

    @initialize(
        seed=st.integers(0, 2**16),
        size=st.sampled_from([1, 2, 3, 1, 2, 3, 4, 5, 8]),
        keep=st.integers(0, 3),
        n=st.integers(1, 10),
    )
    def prefill(self, seed: int, size: int, keep: int, n: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.size, self.keep = size, min(keep, size - 1)
        self.cache = self.make()
        self.plan = CacheRollback(SimpleNamespace(layers=[object()]), [self.cache], rotating="exact")
        if self.keep:  # the executor keeps the guard (engine.rollback.ring_unsupported) ...
            assert "keep=" in self.plan.ring_fallback[0] and not self.plan.rings
        else:
            assert self.plan.rings and not self.plan.ring_fallback, self.plan.ring_fallback
        self.segments: list[tuple[mx.array, mx.array]] = []
        self.round = 0
        self.last = "prefill"
        k, v = _kv(self.rng, n)
        self.cache.update_and_fetch(k, v)
        self.segments.append((k, v))

    def make(self) -> Any:
        return RotatingKVCache(max_size=self.size, keep=self.keep)

    @rule(d=st.integers(0, 8), data=st.data())
    def verify_round(self, d: int, data: st.DataObject) -> None:
        k, v = _kv(self.rng, d + 1)
        k_accept = data.draw(st.integers(0, d), label="k_accept")
        if not self.keep:
            assert self.plan.ring_guard(d) is None  # exact mode never stops speculating
            with self.plan.round():
                self.cache.update_and_fetch(k, v)
            self.plan.rollback(d, k_accept)
        else:  # ... but RingRound's restore is exact with keep > 0 too: the plan's steps by hand
            ring = RingRound(self.cache)
            ring.begin()
            self.cache.update_and_fetch(k, v)
            ring.end()
            if k_accept == d:
                ring.commit()
            elif self.cache.is_trimmable():
                ring.commit()
                cache_ops.trim([self.cache], d - k_accept, "target")
            else:
                ring.rollback(k_accept + 1)
        self.segments.append((k[:, :, : k_accept + 1], v[:, :, : k_accept + 1]))
        self.round += 1
        self.last = f"round {self.round} (target, window {d + 1}, k_accept {k_accept})"

    @rule(feed=st.integers(1, 2), n=st.integers(1, 6), data=st.data())
    def drafter_round(self, feed: int, n: int, data: st.DataObject) -> None:
        """Two-model drafter: the feed call, then ``n - 1`` single-token draft calls."""
        ring = RingRound(self.cache)
        calls = [_kv(self.rng, feed)] + [_kv(self.rng, 1) for _ in range(n - 1)]
        ring.begin()
        for k, v in calls:
            self.cache.update_and_fetch(k, v)
        ring.end()
        k_accept = data.draw(st.integers(0, n), label="k_accept")
        trim = max(n - k_accept - 1, 0)
        processed = feed + n - 1
        if trim == 0:
            ring.commit()
        elif self.cache.is_trimmable():
            ring.commit()
            cache_ops.trim([self.cache], trim, "drafter")
        else:
            ring.rollback(processed - trim)
        left = processed - trim
        for k, v in calls:
            if left <= 0:
                break
            s = min(left, k.shape[2])
            self.segments.append((k[:, :, :s], v[:, :, :s]))
            left -= s
        self.round += 1
        self.last = f"round {self.round} (drafter, feed {feed}, drafts {n}, k_accept {k_accept})"

    @rule(feed=st.integers(1, 2), n=st.integers(1, 6), data=st.data())
    def drafter_replay_round(self, feed: int, n: int, data: st.DataObject) -> None:
        """A two-model drafter with recurrent layers too (``TwoModelSource._commit_rings``,
        replay mode): a rejecting round restores the ring to the round's start
        (``rollback(0)``: every saved slot written back, nothing re-applied), then the model
        re-feeds the kept inputs. Checked BEFORE the re-feed, which would hide a slot that
        was not written back (the first call writes that very slot again)."""
        calls = [_kv(self.rng, feed)] + [_kv(self.rng, 1) for _ in range(n - 1)]
        k_accept = data.draw(st.integers(0, n), label="k_accept")
        ring = RingRound(self.cache)
        ring.begin()
        for k, v in calls:
            self.cache.update_and_fetch(k, v)
        ring.end()
        self.round += 1
        self.last = f"round {self.round} (drafter replay, feed {feed}, drafts {n}, k_accept {k_accept})"
        if k_accept >= n:  # every processed input kept
            ring.commit()
            self.segments += calls
            return
        ring.rollback(0)
        _assert_same(self.cache, self._fresh(), f"{self._what()}: rollback(0) before the re-feed")
        for k, v in calls[: k_accept + 1]:  # the re-feed: the feed, then the accepted drafts
            self.cache.update_and_fetch(k, v)
            self.segments.append((k, v))

    @rule()
    def plain_step(self) -> None:
        k, v = _kv(self.rng, 1)
        self.cache.update_and_fetch(k, v)
        self.segments.append((k, v))
        self.last = "plain step"

    def _fresh(self) -> Any:
        fresh = self.make()
        for k, v in self.segments:
            fresh.update_and_fetch(k, v)
        return fresh

    def _what(self) -> str:
        return f"RotatingKVCache(max_size={self.size}, keep={self.keep}) after {self.last}"

    @invariant()
    def matches_fresh_cache(self) -> None:
        fresh = self._fresh()
        what = self._what()
        _assert_same(self.cache, fresh, what)
        for n in (1, 3):  # the future: the same next update on both
            a, b = clone_caches([self.cache])[0], clone_caches([fresh])[0]
            k, v = _kv(np.random.default_rng(n), n)
            a.update_and_fetch(k, v)
            b.update_and_fetch(k, v)
            _assert_same(a, b, f"{what}, then a {n}-token update")


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
TestRotatingKVCacheExact = ExactRotatingMachine.TestCase
TestRotatingKVCacheExact.settings = settings(max_examples=80, stateful_step_count=16, deadline=None)
TestArraysCacheSpecRound.settings = settings(max_examples=30, stateful_step_count=12, deadline=None)

# Planted bugs must be found on every run, not by luck: a fixed search (derandomize).
PLANT = settings(max_examples=100, stateful_step_count=10, deadline=None, database=None, derandomize=True)
NO_SHRINK = (Phase.explicit, Phase.generate)  # a planted bug only has to be found


def test_machine_catches_short_trim(short_target_trim: None) -> None:
    with pytest.raises(AssertionError, match="live cache differs"):
        run_state_machine_as_test(KVMachine, settings=settings(PLANT, phases=NO_SHRINK))


def test_machine_catches_forgotten_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    def restore_only(self: Any, r: Any, keep: int) -> None:
        c = r.cache
        c.cache, c.lengths, c.left_padding = list(r.snapshot[0]), r.snapshot[1], r.snapshot[2]

    monkeypatch.setattr(CacheRollback, "_replay", restore_only)
    with pytest.raises(AssertionError, match="live cache differs"):
        run_state_machine_as_test(ArraysMachine, settings=settings(PLANT, phases=NO_SHRINK))


def test_machine_catches_replay_of_one_too_many(monkeypatch: pytest.MonkeyPatch) -> None:
    real = CacheRollback._replay
    monkeypatch.setattr(CacheRollback, "_replay", lambda self, r, keep: real(self, r, keep + 1))
    with pytest.raises(AssertionError, match="live cache differs"):
        run_state_machine_as_test(ArraysMachine, settings=settings(PLANT, phases=NO_SHRINK))


def _one_slot_short(self: RingRound, keep: int) -> None:
    self.saved = self.saved[:-1]  # the newest overwritten slot is not written back
    _REAL_RING_ROLLBACK(self, keep)


def _offset_not_restored(self: RingRound, keep: int) -> None:
    assert self.snapshot is not None
    keys, values, _, idx = self.snapshot
    self.snapshot = (keys, values, int(self.cache.offset), idx)
    _REAL_RING_ROLLBACK(self, keep)


def _reapply_one_short(self: RingRound, keep: int) -> None:
    _REAL_RING_ROLLBACK(self, keep - 1)


def _oldest_slot_short(self: RingRound, keep: int) -> None:
    self.saved = self.saved[1:]  # the first overwritten slot is not written back
    _REAL_RING_ROLLBACK(self, keep)


_REAL_RING_ROLLBACK = RingRound.rollback


@pytest.mark.parametrize(
    "plant",
    [_one_slot_short, _offset_not_restored, _reapply_one_short, _oldest_slot_short],
    ids=["one-slot-short", "offset-not-restored", "reapply-one-short", "oldest-slot-short"],
)
def test_exact_machine_catches_restore_bugs(plant: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # oldest-slot-short: hidden whenever the kept positions are re-applied (the first one writes
    # that slot again); only a round restored to its start (rollback(0)) shows it.
    monkeypatch.setattr(RingRound, "rollback", plant)
    with pytest.raises(AssertionError, match=r"after round \d+ \((target|drafter)"):
        run_state_machine_as_test(ExactRotatingMachine, settings=settings(PLANT, report_multiple_bugs=False, phases=NO_SHRINK))


# Quantized KV (mlx-lm 0.32.2 QuantizedKVCache, KVCache.to_quantized via engine.caches.quantize_kv).
QDIM, QGROUP = 32, 32  # mx.quantize groups along the head dim: it must divide it


def _qkv(rng: np.random.Generator, n: int) -> tuple[mx.array, mx.array]:
    k = rng.standard_normal((1, HEADS, n, QDIM)).astype(np.float32)
    v = rng.standard_normal((1, HEADS, n, QDIM)).astype(np.float32)
    return mx.array(k), mx.array(v)


class QuantizedMachine(RuleBasedStateMachine):
    """A KVCache that converts to QuantizedKVCache mid-request (``quantize_kv`` on the committed
    offset, as the executor does), then keeps taking verify windows trimmed by ``d - k``."""

    @initialize(seed=st.integers(0, 2**16), n=st.integers(1, 6), bits=st.sampled_from(cache_ops.KV_BITS),
                start_quantized=st.booleans())
    def prefill(self, seed: int, n: int, bits: int, start_quantized: bool) -> None:
        self.rng = np.random.default_rng(seed)
        self.q = cache_ops.KVQuantization(bits, QGROUP, 0)
        self.caches: list[Any] = [KVCache()]
        self.events: list[Any] = []  # accepted (k, v) calls and "convert" markers, in order
        k, v = _qkv(self.rng, n)
        self.caches[0].update_and_fetch(k, v)
        self.events.append((k, v))
        if start_quantized:
            self.convert()
        self.plan = CacheRollback(SimpleNamespace(layers=[object()]), self.caches)

    @rule()
    def convert(self) -> None:
        if cache_ops.quantize_kv(self.caches, self.q):
            self.events.append("convert")
            self.plan = CacheRollback(SimpleNamespace(layers=[object()]), self.caches)

    @rule(d=st.integers(0, 4), data=st.data())
    def verify_round(self, d: int, data: st.DataObject) -> None:
        k, v = _qkv(self.rng, d + 1)
        with self.plan.round():
            self.caches[0].update_and_fetch(k, v)
        k_accept = data.draw(st.integers(0, d), label="k_accept")
        self.plan.rollback(d, k_accept)
        self.events.append((k[:, :, : k_accept + 1], v[:, :, : k_accept + 1]))

    @rule()
    def plain_step(self) -> None:
        k, v = _qkv(self.rng, 1)
        self.caches[0].update_and_fetch(k, v)
        self.events.append((k, v))

    @invariant()
    def matches_fresh_cache(self) -> None:
        fresh: list[Any] = [KVCache()]
        for ev in self.events:
            if ev == "convert":
                cache_ops.quantize_kv(fresh, self.q)
            else:
                fresh[0].update_and_fetch(*ev)
        assert type(fresh[0]) is type(self.caches[0])
        _assert_same(self.caches[0], fresh[0], type(self.caches[0]).__name__)


TestQuantizedKVCache = QuantizedMachine.TestCase
TestQuantizedKVCache.settings = settings(max_examples=40, stateful_step_count=12, deadline=None)


def test_quantized_machine_catches_short_trim(short_target_trim: None) -> None:
    """A quantized cache rolled back one position short is caught."""
    with pytest.raises(AssertionError, match="QuantizedKVCache: live cache differs"):
        run_state_machine_as_test(QuantizedMachine, settings=settings(PLANT, phases=NO_SHRINK))


def test_quantized_machine_catches_untrimmed_quantized_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: the rollback leaves a quantized cache untrimmed (the rejected tail stays)."""
    real = CacheRollback.rollback

    def keep_tail(self: CacheRollback, d: int, k: int) -> None:
        if any(type(c).__name__ == "QuantizedKVCache" for c in self.caches):
            return
        real(self, d, k)

    monkeypatch.setattr(CacheRollback, "rollback", keep_tail)
    with pytest.raises(AssertionError, match="QuantizedKVCache: live cache differs"):
        run_state_machine_as_test(QuantizedMachine, settings=settings(PLANT, phases=NO_SHRINK))
