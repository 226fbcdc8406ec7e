"""Hostile input to ``tools/mutation.py`` (issue 41): a broken catalogue, an entry whose
``file`` leads outside the tree, a ``--timeout`` that is not a number of seconds, an ``--out``
holding a user's files, and a ``kill -9`` in the middle of a plant.

Each refusal: exit 2, one ``error:`` line naming what is wrong, nothing written anywhere (the
``--out`` folder not even created), the tree's files byte-identical.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, one_error, snapshot

sys.path.insert(0, str(ROOT / "tools"))
import mutation  # noqa: E402

GOOD = '''[[mutation]]
id = "min-tokens-inclusive"
file = "engine/pipeline.py"
find = "return bool(self.eos_ids) and position < self.min_tokens"
replace = "return bool(self.eos_ids) and position <= self.min_tokens"
what = "EOS suppressed one position past min_tokens"
tests = ["tests/test_pipeline.py"]
k = "min_tokens"
'''


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = mutation.main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def _never_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: object, **k: object) -> None:
        raise AssertionError("a mutation ran before the refusal")

    monkeypatch.setattr(mutation, "run", boom)
    monkeypatch.setattr(mutation, "scratch_tree", boom)


BROKEN = {
    "toml syntax": (GOOD.replace('k = "min_tokens"', 'k = "min_tokens'), ["not valid TOML"]),
    "not utf-8": (GOOD.replace("EOS suppressed", "EOS \udcff suppressed"), ["not UTF-8", "line 6"]),
    "tests a string": (GOOD.replace('tests = ["tests/test_pipeline.py"]', 'tests = "tests/test_pipeline.py"'),
                       ["min-tokens-inclusive", "'tests'", "array of test paths"]),
    "id a number": (GOOD.replace('id = "min-tokens-inclusive"', "id = 5"), ["mutation #1", "'id'", "string"]),
    "find a table": (GOOD.replace('find = "return', 'find = {a = 1}\nnotes = "return'), ["unknown field"]),
    "tests empty": (GOOD.replace('["tests/test_pipeline.py"]', "[]"), ["no tests"]),
    "tests an option": (GOOD.replace('["tests/test_pipeline.py"]', '["--co"]'), ["is an option"]),
    "missing replace": ("\n".join(ln for ln in GOOD.splitlines() if not ln.startswith("replace")),
                        ["missing field", "replace"]),
    "mutation not tables": ('mutation = ["a"]\n', ["array of tables"]),
    "stray key": ('title = "x"\n' + GOOD, ["unknown top-level key", "title"]),
    "duplicate ids": (GOOD + "\n" + GOOD, ["duplicate ids"]),
    "file absolute": (GOOD.replace('file = "engine/pipeline.py"', f'file = "{ROOT / "engine" / "pipeline.py"}"'),
                      ["not a path relative to the tree"]),
    "file dotdot": (GOOD.replace('file = "engine/pipeline.py"', 'file = "../outside/pipeline.py"'),
                    ["leads outside the tree"]),
    "file inner dotdot": (GOOD.replace('file = "engine/pipeline.py"', 'file = "engine/../../x.py"'),
                          ["leads outside the tree"]),
    "file home": (GOOD.replace('file = "engine/pipeline.py"', 'file = "~/x.py"'), ["not a path relative"]),
    "file untracked": (GOOD.replace('file = "engine/pipeline.py"', 'file = "engine/no_such_file.py"'),
                       ["not a file of this tree"]),
    "test outside": (GOOD.replace('["tests/test_pipeline.py"]', '["/etc/passwd"]'), ["not a path relative"]),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_catalogue_is_one_line(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    text, must = BROKEN[name]
    cat = tmp_path / "cat.toml"
    cat.write_bytes(text.encode("utf-8", "surrogateescape"))
    _never_run(monkeypatch)
    before = _digest(ROOT / "engine" / "pipeline.py")
    out = tmp_path / "out"
    rc, stdout, err = _main(["--catalogue", cat, "--out", out], capsys)
    assert rc == 2, err
    one_error(err, str(cat), *must)
    assert stdout == "" and not out.exists()
    assert _digest(ROOT / "engine" / "pipeline.py") == before


def test_a_link_leading_outside_the_tree_is_refused(tmp_path: Path) -> None:
    """A link inside a tree whose target is outside it: the resolved path is checked."""
    tree = tmp_path / "tree"
    (tree / "engine").mkdir(parents=True)
    victim = tmp_path / "victim.py"
    victim.write_text("x = 1\n")
    (tree / "engine" / "link.py").symlink_to(victim)
    with pytest.raises(mutation.CatalogueError, match="outside the tree"):
        mutation.check_file(Path("cat.toml"), "mutation #1 (x)", "engine/link.py", root=tree)
    assert victim.read_text() == "x = 1\n"


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "ten"])
def test_a_bad_timeout_is_one_line(value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    _never_run(monkeypatch)
    rc, _, err = _main(["--timeout", value, "--out", tmp_path / "out"], capsys)
    assert rc == 2
    one_error(err, "--timeout", value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("plant", ["mutation.md", "notes.txt"])
def test_out_never_overwrites_a_users_file(plant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A user's ``mutation.md`` (or any file no specparity command wrote) in ``--out``: refused
    before any mutation runs, every byte kept, no lock or marker left."""
    cat = tmp_path / "cat.toml"
    cat.write_text(GOOD)
    out = tmp_path / "out"
    out.mkdir()
    (out / plant).write_text("my own notes\n")
    before = snapshot(out)
    _never_run(monkeypatch)
    rc, _, err = _main(["--catalogue", cat, "--out", out], capsys)
    assert rc == 2, err
    one_error(err, plant)
    assert snapshot(out) == before


