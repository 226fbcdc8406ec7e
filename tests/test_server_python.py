"""``tests/server_python.py``: the Python a server's own virtualenv is built on (tox server-yunshu),
found on PATH, in pyenv's versions or given; none is one line and exit 1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.server_python import ENV, find_python, main, version_of

HERE = sys.version_info[:2]


def _stub(path: Path, version: str) -> Path:
    """An executable that answers the version probe as a Python ``version`` would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def bare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No interpreter anywhere: an empty PATH folder, an empty pyenv root and home."""
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "pyenv"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(ENV, raising=False)
    return tmp_path


def test_none_found_is_one_line_and_exit_1(bare: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--min", "3.13", "--venv", str(bare / "venv")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no Python >= 3.13 found"), err
    assert f"{ENV}=" in err[0] and not (bare / "venv").exists()


def test_the_oldest_new_enough_is_taken_from_path_then_pyenv(bare: Path) -> None:
    _stub(bare / "pyenv" / "versions" / "3.12.1" / "bin" / "python3", "3.12")
    _stub(bare / "pyenv" / "versions" / "3.14.0" / "bin" / "python3", "3.14")
    assert find_python((3, 13)) == str(bare / "pyenv" / "versions" / "3.14.0" / "bin" / "python3")
    _stub(bare / "pyenv" / "versions" / "3.13.0" / "bin" / "python3", "3.13")
    assert find_python((3, 13)) == str(bare / "pyenv" / "versions" / "3.13.0" / "bin" / "python3")
    _stub(bare / "bin" / "python3.13", "3.13")  # PATH first
    assert find_python((3, 13)) == str(bare / "bin" / "python3.13")


def test_a_given_interpreter_is_used_or_refused_in_one_line(bare: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, sys.executable)
    assert find_python(HERE) == sys.executable
    with pytest.raises(LookupError, match=rf"is Python {HERE[0]}\.{HERE[1]}; this server needs Python >= 9\.0"):
        find_python((9, 0))
    monkeypatch.setenv(ENV, str(bare / "no-such-python"))
    with pytest.raises(LookupError, match="does not run as a Python interpreter"):
        find_python((3, 13))


def test_the_version_probe_reads_a_real_interpreter() -> None:
    assert version_of(sys.executable) == HERE
    assert version_of("/no/such/python") is None


def test_a_bad_minimum_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--min", "3", "--venv", "x"])
    assert exc.value.code == 2 and "give a version as MAJOR.MINOR" in capsys.readouterr().err
