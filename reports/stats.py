"""Paired statistics for A/B verdicts (reference §4.5 phase 1c and §7.3).

Two instruments, both from scipy/statsmodels:

- :func:`paired_drop` — "does acceptance not drop?" on paired binary outcomes.
  McNemar's test is ``statsmodels.stats.contingency_tables.mcnemar`` (exact
  binomial when the discordant count ``b + c < 25``, else the chi-square with
  continuity correction). The one-sided 95 % bounds on the drop
  ``p_A - p_B = (b - c) / n`` are **exact Clopper-Pearson bounds on the
  discordant pairs, conditional on their number** ``m = b + c``: given ``m``,
  ``b ~ Binomial(m, pi)`` and the drop is ``(m / n)(2 pi - 1)``; the one-sided
  95 % upper (lower) bound of ``pi`` from ``scipy.stats.binomtest(b, m)
  .proportion_ci(0.90, "exact")`` maps to the upper (lower) bound of the drop.
  With ``m = 0`` the drop is 0 and both bounds are 0. The one-sided p is the
  upper tail ``P(X >= b)`` under ``pi = 1/2`` (exact binomial, or its
  continuity-corrected normal approximation from ``b + c >= 25`` on), so a
  table with one-sided p in (alpha/2, alpha) is a drop although the two-sided
  test does not reject. The lower bound exceeds 0 exactly when the one-sided
  exact McNemar test rejects at ``alpha``.
- :func:`median_ratio` — the median of paired ratios with a two-sided 95 %
  percentile bootstrap interval (``scipy.stats.bootstrap``, 9999 resamples,
  fixed seed).

Verdicts (§7.3: "a tie or a swing inside the noise passes and a real
regression does not"):

- ``drop`` — the one-sided McNemar test rejects "no drop" at ``alpha`` AND the
  lower bound of the drop exceeds ``max_drop`` points: a real regression
  beyond the allowance.
- ``no drop`` — otherwise. ``resolved`` says whether the upper bound is within
  ``max_drop`` (the data rule a larger drop out); an unresolved ``no drop`` is
  a swing inside the noise, and the note says that ``n`` is too small for the
  bound to resolve ``max_drop``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

ALPHA = 0.05
EXACT_BELOW = 25  # discordant pairs; statsmodels' exact binomial below this
BOOTSTRAP_RESAMPLES = 9999
BOOTSTRAP_SEED = 20260707
BOOTSTRAP_CONFIDENCE = 0.95


@dataclass(frozen=True)
class PairedTable:
    """2x2 paired counts: ``a`` both yes, ``b`` A yes B no, ``c`` A no B yes, ``d`` both no."""

    a: int
    b: int
    c: int
    d: int

    @classmethod
    def from_outcomes(cls, outcome_a: Sequence[bool], outcome_b: Sequence[bool]) -> PairedTable:
        if len(outcome_a) != len(outcome_b):
            raise ValueError(f"paired outcomes differ in length: {len(outcome_a)} vs {len(outcome_b)}")
        xa = np.asarray(outcome_a, dtype=bool)
        xb = np.asarray(outcome_b, dtype=bool)
        return cls(int(np.sum(xa & xb)), int(np.sum(xa & ~xb)), int(np.sum(~xa & xb)),
                   int(np.sum(~xa & ~xb)))

    @property
    def n(self) -> int:
        return self.a + self.b + self.c + self.d

    def matrix(self) -> list[list[int]]:
        return [[self.a, self.b], [self.c, self.d]]


@dataclass(frozen=True)
class DropResult:
    """The paired acceptance verdict with everything needed to reproduce it."""

    table: PairedTable
    n: int
    rate_a: float
    rate_b: float
    drop_pts: float  # 100 * (p_A - p_B)
    lower_pts: float  # one-sided (1 - alpha) lower bound of the drop
    upper_pts: float  # one-sided (1 - alpha) upper bound of the drop
    test: str  # "exact binomial" | "chi-square (continuity-corrected)"
    statistic: float
    p_two_sided: float
    p_one_sided: float  # H1: A > B (a drop)
    max_drop_pts: float
    alpha: float
    verdict: str  # "no drop" | "drop"
    resolved: bool
    note: str
    method: str = (
        "McNemar (statsmodels, exact binomial when b+c<25); one-sided bounds: exact "
        "Clopper-Pearson on discordant pairs, conditional on b+c"
    )

    @property
    def passes(self) -> bool:
        return self.verdict == "no drop"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["table"] = asdict(self.table)
        return out


def _pi_bounds(b: int, m: int, alpha: float) -> tuple[float, float]:
    from scipy.stats import binomtest

    ci = binomtest(b, m, 0.5).proportion_ci(confidence_level=1 - 2 * alpha, method="exact")
    return float(ci.low), float(ci.high)


def _p_one_sided(b: int, c: int, exact: bool) -> float:
    """One-sided McNemar p for H1 "A > B" (a drop): ``P(X >= b)``, ``X ~ Binomial(b + c, 1/2)``.

    Exact: ``scipy.stats.binom.sf(b - 1, m, 1/2)``. Chi-square regime: the normal
    approximation with the same continuity correction as statsmodels' statistic,
    ``z = (b - c - 1) / sqrt(m)``. For ``b > c`` both are half of statsmodels'
    two-sided p; for ``b <= c`` halving it is wrong (the tail is not symmetric
    around the observed ``b``), so the tail is computed directly.
    """
    from scipy.stats import binom, norm

    m = b + c
    if m == 0:
        return 1.0
    if exact:
        return float(binom.sf(b - 1, m, 0.5))
    return float(norm.sf((b - c - 1) / np.sqrt(m)))


def paired_drop(
    outcome_a: Sequence[bool] | PairedTable,
    outcome_b: Sequence[bool] | None = None,
    *,
    max_drop_pts: float = 3.0,
    alpha: float = ALPHA,
) -> DropResult:
    """Does B's success rate drop below A's by more than ``max_drop_pts`` points?

    Args:
        outcome_a: Arm A's paired binary outcomes, or a ready :class:`PairedTable`.
        outcome_b: Arm B's outcomes, same units in the same order.
        max_drop_pts: The allowance, in percentage points.
        alpha: One-sided level (0.05: one-sided 95 % bounds).
    """
    from statsmodels.stats.contingency_tables import mcnemar

    if isinstance(outcome_a, PairedTable):
        table = outcome_a
    else:
        if outcome_b is None:
            raise ValueError("outcome_b is required with raw outcomes")
        table = PairedTable.from_outcomes(outcome_a, outcome_b)
    n = table.n
    if n == 0:
        raise ValueError("no paired outcomes")
    b, c = table.b, table.c
    m = b + c
    exact = m < EXACT_BELOW
    res = mcnemar(table.matrix(), exact=exact, correction=True)
    p_two = float(res.pvalue)
    p_one = _p_one_sided(b, c, exact)
    if m == 0:
        lo_pts = hi_pts = 0.0
    else:
        pi_lo, pi_hi = _pi_bounds(b, m, alpha)
        lo_pts = 100 * (m / n) * (2 * pi_lo - 1)
        hi_pts = 100 * (m / n) * (2 * pi_hi - 1)
    drop_pts = 100 * (b - c) / n
    rate_a = (table.a + b) / n
    rate_b = (table.a + c) / n
    if p_one < alpha and lo_pts > max_drop_pts:
        verdict, resolved = "drop", True
        note = (f"real regression: drop {drop_pts:.1f} pts, one-sided {100 * (1 - alpha):.0f}% "
                f"lower bound {lo_pts:.1f} > {max_drop_pts:g} pts (McNemar p={p_one:.3g})")
    elif hi_pts <= max_drop_pts:
        verdict, resolved = "no drop", True
        note = (f"drop {drop_pts:.1f} pts; one-sided {100 * (1 - alpha):.0f}% upper bound "
                f"{hi_pts:.1f} <= {max_drop_pts:g} pts")
    else:
        verdict, resolved = "no drop", False
        note = (f"inside the noise: drop {drop_pts:.1f} pts, bounds [{lo_pts:.1f}, {hi_pts:.1f}]; "
                f"n={n} is too small for the bound to resolve {max_drop_pts:g} pts "
                "(passes per §7.3; more prompts would settle it)")
    return DropResult(
        table=table, n=n, rate_a=rate_a, rate_b=rate_b, drop_pts=drop_pts,
        lower_pts=lo_pts, upper_pts=hi_pts,
        test="exact binomial" if exact else "chi-square (continuity-corrected)",
        statistic=float(res.statistic), p_two_sided=p_two, p_one_sided=p_one,
        max_drop_pts=max_drop_pts, alpha=alpha, verdict=verdict, resolved=resolved, note=note,
    )


@dataclass(frozen=True)
class RatioInterval:
    """Median of paired ratios with its bootstrap interval."""

    n: int
    median: float
    low: float
    high: float
    confidence: float
    method: str = "percentile bootstrap of the median (scipy.stats.bootstrap, 9999 resamples, fixed seed)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def below(self, value: float = 1.0) -> bool:
        """The whole interval lies strictly below ``value``."""
        return self.high < value

    def above(self, value: float = 1.0) -> bool:
        return self.low > value


def median_ratio(
    ratios: Sequence[float],
    *,
    confidence: float = BOOTSTRAP_CONFIDENCE,
    seed: int = BOOTSTRAP_SEED,
    n_resamples: int = BOOTSTRAP_RESAMPLES,
) -> RatioInterval:
    """Median of ``ratios`` with a two-sided percentile bootstrap interval."""
    from scipy.stats import bootstrap

    x = np.asarray(ratios, dtype=float)
    if x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError(f"ratios must be finite and non-empty, got {list(x)[:5]}")
    med = float(np.median(x))
    if x.size == 1 or np.all(x == x[0]):
        return RatioInterval(int(x.size), med, med, med, confidence)
    res = bootstrap((x,), np.median, confidence_level=confidence, n_resamples=n_resamples,
                    method="percentile", random_state=np.random.default_rng(seed))
    ci = res.confidence_interval
    return RatioInterval(int(x.size), med, float(ci.low), float(ci.high), confidence)


@dataclass(frozen=True)
class ABVerdict:
    """§4.5 phase 1c: acceptance drop <= max-drop AND wall clock strictly improves."""

    acceptance: DropResult
    wall: RatioInterval  # wall-time ratio B / A per prompt (< 1: B faster)
    passes: bool
    reasons: list[str]

    @property
    def label(self) -> str:
        return "PASS" if self.passes else "FAIL"

    @property
    def wall_clock(self) -> str:
        """``faster`` (whole interval below 1), ``slower`` (above 1) or ``straddles``."""
        if self.wall.below(1.0):
            return "faster"
        return "slower" if self.wall.above(1.0) else "straddles"

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.label, "passes": self.passes, "wall_clock": self.wall_clock,
                "reasons": self.reasons,
                "acceptance": self.acceptance.to_dict(), "wall_ratio_b_over_a": self.wall.to_dict()}


def ab_verdict(acceptance: DropResult, wall_ratio_b_over_a: RatioInterval) -> ABVerdict:
    """Combine the acceptance gate and the wall-clock gate (whole interval below 1)."""
    reasons = []
    if acceptance.passes:
        reasons.append(f"acceptance: no drop ({acceptance.note})")
    else:
        reasons.append(f"acceptance: DROP ({acceptance.note})")
    w = wall_ratio_b_over_a
    improves = w.below(1.0)
    span = f"median {w.median:.3f}, {100 * w.confidence:.0f}% CI [{w.low:.3f}, {w.high:.3f}]"
    if improves:
        reasons.append(f"wall clock: B strictly faster (time ratio B/A {span})")
    elif w.above(1.0):
        reasons.append(f"wall clock: B SLOWER (time ratio B/A {span})")
    else:
        reasons.append(f"wall clock: NOT strictly improved, interval straddles 1 ({span})")
    return ABVerdict(acceptance, w, acceptance.passes and improves, reasons)
