"""No import cycles and no private names imported across modules, in every project package
(``pyproject.toml`` ``[tool.importlinter] root_packages``), function-level imports included
(``tests/import_graph.py``: the graph by ``ast``; ``lint-imports`` checks the layers, this the rest).

A cycle hides an ownership question (``GenerationParams`` lived in the executor, one of its
consumers: ``engine/params.py`` now); a private name imported elsewhere (``_x``, or a module
``_x``) is an API nobody declared. The fix is a module of its own or a public name, never an
entry below. A package's ``__init__`` re-exporting its modules, which import the package back
(``zoo`` and ``zoo.build``, ``engine.sources`` and ``engine.sources.kind``), is a facade, not a
cycle: an import of one's own ancestor package is not counted.

Each allowlist entry names who removes it; an entry that no longer matches fails the test, so
the lists only shrink.
"""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import ROOT, Import, cycles, graph, imports, modules, private_imports

# Cycles allowed for now, each with the reason and who removes it (none today).
CYCLES_ALLOWED: dict[tuple[str, ...], str] = {}

# (importer, module, name): private imports being removed right now, or that cannot change.
PRIVATE_ALLOWED: dict[tuple[str, str, str | None], str] = {}


def _own_package_edges_dropped(imps: list[Import]) -> list[Import]:
    """Imports of one's own ancestor package (a facade ``__init__``) left out of the cycle graph."""
    return [i for i in imps if not i.importer.startswith(i.target + ".")]


def find(root: Path = ROOT) -> tuple[list[list[str]], list[Import], dict[str, Path]]:
    mods = modules(root)
    imps = imports(mods)
    return cycles(graph(_own_package_edges_dropped(imps))), private_imports(imps), mods


def _cycle_problems(found: list[list[str]]) -> list[str]:
    got = {tuple(c) for c in found}
    out = [f"import cycle: {' <-> '.join(c)} (a shared type or helper belongs in a module of its own)"
           for c in sorted(got - set(CYCLES_ALLOWED))]
    out += [f"allowlisted cycle {' <-> '.join(c)} is gone: drop it from CYCLES_ALLOWED" for c in
            sorted(set(CYCLES_ALLOWED) - got)]
    return out


def _private_problems(found: list[Import], mods: dict[str, Path], root: Path = ROOT) -> list[str]:
    got = {(i.importer, i.target, i.name): i for i in found}
    out = [f"{i.where(mods, root)}: imports private {i.target}{'.' + i.name if i.name else ''} from "
           f"another module (make it public, or move it to a module both use)"
           for k, i in sorted(got.items()) if k not in PRIVATE_ALLOWED]
    out += [f"allowlisted private import {k} is gone: drop it from PRIVATE_ALLOWED"
            for k in sorted(set(PRIVATE_ALLOWED) - set(got), key=str)]
    return out


def test_no_import_cycles() -> None:
    found, _, _ = find()
    assert _cycle_problems(found) == []


def test_no_private_imports_across_modules() -> None:
    _, found, mods = find()
    assert _private_problems(found, mods) == []


# ------------------------------------------------------------------ plants


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text('[tool.importlinter]\nroot_packages = ["pa", "pb"]\n')
    for rel, text in {"pa/__init__.py": "", "pb/__init__.py": "", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_a_function_level_cycle_is_caught_with_both_modules_named(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "pa/x.py": "from pb.y import Y\n",
        "pb/y.py": "class Y: ...\n\ndef f():\n    from pa.x import Y  # a function-level import\n    return Y\n",
        "pa/t.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pa.x import Y\n",
    })
    found, _, _ = find(root)
    assert found == [["pa.x", "pb.y"]]
    assert _cycle_problems(found) == [
        "import cycle: pa.x <-> pb.y (a shared type or helper belongs in a module of its own)"]


def test_a_package_facade_is_not_a_cycle(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"pa/__init__.py": "from pa.k import K\n", "pa/k.py": "import pa\nK = 1\n"})
    assert find(root)[0] == []


def test_private_names_and_modules_across_modules_are_caught_relative_imports_too(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "pa/x.py": "def _helper(): ...\ndef public(): ...\n",
        "pa/_impl.py": "def f(): ...\n",
        "pa/y.py": "from ._impl import f\nfrom .x import public\n",  # its own package's private module: fine
        "pb/z.py": "def g():\n    from pa.x import _helper\n    from pa._impl import f\n",
    })
    _, found, mods = find(root)
    got = [(i.importer, i.target, i.name) for i in found]
    assert got == [("pb.z", "pa.x", "_helper"), ("pb.z", "pa._impl", "f")], got
    msgs = _private_problems(found, mods, root)
    assert msgs[:2] == ["pb/z.py:3: imports private pa._impl.f from another module "
                        "(make it public, or move it to a module both use)",
                        "pb/z.py:2: imports private pa.x._helper from another module "
                        "(make it public, or move it to a module both use)"], msgs
