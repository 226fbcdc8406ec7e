"""The serial-replay audit and the rollback contract can fail (issue: cache-state byte equality).

Planted bugs, each caught with the first bad round and layer named:
a recurrent rollback that forgets to replay, a trim by one too few, a ring
guard that never trips (gemma windows wrap and the trim silently fails), and
batched arithmetic that differs from serial by an ulp (reported as
arithmetic, with its ulp count, not as a rollback bug).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import zoo
from engine.audit import SerialReplayAudit, clone_caches, compare_arrays
from engine.executor import GenerationParams, plain_generate, spec_generate
from engine.sources.two_model import TwoModelProvider
from specparity.runners import load_model


def _pair(target: str, drafter: str = "twin") -> tuple[Any, Any]:
    t, d = zoo.pair(target, drafter)
    return load_model(str(t)), load_model(str(d))


def _audit(target: str, prompt: str = "nat-00", max_tokens: int = 24) -> tuple[SerialReplayAudit, Any]:
    t, d = _pair(target)
    audit = SerialReplayAudit(t.model)
    ids = list(zoo.prompt(prompt).token_ids)
    params = GenerationParams(max_tokens=max_tokens, gamma=3, eos_ids=t.eos_ids)
    result = spec_generate(t.model, TwoModelProvider(d.model), ids, params, observer=audit)
    return audit, result


def test_compare_arrays_counts_ulps() -> None:
    a = mx.array(np.array([1.0, 2.0, -3.0], np.float32))
    b_np = np.array([1.0, 2.0, -3.0], np.float32)
    b_np[1] = np.nextafter(np.float32(2.0), np.float32(3.0))
    b_np[2] = np.nextafter(np.nextafter(np.float32(-3.0), np.float32(0)), np.float32(0))
    d = compare_arrays(a, mx.array(b_np))
    assert not d.equal and d.max_ulp == 2 and d.where == (2,)
    assert compare_arrays(a, a).equal
    assert "shape" in compare_arrays(a, a[:2]).describe()
    # across zero: -0.0 and +0.0 are 0 ulp apart in value order but differ in bytes
    z = compare_arrays(mx.array(np.array([0.0], np.float32)), mx.array(np.array([-0.0], np.float32)))
    assert not z.equal and z.max_ulp == 0


def test_clone_is_independent() -> None:
    t, _ = _pair("gemma3")
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(t.model)
    t.model(mx.array([[5, 6, 7]], mx.uint32), cache=caches)
    clone = clone_caches(caches)
    before = [np.array(c.keys) for c in clone]
    t.model(mx.array([[8]], mx.uint32), cache=caches)  # in-place update of the originals
    assert all(np.array_equal(b, np.array(c.keys)) for b, c in zip(before, clone, strict=True))
    assert [c.offset for c in clone] == [3, 3] and [c.offset for c in caches] == [4, 4]


@pytest.mark.parametrize("target", zoo.TARGETS)
def test_audit_runs_and_rollback_is_exact(target: str) -> None:
    shortest = min(zoo.prompts(), key=lambda p: len(p.token_ids)).id  # rounds before the ring wraps
    audit, result = _audit(target, shortest)
    assert audit.windows, f"{target}: no verify window audited"
    assert any(w.k_accept is not None and w.k_accept < len(w.window) - 1 for w in audit.windows), \
        f"{target}: no rejecting round, the rollback was not exercised"
    assert audit.first_bad_rollback() is None, audit.first_bad_rollback()


def test_forgotten_recurrent_replay_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.rollback import CacheRollback

    def restore_only(self: Any, r: Any, keep: int) -> None:
        c = r.cache
        c.cache, c.lengths, c.left_padding = list(r.snapshot[0]), r.snapshot[1], r.snapshot[2]

    monkeypatch.setattr(CacheRollback, "_replay", restore_only)
    audit, _ = _audit("qwen35")
    first = next(w for w in audit.windows if w.k_accept is not None and w.k_accept < len(w.window) - 1)
    msg = audit.first_bad_rollback()
    assert msg is not None and msg.startswith(f"round {first.round} "), msg
    assert "layer 0 cache" in msg, msg  # the gated-DeltaNet layer (ArraysCache)


def test_short_trim_is_caught(short_target_trim: None) -> None:
    audit, _ = _audit("llama")
    first = next(w for w in audit.windows if w.k_accept is not None and w.k_accept < len(w.window) - 1)
    msg = audit.first_bad_rollback()
    assert msg is not None and msg.startswith(f"round {first.round} "), msg
    assert "layer 0 meta" in msg and "offset" in msg, msg


def test_batched_arithmetic_difference_is_reported_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-token forward that is 1 ulp off is reported with its ulp count."""
    t, d = _pair("llama")
    real_call = type(t.model).__call__

    def nudged(self: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
        out = real_call(self, inputs, *a, **kw)
        if inputs.shape[1] > 1:
            bits = out.view(mx.int32) + 1
            out = bits.view(mx.float32)
        return out

    monkeypatch.setattr(type(t.model), "__call__", nudged)
    audit = SerialReplayAudit(t.model)
    params = GenerationParams(max_tokens=12, gamma=3, eos_ids=t.eos_ids)
    spec_generate(t.model, TwoModelProvider(d.model), list(zoo.prompt("nat-01").token_ids), params, observer=audit)
    w = audit.windows[0]
    assert not w.logits_equal and "(1 ulp)" in w.worst_logits(), w.worst_logits()
    assert w.caches_equal and audit.first_bad_rollback() is None


@pytest.mark.parametrize("target", ["gemma3", "gemma4"])
def test_ring_guard_keeps_windowed_targets_lossless(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The §2 guard stops speculation before a wrap; without it the rollback cannot be exact."""
    t, d = _pair(target)
    ids = list(zoo.prompt("rnd-00").token_ids)
    params = GenerationParams(max_tokens=64, gamma=3, eos_ids=t.eos_ids)
    good = spec_generate(t.model, TwoModelProvider(d.model), ids, params)
    plains = [r for r in good.records if r["type"] == "plain"]
    assert plains and plains[0]["reason"] == "ring-wrap" and "RotatingKVCache" in plains[0]["detail"]
    assert good.output_ids == plain_generate(t.model, ids, params).output_ids

    from engine.rollback import CacheRollback
    from engine.sources.two_model import TwoModelSource

    monkeypatch.setattr(CacheRollback, "ring_guard", lambda self, n: None)
    monkeypatch.setattr(TwoModelSource, "rollback_guard", lambda self, feed, n: None)
    from engine.caches import CacheRollbackError

    with pytest.raises(CacheRollbackError, match="RotatingKVCache"):
        spec_generate(t.model, TwoModelProvider(d.model), ids, params)
