"""Batch traces (``traces/INTERPRETING.md`` "Batch traces") and a row diffed against its serial trace.

A batched run's rows are ordinary request traces (the engine runner's header, the serial
executor's records, plus the optional ``round.batch``) and its batch trace is one
``batch_step`` record per step. ``specparity diff ROW SERIAL`` is identical on a conforming
run; with a planted neighbour rollback it names the round, the batch step and the rows
present. ``specparity run``'s batched cases (``specparity.jobs.batched``) write the files and one
comparison per row and per invariance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine import batched as eb
from engine.batched import batch_generate
from specparity.cases.case import Case
from specparity.jobs.batched import BatchCase, _row, batch_cases, batched_comparisons, row_requests
from specparity.runners import run_case
from traces.diff import diff_main, diff_traces
from traces.io import Trace, write_trace
from traces.validate import validate_batch_steps, validate_trace

CASE = BatchCase("llama/twin/B3", tuple(_row(Case("llama", "twin", "nat-00"), "twin", i) for i in range(3)), (0, 0, 1),
                 ((2, 4), None, None))


def traces_of(bc: BatchCase) -> tuple[Any, dict[str, Trace], dict[str, Trace]]:
    model, reqs, headers = row_requests(bc)
    res = batch_generate(model.model, reqs)
    rows = {rid: Trace.from_records([h, *res.rows[rid].records, res.rows[rid].footer()])
            for rid, h in zip(bc.rids, headers, strict=True)}
    serial = {rid: Trace.from_records(run_case("engine", c)) for rid, c in zip(bc.rids, bc.rows, strict=True)}
    return res, rows, serial


def swap_neighbour_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    real = eb._drops

    def swapped(keeps: list[int], width: int) -> list[int]:
        d = real(keeps, width)
        if len(d) > 1:
            d[0], d[1] = d[1], d[0]
        return d

    monkeypatch.setattr(eb, "_drops", swapped)


def test_row_traces_and_batch_trace_are_valid_and_rows_diff_identical() -> None:
    res, rows, serial = traces_of(CASE)
    assert validate_batch_steps(res.steps) == []
    for rid, t in rows.items():
        assert validate_trace(t) == [], rid
        assert all(r["batch"]["row"] == rid for r in t.rounds if "batch" in r)
        assert diff_traces(t, serial[rid], level="round") is None, rid
    assert any(len(r["batch"]["neighbours"]) == 2 for t in rows.values() for r in t.rounds)


def test_planted_batch_trace_faults_are_named() -> None:
    res, _, _ = traces_of(CASE)
    steps = json.loads(json.dumps(res.steps))
    steps[2]["index"] = steps[1]["index"]
    steps[1]["rows"].append(dict(steps[1]["rows"][0]))
    steps[3]["rows"][0]["round"] += 1
    steps[4]["width"] = -1
    problems = "\n".join(validate_batch_steps(steps))
    assert "line 3: batch_step.index" in problems, problems
    assert f"line 2: batch_step.rows: row {steps[1]['rows'][0]['row']!r} twice" in problems, problems
    assert "line 4: batch_step.rows: row" in problems and "expected" in problems, problems
    assert "line 5: batch_step.width: -1 is less than the minimum of 0" in problems, problems


def test_diff_names_batch_step_and_neighbours(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    swap_neighbour_drops(monkeypatch)
    res, rows, serial = traces_of(CASE)
    first = next(s for s in res.steps if len(s["rows"]) >= 2
                 and len({s["width"] - e["k_accept"] for e in s["rows"][:2]}) == 2)
    hit = []
    for rid in CASE.rids:
        div = diff_traces(rows[rid], serial[rid], level="round")
        if div is not None:
            hit.append((rid, div))
    assert hit, "the planted neighbour rollback went unnoticed"

    def step(x: tuple[str, Any]) -> int:
        kind, _, num = x[1].where.partition(" ")
        return rows[x[0]].rounds[int(num)]["batch"]["step"] if kind == "round" else 1 << 30

    rid, div = min(hit, key=step)
    entry = next(e for e in first["rows"] if e["row"] == rid)
    assert div.where == f"round {entry['round']}" and div.klass == "logic", div.message
    assert f"a ({rid}) ran it in batch step {first['index']}" in div.message, div.message
    assert "rows present: " + ", ".join(entry["neighbours"]) in div.message, div.message
    # the same through the command line
    a, b = tmp_path / "row.jsonl", tmp_path / "serial.jsonl"
    write_trace(a, rows[rid].records())
    write_trace(b, serial[rid].records())
    assert diff_main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert f"ran it in batch step {first['index']}" in out and "rows present" in out, out


def test_run_batched_cases_write_files_and_compare(tmp_path: Path) -> None:
    cases = [Case("llama", "twin", "nat-00", 3, 16)]
    assert [bc.name for bc in batch_cases(cases)] == ["llama/twin/B2", "llama/twin/B4", "llama/ngram/B2",
                                                      "llama/ngram/B4"]
    from specparity.jobs import batched as sb

    small = [bc for bc in batch_cases(cases) if bc.name.endswith("twin/B4")]
    cmp = []
    orig = sb.batch_cases
    try:
        sb.batch_cases = lambda cs: small  # type: ignore[assignment]
        cmp = batched_comparisons(tmp_path, cases)
    finally:
        sb.batch_cases = orig  # type: ignore[assignment]
    kinds = sorted({c.kind for c in cmp})
    assert kinds == ["batched-B", "batched-M", "batched-seeded", "batched-vs-serial"], kinds
    assert not any(c.fails for c in cmp), [c.message for c in cmp if c.fails]
    assert {c.verdict for c in cmp if c.case_id.startswith("engine:")} == {"identical"}
    assert {c.verdict for c in cmp if c.case_id.startswith("mlx_lm:")} == {"not compared"}
    folder = tmp_path / "batched" / "llama__twin__B4"
    assert sorted(p.name for p in folder.iterdir())[:3] == ["batch.jsonl", "r0.jsonl", "r0.serial.jsonl"]
    steps = [json.loads(x) for x in (folder / "batch.jsonl").read_text().splitlines()]
    assert validate_batch_steps(steps) == []
    report = json.loads((tmp_path / "batched.json").read_text())
    assert report[0]["invariances"]["engine"][0]["name"] == "M"


def test_a_batch_trace_file_goes_through_the_trace_validator(tmp_path: Any) -> None:
    """``specparity trace validate`` (and every check that validates a run's files) reads a batch
    trace as one: valid as written, a planted fault named by line and field."""
    from traces.validate import validate_file

    res, _, _ = traces_of(CASE)
    good, bad = tmp_path / "batch.jsonl", tmp_path / "bad.jsonl"
    good.write_text("\n".join(json.dumps(s) for s in res.steps) + "\n")
    assert validate_file(good) == []
    steps = json.loads(json.dumps(res.steps))
    steps[2]["index"] = steps[1]["index"]
    bad.write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    errs = validate_file(bad)
    assert errs and errs[0].line == 3 and errs[0].field == "batch_step.index", [e.format() for e in errs]
