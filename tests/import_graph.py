"""The project's import graph from its source (``ast``; function-level imports included), for
``tests/test_import_hygiene.py``: cycles between modules and private names imported across modules.

A module is a dotted name of the project packages (``pyproject.toml`` ``[tool.importlinter]
root_packages``). An edge ``a -> b`` is any ``import b``/``from b import x`` in ``a``, at any depth
(a function-level import is still a dependency; ``if TYPE_CHECKING:`` imports are left out: they
never run). ``from pkg import mod`` where ``mod`` is a submodule is an edge to ``pkg.mod``. A
package's ``__init__`` is the package's own name.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def root_packages(root: Path = ROOT) -> list[str]:
    cfg = tomllib.loads((root / "pyproject.toml").read_text())
    return list(cfg["tool"]["importlinter"]["root_packages"])


def modules(root: Path = ROOT, packages: list[str] | None = None) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of the project packages."""
    out: dict[str, Path] = {}
    for pkg in packages if packages is not None else root_packages(root):
        for p in sorted((root / pkg).rglob("*.py")):
            rel = p.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


@dataclass(frozen=True)
class Import:
    """One imported name: ``importer`` line ``line`` imports ``name`` (None: the module itself)
    from module ``target``."""

    importer: str
    line: int
    target: str
    name: str | None

    def where(self, mods: dict[str, Path], root: Path = ROOT) -> str:
        return f"{mods[self.importer].relative_to(root)}:{self.line}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node`` except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for e in child.orelse:
                yield e
                yield from _walk(e)
            continue
        yield child
        yield from _walk(child)


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def imports(mods: dict[str, Path]) -> list[Import]:
    """Every import of a project module by a project module (the module itself and each name)."""
    out: list[Import] = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_pkg = path.name == "__init__.py"
        for node in _walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods:
                        out.append(Import(mod, node.lineno, a.name, None))
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node.level, node.module)
                if base not in mods:
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in mods:  # from pkg import submodule
                        out.append(Import(mod, node.lineno, sub, None))
                    else:
                        out.append(Import(mod, node.lineno, base, a.name))
    return out


def graph(imps: list[Import]) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for i in imps:
        if i.target != i.importer:
            g.setdefault(i.importer, set()).add(i.target)
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        work = [(v, iter(sorted(g.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return sorted(out)


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def private_imports(imps: list[Import]) -> list[Import]:
    """Imports of a private name (``_x``) or a private module (a ``_x`` part) from another module.

    A package's own modules may use its private modules (``pkg._impl`` from ``pkg.a``): private
    to the package. Anything else across a module boundary is a finding."""
    out = []
    for i in imps:
        if i.target == i.importer:
            continue
        name_private = i.name is not None and _private(i.name)
        parts = i.target.split(".")
        mod_private = next((k for k, p in enumerate(parts) if _private(p)), None)
        if mod_private is not None:
            owner = ".".join(parts[:mod_private])  # the package the private module belongs to
            if not (i.importer == owner or i.importer.startswith(owner + ".")):
                out.append(i)
                continue
        if name_private:
            out.append(i)
    return out
