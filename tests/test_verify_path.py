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
from specparity.cases.case import Case
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


def _plant_serial_executor(mp: pytest.MonkeyPatch) -> None:
    """The same plant inside the executor (the model untouched, so the witness replays the real
    arithmetic): each verify window computed one position at a time."""
    import engine.executor as ex

    real = ex._forward

    def forward(model: Any, caches: list[Any], tokens: list[int], taps: tuple[int, ...]) -> Any:
        if len(tokens) <= 1 or taps:
            return real(model, caches, tokens, taps)
        rows = [real(model, caches, [t], taps)[0] for t in tokens]
        return mx.concatenate(rows, axis=1), None

    mp.setattr(ex, "_lazy_drafts", lambda *a: None)  # the list path, through _forward
    mp.setattr(ex, "_forward", forward)


def test_the_run_fails_a_serial_verify_only_off_the_cpu(double: Any, tmp_path: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``specparity run`` off a bit-exact backend checks one case per pair: the engine as it is
    passes; a planted serial verify, token-identical to plain decode, fails as ``logic``."""
    from specparity.jobs.run import run_cases

    ok = run_cases(tmp_path / "ok", cases=[CASE], runners=["engine"], progress=False)
    vp = [c for c in ok.comparisons if c.kind == "verify-path"]
    assert len(vp) == 1 and not vp[0].fails and vp[0].verdict == "identical", [c.verdict for c in vp]
    _plant_serial_executor(monkeypatch)
    bad = run_cases(tmp_path / "bad", cases=[CASE], runners=["engine"], progress=False)
    vp = [c for c in bad.comparisons if c.kind == "verify-path"]
    assert vp and vp[0].fails and "position by position" in (vp[0].message or ""), [c.message for c in vp]
    assert not bad.ok
    sp = [c for c in bad.comparisons if c.kind == "spec-vs-plain"]
    assert sp and sp[0].divergence is None  # the tokens alone never showed it


def test_a_bit_exact_run_adds_no_verify_path_check(tmp_path: Any) -> None:
    from specparity.jobs.run import run_cases

    res = run_cases(tmp_path / "cpu", cases=[CASE], runners=["engine"], progress=False)
    assert not [c for c in res.comparisons if c.kind == "verify-path"]
