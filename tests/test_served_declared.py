"""Each served check is declared once (``subjects/served/declare.py``) and a server is one row
(``subjects/server_rows.py``): a toy check and a toy server added the documented way reach the
parser, the plan, the grader, the result tables and the scoreboard. And the promise every check
makes, that it runs every one of its cases (none stops at its first failing case), is a test of
its own: a planted check that stops at its first failure is named by it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specparity.grading.http_servers import SERVERS, engine_reference, grade_served
from subjects.http_client import HttpClient, ServerError
from subjects.served import CHECKS, Finding, Request, check, check_names, make_plan, run_checks
from tests.fake_server import Shared


@pytest.fixture
def toy_check() -> Iterator[str]:
    """A toy check declared the documented way: one case per prompt, each a 1-token request."""

    @check("toy", title="toy column", needs=(2, 0), gated=True)
    def check_toy(ctx: Any) -> str:
        for p in ctx.plan.no_eos("toy"):
            req = Request(p.text, 1, tag="toy")
            with ctx.case(req):
                r = ctx.ask(req)
                if not r.text:
                    raise Finding(req, "max_tokens=1: no token emitted")
        return "one token at max_tokens 1"

    try:
        yield "toy"
    finally:
        CHECKS.pop("toy", None)


@pytest.fixture
def toy_server(monkeypatch) -> str:
    """A toy server: one row (the fake's way of starting, under another name), nothing else."""
    row = dataclasses.replace(SERVERS["fake"], name="toy-server", test_double=False, note="a toy row")
    monkeypatch.setitem(SERVERS, "toy-server", row)
    return "toy-server"


def test_a_toy_check_and_a_toy_server_reach_the_parser_the_tables_and_the_scoreboard(
        toy_check, toy_server, pair, tmp_path) -> None:
    from reports.scoreboard import write_scoreboard
    from specparity.cli.entry import build_parser

    p = build_parser()
    args = p.parse_args(["grade", "--serve", toy_server, "--model", str(pair[0]), "--check", toy_check])
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices["grade"]
    assert args.check == ["toy"] and toy_server in sub.format_help()
    assert toy_check in check_names() and make_plan(engine_reference(str(pair[0]))).no_eos("toy")
    doc = grade_served(model=str(pair[0]), serve=toy_server, out=tmp_path, checks=("toy", "liveness"))
    cell = doc["modes"]["plain"]["checks"]["toy"]
    assert cell["status"] == "pass" and len(cell["cases"]) == 2, cell
    (tmp_path / "server-toy-server--m.json").write_text(json.dumps(doc))
    md, html = write_scoreboard(tmp_path)
    text = Path(md).read_text()
    assert "| toy column |" in text and "| toy-server" in text, text
    assert "toy column" in Path(html).read_text()


class _FailFirst(HttpClient):
    """A client whose first generation request after ``arm()`` is answered HTTP 500 (planted)."""

    armed = False

    def arm(self) -> None:
        self.armed = True

    def _planted(self) -> None:
        if self.armed:
            self.armed = False
            raise ServerError("HTTP 500: planted failure of the check's first request", 500)

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self._planted()
        return super().post(path, body)

    def post_stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        self._planted()
        return super().post_stream(path, body)


def promise_breakers(pair, fakes, names) -> dict[str, str]:
    """The checks of ``names`` that record fewer cases when their first request fails than when it
    passes (the promise: every case runs; a case that needs the failed one's answer still runs, as
    cannot-grade), with the counts."""
    ref = engine_reference(str(pair[0]))
    plan = make_plan(ref)
    launcher = Shared(fakes, str(pair[0]), None, None, deadline=20)
    out: dict[str, str] = {}
    for name in names:
        counts = []
        for fail_first in (False, True):
            with launcher("plain", None, name != "cache") as srv:
                client = _FailFirst(srv.client.url)
                decl = CHECKS[name]

                def armed(ctx: Any, fn=decl.fn, fail=fail_first, c=client) -> str:
                    if fail:
                        c.arm()
                    return fn(ctx)

                CHECKS[name] = dataclasses.replace(decl, fn=armed, before=None)
                try:
                    cell = run_checks(client, ref, [name], plan=plan)[name]
                finally:
                    CHECKS[name] = decl
                counts.append(len(cell.cases))
        if counts[1] < counts[0]:
            out[name] = f"{counts[1]} cases with its first request failing, {counts[0]} when it passes"
    return out


def test_every_check_runs_every_case_when_its_first_request_fails(pair, fakes) -> None:
    names = [n for n, c in CHECKS.items() if c.fn is not None and n not in ("reject", "liveness")]
    assert promise_breakers(pair, fakes, names) == {}


def test_a_check_that_stops_at_its_first_failing_case_breaks_the_promise(pair, fakes) -> None:
    @check("stops-early", title="stops early", needs=(3, 0))
    def check_stops_early(ctx: Any) -> str:
        for p in ctx.plan.no_eos("stops-early"):
            req = Request(p.text, 1, tag="stops early")
            with ctx.case(req):
                ctx.ask(req)
            if ctx.cases[-1].status == "fail":
                return ""  # the planted bug: stops at its first failing case
        return "ok"

    @check("runs-all", title="runs all", needs=(3, 0))
    def check_runs_all(ctx: Any) -> str:
        for p in ctx.plan.no_eos("runs-all"):
            req = Request(p.text, 1, tag="runs all")
            with ctx.case(req):
                ctx.ask(req)
        return "ok"

    try:
        broken = promise_breakers(pair, fakes, ["stops-early", "runs-all"])
    finally:
        CHECKS.pop("stops-early", None)
        CHECKS.pop("runs-all", None)
    assert list(broken) == ["stops-early"] and broken["stops-early"].startswith("1 cases"), broken
