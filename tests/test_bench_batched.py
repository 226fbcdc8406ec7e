"""The batched throughput benchmark (``specparity.measure.bench_batched``): shape of its figures, never a timing.

It prints rows per second of each arm and the paired speedup with its interval; it refuses a
figure when a row's output differs between the batched and the serial arm (planted here).
"""

from __future__ import annotations

from typing import Any

import pytest

from specparity.measure import bench_batched as bb


def test_bench_reports_both_arms_and_a_paired_interval(capsys: pytest.CaptureFixture[str]) -> None:
    assert bb.main(["--drafter", "ngram", "--rows", "1,2", "--repeats", "2", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "| B | tokens | batched rows/s | serial rows/s |" in out, out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2, out
    res = bb.bench_batched(drafter="ngram", rows=(2,), repeats=2, max_tokens=4)
    r = res["table"][0]
    assert r["identical_outputs"] and len(r["batched_wall_s"]) == len(r["serial_wall_s"]) == 2
    assert r["speedup"]["low"] <= r["speedup"]["median"] <= r["speedup"]["high"]


def test_bench_refuses_rows_that_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.batched as eb

    real = eb.batch_generate

    def wrong(model: Any, reqs: Any, **kw: Any) -> Any:
        res = real(model, reqs, **kw)
        res.rows["r1"].output_ids[-1] += 1
        return res

    monkeypatch.setattr(eb, "batch_generate", wrong)
    with pytest.raises(RuntimeError, match="row r1 differs batched vs serial"):
        bb.bench_batched(drafter="ngram", rows=(2,), repeats=1, max_tokens=4)


def test_bad_arguments_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert bb.main(["--rows", "0", "--drafter", "ngram"]) == 2
    assert capsys.readouterr().err.startswith("bench_batched: ")
