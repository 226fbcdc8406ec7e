"""mlx-vlm's batched loops on the scoreboard: the committed row, and the verdicts on planted captures.

Default run, no mlx-vlm: the committed ``docs/scoreboard/mlx_vlm_batched.json`` (written by
``python -m specparity.grading.vlm_batched`` in ``tox -e vlm``) parses, is rendered in the
scoreboard's batched-loops table and the README, and each failing cell has its known entry; the
verdict functions of ``specparity/grading/vlm_batched.py`` catch planted captures (rows swapped
with their neighbour, a flip without evidence, a clamp above the row's own walk, uniform
acceptance passed off as per-row, a row handed tokens its walk did not emit), each named by row
and batch step. The live runs: ``conformance/test_batched_references.py`` (``tox -e vlm``).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from oracles.mlx_vlm_batched import RowRun, RowStep
from specparity.grading import vlm_batched as vb

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "scoreboard" / f"{vb.NAME}.json"


def _row(r: int, first: int, steps: list[tuple[list[int], int | None, int]], present: list[int],
         logits: list[Any] | None = None, finish: str = "length") -> RowRun:
    """A captured row: its first token, then per step (new tokens, own count, committed count)."""
    out = RowRun(r, 10, 99, [], finish)
    for s, (new, own, k) in enumerate(steps):
        window = [0] + [7] * 3
        out.steps.append(RowStep(s, present.index(r), list(present), window, own, k, list(new),
                                 None if logits is None else logits[s]))
    out.stream = [first] + [t for new, _, _ in steps for t in new]
    out.tokens = list(out.stream)
    return out


# ---------------------------------------------------------------- the committed row


def test_committed_row_parses_and_its_findings_have_known_entries() -> None:
    from reports.scoreboard import check_order, failures, is_batched, load_results, render_markdown

    doc = json.loads(DOC.read_text())
    assert is_batched(doc) and doc["engine"] == vb.NAME and doc["tox_env"] == "vlm", {k: doc[k] for k in ("engine",
                                                                                                     "kind")}
    assert set(doc["modes"]) == {"mtp", "dflash"}, doc["modes"].keys()
    assert check_order(doc) == vb.CHECKS
    for mode, m in doc["modes"].items():
        assert set(m["checks"]) == set(vb.CHECKS), (mode, m["checks"].keys())
        for c, r in m["checks"].items():
            assert r["status"] in ("pass", "fail", "unsupported"), (mode, c, r["status"])
            assert r["reproduce"].startswith("tox exec -e vlm -- python -m specparity.grading.vlm_batched"), r
        pairs = [p for p in vb.PAIRS if p.mode == mode]
        assert [p["pair"] for p in m["pairs"]] == [p.name for p in pairs], mode
        for p in m["pairs"]:
            by_b = {b: [x for x in p["rows"] if x["B"] == b and x["against"] == "B=1"] for b in (2, 4)}
            assert len(by_b[2]) == 2 and len(by_b[4]) == 8, (mode, p["pair"])  # B4 greedy + seeded
            assert {x["verdict"] for x in p["rows"]} <= {"identical", "numerics", "logic"}, p["pair"]
    docs = load_results(DOC.parent)
    assert any(is_batched(d) for d in docs), "the scoreboard's loader skips the batched row"
    entries = [e for e in tomllib.loads((ROOT / "traces" / "known_divergences.toml").read_text())["entry"]
               if e["runner"] == vb.NAME]
    for f in [f for f in failures(docs) if f["engine"] == vb.NAME]:
        hit = [e for e in entries if e["kind"] == "subject" and f["check"] in e["checks"] and f["mode"] in e["modes"]]
        assert hit and all(e["reproduce"] and e["reason"].strip() for e in hit), f
    md = render_markdown(docs)
    assert "## Batched loops (B-invariance)" in md
    for mode in doc["modes"]:
        assert f"| {vb.NAME} {doc['version']} | {mode} |" in md, mode
    assert md == (DOC.parent / "scoreboard.md").read_text(), "docs/scoreboard/scoreboard.md is stale: regenerate it"
    readme = (ROOT / "README.md").read_text()
    assert f"| {vb.NAME} {doc['version']} |" in readme, "README's engines section lacks the batched row"


def test_a_batched_failure_is_listed_with_its_reproduction(tmp_path: Path) -> None:
    """A failing batched cell reaches the Failures section with the command that reproduces it."""
    from reports.scoreboard import failures, load_results, render_markdown

    doc = json.loads(DOC.read_text())
    cell, _ = vb._cell("B4", "mtp", [{"pair": "qwen35/qwen35-mtp", "verdicts": {"B4": [vb.RowVerdict(
        "qwen35/qwen35-mtp", 1, "nat-01", 4, "B=1", "logic", "row r1 (nat-01) at B = 4: output token 5, batch "
        "step 2 (window position 1; rows present: r0, r1): batched 3 != B=1 4")]}}])
    assert cell.status == "fail" and cell.divergence["pair"] == "qwen35/qwen35-mtp", cell
    doc["modes"]["mtp"]["checks"]["B4"] = {**cell.to_dict(), "reproduce": vb.reproduce("qwen35/qwen35-mtp", "mtp")}
    (tmp_path / f"{vb.NAME}.json").write_text(json.dumps(doc))
    fails = failures(load_results(tmp_path))
    assert [(f["mode"], f["check"]) for f in fails] == [("mtp", "B4")], fails
    assert fails[0]["reproduce"].endswith("--mode mtp --pair qwen35/qwen35-mtp"), fails[0]
    assert "batch step 2" in render_markdown(load_results(tmp_path))


# ---------------------------------------------------------------- planted captures


def test_rows_swapped_with_their_neighbour_are_caught() -> None:
    alone = [_row(0, 5, [([6, 7], 1, 1), ([8], 0, 0)], [0]), _row(1, 9, [([10], 0, 0), ([11, 12], 1, 1)], [1])]
    for a in alone:
        assert vb.compare_rows("p", "nat-0x", 2, a, a).verdict == "identical"
    # the whole outputs swapped: the first token differs (sampled by the prefill)
    swapped = [_row(0, 9, [([10], 0, 0), ([11, 12], 1, 1)], [0, 1]), _row(1, 5, [([6, 7], 1, 1), ([8], 0, 0)], [0, 1])]
    v = vb.compare_rows("p", "nat-00", 2, swapped[0], alone[0])
    assert v.verdict == "logic" and "row r0 (nat-00) at B = 2: output token 0, the prefill's first token: " \
        "batched 9 != B=1 5" in v.detail, v.detail
    # swapped from batch step 1 on: named by the step and the rows present
    late = _row(0, 5, [([6, 7], 1, 1), ([11, 12], 1, 1)], [0, 1])
    v = vb.compare_rows("p", "nat-00", 2, late, alone[0])
    assert v.verdict == "logic" and "output token 3, batch step 1 (window position 0; rows present: r0, r1): " \
        "batched 11 != B=1 8" in v.detail, v.detail
    # a row whose stream is right but ends differently
    early = _row(0, 5, [([6, 7], 1, 1), ([8], 0, 0)], [0], finish="stop")
    assert vb.compare_rows("p", "nat-00", 2, early, alone[0]).verdict == "logic"


def test_a_row_handed_tokens_its_walk_did_not_emit_is_logic() -> None:
    a = _row(0, 5, [([6, 7], 1, 1)], [0, 1])
    b = _row(0, 5, [([6, 7], 1, 1)], [0, 1])
    b.mismatch = {"pos": 2, "received": 7, "walk": 4}
    v = vb.compare_rows("p", "nat-00", 4, b, a)
    assert v.verdict == "logic" and "output token 2, batch step 0" in v.detail and \
        "the consumer received 7 but the loop's walk emitted 4 for this row" in v.detail, v.detail
    assert vb.compare_tokens("p", "nat-00", 4, b, [6, 7]).verdict == "logic"


def _flip(delta: float, margin: float, batched_token: int = 3) -> tuple[RowRun, RowRun]:
    """Two runs of a row differing at output token 1 (step 0, window position 0): the batched
    run's row picks 3, the row alone picks 4, each by ``margin``; elsewhere they differ by ``delta``."""
    la, lb = np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32)
    la[0, 3], la[0, 4] = 1.0 + margin, 1.0
    lb[0, 3], lb[0, 4] = 1.0, 1.0 + margin
    lb[0, 0] = delta
    return (_row(0, 5, [([batched_token], 0, 0)], [0, 1], logits=[la]), _row(0, 5, [([4], 0, 0)], [0], logits=[lb]))


