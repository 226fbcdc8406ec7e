"""``specparity report RUN_DIR``: Markdown + self-contained HTML from a run's traces.

The headline verdict is CONFORMS only for a finished run whose every engine
speculative case was compared and none failed, and it names the cases the backend lacks
an op for (``CONFORMS (3 cases unsupported on Device(gpu, 0))``; every comparison
unsupported: NOTHING COMPARED); a run killed midway, one whose
marker says it failed, or a folder without ``comparisons.json`` is INCOMPLETE
(``reports.tables.incomplete_reasons``), never CONFORMS. Traces are validated
before anything is read from them. Values from traces and file names are
escaped (``reports/md.py``) in the Markdown; pandas escapes the HTML tables.
Timings are not part of this report (single unpaired wall times); the paired
figures of ``specparity bench`` / ``ab`` appear when their JSON is under RUN_DIR.

Reads ``RUN_DIR/traces/<runner>/*.jsonl`` or any ``*.jsonl`` under RUN_DIR (``traces.io.read_trace``),
``RUN_DIR/comparisons.json`` and every ``ab.json`` / ``bench.json`` under
``RUN_DIR``; writes ``RUN_DIR/report.md`` (plots as ``RUN_DIR/report_files/*.png``)
and ``RUN_DIR/report.html`` (the same plots embedded as base64 data URIs, so the
file stands alone). Tables: :mod:`reports.tables`; plots: :mod:`reports.plots`.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from reports import md, plots, tables
from reports.summary import headline, nothing_compared, unsupported_note
from traces.io import atomic_write_bytes, atomic_write_text


class ReportError(RuntimeError):
    """The report could not be built (missing or unreadable run output)."""


class _Refused(Exception):
    """The output directory's ``track`` refused a file (re-raised as its own error)."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original


def _guarded(track: Callable[[Path], Any]) -> Callable[[Path], Any]:
    def call(p: Path) -> Any:
        try:
            return track(p)
        except Exception as exc:
            raise _Refused(exc) from exc

    return call


@dataclass
class Report:
    run_dir: Path
    markdown: Path
    html: Path
    summary: pd.DataFrame
    sections: list[tuple[str, str, Any]] = field(default_factory=list)
    status: str = "CONFORMS"  # CONFORMS | DIVERGES | INCOMPLETE | NOTHING COMPARED
    headline: str = ""

    @property
    def conforms(self) -> bool:
        return self.status == "CONFORMS"


def _md_table(df: pd.DataFrame) -> str:
    return md.frame(df).to_markdown(index=False, missingval="–") if not df.empty else "_none_"


def _html_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "<p><em>none</em></p>"
    return df.to_html(index=False, border=0, classes="t", na_rep="–")


def _ab_text(res: dict[str, Any]) -> tuple[str, pd.DataFrame]:
    """Headline + per-arm table of one A/B or bench result."""
    if res.get("kind") == "ab":
        acc = res["verdict"]["acceptance"]
        head = (f"**{md.text(res['verdict']['verdict'])}** — target {md.code(res['target'])}, "
                f"A {md.code(res['drafter_a'])} vs B {md.code(res['drafter_b'])}, "
                f"γ={md.text(res['gamma'])}, {md.text(res['n_prompts'])} prompts. "
                + " ".join(f"{md.text(r)}." for r in res["verdict"]["reasons"])
                + f" McNemar table a/b/c/d = {acc['table']['a']}/{acc['table']['b']}/"
                f"{acc['table']['c']}/{acc['table']['d']} ({acc['test']}, "
                f"one-sided p={acc['p_one_sided']:.3g}).")
    else:
        head = (f"bench — target {md.code(res['target'])}, drafter {md.code(res['drafter'])}, "
                f"γ={md.text(res['gamma'])}, {md.text(res['n_prompts'])} prompts × "
                f"{md.text(res['repeats'])} repeats (interleaved). "
                "Figures only; timing never fails.")
    arms = pd.DataFrame(res.get("arms", [])).drop(columns=["path"], errors="ignore")
    return head, arms


