"""Runner declarations of the third-party engines under test: one per ``subjects.SUBJECTS`` row.

A subject is graded on its own checks (``subjects/checks.py``) by ``specparity grade
--engine NAME`` in its own tox environment, not run per case; its drafting modes and what
each supports are its adapter's ``MODES`` (``subjects/<name>.py``). Adding a subject is its
adapter module plus its ``SubjectInfo`` row in ``subjects/__init__.py``; this module turns
every row into a runner.
"""

from __future__ import annotations

from collections.abc import Callable

from specparity.runners.registry import Runner


def _available(name: str) -> Callable[[], tuple[bool, str]]:
    def check() -> tuple[bool, str]:
        import subjects

        return subjects.availability(name)

    return check


def _runners() -> tuple[Runner, ...]:
    from subjects import SUBJECTS

    return tuple(
        Runner(
            name=info.name,
            kind="subject",
            package=info.package.split("==")[0],
            available=_available(info.name),
            install_hint=info.install_hint,
            elsewhere=f"a third-party engine graded by `specparity grade --engine {info.name}` "
                      f"({info.install_hint})",
            rank=200 + i,
        )
        for i, info in enumerate(SUBJECTS.values())
    )


RUNNERS = _runners()
