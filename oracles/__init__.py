"""Oracle runners: drive a reference implementation unmodified and record traces.

Runners import nothing from ``engine`` except ``zoo`` (to build cases);
``engine`` imports nothing from here. A runner whose package is missing
reports itself unavailable with an install hint and never fakes a result.

:func:`availability` says whether a reference can be imported here;
:func:`run_availability` says whether ``specparity run`` can use it: a
reference that is not a per-case runner (``RunnerInfo.not_a_case_runner``)
is reported as skipped with where it is exercised instead, never dispatched
(``unknown runner``) just because its package happens to be installed.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


class OracleUnavailable(RuntimeError):
    """The reference package of a runner is not installed."""


@dataclass(frozen=True)
class RunnerInfo:
    name: str
    module: str
    package: str
    install_hint: str
    not_a_case_runner: str | None = None
    """Why ``specparity run`` does not run it per case (and where it is tested); None: it does."""


RUNNERS: dict[str, RunnerInfo] = {
    "mlx_lm": RunnerInfo(
        name="mlx_lm",
        module="oracles.mlx_lm",
        package="mlx-lm",
        install_hint="pip install 'specparity[oracles]'  (mlx-lm>=0.32,<0.33)",
    ),
    "optiq": RunnerInfo(
        name="optiq",
        module="oracles.optiq",
        package="mlx-optiq",
        install_hint="tox -e optiq  (mlx-optiq pins transformers<5.13: its own environment)",
    ),
    "mlx_vlm": RunnerInfo(
        name="mlx_vlm",
        module="oracles.mlx_vlm",
        package="mlx-vlm",
        install_hint="tox -e vlm  (pip install 'specparity[vlm]': mlx-vlm==0.7.10, own environment)",
        not_a_case_runner="mlx-vlm's MTP round loop and gemma4 assistant drafter run on their own "
                          "model classes; exercised by conformance/test_mtp_references.py and "
                          "test_assistant_references.py (tox -e vlm), not per `specparity run` case",
    ),
    "hf_prompt_lookup": RunnerInfo(
        name="hf_prompt_lookup",
        module="oracles.hf_prompt_lookup",
        package="transformers+torch",
        install_hint="tox -e hf  (pip install 'specparity[hf]': torch==2.13.0 CPU + transformers)",
        not_a_case_runner="the transformers prompt-lookup reference is compared by "
                          "conformance/test_ngram_references.py (tox -e hf), not per "
                          "`specparity run` case",
    ),
    "deepspec": RunnerInfo(
        name="deepspec",
        module="oracles.deepspec",
        package="deepspec (local checkout, DEEPSPEC_PATH)",
        install_hint="tox -e deepspec with DEEPSPEC_PATH=<DeepSpec checkout>  (torch==2.13.0 CPU + transformers==5.10.2)",
    ),
    "mlx_vlm_dspark": RunnerInfo(
        name="mlx_vlm_dspark",
        module="oracles.mlx_vlm_dspark",
        package="mlx-vlm",
        install_hint="tox -e vlm-dspark  (pip install 'specparity[vlm]': mlx-vlm==0.7.10 in its own environment)",
        not_a_case_runner="mlx-vlm's DSpark loop is compared by "
                          "conformance/test_dspark_references.py (tox -e vlm-dspark), not per "
                          "`specparity run` case",
    ),
}


def availability(name: str) -> tuple[bool, str]:
    """(available, reason) for the runner ``name``."""
    if name not in RUNNERS:
        raise ValueError(f"unknown runner {name!r}; known: {', '.join(RUNNERS)}")
    info = RUNNERS[name]
    try:
        mod = importlib.import_module(info.module)
        mod.require()
    except OracleUnavailable as exc:
        return False, str(exc)
    return True, "ok"


def run_availability(name: str) -> tuple[bool, str]:
    """(usable by ``specparity run``, reason): importable AND a per-case runner."""
    if name not in RUNNERS:
        raise ValueError(f"unknown runner {name!r}; known: {', '.join(RUNNERS)}")
    info = RUNNERS[name]
    if info.not_a_case_runner is not None:
        return False, f"skipped by `specparity run`: {info.not_a_case_runner}"
    return availability(name)


def case_runners() -> list[str]:
    """The references ``specparity run`` dispatches per case (importable or not)."""
    return [name for name, info in RUNNERS.items() if info.not_a_case_runner is None]


def available_runners() -> list[str]:
    return [name for name in RUNNERS if availability(name)[0]]
