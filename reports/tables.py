"""pandas tables from the traces of a ``specparity run`` (``traces/INTERPRETING.md``).

- acceptance by draft position: ``accepted_by_pos[i] / drafted_by_pos[i]``
  summed over a (pair, γ) cell's cases (footer ``speculation``);
- acceptance-length histogram: rounds per ``k_accept`` (footer
  ``acceptance_lengths``);
- τ = tokens per target forward (``generation_tokens / target_calls``) and
  tok/s (``generation_tokens / wall_s``) per (pair, γ), with the speedup
  against the SAME target's plain decode (§4.4 denominator discipline).
  Trace wall times are recorded, never compared (INTERPRETING.md); on the tiny
  zoo they are indicative only — the paired figures come from ``ab``/``bench``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

CELL = ["target", "drafter", "gamma"]


@dataclass
class RunData:
    run_dir: Path
    traces: dict[tuple[str, str], Any]  # (runner, case_id) -> traces.io.Trace
    comparisons: list[dict[str, Any]]
    results: list[dict[str, Any]]  # ab.json / bench.json found under run_dir


def load_run(run_dir: Path) -> RunData:
    """Read ``RUN_DIR/traces/<runner>/*.jsonl``, ``comparisons.json`` and any A/B/bench JSON."""
    from traces.io import read_trace

    run_dir = Path(run_dir)
    tdir = run_dir / "traces"
    if not tdir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no traces/ directory (is this a `specparity run` output?)")
    traces: dict[tuple[str, str], Any] = {}
    for path in sorted(tdir.glob("*/*.jsonl")):
        tr = read_trace(path)
        traces[(path.parent.name, tr.header["case_id"])] = tr
    if not traces:
        raise FileNotFoundError(f"{tdir}: no traces found")
    cpath = run_dir / "comparisons.json"
    comparisons = json.loads(cpath.read_text()) if cpath.is_file() else []
    results = []
    for path in sorted([*run_dir.rglob("ab.json"), *run_dir.rglob("bench.json")]):
        data = json.loads(path.read_text())
        data["_path"] = str(path.relative_to(run_dir))
        results.append(data)
    return RunData(run_dir, traces, comparisons, results)


def cases_frame(traces: dict[tuple[str, str], Any]) -> pd.DataFrame:
    """One row per trace: runner, cell, prompt, tokens, forwards, counters, wall."""
    rows = []
    for (runner, case_id), tr in traces.items():
        h, f = tr.header, tr.footer
        spec = f.get("speculation") or {}
        parts = case_id.split("/")
        rows.append({
            "runner": runner, "case_id": case_id, "mode": h["mode"], "target": parts[0],
            "drafter": parts[1] if h["mode"] == "spec" else "plain",
            "gamma": int(h["params"]["gamma"] or 0), "prompt_id": h["prompt"]["id"],
            "tokens": int(f["usage"]["generation_tokens"]),
            "target_calls": int(spec.get("target_calls") or len(tr.plains)),
            "drafted": int(spec.get("drafted", 0)), "accepted": int(spec.get("accepted", 0)),
            "wall_s": float(f.get("wall_s") or 0.0),
        })
    return pd.DataFrame(rows)


def _spec_cells(traces: dict[tuple[str, str], Any], runner: str) -> Any:
    """``(target, drafter, gamma, speculation counters)`` of each speculative trace of ``runner``."""
    for (r, case_id), tr in traces.items():
        spec = tr.footer.get("speculation")
        if r != runner or tr.header["mode"] != "spec" or not spec:
            continue
        t, d = case_id.split("/")[:2]
        yield t, d, int(tr.header["params"]["gamma"]), spec


