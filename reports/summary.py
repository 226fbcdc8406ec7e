"""The Markdown summary of a ``specparity run``: pairs, acceptance, τ, verdicts.

τ is tokens per target forward: ``generation_tokens / target_calls`` summed
over the cases of a (pair, γ) cell. The tables are ``reports.tables``'
DataFrames (the same ones the full report uses), rendered with
``DataFrame.to_markdown``.
"""

from __future__ import annotations

from typing import Any

from reports import md
from reports.tables import tau_table, verdict_table
from traces.io import atomic_write_text


def write_summary(result: Any, traces: dict[tuple[str, str], Any]) -> str:
    """Write ``summary.md`` into the run directory and return its text."""
    lines = ["# specparity run", ""]
    status = "CONFORMS" if result.ok else "DIVERGES"
    lines += [f"**{status}** — runners: {', '.join(result.runners)}; "
              f"{len(result.comparisons)} comparisons; wall {result.wall_s:.1f} s", ""]
    for name, why in sorted(result.unavailable.items()):
        lines.append(f"- oracle {md.code(name)} unavailable: {md.text(why)}")
    for name, why in sorted(getattr(result, "skipped", {}).items()):  # cases it does not implement
        lines.append(f"- oracle {md.code(name)}: {md.text(why)}")
    lines += ["", "## Identity verdicts", "",
              "Engine vs each oracle is compared round for round; engine speculative vs "
              "engine plain at the token level (`numerics` = first flip on a knife-edge, "
              "reported, not failed).", ""]
    vt = verdict_table([{"kind": c.kind, "verdict": c.verdict, "case_id": c.case_id, "fails": c.fails}
                        for c in result.comparisons])
    lines.append(md.frame(vt).to_markdown(index=False) if not vt.empty else "_no comparisons_")
    failing = [c for c in result.comparisons if c.fails]
    if failing:
        lines += ["", "## Divergences (failing)", ""]
        for c in failing[:20]:
            lines += [f"### {md.text(c.kind)} — {md.code(c.case_id)} ({md.text(c.verdict)})", "",
                      md.fenced(c.message or ""), ""]
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
            lines += [f"- **{md.text(kid)}** — {n} case(s). {md.text(e.reason.splitlines()[0]) if e else ''}",
                      f"  Reproduce: {md.code(e.reproduce if e else '?')}"]
    noted = [c for c in result.comparisons if c.divergence is not None and not c.fails and not c.known]
    if noted:
        lines += ["", "## Numerics flips (reported, not failed)", ""]
        for c in noted[:10]:
            lines += [f"### {md.text(c.kind)} — {md.code(c.case_id)}", "", md.fenced(c.message or ""), ""]
    lines += ["", "## Acceptance and τ (engine)", ""]
    at = tau_table(traces)
    lines.append(md.frame(at).to_markdown(index=False) if not at.empty else "_no speculative cases_")
    lines += ["", "Timings: `specparity bench` (paired, interleaved); single trace wall times "
              "are not compared."]
    text = "\n".join(lines) + "\n"
    out = result.out_dir / "summary.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    return text
