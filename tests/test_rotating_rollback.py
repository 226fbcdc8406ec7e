"""The ``rotating`` request option: exact ring rollback vs the §2 guard (engine/rollback.py).

Model-free where possible; the zoo ``gemma3`` pair (window 32) for the
executor-level checks: exact and guard agree round for round (digests
included) up to where the guard stops, and a rotating cache exact rollback
cannot handle keeps the guard with the reason recorded, never a silent
wrong rollback.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from engine.caches import CacheRollbackError
from engine.executor import GenerationParams, spec_generate
from engine.rollback import CacheRollback, RingRound, ring_unsupported
from engine.sources.two_model import TwoModelProvider
from tests.helpers import load_zoo_pair


class OddRing(RotatingKVCache):
    """A rotating cache with its own update code: exact rollback must refuse it."""

    def update_and_fetch(self, keys: Any, values: Any) -> Any:
        return super().update_and_fetch(keys, values)


def _kv(n: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, 2, n, 4), key=mx.random.key(seed))
    return k, k + 1


def test_rotating_option_validated_and_default_guard() -> None:
    assert GenerationParams().rotating == "guard"
    with pytest.raises(ValueError, match="rotating must be one of"):
        GenerationParams(rotating="sometimes")
    with pytest.raises(ValueError, match="rotating must be one of"):
        CacheRollback(SimpleNamespace(layers=[]), [], rotating="nope")


def test_unsupported_ring_keeps_guard_with_reason() -> None:
    assert ring_unsupported(RotatingKVCache(max_size=4)) is None
    assert "overrides RotatingKVCache.update_and_fetch" in (ring_unsupported(OddRing(max_size=4)) or "")
    assert "not mlx-lm RotatingKVCache" in (ring_unsupported(KVCache()) or "")
    odd = OddRing(max_size=4)
    odd.update_and_fetch(*_kv(4))
    plan = CacheRollback(SimpleNamespace(layers=[object()]), [odd], rotating="exact")
    assert not plan.rings and 0 in plan.ring_fallback
    why = plan.ring_guard(1)
    assert why is not None and why.startswith("ring-wrap:") and "exact rollback unsupported" in why


def test_wrong_slot_is_an_error_not_a_silent_restore() -> None:
    c = RotatingKVCache(max_size=3)
    c.update_and_fetch(*_kv(1))
    c.update_and_fetch(*_kv(1, 1))
    c.update_and_fetch(*_kv(1, 2))  # full ring, _idx == max_size
    ring = RingRound(c)
    ring.begin()
    slot = ring.before_update(*_kv(1, 3))
    assert slot == 0  # rotates to keep
    with pytest.raises(CacheRollbackError, match="wrote slot 2, expected 0"):
        ring.after_update(slot)  # as if mlx-lm had written somewhere else
    ring.end()


def test_rollback_without_round_raises() -> None:
    with pytest.raises(CacheRollbackError, match="without a round"):
        RingRound(RotatingKVCache(max_size=2)).rollback(1)


def _pair() -> tuple[Any, Any, list[int]]:
    import zoo

    return (*load_zoo_pair("gemma3"), list(zoo.prompts()[0].token_ids))


def _strip(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k != "time_s"}


def test_exact_equals_guard_until_the_guard_stops() -> None:
    t, d, ids = _pair()
    runs = {
        mode: spec_generate(
            t.model, TwoModelProvider(d.model), ids, GenerationParams(max_tokens=48, eos_ids=(), rotating=mode)
        )
        for mode in ("guard", "exact")
    }
    guard, exact = runs["guard"].records, runs["exact"].records
    stop = next(i for i, r in enumerate(guard) if r["type"] == "plain")
    assert "ring-wrap" in guard[stop]["reason"]
    assert [_strip(r) for r in exact[:stop]] == [_strip(r) for r in guard[:stop]]
    assert all(r["type"] == "round" for r in exact[stop:])
    assert runs["exact"].output_ids == runs["guard"].output_ids


def test_unsupported_target_ring_falls_back_to_guard_in_the_trace() -> None:
    t, d, ids = _pair()
    caches = make_prompt_cache(t.model)
    i = next(i for i, c in enumerate(caches) if isinstance(c, RotatingKVCache))
    caches[i] = OddRing(max_size=caches[i].max_size, keep=caches[i].keep)
    res = spec_generate(
        t.model,
        TwoModelProvider(d.model),
        ids,
        GenerationParams(max_tokens=40, eos_ids=(), rotating="exact"),
        target_caches=caches,
    )
    plain = [r for r in res.records if r["type"] == "plain"]
    assert plain and plain[0]["reason"] == "ring-wrap"
    assert "exact rollback unsupported: OddRing overrides" in plain[0]["detail"]


def test_unsupported_drafter_ring_falls_back_to_guard() -> None:
    t, d, _ = _pair()
    from engine.sampler import StepSampler

    src = TwoModelProvider(d.model).open(StepSampler.from_params(GenerationParams().sampler), SimpleNamespace(model=t.model))
    i = next(i for i, c in enumerate(src.caches) if isinstance(c, RotatingKVCache))
    src.caches[i] = OddRing(max_size=src.caches[i].max_size)
    src.set_rotating("exact")
    assert i in src.ring_fallback and i not in src.rings
    src.caches[i].offset = src.caches[i].max_size  # as if the ring were full
    why = src.rollback_guard([1], 3)
    assert why is not None and "exact rollback unsupported: OddRing overrides" in why


def test_generate_rotating_exact_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import zoo
    from specparity.cli import main
    from traces.io import read_trace

    tdir, ddir = zoo.pair("gemma3", "twin")
    ids = ",".join(str(t) for t in zoo.prompts()[0].token_ids)
    out = {}
    for mode in ("guard", "exact"):
        trace = tmp_path / f"{mode}.jsonl"
        assert main(["generate", "--target", str(tdir), "--draft", str(ddir), "-n", "48", "--prompt-ids", ids,
                     "--eos-ids", "511", "--rotating", mode, "--trace", str(trace)]) == 0
        assert main(["trace", "validate", str(trace)]) == 0
        out[mode] = (read_trace(trace), capsys.readouterr().err)
    guard, exact = out["guard"][0], out["exact"][0]
    assert "rotating" not in guard.header["params"]  # default traces unchanged
    assert exact.header["params"]["rotating"] == "exact"
    assert "speculation stopped" in out["guard"][1] and "speculation stopped" not in out["exact"][1]
    assert guard.plains and not exact.plains
    assert guard.footer["output_ids"] == exact.footer["output_ids"]


def test_audit_rotating_exact_covers_windows_past_the_wrap(tmp_path: Path) -> None:
    import json

    from specparity.cli import main

    out = tmp_path / "audit.json"
    assert main(["audit", "--targets", "gemma3", "--prompts", "1", "--max-tokens", "64",
                 "--rotating", "exact", "--json", str(out)]) == 0
    fig = json.loads(out.read_text())["targets"][0]
    assert fig["windows"] > 12  # the guard stops after a few; exact goes on past the wrap
    assert fig["rollback"]["error"] == 0


def _physical(c: Any) -> tuple[Any, ...]:
    return (int(c.offset), int(c._idx), int(c.keep), int(c.max_size), c.keys.shape,
            bytes(memoryview(mx.array(c.keys))), bytes(memoryview(mx.array(c.values))))


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_target_rollback_is_physically_the_kept_only_update(size: int) -> None:
    """Buffers and indices, not just the live state: the verify cut equals the kept-only concat."""
    from engine.audit import clone_caches

    for keep in range(min(size, 3)):
        for pre, plain in ((size + 2, 0), (1, size + 1), (size, 3)):
            for s in range(2, 8):
                for kept in range(1, s + 1):
                    c = RotatingKVCache(max_size=size, keep=keep)
                    c.update_and_fetch(*_kv(pre, 1))
                    for i in range(plain):
                        c.update_and_fetch(*_kv(1, 10 + i))
                    mx.eval(c.keys, c.values)
                    ref = clone_caches([c])[0]
                    k, v = _kv(s, 99)
                    ring = RingRound(c)
                    ring.begin()
                    c.update_and_fetch(k, v)
                    ring.end()
                    ring.rollback(kept)
                    ref.update_and_fetch(k[..., :kept, :], v[..., :kept, :])
                    assert _physical(c) == _physical(ref), (size, keep, pre, plain, s, kept)


def test_audit_rotating_exact_names_the_round_of_a_planted_restore_bug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from specparity.cli import main

    real = RingRound.rollback

    def offset_not_restored(self: RingRound, keep: int) -> None:
        assert self.snapshot is not None
        keys, values, _, idx = self.snapshot
        self.snapshot = (keys, values, int(self.cache.offset), idx)
        real(self, keep)

    monkeypatch.setattr(RingRound, "rollback", offset_not_restored)
    import json

    out = tmp_path / "audit.json"
    rc = main(["audit", "--targets", "gemma3", "--prompts", "1", "--max-tokens", "48", "--rotating", "exact",
               "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 1, err
    fig = json.loads(out.read_text())["targets"][0]
    assert fig["rollback"]["error"] > 0, fig["rollback"]  # the verdict, then where
    assert " round 1 (k_accept" in f" {fig['rollback_errors'][0]}", fig["rollback_errors"][:2]
    first = err.split("rollback errors", 1)[-1].strip().splitlines()[1]
    assert "round 1 (k_accept" in first and "layer 0 meta: offset" in first, err


def test_keep_prefix_rings_keep_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-lm ``max_kv_size`` caches (keep=4): a multi-token verify past the wrap hides the kept
    prefix from later window positions, so speculation there would not be plain decode."""
    import zoo
    from specparity.runners import load_model

    c = RotatingKVCache(max_size=8, keep=4)
    assert "keep=4" in (ring_unsupported(c) or "")
    tdir, ddir = zoo.pair("llama", "twin")
    t, d = load_model(str(tdir)), load_model(str(ddir))
    ids = list(zoo.prompts()[0].token_ids)

    def caches() -> list[Any]:
        return [RotatingKVCache(max_size=40, keep=4) for _ in t.model.layers]

    spec = spec_generate(t.model, TwoModelProvider(d.model), ids,
                         GenerationParams(max_tokens=64, eos_ids=(), rotating="exact"), target_caches=caches())
    plain = spec_generate(t.model, TwoModelProvider(d.model), ids,
                          GenerationParams(max_tokens=64, gamma=0, eos_ids=()), target_caches=caches())
    fallback = [r for r in spec.records if r["type"] == "plain"]
    assert fallback and "exact rollback unsupported" in fallback[0]["detail"] and "keep=4" in fallback[0]["detail"]
    assert spec.output_ids == plain.output_ids
    # Why: forced past the wrap anyway, the verify windows leave plain decode (mlx-lm 0.32.2).
    import engine.rollback as rb

    monkeypatch.setattr(rb, "ring_unsupported", rb.ring_mechanics_unsupported)
    forced = spec_generate(t.model, TwoModelProvider(d.model), ids,
                           GenerationParams(max_tokens=64, eos_ids=(), rotating="exact"), target_caches=caches())
    assert not [r for r in forced.records if r["type"] == "plain"]
    assert forced.output_ids != plain.output_ids


