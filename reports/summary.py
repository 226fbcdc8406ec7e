"""The Markdown summary of a ``specparity run``: pairs, acceptance, τ, verdicts.

τ is tokens per target forward: ``generation_tokens / target_calls`` summed
over the cases of a (pair, γ) cell. The tables are ``reports.tables``'
DataFrames (the same ones the full report uses), rendered with
``DataFrame.to_markdown``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from reports import md
from reports.tables import tau_table, verdict_table
from traces.io import atomic_write_text


def write_summary(result: Any, traces: dict[tuple[str, str], Any],
                  track: Callable[[Path], Any] | None = None) -> str:
    """Write ``summary.md`` into the run directory and return its text.

    The verdict: a run writes it last, after its traces, ``comparisons.json``
    and report are on disk (``specparity.jobs.run.finish``); ``track`` registers the
    file with the output directory before it is written.
    """
    lines = ["# specparity run", ""]
    rows = [{"case_id": c.case_id, "kind": c.kind, "verdict": c.verdict, "fails": c.fails,
             "message": c.message, "unsupported": getattr(c, "unsupported", None)}
            for c in result.comparisons]
    status = headline(rows, failing=any(e["fails"] for e in rows))
    lines += [f"**{md.text(status)}** — runners: {', '.join(result.runners)}; "
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
    lines += unsupported_section(rows)
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
    if track is not None:
        track(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    return text


def _unsupported(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in entries if isinstance(e.get("unsupported"), dict)]


def nothing_compared(entries: list[dict[str, Any]]) -> bool:
    """Some comparison is unsupported on the backend and none was made (each one unsupported
    or ``not compared``): a run that must not read CONFORMS."""
    return bool(_unsupported(entries)) and all(
        isinstance(e.get("unsupported"), dict) or e.get("verdict") == "not compared" for e in entries)


def unsupported_note(entries: list[dict[str, Any]]) -> str:
    """``3 cases unsupported on Device(gpu, 0)`` (distinct case ids, per device), or ``""``."""
    by_device: dict[str, set[str]] = {}
    for e in _unsupported(entries):
        by_device.setdefault(str(e["unsupported"].get("device", "?")), set()).add(str(e["case_id"]))
    return "; ".join(f"{len(ids)} case{'s' if len(ids) != 1 else ''} unsupported on {dev}"
                     for dev, ids in sorted(by_device.items()))


def headline(entries: list[dict[str, Any]], *, failing: bool) -> str:
    """The verdict word of a run's comparisons (``entries``: ``comparisons.json`` objects):
    ``CONFORMS``, ``DIVERGES`` or ``NOTHING COMPARED``, naming the unsupported cases, e.g.
    ``CONFORMS (3 cases unsupported on Device(gpu, 0))`` -- never a bare CONFORMS hiding them."""
    note = unsupported_note(entries)
    if nothing_compared(entries):
        return f"NOTHING COMPARED (every comparison unsupported on this backend: {note})"
    word = "DIVERGES" if failing else "CONFORMS"
    return f"{word} ({note})" if note else word


def unsupported_section(entries: list[dict[str, Any]]) -> list[str]:
    """The summary's "Unsupported on this backend" section: every (runner, case) the backend
    could not run, with MLX's error line; empty when there is none."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for e in _unsupported(entries):
        u = e["unsupported"]
        for runner in u.get("runners") or [u.get("runner", "?")]:
            rows.setdefault((str(e["case_id"]), str(runner)), u)
    if not rows:
        return []
    lines = ["", "## Unsupported on this backend", "",
             "The backend lacks an op these runs need (`engine/backend.py`): each is that case's "
             "verdict, not a finding, and every comparison that needs its trace reads "
             "`unsupported` (neither failed nor identical). Other backends may run them "
             "(docs/backends.md, \"Unsupported on this backend\").", ""]
    for (case_id, runner), u in sorted(rows.items()):
        lines.append(f"- {md.code(case_id)} ({md.text(runner)}): {md.code(u.get('verdict', '?'))} — "
                     f"{md.code(u.get('line', ''))}")
    return lines


def incomplete_summary(why: str, kept: list[str]) -> str:
    """The ``summary.md`` of a run that did not finish: INCOMPLETE, why, what is on disk."""
    lines = ["# specparity run", "",
             f"**INCOMPLETE** — {md.text(why)}; not a conformance verdict.", ""]
    lines += [f"- kept: {md.text(k)}" for k in kept] or ["- nothing else was written"]
    lines += ["", "`specparity report DIR` builds a report from what is here (it says INCOMPLETE); "
              "run again for a verdict."]
    return "\n".join(lines) + "\n"
