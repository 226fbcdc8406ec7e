"""Runner declarations: mlx-vlm 0.7.10's MTP, assistant and DSpark loops (``oracles/mlx_vlm.py``,
``oracles/mlx_vlm_dspark.py``): run on their own model classes, so exercised by their
conformance tests and draft goldens, not per case."""

from __future__ import annotations

from specparity.runners.registry import Runner, oracle_availability

RUNNERS = (
    Runner(
        name="mlx_vlm",
        kind="reference",
        package="mlx-vlm",
        available=oracle_availability("mlx_vlm"),
        install_hint="tox -e vlm  (pip install 'specparity[vlm]': mlx-vlm==0.7.10, own environment)",
        elsewhere="mlx-vlm's MTP round loop and gemma4 assistant drafter run on their own "
                  "model classes; exercised by conformance/test_mtp_references.py and "
                  "test_assistant_references.py (tox -e vlm), not per `specparity run` case",
        rank=30,
    ),
    Runner(
        name="mlx_vlm_dspark",
        kind="reference",
        package="mlx-vlm",
        available=oracle_availability("mlx_vlm_dspark"),
        install_hint="tox -e vlm-dspark  (pip install 'specparity[vlm]': mlx-vlm==0.7.10 in its "
                     "own environment)",
        elsewhere="mlx-vlm's DSpark loop is compared by "
                  "conformance/test_dspark_references.py (tox -e vlm-dspark), not per "
                  "`specparity run` case",
        rank=60,
    ),
)
