"""``specparity report RUN_DIR``: Markdown + self-contained HTML from a run's traces.

Reads ``RUN_DIR/traces/<runner>/*.jsonl`` (``traces.io.read_trace``),
``RUN_DIR/comparisons.json`` and every ``ab.json`` / ``bench.json`` under
``RUN_DIR``; writes ``RUN_DIR/report.md`` (plots as ``RUN_DIR/report_files/*.png``)
and ``RUN_DIR/report.html`` (the same plots embedded as base64 data URIs, so the
file stands alone). Tables: :mod:`reports.tables`; plots: :mod:`reports.plots`.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from reports import plots, tables


class ReportError(RuntimeError):
    """The report could not be built (missing or unreadable run output)."""


@dataclass
class Report:
    run_dir: Path
    markdown: Path
    html: Path
    summary: pd.DataFrame
    sections: list[tuple[str, str, Any]] = field(default_factory=list)


def _md_table(df: pd.DataFrame) -> str:
    return df.to_markdown(index=False, missingval="–") if not df.empty else "_none_"


def _html_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "<p><em>none</em></p>"
    return df.to_html(index=False, border=0, classes="t", na_rep="–")


def _ab_text(res: dict[str, Any]) -> tuple[str, pd.DataFrame]:
    """Headline + per-arm table of one A/B or bench result."""
    if res.get("kind") == "ab":
        acc = res["verdict"]["acceptance"]
        head = (f"**{res['verdict']['verdict']}** — target `{res['target']}`, A `{res['drafter_a']}` "
                f"vs B `{res['drafter_b']}`, γ={res['gamma']}, {res['n_prompts']} prompts. "
                + " ".join(f"{r}." for r in res["verdict"]["reasons"])
                + f" McNemar table a/b/c/d = {acc['table']['a']}/{acc['table']['b']}/"
                f"{acc['table']['c']}/{acc['table']['d']} ({acc['test']}, "
                f"one-sided p={acc['p_one_sided']:.3g}).")
    else:
        head = (f"bench — target `{res['target']}`, drafter `{res['drafter']}`, γ={res['gamma']}, "
                f"{res['n_prompts']} prompts × {res['repeats']} repeats (interleaved). "
                "Figures only; timing never fails.")
    arms = pd.DataFrame(res.get("arms", [])).drop(columns=["path"], errors="ignore")
    return head, arms


def build_report(run_dir: Path | str) -> Report:
    """Build ``report.md`` and ``report.html`` in ``run_dir``; raise :class:`ReportError` on failure."""
    run_dir = Path(run_dir)
    try:
        data = tables.load_run(run_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise ReportError(f"report: cannot read run {run_dir}: {exc}") from exc
    try:
        return _build(run_dir, data)
    except Exception as exc:
        raise ReportError(f"report: failed to build the report of {run_dir}: "
                          f"{type(exc).__name__}: {exc}") from exc


def _build(run_dir: Path, data: tables.RunData) -> Report:

    by_pos = tables.acceptance_by_position(data.traces)
    lengths = tables.acceptance_lengths(data.traces)
    tau = tables.tau_table(data.traces)
    verdicts = tables.verdict_table(data.comparisons)
    ratios = tables.ratio_table(data.results)
    runners = sorted({r for r, _ in data.traces})

    sections: list[tuple[str, str, Any]] = []  # (title, prose, DataFrame | bytes | None)
    n_fail = int(verdicts["failing"].sum()) if not verdicts.empty else 0
    status = "CONFORMS" if n_fail == 0 else f"DIVERGES ({n_fail} failing comparisons)"
    intro = (f"**{status}** — {len(data.traces)} traces from runners {', '.join(runners)}; "
             f"{len(data.comparisons)} comparisons.")
    sections.append(("Summary: acceptance, τ and tok/s per (pair, γ)",
                     "Engine, greedy. τ = generated tokens / target forwards; tok/s from trace "
                     "wall times (recorded, never compared; indicative on the tiny zoo). "
                     "`speedup_vs_plain` divides by the SAME target's plain decode (§4.4).", tau))
    sections.append(("Identity verdicts",
                     "Engine vs each oracle round for round; engine spec vs plain at the token "
                     "level (`numerics` = a knife-edge flip, reported, not failed).", verdicts))
    sections.append(("Acceptance by draft position", "", plots.acceptance_by_position(by_pos)))
    sections.append(("", "accepted_by_pos[i] / drafted_by_pos[i] per draft position (columns), "
                     "summed over a cell's cases.", _pivot(by_pos, "position", "acceptance")))
    sections.append(("Acceptance-length histogram", "", plots.acceptance_lengths(lengths)))
    sections.append(("", "Share of rounds with k accepted drafts (columns k), within the "
                     "(pair, γ) cell.", _pivot(lengths, "k_accept", "share")))
    sections.append(("τ and tok/s per γ", "", plots.tau_and_rate(tau)))
    if data.results:
        sections.append(("Paired A/B and bench",
                         "Median paired ratio with a two-sided 95 % percentile bootstrap interval "
                         "(scipy.stats.bootstrap, fixed seed). Time ratios: < 1 means the "
                         "numerator arm is faster; speedups: > 1 means faster.", ratios))
        sections.append(("", "", plots.ratio_intervals(ratios)))
        for res in data.results:
            head, arms = _ab_text(res)
            sections.append((f"`{res['_path']}`", head, arms))

    md_lines = ["# specparity report", "", intro, ""]
    html_parts = [f"<h1>specparity report</h1><p>{_md_inline(intro)}</p>"]
    files = run_dir / "report_files"
    files.mkdir(parents=True, exist_ok=True)
    n_png = 0
    for title, prose, body in sections:
        if title:
            md_lines += [f"## {title}", ""]
            html_parts.append(f"<h2>{_md_inline(title)}</h2>")
        if prose:
            md_lines += [prose, ""]
            html_parts.append(f"<p>{_md_inline(prose)}</p>")
        if isinstance(body, pd.DataFrame):
            md_lines += [_md_table(body), ""]
            html_parts.append(_html_table(body))
        elif isinstance(body, bytes):
            n_png += 1
            name = f"plot{n_png}.png"
            (files / name).write_bytes(body)
            md_lines += [f"![{title or name}](report_files/{name})", ""]
            b64 = base64.b64encode(body).decode()
            html_parts.append(f'<img alt="{html.escape(title or name)}" '
                              f'src="data:image/png;base64,{b64}">')
        elif body is None and title:
            md_lines += ["_no data_", ""]
            html_parts.append("<p><em>no data</em></p>")
    md_path = run_dir / "report.md"
    html_path = run_dir / "report.html"
    _atomic_write(md_path, "\n".join(md_lines) + "\n")
    _atomic_write(html_path, _HTML.format(body="\n".join(html_parts)))
    return Report(run_dir, md_path, html_path, tau, sections)


def _pivot(df: pd.DataFrame, column: str, value: str) -> pd.DataFrame:
    """Long (cell, column, value) rows as one row per (target, drafter, γ) cell."""
    if df.empty:
        return df
    wide = df.pivot_table(index=tables.CELL, columns=column, values=value, aggfunc="first")
    wide.columns = [f"{column} {c}" for c in wide.columns]
    return wide.reset_index()


def _md_inline(text: str) -> str:
    """Escape, then render the two inline Markdown forms we use (``code`` and **bold**)."""
    import re

    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>specparity report</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1150px; margin: 1.5em auto; padding: 0 1em;
       color: #222; line-height: 1.4; }}
h1 {{ border-bottom: 2px solid #ccc; }}
h2 {{ margin-top: 1.6em; border-bottom: 1px solid #ddd; }}
table.t {{ border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0 1em; }}
table.t th, table.t td {{ padding: 2px 8px; border-bottom: 1px solid #e4e4e4; text-align: right; }}
table.t th {{ background: #f2f2f2; }}
img {{ max-width: 100%; display: block; margin: 0.5em 0; }}
code {{ background: #f4f4f4; padding: 0 3px; }}
</style></head><body>
{body}
</body></html>
"""
