"""Hostile model directories: truncated weights, broken or odd ``config.json``, NaN weights,
FIFOs in place of model files, names past 255 bytes or starting with a dot.

What each test checks, and the catalogue of inputs: ``tests/test_hostile_catalogue.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    cli,
    engine_trace,
    fifo_guard,
    one_error,
    read_records,
    refused,
    write_records,
)

pytestmark = pytest.mark.usefixtures("in_tmp")


def _broken_model(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    st = dst / "model.safetensors"
    if how == "truncated safetensors":
        os.truncate(st, st.stat().st_size // 2)
    elif how == "config.json not JSON":
        (dst / "config.json").write_text("{bad")
    elif how == "no config.json":
        (dst / "config.json").unlink()
    return dst


@pytest.mark.parametrize("how", ["truncated safetensors", "config.json not JSON", "no config.json"])
def test_broken_model_dir(zoo_pair: tuple[Path, Path], tmp_path: Path, how: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    bad = _broken_model(zoo_pair[0], tmp_path / "model", how)
    for argv in (["generate", "--target", bad, "-n", "4", "--prompt-ids", "5,6"],
                 ["generate", "--target", zoo_pair[0], "--draft", bad, "-n", "4", "--prompt-ids", "5,6"],
                 ["ab", "--target", bad, "--drafter-a", "twin", "--drafter-b", "small"],
                 ["audit", "--target", bad, "--prompts", "1"],
                 ["run", "--target", bad, "--draft", zoo_pair[1], "--max-tokens", "4"]):
        rc, out, err = cli(argv, capsys)
        assert rc == 2, err
        one_error(err, str(bad))


def test_nan_logits_target_fails_clearly(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    import mlx.core as mx

    bad = tmp_path / "nan-target"
    shutil.copytree(zoo_pair[0], bad)
    weights = mx.load(str(bad / "model.safetensors"))
    weights = {k: (v * float("nan") if "norm" in k else v) for k, v in weights.items()}
    mx.save_safetensors(str(bad / "model.safetensors"), weights)
    trace = tmp_path / "t.jsonl"
    for extra in ([], ["--draft", str(zoo_pair[1])]):
        rc, out, err = cli(["generate", "--target", bad, "-n", "8", "--prompt-ids", "5,6",
                            "--trace", trace, *extra], capsys)
        assert rc == 1, (out, err)
        one_error(err, "non-finite logits")
        assert not trace.exists()


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_fifo_model_files_are_refused(zoo_pair: tuple[Path, Path], tmp_path: Path, name: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Before: mlx-lm's loader (or our config read) blocked forever on a FIFO in the model dir."""
    from engine.models import ModelLoadError, load

    d = shutil.copytree(zoo_pair[0], tmp_path / "m")
    (d / name).unlink()
    os.mkfifo(d / name)
    opened = fifo_guard(d / name)
    with pytest.raises(ModelLoadError, match=f"{name}: not a regular file"):
        load(d)
    rc, _, err = cli(["generate", "--target", d, "-n", "2", "--prompt-ids", "5,6"], capsys)
    refused(rc, err, name, "not a regular file")
    assert not opened.is_set(), f"{name} was opened"


@pytest.mark.parametrize("edit,key", [
    (lambda c: c.pop("model_type"), "model_type"),
    (lambda c: c.update(vocab_size=str(c["vocab_size"])), "vocab_size"),
    (lambda c: c.update(vocab_size=True), "vocab_size"),
    (lambda c: c.update(eos_token_id="two"), "eos_token_id"),
    (lambda c: c.update(text_config={"hidden_size": 0}), "text_config.hidden_size"),
], ids=["no model_type", "string vocab_size", "vocab_size true", "string eos_token_id",
        "text_config.hidden_size 0"])
