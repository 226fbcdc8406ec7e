"""Runner declarations: the native-mtp references (``oracles/mlx_vlm_native_mtp.py``: mlx-vlm
0.7.10's own drafter on a native Qwen ``mtp.*`` checkpoint; ``oracles/native_mtp_ref.py``: the
straightforward formulation for the GLM/DeepSeek layouts mlx-vlm does not implement). Both are
compared at the draft-logit level and mlx-vlm's round loop in a conformance test, not per case."""

from __future__ import annotations

from specparity.cases.golden_cases import native_draft_cases
from specparity.runners.draft_goldens import produce_mlx_vlm_native_mtp
from specparity.runners.registry import GoldenSet, Runner, oracle_availability

RUNNERS = (
    Runner(
        name="mlx_vlm_native_mtp",
        kind="reference",
        package="mlx-vlm",
        available=oracle_availability("mlx_vlm_native_mtp"),
        install_hint="tox -e vlm  (pip install 'specparity[vlm]': mlx-vlm==0.7.10, own environment)",
        elsewhere="mlx-vlm's Qwen MTP drafter loaded from the native checkpoint: draft logits and "
                  "its round loop vs the native-mtp source in conformance/test_native_mtp_vlm.py "
                  "(tox -e vlm), not per `specparity run` case",
        rank=31,
        goldens=(GoldenSet("mlx_vlm_native_mtp", "mlx-vlm",
                           ("oracles.__init__", "oracles.drafts", "oracles.mlx_vlm", "oracles.mlx_vlm_native_mtp",
                            "specparity.runners.draft_goldens"),
                           cases=native_draft_cases, produce=produce_mlx_vlm_native_mtp),),
    ),
    Runner(
        name="native_mtp_ref",
        kind="reference",
        package="mlx-lm",
        available=oracle_availability("native_mtp_ref"),
        install_hint="nothing to install (mlx-lm's decoder layers)",
        elsewhere="draft rows recomputed from scratch vs the native-mtp source in "
                  "conformance/test_native_mtp_reference.py (default run), not per `specparity "
                  "run` case",
        rank=32,
    ),
)
