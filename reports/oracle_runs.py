"""One summary of every oracle, subject and server run: which ran, in which tox environment,
which were skipped and why, which were expected to fail and why.

The references, third-party engines and servers live in their own tox environments (their pins
conflict): ``tox -m oracles``, ``tox -m subjects``, ``tox -m servers``. Every pytest run under tox
writes one JSON result into ``.tox/results/`` (the root ``conftest.py``: the environment, each
reference/subject/server runner's availability there with the reason when missing, and the
outcome and its reason of each ``oracle``/``subject``-marked test: skip reason, xfail reason, a
failure's first line). This module combines them::

    python -m reports.oracle_runs .tox/results [--out .tox/results/summary.md]

(``tox -e summary``, the last environment of each label). Exit 0 when every recorded test passed,
was skipped or was expected to fail, 1 when one failed (the table names it), 2 when the folder
holds no results.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUTCOMES = ("passed", "failed", "skipped", "xfailed")


def load(folder: Path) -> list[dict[str, Any]]:
    """Every result document in ``folder`` (``*.json``), ordered by environment name.

    Raises ``ValueError`` naming the file when one is not a result document."""
    docs = []
    for p in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{p}: not a readable JSON result ({exc})") from exc
        if not isinstance(doc, dict) or not {"env", "runners", "tests"} <= doc.keys():
            raise ValueError(f"{p}: not a test-results document (needs env, runners, tests)")
        docs.append(doc)
    return sorted(docs, key=lambda d: (d["env"], d.get("args", "")))


def _counts(tests: list[dict[str, Any]]) -> Counter[str]:
    return Counter(t["outcome"] for t in tests)


def summarize(docs: list[dict[str, Any]]) -> str:
    """The Markdown summary: per environment the outcomes, per runner where it ran or why not,
    every failure with its first line, the skip reasons and the xfail reasons (per known entry) with
    their counts."""
    lines = [HEADING, ""]
    lines += ["| environment | pytest args | finished | " + " | ".join(OUTCOMES) + " |",
              "|---|---|---|" + "---|" * len(OUTCOMES)]
    for d in docs:
        c = _counts(d["tests"])
        lines.append(f"| {d['env']} | `{d.get('args', '')}` | {d.get('finished', '?')} | "
                     + " | ".join(str(c.get(o, 0)) for o in OUTCOMES) + " |")
    ran: dict[str, list[str]] = defaultdict(list)
    missing: dict[str, dict[str, str]] = defaultdict(dict)
    kinds: dict[str, str] = {}
    for d in docs:
        for name, r in d["runners"].items():
            kinds[name] = r.get("kind", "?")
            if r.get("available"):
                if d["env"] not in ran[name]:
                    ran[name].append(d["env"])
            else:
                missing[name].setdefault(d["env"], r.get("why", ""))
    lines += ["", "## Where each runs", "",
              "| runner | kind | ran in | not available in (why, first environment's words) |", "|---|---|---|---|"]
    for name in sorted(kinds, key=lambda n: (kinds[n], n)):
        gone = missing.get(name, {})
        why = ""
        if gone:
            first = next(iter(gone.values()))
            why = f"{len(gone)} environment(s): {first}"
        lines.append(f"| {name} | {kinds[name]} | {', '.join(ran.get(name, [])) or '**nowhere**'} | {why} |")
    failed = [(d["env"], t) for d in docs for t in d["tests"] if t["outcome"] == "failed"]
    lines += ["", f"## Failures ({len(failed)})", ""]
    lines += [f"- {env}: `{t['id']}` ({t.get('reason', '')})" for env, t in failed] or ["none"]
    lines += _reasons(docs, "skipped", "Skipped, and why", lambda r: r)
    lines += _reasons(docs, "xfailed", "Expected failures (xfail), and why", _xfail_kind)
    return "\n".join(lines) + "\n"


def _xfail_kind(reason: str) -> str:
    """An xfail reason without its case's details: the part before the first ``": "`` (``known
    reference behaviour <entry id>``, ``arithmetic flip after the engine's fallback (numerics)``)."""
    return reason.split(": ", 1)[0] if reason else "(no reason recorded)"


def _reasons(docs: list[dict[str, Any]], outcome: str, title: str, key: Callable[[str], str]) -> list[str]:
    """A table of the tests with ``outcome``, counted per environment and ``key(reason)``."""
    counts: Counter[tuple[str, str]] = Counter(
        (d["env"], key(t.get("reason", ""))) for d in docs for t in d["tests"] if t["outcome"] == outcome)
    lines = ["", f"## {title}", "", "| environment | tests | reason |", "|---|---|---|"]
    for (env, reason), n in sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1])):
        lines.append(f"| {env} | {n} | {reason.replace('|', '/')} |")
    return lines if counts else [*lines[:3], "none"]


HEADING = "# Oracle, subject and server runs"


def _ours(p: Path) -> bool:
    """A summary this module wrote (its first line), the ownership marker of ``--out``."""
    try:
        with p.open(encoding="utf-8", errors="replace") as f:
            return f.readline().rstrip("\n") == HEADING
    except OSError:
        return False


def _summary_file(text: str) -> Path:
    """``--out FILE``: a new file, or a summary this module wrote; checked at parse time."""
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory (--out names the summary file)")
    if not p.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: its folder {p.parent} does not exist")
    if p.is_file() and p.stat().st_size > 0 and not _ours(p):
        raise argparse.ArgumentTypeError(f"{text}: exists and is not an oracle-runs summary written by "
                                         "specparity; refusing to overwrite it: give a new file name")
    return p


_summary_file.output = "file"  # type: ignore[attr-defined]  # a writing flag (specparity.cli.outdir.MODULE_WRITERS)


def main(argv: list[str] | None = None) -> int:
    from contextlib import nullcontext

    from traces.outdir import UsageError, claim_output_file

    prog = "python -m reports.oracle_runs"
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="the results folder (.tox/results)")
    ap.add_argument("--out", type=_summary_file, default=None,
                    help="also write the Markdown here (a new file, or a summary this module wrote)")
    a = ap.parse_args(argv)
    try:  # the destination is checked before any work (traces/outdir.py: the one ownership mechanism)
        claim = (claim_output_file(a.out, prog, flag="--out", what="oracle-runs summary", ours=_ours)
                 if a.out is not None else nullcontext(None))
        with claim as out:
            return _summarize_into(a.folder, out)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def _summarize_into(folder: Path, out: Path | None) -> int:
    if not folder.is_dir():
        print(f"error: {folder}: no results folder (run `tox -m oracles` first)", file=sys.stderr)
        return 2
    try:
        docs = load(folder)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not docs:
        print(f"error: {folder}: no results (*.json) in it (run `tox -m oracles` first)", file=sys.stderr)
        return 2
    text = summarize(docs)
    if out is not None:
        from traces.io import atomic_write_text

        atomic_write_text(out, text)
    sys.stdout.write(text)
    return 1 if any(t["outcome"] == "failed" for d in docs for t in d["tests"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
