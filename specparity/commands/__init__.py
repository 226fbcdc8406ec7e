"""Subcommands of ``specparity``: one module per command, found by discovery.

Each module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``main(args) -> int`` (0 success, 1 divergence/failure, 2 usage error). A new
command is a new module here; ``specparity/cli/entry.py`` needs no edit.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from specparity.cli import args

# Strict, shared flag types (specparity/cli/args.py): "1,,2", "a,,b", "0", "-3" are one-line usage errors.
int_list, str_list, positive = args.positive_int_list, args.str_list, args.positive_int


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