def build_report(run_dir: Path | str, track: Callable[[Path], Any] | None = None) -> Report:
    """Build ``report.md`` and ``report.html`` in ``run_dir``; raise :class:`ReportError` on failure.

    ``track`` is called with each file's path before it is written (the output
    directory's ownership list, ``specparity.cli.outdir``); it may refuse by raising.
    """
    run_dir = Path(run_dir)
    try:
        data = tables.load_run(run_dir)
    except FileNotFoundError as exc:
        nothing = _nothing_compared_run(run_dir)  # no trace at all: every run unsupported
        if nothing is None:
            raise ReportError(f"report: cannot read run {run_dir}: {exc}") from exc
        data = nothing
    except (OSError, ValueError) as exc:
        raise ReportError(f"report: cannot read run {run_dir}: {exc}") from exc
    try:
        return _build(run_dir, data, _guarded(track or (lambda p: p)))
    except _Refused as exc:
        raise exc.original from None
    except Exception as exc:
        raise ReportError(f"report: failed to build the report of {run_dir}: "
                          f"{type(exc).__name__}: {exc}") from exc


def _nothing_compared_run(run_dir: Path) -> tables.RunData | None:
    """A run that made no trace because the backend lacked an op for every one of its runs:
    its ``comparisons.json`` (every entry unsupported or not compared), else None."""
    path = run_dir / "comparisons.json"
    if not path.is_file():
        return None
    try:
        comparisons = tables.load_comparisons(path)
    except (OSError, ValueError):
        return None
    if not nothing_compared(comparisons):
        return None
    return tables.RunData(run_dir, {}, comparisons, [], True, tables.run_state(run_dir))