def acceptance_by_position(traces: dict[tuple[str, str], Any], runner: str = "engine") -> pd.DataFrame:
    rows = []
    for t, d, g, spec in _spec_cells(traces, runner):
        drafted, accepted = spec["drafted_by_pos"], spec["accepted_by_pos"]
        for i, n in enumerate(drafted):
            rows.append({"target": t, "drafter": d, "gamma": g, "position": i + 1, "drafted": n,
                         "accepted": accepted[i] if i < len(accepted) else 0})
    if not rows:
        return pd.DataFrame(columns=[*CELL, "position", "drafted", "accepted", "acceptance"])
    df = pd.DataFrame(rows).groupby([*CELL, "position"], as_index=False).sum()
    df["acceptance"] = (df["accepted"] / df["drafted"]).round(3)
    return df


def acceptance_lengths(traces: dict[tuple[str, str], Any], runner: str = "engine") -> pd.DataFrame:
    rows = []
    for t, d, g, spec in _spec_cells(traces, runner):
        for k in spec["acceptance_lengths"]:
            rows.append({"target": t, "drafter": d, "gamma": g, "k_accept": int(k)})
    if not rows:
        return pd.DataFrame(columns=[*CELL, "k_accept", "rounds", "share"])
    df = pd.DataFrame(rows).groupby([*CELL, "k_accept"]).size().reset_index(name="rounds")
    df["share"] = (df["rounds"] / df.groupby(CELL)["rounds"].transform("sum")).round(3)
    return df


def tau_table(traces: dict[tuple[str, str], Any], runner: str = "engine") -> pd.DataFrame:
    """Per (pair, γ): acceptance, τ, tok/s and the speedup vs the same target's plain decode."""
    cf = cases_frame(traces)
    cf = cf[cf["runner"] == runner]
    spec = cf[cf["mode"] == "spec"]
    cols = [*CELL, "cases", "drafted", "accepted", "acceptance", "tau", "tok_per_s",
            "plain_tok_per_s", "speedup_vs_plain"]
    if spec.empty:
        return pd.DataFrame(columns=cols)
    agg = spec.groupby(CELL, as_index=False).agg(
        cases=("case_id", "count"), drafted=("drafted", "sum"), accepted=("accepted", "sum"),
        tokens=("tokens", "sum"), target_calls=("target_calls", "sum"), wall_s=("wall_s", "sum"))
    agg["acceptance"] = (agg["accepted"] / agg["drafted"]).round(3)
    agg["tau"] = (agg["tokens"] / agg["target_calls"]).round(3)
    agg["tok_per_s"] = (agg["tokens"] / agg["wall_s"]).round(1)
    plain = cf[cf["mode"] == "plain"].groupby("target").agg(tokens=("tokens", "sum"),
                                                            wall_s=("wall_s", "sum"))
    plain_rate = (plain["tokens"] / plain["wall_s"]).round(1)
    agg["plain_tok_per_s"] = agg["target"].map(plain_rate)
    agg["speedup_vs_plain"] = (agg["tok_per_s"] / agg["plain_tok_per_s"]).round(3)
    return agg[cols]


def verdict_table(comparisons: list[dict[str, Any]]) -> pd.DataFrame:
    if not comparisons:
        return pd.DataFrame(columns=["comparison", "verdict", "cases", "failing"])
    df = pd.DataFrame(comparisons)
    return (df.groupby(["kind", "verdict"], as_index=False)
            .agg(cases=("case_id", "count"), failing=("fails", "sum"))
            .rename(columns={"kind": "comparison"}))


def ratio_table(results: list[dict[str, Any]]) -> pd.DataFrame:
    """Every paired ratio interval found in A/B and bench results."""
    rows = []
    for res in results:
        for name, iv in res.get("ratios", {}).items():
            rows.append({"source": res["_path"], "ratio": name, "n": iv["n"],
                         "median": round(iv["median"], 3), "low": round(iv["low"], 3),
                         "high": round(iv["high"], 3),
                         "confidence": iv["confidence"]})
    return pd.DataFrame(rows, columns=["source", "ratio", "n", "median", "low", "high", "confidence"])
