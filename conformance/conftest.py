"""Shared fixtures for the conformance suite.

Models are loaded once per session (``specparity.runners.load_model`` caches
them); the case matrix is small by default and grows with
``SPECPARITY_PROMPTS=all`` (the nightly setting). ``--suite FILE`` runs the
user-pair tests (``test_user_suite.py``) on a suite's pairs.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest

from traces.io import Trace


def matrix_prompt_ids(default: int = 6) -> list[str]:
    import zoo
    from specparity.cases.case import pick_prompts

    ids = [p.id for p in zoo.prompts()]
    want = os.environ.get("SPECPARITY_PROMPTS", str(default))
    return ids if want == "all" else pick_prompts(ids, int(want))


def run_trace(runner: str, case) -> Trace:  # noqa: ANN001
    from specparity.runners import run_case

    return Trace.from_records(run_case(runner, case))


@functools.cache
def witness() -> Any:
    """The numerics witness (``engine/witness.py``) on the session's cached models.

    Pass it to ``diff_traces`` / ``compare_with_reference`` wherever a class
    decides the outcome: a flip is ``numerics`` only when each run's own
    arithmetic path reproduces its token (traces/INTERPRETING.md).
    """
    from specparity.jobs.run import numerics_witness

    return numerics_witness()


def require_oracle(name: str) -> None:
    """Skip unless the reference runner ``name`` is available (the reason ends with its install hint)."""
    from specparity.runners.registry import availability

    ok, why = availability(name)
    if not ok:
        pytest.skip(f"oracle {name} unavailable: {why}")


@pytest.fixture(scope="module")
def oracle_ok() -> None:
    """The mlx-lm oracle is installed (else each test asking for it is skipped, with the reason)."""
    require_oracle("mlx_lm")


# ------------------------------------------------------------------ the user's pairs (--suite)
#
# ``pytest conformance/ -m oracle --suite FILE`` (or ``SPECPARITY_SUITE=FILE``): the
# EOS, planted-bug, sampled and rotating tests of ``conformance/test_user_suite.py`` run
# on every pair of a suite TOML as ``specparity run --suite`` reads it
# (``specparity.cases.suite.load_suite``), zoo pairs and model paths alike; the zoo tests run
# as always. A test requesting the ``user_pair`` fixture is parametrized over the pairs.


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--suite", default=None, metavar="FILE",
                     help="a specparity suite TOML: run conformance/test_user_suite.py's EOS, "
                          "planted-bug, sampled and rotating tests on its pairs too "
                          "(default: $SPECPARITY_SUITE)")


def suite_option(config: pytest.Config) -> str | None:
    return config.getoption("--suite", default=None) or os.environ.get("SPECPARITY_SUITE") or None


def pytest_report_header(config: pytest.Config) -> list[str]:
    path = suite_option(config)
    return [f"specparity user suite: {path}"] if path else []


class UserPair:
    """One suite pair: its spec and its cases (``specparity.cases.suite.pair_cases``)."""

    def __init__(self, spec: Any, cases: list[Any]) -> None:
        self.spec = spec
        self.cases = cases
        self.label = f"{Path(spec.target).name}+{Path(spec.drafter).name if spec.drafter else 'plain'}"

    @property
    def greedy(self) -> list[Any]:
        """The pair's greedy two-model cases (the ones mlx-lm implements)."""
        return [c for c in self.cases if c.source == "two-model" and c.drafter is not None
                and not c.temperature and not c.processors]

    @property
    def sampled(self) -> list[Any]:
        return [c for c in self.cases if c.source == "two-model" and c.drafter is not None
                and c.temperature > 0 and not c.processors]

    def paths(self) -> tuple[Path, Path | None]:
        """Target and drafter model dirs (a zoo pair's from the zoo)."""
        from specparity.runners import case_paths

        return case_paths(self.greedy[0] if self.greedy else self.cases[0])

    def __repr__(self) -> str:
        return self.label


@functools.cache
def _user_pairs(path: str) -> list[UserPair]:
    from specparity.cases.suite import load_suite, pair_cases

    return [UserPair(spec, pair_cases(spec)) for spec in load_suite(path)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "user_pair" not in metafunc.fixturenames:
        return
    path = suite_option(metafunc.config)
    if path is None:
        metafunc.parametrize("user_pair", [pytest.param(None, marks=pytest.mark.skip(
            reason="no user suite: pytest conformance/ -m oracle --suite FILE (or SPECPARITY_SUITE)"),
            id="no-suite")])
        return
    pairs = _user_pairs(path)
    metafunc.parametrize("user_pair", pairs, ids=[f"{i}-{p.label}" for i, p in enumerate(pairs)])
