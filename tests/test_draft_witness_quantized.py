"""The drafter witness replays a quantized-KV drafter as it ran (``engine.witness.evaluate_draft_path``).

The two-model drafter converts its caches to quantized KV after every forward once they reach
``quantized_kv_start`` (``engine.sources.two_model``, mlx-lm ``maybe_quantize_kv_cache``); a
replay that does not convert drafts from other caches. Found under the CPU double configured as
the GPU (``SPECPARITY_EMULATE_NONEXACT=0.01:0:0.001``): ``run --sessions`` read
``llama-kv/twin/.../kv4@36/multi-turn`` as ``logic`` ("the warm run took 364 but its drafter path
gives 166: the arithmetic does not explain it"); the replay now converts as the drafter does and
every recorded draft of a quantized run reproduces, while a planted replay without the
conversion does not.
"""

from __future__ import annotations

import pytest

import engine.witness as w
from specparity.cases.case import Case
from specparity.runners import load_model, run_case
from traces.diff import TokenSite
from traces.io import Trace

CASE = Case("llama-kv", "twin", "nat-03", 3, 48, kv_bits=4, kv_group_size=32, quantized_kv_start=30)


def _unreproduced(trace: Trace) -> list[str]:
    from specparity.runners import case_paths

    drafter = load_model(str(case_paths(CASE)[1])).model
    bad = []
    for i, rec in enumerate(trace.events):
        if rec["type"] != "round":
            continue
        for pos, tok in enumerate(rec["drafts"]):
            p = w.evaluate_draft_path(drafter, trace, TokenSite(i, f"round {rec['index']}", pos, tok, None), "a")
            if not p.reproduced:
                bad.append(f"round {rec['index']} draft {pos}: ran {tok}, replay {p.token}")
    return bad


def test_every_draft_of_a_quantized_run_reproduces(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = Trace.from_records(run_case("engine", CASE))
    assert sum(len(r["drafts"]) for r in trace.rounds) > 6
    assert _unreproduced(trace) == []
    monkeypatch.setattr(w, "quantize_kv", lambda caches, kv, who="target": False)  # the plant: no conversion
    assert _unreproduced(trace), "a replay that never converts the drafter's caches still reproduced every draft"
