"""Each arm proves its set-up from the server's own evidence (``subjects/setup_evidence.py``).

Planted on the fake server: speculation counters kept in ``/health`` only are read there; a draft
model the server's log says it disabled makes the spec arm not-engaged with that line quoted; a spec
arm with no counters anywhere passes only as "unverified", cell by cell; a setting asked off that
the log shows on is recorded as not in effect; the row records the server's own runtime versions.
"""

from __future__ import annotations

import dataclasses
import sys

from specparity.grading.http_servers import SERVERS, engine_reference, grade_arms, grade_served
from tests.fake_server import Shared

CHECKS = ("identity", "speculation")


def _spec(pair, fakes, bug):
    ref = engine_reference(str(pair[0]))
    launcher = Shared(fakes, str(pair[0]), str(pair[1]), bug, deadline=20)
    results, _ = grade_arms(ref, launcher, [("spec", str(pair[1]))], checks=CHECKS, log=lambda m: None)
    return results["spec"].cells


def test_counters_kept_in_health_are_read_there(pair, fakes) -> None:
    cells = _spec(pair, fakes, "health-counters")
    assert cells["speculation"].status == "pass", cells["speculation"]
    assert "/health speculative.draft_tokens" in cells["speculation"].detail, cells["speculation"].detail
    assert "acceptance_rate" not in cells["speculation"].detail  # a ratio is not a count
    assert cells["identity"].status == "pass" and cells["identity"].unverified is None


def test_a_spec_arm_with_no_counters_anywhere_is_unverified_in_every_passing_cell(pair, fakes) -> None:
    cells = _spec(pair, fakes, "no-counters")
    assert cells["speculation"].status == "cannot-grade", cells["speculation"]
    assert "/health" in cells["speculation"].detail and "unverified" in cells["speculation"].detail
    assert cells["identity"].status == "pass" and "speculation unverified" in (cells["identity"].unverified or "")


def test_a_draft_model_the_log_says_is_disabled_is_not_engaged_with_the_line_quoted(pair, tmp_path) -> None:
    doc = grade_served(model=str(pair[0]), draft=str(pair[1]), serve="fake", out=tmp_path / "out",
                       checks=CHECKS, env={"SPECPARITY_FAKE_SERVER_BUG": "draft-disabled"})
    spec = doc["modes"]["spec"]["checks"]
    assert spec["speculation"]["status"] == "not-engaged", spec["speculation"]
    assert "draft model disabled under continuous batching" in spec["speculation"]["detail"]
    assert spec["identity"]["status"] == "not-engaged", spec["identity"]
    observed = [s["observed"] for s in doc["modes"]["spec"]["setup"]["servers"]]
    assert any("disabled" in o.get("speculation_off_in_log", "") for o in observed), observed
    assert doc["server_runtime"]["python"] == sys.version.split()[0], doc["server_runtime"]


def test_the_command_line_at_the_top_of_the_log_is_not_the_server_saying_speculation_is_off(pair, tmp_path,
                                                                                         monkeypatch) -> None:
    """vmlx's spec argv (``--num-draft-tokens 3 --no-continuous-batching --disable-block-disk-cache``), which the
    harness writes as its log's first line, matches "draft ... disabled": it was quoted as the server's own
    word that speculation was off (and, on a server with no counters, would have made the arm not-engaged).
    Only what the server printed is evidence: with no counters the arm is unverified, never not-engaged."""
    row = dataclasses.replace(SERVERS["fake"], defaults_off=("--num-draft-tokens", "3", "--disable-block-disk-cache"))
    monkeypatch.setitem(SERVERS, "fake", row)
    doc = grade_served(model=str(pair[0]), draft=str(pair[1]), serve="fake", out=tmp_path / "out",
                       checks=CHECKS, env={"SPECPARITY_FAKE_SERVER_BUG": "no-counters"})
    spec = doc["modes"]["spec"]
    argvs = [" ".join(s["argv"]) for s in spec["setup"]["servers"]]
    assert all("--disable-block-disk-cache" in a for a in argvs), argvs  # the argv was as asked
    assert spec["checks"]["speculation"]["status"] == "cannot-grade", spec["checks"]["speculation"]
    assert "unverified" in spec["checks"]["speculation"]["detail"], spec["checks"]["speculation"]
    assert spec["checks"]["identity"]["status"] == "pass", spec["checks"]["identity"]
    assert not any("speculation_off_in_log" in s["observed"] for s in spec["setup"]["servers"]), spec["setup"]


