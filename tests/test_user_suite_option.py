"""``pytest conformance/ -m oracle --suite FILE``: the conformance tests on a user's pairs.

A suite over a tests/foreign.py pair (phi3 + twin, a word-level tokenizer outside the
zoo) and a zoo pair with a sliding window (gemma3 + twin) runs
``conformance/test_user_suite.py`` in a pytest subprocess: the EOS, planted-bug, sampled
and rotating tests run on the user's pairs and pass (zoo-only tests skip saying so); with
an engine bug planted for the whole run (``tests/plants.py``: an EOS emitted as content)
the EOS tests fail on the user's pair, naming its case.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests import foreign

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("user-suite")
    foreign.build(root, ("phi3",))
    f = root / "suite.toml"
    f.write_text('gammas = [2]\nmax_tokens = 16\n\n[[pair]]\ntarget = "phi3-tiny"\n'
                 'drafter = "phi3-tiny-twin"\nprompts_file = "prompts.jsonl"\n\n'
                 '[[pair]]\ntarget = "gemma3"\ndrafter = "twin"\nzoo_prompts = 1\n')
    return f


def _pytest(suite: Path, tmp: Path, plant: str | None = None,
            select: str | None = None) -> tuple[int, dict[str, tuple[str, str]]]:
    """Exit status and ``{test id: (outcome, message)}`` of the user-suite tests (``select``: a
    ``-k`` expression)."""
    xml = tmp / "junit.xml"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SPECPARITY_SUITE", None)
    if plant:
        env["SPECPARITY_PLANT"] = plant
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.plants",
           "conformance/test_user_suite.py", "--suite", str(suite), "-m", "oracle",
           f"--junitxml={xml}", *(["-k", select] if select else [])]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    out: dict[str, tuple[str, str]] = {}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        kids = list(tc)
        kind = kids[0].tag if kids else "passed"
        out[tc.get("name", "")] = (kind, (kids[0].get("message") or "") if kids else "")
    return proc.returncode, out


def test_user_suite_runs_on_the_users_pairs_and_passes(suite: Path, tmp_path: Path) -> None:
    from conformance.test_user_suite import ZOO_ONLY

    rc, res = _pytest(suite, tmp_path)
    failed = {k: v for k, v in res.items() if v[0] in ("failure", "error")}
    assert rc == 0 and not failed, failed
    phi3 = {k: v[0] for k, v in res.items() if "phi3-tiny+phi3-tiny-twin" in k}
    for name in ("test_eos_on_user_pair", "test_planted_accounting_bug_on_user_pair",
                 "test_planted_target_short_trim_on_user_pair",
                 "test_planted_drafter_overtrim_on_user_pair", "test_sampled_on_user_pair"):
        assert any(k.startswith(name + "[") and v == "passed" for k, v in phi3.items()), (name, phi3)
    assert res["test_rotating_exact_on_user_pair[1-gemma3+twin]"][0] == "passed"
    assert "no rotating" in res["test_rotating_exact_on_user_pair[0-phi3-tiny+phi3-tiny-twin]"][1]
    zoo_only = [v for k, v in res.items() if k.startswith("test_zoo_only[0-")]
    assert len(zoo_only) == len(ZOO_ONLY) and all(v[0] == "skipped" and "zoo-only" in v[1]
                                                   for v in zoo_only)


def test_a_planted_engine_bug_fails_on_the_users_pair(suite: Path, tmp_path: Path) -> None:
    rc, res = _pytest(suite, tmp_path, plant="eos-as-content", select="test_eos_on_user_pair")
    assert rc == 1
    eos = {k: v for k, v in res.items() if k.startswith("test_eos_on_user_pair[0-phi3")}
    failed = [v[1] for k, v in eos.items() if v[0] == "failure"]
    assert failed, eos
    assert any("EOS emitted as content" in m and "phi3-tiny-" in m for m in failed), failed[:2]
