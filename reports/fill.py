"""Forwards saved and wasted samples of token fast-forwarding, per tier (§7.3).

Each fill case is PAIRED with decoding its own output one token per forward:
that costs one forward per sample (``generation_tokens``, the stopping EOS
included; at temperature 0 the identity gate makes this plain decode's count,
at temperature > 0 the fill draw differs from the plain one, so the pair is
the fill output with and without fill); the fill run's forwards are counted by
the fill loop (one per sample, one per append). Per (tier, syntax, temperature) cell the table gives the summed
forwards, the forwards saved, and the mean saved per case with the 95 % interval
of the paired t-test (``scipy.stats.ttest_rel(...).confidence_interval``;
a degenerate interval when every pair differs by the same amount), plus the
wasted samples (in-flight samples an assert append dropped) and the verify
accounting. Counts only: no wall clock is compared here (``specparity bench``
times things).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

COLUMNS = ["tier", "syntax", "temp", "cases", "verdicts", "1-token fwd", "fill fwd", "saved", "saved %",
           "saved/case (95% CI)", "appends", "injected", "wasted samples", "verify kept/rewound/free"]


def paired_interval(plain: list[int], filled: list[int], alpha: float = 0.05) -> tuple[float, float, float]:
    """``(mean, low, high)`` of the per-case forwards saved ``plain - filled`` (paired t)."""
    from scipy.stats import ttest_rel

    d = [p - f for p, f in zip(plain, filled, strict=True)]
    mean = sum(d) / len(d) if d else math.nan
    if len(d) < 2 or len(set(d)) == 1:
        return mean, mean, mean
    ci = ttest_rel(plain, filled).confidence_interval(confidence_level=1 - alpha)
    return mean, float(ci.low), float(ci.high)


def forwards_table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per (tier, syntax, temperature) over ``zoo.fill.run_case`` results."""
    out = []
    keys = sorted({(r["tier"], r["syntax"], r["temperature"]) for r in rows})
    for tier, syntax, temp in keys:
        cell = [r for r in rows if (r["tier"], r["syntax"], r["temperature"]) == (tier, syntax, temp)]
        verdicts = {v: sum(r["verdict"] == v for r in cell) for v in dict.fromkeys(r["verdict"] for r in cell)}
        plain = [int(r["fill_tokens"]) for r in cell]
        filled = [int(r["fill_forwards"]) for r in cell]
        mean, lo, hi = paired_interval(plain, filled)
        st = [r["stats"] for r in cell]
        saved = sum(plain) - sum(filled)
        out.append({
            "tier": tier, "syntax": syntax, "temp": temp, "cases": len(cell),
            "verdicts": ", ".join(f"{n} {v}" for v, n in verdicts.items()),
            "1-token fwd": sum(plain), "fill fwd": sum(filled), "saved": saved,
            "saved %": round(100 * saved / sum(plain), 1) if sum(plain) else 0.0,
            "saved/case (95% CI)": f"{mean:.2f} [{lo:.2f}, {hi:.2f}]",
            "appends": sum(s["appends"] for s in st), "injected": sum(s["injected"] for s in st),
            "wasted samples": sum(s["wasted_samples"] for s in st),
            "verify kept/rewound/free": f"{sum(s['verify_accepted'] for s in st)}/"
                                        f"{sum(s['verify_rejected'] for s in st)}/"
                                        f"{sum(s['verify_first_rejected'] for s in st)}",
        })
    return pd.DataFrame(out, columns=COLUMNS)


def fill_section(rows: list[dict[str, Any]]) -> str:
    """The run summary's fill section (Markdown)."""
    lines = ["", "## Token fast-forwarding (fill, §7)", "",
             "Each fill case is paired with plain decode of the same request on the zoo fill models "
             "(`zoo/fill.py`). Temperature 0: token identity is required (id containment); "
             "temperature > 0: an assert fill is the behaviour-policy deviation §7 names, not compared. "
             "Forwards saved = forwards one-token-per-forward decoding of the same output needs "
             "(plain decode's, at temperature 0) - fill forwards; interval: paired t, 95 %. "
             "Verify: ids kept / span positions forwarded then rewound / position-0 rejections "
             "(free).", ""]
    if not rows:
        return "\n".join([*lines, "_no fill cases_", ""])
    lines.append(forwards_table(rows).to_markdown(index=False))
    bad = [r for r in rows if r["verdict"] == "divergent"]
    for r in bad[:10]:
        lines += ["", f"- `{r['case_id']}`: {r['message']}"]
    return "\n".join(lines) + "\n"
