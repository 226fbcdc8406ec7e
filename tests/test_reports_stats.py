"""``reports.stats``: McNemar on known tables, the drop bound, the bootstrap and both verdicts."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest
from scipy.stats import chi2

from reports.stats import PairedTable, ab_verdict, median_ratio, paired_drop


def _outcomes(a: int, b: int, c: int, d: int) -> tuple[list[bool], list[bool]]:
    xa = [True] * a + [True] * b + [False] * c + [False] * d
    xb = [True] * a + [False] * b + [True] * c + [False] * d
    return xa, xb


def test_table_from_outcomes() -> None:
    xa, xb = _outcomes(5, 3, 2, 7)
    t = PairedTable.from_outcomes(xa, xb)
    assert (t.a, t.b, t.c, t.d, t.n) == (5, 3, 2, 7, 17), t
    with pytest.raises(ValueError, match="length"):
        PairedTable.from_outcomes([True], [True, False])


def test_exact_binomial_p_value_hand_computed() -> None:
    # b=10, c=2: m=12 < 25 -> exact; one-sided P(X<=2 | Binom(12, 1/2)) = 79/4096
    r = paired_drop(PairedTable(50, 10, 2, 38), max_drop_pts=3)
    tail = sum(comb(12, k) for k in range(3)) / 2**12
    assert r.test == "exact binomial"
    assert r.p_one_sided == pytest.approx(tail, rel=1e-9), r
    assert r.p_two_sided == pytest.approx(2 * tail, rel=1e-9), r
    assert r.drop_pts == pytest.approx(8.0), r


def test_chi_square_with_continuity_correction_wikipedia_table() -> None:
    # Wikipedia "McNemar's test" example: b=121, c=59 -> corrected chi2 = 61^2 / 180
    r = paired_drop(PairedTable(101, 121, 59, 33), max_drop_pts=3)
    assert r.test.startswith("chi-square")
    assert r.statistic == pytest.approx(61**2 / 180), r
    assert r.p_two_sided == pytest.approx(chi2.sf(61**2 / 180, 1)), r


def test_clear_regression_is_drop() -> None:
    # planted regression: A accepts 60 % of 400 units, B loses 80 of them
    r = paired_drop(*_outcomes(160, 80, 0, 160), max_drop_pts=3)
    assert r.verdict == "drop" and r.resolved and not r.passes, r
    assert r.lower_pts > 3 and r.drop_pts == pytest.approx(20.0), r


def test_tie_is_no_drop_resolved() -> None:
    r = paired_drop(*_outcomes(200, 0, 0, 200), max_drop_pts=3)
    assert r.verdict == "no drop" and r.resolved, r
    assert r.drop_pts == r.upper_pts == r.lower_pts == 0.0, r
    assert r.p_one_sided == 1.0


def test_balanced_swing_inside_noise_passes() -> None:
    r = paired_drop(*_outcomes(400, 6, 6, 400), max_drop_pts=3)
    assert r.verdict == "no drop" and r.resolved, r
    assert r.upper_pts < 3, r


def test_improvement_is_no_drop() -> None:
    r = paired_drop(*_outcomes(100, 0, 40, 100), max_drop_pts=3)
    assert r.verdict == "no drop" and r.drop_pts < 0 and r.upper_pts <= 0, r


def test_small_n_cannot_resolve_and_says_so() -> None:
    # 3 of 10 lost: a 30-point point drop, but exact p = 1/8 -> not significant
    r = paired_drop(*_outcomes(3, 3, 0, 4), max_drop_pts=3)
    assert r.p_one_sided == pytest.approx(1 / 8), r
    assert r.verdict == "no drop" and not r.resolved, r
    assert "too small" in r.note and "n=10" in r.note, r.note
    assert r.upper_pts > 3


def test_significant_but_within_allowance_is_no_drop() -> None:
    # a real but tiny drop (significant at alpha) inside a generous allowance
    r = paired_drop(PairedTable(4000, 60, 10, 4000), max_drop_pts=3)
    assert r.p_one_sided < 0.05, r
    assert r.verdict == "no drop", r
    strict = paired_drop(PairedTable(4000, 60, 10, 4000), max_drop_pts=0)
    assert strict.verdict == "drop", strict


def test_lower_bound_matches_exact_test() -> None:
    # the Clopper-Pearson lower bound is > 0 exactly when the one-sided exact test rejects
    for b in range(0, 20):
        r = paired_drop(PairedTable(30, b, 20 - b if b <= 20 else 0, 30), max_drop_pts=0)
        assert (r.lower_pts > 0) == (r.p_one_sided < 0.05), r


def test_median_ratio_bootstrap_fixed_seed() -> None:
    rng = np.random.default_rng(1)
    x = 0.8 + 0.05 * rng.standard_normal(40)
    r1, r2 = median_ratio(x), median_ratio(x)
    assert r1 == r2
    assert r1.low <= r1.median <= r1.high
    assert r1.median == pytest.approx(float(np.median(x)))
    assert r1.below(1.0) and not r1.above(1.0)
    const = median_ratio([1.0] * 5)
    assert (const.low, const.median, const.high) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        median_ratio([])


def test_ab_verdict_paths() -> None:
    ok_acc = paired_drop(*_outcomes(200, 0, 0, 200))
    bad_acc = paired_drop(*_outcomes(160, 80, 0, 160))
    faster = median_ratio([0.7, 0.72, 0.69, 0.75, 0.71, 0.7, 0.73, 0.68])
    slower = median_ratio([1.3, 1.25, 1.31, 1.28, 1.27, 1.35, 1.29, 1.3])
    straddle = median_ratio([0.8, 1.2, 0.9, 1.1, 1.0, 0.85, 1.15, 1.05])
    assert ab_verdict(ok_acc, faster).passes
    v = ab_verdict(ok_acc, slower)
    assert not v.passes and "SLOWER" in v.reasons[1], v.reasons
    v = ab_verdict(ok_acc, straddle)
    assert not v.passes and "straddles" in v.reasons[1], v.reasons
    v = ab_verdict(bad_acc, faster)
    assert not v.passes and "DROP" in v.reasons[0], v.reasons
    assert v.to_dict()["verdict"] == "FAIL"
