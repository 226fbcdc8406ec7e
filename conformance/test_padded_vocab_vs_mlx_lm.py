"""Engine two-model vs mlx-lm ``speculative_generate_step`` on a padded-vocabulary pair.

mlx-lm 0.32.2 ``mlx_lm/generate.py`` ``speculative_generate_step`` runs a target and a
drafter with one tokenizer but different embedding row counts (it checks nothing); the
engine accepts the pair (``engine.sources.two_model.check_compatible``) and must match it
round for round (§3 row ``two-model``): a phi3 target padded to 128 rows (Qwen-like:
``tests/foreign.py`` ``write_padded``) with its 112-row twin, and the reverse.
"""

from __future__ import annotations

import pytest

from conformance.conftest import require_oracle, run_trace, witness
from specparity.cases.case import Case
from tests import foreign
from traces.reference import compare_with_reference


@pytest.fixture(scope="module")
def padded_cases(tmp_path_factory: pytest.TempPathFactory) -> list[Case]:
    from specparity.cases.suite import PairSpec, suite_cases

    root = tmp_path_factory.mktemp("padded")
    foreign.build(root, ("phi3",))
    pad_t = foreign.write_padded("phi3", root / "phi3-pad128", 128)
    pad_d = foreign.write_padded("phi3", root / "phi3-twin-pad144", 144, drafter=True)
    specs = [PairSpec(target=str(t), drafter=str(d), gammas=(1, 3), max_tokens=16,
                      prompts_file=root / "prompts.jsonl")
             for t, d in ((pad_t, root / "phi3-tiny-twin"), (root / "phi3-tiny", pad_d))]
    return suite_cases(specs)


@pytest.mark.oracle
def test_padded_pair_round_for_round(padded_cases: list[Case]) -> None:
    require_oracle("mlx_lm")
    assert len(padded_cases) == 16
    drafted = 0
    for case in padded_cases:
        eng = run_trace("engine", case)
        verdict = compare_with_reference(eng, run_trace("mlx_lm", case), "mlx_lm", witness=witness())
        assert verdict.status == "identical", f"{case.case_id}: engine vs mlx-lm\n{verdict.format()}"
        drafted += sum(len(r["drafts"]) for r in eng.rounds)
    assert drafted > 0