def test_a_flip_is_numerics_only_with_evidence() -> None:
    a, b = _flip(delta=0.004, margin=0.002)
    v = vb.compare_rows("p", "nat-00", 4, a, b, bound=0.01, reproduced=True)
    assert v.verdict == "numerics", (v.detail, v.evidence)
    assert "output token 1, batch step 0" in v.detail and any("|Δ| 0.004" in e for e in v.evidence), v
    assert any("own row's pick: [True, True]" in e for e in v.evidence), v.evidence
    assert vb.compare_rows("p", "nat-00", 4, a, b, bound=0.01, reproduced=False).verdict == "logic"  # not reproduced
    assert vb.compare_rows("p", "nat-00", 4, a, b, bound=0.0, reproduced=True).verdict == "logic"  # bit-exact backend
    wide_a, wide_b = _flip(delta=0.5, margin=0.002)  # the rows differ beyond twice the bound
    assert vb.compare_rows("p", "nat-00", 4, wide_a, wide_b, bound=0.01, reproduced=True).verdict == "logic"
    odd_a, odd_b = _flip(delta=0.004, margin=0.002, batched_token=5)  # not its own row's pick
    v = vb.compare_rows("p", "nat-00", 4, odd_a, odd_b, bound=0.01, reproduced=True)
    assert v.verdict == "logic" and any("[False, True]" in e for e in v.evidence), v.evidence
    no_rows = _row(0, 5, [([3], 0, 0)], [0, 1])  # no logits captured: nothing to weigh
    assert vb.compare_rows("p", "nat-00", 4, no_rows, b, bound=0.01, reproduced=True).verdict == "logic"


