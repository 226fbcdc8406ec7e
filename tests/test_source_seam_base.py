"""``engine.seam.DraftSourceBase``: every optional source hook with its default (issue 34).

The executor looks each optional hook up with ``getattr(source, name, None)``; the base
class's defaults must read exactly as a source without the attribute, so inheriting the
base changes no run. These tests drive the real executor on a zoo model with a model-free
source (``tests/fakes.py``) with and without the base, on the paths each hook decides:
quantized KV (``set_kv_quantization`` None: plain decode, reason ``quantized-kv``),
``rotating="exact"`` (``set_rotating`` a no-op), every round (``rollback_guard`` None,
``last_confidence`` None, ``draft_array`` None).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from fakes import FakeProvider, FakeSource

import zoo
from engine.executor import GenerationParams, spec_generate
from engine.seam import OPTIONAL_HOOKS, DraftSource, DraftSourceBase

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENGINE = Path(__file__).resolve().parents[1] / "engine"


class BaseFake(FakeSource, DraftSourceBase):
    """The tests' model-free source on the base class (every hook its default)."""


BaseFake.__name__ = "FakeSource"  # a fallback's detail names the source's class: same bytes


def _copy_policy(src: FakeSource, feed: list[int], n: int, step_base: int) -> list[int]:
    return [feed[-1]] * n  # repeat the last fed token: some accepts, some rejections


@pytest.fixture(scope="module")
def kv_target() -> Any:
    from specparity.runners import load_model

    return load_model(str(zoo.model_dir(zoo.KV_TARGET)))


def _strip(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "time_s"} for r in records]


def _run(target: Any, source: FakeSource, **kw: Any) -> list[dict[str, Any]]:
    params = GenerationParams(max_tokens=12, gamma=3, eos_ids=(), **kw)
    ids = list(zoo.prompt("nat-00").token_ids)
    return _strip(spec_generate(target.model, FakeProvider(source), ids, params).records)


def _first_difference(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> str | None:
    for i, (ra, rb) in enumerate(zip(a, b, strict=False)):
        if ra != rb:
            field = next(k for k in sorted(set(ra) | set(rb)) if ra.get(k) != rb.get(k))
            return f"record {i} ({ra.get('type')}) field {field!r}: {ra.get(field)!r} != {rb.get(field)!r}"
    return None if len(a) == len(b) else f"record count {len(a)} != {len(b)}"


# ------------------------------------------------------------------ the defaults read as absent

PATHS = {
    "plain-rounds": {},
    "quantized-kv": {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0},
    "rotating-exact": {"rotating": "exact"},
}


@pytest.mark.parametrize("path", PATHS)
def test_base_defaults_run_as_a_source_without_the_hooks(kv_target: Any, path: str) -> None:
    bare = _run(kv_target, FakeSource(_copy_policy), **PATHS[path])
    based = _run(kv_target, BaseFake(_copy_policy), **PATHS[path])
    assert _first_difference(bare, based) is None, f"{path}: {_first_difference(bare, based)}"
    if path == "quantized-kv":  # the hook's None is a decision: no speculation over quantized KV
        steps = [r for r in based if r["type"] != "prefill"]
        assert steps and all(r["type"] == "plain" and r["reason"] == "quantized-kv" for r in steps), steps[:2]
    else:
        rounds = [r for r in based if r["type"] == "round"]
        assert rounds and all(r.get("confidence") is None for r in rounds)


def test_a_wrong_default_is_caught(kv_target: Any) -> None:
    """Planted: a base whose ``set_kv_quantization`` default were a no-op method (not None)
    would speculate over quantized KV; the comparison above names the first difference."""

    class NoOpKV(BaseFake):
        def set_kv_quantization(self, q: Any) -> None:
            pass

    kv = PATHS["quantized-kv"]
    why = _first_difference(_run(kv_target, FakeSource(_copy_policy), **kv), _run(kv_target, NoOpKV(_copy_policy), **kv))
    # the planted default speculates: its prefill already feeds the drafter (quantized-kv: not)
    assert why is not None and why.startswith("record 0 (prefill) field 'drafter_tokens': None != ["), why


def test_base_keeps_the_protocol() -> None:
    src = BaseFake(_copy_policy)
    assert isinstance(src, DraftSource)
    for hook in OPTIONAL_HOOKS:
        assert hasattr(DraftSourceBase, hook), hook
    assert src.rollback_guard([1], 3) is None and src.set_rotating("exact") is None
    assert src.draft_array is None and src.last_confidence is None and src.set_kv_quantization is None


# ------------------------------------------------------------------ every hook has a default


def _hooks_looked_up(tree: ast.AST) -> set[str]:
    """Names ``getattr(source, "<name>", ...)`` looks up (the optional-hook reads)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "source"
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            out.add(node.args[1].value)
    return out - {"__dict__"}


def test_every_hook_the_engine_looks_up_has_a_default() -> None:
    """A hook the executor (or any engine module) reads with ``getattr(source, ...)`` is in
    ``OPTIONAL_HOOKS`` and on the base class, so a new hook cannot arrive without its default."""
    looked: dict[str, set[str]] = {}
    for p in sorted(ENGINE.rglob("*.py")):
        for h in _hooks_looked_up(ast.parse(p.read_text())):
            looked.setdefault(h, set()).add(str(p.relative_to(ENGINE.parent)))
    missing = {h: sorted(w) for h, w in looked.items() if h not in OPTIONAL_HOOKS or not hasattr(DraftSourceBase, h)}
    assert not missing, f"optional source hooks without a DraftSourceBase default: {missing}"


def test_the_hook_scan_sees_a_new_hook() -> None:
    tree = ast.parse("def f(source):\n    return getattr(source, 'brand_new_hook', None)\n")
    assert _hooks_looked_up(tree) == {"brand_new_hook"}


# ------------------------------------------------------------------ every source inherits it


def _source_classes(module: ModuleType) -> list[type]:
    """Classes defined in ``module`` with the DraftSource shape (prefill, draft, commit)."""
    return [c for _, c in inspect.getmembers(module, inspect.isclass)
            if c.__module__ == module.__name__ and all(callable(getattr(c, m, None)) for m in
                                                       ("prefill", "draft", "commit"))]


def _not_on_base(module: ModuleType) -> list[str]:
    return [c.__name__ for c in _source_classes(module) if not issubclass(c, DraftSourceBase)]


def test_every_declared_kind_source_inherits_the_base() -> None:
    from engine.sources import all_kinds

    seen: dict[str, list[str]] = {}
    for kind in all_kinds():
        module = importlib.import_module(kind.provider.__module__)
        seen[kind.name] = [c.__name__ for c in _source_classes(module)]
        assert seen[kind.name], f"{kind.name}: no DraftSource class found in {module.__name__}"
        assert not _not_on_base(module), f"{kind.name}: {_not_on_base(module)} do not inherit DraftSourceBase"


def test_a_source_off_the_base_is_caught() -> None:
    """Planted: a module declaring one source on the base and one off it."""
    toy = ModuleType("toy_kind")
    exec("class Off:\n    def prefill(self): ...\n    def draft(self): ...\n    def commit(self): ...\n"
         "class On(Base, Off): ...\nclass NotASource:\n    def draft(self): ...\n",
         {"Base": DraftSourceBase, "__name__": "toy_kind"}, toy.__dict__)
    assert sorted(c.__name__ for c in _source_classes(toy)) == ["Off", "On"]
    assert _not_on_base(toy) == ["Off"]
