"""matplotlib PNG plots (Agg backend) of the report tables; each returns PNG bytes."""

from __future__ import annotations

import io
import math
from typing import Any

import pandas as pd


def _plt():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:  # type: ignore[no-untyped-def]
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def _grid(n: int, width: float = 3.6, height: float = 2.8):  # type: ignore[no-untyped-def]
    plt = _plt()
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False,
                             constrained_layout=True)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _pair_panels(df: pd.DataFrame) -> tuple[Any, list[tuple[Any, pd.DataFrame]]]:
    """One titled panel per (target, drafter) pair, with that pair's rows."""
    pairs = list(df.groupby(["target", "drafter"]).groups)
    fig, axes = _grid(len(pairs))
    panels = []
    for ax, (t, d) in zip(axes, pairs, strict=False):
        ax.set_title(f"{t} / {d}", fontsize=10)
        panels.append((ax, df[(df["target"] == t) & (df["drafter"] == d)]))
    return fig, panels


def acceptance_by_position(df: pd.DataFrame) -> bytes | None:
    if df.empty:
        return None
    fig, panels = _pair_panels(df)
    for ax, sub in panels:
        for g, gd in sub.groupby("gamma"):
            ax.plot(gd["position"], gd["acceptance"], marker="o", label=f"γ={g}")
        ax.set_ylim(-0.05, 1.05)
        # ticks at the positions present: a tick per value up to the max would allocate
        # proportionally to a (hostile) header's γ, not to the data
        ax.set_xticks(sorted(int(x) for x in sub["position"].unique()))
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _png(fig)


def acceptance_lengths(df: pd.DataFrame) -> bytes | None:
    if df.empty:
        return None
    fig, panels = _pair_panels(df)
    for ax, sub in panels:
        gammas = sorted(sub["gamma"].unique())
        width = 0.8 / len(gammas)
        for j, g in enumerate(gammas):
            gd = sub[sub["gamma"] == g]
            ax.bar(gd["k_accept"] + (j - (len(gammas) - 1) / 2) * width, gd["share"], width,
                   label=f"γ={g}")
        ax.set_xticks(sorted({0, *(int(k) for k in sub["k_accept"].unique()), *map(int, gammas)}))
        ax.set_xlim(-0.6, int(max(gammas)) + 0.6)
        ax.set_xlabel("accepted drafts per round (k)")
        ax.set_ylabel("share of rounds")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    return _png(fig)


def tau_by_gamma(df: pd.DataFrame) -> bytes | None:
    """τ per γ, one line per (target, drafter); no timings (see ``reports.tables``)."""
    if df.empty:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6), constrained_layout=True)
    for (t, d), sub in df.groupby(["target", "drafter"]):
        ax.plot(sub["gamma"], sub["tau"], marker="o", label=f"{t}/{d}")
    ax.set_title("τ (tokens per target forward)")
    ax.set_xlabel("γ")
    ax.grid(alpha=0.3)
    ax.set_xticks(sorted(df["gamma"].unique()))
    ax.legend(fontsize=7)
    return _png(fig)


def ratio_intervals(df: pd.DataFrame) -> bytes | None:
    if df.empty:
        return None
    plt = _plt()
    labels = [f"{r.ratio}\n({r.source})" for r in df.itertuples()]
    fig, ax = plt.subplots(figsize=(8, 0.7 * len(df) + 1.2))
    y = list(range(len(df)))
    ax.errorbar(df["median"], y, xerr=[df["median"] - df["low"], df["high"] - df["median"]],
                fmt="o", capsize=4)
    ax.axvline(1.0, color="grey", ls="--", lw=1)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("median paired ratio with bootstrap interval (1 = no difference)")
    ax.grid(alpha=0.3, axis="x")
    ax.set_title("Paired ratio intervals")
    return _png(fig)
