"""``reports/oracle_runs.py`` and the root conftest's results: one summary of which oracles,
subjects and servers ran in which tox environment, and which were skipped and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reports.oracle_runs import load, main, summarize

ROOT = Path(__file__).resolve().parents[1]


def _doc(env: str, tests: list[dict], runners: dict) -> dict:
    return {"env": env, "args": "conformance/ -m oracle", "exitstatus": 0, "finished": "now",
            "runners": runners, "tests": tests}


def _write(folder: Path, *docs: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (folder / f"{d['env']}--{i}.json").write_text(json.dumps(d))


def test_summary_says_where_each_oracle_ran_and_why_it_was_skipped(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    why = "mlx-optiq is not installed; install: tox -e optiq"
    _write(tmp_path,
           _doc("oracle", [{"id": "conformance/t.py::a", "outcome": "passed", "reason": ""},
                           {"id": "conformance/t.py::b", "outcome": "skipped", "reason": f"oracle optiq unavailable: {why}"},
                           {"id": "conformance/t.py::c[1]", "outcome": "xfailed",
                            "reason": "known reference behaviour mlx-lm-x: traces diverge at round 2"},
                           {"id": "conformance/t.py::c[2]", "outcome": "xfailed",
                            "reason": "known reference behaviour mlx-lm-x: traces diverge at round 5"}],
                {"mlx_lm": {"kind": "reference", "available": True, "why": ""},
                 "optiq": {"kind": "reference", "available": False, "why": why}}),
           _doc("optiq", [{"id": "conformance/t.py::b", "outcome": "passed", "reason": ""}],
                {"mlx_lm": {"kind": "reference", "available": True, "why": ""},
                 "optiq": {"kind": "reference", "available": True, "why": ""},
                 "nunspark": {"kind": "subject", "available": False, "why": "not installed"}}))
    assert main([str(tmp_path), "--out", str(tmp_path / "summary.md")]) == 0
    text = capsys.readouterr().out
    assert text == (tmp_path / "summary.md").read_text()
    assert "| optiq | reference | optiq | 1 environment(s): " + why + " |" in text, text
    assert "| mlx_lm | reference | optiq, oracle |  |" in text, text
    assert "| nunspark | subject | **nowhere** |" in text, text
    assert f"| oracle | 1 | oracle optiq unavailable: {why} |" in text, text
    assert "## Failures (0)" in text
    # expected failures: counted per known entry, not one row per case
    assert "| oracle | 2 | known reference behaviour mlx-lm-x |" in text, text
    # a rerun replaces its own summary (recognised by its heading), never a user's file
    assert main([str(tmp_path), "--out", str(tmp_path / "summary.md")]) == 0
    capsys.readouterr()
    (tmp_path / "notes.md").write_text("a user's notes\n")
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path), "--out", str(tmp_path / "notes.md")])
    assert exc.value.code == 2
    assert "not an oracle-runs summary" in capsys.readouterr().err
    assert (tmp_path / "notes.md").read_text() == "a user's notes\n"


def test_a_failed_oracle_test_is_named_and_exits_1(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    _write(tmp_path, _doc("vlm", [{"id": "conformance/test_mtp_references.py::x", "outcome": "failed",
                                   "reason": "failed in call"}], {}))
    assert main([str(tmp_path)]) == 1
    assert "- vlm: `conformance/test_mtp_references.py::x` (failed in call)" in capsys.readouterr().out


def test_no_results_or_a_foreign_file_is_one_error_line(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    assert main([str(tmp_path / "nope")]) == 2
    assert main([str(tmp_path)]) == 2
    (tmp_path / "x.json").write_text('{"a": 1}')
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("error: ") for e in err), err
    assert "x.json: not a test-results document" in err[2]


def test_the_root_conftest_writes_the_results_of_a_run(tmp_path: Path) -> None:
    """A pytest run with SPECPARITY_RESULTS_DIR (tox sets TOX_WORK_DIR: .tox/results) records every
    oracle-marked test's outcome and skip reason, and the runners' availability."""
    test = tmp_path / "test_planted.py"
    test.write_text("import pytest\n\n@pytest.mark.oracle\ndef test_ran():\n    pass\n\n"
                    "@pytest.mark.oracle\ndef test_skipped():\n    pytest.skip('oracle planted unavailable: why')\n\n"
                    "@pytest.mark.oracle\ndef test_known():\n"
                    "    pytest.xfail('known reference behaviour planted-entry: rounds differ at 3\\nline two')\n\n"
                    "def test_unmarked():\n    pass\n")
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOX_") and k != "SPECPARITY_RESULTS_OWNER"}
    env.update(SPECPARITY_RESULTS_DIR=str(out), TOX_ENV_NAME="planted-env", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", str(test)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [doc] = load(out)
    assert doc["env"] == "planted-env"
    got = {t["id"].split("::")[-1]: (t["outcome"], t["reason"]) for t in doc["tests"]}
    assert got == {"test_ran": ("passed", ""), "test_skipped": ("skipped", "oracle planted unavailable: why"),
                   "test_known": ("xfailed", "known reference behaviour planted-entry: rounds differ at 3")}, got
    assert doc["runners"]["mlx_lm"]["kind"] == "reference"
    text = summarize([doc])
    assert "planted-env" in text and "| planted-env | 1 | known reference behaviour planted-entry |" in text, text
    # a failing oracle test is recorded with the first line of its failure
    failing = tmp_path / "test_failing.py"
    failing.write_text("import pytest\n\n@pytest.mark.oracle\ndef test_bad():\n    assert 1 == 2, 'engine vs planted'\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                           str(failing)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    bad = [t for d in load(out) for t in d["tests"] if t["outcome"] == "failed"]
    assert [t["reason"] for t in bad] == ["failed in call: AssertionError: engine vs planted"], bad
    # a pytest started by a recording run (a test's subprocess) records nothing
    nested = tmp_path / "nested"
    env.update(SPECPARITY_RESULTS_DIR=str(nested), SPECPARITY_RESULTS_OWNER="1234")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", str(test)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and not nested.exists(), proc.stdout + proc.stderr
