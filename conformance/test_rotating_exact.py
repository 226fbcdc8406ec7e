"""Exact rollback of rotating caches past the ring wrap (``rotating="exact"``), on the zoo.

The windowed zoo targets (``gemma3``, ``gemma4``: a ``RotatingKVCache`` of
window 32 in layer 0, a ``KVCache`` in layer 1) with the ``self`` and ``twin``
drafters (themselves windowed) generate 128 tokens (256 and more prompts and
γ under the ``slow`` marker, selected with ``-m slow`` or ``SPECPARITY_PROMPTS=all``) with ``engine.rollback.RingRound``. Checked per
run:

- speculation continues to the end: every record after the prefill is a
  ``round`` (no ``plain`` fallback), and rounds run past the wrap;
- spec ≡ plain: the emitted tokens equal the engine's plain decode, round for
  round (each round's emitted tokens are the plain tokens at its positions);
- after every rollback the target's rotating layers equal — byte for byte,
  live state — a clone of the round's incoming caches fed only the kept
  window tokens one at a time (plain decode); the other layers keep the same
  positions (their bytes past the wrap are the batched verify's, which
  differ from serial decode by batched-vs-serial arithmetic: the verify
  attends over the ring in temporal order, serial decode in slot order);
- after every drafter commit the drafter's rotating layers equal a clone of
  its caches before the round fed only the kept tokens one at a time.

The gemma4 assistant heads (which attend over the target's own caches) get
the same target checks.

Planted restore bugs (one saved slot not written back, the offset not
restored, one position too few re-applied) are caught with the round named.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import pytest

from engine.audit import clone_caches, compare_caches
from engine.executor import GenerationParams, plain_generate, spec_generate
from engine.rollback import RingRound, is_rotating
from engine.sources.two_model import TwoModelProvider, TwoModelSource

TARGETS = ("gemma3", "gemma4")


def _serial(model: Any, caches: list[Any], tokens: list[int]) -> None:
    for t in tokens:
        model(mx.array([[t]], mx.uint32), cache=caches)
    mx.eval([c.state for c in caches])


def _check(who: str, index: int, k: int, live: list[Any], kept: list[Any]) -> list[str]:
    bad = []
    for layer, name, d in compare_caches(live, kept):
        if d.equal:
            continue
        if is_rotating(live[layer]) or d.shape_mismatch or name == "meta":
            bad.append(f"round {index} (k_accept {k}): {who} layer {layer} {name}: {d.describe()}")
    return bad


class RingAudit:
    """Executor observer + drafter wrapper: rolled-back caches vs kept-only plain decode."""

    def __init__(self, target_model: Any) -> None:
        self.model = target_model
        self.errors: list[str] = []
        self.past_wrap = 0  # rounds whose window reached the ring's max_size
        self._incoming: list[Any] = []
        self._window: list[int] = []

    def before_verify(self, index: int, window: list[int], caches: list[Any]) -> None:
        self._incoming, self._window = clone_caches(caches), list(window)
        ring = [c for c in caches if is_rotating(c)]
        if ring and any(int(c.offset) + len(window) >= int(c.max_size) for c in ring):
            self.past_wrap += 1

    def after_verify(self, index: int, window: list[int], block: Any, caches: list[Any]) -> None:
        pass

    def after_rollback(self, index: int, k_accept: int, caches: list[Any]) -> None:
        kept = self._incoming
        _serial(self.model, kept, self._window[: k_accept + 1])
        self.errors += _check("target", index, k_accept, caches, kept)

    def provider(self, draft_model: Any) -> TwoModelProvider:
        audit = self

        class Audited(TwoModelProvider):
            def open(self, sampler: Any, target: Any) -> TwoModelSource:
                src = super().open(sampler, target)
                real_draft, real_commit = src.draft, src.commit
                state: dict[str, Any] = {"round": 0}

                def draft(feed: list[int], n: int, *a: Any) -> list[int]:
                    state["before"], state["feed"] = clone_caches(src.caches), list(feed)
                    state["drafts"] = real_draft(feed, n, *a)
                    return state["drafts"]

                def commit(d: int, k: int, *a: Any, **kw: Any) -> None:
                    real_commit(d, k, *a, **kw)
                    if d > 0:
                        kept = state["before"]
                        toks = state["feed"] + state["drafts"][: max(d - 1, 0)]
                        toks = toks[: len(toks) - max(d - k - 1, 0)]
                        _serial(src.model, kept, toks)
                        audit.errors += _check("drafter", state["round"], k, src.caches, kept)
                    state["round"] += 1

                src.draft, src.commit = draft, commit  # type: ignore[method-assign]
                return src

        return Audited(draft_model)


def run_exact(target: str, drafter: str, prompt: int, max_tokens: int, gamma: int) -> tuple[Any, Any, RingAudit]:
    import zoo
    from specparity.runners import load_model

    tdir, ddir = zoo.pair(target, drafter)
    t, d = load_model(str(tdir)), load_model(str(ddir))
    ids = list(zoo.prompts()[prompt].token_ids)
    params = GenerationParams(max_tokens=max_tokens, gamma=gamma, eos_ids=(), rotating="exact")
    audit = RingAudit(t.model)
    spec = spec_generate(t.model, audit.provider(d.model), ids, params, observer=audit)
    plain = plain_generate(t.model, ids, GenerationParams(max_tokens=max_tokens, eos_ids=()))
    return spec, plain, audit


def assert_exact(spec: Any, plain: Any, audit: RingAudit) -> None:
    assert not audit.errors, "rolled-back caches differ from kept-only plain decode:\n" + "\n".join(audit.errors[:5])
    fallback = [r for r in spec.records if r["type"] == "plain" and r["reason"] != "initial"]
    assert not fallback, fallback[0].get("detail")
    assert audit.past_wrap > 0, "no round reached the ring's window"
    pos = 0
    for r in spec.records:
        if r["type"] == "plain":  # the full-prefill sample of a head source
            assert [r["sample"]] == plain.output_ids[pos : pos + 1]
            pos += 1
            continue
        if r["type"] != "round":
            continue
        want = plain.output_ids[pos : pos + len(r["emitted"])]
        assert r["emitted"] == want, (
            f"round {r['index']}: spec emitted {r['emitted']}, plain decode {want} at positions {pos}.."
        )
        pos += len(r["emitted"])
    assert spec.output_ids == plain.output_ids


FAST = [(t, d) for t in TARGETS for d in ("self", "twin")]


@pytest.mark.parametrize(("target", "drafter"), FAST, ids=[f"{t}-{d}" for t, d in FAST])
def test_exact_speculates_past_wrap(target: str, drafter: str) -> None:
    spec, plain, audit = run_exact(target, drafter, 0, 128, 3)
    assert_exact(spec, plain, audit)


@pytest.mark.parametrize("head", ["gemma4-assistant-self", "gemma4-assistant-centroid"])
def test_exact_with_assistant_heads_reading_the_target_ring(head: str) -> None:
    """The gemma4 assistant drafter attends over the target's own (rotating) caches."""
    import zoo
    from engine.sources import make_provider
    from specparity.runners import load_model
    from zoo.heads import head_dir

    t = load_model(str(zoo.model_dir("gemma4")))
    ids = list(zoo.prompts()[0].token_ids)
    audit = RingAudit(t.model)
    spec = spec_generate(t.model, make_provider("assistant", path=head_dir(head)), ids,
                         GenerationParams(max_tokens=96, eos_ids=(), rotating="exact", prefill="full"),
                         observer=audit)
    plain = plain_generate(t.model, ids, GenerationParams(max_tokens=96, eos_ids=(), prefill="full"))
    assert_exact(spec, plain, audit)


