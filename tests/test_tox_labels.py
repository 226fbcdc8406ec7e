"""tox labels: ``tox -m oracles``, ``-m subjects``, ``-m servers`` cover every reference, subject
and server environment, each ending with ``summary`` (reports/oracle_runs.py); the README lists
``tox -m oracles`` and the nightly workflow runs the labels instead of naming environments."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORACLE_ENVS = {"oracle", "optiq", "hf", "vlm", "deepspec", "vlm-dspark"}  # plus grammar-<reference>


def labels_of(ini_text: str) -> dict[str, set[str]]:
    cp = configparser.ConfigParser(interpolation=None)
    cp.read_string(ini_text)
    out: dict[str, set[str]] = {}
    for sec in cp.sections():
        if sec.startswith("testenv:"):
            out[sec.removeprefix("testenv:")] = {x.strip() for x in cp[sec].get("labels", "").split(",") if x.strip()}
    return out


def unlabelled(labels: dict[str, set[str]]) -> list[str]:
    """The reference/subject/server environments missing their label, as one message each."""
    bad = []
    for env, have in labels.items():
        want = ("oracles" if env in ORACLE_ENVS or env.startswith("grammar-") else
                "subjects" if env.startswith("subject-") else "servers" if env.startswith("server-") else None)
        if want and want not in have:
            bad.append(f"tox env {env} lacks `labels = {want}` (tox -m {want} would not run it)")
    return bad


def test_every_reference_subject_and_server_env_is_labelled_and_summary_ends_each() -> None:
    labels = labels_of((ROOT / "tox.ini").read_text())
    assert unlabelled(labels) == []
    assert labels["summary"] == {"oracles", "subjects", "servers"}
    assert list(labels)[-1] == "summary", "summary must be the last environment (it runs last in each label)"
    for lab in ("oracles", "subjects", "servers"):
        assert len([e for e, ls in labels.items() if lab in ls]) >= 3, lab


def test_a_new_unlabelled_environment_is_caught() -> None:
    text = (ROOT / "tox.ini").read_text() + "\n[testenv:server-planted]\ncommands = pytest\n"
    assert unlabelled(labels_of(text)) == ["tox env server-planted lacks `labels = servers` (tox -m servers would not run it)"]


def test_readme_and_nightly_use_the_labels() -> None:
    assert "tox -m oracles" in (ROOT / "README.md").read_text()
    wf = (ROOT / ".github" / "workflows" / "nightly.yml").read_text()
    for lab in ("oracles", "subjects", "servers"):
        assert f"tox -m {lab}" in wf, lab
    assert not re.search(r"tox -e (subject|server)-", wf), "the nightly names environments by hand"
