"""Older hostile inputs still open in issue 41 (round four), each one line naming the file.

- a lying header's ``logit_bias`` id outside the target's vocabulary: found before the model
  loads, the trace file named;
- ``grade RUN/batched``: the batch traces there (``batch.jsonl``) are validated, not graded as
  request traces (they were refused as broken ones);
- a trace whose header ``case_id`` has 5,000 characters, or whose grammar is named with 400:
  re-run and graded (the id's file stem and the grammar's file name were past the OS limit);
- ``tokenizer.json`` = ``{}``: one line naming it (was a ``KeyError`` from inside mlx-lm);
- a 4-bit checkpoint whose config lost its ``quantization`` block: one line naming the config.
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


def _trace(zoo_pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    t = tmp_path / "made" / "t.jsonl"
    rc, _, err = cli(["generate", "--target", zoo_pair[0], "--draft", zoo_pair[1], "--prompt-ids", "5,6",
                      "-n", "4", "--trace", t], capsys)
    assert rc == 0, err
    return read_records(t)


def test_a_5000_character_case_id_is_graded(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    recs = _trace(zoo_pair, tmp_path, capsys)
    recs[0]["case_id"] = "x" * 5000
    d = tmp_path / "in"
    d.mkdir()
    write_records(d / "t.jsonl", recs)
    rc, _, err = cli(["grade", d, "--runners", "", "--out", tmp_path / "g"], capsys)
    assert rc == 0, err
    assert all(len(p.name.encode()) <= 255 for p in (tmp_path / "g").rglob("*"))


def test_a_400_character_grammar_name_is_graded(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    monkeypatch.setenv("SPECPARITY_CACHE_DIR", str(tmp_path / "cache"))
    recs = _trace(zoo_pair, tmp_path, capsys)
    recs[0]["params"]["grammar"] = {"kind": "regex", "name": "g" * 400, "text": "[a-z ]+",
                                    "sha256": hashlib.sha256(b"regex\0[a-z ]+").hexdigest()}
    d = tmp_path / "in"
    d.mkdir()
    write_records(d / "t.jsonl", recs)
    rc, _, err = cli(["grade", d, "--runners", "", "--out", tmp_path / "g"], capsys)
    assert rc in (0, 1), err  # graded (the trace was not made under this grammar: it may differ)
    assert "Traceback" not in err and "internal error" not in err and "File name too long" not in err, err
    recs[0]["params"]["grammar"]["sha256"] = "0" * 64  # a refusal quotes the name cut short
    write_records(d / "t.jsonl", recs)
    rc, _, err = cli(["grade", d, "--runners", "", "--out", tmp_path / "g2"], capsys)
    line = one_error(err, "does not match its sha256", "400 characters")
    assert rc != 0 and len(line) < 400


@pytest.fixture
def llama_copy(zoo_pair: tuple[Path, Path], tmp_path: Path) -> Path:
    import shutil

    d = tmp_path / "model"
    shutil.copytree(zoo_pair[0], d)
    return d


def test_an_empty_tokenizer_json_is_one_line(llama_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (llama_copy / "tokenizer.json").write_text("{}")
    rc, _, err = cli(["generate", "--target", llama_copy, "--prompt-ids", "5,6", "-n", "2"], capsys)
    assert rc == 2, err
    one_error(err, str(llama_copy / "tokenizer.json"), "'model' missing")


def test_a_4bit_checkpoint_without_its_quantization_config_is_one_line(
        llama_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load, quantize_model

    model, _ = load(str(llama_copy))
    cfg = json.loads((llama_copy / "config.json").read_text())
    model, qcfg = quantize_model(model, cfg, 32, 4)
    mx.save_safetensors(str(llama_copy / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (llama_copy / "config.json").write_text(json.dumps(qcfg))
    rc, _, err = cli(["generate", "--target", llama_copy, "--prompt-ids", "5,6", "-n", "2"], capsys)
    assert rc == 0, err  # with its quantization block: loads
    (llama_copy / "config.json").write_text(json.dumps({k: v for k, v in qcfg.items()
                                                        if k not in ("quantization", "quantization_config")}))
    rc, _, err = cli(["generate", "--target", llama_copy, "--prompt-ids", "5,6", "-n", "2"], capsys)
    assert rc == 2, err
    one_error(err, str(llama_copy / "config.json"), "no 'quantization' block", "quantized")
