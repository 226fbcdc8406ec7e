"""Oracle runners: drive a reference implementation unmodified and record traces.

Runners import nothing from ``engine`` except ``zoo`` (to build cases);
``engine`` imports nothing from here. A runner whose package is missing
reports itself unavailable with an install hint and never fakes a result.
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
    ),
    "hf_prompt_lookup": RunnerInfo(
        name="hf_prompt_lookup",
        module="oracles.hf_prompt_lookup",
        package="transformers+torch",
        install_hint="tox -e hf  (pip install 'specparity[hf]': torch==2.13.0 CPU + transformers)",
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
    ),
}


def availability(name: str) -> tuple[bool, str]:
    """(available, reason) for the runner ``name``."""
    info = RUNNERS[name]
    try:
        mod = importlib.import_module(info.module)
        mod.require()
    except OracleUnavailable as exc:
        return False, str(exc)
    return True, "ok"


def available_runners() -> list[str]:
    return [name for name in RUNNERS if availability(name)[0]]