def test_acceptance_plants_are_caught() -> None:
    rows = [_row(0, 5, [([6], 2, 0), ([7, 8], 1, 1)], [0, 1]), _row(1, 9, [([10], 0, 0), ([11, 12], 3, 1)], [0, 1])]
    probs, counts = vb.acceptance_problems("p", 2, rows, uniform=True)
    assert probs == [] and counts == {"row_steps": 4, "clamped": 2, "drafts_discarded": 4, "own_not_exposed": 0}
    above = [_row(0, 5, [([6, 7, 8], 1, 2)], [0, 1]), _row(1, 9, [([10, 11, 12], 2, 2)], [0, 1])]
    probs, _ = vb.acceptance_problems("p", 2, above, uniform=True)
    assert probs == ["p B = 2 row r0: batch step 0: committed 2 drafts but its own walk accepted 1"], probs
    ragged = [_row(0, 5, [([6], 0, 0)], [0, 1]), _row(1, 9, [([10, 11], 1, 1)], [0, 1])]
    probs, _ = vb.acceptance_problems("p", 2, ragged, uniform=True)
    assert probs == ["p B = 2: batch step 0: rows commit [0, 1] drafts, not one count (the loop declares uniform "
                     "acceptance)"], probs
    assert vb.acceptance_problems("p", 2, ragged, uniform=False)[0] == []
    # uniform acceptance (the minimum over rows) passed off as per-row
    probs, _ = vb.acceptance_problems("p", 2, rows, uniform=False)
    assert probs[0] == "p B = 2 row r0: batch step 0: committed 0 != its own walk's 2, and the loop declares " \
        "per-row acceptance", probs


def test_rounds_against_the_engine_name_the_round() -> None:
    r = _row(0, 5, [([6, 7], 1, 1), ([8, 9], 1, 1)], [0])
    eng = [{"window": [0, 7, 7, 7], "k_accept": 1, "emitted": [6, 7]},
           {"window": [0, 7, 7, 7], "k_accept": 1, "emitted": [8, 9]}]
    assert vb.compare_rounds("p", "nat-00", r, eng).verdict == "identical"
    moved = [eng[0], {**eng[1], "window": [0, 7, 7, 1]}]
    v = vb.compare_rounds("p", "nat-00", r, moved)
    assert v.verdict == "logic" and "round 1: (window, content tokens kept)" in v.detail, v.detail
    k_off = [{**eng[0], "k_accept": 2}, eng[1]]
    assert "round 0: (window, k) mlx-vlm ([0, 7, 7, 7], 1) != engine ([0, 7, 7, 7], 2)" in \
        vb.compare_rounds("p", "nat-00", r, k_off).detail
    # the engine left speculation at its ring-wrap guard after round 0: a prefix
    v = vb.compare_rounds("p", "nat-00", r, eng[:1], guarded=True)
    assert v.verdict == "identical" and "ring-wrap guard" in v.detail, v.detail
    assert vb.compare_rounds("p", "nat-00", r, eng[:1]).verdict == "logic"


@pytest.mark.parametrize("pos, expected", [(0, None), (1, (0, 0)), (2, (0, 1)), (3, (1, 0))])
def test_an_output_token_is_traced_to_its_step(pos: int, expected: tuple[int, int] | None) -> None:
    r = _row(0, 5, [([6, 7], 1, 1), ([8], 0, 0)], [0])
    at = r.origin(pos)
    assert (None if at is None else (at[0].step, at[1])) == expected
