"""Older hostile inputs still open in issue 41 (round four), each one line naming the file.

- a lying header's ``logit_bias`` id outside the target's vocabulary: found before the model
  loads, the trace file named;
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
