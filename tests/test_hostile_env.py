"""A hostile environment: every reference installed, a ``traces/`` folder in the working
directory, a umask, stderr not a TTY, goldens read from another location.

What each test checks, and the catalogue of inputs: ``tests/test_hostile_catalogue.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import zoo
from tests.helpers import cli

pytestmark = pytest.mark.usefixtures("in_tmp")


def test_every_available_runner_is_dispatchable(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every reference 'installed', run either dispatches a runner or skips it with a reason."""
    import oracles
    from specparity import run as run_mod
    from specparity.cases import Case
    from specparity.runners import run_case

    monkeypatch.setattr(oracles, "availability", lambda name: (True, "ok"))
    runners, skipped = run_mod.available_runners(None)
    assert "hf_prompt_lookup" in skipped and "conformance/" in skipped["hf_prompt_lookup"]
    for name in runners[1:]:
        try:
            run_case(name, Case("llama", None, zoo.prompts()[0].id, 0, 4))
        except ValueError as exc:
            assert "unknown runner" not in str(exc), (name, exc)
        except Exception:  # noqa: S110 - not installed here; only dispatch is checked
            pass


def test_progress_lines_when_not_a_tty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(["run", "--targets", "llama", "--drafters", "self", "--gammas", "1",
                      "--prompts", "1", "--max-tokens", "4", "--runners", "", "--out",
                      tmp_path / "run"], capsys)
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("running cases:")]
    assert lines and lines[-1].startswith("running cases: 2/2"), err
    assert "\r" not in err


def test_published_file_modes(tiny_run: Path, tmp_path: Path) -> None:
    from specparity.goldens import save_manifest
    from traces.io import atomic_write_json

    old = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "x.json", {"a": 1})
        save_manifest({"goldens": {}}, tmp_path / "g")
        files = [tmp_path / "x.json", tmp_path / "g" / "manifest.json",
                 *tiny_run.rglob("*.jsonl"), tiny_run / "comparisons.json", tiny_run / "report.md"]
        for p in files:
            assert (p.stat().st_mode & 0o777) == 0o644, (p, oct(p.stat().st_mode))
    finally:
        os.umask(old)


def test_goldens_are_location_independent() -> None:
    from specparity.goldens import GOLDEN_DIR

    for p in sorted(Path(GOLDEN_DIR).rglob("*.jsonl"))[:400]:
        header = json.loads(p.open().readline())
        for role in ("target", "drafter"):
            ident = header.get(role)
            if isinstance(ident, dict) and ident.get("path"):
                assert not Path(ident["path"]).is_absolute(), (p, ident["path"])


def test_package_data_ignores_the_working_directory(tmp_path: Path, tiny_run: Path) -> None:
    """A ``traces/`` folder in the cwd (here with a broken schema) changes nothing: package
    data is read from the package."""
    from traces import validate

    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "schema.json").write_text("{broken")
    (tmp_path / "traces" / "known_divergences.toml").write_text("broken = [")
    assert Path.cwd() == tmp_path
    validate.load_schema.cache_clear()
    validate._validator.cache_clear()
    assert validate.load_schema()["$defs"]["header"]
    assert all(validate.validate_file(p) == [] for p in tiny_run.rglob("*.jsonl"))
    from traces.reference import known_entries

    assert known_entries()
