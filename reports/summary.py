"""The Markdown summary of a ``specparity run``: pairs, acceptance, τ, verdicts.

τ is tokens per target forward: ``generation_tokens / target_calls`` summed
over the cases of a (pair, γ) cell. Tables are pandas DataFrames rendered
with ``DataFrame.to_markdown``.
"""

from __future__ import annotations

from typing import Any

import pandas as pd


def acceptance_table(traces: dict[tuple[str, str], Any], runner: str = "engine") -> pd.DataFrame:
    rows = []
    for (r, _case_id), tr in traces.items():
        spec = tr.footer.get("speculation") if tr.footer else None
        if r != runner or tr.header["mode"] != "spec" or not spec:
            continue
        target = tr.header["case_id"].split("/")
        rows.append({
            "target": target[0], "drafter": target[1], "gamma": tr.header["params"]["gamma"],
            "drafted": spec["drafted"], "accepted": spec["accepted"],
            "target_calls": spec["target_calls"],
            "tokens": tr.footer["usage"]["generation_tokens"],
            "wall_s": tr.footer.get("wall_s") or 0.0,
        })
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows).groupby(["target", "drafter", "gamma"], as_index=False).sum()
    df["acceptance"] = (df["accepted"] / df["drafted"]).round(3)
    df["tau"] = (df["tokens"] / df["target_calls"]).round(3)
    df["tok_per_s"] = (df["tokens"] / df["wall_s"]).round(1)
    return df[["target", "drafter", "gamma", "drafted", "accepted", "acceptance", "tau", "tok_per_s"]]


def verdict_table(comparisons: list[Any]) -> pd.DataFrame:
    df = pd.DataFrame([{"comparison": c.kind, "verdict": c.verdict} for c in comparisons])
    if df.empty:
        return df
    return df.groupby(["comparison", "verdict"]).size().reset_index(name="cases")


def write_summary(result: Any, traces: dict[tuple[str, str], Any]) -> str:
    """Write ``summary.md`` into the run directory and return its text."""
    lines = ["# specparity run", ""]
    status = "CONFORMS" if result.ok else "DIVERGES"
    lines += [f"**{status}** — runners: {', '.join(result.runners)}; "
              f"{len(result.comparisons)} comparisons; wall {result.wall_s:.1f} s", ""]
    for name, why in sorted(result.unavailable.items()):
        lines.append(f"- oracle `{name}` unavailable: {why}")
    lines += ["", "## Identity verdicts", "",
              "Engine vs each oracle is compared round for round; engine speculative vs "
              "engine plain at the token level (`numerics` = first flip on a knife-edge, "
              "reported, not failed).", ""]
    vt = verdict_table(result.comparisons)
    lines.append(vt.to_markdown(index=False) if not vt.empty else "_no comparisons_")
    failing = [c for c in result.comparisons if c.fails]
    if failing:
        lines += ["", "## Divergences (failing)", ""]
        for c in failing[:20]:
            lines += [f"### {c.kind} — `{c.case_id}` ({c.verdict})", "", "```",
                      c.message or "", "```", ""]
        if len(failing) > 20:
            lines.append(f"... and {len(failing) - 20} more (see comparisons.json)")
    known = sorted({c.known for c in result.comparisons if c.known})
    if known:
        from traces.reference import known_entries

        entries = {e.id: e for e in known_entries()}
        lines += ["", "## Known reference behaviour (traces/known_divergences.toml)", ""]
        for kid in known:
            n = sum(1 for c in result.comparisons if c.known == kid)
            e = entries.get(kid)
            lines += [f"- **{kid}** — {n} case(s). {e.reason.splitlines()[0] if e else ''}",
                      f"  Reproduce: `{e.reproduce if e else '?'}`"]
    noted = [c for c in result.comparisons if c.divergence is not None and not c.fails and not c.known]
    if noted:
        lines += ["", "## Numerics flips (reported, not failed)", ""]
        for c in noted[:10]:
            lines += [f"### {c.kind} — `{c.case_id}`", "", "```", c.message or "", "```", ""]
    lines += ["", "## Acceptance and τ (engine, greedy)", ""]
    at = acceptance_table(traces)
    lines.append(at.to_markdown(index=False) if not at.empty else "_no speculative cases_")
    text = "\n".join(lines) + "\n"
    out = result.out_dir / "summary.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(out)
    return text
