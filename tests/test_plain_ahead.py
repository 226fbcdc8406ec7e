"""Plain decode one step ahead (``engine.executor.Request.plain_loop(ahead=True)``).

mlx-lm 0.32 ``generate.py`` ``generate_step`` queues step t+1's forward on step
t's still-lazy sample (``mx.async_eval``) before it reads step t back; the
engine's plain decode and its plain fallback after a ring-wrap do the same when
nothing reads the caches or the history between steps (``cache_digests=False``,
no processors). These tests pin that it is the same arithmetic: records with and
without the look-ahead are equal field for field (digests and timings aside), on
a KV target, a recurrent one (qwen3_5 ``ArraysCache``) and a windowed one past
its ring wrap, greedy and sampled, ending by budget, EOS and stop sequence — and
that a look-ahead fed the wrong token is caught with the first differing record.
"""

from __future__ import annotations

from typing import Any

import pytest

import zoo
from engine.executor import GenerationParams, Request, plain_generate, spec_generate
from engine.sampler import SamplerParams
from engine.sources.two_model import TwoModelProvider

SKIP = ("target_cache_digest", "drafter_cache_digest", "time_s")


def _load(name: str) -> Any:
    from specparity.runners import load_model

    return load_model(str(zoo.model_dir(name)))


def first_record_difference(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> str | None:
    """``None`` when equal (digests and timings aside), else where they first differ."""
    for i, (ra, rb) in enumerate(zip(a, b, strict=False)):
        for key in sorted(set(ra) | set(rb)):
            if key not in SKIP and ra.get(key) != rb.get(key):
                return f"record {i} ({ra.get('type')}) field {key!r}: {ra.get(key)!r} != {rb.get(key)!r}"
    if len(a) != len(b):
        return f"record count {len(a)} != {len(b)}"
    return None


@pytest.fixture
def queued(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts look-ahead steps, so a test cannot pass without taking the path."""
    calls: list[int] = []
    orig = Request._queue_next

    def spy(self: Request, y: Any) -> Any:
        calls.append(1)
        return orig(self, y)

    monkeypatch.setattr(Request, "_queue_next", spy)
    return calls


def _plain_pair(name: str, how: str, max_tokens: int = 20) -> tuple[Any, Any]:
    t = _load(name)
    prompt = list(zoo.prompts()[1].token_ids)
    greedy = plain_generate(t.model, prompt, GenerationParams(max_tokens=max_tokens)).output_ids
    kw: dict[str, Any] = {"max_tokens": max_tokens}
    if how == "sampled":
        kw.update(sampler=SamplerParams(temperature=1.0), seed=7)
    elif how == "eos":
        kw["eos_ids"] = (greedy[5],)
    elif how == "stop":
        kw["stop_sequences"] = (tuple(greedy[3:5]),)
    serial = plain_generate(t.model, prompt, GenerationParams(cache_digests=True, **kw))
    ahead = plain_generate(t.model, prompt, GenerationParams(cache_digests=False, **kw))
    return serial, ahead


@pytest.mark.parametrize("name", ["llama", "qwen35", "gemma3"])
@pytest.mark.parametrize("how", ["greedy", "sampled", "eos", "stop"])
def test_plain_ahead_is_the_same_arithmetic(name: str, how: str, queued: list[int]) -> None:
    serial, ahead = _plain_pair(name, how, max_tokens=40 if name == "gemma3" else 20)
    assert queued, "the look-ahead path was not taken"
    assert first_record_difference(serial.records, ahead.records) is None
    assert serial.output_ids == ahead.output_ids and serial.usage == ahead.usage
    if how in ("eos", "stop"):
        assert ahead.usage.finish_reason == "stop" and len(ahead.output_ids) < 20


def test_plain_ahead_budget_queues_no_step_past_the_end(queued: list[int]) -> None:
    _, ahead = _plain_pair("llama", "greedy", max_tokens=6)
    assert len(ahead.output_ids) == 6
    assert len(queued) == 5  # one per token but the last: nothing queued past the budget


def test_spec_fallback_after_ring_wrap_ahead(queued: list[int]) -> None:
    t, d = _load("gemma3"), _load("gemma3-twin")
    prompt = list(zoo.prompts()[0].token_ids)

    def go(digests: bool) -> Any:
        return spec_generate(t.model, TwoModelProvider(d.model), prompt,
                             GenerationParams(max_tokens=48, gamma=3, cache_digests=digests))

    serial, ahead = go(True), go(False)
    plains = [r for r in ahead.records if r["type"] == "plain"]
    assert plains and plains[0]["reason"] == "ring-wrap", "the case no longer reaches the ring-wrap fallback"
    assert queued
    assert first_record_difference(serial.records, ahead.records) is None


def test_planted_wrong_lookahead_token_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    orig = Request._queue_next

    def planted(self: Request, y: Any) -> Any:
        return orig(self, (y + 1) % 256)  # feeds another id than the sample

    monkeypatch.setattr(Request, "_queue_next", planted)
    serial, ahead = _plain_pair("llama", "greedy")
    msg = first_record_difference(serial.records, ahead.records)
    assert msg is not None and msg.startswith("record 2 (plain) field ")