def _build(run_dir: Path, data: tables.RunData, track: Callable[[Path], Any]) -> Report:

    by_pos = tables.acceptance_by_position(data.traces)
    lengths = tables.acceptance_lengths(data.traces)
    tau = tables.tau_table(data.traces)
    verdicts = tables.verdict_table(data.comparisons)
    ratios = tables.ratio_table(data.results)
    runners = sorted({r for r, _ in data.traces})

    sections: list[tuple[str, str, Any]] = []  # (title, prose, DataFrame | bytes | None)
    n_fail = int(verdicts["failing"].sum()) if not verdicts.empty else 0
    missing = tables.incomplete_reasons(data)
    note = unsupported_note(data.comparisons)  # cases the backend lacks an op for: always named
    if n_fail:
        status, word = "DIVERGES", f"DIVERGES ({n_fail} failing comparisons{'; ' + note if note else ''})"
    elif nothing_compared(data.comparisons) and data.state[0] not in ("failed", "killed", "writing"):
        # every run unsupported: no engine trace either, which is why, not a lost one
        status, missing = "NOTHING COMPARED", []
        word = headline(data.comparisons, failing=False)
    elif missing:
        status, word = "INCOMPLETE", "INCOMPLETE (not a conformance verdict)"
    else:
        status, word = "CONFORMS", headline(data.comparisons, failing=False)
    made = (f"{len(data.traces)} traces from runners {', '.join(md.code(r) for r in runners)}" if runners
            else "no traces")
    intro = f"**{word}** — {made}; {len(data.comparisons)} comparisons."
    if missing:
        intro += " Incomplete: " + "; ".join(md.text(r) for r in missing) + "."
    sections.append(("Summary: acceptance and τ per (pair, γ)",
                     "Engine traces. τ = generated tokens / target forwards. Timings are not in "
                     "this report: a trace's wall time is one unpaired measurement, and a ratio "
                     "of two of them is noise. For tok/s and speedup run `specparity bench` "
                     "(interleaved, paired; its bench.json under this directory appears below).",
                     tau))
    sections.append(("Identity verdicts",
                     "Engine vs each oracle round for round; engine spec vs plain at the token "
                     "level (`numerics` = a knife-edge flip, reported, not failed).", verdicts))
    unsupported = _unsupported_rows(data.comparisons)
    if not unsupported.empty:
        sections.append(("Unsupported on this backend",
                         "Runs the backend lacks an op for (`engine/backend.py`): that case's verdict, "
                         "not a finding; every comparison needing the trace reads `unsupported`.",
                         unsupported))
    sections.append(("Cases", "One row per (runner, case) trace.", _cases(data.traces)))
    sections.append(("Acceptance by draft position", "", plots.acceptance_by_position(by_pos)))
    sections.append(("", "accepted_by_pos[i] / drafted_by_pos[i] per draft position (columns), "
                     "summed over a cell's cases.", _pivot(by_pos, "position", "acceptance")))
    sections.append(("Acceptance-length histogram", "", plots.acceptance_lengths(lengths)))
    sections.append(("", "Share of rounds with k accepted drafts (columns k), within the "
                     "(pair, γ) cell.", _pivot(lengths, "k_accept", "share")))
    sections.append(("τ per γ", "", plots.tau_by_gamma(tau)))
    if data.results:
        sections.append(("Paired A/B and bench",
                         "Median paired ratio with a two-sided 95 % percentile bootstrap interval "
                         "(scipy.stats.bootstrap, fixed seed). Time ratios: < 1 means the "
                         "numerator arm is faster; speedups: > 1 means faster.", ratios))
        sections.append(("", "", plots.ratio_intervals(ratios)))
        for res in data.results:
            head, arms = _ab_text(res)
            sections.append((md.code(res["_path"]), head, arms))

    md_lines = ["# specparity report", "", intro, ""]
    html_parts = [f"<h1>specparity report</h1><p>{_md_inline(intro)}</p>"]
    files = run_dir / "report_files"
    md_path = run_dir / "report.md"
    html_path = run_dir / "report.html"
    track(md_path)  # refused here, before anything is written, if not ours
    track(html_path)
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
            track(files / name)
            files.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(files / name, body)
            md_lines += [f"![{md.text(title or name)}](report_files/{name})", ""]
            b64 = base64.b64encode(body).decode()
            html_parts.append(f'<img alt="{html.escape(title or name)}" '
                              f'src="data:image/png;base64,{b64}">')
        elif body is None and title:
            md_lines += ["_no data_", ""]
            html_parts.append("<p><em>no data</em></p>")
    atomic_write_text(md_path, "\n".join(md_lines) + "\n")
    atomic_write_text(html_path, _HTML.format(body="\n".join(html_parts)))
    return Report(run_dir, md_path, html_path, tau, sections, status, intro)


def _unsupported_rows(comparisons: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per (runner, case) the backend could not run: its verdict and MLX's error line."""
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for c in comparisons:
        u = c.get("unsupported")
        if isinstance(u, dict):
            for runner in u.get("runners") or [u.get("runner", "?")]:
                rows.setdefault((str(c["case_id"]), str(runner)),
                                {"case_id": str(c["case_id"]), "runner": str(runner),
                                 "verdict": str(u.get("verdict", "?")), "error": str(u.get("line", ""))})
    return pd.DataFrame([rows[k] for k in sorted(rows)], columns=["case_id", "runner", "verdict", "error"])


def _cases(traces: dict[tuple[str, str], Any]) -> pd.DataFrame:
    cf = tables.cases_frame(traces)
    if cf.empty:
        return cf
    cols = ["runner", "case_id", "mode", "target", "drafter", "gamma", "prompt_id", "tokens",
            "target_calls", "drafted", "accepted"]
    return cf[cols].sort_values(["case_id", "runner"]).reset_index(drop=True)


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

    text = html.unescape(re.sub(r"\\([\\`*_\[\]|~])", r"\1", text))
    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)


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
