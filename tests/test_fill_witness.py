"""Fill vs plain through the numerics witness (``engine/fill/witness.py``), on the CPU double.

A fill run samples the token after an append from the span forward's last kept row (one
multi-token forward); plain decode from a one-token forward. On a backend where the two are
not bit-exact (``engine.nonexact``), a knife-edge there is ``numerics`` with the evidence, not
a failed fill case; a forced id the model does not pick, or a row the run did not sample
from, stays ``logic``.

The zoo's fill models are trained tool callers with wide margins: the double needs a large
scale (3.0) to flip one of their picks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine.fill import proposal as fp
from engine.nonexact import emulate_nonexact, exact
from zoo import fill as zf

FLIP = zf.FillCase("json", "echo", "fill-02", 48)  # output token 11 flips under the double at 3.0


@pytest.fixture
def double() -> Iterator[None]:
    model = zf.load("json")
    emulate_nonexact(model, 3.0)
    try:
        yield
    finally:
        exact(model)


def test_exact_cpu_fill_is_identical() -> None:
    assert zf.run_case(FLIP)["verdict"] == "identical"


def test_knife_edge_after_an_append_is_numerics(double: None) -> None:
    row = zf.run_case(FLIP)
    assert row["verdict"] == "divergent" and row["class"] == "numerics", row["message"]
    paths = row["witness"]["data"]["paths"]
    assert "one forward" in paths[0]["path"] and "one-token decode" in paths[1]["path"], paths
    assert "class: numerics" in row["message"] and "Δ = logit[" in row["message"]


def test_the_run_reports_it_and_does_not_fail(double: None, tmp_path: Any) -> None:
    from specparity.jobs.run import fill_comparisons

    rows, cmp = fill_comparisons([FLIP])
    assert cmp[0].divergence is not None and cmp[0].divergence.klass == "numerics"
    assert not cmp[0].fails and cmp[0].verdict == "numerics", cmp[0].verdict


def test_a_row_the_run_did_not_sample_from_stays_logic(double: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: after an append the next token is drawn from the span's FIRST row, not its last
    kept one."""
    real = fp._FillLoop.apply

    def apply(self: Any, prop: Any, y: int) -> int | None:
        forward = self.forward

        def first_row(ids: list[int]) -> Any:
            out = forward(ids)
            return out[:, :1, :] if len(ids) > 1 and prop.policy == "assert" else out

        self.forward = first_row
        try:
            return real(self, prop, y)
        finally:
            self.forward = forward

    monkeypatch.setattr(fp._FillLoop, "apply", apply)
    bad = [r for r in (zf.run_case(zf.FillCase("json", "strict", p, 48)) for p in ("fill-05", "fill-08"))
           if r["verdict"] == "divergent"]
    assert bad, "the planted row went unnoticed"
    assert all(r["class"] == "logic" for r in bad), [r["message"] for r in bad]
    assert any("its path gives" in r["message"] for r in bad), bad[0]["message"]


def test_a_forced_id_the_model_does_not_pick_stays_logic(double: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.fill.strict import Row, ScaffoldPlan, StrictSource

    def planted(tier: str, syntax: str, conv: Any, plan: Any = None) -> list[Any]:
        good = zf.plan_for(syntax, conv)
        rows = [Row(r.kind, r.tool, r.trigger, (r.ids[0], (r.ids[1] + 1) % 64, *r.ids[2:]) if len(r.ids) > 2
                    else r.ids, r.tool) for r in good.rows]
        return [StrictSource(ScaffoldPlan(tuple(rows), good.delimiters, good.renderings))]

    monkeypatch.setattr(zf, "sources_for", planted)
    bad = [r for r in (zf.run_case(zf.FillCase("json", "strict", p, 48)) for p in ("fill-05", "fill-06", "fill-08"))
           if r["verdict"] == "divergent"]
    assert bad, "the planted scaffold went unnoticed"
    assert all(r["class"] == "logic" for r in bad), [r["message"] for r in bad]
    assert any("forced" in r["message"] for r in bad), bad[0]["message"]
