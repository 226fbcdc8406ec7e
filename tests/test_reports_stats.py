"""``reports.stats``: McNemar on known tables, the drop bound, the bootstrap and both verdicts."""

from __future__ import annotations

from math import comb, erfc, sqrt

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
    v = ab_verdict(ok_acc, faster)
    assert (v.label, v.wall_clock) == ("PASS", "faster"), v.reasons
    v = ab_verdict(ok_acc, slower)
    assert (v.label, v.wall_clock) == ("FAIL", "slower") and "SLOWER" in v.reasons[1], v.reasons
    v = ab_verdict(ok_acc, straddle)
    assert (v.label, v.wall_clock) == ("FAIL", "straddles") and "straddles" in v.reasons[1], v.reasons
    v = ab_verdict(bad_acc, faster)
    assert (v.label, v.wall_clock, v.acceptance.verdict) == ("FAIL", "faster", "drop"), v.reasons
    assert "DROP" in v.reasons[0], v.reasons
    assert v.to_dict()["verdict"] == "FAIL" and v.to_dict()["wall_clock"] == "faster"


def test_ab_verdict_median_below_one_interval_straddling_one_is_fail() -> None:
    """Median 0.87 and mean 0.89 below 1, 5 of 8 ratios below 1, interval [0.70, 1.10]: a gate on
    the median, the mean, the lower bound or the majority says PASS; the whole interval must lie
    below 1 (§4.5), so the verdict is FAIL, "straddles"."""
    ok_acc = paired_drop(*_outcomes(200, 0, 0, 200))
    w = median_ratio([0.62, 0.7, 0.78, 0.84, 0.9, 1.04, 1.1, 1.16])
    assert w.median < 1 and w.low < 1 < w.high and not w.below(1.0) and not w.above(1.0), w
    v = ab_verdict(ok_acc, w)
    assert (v.passes, v.label, v.wall_clock) == (False, "FAIL", "straddles"), v.reasons


# ------------------------------------------- one-sided vs two-sided at the boundary
#
# Tables where a one-sided 95 % answer and a two-sided (or 97.5 %) answer differ,
# derived by hand: binomial tails written out as sums, Clopper-Pearson bounds as the
# root of such a sum (bisection), the chi-square regime's tail as the continuity-
# corrected normal tail. ``paired_drop`` promises one-sided 95 % decisions.


def _upper_tail(b: int, m: int, p: float) -> float:
    """P(X >= b), X ~ Binomial(m, p), written out."""
    return sum(comb(m, k) * p**k * (1 - p) ** (m - k) for k in range(b, m + 1))


def _lower_tail(b: int, m: int, p: float) -> float:
    """P(X <= b), X ~ Binomial(m, p), written out."""
    return sum(comb(m, k) * p**k * (1 - p) ** (m - k) for k in range(b + 1))


def _root(f, target: float) -> float:  # f increasing in p on [0, 1]
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def _drop_bounds(t: PairedTable, level: float) -> tuple[float, float]:
    """One-sided ``level`` Clopper-Pearson bounds on the drop, in points."""
    m = t.b + t.c
    pi_lo = _root(lambda p: _upper_tail(t.b, m, p), 1 - level)  # P(X >= b | pi_lo) = 1 - level
    pi_hi = _root(lambda p: -_lower_tail(t.b, m, p), -(1 - level))  # P(X <= b | pi_hi) = 1 - level
    return 100 * m / t.n * (2 * pi_lo - 1), 100 * m / t.n * (2 * pi_hi - 1)


