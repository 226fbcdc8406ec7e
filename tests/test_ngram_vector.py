"""The n-gram lookup's vectorized path (``engine.sources.ngram``, long histories) proposes exactly
what the slice-by-slice definition proposes, on histories built to match at every k, to miss,
and at the threshold; a planted off-by-one in the candidate span is caught."""

from __future__ import annotations

import random

import pytest

from engine.sources import ngram


def _histories() -> list[list[int]]:
    rng = random.Random(7)
    out = []
    for size in (ngram.VECTOR_MIN - 1, ngram.VECTOR_MIN, ngram.VECTOR_MIN + 1, 100, 257, 700):
        for vocab in (2, 3, 7, 50, 5000):  # small vocabularies match often, large ones rarely
            out.append([rng.randrange(vocab) for _ in range(size)])
        h = [rng.randrange(5000) for _ in range(size)]
        h[-3:] = h[10:13]  # a trigram match early on
        out.append(h)
        h = [rng.randrange(5000) for _ in range(size)]
        h[-2:] = h[size - 6 : size - 4]  # a bigram match just before the overlap limit
        out.append(h)
    return out


@pytest.mark.parametrize("n", [1, 3, 10])
@pytest.mark.parametrize(("kmax", "kmin"), [(3, 1), (4, 2), (1, 1)])
def test_vectorized_lookup_equals_the_scan(n: int, kmax: int, kmin: int) -> None:
    for h in _histories():
        want = ngram._lookup_scan(h, n, kmax, kmin)
        got = ngram._lookup_vector(h, n, kmax, kmin)
        assert got == want, f"history of {len(h)}: vectorized {got} != scanned {want}"
        assert ngram.lookup(h, n, kmax, kmin) == want


def test_an_overlapping_candidate_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    def overlapping(history: list[int], n: int, ngram_max: int, ngram_min: int) -> list[int]:
        size = len(history)
        arr = np.asarray(history)
        for k in range(min(ngram_max, size // 2), ngram_min - 1, -1):
            span = size - 2 * k + 2  # planted: one start too many (overlaps the trailing k-gram)
            tail = arr[size - k :]
            ok = arr[:span] == tail[0]
            for j in range(1, k):
                ok &= arr[j : j + span] == tail[j]
            hits = np.flatnonzero(ok)
            if hits.size:
                return [int(t) for t in history[int(hits[0]) + k : int(hits[0]) + k + n]]
        return []

    h = list(range(100)) + [5, 5, 5]  # "5 5" recurs only overlapping the trailing bigram
    wrong = [x for x in [*_histories(), h] if overlapping(x, 3, 3, 2) != ngram._lookup_scan(x, 3, 3, 2)]
    assert wrong, "the comparison cannot see a candidate overlapping the trailing k-gram"