SLOW = [(t, d, p, g) for t in TARGETS for d in ("self", "twin") for p in (1, 2, 3) for g in (1, 5)]


def _slow_selected(config: pytest.Config) -> bool:
    expr = str(config.getoption("-m") or "")
    return ("slow" in expr and "not slow" not in expr) or os.environ.get("SPECPARITY_PROMPTS") == "all"


@pytest.mark.slow
@pytest.mark.parametrize(("target", "drafter", "prompt", "gamma"), SLOW, ids=[f"{t}-{d}-p{p}-g{g}" for t, d, p, g in SLOW])
def test_exact_speculates_past_wrap_256(
    target: str, drafter: str, prompt: int, gamma: int, request: pytest.FixtureRequest
) -> None:
    if not _slow_selected(request.config):
        pytest.skip("256-token matrix: run with -m slow or SPECPARITY_PROMPTS=all (about 6 min)")
    spec, plain, audit = run_exact(target, drafter, prompt, 256, gamma)
    assert_exact(spec, plain, audit)


_REAL = RingRound.rollback


def _one_slot_short(self: RingRound, keep: int) -> None:
    self.saved = self.saved[:-1]
    _REAL(self, keep)


def _offset_not_restored(self: RingRound, keep: int) -> None:
    assert self.snapshot is not None
    keys, values, _, idx = self.snapshot
    self.snapshot = (keys, values, int(self.cache.offset), idx)
    _REAL(self, keep)


def _reapply_one_short(self: RingRound, keep: int) -> None:
    _REAL(self, keep - 1)


PLANTS = {
    "one-slot-short": (_one_slot_short, "drafter"),
    "offset-not-restored": (_offset_not_restored, "target"),
    "reapply-one-short": (_reapply_one_short, "target"),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_restore_bug_is_caught(plant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fn, who = PLANTS[plant]
    monkeypatch.setattr(RingRound, "rollback", fn)
    try:
        spec, plain, audit = run_exact("gemma3", "twin", 0, 64, 3)
    except Exception as e:  # noqa: BLE001 - a crash mid-run would also be a catch, but name it
        pytest.fail(f"planted {plant} crashed the run instead of being reported: {e!r}")
    assert audit.errors, f"planted {plant} not caught"
    first = audit.errors[0]
    assert first.startswith("round ") and f": {who} layer 0 " in first, first


def _windowed(path: Any, window: int) -> Any:
    """A fresh load of a zoo gemma3 model with its sliding window set to ``window``."""
    from engine.models import load

    m = load(str(path))
    m.model.args.sliding_window = window
    m.model.model.window_size = window
    return m


@pytest.mark.parametrize("window", [1, 2, 3])
def test_exact_tiny_windows_and_gamma_beyond_the_window(window: int) -> None:
    """gemma3 (and its twin drafter) with windows 1-3 and γ 5: every round overruns the ring."""
    import zoo

    tdir, ddir = zoo.pair("gemma3", "twin")
    t, d = _windowed(tdir, window), _windowed(ddir, window)
    assert t.model.make_cache()[0].max_size == window
    ids = list(zoo.prompts()[1].token_ids)
    audit = RingAudit(t.model)
    spec = spec_generate(t.model, audit.provider(d.model), ids,
                         GenerationParams(max_tokens=48, gamma=5, eos_ids=(), rotating="exact"), observer=audit)
    plain = plain_generate(t.model, ids, GenerationParams(max_tokens=48, eos_ids=()))
    assert_exact(spec, plain, audit)
    assert any(0 < r["k_accept"] < len(r["drafts"]) for r in spec.records if r["type"] == "round")