# (table, max_drop, expected verdict, expected resolved, hand one-sided p, why it is a boundary case)
BOUNDARY = [
    # m = 11 < 25 (exact): P(X >= 9) = (C(11,9)+C(11,10)+C(11,11)) / 2^11 = 67/2048 = 0.0327:
    # one-sided rejects, two-sided (0.0654) does not; 95 % lower bound +0.66 > 0, 97.5 % -0.39.
    (PairedTable(40, 9, 2, 49), 0.0, "drop", True, 67 / 2048, "one-sided p in (0.025, 0.05)"),
    # m = 22: very significant, but the lower bound moves across the 10-point allowance
    # with its level: 95 % one-sided 10.58 > 10, 97.5 % one-sided 9.17 < 10.
    (PairedTable(30, 20, 2, 48), 10.0, "drop", True,
     sum(comb(22, k) for k in range(20, 23)) / 2**22, "lower bound crosses the allowance"),
    # mirror image: an improvement whose 95 % upper bound (-0.66) is inside a 0-point
    # allowance and whose 97.5 % upper bound (+0.39) is not: resolved only one-sided.
    # One-sided p = P(X >= 2) = 1 - (1 + 11) / 2^11 (not 1 - two-sided/2 = 1 - 67/2048).
    (PairedTable(40, 2, 9, 49), 0.0, "no drop", True, 1 - 12 / 2048, "upper bound crosses the allowance"),
    # m = 40 >= 25 (chi-square, continuity-corrected): z = (26 - 14 - 1) / sqrt(40),
    # one-sided p = 0.041, two-sided 0.082; exact 95 % lower bound +0.10 > 0, 97.5 % -0.21.
    (PairedTable(300, 26, 14, 300), 0.0, "drop", True, 0.5 * erfc(11 / sqrt(40) / sqrt(2)),
     "chi-square regime, one-sided p in (0.025, 0.05)"),
    # same table, allowance 3.5: 95 % upper bound 3.43 <= 3.5 resolves it, 97.5 % (3.67) would not.
    (PairedTable(300, 26, 14, 300), 3.5, "no drop", True, 0.5 * erfc(11 / sqrt(40) / sqrt(2)),
     "chi-square regime, upper bound crosses the allowance"),
    # a tie: P(X >= 3 | Binomial(6, 1/2)) = (20 + 15 + 6 + 1) / 64 (not 1/2)
    (PairedTable(30, 3, 3, 30), 0.0, "no drop", False, 42 / 64, "tie: one-sided p is the upper tail"),
]


def _boundary_failures() -> list[str]:
    """Every way ``paired_drop`` breaks its one-sided promise on the boundary tables."""
    bad: list[str] = []
    for t, allowance, verdict, resolved, p_hand, why in BOUNDARY:
        r = paired_drop(t, max_drop_pts=allowance)
        lo, hi = _drop_bounds(t, 0.95)
        got = (r.verdict, r.resolved)
        if got != (verdict, resolved):
            bad.append(f"{t} max_drop={allowance} ({why}): verdict {got}, promised {(verdict, resolved)}")
        if abs(r.p_one_sided - p_hand) > 1e-9:
            bad.append(f"{t} ({why}): one-sided p {r.p_one_sided:.6g}, hand-derived {p_hand:.6g}")
        if abs(r.lower_pts - lo) > 1e-6 or abs(r.upper_pts - hi) > 1e-6:
            bad.append(f"{t} ({why}): bounds [{r.lower_pts:.4f}, {r.upper_pts:.4f}], "
                       f"hand one-sided 95 % [{lo:.4f}, {hi:.4f}]")
    return bad


def test_boundary_tables_are_hand_derived_boundaries() -> None:
    """The tables really are boundary cases: the two-sided / 97.5 % answer differs."""
    for t, allowance, verdict, resolved, p_hand, why in BOUNDARY:
        lo95, hi95 = _drop_bounds(t, 0.95)
        lo975, hi975 = _drop_bounds(t, 0.975)
        one = _verdict(p_hand < 0.05 and lo95 > allowance, hi95 <= allowance)
        two = _verdict(2 * p_hand < 0.05 and lo975 > allowance, hi975 <= allowance)
        assert one == (verdict, resolved), (t, why, one)
        assert one != two or "tie" in why, (t, why, one, two)


def _verdict(drop: bool, upper_inside: bool) -> tuple[str, bool]:
    return ("drop", True) if drop else ("no drop", upper_inside)


def test_one_sided_verdicts_at_the_boundary() -> None:
    bad = _boundary_failures()
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("plant", ["two-sided bounds", "two-sided p", "halved two-sided p"])
def test_planted_two_sided_statistics_are_caught(plant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the bounds at a two-sided 95 % level (one-sided 97.5 %), the verdict on the
    two-sided p, or the old one-sided p (half the two-sided p, wrong for b <= c)."""
    import reports.stats as stats

    real_bounds, real_p = stats._pi_bounds, stats._p_one_sided
    if plant == "two-sided bounds":
        monkeypatch.setattr(stats, "_pi_bounds", lambda b, m, alpha: real_bounds(b, m, alpha / 2))
    elif plant == "two-sided p":
        monkeypatch.setattr(stats, "_p_one_sided", lambda b, c, exact: min(1.0, 2 * real_p(b, c, exact))
                            if b > c else real_p(b, c, exact))
    else:
        def halved(b: int, c: int, exact: bool) -> float:
            p_two = min(1.0, 2 * min(real_p(b, c, exact), real_p(c, b, exact)))
            return p_two / 2 if b > c else 1 - p_two / 2
        monkeypatch.setattr(stats, "_p_one_sided", halved)
    bad = _boundary_failures()
    assert bad, f"planted {plant!r} passed every boundary table"
