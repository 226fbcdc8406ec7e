"""dflash-mlx 0.1.8 (PyPI ``dflash-mlx``): DFlash block-diffusion drafting with several verify modes.

Reference API: ``dflash_mlx/runtime/__init__.py`` ``stream_dflash_generate`` (engine events: TokenEvent, cycle events, SummaryEvent) over ``runtime/bundle.py`` ``load_runtime_bundle(model_ref, draft_ref, ...)``.

Status: not driven yet: a DFlash drafter checkpoint in dflash-mlx's own format (its model.py DFlash draft model with target-layer taps and mask token) has to be built from the zoo targets first. The scoreboard lists the engine with that reason (and
the exact import error when the package does not import here) until an
adapter drives it; nothing is faked.
"""

from __future__ import annotations

from subjects import Mode
from subjects._common import dist_version, require_module
from subjects.base import SubjectCase, SubjectRun, SubjectUnsupported

NAME = "dflash-mlx"
NOT_DRIVEN = "not driven yet: a DFlash drafter checkpoint in dflash-mlx's own format (its model.py DFlash draft model with target-layer taps and mask token) has to be built from the zoo targets first; the installed package imports"
MODES: dict[str, Mode] = {}


def require() -> None:
    require_module("dflash_mlx.runtime", NAME)


def version() -> str:
    return dist_version("dflash-mlx")


def generate(case: SubjectCase) -> SubjectRun:
    raise SubjectUnsupported(NOT_DRIVEN)
