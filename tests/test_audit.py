"""The serial-replay audit and the rollback contract can fail (issue: cache-state byte equality;
issue 13: the audit on non-bit-exact backends).

Two backends: this CPU (bit-exact: batched verify equals serial decode byte for
byte) and an emulated non-bit-exact one (``nonexact``: every multi-token
forward's cache writes and logits are perturbed by ~1e-3 relative, the size
measured on MLX's CUDA backend). On both, the correct engine's rollback passes
(``exact`` on the CPU, ``arithmetic`` on the emulation) and every planted
rollback bug is an ``error`` with the first bad round and layer named:
a recurrent rollback that forgets to replay, a trim by one too few, an offset
wrong on one layer, a wrong value at a kept position, a ring guard that never
trips (gemma windows wrap and the trim silently fails).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import zoo
from engine.audit import DeltaStats, SerialReplayAudit, check_rollback, clone_caches, compare_arrays
from engine.executor import GenerationParams, plain_generate, spec_generate
from engine.sources.two_model import TwoModelProvider
from tests.helpers import load_zoo_pair

PERTURB = 1e-3  # relative, per element, of every batched (multi-token) forward


def _audit(target: str, prompt: str = "nat-00", max_tokens: int = 24) -> tuple[SerialReplayAudit, Any]:
    t, d = load_zoo_pair(target)
    audit = SerialReplayAudit(t.model)
    ids = list(zoo.prompt(prompt).token_ids)
    params = GenerationParams(max_tokens=max_tokens, gamma=3, eos_ids=t.eos_ids)
    result = spec_generate(t.model, TwoModelProvider(d.model), ids, params, observer=audit)
    return audit, result


def _noise(shape: tuple[int, ...], salt: int) -> mx.array:
    return mx.random.uniform(-1.0, 1.0, shape, key=mx.random.key(salt))


@pytest.fixture
def nonexact(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Emulate a backend whose batched forward is not bit-exact to serial decode.

    Multi-token cache writes (``KVCache`` / ``RotatingKVCache.update_and_fetch``)
    and multi-token logits get a deterministic relative perturbation of ``PERTURB``;
    single-token (serial) forwards are untouched.
    """
    from mlx_lm.models import cache as cache_mod

    for cls in (cache_mod.KVCache, cache_mod.RotatingKVCache):
        real = cls.update_and_fetch

        def update(self: Any, keys: mx.array, values: mx.array, _real: Any = real) -> Any:
            if keys.shape[2] > 1:
                keys = keys * (1 + PERTURB * _noise(keys.shape, 1)).astype(keys.dtype)
                values = values * (1 + PERTURB * _noise(values.shape, 2)).astype(values.dtype)
            return _real(self, keys, values)

        monkeypatch.setattr(cls, "update_and_fetch", update)
    yield


