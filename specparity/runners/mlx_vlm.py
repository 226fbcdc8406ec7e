"""Runner declarations: mlx-vlm 0.7.10's MTP, assistant and DSpark loops (``oracles/mlx_vlm.py``,
``oracles/mlx_vlm_dspark.py``): run on their own model classes, so exercised by their
conformance tests and draft goldens, not per case."""

from __future__ import annotations

from specparity.cases.golden_cases import assistant_draft_cases, mtp_draft_cases
from specparity.runners.draft_goldens import produce_mlx_vlm_assistant, produce_mlx_vlm_mtp
from specparity.runners.registry import GoldenSet, Runner, oracle_availability

# Draft-level goldens (specparity/runners/draft_goldens.py): mlx-vlm's drafters in their own loops.
DRAFT_CODE = ("oracles.__init__", "oracles.drafts", "oracles.mlx_vlm", "specparity.runners.draft_goldens")


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
        goldens=(GoldenSet("mlx_vlm_mtp", "mlx-vlm", DRAFT_CODE, cases=mtp_draft_cases, produce=produce_mlx_vlm_mtp),
                 GoldenSet("mlx_vlm_assistant", "mlx-vlm", DRAFT_CODE, cases=assistant_draft_cases,
                           produce=produce_mlx_vlm_assistant)),
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
