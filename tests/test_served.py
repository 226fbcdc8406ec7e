"""Served engines (subjects/served/, specparity/grading/http_servers.py) on the fake server, loopback only.

The fake (``tests/fake_server.py``) is a real server's double: batched (requests in
flight together), a streaming detokenizer, bf16-rounded logprobs, a prompt cache,
``/metrics`` speculation counters. Most tests grade long-lived fake processes
(one per model pair, reset between launches through a control route) on a
word-level model (``tests/foreign.py`` phi3 + its twin) and a byte-level one (the
zoo's llama): the correct fake passes every check in both arms; each planted bug
is caught by exactly the check it targets (the other cells pass); set-up failures
read cannot-grade, never fail; a spec arm that never speculated is not-engaged;
the prompt-cache × speculation plant is ONE cell, attributed to cache ×
speculation. Both arms run on phi3 with a chat template (tool calls are parsed
and compared across the arms), the spec arm's ``reject`` check on a server whose
drafter has zero weights; every served check has a plant that reaches its
failure branch (asserted by enumerating them). A few tests start the fake through ``--serve fake`` as a real
subprocess: the CLI, SIGTERM, a server that hangs, dies or never starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specparity.grading.http_servers import (
    SERVERS,
    ServedEngine,
    ServeFailed,
    engine_reference,
    exit_code,
    grade_arms,
    grade_served,
    launch_process,
    make_plan,
    rejecting_drafter,
    resolve_model,
    started,
)
from subjects.http_client import HttpClient, Limits
from subjects.served import SERVER_CHECKS, run_checks
from tests.fake_server import BUGS, Shared

ROOT = Path(__file__).resolve().parents[1]
CLI = "import sys; from specparity.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture(scope="session")
def tmpl(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """phi3-tiny with a chat template that renders ``tools`` (a word when tools are offered), + its twin."""
    import shutil

    from tests.foreign import CHAT_TEMPLATE, add_chat_template

    dest = tmp_path_factory.mktemp("served-tmpl") / "phi3-tiny-chat"
    shutil.copytree(pair[0], dest)
    add_chat_template(dest, "{% if tools %}sa fi {% endif %}" + CHAT_TEMPLATE)
    return dest, pair[1]


@pytest.fixture(scope="session")
def llama() -> tuple[Path, Path]:
    return resolve_model("llama"), resolve_model("twin", target="llama")


def _grade(fakes, target: Path, draft: Path | None, bug: str | None = None, checks=SERVER_CHECKS, wrap=None):
    """Grade the fake (plain arm; with ``draft`` the spec arm too, and its all-reject server); ``wrap``: the
    completions wrapping the row declares (``ServedEngine.completions_wrap``)."""
    ref = engine_reference(str(target), **({"wrap": wrap} if wrap is not None else {}))
    launcher = Shared(fakes, str(target), str(draft) if draft else None, bug, deadline=20)
    arms = [("plain", None)] + ([("spec", str(draft))] if draft else [])
    reject = str(rejecting_drafter(draft, draft.parent)) if draft and "reject" in checks else None
    results, blame = grade_arms(ref, launcher, arms, checks=checks, log=lambda m: None, reject_draft=reject)
    return results, blame, launcher


def _statuses(results, arm: str) -> dict[str, str]:
    return {c: cell.status for c, cell in results[arm].cells.items()}


def _pids_with(needle: str) -> list[int]:
    """Live processes whose command line mentions ``needle`` (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = next((ln for ln in (d / "status").read_text().splitlines() if ln.startswith("State:")), "")
            except OSError:
                continue
            if needle in cmd and "zombie" not in state and "--control" not in cmd:
                out.append(int(d.name))
    return out


# ------------------------------------------------------------------ the correct fake


@pytest.mark.slow
def test_correct_fake_passes_every_check_with_and_without_the_drafter(tmpl, fakes) -> None:
    """Both arms on a model with a chat template (so tool calls are parsed and compared): every cell
    passes but the plain arm's two that cannot apply (no drafter: speculation, all-reject)."""
    target, twin = tmpl
    results, blame, launcher = _grade(fakes, target, twin)
    for arm in ("plain", "spec"):
        bad = {c: cell.detail for c, cell in results[arm].cells.items()
               if cell.status != "pass" and not (arm == "plain" and c in ("speculation", "reject"))}
        assert not bad, (arm, bad)
    assert results["plain"].cells["speculation"].status == "unsupported"
    assert results["plain"].cells["reject"].detail == "plain arm: no drafter"
    assert "drafted" in results["spec"].cells["speculation"].detail
    assert list(results["plain"].cells) == list(SERVER_CHECKS) and blame == {}
    # isolation: each arm's checks on a fresh server with the prompt cache off, `cache` on its own with it on,
    # the spec arm's all-reject check on its own server (its drafter has zero weights)
    assert launcher.launches == [("plain", True), ("plain", False), ("spec", True), ("spec", False), ("spec", True)]
    assert results["spec"].cache_state["identity"] == "off" and results["spec"].cache_state["cache"] == "on"
    assert "zero weights" in results["spec"].setup["servers"][-1]["drafter"]
    # every case of every check ran and was reported
    assert all(len(cell.cases) >= 2 for c, cell in results["plain"].cells.items()
               if c not in ("speculation", "reject")), {c: cell.cases for c, cell in results["plain"].cells.items()}
    # the concurrency check's requests were in flight together at the server, in one batch
    assert launcher.stats[0]["max_inflight"] >= 4 and launcher.stats[0]["max_batch"] >= 2, launcher.stats[0]
    cache_cases = [c["label"] for c in results["plain"].cells["cache"].cases]
    assert any("ids [" in lab for lab in cache_cases), cache_cases  # exact continuations by token id
    # what the new checks compared: tool calls across the arms, every draft rejected on the reject server
    assert "parsed under speculation = without" in results["spec"].cells["tools"].detail
    reject = results["spec"].cells["reject"]
    assert reject.status == "pass" and all(k["status"] == "pass" for k in reject.cases), reject.cases
    assert launcher.stats[-1]["drafted"] > 0 and launcher.stats[-1]["accepted"] == 0, launcher.stats[-1]
    assert "batch-mates" in results["spec"].cells["seeded"].detail
    # the leak check's first answer is the fresh server's first request: every other check's requests come between
    n = int(re.search(r"after (\d+) unrelated requests", results["plain"].cells["leak"].detail).group(1))
    assert n >= 40, results["plain"].cells["leak"].detail


def test_correct_fake_passes_every_check_on_a_word_level_model(pair, fakes) -> None:
    results, blame, launcher = _grade(fakes, pair[0], None)
    bad = {c: cell.detail for c, cell in results["plain"].cells.items() if cell.status not in ("pass", "unsupported")}
    assert not bad and blame == {}, bad
    assert launcher.launches == [("plain", True), ("plain", False)]
    assert launcher.stats[0]["max_inflight"] >= 4 and launcher.stats[0]["max_batch"] >= 2, launcher.stats[0]
    assert {c for c, cell in results["plain"].cells.items() if cell.status == "unsupported"} == {
        "tools", "reject", "speculation"}
    assert "no chat template" in results["plain"].cells["tools"].detail  # said so, never a fail
    assert all(len(cell.cases) >= 2 for c, cell in results["plain"].cells.items()
               if c not in ("speculation", "tools", "reject"))


def test_correct_fake_passes_on_a_byte_level_model(llama, fakes) -> None:
    target, _ = llama
    results, blame, _ = _grade(fakes, target, None)
    bad = {c: cell.detail for c, cell in results["plain"].cells.items() if cell.status not in ("pass", "unsupported")}
    assert not bad and blame == {}, bad
    assert "split a multi-byte character" in results["plain"].cells["stream"].detail
    usage_cases = [c["label"] for c in results["plain"].cells["usage"].cases]
    assert any("re-encodes to another count" in lab for lab in usage_cases), usage_cases


# ------------------------------------------------------------------ plants: each caught by its own check only


PLANTS = {  # bug -> (model, arms, the check that must catch it, words its finding must carry)
    "system-prompt": ("pair", "plain", "identity", "the chat prompt the server builds"),
    "stream-drop-byte": ("llama", "plain", "stream", "streamed deltas concatenated differ from the non-streamed text"),
    "overrun": ("pair", "plain", "budget", "max_tokens=1: 2 tokens emitted"),
    "finish-label": ("pair", "plain", "finish_reason", "finish_reason 'stop' at the budget, expected 'length'"),
    "stop-label": ("pair", "plain", "finish_reason", "ended the text but finish_reason is 'length'"),
    "usage-reencode": ("llama", "plain", "usage", "usage.completion_tokens"),
    "chat-usage-off": ("pair", "plain", "usage", "usage.completion_tokens 10, the server returned 9 token(s)"),
    "eos-leak": ("pair", "plain", "eos", "EOS text '</s>'"),
    "stop-trailing-logprob": ("pair", "plain", "stop", "logprob entries came back"),
    "stop-cut-out": ("pair", "plain", "stop", "did not stop generation: it was cut out of the text"),
    "logprob-off": ("llama", "plain", "logprobs", "vs plain"),
    "cache-drop": ("pair", "plain", "cache", "warm != cold"),
    "cache-every-tenth": ("pair", "plain", "cache", "warm != cold"),  # 1 request in 10: caught over 24
    "cache-no-logprobs": ("pair", "plain", "cache", "warm != cold plain decode (without logprobs)"),
    "batch-leak": ("pair", "plain", "concurrency", "others in flight"),  # seeded: cannot tell (BLOCKED below)
    "seed-batch": ("pair", "plain", "seeded", "with 3 batch-mates in flight draws other tokens than alone"),
    "logit-bias-leak": ("pair", "plain", "leak", "differs from its answer on the fresh server: output token"),
    "models-500": ("pair", "plain", "liveness", "GET /v1/models: HTTP 500"),
    # the spec arm's plants (both arms graded; the plain arm stays clean)
    "tool-spec-mangle": ("tmpl", "spec", "tools", "the tool call parsed under speculation differs from the one "
                                                  "without: tool call 0 (lookup) arguments"),
    "reject-placeholder": ("tmpl", "spec", "reject", "with every draft rejected: output token 0: server id 0"),
    "reject-usage": ("tmpl", "spec", "reject", "with every draft rejected: usage.completion_tokens"),
    "cache-short-save": ("tmpl", "spec", "cache", "warm != cold"),  # its own test: the attribution rerun
}
BLOCKED = {  # cells a plant leaves cannot-grade (never fail): the root cause is another check's finding
    "batch-leak": {"seeded": "batch-mates changed the computation itself (the concurrency check's finding)"},
}
NOT_ENGAGED = {"spec-off": "speculation"}  # the speculation check's failure branch: not engaged, never pass
OTHER_PLANTS = {  # set-up failures and limitations (never a finding), a server that stops: each has its own test
    "no-template": "cannot-grade", "crash-start": "cannot-grade", "no-token-ids": "pass (as text)",
    "seed-ignored": "cannot-grade", "no-tool-parser": "n/a", "slow": "pass",
    "hang": "one finding, the rest cannot-grade", "die": "one finding, the rest cannot-grade",
    "metrics-other-method": "speculation cannot-grade", "metrics-method-named": "speculation pass",
    "wrap-system": "one identity finding, the reference-judged checks cannot-grade; declared: pass",
    # tests/test_served_causes.py: dialects spoken (pass), an error returned as success (its finding's cause)
    "chat-only": "pass (through chat)", "model-name": "pass (the served name)",
    "legacy-logprobs": "pass (the legacy integer logprobs, learnt from its one-entry answer)",
    "empty-error": "findings classified 'server error returned as success'",
    # tests/test_served_setup_evidence.py: each arm's set-up proven from the server's own evidence
    "health-counters": "speculation pass (from /health)", "draft-disabled": "not-engaged (from the log)",
    "no-counters": "speculation cannot-grade, passes unverified", "cache-on-anyway": "recorded not in effect"}


def test_every_served_check_has_a_plant_that_reaches_its_failure_branch() -> None:
    """A new check without a plant in the fake (or a plant without a test) fails here."""
    reached = {c for _, _, c, _ in PLANTS.values()} | set(NOT_ENGAGED.values())
    assert reached == set(SERVER_CHECKS), f"checks no plant fails: {sorted(set(SERVER_CHECKS) - reached)}"
    assert set(PLANTS) | set(NOT_ENGAGED) | set(OTHER_PLANTS) == set(BUGS), \
        f"plants with no test: {sorted(set(BUGS) - set(PLANTS) - set(NOT_ENGAGED) - set(OTHER_PLANTS))}"


def _models(which: str, pair, llama, tmpl) -> tuple[Path, Path]:
    return {"pair": pair, "llama": llama, "tmpl": tmpl}[which]


NIGHTLY = (pytest.mark.slow, pytest.mark.heavy)


@pytest.mark.parametrize("scope", ["its-check", pytest.param("every-check", marks=NIGHTLY)])
@pytest.mark.parametrize("bug", [b for b in PLANTS if b != "cache-short-save"])
def test_each_planted_bug_is_caught_by_exactly_its_check(bug, scope, pair, llama, tmpl, fakes) -> None:
    """Each plant fails its check with its words, its blame, and the request in the cell. By default
    the plant's own check is graded (and the cells its root cause blocks): one check's requests, not
    sixteen; nightly (``every-check``) every check is graded and no other cell may fail (a plant's
    cross-talk into another check). The correct fake passing every check is its own test."""
    which, arms, check, words = PLANTS[bug]
    target, twin = _models(which, pair, llama, tmpl)
    checks = SERVER_CHECKS if scope == "every-check" else (check, *BLOCKED.get(bug, {}))
    results, blame, _ = _grade(fakes, target, twin if arms == "spec" else None, bug, checks=checks)
    arm = arms
    st = _statuses(results, arm)
    assert set(st) == set(checks), st  # every check asked for was graded, nothing else
    assert {c for c, s in st.items() if s == "fail"} == {check}, (bug, st)
    blocked = BLOCKED.get(bug, {})
    assert {c for c, s in st.items() if s not in ("pass", "fail", "unsupported")} <= set(blocked), st
    for c, why in blocked.items():  # pass where a burst was not hit, cannot-grade (with that reason) where it was
        graded = [k for k in results[arm].cells[c].cases if k["status"] != "pass"]
        assert all(k["status"] == "cannot-grade" and why in k["detail"] for k in graded), graded
    cell = results[arm].cells[check]
    assert words in cell.detail, cell.detail
    assert cell.case and "POST /v1/" in cell.case or check == "liveness", cell  # the request, with its parameters
    if arms == "plain":
        assert blame == {check: "server: fails without speculation"}, blame
    else:  # the plain arm is clean, the finding is speculation's
        assert not [c for c, s in _statuses(results, "plain").items() if s not in ("pass", "unsupported")]
        assert list(blame) == [check] and blame[check].startswith("speculation: fails with the prompt cache off"), blame


# ------------------------------------------------------------------ a server that wraps the prompt (issue 32)


GATED_CELLS = {"budget", "finish_reason", "usage", "eos", "stop", "logprobs", "cache", "concurrency"}


def test_a_server_that_wraps_the_prompt_is_one_identity_finding_and_the_rest_cannot_grade(tmpl, fakes) -> None:
    """fusion-mlx 0.10.24 runs every completions prompt as a chat with an injected system message: ONE root
    cause, so ONE cell (identity, naming usage.prompt_tokens); every check judged against plain decode of the
    prompt as sent reads cannot-grade pointing there, never FAIL; the checks of the server against itself pass."""
    results, blame, _ = _grade(fakes, tmpl[0], None, "wrap-system")
    st = _statuses(results, "plain")
    assert {c for c, s in st.items() if s == "fail"} == {"identity"}, st
    ident = results["plain"].cells["identity"]
    assert "does not complete the prompt as sent: usage.prompt_tokens" in ident.detail, ident.detail
    assert "prompt fidelity" in ident.case and "POST /v1/completions" in ident.case, ident.case
    assert [k["status"] for k in ident.cases].count("fail") == 1, ident.cases
    for c in GATED_CELLS:
        cell = results["plain"].cells[c]
        assert cell.status == "cannot-grade", (c, cell)
        assert cell.detail.startswith("the server does not complete the prompt as sent (usage.prompt_tokens ")
        assert cell.detail.endswith("its output cannot be compared with plain decode of it; see identity"), cell
    assert {c for c, s in st.items() if s == "pass"} == {"stream", "seeded", "tools", "leak", "liveness"}, st
    assert blame == {"identity": "server: fails without speculation"}, blame


def test_a_declared_wrapping_is_the_reference_and_the_correct_wrapping_server_passes(tmpl, fakes, tmp_path,
                                                                                     monkeypatch) -> None:
    """Declared on its row (``completions_wrap``), the reference is plain decode of the wrapped prompt: the
    fake that wraps exactly so passes every check; a server that does NOT wrap, graded as if it did, is the one
    identity finding again (the declaration is credited only where usage.prompt_tokens agrees)."""
    from subjects.server_rows import ChatWrap
    from tests.fake_server import WRAP_SYSTEM

    wrap = ChatWrap(system=WRAP_SYSTEM)
    results, blame, _ = _grade(fakes, tmpl[0], None, "wrap-system", wrap=wrap)
    bad = {c: cell.detail for c, cell in results["plain"].cells.items()
           if cell.status != "pass" and c not in ("reject", "speculation")}
    assert not bad and blame == {}, bad
    assert all(len(cell.cases) >= 2 for c, cell in results["plain"].cells.items()
               if c not in ("speculation", "tools", "reject")), {c: len(x.cases) for c, x in results["plain"].cells.items()}
    results, _, _ = _grade(fakes, tmpl[0], None, None, checks=("identity", "stop"), wrap=wrap)
    ident, stop = results["plain"].cells["identity"], results["plain"].cells["stop"]
    assert ident.status == "fail" and "as its row declares it wraps it" in ident.detail, ident
    assert stop.status == "cannot-grade" and stop.detail.endswith("see identity"), stop
    # the row and the scoreboard say the wrapping was applied (fusion-mlx's row declares its wrapping)
    import dataclasses

    from reports.scoreboard import render_markdown

    assert SERVERS["fusion-mlx"].completions_wrap == ChatWrap(system="You are a helpful assistant.")
    monkeypatch.setitem(SERVERS, "fake", dataclasses.replace(SERVERS["fake"], completions_wrap=wrap))
    doc = grade_served(model=str(tmpl[0]), serve="fake", out=tmp_path, checks=("identity", "liveness"),
                       env={"SPECPARITY_FAKE_SERVER_BUG": "wrap-system"})
    assert doc["setup"]["completions_wrap"] == wrap.describe(), doc["setup"]
    assert {c: r["status"] for c, r in doc["modes"]["plain"]["checks"].items()} == {
        "identity": "pass", "liveness": "pass"}, doc["modes"]["plain"]["checks"]
    assert f"completions prompt wrapped as the row declares: {wrap.describe()}" in render_markdown([doc])


def test_a_wrapping_server_with_a_stop_bug_still_fails_the_stop_check(tmpl, fakes) -> None:
    """The declared wrapping hides no finding: the wrapping fake with the stop-trailing-logprob plant is
    caught by the stop check (and only it)."""
    from subjects.server_rows import ChatWrap
    from tests.fake_server import WRAP_SYSTEM

    checks = ("identity", "budget", "finish_reason", "usage", "stop", "logprobs")  # the reference-judged ones
    results, _, _ = _grade(fakes, tmpl[0], None, "wrap-system+stop-trailing-logprob",
                           wrap=ChatWrap(system=WRAP_SYSTEM), checks=checks)
    st = _statuses(results, "plain")
    assert set(st) == set(checks), st
    assert {c for c, s in st.items() if s == "fail"} == {"stop"}, st
    assert "logprob entries came back" in results["plain"].cells["stop"].detail
    assert {c for c, s in st.items() if s == "cannot-grade"} == set(), st


def test_usage_reencode_shows_on_a_word_level_model_only_where_a_stop_trims_the_text(pair, fakes) -> None:
    """Why the byte-level model is in the plants: on a word-level one the text re-encodes to its ids,
    so only the stop cases (the stop string cut from the text) see the re-encoded count."""
    results, _, _ = _grade(fakes, pair[0], None, "usage-reencode", checks=("usage",))
    cases = results["plain"].cells["usage"].cases
    assert {k["status"] for k in cases if "stop" not in k["label"]} == {"pass"}, cases
    assert {k["status"] for k in cases if "stop" in k["label"]} == {"fail"}, cases


@pytest.mark.parametrize("scope", ["its-check", pytest.param("every-check", marks=NIGHTLY)])
def test_a_short_prompt_cache_save_under_speculation_is_one_cell_attributed_to_cache_x_speculation(
        scope, tmpl, fakes) -> None:
    """By default the cache check and identity beside it (nightly: every check)."""
    target, twin = tmpl
    checks = SERVER_CHECKS if scope == "every-check" else ("identity", "cache")
    results, blame, launcher = _grade(fakes, target, twin, "cache-short-save", checks=checks)
    spec = _statuses(results, "spec")
    assert set(spec) == set(checks), spec
    assert {c for c, s in spec.items() if s != "pass"} == {"cache"}, spec  # the rest of the spec arm passes
    assert PLANTS["cache-short-save"][3] in results["spec"].cells["cache"].detail
    assert not [c for c, s in _statuses(results, "plain").items() if s == "fail"]
    assert blame == {"cache": results["spec"].cells["cache"].attribution}
    assert blame["cache"].startswith("cache × speculation"), blame
    assert launcher.launches[-1] == ("spec", True)  # the rerun with the prompt cache off


def test_a_spec_arm_that_never_speculated_is_not_engaged_never_pass(tmpl, fakes) -> None:
    target, twin = tmpl
    results, _, _ = _grade(fakes, target, twin, "spec-off", checks=("identity", "tools", "speculation"))
    spec = _statuses(results, "spec")
    assert spec["speculation"] == "not-engaged", results["spec"].cells["speculation"]
    assert "0 drafted tokens" in results["spec"].cells["speculation"].detail
    assert "pass" not in spec.values() and "fail" not in spec.values(), spec
    assert set(_statuses(results, "plain").values()) <= {"pass", "unsupported"}
    doc = {"modes": {a: {"checks": {c: cell.to_dict() for c, cell in r.cells.items()}} for a, r in results.items()}}
    assert exit_code(doc) == 3


def test_a_server_that_ignores_the_seed_cannot_be_graded_on_seeded_sampling_never_fails(pair, fakes) -> None:
    results, blame, _ = _grade(fakes, pair[0], None, "seed-ignored", checks=("seeded", "leak"))
    seeded, leak = results["plain"].cells["seeded"], results["plain"].cells["leak"]
    assert seeded.status == "cannot-grade" and "not reproducible" in seeded.detail, seeded
    assert leak.status == "pass" and blame == {}, leak  # the greedy probe is judged, the seeded one cannot be
    assert [k["status"] for k in leak.cases] == ["pass", "cannot-grade"], leak.cases


def test_a_server_without_a_tool_parser_is_n_a_for_tool_calls(tmpl, fakes) -> None:
    results, blame, _ = _grade(fakes, tmpl[0], None, "no-tool-parser", checks=("tools",))
    cell = results["plain"].cells["tools"]
    assert cell.status == "unsupported" and "no tool call parsed" in cell.detail and blame == {}, cell


def test_the_all_reject_drafter_has_zero_weights_and_applies_to_two_model_spec_arms_only(pair) -> None:
    import mlx.core as mx

    from specparity.grading.http_servers import grade_arm

    d = rejecting_drafter(pair[1], pair[1].parent)
    assert d == rejecting_drafter(pair[1], pair[1].parent) and d.parent == pair[1].parent and json.loads((d / "config.json").read_text()) == json.loads(
        (pair[1] / "config.json").read_text())
    assert all(float(mx.abs(v).max()) == 0.0 for v in mx.load(str(d / "model.safetensors")).values())
    ref = engine_reference(str(pair[0]))
    plan = make_plan(ref)

    def never(*a):
        raise AssertionError("no server should start")

    for arm, reject, restartable, why in (
            ("plain", str(d), True, "plain arm: no drafter"),
            ("spec", None, True, "no two-model drafter"),
            ("spec", str(d), False, "a running server's drafter cannot be swapped")):
        cell = grade_arm(ref, never, arm, "x", ["reject"], plan, restartable=restartable, reject_draft=reject,
                         log=lambda m: None).cells["reject"]
        assert cell.status == "unsupported" and why in cell.detail, (arm, cell)


def test_a_chat_endpoint_refused_for_lack_of_a_template_cannot_be_graded_never_fails(pair, fakes) -> None:
    results, blame, _ = _grade(fakes, pair[0], None, "no-template")
    st = _statuses(results, "plain")
    assert "fail" not in st.values() and blame == {}, st
    for c in ("identity", "stream"):
        cases = results["plain"].cells[c].cases
        chat = [k for k in cases if "chat/completions" in k["label"]]
        assert chat and all(k["status"] == "cannot-grade" and "no chat template" in k["detail"] for k in chat), cases
        assert "could not be graded" in results["plain"].cells[c].detail


def test_a_server_that_does_not_start_cannot_be_graded_with_its_log_line(pair, fakes) -> None:
    results, blame, _ = _grade(fakes, pair[0], None, "crash-start")
    cells = {c: x for c, x in results["plain"].cells.items() if c != "reject"}  # reject: n/a on a plain arm
    assert all(c.status == "cannot-grade" for c in cells.values()), {c: x.status for c, x in cells.items()}
    assert all("server did not start" in c.detail for c in cells.values())
    assert results["plain"].cells["reject"].status == "unsupported"
    assert "needs mlx-vlm" in (cells["identity"].log or ""), cells["identity"]
    doc = {"modes": {"plain": {"checks": {c: x.to_dict() for c, x in cells.items()}}}}
    assert exit_code(doc) == 3 and blame == {}


def test_a_correct_but_slow_server_passes(pair, fakes) -> None:
    results, _, _ = _grade(fakes, pair[0], None, "slow", checks=("identity", "stream", "concurrency", "speculation"))
    assert set(_statuses(results, "plain").values()) <= {"pass", "unsupported"}, _statuses(results, "plain")


def test_token_id_requests_fall_back_to_text_only_where_the_ids_round_trip(pair, llama, fakes) -> None:
    res, _, _ = _grade(fakes, pair[0], None, "no-token-ids", checks=("cache", "concurrency", "leak"))
    cell = res["plain"].cells["cache"]
    assert cell.status == "pass" and all("as text: the ids round-trip" in k["label"] for k in cell.cases), cell
    # its refusal is an HTTP 404 (mlx_lm.server's): not a missing /v1/completions, so no chat-only dialect is
    # learnt and the text prompts still go through completions (the other checks' too)
    assert all("/v1/completions" in k["label"] for k in cell.cases), cell.cases
    assert {c: x.status for c, x in res["plain"].cells.items()} == dict.fromkeys(("cache", "concurrency", "leak"),
                                                                                   "pass"), res["plain"].cells
    notes = [n for s in res["plain"].setup["servers"] for n in s.get("dialect", [])]
    assert not any("no /v1/completions" in n for n in notes), notes
    res, _, _ = _grade(fakes, llama[0], None, "no-token-ids", checks=("cache",))
    cell = res["plain"].cells["cache"]
    assert cell.status != "fail", cell
    graded = [k for k in cell.cases if k["status"] == "cannot-grade"]
    assert all("do not round-trip" in k["detail"] for k in graded), cell.cases


def test_a_hit_the_server_did_not_make_is_not_credited(pair, fakes) -> None:
    """The cache check on a server whose prompt cache is off: no case credited, cannot-grade."""
    ref = engine_reference(str(pair[0]))
    launcher = Shared(fakes, str(pair[0]), None, None)
    with launcher("plain", None, True) as srv:
        cell = run_checks(srv.client, ref, ["cache"], plan=make_plan(ref))["cache"]
    assert cell.status == "cannot-grade", cell
    assert "the warm path was not exercised" in cell.detail, cell.detail


def test_a_hostile_server_is_graded_within_its_bound(pair) -> None:
    """A server that trickles its body: the first case fails on the deadline, the rest cannot be graded."""
    from tests.test_http_client import hostile, trickle_body

    ref = engine_reference(str(pair[0]))

    def health_then_trickle(conn):  # /health answers; everything else trickles
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")

    calls = {"n": 0}

    def behave(conn):
        calls["n"] += 1
        (health_then_trickle if calls["n"] == 1 else trickle_body)(conn)

    with hostile(behave) as url:
        t0 = time.monotonic()
        cells = run_checks(HttpClient(url, limits=Limits(deadline=1.0, stream_deadline=1.0)), ref,
                           ["identity", "budget", "liveness"], plan=make_plan(ref))
        took = time.monotonic() - t0
    assert cells["identity"].status == "fail" and "no complete answer within 1 s" in cells["identity"].detail
    assert all(cells[c].status == "cannot-grade" and "stopped answering in check 'identity'" in cells[c].detail
               for c in ("budget", "liveness")), cells
    assert took < 10, took


# ------------------------------------------------------------------ attribution and exit codes


def test_exit_codes_tell_findings_from_nothing_graded() -> None:
    def doc(**arms):
        return {"modes": {a: {"checks": {f"c{i}": {"status": s} for i, s in enumerate(st)}} for a, st in arms.items()}}

    assert exit_code(doc(plain=["pass", "unsupported", "cannot-grade"])) == 0
    assert exit_code(doc(plain=["pass", "fail"])) == 1
    assert exit_code(doc(plain=["cannot-grade", "cannot-grade"])) == 3
    assert exit_code(doc(plain=["pass"], spec=["not-engaged", "not-engaged"])) == 3
    assert exit_code(doc(plain=["cannot-grade"], spec=["fail"])) == 1
    assert exit_code({"available": False, "modes": {}}) == 2


def test_attribution_without_a_rerun() -> None:
    from specparity.grading.http_servers import ArmResult, attribute
    from subjects.served import CellResult

    def arm(states, cache):
        return ArmResult({c: CellResult(c, s, "d") for c, s in states.items()}, {}, cache)

    results = {"plain": arm({"stop": "fail", "budget": "pass", "usage": "pass"}, {}),
               "spec": arm({"stop": "fail", "budget": "fail", "usage": "fail"},
                           {"stop": "off", "budget": "off", "usage": "unknown"})}
    out = attribute(None, None, results, {"spec": "d"}, None, restartable=False)
    assert out["stop"].startswith("server: fails on the plain arm too")
    assert out["budget"].startswith("speculation: fails with the prompt cache off")
    assert "could not be turned off" in out["usage"]


# ------------------------------------------------------------------ set-up: pass-through, home, warm-up


STUB = r"""
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, record = int(sys.argv[1]), sys.argv[2]
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _ok(self, doc):
        raw = json.dumps(doc).encode(); self.send_response(200)
        self.send_header("Content-Length", str(len(raw))); self.end_headers(); self.wfile.write(raw)
    def do_GET(self): self._ok({})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(record, "w") as f:
            json.dump({"argv": sys.argv[3:], "home": os.environ["HOME"], "xdg": os.environ.get("XDG_CONFIG_HOME"),
                       "foo": os.environ.get("FOO"), "prompt": body.get("prompt"),
                       "settings": open(os.path.join(os.environ["HOME"], ".stub", "settings.json")).read()
                       if os.path.exists(os.path.join(os.environ["HOME"], ".stub", "settings.json")) else None}, f)
        text = "" if os.environ.get("STUB_EMPTY") else "x"
        self._ok({"choices": [{"text": text, "finish_reason": "stop"}], "usage": {"completion_tokens": 0}})
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_serve_args_env_and_an_isolated_home_reach_the_server_and_the_warm_up_uses_its_words(tmp_path) -> None:
    record = tmp_path / "record.json"
    stub = ServedEngine("stub", "x", "x", "x", lambda m, d, p: [sys.executable, "-c", STUB, str(p), str(record)],
                        cache_off=("--cache", "0"))
    with launch_process(stub, "m", None, tmp_path / "stub.log", startup_timeout=30, env={"FOO": "bar"},
                        serve_args=["--my-flag", "v"], cache_off=True, warmup="gu lo fin") as srv:
        seen = json.loads(record.read_text())
        assert srv.cache == "off"
    assert seen["argv"] == ["--cache", "0", "--my-flag", "v"], seen
    assert seen["foo"] == "bar" and seen["prompt"] == "gu lo fin", seen
    assert seen["home"] != os.environ.get("HOME") and "specparity-stub-home-" in seen["home"], seen
    assert seen["xdg"].startswith(seen["home"]) and not Path(seen["home"]).exists()  # removed after


def test_a_default_turned_off_in_a_settings_file_reaches_the_isolated_home_and_the_row(pair, tmp_path,
                                                                                        monkeypatch) -> None:
    """fusion-mlx 0.10.24 auto-enables a TurboQuant 4-bit KV cache (lossy; it needs mlx_vlm, which it does not
    install: every request HTTP 500 on a head-dim-64 model) with no flag to turn it off, only
    ~/.fusion-mlx/model_settings.json: ``home_files`` are written into the server's own home before it starts
    and named in the row's set-up."""
    import dataclasses

    record = tmp_path / "record.json"
    stub = ServedEngine("stub", "x", "x", "x", lambda m, d, p: [sys.executable, "-c", STUB, str(p), str(record)],
                        home_files=((".stub/settings.json", '{"lossy": false}'),))
    with launch_process(stub, "m", None, tmp_path / "stub.log", startup_timeout=30):
        seen = json.loads(record.read_text())
    assert seen["settings"] == '{"lossy": false}', seen
    fusion = SERVERS["fusion-mlx"]
    settings = json.loads(dict(fusion.home_files)[".fusion-mlx/model_settings.json"])
    assert settings["models"]["default_model"] == {"turboquant_kv_enabled": False}, settings
    monkeypatch.setitem(SERVERS, "fake", dataclasses.replace(SERVERS["fake"], home_files=stub.home_files))
    doc = grade_served(model=str(pair[0]), serve="fake", out=tmp_path / "out", checks=("liveness",))
    assert doc["setup"]["home_files"] == {".stub/settings.json": '{"lossy": false}'}, doc["setup"]


def test_a_server_that_generates_nothing_on_the_warm_up_did_not_start(tmp_path) -> None:
    """An engine error answered as an empty HTTP 200 (yunshu 0.1.5 on a head_dim-12 model): set-up."""
    stub = ServedEngine("stub", "x", "x", "x", lambda m, d, p: [sys.executable, "-c", STUB, str(p),
                                                                 str(tmp_path / "r.json")])
    (tmp_path / "stub.log").write_text("")
    with pytest.raises(ServeFailed, match="came back empty .* it generates nothing for this model"):
        with launch_process(stub, "m", None, tmp_path / "stub.log", startup_timeout=30, env={"STUB_EMPTY": "1"},
                            expect_output=True):
            pass
    with launch_process(stub, "m", None, tmp_path / "stub2.log", startup_timeout=30, env={"STUB_EMPTY": "1"}):
        pass  # plain decode's first token is EOS: an empty warm-up is right


def test_prompts_file_feeds_the_plan(pair, tmp_path) -> None:
    from specparity.grading.http_servers import prompts_from_file
    from tests.foreign import WORDS

    f = tmp_path / "p.txt"
    f.write_text("\n".join(" ".join(WORDS[i: i + 7]) for i in range(0, 70, 7)) + "\n")
    prompts = prompts_from_file(f)
    plan = make_plan(engine_reference(str(pair[0]), prompts))
    used = {p.text for ps in plan.by_check.values() for group in ps for p in group}
    assert used and used <= set(prompts)
    (tmp_path / "ids.jsonl").write_text('{"id": "a", "token_ids": [1, 2]}\n{"id": "b", "text": "x y"}\n')
    with pytest.raises(ValueError, match="token ids; grade --serve takes text"):
        prompts_from_file(tmp_path / "ids.jsonl")


# ------------------------------------------------------------------ the real subprocess path


@pytest.mark.slow
def test_cli_serve_writes_named_results_and_scoreboard_and_leaves_nothing_running(pair, tmp_path) -> None:
    target, _ = pair
    p = _cli("--serve", "fake", "--model", str(target), "--out", str(tmp_path / "o"), "--check", "identity",
             "--check", "usage", "--check", "liveness", cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads((tmp_path / "o" / f"server-fake--{target.name}.json").read_text())
    assert doc["kind"] == "server" and doc["modes"]["plain"]["checks"]["identity"]["status"] == "pass"
    assert doc["model"]["name"] == f"$MODELS/{target.name}" and "path" not in doc["model"], doc["model"]
    assert str(target) not in json.dumps(doc), "a machine path in the committed row"
    md = (tmp_path / "o" / "scoreboard.md").read_text()
    assert "## Served engines" in md and "| fake " in md
    assert not _pids_with(str(target))


# "hang" (a deadline runs out mid-grade) nightly: by default "die" here, and a deadline running out in
# test_a_hostile_server_is_graded_within_its_bound and tests/test_http_client.py.
@pytest.mark.parametrize("bug", [pytest.param("hang", marks=NIGHTLY), "die"])
def test_a_server_that_stops_answering_is_one_finding_and_the_rest_cannot_be_graded(bug, pair, tmp_path) -> None:
    target, _ = pair
    doc = grade_served(model=str(target), serve="fake", out=tmp_path, timeout=3,
                       checks=("identity", "budget", "liveness"), env={"SPECPARITY_FAKE_SERVER_BUG": bug})
    checks = doc["modes"]["plain"]["checks"]
    first = checks["identity"]
    assert first["status"] == "fail" and "server stopped answering" in first["detail"], first
    assert "POST /v1/completions" in first["detail"]
    later = [r for c, r in checks.items() if c != "identity"]
    assert all(r["status"] == "cannot-grade" and "the server stopped answering in check 'identity'"
               in r["detail"] for r in later), later
    assert exit_code(doc) == 1
    assert not _pids_with(str(target))


def test_serve_stops_a_server_that_never_answers_or_exits_at_once(tmp_path) -> None:
    marker = f"specparity-test-{os.getpid()}"
    never = ServedEngine("never", "x", "x", "x", lambda m, d, p: [sys.executable, "-c",
                         f"import time; time.sleep(600)  # {marker}"])
    with pytest.raises(ServeFailed, match=r"did not answer /health within 2 s"):
        with started(never, "m", None, tmp_path / "never.log", startup_timeout=2):
            pass
    assert not _pids_with(marker)
    dies = ServedEngine("dies", "x", "x", "x", lambda m, d, p: [sys.executable, "-c",
                        f"import sys; print('cannot bind'); sys.exit(3)  # {marker}"])
    with pytest.raises(ServeFailed, match=r"exited with code 3") as err:
        with started(dies, "m", None, tmp_path / "dies.log", startup_timeout=30):
            pass
    assert "cannot bind" in err.value.log_line
    assert not _pids_with(marker)


def test_serve_failing_to_start_cannot_be_graded_with_the_reason_and_exit_3(pair, tmp_path) -> None:
    target, _ = pair
    p = _cli("--serve", "fake", "--model", str(target), "--out", str(tmp_path), "--check", "identity",
             env={"SPECPARITY_FAKE_SERVER_BUG": "crash-start"})
    assert p.returncode == 3, (p.returncode, p.stderr[-1500:])
    doc = json.loads((tmp_path / f"server-fake--{target.name}.json").read_text())
    res = doc["modes"]["plain"]["checks"]
    assert all(r["status"] == "cannot-grade" and "server did not start" in r["detail"] for r in res.values()), res
    assert "needs mlx-vlm" in res["identity"]["log"], res["identity"]
    assert not _pids_with(str(target))


def _cli(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", CLI, "grade", *args], capture_output=True, text=True,
                          env=e, timeout=240, **kw)


def test_sigterm_to_the_grader_stops_the_server(pair, tmp_path) -> None:
    target, _ = pair
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPECPARITY_FAKE_SERVER_BUG": "hang"}
    proc = subprocess.Popen([sys.executable, "-c", CLI, "grade", "--serve", "fake", "--model",
                             str(target), "--out", str(tmp_path)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # the server is up once a check has started (it hangs from request 3)
            if [p for p in _pids_with(str(target)) if p != proc.pid] and (tmp_path / "logs").exists():
                break
            time.sleep(0.1)
        time.sleep(1.0)
        server = [p for p in _pids_with("tests.fake_server") if p != proc.pid and
                  str(target) in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        assert server, "the fake server never started"
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert not _pids_with(str(target))


@pytest.mark.parametrize("args, msg", [
    (["--server", "ftp://host", "--model", "llama"], "bad server URL 'ftp://host'"),
    (["--server", "http://127.0.0.1:1", "--model", "llama"], "cannot reach the server at http://127.0.0.1:1: "
                                                               "connection refused"),
    (["--server", "http://al:s3cr3t@127.0.0.1:1", "--model", "llama"], "carries credentials"),
    (["--server", "http://10.1.2.3:8080", "--model", "llama"], "--allow-remote"),
    (["--serve", "mlx-lm", "--model", "/no/such/dir"], "--model /no/such/dir: no such model directory"),
    (["--serve", "nope", "--model", "llama"], "unknown server 'nope'"),
    (["--serve", "mlx_lm", "--model", "llama"], "mlx_lm is a runner of kind reference"),
    (["--serve", " ", "--model", "llama"], "empty server name"),
    (["--serve", "fake"], "need --model PATH"),
    (["--serve", "fake", "--model", "llama", "--serve-env", "NOEQUALS"], "expected NAME=VALUE"),
    (["--server", "http://127.0.0.1:1", "--model", "llama", "--serve-arg=--x"], "go with --serve NAME"),
])
def test_cli_usage_errors_are_one_line_and_never_echo_credentials(args, msg) -> None:
    p = _cli(*args)
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and msg in lines[0], p.stderr
    assert "s3cr3t" not in p.stderr + p.stdout


def test_every_server_is_a_registry_runner_of_kind_server() -> None:
    """One registry: `grade --serve` takes exactly the registry's servers, graded elsewhere (not per case)."""
    from specparity.runners import registry
    from subjects.server_rows import availability

    assert registry.names("server") == list(SERVERS)
    for name in SERVERS:
        r = registry.get(name, kind="server")
        assert not r.per_case and f"--serve {name}" in (r.elsewhere or ""), r
        assert r.available() == availability(name)
    assert SERVERS["fake"].test_double and SERVERS["fake"].module == "tests.fake_server"


def test_qmlx_serve_is_graded_with_its_prompt_cache_off_and_a_lossless_kv_cache() -> None:
    """qmlx-serve 0.16.0 has `--disable-prefix-cache` (default on) and an int4 KV cache by default
    (`--kv-cache-dtype`, default int4): the graded arms run with the cache off (only the cache check
    keeps it on) and every launch with a bf16 KV cache, as rapid-mlx (the same vllm_mlx code base) is graded."""
    eng = SERVERS["qmlx-serve"]
    for draft in (None, "d"):
        off, on = eng.command("m", draft, 1, cache_off=True), eng.command("m", draft, 1)
        assert "--disable-prefix-cache" in off and "--disable-prefix-cache" not in on, (off, on)
        for argv in (off, on):
            assert argv[argv.index("--kv-cache-dtype") + 1] == "bf16", argv


def test_metrics_counters_labelled_for_another_method_are_no_evidence_about_this_arm() -> None:
    """qmlx-serve 0.16.0's /metrics: MTP / DFlash counters (``method="mtp"``), zero under SuffixDecoding."""
    from subjects.served import SpecCounters, speculation_cell

    page = ('# TYPE qmlx_spec_decode_attempts_total counter\n'
            'qmlx_spec_decode_attempts_total{family="unknown",method="mtp"} 0\n'
            'qmlx_spec_decode_accepts_total{family="unknown",method="mtp"} 0\n'
            'qmlx_spec_decode_dflash_accepts_total{method="dflash"} 0\n')
    c = SpecCounters.from_metrics(page, "suffix")
    assert not c.sources and c.drafted == 0 and len(c.other_methods) == 3, c
    cell = speculation_cell("spec", c)
    assert cell.status == "cannot-grade" and 'method="mtp"' in cell.detail, cell
    ours = SpecCounters.from_metrics(page + 'qmlx_spec_decode_attempts_total{method="suffix"} 5\n', "suffix")
    assert ours.drafted == 5 and speculation_cell("spec", ours).status == "pass"
    assert speculation_cell("spec", SpecCounters.from_metrics(page)).status == "not-engaged"  # no method: as before
    assert SERVERS["qmlx-serve"].spec_method == "suffix"


def test_a_model_free_speculator_given_a_draft_model_is_graded_without_one(pair, tmp_path, monkeypatch) -> None:
    """`grade --serve qmlx-serve --draft D` (tox -e server-qmlx-serve): D only switches SuffixDecoding on and is
    never loaded, so the row names no drafter, `reject` (every draft of a zeroed drafter rejected) is n/a, and
    counters of another method leave `speculation` cannot-grade instead of passing cells off as not-engaged."""
    import dataclasses

    import subjects.server_rows as rows

    target, twin = pair
    monkeypatch.setitem(rows.SERVERS, "fake", dataclasses.replace(rows.SERVERS["fake"], spec_without_draft=True,
                                                                  spec_method="suffix"))
    doc = grade_served(model=str(target), draft=str(twin), serve="fake", out=tmp_path, timeout=10,
                       checks=("identity", "reject", "speculation"),
                       env={"SPECPARITY_FAKE_SERVER_BUG": "metrics-other-method"})
    assert doc["draft"] is None and "model-free" in doc["note"] and "reject_drafter" not in doc["setup"], doc
    spec = doc["modes"]["spec"]
    assert spec["drafter"] == "model-free", spec
    assert spec["checks"]["reject"]["status"] == "unsupported" and "model-free" in spec["checks"]["reject"]["detail"]
    assert spec["checks"]["speculation"]["status"] == "cannot-grade", spec["checks"]["speculation"]
    assert spec["checks"]["identity"]["status"] == "pass", spec["checks"]["identity"]
    assert not _pids_with(str(target))


@pytest.mark.parametrize("two_model_draft, arms", [(None, ["plain"]), (True, ["plain", "spec"])])
def test_a_console_script_server_gets_a_spec_arm_only_where_its_row_takes_a_draft_model(
        two_model_draft, arms, pair, tmp_path, monkeypatch) -> None:
    """`grade --serve vmlx --draft D` (tox -e server-vmlx): vmlx is a console script whose spec arm is started
    with `--speculative-model D`; its row says so (`two_model_draft`), so both arms are graded. A console-script
    row that says nothing (vllm-mlx, fusion-mlx, flyto-mlx: no two-model drafter) is graded without
    speculation and says why. (The rule was `exe is not None`: vmlx's spec arm was silently dropped.)"""
    import dataclasses

    import subjects.server_rows as rows

    target, twin = pair
    monkeypatch.delenv("SPECPARITY_SERVER_BIN", raising=False)  # the exe is this interpreter, found on its own
    monkeypatch.setitem(rows.SERVERS, "fake", dataclasses.replace(rows.SERVERS["fake"], exe=sys.executable,
                                                                  two_model_draft=two_model_draft))
    assert rows.SERVERS["fake"].available()
    doc = grade_served(model=str(target), draft=str(twin), serve="fake", out=tmp_path, timeout=10,
                       checks=("identity", "speculation"))
    assert list(doc["modes"]) == arms, doc["modes"].keys()
    if two_model_draft:
        spec = doc["modes"]["spec"]
        assert spec["drafter"] and spec["drafter"] != "model-free", spec
        assert spec["checks"]["identity"]["status"] == "pass", spec["checks"]["identity"]
        assert spec["checks"]["speculation"]["status"] == "pass", spec["checks"]["speculation"]
        assert "takes no two-model draft model" not in (doc.get("note") or ""), doc.get("note")
    else:
        assert "takes no two-model draft model" in (doc.get("note") or ""), doc.get("note")
    assert not _pids_with(str(target))


RAPID_PAGE = ('# TYPE rapid_mlx_spec_decode_attempts_total counter\n'  # rapid-mlx 0.16.10, rapid_mlx/routes/metrics.py
              'rapid_mlx_spec_decode_attempts_total{family="phi3-tiny",method="mtp"} 0\n'
              'rapid_mlx_spec_decode_accepts_total{family="phi3-tiny",method="mtp"} 0\n'
              'rapid_mlx_spec_decode_verify_calls_total{family="phi3-tiny",method="mtp"} 0\n'
              'rapid_mlx_suffix_decode_verify_steps_total{family="phi3-tiny",method="suffix"} %d\n'
              'rapid_mlx_suffix_decode_fallthrough_steps_total{family="phi3-tiny",method="suffix"} 40\n'
              'rapid_mlx_suffix_decode_draft_tokens_proposed_total{family="phi3-tiny",method="suffix"} %d\n'
              'rapid_mlx_suffix_decode_draft_tokens_accepted_total{family="phi3-tiny",method="suffix"} %d\n'
              'rapid_mlx_suffix_decode_accept_ratio{family="phi3-tiny",method="suffix"} 0.5\n'
              'rapid_mlx_suffix_decode_fallthrough_total{family="phi3-tiny",method="suffix",reason="no_draft"} 40\n'
              'http_requests_total{method="POST"} 7\n')


def test_counters_labelled_with_the_arms_method_count_whatever_their_name() -> None:
    """rapid-mlx 0.16.10: its ``rapid_mlx_spec_decode_*`` counters are MTP's (``method="mtp"``, zero under
    SuffixDecoding); SuffixDecoding's are ``rapid_mlx_suffix_decode_*{method="suffix"}`` (no "spec" in the
    name). The suffix arm reads those: drafted = proposed draft tokens (not the verify steps beside them)."""
    from subjects.served import SpecCounters, speculation_cell

    c = SpecCounters.from_metrics(RAPID_PAGE % (3, 12, 6), "suffix")
    assert (c.drafted, c.accepted) == (12, 6), c
    assert "/metrics rapid_mlx_suffix_decode_draft_tokens_proposed_total" in c.sources, c
    assert not any("rapid_mlx_spec_decode" in s or "http" in s for s in c.sources), c
    assert len(c.other_methods) == 3 and all('method="mtp"' in o for o in c.other_methods), c
    assert speculation_cell("spec", c).status == "pass"
    zero = SpecCounters.from_metrics(RAPID_PAGE % (0, 0, 0), "suffix")  # its own counters at zero: a finding
    assert zero.sources and speculation_cell("spec", zero).status == "not-engaged"
    assert SERVERS["rapid-mlx"].spec_method == "suffix"


def test_a_model_free_speculator_whose_counters_carry_their_method_in_a_label_is_read_by_it(
        pair, tmp_path, monkeypatch) -> None:
    """`grade --serve rapid-mlx --model M` (tox -e server-rapid-mlx): zero MTP counters named spec_decode and
    SuffixDecoding's under other names, labelled method="suffix": the spec arm's speculation passes on the
    suffix counts, never "not engaged" on the MTP zeros (the v2 row's misreading)."""
    import dataclasses

    import subjects.server_rows as rows

    target, _ = pair
    monkeypatch.setitem(rows.SERVERS, "fake", dataclasses.replace(rows.SERVERS["fake"], spec_without_draft=True,
                                                                  spec_method="suffix"))
    doc = grade_served(model=str(target), serve="fake", out=tmp_path, timeout=10,
                       checks=("identity", "speculation"),
                       env={"SPECPARITY_FAKE_SERVER_BUG": "metrics-method-named"})
    spec = doc["modes"]["spec"]
    cell = spec["checks"]["speculation"]
    assert cell["status"] == "pass" and "rapid_mlx_suffix_decode_draft_tokens_proposed_total" in cell["detail"], cell
    assert spec["checks"]["identity"]["status"] == "pass", spec["checks"]["identity"]
    assert doc["modes"]["plain"]["checks"]["speculation"]["status"] == "unsupported", doc["modes"]["plain"]
    assert not _pids_with(str(target))


def test_scoreboard_renders_four_states_attribution_and_no_secret(tmp_path) -> None:
    from reports.scoreboard import failures, render_html, render_markdown

    doc = {"engine": "fake", "kind": "server", "version": "1", "tox_env": "py311", "available": True,
           "platform": {}, "model": {"name": "phi3-tiny"}, "checks": list(SERVER_CHECKS),
           "blame": {"budget": "cache × speculation: passes when rerun with the prompt cache off"},
           "modes": {"spec": {"note": "n", "targets": ["phi3-tiny"], "checks": {
               "budget": {"status": "fail", "detail": "max_tokens=2: 3 tokens", "case": "budget: POST /v1/x",
                          "attribution": "cache × speculation: passes when rerun with the prompt cache off",
                          "reproduce": "python -m specparity.grading.http_servers --server http://u:pw@127.0.0.1:1 --check budget"},
               "identity": {"status": "cannot-grade", "detail": "server did not start: boom", "log": "E: no"},
               "stop": {"status": "not-engaged", "detail": "passed, but speculation was not engaged"},
               "eos": {"status": "unsupported", "detail": "no EOS"},
               "usage": {"status": "pass", "detail": "ok"}}}}}
    md = render_markdown([doc])
    assert "| fake 1 | phi3-tiny | spec |" in md
    assert "cannot grade: server did not start" in md and "**FAIL**" in md and "not engaged" in md
    assert "pw" not in md.replace("pwd", "") and "u:pw@" not in render_html([doc])
    f = failures([doc])
    assert len(f) == 1 and f[0]["reproduce"].endswith("--check budget") and "cache × speculation" in f[0]["detail"]


def test_a_server_without_a_health_route_is_alive_when_its_models_route_answers() -> None:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            code = 200 if self.path == "/v1/models" else 404
            self.send_response(code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        ok, why = HttpClient(f"http://127.0.0.1:{httpd.server_address[1]}").healthy()
        assert ok and why.startswith("no /health (404)"), why
    finally:
        httpd.shutdown()
        httpd.server_close()
    ok, why = HttpClient(f"http://127.0.0.1:{httpd.server_address[1]}").healthy()
    assert not ok and "connection refused" in why, why
