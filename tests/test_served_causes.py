"""A failed request is classified by what it is (``subjects/failure_causes.py``), wherever it is sent.

Planted on the fake server (``tests/fake_server.py``): a server with no ``/v1/completions`` and one
that refuses the harness's model name are dialects the harness speaks (no FAIL cell: graded through
chat / under the name ``/v1/models`` reports, the row says so in one line each); a server whose
engine error comes back as HTTP 200 with an empty text and an exception in its log is a finding
classified "server error returned as success" (never "did not start"); HTTP 5xx is "server error
returned as an error"; the scoreboard prints a FAIL cell's cause.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specparity.grading.http_servers import engine_reference, grade_arms, grade_served
from subjects import failure_causes as fc
from subjects.http_client import ServerDown, ServerError
from tests.fake_server import Shared


def test_each_client_failure_has_its_class() -> None:
    assert fc.classify_error(ServerDown("connection refused", "refused")).kind == fc.TRANSPORT
    assert fc.classify_error(ServerError("closed mid-answer")).kind == fc.TRANSPORT
    assert fc.classify_error(ServerError("HTTP 404: Not Found", 404), "/v1/completions").kind == fc.PROTOCOL
    assert fc.classify_error(ServerError("HTTP 400: model 'default_model' not found", 400)).kind == fc.SETUP
    assert fc.classify_error(ServerError("HTTP 500: boom", 500)).kind == fc.SERVER_ERROR
    # mlx-vlm 0.7.10 loads the model a request names: offline, a name it cannot load is a set-up refusal
    offline = 'HTTP 400: {"detail":"Failed to load model: Cannot find an appropriate cached snapshot folder"}'
    assert fc.classify_error(ServerError(offline, 400)).kind == fc.SETUP
    assert fc.classify_error(ServerError("response is not JSON: <html>", 200)).kind == fc.PROTOCOL
    assert not fc.Cause(fc.SETUP, "x").finding and fc.Cause(fc.SERVER_ERROR, "x").finding
    hidden = fc.error_as_success({"choices": []}, "", "INFO ok\nIndexError: index 7 is out of bounds\n")
    assert hidden is not None and hidden.kind == fc.ERROR_AS_SUCCESS and "IndexError: index 7" in hidden.evidence
    assert fc.error_as_success(None, "", "INFO all fine\n") is None  # empty text alone is no evidence
    assert fc.error_as_success({"error": {"message": "oom"}}, "x", "").evidence.endswith("oom")


CHECKS = ("identity", "stream", "budget", "usage", "liveness")


@pytest.mark.parametrize("bug, learnt", [("chat-only", "no /v1/completions"), ("model-name", "was refused")])
def test_a_dialect_is_spoken_one_line_and_never_a_finding(bug, learnt, pair, fakes) -> None:
    ref = engine_reference(str(pair[0]))
    launcher = Shared(fakes, str(pair[0]), None, bug, deadline=20)
    results, blame = grade_arms(ref, launcher, [("plain", None)], checks=CHECKS, log=lambda m: None)
    cells = results["plain"].cells
    assert {c: x.status for c, x in cells.items()} == dict.fromkeys(CHECKS, "pass"), {
        c: (x.status, x.detail) for c, x in cells.items()}
    assert blame == {}
    notes = [n for s in results["plain"].setup["servers"] for n in s.get("dialect", [])]
    assert len(notes) == 1 and learnt in notes[0], notes
    if bug == "chat-only":
        assert all("chat/completions" in k["label"] for k in cells["budget"].cases if k["status"] == "pass")


def test_legacy_integer_logprobs_are_learnt_from_a_one_entry_answer_never_a_finding(pair, fakes) -> None:
    """vmlx 1.6.81's /v1/completions takes OpenAI's legacy `logprobs: int` and ignores `top_logprobs`: the
    harness's `logprobs: true, top_logprobs: 5` came back with one top entry per token ("1 top_logprobs, asked
    for 5", a false FAIL). Learnt from that answer: the request is sent again with `logprobs: 5` and the row
    says so in one line."""
    checks = ("logprobs", "identity", "stream")
    ref = engine_reference(str(pair[0]))
    launcher = Shared(fakes, str(pair[0]), None, "legacy-logprobs", deadline=20)
    results, blame = grade_arms(ref, launcher, [("plain", None)], checks=checks, log=lambda m: None)
    cells = results["plain"].cells
    assert {c: x.status for c, x in cells.items()} == dict.fromkeys(checks, "pass"), {
        c: (x.status, x.detail) for c, x in cells.items()}
    notes = [n for s in results["plain"].setup["servers"] for n in s.get("dialect", [])]
    assert len(notes) == 1 and "read as `logprobs: 1`" in notes[0], notes


def test_an_error_returned_as_success_is_a_finding_with_its_log_line_never_did_not_start(pair, tmp_path,
                                                                                       monkeypatch) -> None:
    monkeypatch.setenv("SPECPARITY_FAKE_SERVER_BUG", "empty-error")
    doc = grade_served(model=str(pair[0]), serve="fake", out=tmp_path / "out", checks=("identity", "budget"))
    cells = doc["modes"]["plain"]["checks"]  # its warm-up came back empty too: it started all the same
    assert not any("did not start" in c["detail"] for c in cells.values()), cells
    assert cells["budget"]["status"] == "fail", cells
    for c in (c for c in cells.values() if c["status"] == "fail"):
        assert c["cause"] == fc.ERROR_AS_SUCCESS, c
        assert "IndexError: index" in c["detail"], c["detail"]


def test_the_scoreboard_prints_the_cause_of_a_fail_cell(tmp_path) -> None:
    from reports.scoreboard import write_scoreboard

    doc = {"engine": "x", "kind": "server", "available": True, "version": "1", "tox_env": "t", "checks": ["budget"],
           "platform": {}, "model": {"name": "m"}, "modes": {"plain": {"note": "", "checks": {"budget": {
               "status": "fail", "detail": "bad response: HTTP 500: boom", "cause": fc.SERVER_ERROR}}}}}
    import json

    (tmp_path / "server-x--m.json").write_text(json.dumps(doc))
    md, _ = write_scoreboard(tmp_path)
    text = Path(md).read_text()
    assert f"**FAIL** ({fc.SERVER_ERROR}): bad response: HTTP 500: boom" in text, text