def test_out_written_through_the_ownership_mechanism(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The reports are listed in the folder's marker, and a second run replaces its own files."""
    import json

    cat = tmp_path / "cat.toml"
    cat.write_text(GOOD)
    out = tmp_path / "out"
    monkeypatch.setattr(mutation, "run", lambda muts, timeout: [
        mutation.Outcome(m.id, m.what, "caught", "tests/x.py::t") for m in muts])
    for _ in range(2):
        rc, stdout, err = _main(["--catalogue", cat, "--out", out], capsys)
        assert rc == 0, err
        assert "1/1 planted bugs caught" in stdout
    marker = json.loads((out / ".specparity-run.json").read_text())
    assert sorted(marker["added"]) == ["mutation.json", "mutation.md"]
    assert sorted(p.name for p in out.iterdir()) == [".specparity-run.json", "mutation.json", "mutation.md"]


KILLED = r'''
import sys, time
from pathlib import Path
sys.path.insert(0, {tools!r})
import mutation
calls = []
def slow(tree, m, timeout):
    calls.append(1)
    if len(calls) == 1:
        return 0, "clean"
    Path({ready!r}).write_text(str(tree))
    time.sleep(600)
mutation._pytest = slow
sys.exit(mutation.main(["--catalogue", {cat!r}, "--out", {out!r}]))
'''


def test_kill_9_mid_plant_leaves_the_tree_untouched(tmp_path: Path) -> None:
    """A plant is written only into the scratch copy: killed while planted, the tree is
    byte-identical, and the next run removes the killed run's copy (its pid is gone)."""
    cat = tmp_path / "cat.toml"
    cat.write_text(GOOD)
    ready = tmp_path / "ready"
    scratch_base = tmp_path / "tmp"
    scratch_base.mkdir()
    real = ROOT / "engine" / "pipeline.py"
    before = _digest(real)
    code = KILLED.format(tools=str(ROOT / "tools"), ready=str(ready), cat=str(cat), out=str(tmp_path / "out"))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                            env=dict(os.environ, TMPDIR=str(scratch_base)))
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, "the run ended before planting"
            assert time.monotonic() < deadline, "never planted"
            time.sleep(0.1)
        tree = Path(ready.read_text())
        assert "position <= self.min_tokens" in (tree / "engine" / "pipeline.py").read_text()  # planted there
        assert _digest(real) == before, "the plant reached the working tree"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert _digest(real) == before
    assert tree.exists()
    gone = mutation.remove_stale_scratch(scratch_base)
    assert gone == [tree] and not tree.exists()