def test_a_setting_asked_off_that_the_log_shows_on_is_recorded_as_not_in_effect(pair, tmp_path,
                                                                               monkeypatch) -> None:
    row = dataclasses.replace(SERVERS["fake"], observe=(("prompt cache", r"prefix cache: enabled"),))
    monkeypatch.setitem(SERVERS, "fake", row)
    doc = grade_served(model=str(pair[0]), serve="fake", out=tmp_path / "out", checks=("liveness",),
                       env={"SPECPARITY_FAKE_SERVER_BUG": "cache-on-anyway"})
    setup = doc["modes"]["plain"]["setup"]
    assert setup["not_in_effect"] == {"prompt cache": "INFO: prefix cache: enabled (adaptive default)"}, setup
    assert setup["servers"][0]["observed"]["models"] == ["default_model"], setup


def test_the_scoreboard_says_a_pass_is_unverified() -> None:
    from reports.scoreboard import _cell

    assert _cell({"status": "pass", "detail": "ok", "unverified": "speculation unverified"})[1] == \
        "pass (speculation unverified)"
    assert _cell({"status": "pass", "detail": "ok"})[1] == "pass"


def test_health_counts_are_the_counts_not_the_settings_beside_them() -> None:
    """vmlx 1.6.81's /health (speculative.py get_spec_stats, adaptive_speculative.py snapshot): the draft
    width asked for, the widths and the delivered drafts sit beside the counts; only the counts count."""
    from subjects.served.counters import health_doc_counters, speculation_cell

    runtime = {"policy": "adaptive", "starting_width": 3, "selected_width": 3, "cycles": 4,
               "verification_allocation_limit": 3, "drafted_tokens": 10, "accepted_draft_tokens": 7,
               "width_counts": {"3": 4}, "delivered_tokens": 17, "delivered_draft_tokens": 7}
    doc = {"status": "healthy", "speculative_decoding": {
        "enabled": True, "draft_model": "/m/twin", "num_draft_tokens": 3, "configured_num_draft_tokens": 3,
        "draft_model_loaded": True, "runtime": runtime, "disable_by_batch_size": 0}}
    c = health_doc_counters(doc)
    assert c is not None and (c.drafted, c.accepted) == (10, 7), c
    # the same body before any request (runtime {}): the configured width is no evidence of speculation
    idle = health_doc_counters({**doc, "speculative_decoding": {**doc["speculative_decoding"], "runtime": {}}})
    assert idle is None, idle
    assert speculation_cell("spec", idle).status == "cannot-grade"


def test_timings_draft_rounds_are_not_drafted_tokens() -> None:
    """mlx-vlm 0.7.10 server/schemas.py GenerationTimings: draft_rounds beside llama.cpp's draft_n / draft_n_accepted."""
    from subjects.served.counters import SpecCounters

    c = SpecCounters()
    c.add_doc({"timings": {"draft_kind": "dflash", "draft_rounds": 4, "draft_n": 12, "draft_n_accepted": 9}})
    assert (c.drafted, c.accepted) == (12, 9), c
    assert c.sources == {"timings.draft_n", "timings.draft_n_accepted"}, c.sources


def test_a_model_path_the_server_reports_leaves_no_machine_path_in_the_row(tmp_path) -> None:
    """mlx-vlm 0.7.10's /health and /v1/models name the loaded model by its absolute path."""
    from specparity.grading.http_servers import _public_paths

    m = tmp_path / "phi3-chat64"
    m.mkdir()
    (m / "config.json").write_text("{}")
    seen = {"health": f'HTTP 200 {{"status":"healthy","loaded_model":"{m}"}}', "models": [str(m)], "n": 1}
    got = _public_paths(seen)
    assert str(tmp_path) not in str(got), got
    assert got["models"] == ["$MODELS/phi3-chat64"] and '"loaded_model":"$MODELS/phi3-chat64"' in got["health"], got
