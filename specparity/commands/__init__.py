"""Subcommands of ``specparity``: one module per command, found by discovery.

Each module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``main(args) -> int`` (0 success, 1 divergence/failure, 2 usage error). A new
command is a new module here; ``specparity/cli.py`` needs no edit.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from types import ModuleType


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _str_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


int_list, str_list, positive = _int_list, _str_list, _positive


def discover() -> list[ModuleType]:
    """Every command module, sorted by name."""
    mods = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(mod, "NAME") and hasattr(mod, "main"):
            mods.append(mod)
    return sorted(mods, key=lambda m: m.NAME)
