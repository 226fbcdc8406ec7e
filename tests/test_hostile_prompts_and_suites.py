"""Hostile prompts files and suite files: a BOM, JSON arrays, JSON cut short, deep nesting,
FIFOs and devices, and every suite key with every bad value (each read as its flag reads it).

What each test checks, and the catalogue of inputs: ``tests/test_hostile_catalogue.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import zoo
from specparity.cli import main
from tests.helpers import cli, fifo_guard, refused

pytestmark = pytest.mark.usefixtures("in_tmp")


def test_prompts_file_bom_json_array_and_text(tmp_path: Path) -> None:
    """A BOM is dropped (before: the JSONL was read as one text prompt per line); a JSON array
    is read as prompts; JSON-looking garbage is refused, not read as text."""
    from specparity.cases.prompts import PromptError, read_prompts_file

    objs = [{"id": "a", "token_ids": [5, 6, 7]}, {"id": "b", "text": "ba de"}]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(o) + "\n" for o in objs).encode())
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps(objs, indent=2))
    want = [("a", None, (5, 6, 7)), ("b", "ba de", None)]
    for f in (bom, arr):
        assert [(p.id, p.text, p.token_ids) for p in read_prompts_file(f)] == want, f
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(objs)[:-5])
    with pytest.raises(PromptError, match="JSON array of prompts but is not valid JSON"):
        read_prompts_file(cut)
    bad_item = tmp_path / "item.json"
    bad_item.write_text('[{"id": "a", "text": "x"}, 5]')
    with pytest.raises(PromptError, match="item 2: expected a JSON object"):
        read_prompts_file(bad_item)
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"id": ' + "[" * 100_000 + "\n")
    with pytest.raises(PromptError, match="deep.jsonl:1"):
        read_prompts_file(deep)
    inst = tmp_path / "inst.txt"
    inst.write_text("[INST] hi [/INST]\n")
    assert [(p.id, p.text) for p in read_prompts_file(inst)] == [("line-1", "[INST] hi [/INST]")]


def test_fifo_and_device_prompts_files_are_refused(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cases.prompts import PromptError, read_prompts_file

    fifo = tmp_path / "p.jsonl"
    os.mkfifo(fifo)
    opened = fifo_guard(fifo)
    with pytest.raises(PromptError, match="not a regular file"):
        read_prompts_file(fifo)
    for target in (fifo, "/dev/zero"):
        suite = tmp_path / "s.toml"
        suite.write_text(f'prompts_file = "{target}"\n[[pair]]\ntarget = "llama"\n')
        rc, _, err = cli(["run", "--suite", suite], capsys)
        refused(rc, err, "prompts_file", "not a regular file")
    assert not opened.is_set(), "the FIFO was opened"


# TOML spelling of the flag sweep's values, and the flag whose validator a suite key shares.
SUITE_SWEEP = {"nan": "nan", "-1": "-1", "99999999999999999999": "99999999999999999999",
               "/dev/zero": '"/dev/zero"', "a\x00b": '"a\\u0000b"'}


SUITE_KEY_FLAG: dict[str, str | None] = {
    "gammas": "--gammas", "max_tokens": "--max-tokens", "zoo_prompts": "--prompts",
    "prompts_file": "--prompts-file", "eos_ids": "--eos-ids", "stop_ids": None,
    "stop_strings": None, "truncate": None, "chat_template": None, "sampling.temperature": "--temps",
    "sampling.top_p": "--top-p", "sampling.top_k": "--top-k", "sampling.seed": "--seed",
    "sampling.min_p": "--min-p",
    "sampling.min_tokens": "--min-tokens", "sampling.rng": "--rng",
    "sampling.processors": None, "target": None, "drafter": None, "sources": None,
    "kv_bits": "--kv-bits", "kv_group_size": "--kv-group-size", "quantized_kv_start": "--quantized-kv-start",
    "rotating": "--rotating", "grammar": "--grammar", "reasoning_end": "--reasoning-end",
}


_LIST_KEYS = {"gammas", "eos_ids", "stop_strings", "sources"}


def test_suite_values_go_through_the_flag_validators(tmp_path: Path,
                                                    captured: list[dict[str, Any]]) -> None:
    """Every suite key x every flag-sweep value: no traceback; a suite accepts a value exactly
    when the key's flag accepts it (before: seed = 2^70, gammas = [10^20] ... were accepted)."""
    import contextlib
    import io

    from specparity.cases.suite import _PAIR_KEYS, _SAMPLING_KEYS

    assert set(SUITE_KEY_FLAG) == ({k for k in _PAIR_KEYS if k not in ("source", "sampling")}
                                   | {f"sampling.{k}" for k in _SAMPLING_KEYS}), "a new suite key"

    def accepted(argv: list[str]) -> tuple[bool, str]:
        captured.clear()
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["run", "--out", str(tmp_path / "out"), *argv])
        text = err.getvalue()
        assert "Traceback" not in text and ("internal error" not in text or captured), (argv, text)
        if not captured:
            assert rc == 2 and len([ln for ln in text.splitlines() if "error:" in ln]) == 1, (argv, text)
        return bool(captured), text

    tried, disagree = 0, []
    for key, flag in SUITE_KEY_FLAG.items():
        for raw, toml in SUITE_SWEEP.items():
            value = f"[{toml}]" if key in _LIST_KEYS else f"[[{toml}]]" if key == "stop_ids" else toml
            pair = {"target": '"llama"', "drafter": '"twin"', "sources": '["two-model"]'}
            top = ["zoo_prompts = 1", "gammas = [1]"]
            if key.startswith("sampling."):
                temp = "" if key == "sampling.temperature" else "temperature = 0.5, "
                top.append(f"sampling = [{{{temp}{key.split('.')[1]} = {value}}}]")
            elif key in pair:
                pair[key] = value
            else:
                top = [ln for ln in top if not ln.startswith(key)] + [f"{key} = {value}"]
            suite = tmp_path / f"s{tried}.toml"
            suite.write_text("\n".join(top) + "\n[[pair]]\n"
                             + "".join(f"{k} = {v}\n" for k, v in pair.items()))
            ok, text = accepted(["--suite", str(suite)])
            tried += 1
            if flag is not None:
                extra = ["--temps", "0.5"] if flag in ("--top-p", "--top-k", "--min-p", "--seed") else []
                base = ["--target", "llama", "--draft", str(zoo.model_dir("llama-twin"))] \
                    if flag == "--prompts-file" else ["--targets", "llama", "--drafters", "twin"]
                flag_ok, flag_text = accepted([*base, "--gammas", "1", *extra, flag, raw])
                if ok != flag_ok:
                    disagree.append((key, raw, text[-200:], flag_text[-200:]))
    print(f"suite sweep: {tried} suites")
    assert not disagree, disagree