def test_bad_config_json_is_one_line(zoo_pair: tuple[Path, Path], tmp_path: Path, edit: Callable[..., Any],
                                     key: str, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "model"
    shutil.copytree(zoo_pair[0], bad)
    cfg = json.loads((bad / "config.json").read_text())
    edit(cfg)
    (bad / "config.json").write_text(json.dumps(cfg))
    prompts = tmp_path / "p.txt"
    prompts.write_text("ba de\n")
    for argv in (["generate", "--target", bad, "-n", "2", "--prompt-ids", "5"],
                 ["generate", "--target", zoo_pair[0], "--draft", bad, "-n", "2", "--prompt-ids", "5"],
                 ["run", "--target", bad, "--prompts-file", prompts, "--max-tokens", "2"],
                 ["audit", "--target", bad, "--prompts", "1"]):
        rc, _, err = cli(argv, capsys)
        assert rc == 2, (argv, err)
        one_error(err, "config.json", key)
    from engine.models import ModelLoadError, check_model_dir

    with pytest.raises(ModelLoadError, match=key):
        check_model_dir(bad)


def test_long_case_ids_become_short_file_names(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cases.case import STEM_MAX_BYTES, file_stem

    model = tmp_path / ("m" * 250)
    shutil.copytree(zoo_pair[0], model)
    prompts = tmp_path / "p.txt"
    prompts.write_text("ba de fi\n")
    d = tmp_path / "run"
    rc, _, err = cli(["run", "--target", model, "--prompts-file", prompts, "--max-tokens", "4",
                      "--runners", "", "--out", d, "--quiet"], capsys)
    assert rc == 0, err
    (trace,) = (d / "traces" / "engine").glob("*.jsonl")
    assert len(trace.stem.encode()) <= STEM_MAX_BYTES and "m" * 150 in trace.stem
    assert file_stem("a" * 300) != file_stem("a" * 299 + "b"), "cut ids stay distinct"
    assert file_stem("llama/twin/nat-00/g1/n4") == "llama__twin__nat-00__g1__n4", "short ids unchanged"


def test_case_ids_starting_with_a_dot_are_not_hidden(zoo_pair: tuple[Path, Path], tiny_run: Path,
                                                     tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / ".hidden-model"
    shutil.copytree(zoo_pair[0], model)
    prompts = tmp_path / "p.txt"
    prompts.write_text("ba de fi\n")
    d = tmp_path / "run"
    rc, _, err = cli(["run", "--target", model, "--draft", zoo_pair[1], "--prompts-file", prompts,
                      "--max-tokens", "4", "--gammas", "1", "--runners", "", "--out", d, "--quiet"],
                     capsys)
    assert rc == 0, err
    traces = list((d / "traces" / "engine").iterdir())
    assert len(traces) == 2 and not any(p.name.startswith(".") for p in traces), traces
    assert "**CONFORMS**" in (d / "report.md").read_text()
    folder = tmp_path / "engine-traces"
    folder.mkdir()
    recs = read_records(engine_trace(tiny_run, "spec"))
    recs[0]["case_id"] = ".hidden/case"
    write_records(folder / "t.jsonl", recs)
    rc, _, err = cli(["grade", folder, "--out", tmp_path / "graded", "--runners", "", "--quiet"],
                     capsys)
    assert rc == 0, err
    graded = list((tmp_path / "graded" / "traces" / "engine").iterdir())
    assert graded and not any(p.name.startswith(".") for p in graded), graded


# ------------------------------------------------------------- headers and configs that lie (issue 35)


def _rewrite_header(st: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a safetensors file's JSON header (the data bytes kept as they are)."""
    raw = st.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    st.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def _first(h: dict[str, Any], name: str = "model.embed_tokens.weight") -> dict[str, Any]:
    return h[name]


def _overlap(h: dict[str, Any]) -> None:
    a, b = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])[:2]
    begin = h[a]["data_offsets"][0]
    h[b]["data_offsets"] = [begin, begin + (h[b]["data_offsets"][1] - h[b]["data_offsets"][0])]


HEADER_LIES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("offsets disagree with the shape", lambda h: _first(h)["shape"].__setitem__(0, 2 * _first(h)["shape"][0]),
     "needs"),
    ("negative offset", lambda h: _first(h).update(data_offsets=[-8, _first(h)["data_offsets"][1]]),
     "data_offsets"),
    ("negative shape", lambda h: _first(h).update(shape=[-1, *_first(h)["shape"][1:]]), "shape"),
    ("unknown dtype", lambda h: _first(h).update(dtype="F12"), "unknown dtype 'F12'"),
    ("offsets not a pair", lambda h: _first(h).update(data_offsets=[0]), "data_offsets"),
    ("overlapping tensors", _overlap, "overlap"),
]


@pytest.mark.parametrize("edit,must", [p[1:] for p in HEADER_LIES], ids=[p[0] for p in HEADER_LIES])
def test_safetensors_header_that_lies_is_one_line(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                  edit: Callable[[dict[str, Any]], None], must: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Before: internal errors (or MLX trusting the offsets). Refused by every path that reads
    weights, naming the file and the tensor: the flags, the loader, the weights digest."""
    from engine.models import ModelLoadError, load
    from traces.digest import WeightsError, weights_digest

    bad = shutil.copytree(zoo_pair[0], tmp_path / "model")
    _rewrite_header(bad / "model.safetensors", edit)
    for argv in (["generate", "--target", bad, "-n", "2", "--prompt-ids", "5"],
                 ["generate", "--target", zoo_pair[0], "--draft", bad, "-n", "2", "--prompt-ids", "5"],
                 ["run", "--target", bad, "--draft", zoo_pair[1], "--max-tokens", "2"]):
        rc, _, err = cli(argv, capsys)
        refused(rc, err, "model.safetensors", must)
    with pytest.raises(ModelLoadError, match=must):
        load(bad)
    with pytest.raises(WeightsError, match=must):
        weights_digest(bad)


CONFIG_LIES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("quantization a string", lambda c: c.update(quantization="4bit"), "'quantization' must be an object"),
    ("quantization a list", lambda c: c.update(quantization=[4, 64]), "'quantization' must be an object"),
    ("quantization.bits 0", lambda c: c.update(quantization={"group_size": 64, "bits": 0}),
     "'quantization.bits'"),
    ("quantization without group_size", lambda c: c.update(quantization={"bits": 4}),
     "'quantization.group_size'"),
    ("quantization_config a number", lambda c: c.update(quantization_config=8),
     "'quantization_config' must be an object"),
    ("vocab_size 10^9", lambda c: c.update(vocab_size=10**9), "'vocab_size' is 1000000000"),
    ("hidden_size 10^6", lambda c: c.update(hidden_size=10**6), "'hidden_size' is 1000000"),
    ("num_hidden_layers 10^6", lambda c: c.update(num_hidden_layers=10**6), "'num_hidden_layers' is 1000000"),
]


@pytest.mark.parametrize("edit,must", [p[1:] for p in CONFIG_LIES], ids=[p[0] for p in CONFIG_LIES])
def test_config_that_lies_about_its_weights_is_one_line(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                        edit: Callable[[dict[str, Any]], None], must: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: internal errors, lines naming neither file nor field, or (num_hidden_layers 10^6)
    minutes building a model. Refused before MLX builds anything, at once."""
    import time

    from engine.models import ModelLoadError, load

    bad = shutil.copytree(zoo_pair[0], tmp_path / "model")
    cfg = json.loads((bad / "config.json").read_text())
    edit(cfg)
    (bad / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    for argv in (["generate", "--target", bad, "-n", "2", "--prompt-ids", "5"],
                 ["run", "--target", bad, "--draft", zoo_pair[1], "--max-tokens", "2"]):
        rc, _, err = cli(argv, capsys)
        refused(rc, err, "config.json", must)
    with pytest.raises(ModelLoadError, match=must):
        load(bad)
    assert time.perf_counter() - t0 < 10, "refused before any model is built"


def test_a_shard_the_index_names_but_the_folder_lacks(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    bad = shutil.copytree(zoo_pair[0], tmp_path / "model")
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors"}}))
    rc, _, err = cli(["generate", "--target", bad, "-n", "2", "--prompt-ids", "5"], capsys)
    refused(rc, err, "model.safetensors.index.json", "model-00002-of-00002.safetensors", "lacks")
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../evil.safetensors"}}))
    rc, _, err = cli(["generate", "--target", bad, "-n", "2", "--prompt-ids", "5"], capsys)
    refused(rc, err, "model.safetensors.index.json", "not a file name")


@pytest.mark.parametrize("how", ["a symlink loop", "a dangling symlink", "nested 100000 deep"])
def test_a_config_loop_is_one_line(zoo_pair: tuple[Path, Path], tmp_path: Path, how: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    bad = shutil.copytree(zoo_pair[0], tmp_path / "model")
    cfg = bad / "config.json"
    cfg.unlink()
    if how == "a symlink loop":
        cfg.symlink_to("config.json")
    elif how == "a dangling symlink":
        cfg.symlink_to(tmp_path / "nowhere.json")
    else:
        cfg.write_text('{"model_type": ' + "[" * 100_000 + "]" * 100_000 + "}")
    rc, _, err = cli(["generate", "--target", bad, "-n", "2", "--prompt-ids", "5"], capsys)
    refused(rc, err, "config.json")


def test_native_mtp_checkpoint_as_the_users_own_target(capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    """The documented form (docs/references.md) on the zoo's DeepSeek-style checkpoint (two MTP
    layers past num_hidden_layers; stock mlx-lm refuses them): before, ``Received 34 parameters
    not in model``. The target loads as its trunk: the same tokens as the stripped checkpoint."""
    from zoo.native_mtp import model_dir

    ckpt, plain = model_dir("deepseek-mtp"), model_dir("deepseek-mtp-plain")
    trace = tmp_path / "t.jsonl"
    rc, out, err = cli(["generate", "--source", "native-mtp", "--target", ckpt, "--draft", ckpt,
                        "--prompt-ids", "5,6,7,8", "-n", "12", "--trace", trace], capsys)
    assert rc == 0, err
    assert "source native-mtp" in err
    rc, plain_out, err = cli(["generate", "--target", plain, "--prompt-ids", "5,6,7,8", "-n", "12"], capsys)
    assert rc == 0, err
    assert out == plain_out, "the trunk of the full checkpoint is the stripped checkpoint"
    rc, ckpt_out, err = cli(["generate", "--target", ckpt, "--prompt-ids", "5,6,7,8", "-n", "12"], capsys)
    assert rc == 0 and ckpt_out == plain_out, err
