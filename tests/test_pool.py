"""``specparity/cli/pool.py``: the one module of the execution backends (in process, ``spawn``
process pool, Ray) shared by ``specparity run``/``grade DIR`` and ``specparity regen``."""

from __future__ import annotations

from typing import Any

import pytest

from specparity.cli.pool import execute

JOBS = [(2, 3), (5, 0), (7, 1)]  # divmod: the middle job raises ZeroDivisionError


def _collect(workers: int) -> dict[tuple[int, int], Any]:
    got: dict[tuple[int, int], Any] = {}

    def done(job: Any, result: Any, exc: BaseException | None) -> None:
        got[job] = type(exc).__name__ if exc is not None else result

    execute(divmod, JOBS, done, workers=workers)
    return got


def test_inline_and_pool_give_the_same_results_and_hand_errors_to_the_caller() -> None:
    want = {(2, 3): (0, 2), (5, 0): "ZeroDivisionError", (7, 1): (7, 0)}
    assert _collect(0) == want
    assert _collect(2) == want


def test_an_error_raised_by_the_caller_stops_the_run() -> None:
    seen: list[Any] = []

    def done(job: Any, result: Any, exc: BaseException | None) -> None:
        seen.append(job)
        if exc is not None:
            raise exc

    with pytest.raises(ZeroDivisionError):
        execute(divmod, JOBS, done, workers=0)
    assert seen == [(2, 3), (5, 0)]  # the job after the error never ran


def test_ray_missing_is_one_line() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"--ray needs Ray: pip install 'specparity\[ray\]'"):
            execute(divmod, JOBS, lambda *a: None, ray_address="")
    else:
        pytest.skip("ray is installed here")
