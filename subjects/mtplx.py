"""mtplx 2.12.2 (PyPI ``mtplx``): native MTP heads for Qwen3-Next-style models.

Reference: the package's generation API over MTP heads of Qwen3-Next-style targets (the zoo ``qwen35`` target is the nearest architecture). Its timing module loads a macOS library at import.

Status: not driven yet: needs a Qwen3-Next-style target with native MTP head weights in mtplx's layout and a stub for the macOS timing library its timing module loads at import on Linux. The scoreboard lists the engine with that reason (and
the exact import error when the package does not import here) until an
adapter drives it; nothing is faked.
"""

from __future__ import annotations

from subjects import Mode
from subjects._common import dist_version, require_module
from subjects.base import SubjectCase, SubjectRun, SubjectUnsupported

NAME = "mtplx"
NOT_DRIVEN = "not driven yet: needs a Qwen3-Next-style target with native MTP head weights in mtplx's layout and a stub for the macOS timing library its timing module loads at import on Linux"
MODES: dict[str, Mode] = {}


def require() -> None:
    require_module("mtplx", NAME)


def version() -> str:
    return dist_version("mtplx")


def generate(case: SubjectCase) -> SubjectRun:
    raise SubjectUnsupported(NOT_DRIVEN)
