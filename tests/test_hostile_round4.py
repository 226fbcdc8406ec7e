"""Older hostile inputs still open in issue 41 (round four), each one line naming the file.

- a lying header's ``logit_bias`` id outside the target's vocabulary: found before the model
  loads, the trace file named;
- ``grade RUN/batched``: the batch traces there (``batch.jsonl``) are validated, not graded as
  request traces (they were refused as broken ones);
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import cli, engine_trace, one_error, read_records, write_records


def test_header_logit_bias_outside_the_vocabulary_is_found_before_the_model_loads(
        tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import specparity.runners

    def no_load(*_a: Any, **_k: Any) -> None:
        raise AssertionError("the model was loaded before the header's bias ids were checked")

    monkeypatch.setattr(specparity.runners, "load_model", no_load)
    d = tmp_path / "traces"
    d.mkdir()
    recs = read_records(engine_trace(tiny_run, "spec"))
    from engine.pipeline import processors_block
    from engine.sampler import ProcessorParams

    recs[0]["params"]["logits_processors"] = processors_block(ProcessorParams(logit_bias=((5, 1.0), (10**7, 2.0))))
    write_records(d / "t.jsonl", recs)
    rc, _, err = cli(["grade", d, "--runners", "", "--out", tmp_path / "g"], capsys)
    assert rc in (1, 2), err
    line = one_error(err, "t.jsonl", "logit_bias", "10000000", "outside the target's vocabulary")
    assert "config.json" in line


def test_grade_of_a_runs_batched_folder_grades_its_request_traces(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``grade RUN/batched``: the batch traces there (``batch.jsonl``, valid for ``trace validate``)
    are not refused as broken traces; the rows' own traces are graded."""
    from specparity.cases.case import Case
    from specparity.jobs import batched as sb
    from traces.validate import validate_file

    case = Case("llama", "twin", "nat-00", 3, 8)
    small = [bc for bc in sb.batch_cases([case]) if bc.name.endswith("twin/B2")]
    monkeypatch.setattr(sb, "batch_cases", lambda cs: small)
    run = tmp_path / "run"
    run.mkdir()
    sb.batched_comparisons(run, [case])
    batch = sorted((run / "batched").rglob("batch.jsonl"))
    assert batch and validate_file(batch[0]) == []
    rc, _, err = cli(["grade", run / "batched", "--runners", "", "--out", tmp_path / "g"], capsys)
    assert rc in (0, 1), err
    assert "batch_step" not in err and "problem(s) in the traces" not in err and "Traceback" not in err, err
    graded = (tmp_path / "g" / "comparisons.json").read_text()
    assert "llama" in graded
