"""Tests for traces.io: atomic writer, streaming reader, Trace building."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from traces.io import Trace, TraceFormatError, TraceWriter, iter_records, read_trace, write_trace
from traces.testing import make_plain_trace, make_spec_trace

ROUNDS = [
    (None, [5, 6, 7], [5, 6, 8], 2, [5, 6, 8], "correction"),
    (None, [9], [9, 3], 1, [9, 3], "bonus"),
    (None, [], [2], 0, [], "eos"),
]


def _spec() -> Trace:
    return make_spec_trace(ROUNDS)


def test_round_trip(tmp_path: Path) -> None:
    trace = _spec()
    path = tmp_path / "t.jsonl"
    write_trace(path, trace.records())
    back = read_trace(path)
    assert back.records() == trace.records()
    assert back.path == str(path)
    assert [r["index"] for r in back.rounds] == [0, 1, 2]
    assert back.output_ids == [5, 6, 8, 9, 3]
    assert back.prefill is not None
    lines = path.read_text().splitlines()
    assert len(lines) == len(trace.records())
    assert [n for n, _ in iter_records(path)] == list(range(1, len(lines) + 1))


def test_events_keep_file_order() -> None:
    trace = make_spec_trace(ROUNDS[:2], plains_after=[(4, 1, None), (2, 0, "eos")])
    assert [e["type"] for e in trace.events] == ["round", "round", "plain", "plain"]
    assert len(trace.rounds) == 2 and len(trace.plains) == 2


def test_no_temp_left_and_no_final_on_exception(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    records = _spec().records()
    with pytest.raises(RuntimeError, match="killed"):
        with TraceWriter(path) as w:
            for r in records[:3]:
                w.write(r)
            raise RuntimeError("killed mid-write")
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_exception_keeps_old_file_intact(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, _spec().records())
    before = path.read_bytes()
    other = make_plain_trace([1, 2, 3], eos_ids=[0])
    with pytest.raises(KeyboardInterrupt):
        with TraceWriter(path) as w:
            for r in other.records()[:-1]:
                w.write(r)
            raise KeyboardInterrupt
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


def test_replaces_on_success(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, _spec().records())
    plain = make_plain_trace([4, 4])
    write_trace(path, plain.records())
    assert read_trace(path).records() == plain.records()


def test_missing_footer_not_published(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with pytest.raises(TraceFormatError, match="footer"):
        with TraceWriter(path) as w:
            w.write(_spec().header)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "bad",
    [["not a dict"], [{"type": "bogus"}], [{"no": "type"}]],
)
def test_write_rejects_bad_shape(tmp_path: Path, bad: list[object]) -> None:
    with pytest.raises((TypeError, ValueError)):
        with TraceWriter(tmp_path / "t.jsonl") as w:
            w.write(bad[0])  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_write_order_enforced(tmp_path: Path) -> None:
    recs = _spec().records()
    with pytest.raises(ValueError, match="first trace record"):
        with TraceWriter(tmp_path / "a.jsonl") as w:
            w.write(recs[1])
    with pytest.raises(ValueError, match="after the footer"):
        with TraceWriter(tmp_path / "b.jsonl") as w:
            for r in recs:
                w.write(r)
            w.write(recs[2])
    assert list(tmp_path.iterdir()) == []


def test_nan_refused(tmp_path: Path) -> None:
    recs = _spec().records()
    recs[2]["margins"][0] = float("nan")
    with pytest.raises(ValueError):
        write_trace(tmp_path / "t.jsonl", recs)
    assert list(tmp_path.iterdir()) == []


def test_tolist_values_serialised(tmp_path: Path) -> None:
    class Arr:
        def __init__(self, xs: list[int]) -> None:
            self.xs = xs

        def tolist(self) -> list[int]:
            return self.xs

    recs = _spec().records()
    recs[-1]["output_ids"] = Arr(recs[-1]["output_ids"])
    write_trace(tmp_path / "t.jsonl", recs)
    assert read_trace(tmp_path / "t.jsonl").output_ids == [5, 6, 8, 9, 3]


def test_iter_records_json_error_has_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    recs = _spec().records()
    text = [json.dumps(r) for r in recs]
    text[3] = text[3][:-5]
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(TraceFormatError) as info:
        list(iter_records(path))
    assert info.value.line_no == 4
    assert info.value.path == str(path)
    assert f"{path}:4:" in str(info.value)


def test_iter_records_non_object(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"type": "header"}\n\n[1, 2]\n')
    with pytest.raises(TraceFormatError) as info:
        list(iter_records(path))
    assert info.value.line_no == 3


def test_read_trace_structure_errors_map_to_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    recs = _spec().records()
    path.write_text("\n".join(json.dumps(r) for r in recs[:-1]) + "\n")
    with pytest.raises(TraceFormatError, match="no footer"):
        read_trace(path)
    path.write_text("\n\n" + "\n".join(json.dumps(r) for r in [recs[1], *recs]) + "\n")
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert info.value.line_no == 3


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda rs: rs[1:], "first record"),
        (lambda rs: [rs[0], rs[2], rs[1], *rs[3:]], "prefill"),
        (lambda rs: [*rs, rs[-1]], "after the footer"),
        (lambda rs: [], "empty"),
        (lambda rs: [rs[0], {"type": "nope"}, *rs[1:]], "unknown type"),
    ],
)
def test_from_records_errors(mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TraceFormatError, match=match):
        Trace.from_records(mutate(_spec().records()))


def test_default_feed_follows_mlx_lm_refeed_rule() -> None:
    feeds = [r["feed"] for r in _spec().rounds]
    # round 0: [last prompt token]; after a correction: [correction];
    # after an all-accept round: [last draft, bonus].
    assert feeds == [[99], [8], [9, 3]]
