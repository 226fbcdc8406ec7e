"""The README's scoreboard sections are generated from ``docs/scoreboard/`` (reports/scoreboard.py).

The served engines' paragraph and rows, and the in-process engines' table, sit between
``<!-- generated: NAME ... -->`` / ``<!-- end generated: NAME -->`` markers and are
rewritten by ``python -m reports.scoreboard docs/scoreboard --readme README.md``; a
README (or a ``scoreboard.md``) that no longer says what the committed rows say fails
here, in the default tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reports.scoreboard import (
    README_CMD,
    load_results,
    readme_marks,
    readme_served,
    render_markdown,
    update_readme,
)

ROOT = Path(__file__).resolve().parents[1]
BOARD = ROOT / "docs" / "scoreboard"


def test_the_readme_sections_are_the_scoreboard_s() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert update_readme(text, load_results(BOARD)) == text, f"README.md's generated sections are stale: run {README_CMD}"


def test_the_committed_scoreboard_is_generated_from_its_rows() -> None:
    md = (BOARD / "scoreboard.md").read_text(encoding="utf-8")
    assert render_markdown(load_results(BOARD)) == md, f"docs/scoreboard/scoreboard.md is stale: run {README_CMD}"


def _row(engine: str, arms: dict[str, dict[str, str]], **kw) -> dict:
    return {"engine": engine, "kind": "server", "version": "1", "available": True, "platform": {},
            "model": {"name": "m"}, "checks": sorted({c for a in arms.values() for c in a}), **kw,
            "modes": {arm: {"checks": {c: {"status": s, "detail": f"{c} detail", **(
                {"attribution": "cache × speculation: passes when rerun"} if s == "fail" and arm == "spec" else {})}
                for c, s in cells.items()}} for arm, cells in arms.items()}}


def test_a_changed_row_changes_the_served_section_and_a_stale_readme_is_caught(tmp_path) -> None:
    docs = [_row("x", {"plain": {"identity": "pass", "cache": "pass"}, "spec": {"identity": "pass", "cache": "fail"}})]
    text = readme_served(docs)
    assert "| x 1 | m | spec | 1 | 1 | 0 | 0 | 0 |" in text and "cache (cache × speculation)" in text, text
    docs[0]["modes"]["spec"]["checks"]["cache"] = {"status": "pass", "detail": "ok"}
    assert readme_served(docs) != text  # a finding that went away is not left in the README
    begin, end = readme_marks("served")
    b2, e2 = readme_marks("engines")
    stale = f"intro\n{begin}\n{text}\n{end}\n{b2}\nold table\n{e2}\nrest\n"
    fresh = update_readme(stale, docs)
    assert fresh != stale and fresh.startswith("intro\n") and fresh.endswith(f"{e2}\nrest\n")
    assert update_readme(fresh, docs) == fresh  # idempotent
    with pytest.raises(ValueError, match="no '<!-- generated: "):
        update_readme("no markers here", docs)


def test_a_row_that_could_not_be_graded_says_why_not_fail() -> None:
    row = _row("y", {"plain": {"identity": "cannot-grade", "stream": "cannot-grade"}})
    for c in row["modes"]["plain"]["checks"].values():
        c.update(detail="server did not start: y: refused", log="ValueError: no chat template | more")
    text = readme_served([row])
    assert "| y 1 | m | plain | 0 | 0 | 2 |" in text and "cannot grade: server did not start (`ValueError: no chat " \
        "template`)" in text, text


def test_the_cli_rewrites_the_readme_and_refuses_one_without_markers(tmp_path) -> None:
    from reports.scoreboard import main

    d = tmp_path / "board"
    d.mkdir()
    (d / "server-x--m.json").write_text(json.dumps(_row("x", {"plain": {"identity": "pass"}})))
    readme = tmp_path / "README.md"
    begin, end = readme_marks("served")
    b2, e2 = readme_marks("engines")
    readme.write_text(f"# r\n{begin}\nstale\n{end}\n{b2}\n{e2}\n")
    assert main([str(d), "--readme", str(readme)]) == 0
    assert "| x 1 | m | plain | 1 |" in readme.read_text() and "stale" not in readme.read_text()
    readme.write_text("# r\n")
    assert main([str(d), "--readme", str(readme)]) == 2
