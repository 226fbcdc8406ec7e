"""Hostile traces and run folders given to ``trace validate``, ``report``, ``grade`` and
``known``: malformed or planted records, impossible headers, a killed or failed run, FIFOs,
markdown injection, unbounded walks and sizes; and the trace writer's refusals of
non-integer token ids.

What each test checks, and the catalogue of inputs: ``tests/test_hostile_catalogue.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specparity.cli import main
from tests.helpers import (
    cli,
    copy_run,
    engine_trace,
    fifo_guard,
    one_error,
    read_records,
    write_records,
)

pytestmark = pytest.mark.usefixtures("in_tmp")


def test_bad_trace_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nested = tmp_path / "nested.jsonl"
    nested.write_text("[" * 200_000 + "]" * 200_000 + "\n")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\n")
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # open() on it would block forever: refused before opening
    for path, what in ((nested, "nested too deeply"), (binary, "not UTF-8"), (tmp_path, "regular file"),
                       (tmp_path / "missing.jsonl", "No such file"), (fifo, "regular file")):
        rc, out, err = cli(["trace", "validate", path], capsys)
        assert rc == 1
        assert "Traceback" not in out + err
        assert what in out and str(path) in out, out


def test_validate_refuses_unbounded_input(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from traces import io

    monkeypatch.setattr(io, "MAX_LINE_BYTES", 1 << 20)
    big = tmp_path / "big.jsonl"
    big.write_text("[" + ",".join(["12345"] * 900_000) + "]\n")  # ~5 MB on one line
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("x\n" * 100_000)
    # no wall-clock bound: the per-test timeout catches a hang; the bounds are asserted below
    rc, out, err = cli(["trace", "validate", "/dev/zero", big, garbage], capsys)
    assert rc == 1 and "Traceback" not in out + err
    assert "/dev/zero: file: not a regular file" in out
    assert f"{big}:1: file: line longer than" in out
    assert "more problems" in out and len(out.splitlines()) < 300


@pytest.mark.parametrize("content,what", [
    ("{not json", "comparisons.json"),
    ('{"a": 1}', "list"),
    ("[1, 2]", "comparison 0"),
    ("[" * 100_000 + "]" * 100_000, "comparisons.json"),
], ids=["malformed", "not a list", "not objects", "deeply nested"])
def test_malformed_comparisons(tiny_run: Path, tmp_path: Path, content: str, what: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    d = copy_run(tiny_run, tmp_path / "run")
    (d / "comparisons.json").write_text(content)
    before = (d / "report.md").read_bytes()
    rc, _, err = cli(["report", d], capsys)
    assert rc == 1
    one_error(err, what)
    assert (d / "report.md").read_bytes() == before, "a refused report leaves the old one intact"
    rc, _, err = cli(["known", "--run", d], capsys)
    assert rc in (1, 2)
    one_error(err, "comparisons.json")


def test_malformed_ab_json(tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = copy_run(tiny_run, tmp_path / "run")
    (d / "ab").mkdir()
    (d / "ab" / "ab.json").write_text('{"kind": "ab", "target": "llama"}')
    rc, _, err = cli(["report", d], capsys)
    assert rc == 1
    one_error(err, "ab.json")


def _plant_schema_99(recs: list[dict[str, Any]]) -> int:
    recs[0]["schema_version"] = 99
    return 1


def _plant_dup_index(recs: list[dict[str, Any]]) -> int:
    plains = [i for i, r in enumerate(recs) if r["type"] == "plain"]
    recs[plains[1]]["index"] = recs[plains[0]]["index"]
    return plains[1] + 1


def _plant_negative_id(recs: list[dict[str, Any]]) -> int:
    recs[0]["prompt"]["token_ids"][0] = -7
    return 1


@pytest.mark.parametrize("plant", [_plant_schema_99, _plant_dup_index, _plant_negative_id],
                         ids=["schema_version 99", "duplicated index", "negative id"])
def test_report_validates_traces_first(tiny_run: Path, tmp_path: Path,
                                       plant: Callable[[list[dict[str, Any]]], int],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    d = copy_run(tiny_run, tmp_path / "run")
    victim = engine_trace(d, "plain")
    recs = read_records(victim)
    line = plant(recs)
    write_records(victim, recs)
    rc, out, err = cli(["report", d], capsys)
    assert rc == 1
    one_error(err, f"{victim.name}:{line}:")
    assert "CONFORMS" not in out


def test_killed_run_is_incomplete(tiny_run: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    d = copy_run(tiny_run, tmp_path / "run")
    (d / "comparisons.json").unlink()
    marker = json.loads((d / ".specparity-run.json").read_text())
    marker.update(state="running", pid=2**22 + 12345)  # a dead run: its lock is not held
    (d / ".specparity-run.json").write_text(json.dumps(marker))
    rc, out, err = cli(["report", d], capsys)
    assert rc == 1
    md = (d / "report.md").read_text()
    assert "**INCOMPLETE" in md and "CONFORMS" not in md, md[:400]
    assert "stopped before finishing" in md and "no comparisons.json" in md
    assert "INCOMPLETE" in err


def test_fewer_comparisons_than_cases(tiny_run: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    d = copy_run(tiny_run, tmp_path / "run")
    comps = json.loads((d / "comparisons.json").read_text())
    assert comps
    (d / "comparisons.json").write_text(json.dumps([c for c in comps if c["kind"] != "spec-vs-plain"]))
    rc, _, _ = cli(["report", d], capsys)
    assert rc == 1
    md = (d / "report.md").read_text()
    assert "**INCOMPLETE" in md and "have no comparison" in md


def test_failed_marker_is_incomplete(tiny_run: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    d = copy_run(tiny_run, tmp_path / "run")
    marker = json.loads((d / ".specparity-run.json").read_text())
    marker.update(state="failed", error="OSError: planted")
    (d / ".specparity-run.json").write_text(json.dumps(marker))
    rc, _, _ = cli(["report", d], capsys)
    assert rc == 1
    assert "planted" in (d / "report.md").read_text()


def test_no_unpaired_timings_in_report(tiny_run: Path) -> None:
    for name in ("report.md", "summary.md"):
        text = (tiny_run / name).read_text()
        tables = [ln for ln in text.splitlines() if ln.startswith("|")]
        assert tables, name
        for col in ("speedup", "tok_per_s", "tok/s", "wall"):
            assert not any(col in ln for ln in tables), (name, col)
        assert "specparity bench" in text


def test_markdown_injection_escaped(tiny_run: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "folder"
    d.mkdir()
    recs = read_records(engine_trace(tiny_run, "spec"))
    recs[0]["case_id"] = "<script>alert(1)</script>|`x`"
    recs[0]["prompt"]["id"] = "<img src=x onerror=alert(2)>"
    recs[0]["target"]["path"] = "zoo/<b>bold</b>"
    write_records(d / "evil.jsonl", recs)
    rc, _, err = cli(["report", d], capsys)
    assert rc == 1 and "Traceback" not in err  # no comparisons: INCOMPLETE, but a report
    md = (d / "report.md").read_text()
    html = (d / "report.html").read_text()
    for raw in ("<script>", "<img src=x", "<b>bold"):
        assert raw not in md, raw
        assert raw not in html.split("<body>")[1], raw
    assert "&lt;script&gt;" in md


def test_report_on_any_trace_folder(tiny_run: Path, zoo_pair: tuple[Path, Path], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "folder"
    d.mkdir()
    for i, ids in enumerate(("5,6", "7,8")):
        assert main(["generate", "--target", str(zoo_pair[0]), "--draft", str(zoo_pair[1]), "-n", "4",
                     "--prompt-ids", ids, "--trace", str(d / f"gen{i}.jsonl")]) == 0
    assert main(["generate", "--target", str(zoo_pair[0]), "-n", "4", "--prompt-ids", "5,6",
                 "--trace", str(d / "plain.jsonl")]) == 0
    shutil.copy(engine_trace(tiny_run, "spec"), d / "zoo-spec.jsonl")
    ref = read_records(engine_trace(tiny_run, "plain"))
    ref[0]["runner"] = {"name": "mlx_lm", "package": "mlx-lm", "version": "0", "commit": None}
    (d / "sub").mkdir()
    write_records(d / "sub" / "ref.jsonl", ref)
    capsys.readouterr()
    rc, _, err = cli(["report", d], capsys)
    assert rc == 1 and "Traceback" not in err and "internal error" not in err, err
    assert "INCOMPLETE" in err, err
    md = (d / "report.md").read_text()
    cases = md.split("## Cases")[1].split("##")[0]
    rows = [ln for ln in cases.splitlines() if ln.startswith("|") and "---" not in ln][1:]
    assert len(rows) == 5, cases
    assert "INCOMPLETE" in md


def test_report_ticks_follow_the_values_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: one axis tick per γ up to the largest (a γ of 10^9: 23 GB)."""
    import matplotlib.axes
    import pandas as pd

    from reports import plots

    ticks: list[int] = []
    real = matplotlib.axes.Axes.set_xticks

    def count(self: Any, t: Any, *a: Any, **k: Any) -> Any:
        ticks.append(len(t))
        assert len(t) < 100, f"{len(t)} ticks"
        return real(self, list(t), *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks", count)
    df = pd.DataFrame({"target": ["t"] * 2, "drafter": ["d"] * 2, "gamma": [10**9] * 2,
                       "k_accept": [0, 2], "share": [0.5, 0.5]})
    assert plots.acceptance_lengths(df)
    pos = pd.DataFrame({"target": ["t"] * 2, "drafter": ["d"] * 2, "gamma": [10**9] * 2,
                        "position": [1, 10**6], "acceptance": [0.5, 0.1]})
    assert plots.acceptance_by_position(pos)
    assert ticks and max(ticks) <= 3


def test_report_with_a_fifo_run_marker(tiny_run: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Before: reading the marker blocked on a FIFO; now: unreadable marker, INCOMPLETE, exit 1."""
    from reports.tables import RUN_MARKER

    d = copy_run(tiny_run, tmp_path / "r")
    (d / RUN_MARKER).unlink()
    os.mkfifo(d / RUN_MARKER)
    opened = fifo_guard(d / RUN_MARKER)
    rc, out, err = cli(["report", d], capsys)
    assert rc == 1 and "INCOMPLETE" in err, (out, err)
    assert "unreadable run marker" in (d / "report.md").read_text()
    assert not opened.is_set(), "the FIFO marker was opened"


def _grade_dir(tiny_run: Path, tmp_path: Path, plant: Callable[[dict[str, Any]], None],
               mode: str = "spec") -> Path:
    d = tmp_path / "engine-traces"
    d.mkdir()
    recs = read_records(engine_trace(tiny_run, mode))
    plant(recs[0])
    write_records(d / "t.jsonl", recs)
    return d


HEADER_PLANTS: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("unknown source", lambda h: h.update(source="warp-drive"), "spec", "header.source"),
    ("plain with a source", lambda h: h.update(source="ngram"), "plain", "header.source"),
    ("gamma 1e9", lambda h: h["params"].update(gamma=10**9), "spec", "header.params.gamma"),
    ("seed 2^70", lambda h: h["params"].update(seed=2**70), "spec", "header.params.seed"),
    ("max_tokens 0", lambda h: h["params"].update(max_tokens=0), "spec", "header.params.max_tokens"),
    ("top_k 2^40", lambda h: h["params"].update(top_k=2**40), "spec", "header.params.top_k"),
    # every other header param a re-run reads, through its flag's validator (issue 35)
    ("mtp_conventions bad value", lambda h: h["params"].update(mtp_conventions={"hidden": "sideways"}),
     "spec", "header.params.mtp_conventions"),
    ("mtp_conventions unknown name", lambda h: h["params"].update(mtp_conventions={"warp": 1}),
     "spec", "header.params.mtp_conventions"),
    ("mtp_conventions a string", lambda h: h["params"].update(mtp_conventions="hidden=pre-norm"),
     "spec", "header.params.mtp_conventions"),
    ("grammar.reasoning_end empty", lambda h: h["params"].update(grammar={
        "kind": "regex", "name": "g", "text": "a+", "sha256": "0" * 64, "reasoning_end": ""}),
     "spec", "header.params.grammar.reasoning_end"),
    ("grammar.reasoning_end 300 chars", lambda h: h["params"].update(grammar={
        "kind": "regex", "name": "g", "text": "a+", "sha256": "0" * 64, "reasoning_end": "x" * 300}),
     "spec", "header.params.grammar.reasoning_end"),
    ("grammar.kind unknown", lambda h: h["params"].update(grammar={
        "kind": "ebnf", "name": "g", "text": "a", "sha256": "0" * 64}), "spec", "header.params.grammar.kind"),
    ("grammar a list", lambda h: h["params"].update(grammar=["a+"]), "spec", "header.params.grammar"),
    ("min_tokens -1", lambda h: h["params"].update(min_tokens=-1), "spec", "header.params.min_tokens"),
    ("min_tokens a string", lambda h: h["params"].update(min_tokens="8"), "spec", "header.params.min_tokens"),
    ("rng unknown", lambda h: h["params"].update(rng="chaos"), "spec", "header.params.rng"),
    ("min_p 2", lambda h: h["params"].update(min_p=2), "spec", "header.params.min_p"),
    ("confidence_threshold a string", lambda h: h["params"].update(confidence_threshold="high"), "spec",
     "header.params.confidence_threshold"),
    ("logits_processors negative", lambda h: h["params"].update(logits_processors={
        "repetition_penalty": -1.0}), "spec", "header.params.logits_processors"),
    ("logits_processors bias huge", lambda h: h["params"].update(logits_processors={
        "logit_bias": [[5, float("inf")]]}), "spec", "header.params.logits_processors"),
    ("stop_sequences negative id", lambda h: h["params"].update(stop_sequences=[[5, -1]]), "spec",
     "header.params.stop_sequences[0]"),
    ("target.path ~nosuchuser", lambda h: h["target"].update(path="~nosuchuser-xyz/model"), "spec",
     "header.target.path"),
]


@pytest.mark.parametrize("plant,mode,field", [p[1:] for p in HEADER_PLANTS],
                         ids=[p[0] for p in HEADER_PLANTS])
def test_grade_refuses_impossible_headers(tiny_run: Path, tmp_path: Path, plant: Any, mode: str,
                                         field: str, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: graded as if valid (an unknown source re-run as two-model, γ 10^9 to 23 GB)."""
    import specparity.grading.trace_folders

    def no_models(*_a: object, **_k: object) -> None:
        raise AssertionError("a model was looked up for an invalid header")

    monkeypatch.setattr(specparity.grading.trace_folders, "case_from_header", no_models)
    d = _grade_dir(tiny_run, tmp_path, plant, mode)
    rc, _, err = cli(["grade", d, "--out", tmp_path / "g"], capsys)
    assert rc == 1, err
    assert f"t.jsonl:1: {field}:" in err, err
    assert "Traceback" not in err and "internal error" not in err
    assert not (tmp_path / "g").exists()


def test_grade_skips_its_own_earlier_output(tiny_run: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `grade D --out D/g2` graded D/g1 (an earlier grade's re-runs and copies) too."""
    from specparity.grading.trace_folders import GradeError, find_traces

    d = tmp_path / "d"
    shutil.copytree(tiny_run / "traces" / "engine", d)
    own = sorted(d.glob("*.jsonl"))
    copy_run(tiny_run, d / "g1")  # an earlier output: marker + traces/<runner>/...
    assert len(list((d / "g1").rglob("*.jsonl"))) >= 2
    assert find_traces(d, d / "g2") == own
    with pytest.raises(GradeError, match="is a specparity run/grade output"):
        find_traces(d / "g1")
    rc, _, err = cli(["grade", tiny_run], capsys)
    assert rc == 1 and "traces/engine" in one_error(err), err


def test_grade_walk_is_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `grade /` walked the whole file system (rglob), FIFOs included."""
    import specparity.grading.trace_folders
    from specparity.grading.trace_folders import GradeError, find_traces

    monkeypatch.setattr(specparity.grading.trace_folders, "MAX_WALK_ENTRIES", 2000)
    rc, _, err = cli(["grade", "/", "--out", tmp_path / "g"], capsys)
    assert rc == 1 and "more than 2000 files and folders" in one_error(err), err
    deep = tmp_path / "deep"
    (deep / "/".join("abcdefghijklmnopqrstu")).mkdir(parents=True)
    with pytest.raises(GradeError, match="nested deeper than 16 levels"):
        find_traces(deep)
    d = tmp_path / "d"
    d.mkdir()
    os.mkfifo(d / "x.jsonl")
    opened = fifo_guard(d / "x.jsonl")
    (d / "loop").symlink_to(d)
    (d / "a.jsonl").write_text("{}\n")
    assert find_traces(d) == [d / "a.jsonl"]
    rc, _, err = cli(["grade", d, "--out", tmp_path / "g2"], capsys)
    assert rc == 1 and "a.jsonl" in err and "x.jsonl" not in err, err
    assert not opened.is_set(), "the FIFO was opened"


def test_grade_reads_a_folder_other_commands_added_traces_to(tiny_run: Path, tmp_path: Path) -> None:
    """`record --out D` marks D as holding added outputs (state ``outputs``, no run id):
    D is the user's folder of traces and is graded; a run's marker (a run id) or an
    unreadable one keeps the folder out."""
    import json

    from reports.tables import RUN_MARKER
    from specparity.grading.trace_folders import GradeError, find_traces

    d = tmp_path / "rec"
    shutil.copytree(tiny_run / "traces" / "engine", d / "engine")
    own = sorted((d / "engine").glob("*.jsonl"))
    (d / RUN_MARKER).write_text(json.dumps({"command": "specparity record", "state": "outputs",
                                            "files": [], "added": [str(p.relative_to(d)) for p in own]}))
    assert own and find_traces(d) == own
    (d / RUN_MARKER).write_text(json.dumps({"command": "specparity run", "state": "complete",
                                            "run_id": "abc", "files": [], "added": []}))
    with pytest.raises(GradeError, match="is a specparity run/grade output"):
        find_traces(d)
    (d / RUN_MARKER).write_text("{not json")
    with pytest.raises(GradeError, match="is a specparity run/grade output"):
        find_traces(d)


@pytest.mark.parametrize("value,where", [
    (187.7, "prompt_ids"), ("496", "prompt_ids"), (True, "prompt_ids"),
    (True, "round.samples"), ("5", "plain.sample"), ("nan", "round.margins"), (1.0, "eos_ids"),
], ids=["float id", "str id", "bool id", "bool sample", "str plain sample", "str margin", "float eos"])
def test_writer_refuses_non_integer_token_ids(value: Any, where: str) -> None:
    """Before: int()/float() coerced 187.7 -> 187, "496" -> 496, True -> 1 into a valid trace."""
    from traces.records import RecordValueError
    from traces.writer import EngineTrace

    def trace(**kw: Any) -> EngineTrace:
        args: dict[str, Any] = {"runner": {"name": "x"}, "case_id": "c", "prompt_id": "p",
                                "prompt_ids": [1, 2], "target": {"path": "t"}, "eos_ids": [0],
                                "drafter": {"path": "d"}}
        return EngineTrace(**{**args, **kw})

    field = {"prompt_ids": "prompt.token_ids[1]", "eos_ids": "eos_ids[0]"}.get(where, where)
    with pytest.raises(RecordValueError, match=rf"^{re.escape(field)}"):
        if where == "prompt_ids":
            trace(prompt_ids=[1, value])
        elif where == "eos_ids":
            trace(eos_ids=[value])
        elif where == "round.samples":
            trace().round(feed=[1], pending=1, drafts=[2], samples=[value], k_accept=0, emitted=[],
                          end="correction", margins=[0.5, 0.5])
        elif where == "round.margins":
            trace().round(feed=[1], pending=1, drafts=[2], samples=[3], k_accept=0, emitted=[3],
                          end="correction", margins=[value, 0.5])
        else:
            trace(drafter=None).plain(input=[1], sample=value, margin=0.5, emitted=[5], end=None)


def test_writer_accepts_numpy_and_mlx_integers() -> None:
    import mlx.core as mx
    import numpy as np

    from traces.validate import validate_records
    from traces.writer import EngineTrace

    tr = EngineTrace(runner={"name": "x", "version": "1"}, case_id="c", prompt_id="p", prompt_ids=np.array([1, 2]),
                     target={"path": "t", "weights_sha256": None, "config_sha256": None},
                     eos_ids=[np.int64(0)], drafter={"path": "d", "weights_sha256": None,
                                                     "config_sha256": None},
                     params={"gamma": 1})
    tr.round(feed=[mx.array(2)], pending=np.int32(2), drafts=[3], samples=[3, 4], k_accept=1,
             emitted=[3, 4], end="bonus", margins=[np.float32(1.5), 2.0])
    recs = tr.all_records()
    assert recs[1]["window"] == [2, 3] and recs[0]["prompt"]["token_ids"] == [1, 2]
    assert all(type(t) is int for t in recs[1]["feed"] + recs[1]["samples"])
    assert validate_records(enumerate(json.loads(json.dumps(r)) for r in recs)) == []


def test_grade_a_file_is_a_usage_error(tiny_run: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``grade FILE`` (a trace, not a folder) exited 1, as a failed grade would."""
    trace = engine_trace(tiny_run, "spec")
    for arg, must in ((trace, "not a directory"), (tmp_path / "nope", "no such directory"),
                      ("~nosuchuser-xyz/traces", "no such user")):
        rc, out, err = cli(["grade", arg, "--out", tmp_path / "g"], capsys)
        assert rc == 2, err
        one_error(err, must)
        assert out == "" and not (tmp_path / "g").exists()
