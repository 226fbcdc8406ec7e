"""dfly-mlx 0.1.0 (PyPI ``dfly-mlx``): DFly drafting on top of dflash-mlx's runtime.

Reference API: ``dfly_mlx/loading.py`` ``load_runtime(target_ref, draft_ref)`` (with ``validate_pair``) and ``dfly_mlx/generate.py`` ``generate`` returning a ``GenerationResult``.

Status: not driven yet: needs a DFly drafter checkpoint in dfly-mlx's format (its model.py) built from the zoo targets. The scoreboard lists the engine with that reason (and
the exact import error when the package does not import here) until an
adapter drives it; nothing is faked.
"""

from __future__ import annotations

from subjects import Mode
from subjects._common import dist_version, require_module
from subjects.base import SubjectCase, SubjectRun, SubjectUnsupported

NAME = "dfly-mlx"
NOT_DRIVEN = "not driven yet: needs a DFly drafter checkpoint in dfly-mlx's format (its model.py) built from the zoo targets; the installed package imports"
MODES: dict[str, Mode] = {}


def require() -> None:
    require_module("dfly_mlx.generate", NAME)


def version() -> str:
    return dist_version("dfly-mlx")


def generate(case: SubjectCase) -> SubjectRun:
    raise SubjectUnsupported(NOT_DRIVEN)
