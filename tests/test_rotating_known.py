"""``grade`` of ``generate --rotating exact`` traces on a sliding-window model: the known mlx-lm
wrap entry, not DIVERGES; real divergences in exact mode still fail.

mlx-lm 0.32.2 stops trimming a wrapped ``RotatingKVCache`` (known entry
``mlx-lm-rotating-trim-after-wrap``). With ``--rotating exact`` the engine never
falls back, so the entry's point is the first round whose window could reach
``params.sliding_window`` (written in the header of exact-mode traces), the
round the guard stops at (``traces.reference.wrap_point``). Zoo: gemma3 + twin,
window 32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.rollback import RingRound
from traces.io import read_trace, write_trace

N = 64


def _generate(tmp: Path, rotating: str = "exact") -> Path:
    import zoo
    from specparity.cli import main

    t, d = zoo.pair("gemma3", "twin")
    ids = ",".join(map(str, zoo.prompt("nat-00").token_ids))
    out = tmp / "traces" / "g3.jsonl"
    assert main(["generate", "--target", str(t), "--draft", str(d), "-n", str(N), "--prompt-ids", ids,
                 "--eos-ids", "1", "--rotating", rotating, "--trace", str(out)]) == 0
    return out


def _grade(trace_dir: Path, out: Path) -> Any:
    from specparity.grading.trace_folders import grade

    return grade(trace_dir, out, runners=["mlx_lm"], progress=False)


def _by_kind(result: Any) -> dict[str, Any]:
    return {c.kind: c for c in result.comparisons}


def test_exact_trace_grades_as_the_known_wrap_entry(tmp_path: Path) -> None:
    from traces.reference import wrap_point

    path = _generate(tmp_path)
    tr = read_trace(path)
    assert tr.header["params"]["rotating"] == "exact" and tr.header["params"]["sliding_window"] == 32
    assert tr.header["case_id"].endswith("/rot-exact")
    assert not tr.plains, "exact mode speculates to the end"
    point = wrap_point(tr)
    assert point is not None and 0 < point[0] < len(tr.rounds)
    res = _grade(path.parent, tmp_path / "graded")
    c = _by_kind(res)
    assert c["engine-vs-mlx_lm"].known == "mlx-lm-rotating-trim-after-wrap", c["engine-vs-mlx_lm"].verdict
    assert c["spec-vs-plain"].divergence is None
    assert res.ok


def test_exact_trace_without_window_is_not_excused(tmp_path: Path) -> None:
    """The point comes from the header: without ``sliding_window`` nothing is excused (an exact
    trace that diverged from mlx-lm is DIVERGES, as every trace was before)."""
    from specparity.cases.case import Case
    from specparity.runners import run_case
    from traces.io import Trace
    from traces.reference import compare_with_reference

    case = Case("gemma3", "twin", "nat-00", 3, N, eos_ids=(1,), rotating="exact")
    eng = Trace.from_records(run_case("engine", case))
    ref = Trace.from_records(run_case("mlx_lm", case))
    assert compare_with_reference(eng, ref, "mlx_lm").status == "known"
    p = {k: v for k, v in eng.header["params"].items() if k != "sliding_window"}
    bare = Trace.from_records([dict(eng.header, params=p), *eng.records()[1:]])
    assert compare_with_reference(bare, ref, "mlx_lm").status == "divergent"


def test_planted_divergence_before_the_wrap_point_diverges(tmp_path: Path) -> None:
    from traces.reference import wrap_point

    path = _generate(tmp_path)
    recs = read_trace(path).records()
    point = wrap_point(read_trace(path))
    assert point is not None
    i = [j for j, r in enumerate(recs) if r["type"] == "round"][point[0] - 1]  # the last round before it
    recs[i] = dict(recs[i], target_cache_digest={**recs[i]["target_cache_digest"], "combined": "0" * 64})
    write_trace(path, recs)
    c = _by_kind(_grade(path.parent, tmp_path / "graded"))["engine-vs-mlx_lm"]
    assert c.known is None and c.status == "divergent", c.verdict
    assert c.divergence is not None and c.divergence.where == f"round {point[0] - 1}"


def test_planted_exact_rollback_bug_diverges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real bug past the wrap (one kept position too few re-applied) is excused by no entry:
    spec vs plain fails, naming the first differing output token."""
    real = RingRound.rollback
    monkeypatch.setattr(RingRound, "rollback", lambda self, keep: real(self, keep - 1))
    path = _generate(tmp_path)
    monkeypatch.undo()
    res = _grade(path.parent, tmp_path / "graded")
    c = _by_kind(res)["spec-vs-plain"]
    assert c.divergence is not None and "output token" in c.divergence.where, c.verdict
    assert not res.ok
