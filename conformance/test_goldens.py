"""The live engine against the committed golden traces (``traces/golden/``).

First the goldens themselves: every golden the registry expects
(the golden sets the runner registry declares, ``specparity.runners.registry.golden_sets``) exists, matches its recorded sha256 and was
produced from the current inputs (weights, config, tokenizer, prompt, params,
runner package version and code). A stale golden fails *that* test, with the
reason, and is skipped by the comparisons — an input change is not a
divergence. Then, per golden case, the live engine run is compared round for
round with the engine golden and with each oracle golden of that case. No
oracle package is needed: the oracle goldens are read, not regenerated.
"""

from __future__ import annotations

import pytest

from conformance.conftest import run_trace
from specparity.goldens.manifest import (
    GoldenProblem,
    check_goldens,
    compare_to_goldens,
    golden_cases,
)

pytestmark = pytest.mark.golden


def _cases() -> list:
    seen: dict[str, object] = {}
    for _runner, case in golden_cases().values():
        seen.setdefault(case.case_id, case)
    return list(seen.values())


CASES = _cases()


@pytest.fixture(autouse=True, scope="module")
def _cpu_device():  # noqa: ANN202
    """Goldens are CPU traces: compared on MLX's CPU even where the GPU is MLX's default (issue 13)."""
    import mlx.core as mx

    prev = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(prev)


@pytest.fixture(scope="module")
def problems() -> list[GoldenProblem]:
    return check_goldens()


def test_goldens_are_fresh(problems: list[GoldenProblem]) -> None:
    if problems:
        lines = "\n".join(f"  {p.format()}" for p in problems)
        pytest.fail(
            f"{len(problems)} golden(s) stale, corrupt or missing:\n{lines}\n"
            "run `specparity regen --stale-only` (and review its drift report)",
            pytrace=False,
        )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.case_id)
def test_live_engine_matches_goldens(case, problems: list[GoldenProblem]) -> None:  # noqa: ANN001
    from specparity.goldens.manifest import golden_key

    bad = {p.key for p in problems}
    keys = [golden_key(r, case) for r in golden_runners_of(case)]
    if all(k in bad for k in keys):
        pytest.skip("every golden of this case is stale/corrupt/missing (see test_goldens_are_fresh)")
    comps = compare_to_goldens(run_trace("engine", case), case, problems)
    divergent = [c for c in comps if c.status == "divergent"]
    assert not divergent, f"{case.case_id}: live engine vs goldens\n" + "\n".join(
        c.format() for c in divergent)
    # Not vacuous: at least one golden was compared (a known reference behaviour is compared
    # round for round up to the engine's fallback point).
    assert any(c.status in ("identical", "known") for c in comps), [c.format() for c in comps]


def golden_runners_of(case) -> list[str]:  # noqa: ANN001
    return [r for r, c in golden_cases().values() if c.case_id == case.case_id]
