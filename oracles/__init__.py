"""Oracle runners: drive a reference implementation unmodified and record traces.

Runners import nothing from ``engine`` (``zoo`` only, to build cases);
``engine`` imports nothing from here. A runner whose package is missing
reports itself unavailable (its module's ``require()`` says what is missing;
the install hint is written once, in its runner declaration, and the registry
adds it to every such message) and never fakes a result.

Which references exist, what each implements and how a case is run with it
is declared once, in the runner registry of the ``specparity`` layer
(``specparity/runners/``, one module per runner; docs/runners.md): this
package only drives the references.
"""

from __future__ import annotations

import importlib


class OracleUnavailable(RuntimeError):
    """The reference package of a runner is not installed."""


def availability(module: str) -> tuple[bool, str]:
    """(available, what is missing) of the reference driven by ``oracles.<module>`` (the install
    hint is its runner declaration's: ``specparity.runners.registry.availability``)."""
    if not module.isidentifier():
        raise ValueError(f"unknown reference module {module!r}")
    try:
        mod = importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as exc:
        if exc.name == f"{__name__}.{module}":
            raise ValueError(f"unknown reference module oracles.{module}") from None
        raise
    require = getattr(mod, "require", None)
    if require is None:
        raise ValueError(f"oracles.{module} drives no reference (no require())")
    try:
        require()
    except OracleUnavailable as exc:
        return False, str(exc)
    return True, "ok"
