"""Third-party engines (subjects), live: each graded in its own environment.

Run by ``tox -e subject-<engine>`` (marker ``subject``); in any other
environment the subject's package is missing and these tests skip with its
install hint. Each available subject must (1) record a trace whose header
names its package, version and the hooks used, and (2) grade exactly as the
committed scoreboard says (``docs/scoreboard/<engine>.json``): a check that
starts failing, or a known failure that stops failing, both fail here, so
the committed scoreboard and ``traces/known_divergences.toml`` stay true.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from subjects import SUBJECTS, availability, load
from subjects.base import SubjectCase

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "scoreboard"

pytestmark = pytest.mark.subject


def _require(name: str) -> None:
    ok, why = availability(name)
    if not ok:
        pytest.skip(f"{name}: {why}")


@pytest.mark.parametrize("name", list(SUBJECTS))
def test_subject_records_its_identity_and_hooks(name: str, tmp_path: Path) -> None:
    _require(name)
    from specparity.grading.engines import Recorder
    from traces.io import read_trace

    mod = load(name)
    if not mod.MODES:
        pytest.skip(f"{name}: {getattr(mod, 'NOT_DRIVEN', 'no mode driven')}")
    rec = Recorder(name, mod, tmp_path)
    committed = COMMITTED / f"{name}.json"
    want = json.loads(committed.read_text()).get("modes", {}) if committed.exists() else {}
    ran = 0
    for mode_name, mode in mod.MODES.items():
        try:
            rec(SubjectCase(target=mode.targets[0], mode=mode_name, drafter=mode.drafter, max_tokens=8))
            ran += 1
        except Exception as exc:  # a crash the committed scoreboard records is the known finding
            known = want.get(mode_name, {}).get("checks", {}).get("identity", {}).get("detail", "")
            if not known.startswith(f"raised {type(exc).__name__}"):
                raise
    traces = sorted(tmp_path.glob("*.jsonl"))
    assert len(traces) == ran
    for p in traces:
        h = read_trace(p).header
        assert h["runner"]["name"] == name and h["runner"]["version"] == mod.version()
        assert h["runner"]["hooks"], p


@pytest.mark.parametrize("name", list(SUBJECTS))
def test_subject_grades_as_the_committed_scoreboard(name: str, tmp_path: Path) -> None:
    _require(name)
    from specparity.grading.engines import grade_engine

    committed = COMMITTED / f"{name}.json"
    if not committed.exists():
        pytest.fail(f"no committed result {committed}: run specparity grade --engine {name} --out docs/scoreboard")
    want = json.loads(committed.read_text())
    got = grade_engine(name, tmp_path)
    assert got["available"] == want["available"], (got.get("reason"), want.get("reason"))
    diffs = []
    for mode, m in want.get("modes", {}).items():
        for check, r in m["checks"].items():
            now = got["modes"].get(mode, {}).get("checks", {}).get(check, {}).get("status")
            if now != r["status"]:
                diffs.append(f"{mode}/{check}: committed {r['status']}, now {now}: "
                             f"{got['modes'].get(mode, {}).get('checks', {}).get(check, {}).get('detail')}")
    for mode in set(got.get("modes", {})) - set(want.get("modes", {})):
        diffs.append(f"{mode}: graded now but not in {committed} (regenerate the scoreboard)")
    assert not diffs, "\n".join(diffs)