def _perturb_logits(monkeypatch: pytest.MonkeyPatch, model: Any) -> None:
    real_call = type(model).__call__

    def call(self: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
        out = real_call(self, inputs, *a, **kw)
        if inputs.shape[1] > 1:
            out = out + PERTURB * mx.abs(out).max() * _noise(out.shape, 3).astype(out.dtype)
        return out

    monkeypatch.setattr(type(model), "__call__", call)


BACKENDS = ["cpu-exact", "nonexact"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "nonexact":
        request.getfixturevalue("nonexact")
    return str(request.param)


def _first_rejecting(audit: SerialReplayAudit) -> Any:
    return next(w for w in audit.windows if w.k_accept is not None and w.k_accept < len(w.window) - 1)


# --- units -------------------------------------------------------------------------------


def test_compare_arrays_reports_abs_and_rel_without_ulps() -> None:
    a = mx.array(np.array([1.0, 2.0, -3.0, 100.0], np.float32))
    b = mx.array(np.array([1.0, 2.5, -3.0, 100.0], np.float32))
    d = compare_arrays(a, b)
    assert not d.equal and d.where == (1,) and d.max_abs == pytest.approx(0.5)
    assert d.max_rel == pytest.approx(0.5 / 100.0)
    assert compare_arrays(a, a).equal
    assert "shape" in compare_arrays(a, a[:2]).describe()
    # across zero: -0.0 and +0.0 differ in bytes, not in value
    z = compare_arrays(mx.array(np.array([0.0], np.float32)), mx.array(np.array([-0.0], np.float32)))
    assert not z.equal and z.max_abs == 0.0
    # across a sign change the size is the value difference, not billions of ulps
    s = compare_arrays(mx.array(np.array([1e-8], np.float32)), mx.array(np.array([-1e-8], np.float32)))
    assert s.max_abs == pytest.approx(2e-8)
    bf = compare_arrays(mx.array([1.0, 2.0], mx.bfloat16), mx.array([1.0, 2.015625], mx.bfloat16))
    assert bf.dtype == "bfloat16" and bf.max_abs == pytest.approx(0.015625)


def test_delta_stats_max_and_p99() -> None:
    st = DeltaStats()
    x = np.zeros(1000)
    x[-5:] = 1e-2  # 0.5 % of the elements: p99 is 0
    st.add(x, 2.0)
    assert st.max_abs == pytest.approx(1e-2) and st.max_rel == pytest.approx(5e-3)
    assert st.p99_abs() == 0.0
    y = np.full(1000, 1e-3)
    y[:5] = 1.0
    st2 = DeltaStats()
    st2.add(y, 1.0)
    assert st2.max_abs == 1.0 and 1e-3 <= st2.p99_abs() <= 1e-3 * 1.08
    assert st2.to_dict()["byte_equal_arrays"] == 0
    st3 = DeltaStats()
    st3.add(np.zeros(4), 1.0)
    assert st3.to_dict() == {"arrays": 1, "byte_equal_arrays": 1, "elements": 4, "max_abs": 0.0,
                             "p99_abs": 0.0, "max_rel": 0.0, "p99_rel": 0.0}


def test_check_rollback_separates_arithmetic_from_structure() -> None:
    from mlx_lm.models.cache import KVCache

    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((1, 2, 6, 4)).astype(np.float32))

    def cache(keys: mx.array) -> Any:
        c = KVCache()
        c.update_and_fetch(keys, keys)
        return c

    ref = cache(k)
    near = cache(k + mx.array(np.r_[np.zeros(4), [1e-4, -1e-4]].astype(np.float32))[None, None, :, None])
    rc, _ = check_rollback([near], [ref], [4], scale=1e-4)
    assert rc.verdict == "arithmetic" and not rc.errors, rc
    rc, _ = check_rollback([near], [ref], [4], scale=0.0)  # bit-exact backend: any Δ is an error
    assert rc.verdict == "error" and "kept position 4" in rc.errors[0], rc.errors
    touched = cache(k + mx.array(np.r_[[1e-6], np.zeros(5)].astype(np.float32))[None, None, :, None])
    rc, _ = check_rollback([touched], [ref], [4], scale=1.0)
    assert rc.verdict == "error" and "position 0 (written before this round" in rc.errors[0], rc.errors
    short = cache(k[:, :, :5])
    rc, _ = check_rollback([short], [ref], [4], scale=1.0)
    assert rc.verdict == "error" and "layer 0 meta" in rc.errors[0] and "offset" in rc.errors[0], rc.errors
    rc, _ = check_rollback([cache(k)], [ref], [4], scale=0.0)
    assert rc.verdict == "exact"


def test_clone_is_independent() -> None:
    t, _ = load_zoo_pair("gemma3")
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(t.model)
    t.model(mx.array([[5, 6, 7]], mx.uint32), cache=caches)
    clone = clone_caches(caches)
    before = [np.array(c.keys) for c in clone]
    t.model(mx.array([[8]], mx.uint32), cache=caches)  # in-place update of the originals
    assert all(np.array_equal(b, np.array(c.keys)) for b, c in zip(before, clone, strict=True))
    assert [c.offset for c in clone] == [3, 3] and [c.offset for c in caches] == [4, 4]


# --- the correct engine ----------------------------------------------------------------------


@pytest.mark.parametrize("target", zoo.TARGETS)
def test_audit_runs_and_rollback_is_exact(target: str) -> None:
    shortest = min(zoo.prompts(), key=lambda p: len(p.token_ids)).id  # rounds before the ring wraps
    audit, result = _audit(target, shortest)
    assert audit.windows, f"{target}: no verify window audited"
    _first_rejecting(audit)  # the rollback was exercised
    assert audit.first_bad_rollback() is None, audit.first_bad_rollback()
    assert all(w.rollback_check is not None and w.rollback_check.verdict == "exact" for w in audit.windows)
    # bit-exact CPU: every |Δ| distribution is all zeros
    assert audit.stats and all(s.max_abs == 0.0 for s in audit.stats.values()), audit.stats


@pytest.mark.parametrize("target", ["llama", "gemma3", "qwen35"])
def test_nonexact_backend_rollback_is_arithmetic_not_error(target: str, nonexact: None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    t, d = load_zoo_pair(target)
    _perturb_logits(monkeypatch, t.model)
    audit = SerialReplayAudit(t.model)
    params = GenerationParams(max_tokens=20, gamma=3, eos_ids=t.eos_ids)
    shortest = min(zoo.prompts(), key=lambda p: len(p.token_ids))
    spec_generate(t.model, TwoModelProvider(d.model), list(shortest.token_ids), params, observer=audit)
    assert audit.rollback_errors() == [], audit.rollback_errors()
    w = _first_rejecting(audit)
    assert w.rollback_check is not None and w.rollback_check.verdict == "arithmetic", w.rollback_summary()
    assert "within arithmetic" in w.rollback_summary()
    logits = audit.stats[("logits", "float32")]
    cache = audit.stats[("cache", "float32")]
    assert logits.max_abs > 0, logits.to_dict()
    assert 0 < cache.max_rel < 4 * PERTURB, cache.to_dict()
    assert not w.logits_equal and "max |Δ|" in w.worst_logits() and "ulp" not in w.worst_logits()


# --- planted rollback bugs, on both backends ---------------------------------------------------


def _planted_run(target: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> SerialReplayAudit:
    t, d = load_zoo_pair(target)
    if backend == "nonexact":
        _perturb_logits(monkeypatch, t.model)
    audit = SerialReplayAudit(t.model)
    params = GenerationParams(max_tokens=24, gamma=3, eos_ids=t.eos_ids)
    spec_generate(t.model, TwoModelProvider(d.model), list(zoo.prompt("nat-00").token_ids), params,
                  observer=audit)
    return audit


def _assert_caught(audit: SerialReplayAudit, layer: int, *needles: str) -> None:
    """The verdict first: every window before the first rejecting round is exact or within
    arithmetic, that round's rollback is an ``error`` (never ``arithmetic``: a planted logic bug
    on the non-exact backend must not pass as rounding) in ``layer``; then the message."""
    first = _first_rejecting(audit)
    verdicts = [(w.round, w.rollback_check.verdict if w.rollback_check else None) for w in audit.windows]
    before = [v for r, v in verdicts if r < first.round]
    assert all(v in ("exact", "arithmetic", None) for v in before), verdicts
    assert first.rollback_check is not None and first.rollback_check.verdict == "error", verdicts
    assert not first.rollback_ok
    bad_layers = {lay for lay, _, d in first.rollback if not d.equal}
    assert layer in bad_layers or any(e.startswith(f"layer {layer} ") for e in first.rollback_check.errors), \
        (bad_layers, first.rollback_check.errors)
    msg = audit.first_bad_rollback()
    assert msg is not None and msg.startswith(f"round {first.round} "), msg
    assert f"layer {layer} " in msg and all(n in msg for n in needles), msg
    assert audit.rollback_errors() and audit.rollback_errors()[0].startswith(f"round {first.round} ")


def test_short_trim_is_caught(short_target_trim: None, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_caught(_planted_run("llama", backend, monkeypatch), 0, "meta", "offset", "kept or lost")


def test_offset_wrong_on_one_layer_is_caught(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.rollback import CacheRollback

    real = CacheRollback.rollback

    def off_by_one(self: Any, d: int, k: int) -> None:
        real(self, d, k)
        if k < d:
            self.caches[1].offset += 1  # layer 1 keeps the first rejected position

    monkeypatch.setattr(CacheRollback, "rollback", off_by_one)
    _assert_caught(_planted_run("llama", backend, monkeypatch), 1, "meta", "offset")


def test_wrong_kept_position_is_caught(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.rollback import CacheRollback

    real = CacheRollback.rollback

    def wrong_value(self: Any, d: int, k: int) -> None:
        real(self, d, k)
        if k < d:  # the last kept slot gets the first rejected token's K/V
            c = self.caches[0]
            p = c.offset - 1
            c.keys[..., p, :] = c.keys[..., p + 1, :]

    monkeypatch.setattr(CacheRollback, "rollback", wrong_value)
    audit = _planted_run("llama", backend, monkeypatch)
    first = _first_rejecting(audit)
    assert first.rollback_check is not None
    p = len(zoo.prompt("nat-00").token_ids) - 1  # tail-split: the first window starts here
    _assert_caught(audit, 0, "keys[0]", "kept position", "beyond")
    if first.round == 0:
        assert f"kept position {p + first.k_accept}" in audit.first_bad_rollback(), audit.first_bad_rollback()


def test_forgotten_recurrent_replay_is_caught(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.rollback import CacheRollback

    def restore_only(self: Any, r: Any, keep: int) -> None:
        c = r.cache
        c.cache, c.lengths, c.left_padding = list(r.snapshot[0]), r.snapshot[1], r.snapshot[2]

    monkeypatch.setattr(CacheRollback, "_replay", restore_only)
    _assert_caught(_planted_run("qwen35", backend, monkeypatch), 0, "cache")  # the gated-DeltaNet layer


@pytest.mark.parametrize("target", ["gemma3", "gemma4"])
def test_ring_guard_keeps_windowed_targets_lossless(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The §2 guard stops speculation before a wrap; without it the rollback cannot be exact."""
    t, d = load_zoo_pair(target)
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


# --- the command ---------------------------------------------------------------------------------


def test_audit_command_reports_arithmetic_and_exits_0(nonexact: None, tmp_path: Any,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from specparity.cli import main

    out = tmp_path / "audit.json"
    rc = main(["audit", "--targets", "llama", "--prompts", "1", "--max-tokens", "16", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    fig = json.loads(out.read_text())["targets"][0]
    assert fig["rollback"]["error"] == 0 and fig["rollback"]["arithmetic"] > 0, fig["rollback"]
    assert fig["delta"]["cache/float32"]["max_abs"] > 0 and "ulp" not in text
    assert "llama      cache/float32" in text and "p99 |Δ|" in text


def test_audit_command_exits_1_on_a_rollback_error(nonexact: None, short_target_trim: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cli import main

    rc = main(["audit", "--targets", "llama", "--prompts", "1", "--max-tokens", "16"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "llama nat-00 round " in err and "layer 0 meta: offset" in err, err


def test_audit_command_gpu_unavailable_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    import mlx.core as mx

    from specparity.cli import main

    if mx.is_available(mx.gpu):
        pytest.skip("this machine has a GPU backend")
    assert main(["audit", "--targets", "llama", "--device", "gpu"]) == 2
    assert "--device gpu: MLX" in capsys.readouterr().err


def test_check_rollback_on_a_wrapped_ring_counts_positions_in_temporal_order() -> None:
    """Past the wrap the live view is the last max_size positions: only the newest are this round's."""
    from mlx_lm.models.cache import RotatingKVCache

    rng = np.random.default_rng(1)
    toks = [mx.array(rng.standard_normal((1, 1, 1, 4)).astype(np.float32)) for _ in range(6)]

    def ring(last_delta: float = 0.0, first_delta: float = 0.0) -> Any:
        c = RotatingKVCache(max_size=4)
        for i, t in enumerate(toks):
            d = last_delta if i == 5 else first_delta if i == 3 else 0.0
            c.update_and_fetch(t + d, t + d)
        return c

    ref = ring()
    rc, _ = check_rollback([ring(last_delta=1e-4)], [ref], [5], scale=1e-4)  # position 5 is this round's
    assert rc.verdict == "arithmetic", rc
    rc, _ = check_rollback([ring(first_delta=1e-4)], [ref], [5], scale=1e-4)  # position 3: history
    assert rc.verdict == "error" and "position 3 (written before this round" in rc.errors[0], rc.errors
    rc, _ = check_rollback([ring(last_delta=1.0)], [ref], [5], scale=1e-4)
    assert rc.verdict == "error" and "kept position 5 " in rc.errors[0], rc.errors
