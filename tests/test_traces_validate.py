"""Tests for traces.validate: schema errors and cross-record invariants."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from traces.io import Record, write_trace
from traces.testing import make_plain_trace, make_spec_trace
from traces.validate import (
    load_schema,
    validate_file,
    validate_main,
    validate_records,
    validate_trace,
)

ROUNDS = [
    (None, [5, 6, 7], [5, 6, 8], 2, [5, 6, 8], "correction"),
    (None, [9], [9, 3], 1, [9, 3], "bonus"),
    (None, [], [4], 0, [4], "bonus"),
    (None, [7, 7], [2], 0, [], "eos"),
]
# Record layout of the spec trace: line 1 header, 2 prefill, 3..6 rounds, 7 footer.


def _records() -> list[Record]:
    return make_spec_trace(ROUNDS).records()


def _dump(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_schema_is_valid_2020_12() -> None:
    schema = load_schema()
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"].endswith("2020-12/schema")
    assert schema["$defs"]["header"]["properties"]["schema_version"] == {"const": 1}
    for name in ("round", "plain", "footer", "prefill"):
        assert schema["$defs"][name]["additionalProperties"] is False


def test_whole_schema_accepts_valid_records() -> None:
    v = Draft202012Validator(load_schema())
    recs = _records() + make_plain_trace([3, 4]).records()
    for r in recs:
        assert list(v.iter_errors(r)) == [], r["type"]
    assert not v.is_valid({"type": "round"})
    assert not v.is_valid({"type": "nope"})


def test_valid_traces_pass(tmp_path: Path) -> None:
    assert validate_trace(make_spec_trace(ROUNDS)) == []
    assert validate_trace(make_plain_trace([3, 4, 5])) == []
    assert validate_trace(make_plain_trace([3, 4, 5], end="budget")) == []
    mixed = make_spec_trace(ROUNDS[:3], plains_after=[(8, 1, None), (2, 0, "eos")])
    assert validate_trace(mixed) == []
    path = write_path = tmp_path / "ok.jsonl"
    write_trace(write_path, _records())
    assert validate_file(path) == []


def test_header_extra_properties_allowed() -> None:
    recs = _records()
    recs[0]["future"] = 1
    recs[0]["params"]["new_knob"] = True
    recs[0]["platform"]["gpu"] = "x"
    assert validate_records(enumerate(recs, 1)) == []


Mutation = Callable[[list[Record]], Any]


def _set(line: int, key: str, value: Any) -> Mutation:
    def f(rs: list[Record]) -> None:
        rs[line - 1][key] = value

    return f


CASES: list[tuple[str, Mutation, int | None, str, str]] = [
    ("bad type", _set(3, "type", "rnd"), 3, "record.type", "unknown record type"),
    ("negative k", _set(3, "k_accept", -1), 3, "round.k_accept", "-1 is less than the minimum of 0"),
    ("typo key", _set(4, "k_acept", 1), 4, "round", "Additional properties"),
    ("bad end", _set(4, "end", "done"), 4, "round.end", "is not one of"),
    ("bad draft", lambda rs: rs[2]["drafts"].__setitem__(1, "x"), 3, "round.drafts[1]", "is not of type 'integer'"),
    ("bad version", _set(1, "schema_version", 2), 1, "header.schema_version", "1 was expected"),
    ("bad gamma", lambda rs: rs[0]["params"].__setitem__("gamma", "4"), 1, "header.params.gamma", "is not of type"),
    ("digest", _set(3, "target_cache_digest", {"combined": "x"}), 3, "round.target_cache_digest", "'layers' is a required property"),
    ("eos emitted", lambda rs: rs[5].update(emitted=[2], samples=[2], k_accept=0, end="bonus", drafts=[], window=[4], margins=[5.0]), 6, "round.emitted[0]", "EOS id 2"),
    ("output mismatch", lambda rs: rs[-1]["output_ids"].__setitem__(2, 77), 7, "footer.output_ids", "output token 2"),
    ("missing footer", lambda rs: rs.pop(), 6, "footer", "missing footer"),
    ("header not first", lambda rs: rs.insert(0, rs.pop(1)), 1, "prefill", "first record must be the header"),
    ("record after footer", lambda rs: rs.append(dict(rs[3])), 8, "round", "after the footer"),
    ("index gap", _set(4, "index", 5), 4, "round.index", "expected 1"),
    ("window mismatch", lambda rs: rs[2]["window"].__setitem__(1, 99), 3, "round.window", "[window[0]] + drafts"),
    ("margins len", lambda rs: rs[2]["margins"].pop(), 3, "round.margins", "3 entries"),
    ("k > drafts", _set(4, "k_accept", 2), 4, "round.k_accept", "exceeds"),
    ("too many emitted", lambda rs: rs[2].update(k_accept=0, end="correction"), 3, "round.emitted", "at most k_accept + 1"),
    ("zero-draft correction", _set(5, "end", "correction"), 5, "round.end", "'correction' requires"),
    ("early terminal", _set(4, "end", "budget"), 4, "round.end", "not the last"),
    ("emitted not samples", lambda rs: rs[3].update(emitted=[9, 1]), 4, "round.emitted", "not a prefix of samples"),
    ("negative margin", lambda rs: rs[2]["margins"].__setitem__(0, -0.5), 3, "round.margins[0]", "minimum of 0"),
]


@pytest.mark.parametrize(("name", "mutate", "line", "field", "msg"), CASES, ids=[c[0] for c in CASES])
def test_planted_errors(
    tmp_path: Path, name: str, mutate: Mutation, line: int | None, field: str, msg: str
) -> None:
    recs = _records()
    mutate(recs)
    path = _dump(tmp_path / "bad.jsonl", recs)
    errors = validate_file(path)
    assert errors, name
    hits = [e for e in errors if e.line == line and e.field == field and msg in e.message]
    assert hits, [str(e) for e in errors]
    e = hits[0]
    assert e.path == str(path)
    assert str(e) == f"line {line}: {field}: {e.message}"
    assert e.format() == f"{path}:{line}: {field}: {e.message}"


def test_error_message_format_example() -> None:
    recs = _records()
    recs[2]["k_accept"] = -1
    errors = validate_records(enumerate(recs, 1))
    assert "line 3: round.k_accept: -1 is less than the minimum of 0" in [str(e) for e in errors]


def test_plain_mode_rules() -> None:
    recs = make_plain_trace([3, 4]).records()
    recs[-1]["speculation"] = make_spec_trace(ROUNDS).footer["speculation"]
    errs = validate_records(enumerate(recs, 1))
    assert any(e.field == "footer.speculation" for e in errs)
    recs = make_plain_trace([3, 2]).records()
    errs = validate_records(enumerate(recs, 1))
    assert any(e.field == "plain.emitted[0]" and "EOS" in e.message for e in errs)


def test_json_error_and_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [json.dumps(r) for r in _records()]
    lines[3] = "{oops"
    path.write_text("\n".join(lines) + "\n")
    errors = validate_file(path)
    assert errors[0].line == 4 and errors[0].field == "json"
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    assert [e.field for e in validate_file(empty)] == ["file"]
    missing = validate_file(tmp_path / "nope.jsonl")
    assert missing[0].field == "file" and "cannot read" in missing[0].message


def test_validate_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.jsonl"
    write_trace(good, _records())
    assert validate_main([str(good)]) == 0
    assert capsys.readouterr().out.strip() == f"{good}: ok"
    recs = _records()
    recs[2]["k_accept"] = -1
    bad = _dump(tmp_path / "bad.jsonl", recs)
    assert validate_main([str(good), str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{good}: ok"
    assert f"{bad}:3: round.k_accept: -1 is less than the minimum of 0" in out
    assert validate_main([]) == 2
