"""Runner declaration: mlx-vlm 0.7.10's batched MTP and DFlash loops (``oracles/mlx_vlm_batched.py``).

A reference's other entry point: the ``BatchGenerator`` its server batches requests with. Not run
per case: each row of a batch is graded against the same row alone through the same loop
(B-invariance) and against the engine's serial run by ``specparity/grading/vlm_batched.py``
(``tox exec -e vlm -- python -m specparity.grading.vlm_batched``), one scoreboard row per loop
(``docs/scoreboard/mlx_vlm_batched.json``)."""

from __future__ import annotations

from specparity.runners.registry import Runner, oracle_availability

RUNNER = Runner(
    name="mlx_vlm_batched",
    kind="reference",
    package="mlx-vlm",
    available=oracle_availability("mlx_vlm_batched"),
    install_hint="tox -e vlm  (pip install 'specparity[vlm]': mlx-vlm==0.7.10, own environment)",
    elsewhere="mlx-vlm's batched MTP/DFlash loops (BatchGenerator) graded for B-invariance and against the "
              "engine's serial runs by `python -m specparity.grading.vlm_batched` (tox -e vlm), the scoreboard's "
              "batched-loops table; conformance/test_batched_references.py (live) and "
              "tests/test_vlm_batched_row.py (the row)",
    rank=33,
)
