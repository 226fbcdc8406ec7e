"""Cases and cells: a case is pass / fail / cannot-grade / n/a; a cell is made of its check's cases.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from subjects.failure_causes import SETUP, WRONG_OUTPUT

if TYPE_CHECKING:
    from subjects.served.wire import Request

STATUSES = ("pass", "fail", "cannot-grade", "unsupported", "not-engaged")


class Finding(Exception):
    """A case failed: the server's answer is wrong (``req`` names the request; ``cause``: what the
    failure is, ``subjects/failure_causes.py``; None: wrong output unless the reply hid an error)."""

    def __init__(self, req: Request | None, msg: str, cause: str | None = None) -> None:
        super().__init__(msg)
        self.req = req
        self.cause = cause


class CannotGrade(Exception):
    """A case could not be set up (not the server's fault as far as this check can tell)."""

    def __init__(self, msg: str, cause: str = SETUP) -> None:
        super().__init__(msg)
        self.cause = cause


class Unsupported(Exception):
    """A case that does not apply (n/a)."""


@dataclass
class CaseResult:
    label: str
    status: str
    detail: str
    cause: str | None = None  # a fail's or cannot-grade's class (``failure_causes.CAUSES``)


@dataclass
class CellResult:
    """One check's cell: its status (``STATUSES``), a one-line detail, and every case's result."""

    check: str
    status: str
    detail: str
    case: str | None = None  # the first failing request
    cases: list[dict[str, str]] = field(default_factory=list)
    attribution: str | None = None
    log: str | None = None  # a server log line that explains a cannot-grade
    cause: str | None = None  # what the first failing (else ungradeable) case's failure is
    unverified: str | None = None  # a pass on an arm whose set-up claim the server did not prove (why)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: v for k, v in d.items() if v is not None}


def cell_from_cases(check: str, cases: list[CaseResult], summary: str) -> CellResult:
    by = {s: [c for c in cases if c.status == s] for s in ("pass", "fail", "cannot-grade", "unsupported")}
    rows = [{"label": c.label, "status": c.status, "detail": c.detail} | ({"cause": c.cause} if c.cause else {})
            for c in cases]
    counts = ", ".join(f"{len(v)} {k}" for k, v in by.items() if v)
    if by["fail"]:
        f = by["fail"][0]
        more = f" ({len(by['fail'])} of {len(cases)} cases fail)" if len(cases) > 1 else ""
        return CellResult(check, "fail", f"{f.detail}{more}", case=f.label, cases=rows, cause=f.cause or WRONG_OUTPUT)
    note = ""
    if by["cannot-grade"]:
        g = by["cannot-grade"][0]
        note = f"; {len(by['cannot-grade'])} case(s) could not be graded: {g.detail}"
    if by["pass"]:
        return CellResult(check, "pass", f"{summary} [{counts}]{note}", cases=rows)
    if by["cannot-grade"]:
        g = by["cannot-grade"][0]
        return CellResult(check, "cannot-grade", f"{g.detail} [{counts}]", case=g.label, cases=rows, cause=g.cause)
    why = by["unsupported"][0].detail if by["unsupported"] else "no case applies"
    return CellResult(check, "unsupported", why, cases=rows)