def _restore_to_start(c: Any, writes: int, rollback: Any) -> None:
    """A round of ``writes`` single-token in-place writes into the full ring, then ``rollback(ring, 0)``."""
    ring = RingRound(c)
    ring.begin()
    for i in range(writes):
        c.update_and_fetch(*_kv(1, 50 + i))
    ring.end()
    assert len(ring.saved) == writes  # every write overwrote a slot of the incoming buffer
    rollback(ring, 0)


@pytest.mark.parametrize("writes", [1, 2, 3, 5])  # 5 > max_size: a slot overwritten twice
def test_round_restored_to_its_start_is_physically_the_incoming_cache(writes: int) -> None:
    """``rollback(0)`` (the two-model drafter's replay mode: the model re-feeds afterwards)
    writes EVERY saved slot back; the re-feed's first write would hide a missing first slot,
    so this is checked on the cache right after the rollback, buffers and indices."""
    from engine.audit import clone_caches

    c = RotatingKVCache(max_size=4)
    c.update_and_fetch(*_kv(6, 1))  # past the wrap: in-place writes overwrite live slots
    c.update_and_fetch(*_kv(1, 2))
    mx.eval(c.keys, c.values)
    ref = clone_caches([c])[0]
    _restore_to_start(c, writes, RingRound.rollback)
    assert _physical(c) == _physical(ref)


@pytest.mark.parametrize(("plant", "writes"), [("oldest", 1), ("oldest", 3), ("oldest", 5),
                                               ("newest", 1), ("newest", 3)])
def test_restore_one_saved_slot_short_is_caught(plant: str, writes: int) -> None:
    """(With 5 writes into a ring of 4 the newest saved copy is of a slot the oldest one restores
    anyway: dropping it changes nothing, so it is not a plant there.)"""
    from engine.audit import clone_caches

    def short(ring: RingRound, keep: int) -> None:
        ring.saved = ring.saved[1:] if plant == "oldest" else ring.saved[:-1]
        RingRound.rollback(ring, keep)

    c = RotatingKVCache(max_size=4)
    c.update_and_fetch(*_kv(6, 1))
    c.update_and_fetch(*_kv(1, 2))
    mx.eval(c.keys, c.values)
    ref = clone_caches([c])[0]
    _restore_to_start(c, writes, short)
    assert _physical(c) != _physical(ref), f"{plant} saved slot not written back went unnoticed"
