"""Which arithmetic produced a trace (``engine.witness.verify_path``), on the CPU double.

The seed's 06-14 finding: an engine that verifies each window position with its own
one-token forward instead of ONE batched forward over the window emits the same tokens on a
bit-exact backend, so no token comparison sees it. Where the two paths differ (a non-bit-exact
backend; on the CPU the double ``engine.nonexact``), the recorded margins say which path ran:
the engine's own trace matches the batched window; a planted serial verify matches one-token
decode and is reported as a deviation from the reference's verify path, its round named. On
the bit-exact CPU the two are indistinguishable, and said so.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest

from engine.nonexact import emulate_nonexact, exact
from engine.witness import verify_path
from specparity.cases import Case
from specparity.runners import case_paths, load_model, run_case
from traces.io import Trace

CASE = Case("llama", "twin", "nat-00", 3, 24)


def _trace(case: Case = CASE) -> Trace:
    return Trace.from_records(run_case("engine", case))


@pytest.fixture
def target() -> Any:
    return load_model(str(case_paths(CASE)[0])).model


@pytest.fixture
def double(target: Any) -> Iterator[Any]:
    emulate_nonexact(target, 1e-2)
    try:
        yield target
    finally:
        exact(target)


def _serial_verify(model: Any) -> Any:
    """The plant: every multi-token forward after the prefill is computed one token at a time."""
    base = type(model)

    def __call__(self: Any, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", args[0] if args else None)
        offset = next((int(c.offset) for c in cache or () if hasattr(c, "offset")), 0)
        if inputs.ndim < 2 or inputs.shape[-1] <= 1 or offset == 0:
            return base.__call__(self, inputs, *args, **kwargs)
        rows = [base.__call__(self, inputs[:, i : i + 1], *args, **kwargs) for i in range(inputs.shape[-1])]
        return mx.concatenate(rows, axis=1)

    model.__class__ = type(f"Serial{base.__name__}", (base,), {"__call__": __call__})
    return model


def test_bit_exact_cpu_cannot_tell(target: Any) -> None:
    v = verify_path(target, _trace())
    assert v.verdict == "indistinguishable" and v.deviation is None, v


def test_the_engine_verifies_a_batched_window(double: Any) -> None:
    v = verify_path(double, _trace())
    assert v.verdict == "batched" and v.deviation is None, v.rounds
    assert all(r["apart"] > 0 for r in v.rounds)


def test_a_serial_verify_is_a_deviation(double: Any) -> None:
    good = _trace()
    _serial_verify(double)
    try:
        bad = _trace()
    finally:
        double.__class__ = type(double).__mro__[1]  # back to the double
    assert bad.rounds and good.rounds
    v = verify_path(double, bad)
    assert v.verdict == "serial", v.rounds
    assert v.deviation is not None and "position by position" in v.deviation and "round 0" in v.deviation
