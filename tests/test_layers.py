"""The package layers (README "What is here", pyproject ``[tool.importlinter]``).

``lint-imports`` runs in ``.ci/run`` and ``tox -e lint``; these tests show that
the contracts hold on the tree and that each one fails, with a message naming
the import, when a forbidden import is planted in a copy of the tree.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("traces", "engine", "zoo", "oracles", "subjects", "reports", "specparity")
LINT = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")

pytestmark = pytest.mark.skipif(not Path(LINT).exists(), reason="import-linter not installed (pip install import-linter)")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LINT, "--config", str(root / "pyproject.toml")], cwd=root,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the packages' sources (no data) and pyproject.toml."""
    root = tmp_path_factory.mktemp("layers")
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    for pkg in PACKAGES:
        for src in (ROOT / pkg).rglob("*.py"):
            dst = root / src.relative_to(ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    return root


def test_the_tree_keeps_every_contract(tree: Path) -> None:
    res = _lint(tree)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


@pytest.mark.parametrize(
    ("module", "planted", "message"),
    [
        ("engine/telemetry.py", "import specparity.goldens.manifest", "engine is not allowed to import specparity"),
        ("engine/seam.py", "import zoo", "engine is not allowed to import zoo"),
        ("oracles/recording.py", "import engine.executor", "oracles is not allowed to import engine"),
        ("subjects/checks.py", "import engine.executor", "subjects is not allowed to import engine"),
        ("traces/records.py", "import reports.stats", "traces is not allowed to import reports"),
        ("zoo/pinned.py", "import oracles.mlx_lm", "zoo is not allowed to import oracles"),
        ("reports/stats.py", "import specparity.measure.ab", "reports is not allowed to import specparity"),
        # inside specparity/: the split's contracts
        ("specparity/jobs/batched.py", "import specparity.commands.run",
         "specparity.jobs is not allowed to import specparity.commands"),
        ("specparity/cases/prompts.py", "import specparity.runners.registry",
         "specparity.cases is not allowed to import specparity.runners"),
        ("specparity/runners/registry.py", "import specparity.jobs.run",
         "specparity.runners is not allowed to import specparity.jobs"),
        ("specparity/goldens/manifest.py", "import specparity.grading.engines",
         "specparity.goldens is not allowed to import specparity.grading"),
        ("specparity/jobs/batched.py", "import specparity.measure.bench",
         "specparity.jobs is not allowed to import specparity.measure"),
        ("specparity/measure/ab.py", "import specparity.jobs.run",
         "specparity.measure is not allowed to import specparity.jobs"),
    ],
)
def test_a_planted_forbidden_import_is_named(tree: Path, module: str, planted: str, message: str) -> None:
    path = tree / module
    original = path.read_text()
    try:
        path.write_text(original + f"\n{planted}  # planted\n")
        res = _lint(tree)
    finally:
        path.write_text(original)
    assert res.returncode != 0, f"{planted} in {module} was not caught:\n{res.stdout}"
    assert message in res.stdout, res.stdout
    assert module.removesuffix(".py").replace("/", ".") in res.stdout, res.stdout


def test_the_readme_layout_names_the_same_layers() -> None:
    """README "What is here" lists the packages in the order the layers contract has."""
    import re
    import tomllib

    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contract if c["type"] == "layers")["layers"]
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (.+?) \|", readme, flags=re.M)
    by_level: dict[int, set[str]] = {}
    for level, parts in rows:
        by_level.setdefault(int(level), set()).update(re.findall(r"`(\w+)/`", parts))
    readme_order = [by_level[k] for k in sorted(by_level)]
    contract_order = [{p.strip() for p in layer.split("|")} for layer in reversed(layers)]
    assert readme_order == contract_order, (readme_order, contract_order)


# No twins left (the served job is specparity/grading/http_servers.py, its checks subjects/served/,
# its rows subjects/server_rows.py); a name allowed here must be a real, explained exception.
TWINS_ALLOWED: set[str] = set()


def shared_basenames(root: Path) -> list[str]:
    """Module file names found both under ``specparity/`` (any depth) and in ``subjects/``."""
    ours = {p.name for p in (root / "specparity").rglob("*.py")} - {"__init__.py", "__main__.py"}
    return sorted(ours & {p.name for p in (root / "subjects").rglob("*.py")})


def test_no_module_basename_is_shared_between_specparity_and_subjects() -> None:
    """ARCHITECTURE: "No file name is shared with subjects/": a newcomer finds a part in one guess.
    An allowed twin that is gone is reported too (the allow-list only shrinks)."""
    shared = set(shared_basenames(ROOT))
    assert shared <= TWINS_ALLOWED, f"{sorted(shared - TWINS_ALLOWED)}: named in specparity/ and subjects/ alike"
    assert TWINS_ALLOWED <= shared, f"{sorted(TWINS_ALLOWED - shared)}: no longer twins, drop from TWINS_ALLOWED"


def test_a_planted_twin_is_named(tmp_path: Path) -> None:
    for rel in ("specparity/grading/checks.py", "subjects/checks.py", "specparity/__init__.py",
                "subjects/__init__.py", "specparity/cli/__main__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert shared_basenames(tmp_path) == ["checks.py"]
