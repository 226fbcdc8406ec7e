"""The ``ngram`` source (§3 roster row): the lookup rule and the rebuilt history.

- ``lookup`` vs a brute-force model of the rule on random histories
  (hypothesis): every (k, i) occurrence is enumerated, the longest k wins, then
  the first (smallest) i whose occurrence does not overlap the trailing k-gram;
  the continuation is clipped at the history end and at ``n``.
- The model is not vacuous: planted variants (most recent occurrence,
  shortest k first, overlap allowed) disagree with it on the stated examples.
- The source's history equals prompt + emitted tokens at every ``draft`` call,
  live through ``spec_generate`` on the zoo ``llama`` target.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from engine.sources import KINDS, make_provider
from engine.sources.ngram import NgramProvider, NgramSource, lookup

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def brute_force(
    history: list[int],
    n: int,
    ngram_max: int,
    ngram_min: int,
    *,
    pick: str = "first",
    overlap: bool = False,
) -> list[int]:
    """Every occurrence of every trailing k-gram, then the rule's choice."""
    size = len(history)
    found: list[tuple[int, int]] = []  # (k, i)
    for k in range(ngram_min, ngram_max + 1):
        if k > size:
            continue
        tail = tuple(history[size - k :])
        for i in range(size - k):  # i = size - k is the trailing k-gram itself
            disjoint = i + k <= size - k
            if tuple(history[i : i + k]) == tail and (disjoint or overlap):
                found.append((k, i))
    if not found or n <= 0:
        return []
    best_k = max(k for k, _ in found)
    starts = [i for k, i in found if k == best_k]
    i = min(starts) if pick == "first" else max(starts)
    return history[i + best_k : min(i + best_k + n, size)]


histories = st.lists(st.integers(0, 4), min_size=0, max_size=40)


@given(
    history=histories,
    n=st.integers(0, 12),
    ngram_min=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_lookup_matches_brute_force(history: list[int], n: int, ngram_min: int, extra: int) -> None:
    ngram_max = ngram_min + extra
    got = lookup(history, n, ngram_max, ngram_min)
    want = brute_force(history, n, ngram_max, ngram_min)
    note(f"history={history} n={n} max={ngram_max} min={ngram_min}")
    assert got == want, (
        f"history={history} n={n} k=[{ngram_min},{ngram_max}]: got {got}, want {want}"
    )
    assert len(got) <= n


@pytest.mark.parametrize(
    ("history", "n", "want"),
    [
        ([1, 2, 3, 9, 1, 2, 3], 10, [9, 1, 2, 3]),  # 3-gram, clipped at the history end
        ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),  # clipped at n
        ([5, 1, 2, 7, 1, 2, 8, 1, 2], 3, [7, 1, 2]),  # FIRST occurrence of [1, 2], not the latest
        ([4, 2, 6, 3, 2], 4, [6, 3, 2]),  # falls back to k = 1
        ([1, 2, 3, 4], 4, []),  # no earlier occurrence: zero-length draft
        ([7, 7, 7], 4, [7, 7]),  # [7, 7] overlaps itself: k = 1 at i = 0
        ([], 4, []),
        ([3], 4, []),
    ],
)
def test_lookup_examples(history: list[int], n: int, want: list[int]) -> None:
    assert lookup(history, n, 3, 1) == want, history


def test_lookup_min_max_bounds() -> None:
    # Only a 1-gram repeats; ngram_min = 2 finds nothing.
    assert lookup([4, 2, 6, 3, 2], 4, 3, 2) == []
    # ngram_max = 1 ignores a longer match and takes the first 1-gram occurrence.
    assert lookup([1, 2, 9, 2, 1, 2], 3, 1, 1) == [9, 2, 1]
    assert lookup([1, 2, 9, 2, 1, 2], 3, 2, 1) == [9, 2, 1]
    assert lookup([2, 5, 1, 2, 9, 1, 2], 3, 2, 1) == [9, 1, 2]
    assert lookup([2, 5, 1, 2, 9, 1, 2], 3, 1, 1) == [5, 1, 2]
    with pytest.raises(ValueError):
        lookup([1, 2], 1, 1, 2)
    with pytest.raises(ValueError):
        lookup([1, 2], 1, 1, 0)


@pytest.mark.parametrize(
    ("variant", "history"),
    [
        ({"pick": "last"}, [5, 1, 2, 7, 1, 2, 8, 1, 2]),
        ({"overlap": True}, [7, 7, 7]),
    ],
)
def test_brute_force_model_tells_rule_variants_apart(variant: dict, history: list[int]) -> None:
    """The property test can fail: a planted rule variant disagrees on this history."""
    assert brute_force(history, 4, 3, 1, **variant) != lookup(history, 4, 3, 1)