@pytest.mark.parametrize("content,must", [
    (b"hello\x00world\nsecond\n", ["nul.txt:1", "NUL byte", "character 6"]),
    (b'{"id": "a", "text": "he\\u0000llo"}\n', ["nul.txt:1", "prompt 'a'", "NUL byte"]),
    (b'[{"id": "b", "text": "x\\u0000"}]', ["item 1", "prompt 'b'", "NUL byte"]),
    (b'{"id": "a\\u0000b", "text": "hello"}\n', ["nul.txt:1", "'id'", "NUL"]),
], ids=["text line", "JSONL text", "JSON array text", "JSONL id"])
def test_nul_in_a_prompts_file_is_named(tmp_path: Path, content: bytes, must: list[str],
                                        capsys: pytest.CaptureFixture[str],
                                        captured: list[dict[str, Any]]) -> None:
    """Before: a NUL in a prompt's text reached the tokenizer (or was refused without naming it)."""
    f = tmp_path / "nul.txt"
    f.write_bytes(content)
    rc, _, err = cli(["run", "--target", "llama", "--draft", "twin", "--prompts-file", f], capsys)
    refused(rc, err, *must)
    assert not captured


@pytest.mark.parametrize("processors", ["rpnanc20", "ppinf", "fp-infc4", "lb5=nan", "lb5=inf,6=1"])
def test_suite_non_finite_processor_values_are_refused(tmp_path: Path, processors: str,
                                                      capsys: pytest.CaptureFixture[str],
                                                      captured: list[dict[str, Any]]) -> None:
    """Before: a suite's ``processors = "rpnanc20"`` reached the model's logits."""
    suite = tmp_path / "s.toml"
    suite.write_text(f'sampling = [{{temperature = 0.0, processors = "{processors}"}}]\n'
                     '[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    rc, _, err = cli(["run", "--suite", suite], capsys)
    refused(rc, err, "processors", "finite")
    assert not captured


# ---------------------------------------------------------------------------- grammar files


def test_a_grammar_too_big_for_a_trace_header_is_refused_up_front(
        zoo_pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        captured: list[dict[str, Any]]) -> None:
    """Before: a 5 MB grammar ran, and its traces (whose header carries the grammar's text) were
    refused by the tool's own validator at the report step."""
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"type": "string", "pattern": "^(" + "|".join(
        f"w{i}" for i in range(700_000)) + ")$"}))
    trace = tmp_path / "t.jsonl"
    rc, out, err = cli(["generate", "--target", zoo_pair[0], "--prompt-ids", "5,6", "-n", "4",
                        "--grammar", big, "--trace", trace], capsys)
    refused(rc, err, "--grammar", "big.json", "at most 1 MiB")
    assert not trace.exists() and out == ""
    suite = tmp_path / "s.toml"
    suite.write_text(f'grammar = "{big}"\n[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    rc, _, err = cli(["run", "--suite", suite], capsys)
    refused(rc, err, "grammar", "at most 1 MiB")
    assert not captured


def test_the_trace_writer_never_writes_a_line_the_validator_refuses(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from traces import io
    from traces.validate import validate_file

    monkeypatch.setenv("SPECPARITY_MAX_LINE_BYTES", str(64 << 10))
    header = {"type": "header", "schema_version": 1, "note": "x" * (80 << 10)}
    with pytest.raises(ValueError, match="longer than a trace line may be"):
        io.write_trace(tmp_path / "t.jsonl", [header])
    assert not (tmp_path / "t.jsonl").exists() and not list(tmp_path.iterdir())
    assert validate_file  # the limit both use: traces.io.line_limit()


@pytest.mark.parametrize("regex", ["x{0}", "(|)"], ids=["x{0}", "empty alternation"])
def test_a_grammar_that_admits_no_output_is_refused(zoo_pair: tuple[Path, Path], tmp_path: Path, regex: str,
                                                    capsys: pytest.CaptureFixture[str],
                                                    captured: list[dict[str, Any]]) -> None:
    """Before: it "succeeded" with an empty output (exit 0, a trace of one EOS)."""
    g = tmp_path / "nothing.regex"
    g.write_text(regex)
    trace = tmp_path / "t.jsonl"
    rc, out, err = cli(["generate", "--target", zoo_pair[0], "--prompt-ids", "5,6", "-n", "4",
                        "--grammar", g, "--trace", trace], capsys)
    refused(rc, err, "nothing.regex", "admits no output")
    assert not trace.exists() and out == ""
    rc, _, err = cli(["run", "--targets", "llama", "--drafters", "twin", "--grammar", g], capsys)
    refused(rc, err, "nothing.regex", "admits no output")
    rc, _, err = cli(["record", "--runner", "engine", "--target", zoo_pair[0], "--prompt-ids", "5,6", "-n",
                      "4", "--grammar", g, "--trace", trace], capsys)
    assert rc in (1, 2) and "admits no output" in err and not trace.exists(), err
    assert not captured