def test_shortest_first_variant_differs() -> None:
    history = [2, 5, 1, 2, 9, 1, 2]
    assert (
        brute_force(history, 3, 1, 1) != brute_force(history, 3, 2, 1) == lookup(history, 3, 2, 1)
    )


def test_registry_and_defaults() -> None:
    assert "ngram" in KINDS
    p = make_provider("ngram", gamma=4, ngram_max=2, ngram_min=2)
    assert isinstance(p, NgramProvider) and (p.gamma, p.ngram_max, p.ngram_min) == (4, 2, 2)
    d = make_provider("ngram")
    assert (d.gamma, d.ngram_max, d.ngram_min) == (10, 3, 1)
    src = d.open(None, None)  # type: ignore[arg-type]
    assert src.prefill_mode == "tail-split" and src.tap_layers == () and src.cache_digest() is None
    with pytest.raises(ValueError):
        make_provider("ngram", ngram_max=1, ngram_min=2)


def test_history_follows_feed_and_commit() -> None:
    src = NgramSource(3, 1)
    assert src.prefill([1, 2, 3, 1, 2], None) == []
    assert src.draft([3], 4, 0) == [1, 2, 3]  # history 1 2 3 1 2 3 -> after [1 2 3] at 0
    src.commit(3, 3, accepted_tokens=[1, 2, 3])  # all accepted; feed = [last draft, bonus]
    assert src.history == [1, 2, 3, 1, 2, 3, 1, 2, 3]
    src.draft([3, 7], 4, 4)
    assert src.history == [1, 2, 3, 1, 2, 3, 1, 2, 3, 7]
    src.commit(0, 0, accepted_tokens=[])
    src.draft([9], 4, 5)
    assert src.history[-2:] == [7, 9]
    with pytest.raises(RuntimeError):  # accepted tokens that were never drafted
        src.commit(1, 1, accepted_tokens=[42])


@pytest.fixture(scope="module")
def llama():
    import zoo
    from specparity.runners import load_model

    return load_model(str(zoo.model_dir("llama")))


class _Probe(NgramProvider):
    """Records the source's history at every draft call (test instrumentation)."""

    def __init__(self, log: list, **kw) -> None:
        super().__init__(**kw)
        self.log = log

    def open(self, sampler, target):  # noqa: ANN001, ANN201
        src = super().open(sampler, target)
        inner = src.draft

        def draft(feed, n, step_base, anchor_hidden=None):  # noqa: ANN001, ANN202
            out = inner(feed, n, step_base, anchor_hidden)
            self.log.append((list(src.history), step_base, list(out)))
            return out

        src.draft = draft  # type: ignore[method-assign]
        return src


@pytest.mark.parametrize("prefill", ["tail-split", "full"])
@pytest.mark.parametrize("gamma", [1, 3, 10])
def test_history_is_prompt_plus_emitted(llama, prefill: str, gamma: int) -> None:
    import zoo
    from engine.executor import GenerationParams, spec_generate

    prompt = list(zoo.prompts()[0].token_ids)
    emitted: list[int] = []
    log: list = []
    params = GenerationParams(max_tokens=40, gamma=gamma, prefill=prefill, eos_ids=())  # type: ignore[arg-type]

    def on_token(t: int) -> None:
        emitted.append(t)

    calls_emitted: list[list[int]] = []
    probe = _Probe(log, gamma=gamma)
    orig_open = probe.open

    def open_(sampler, target):  # noqa: ANN001, ANN202
        src = orig_open(sampler, target)
        d = src.draft

        def draft(*a, **k):  # noqa: ANN002, ANN003, ANN202
            calls_emitted.append(list(emitted))
            return d(*a, **k)

        src.draft = draft  # type: ignore[method-assign]
        return src

    probe.open = open_  # type: ignore[method-assign]
    result = spec_generate(llama.model, probe, prompt, params, on_token=on_token)
    assert log and len(log) == len(calls_emitted)
    for (history, step_base, drafts), seen in zip(log, calls_emitted, strict=True):
        assert history == prompt + seen, (
            f"gamma={gamma} step {step_base}: history != prompt + emitted"
        )
        assert step_base == len(seen)
        assert drafts == lookup(history, min(gamma, 40 - len(seen)), 3, 1)
    assert result.output_ids == emitted
    assert any(d for _, _, d in log), "no round drafted anything: the invariant was not exercised"
