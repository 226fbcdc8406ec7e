"""Every draft-source kind and cache convention through the witness, on the CPU non-exact double.

``conformance/test_witness.py`` proves the witness on two-model and self drafters; the
backend-facing verdicts hold for every lane only if each kind's runs replay: tapped sources
(DSpark, DeepSpec: full prefill, the target's hidden rows), the assistant and MTP heads,
native MTP (the MTP layers inside the target checkpoint), rotating caches rolled back
exactly past the ring wrap, and a grammar free until a reasoning-end marker. For each, under
the double (``engine.nonexact``: multi-token forwards' logits perturbed, one-token decode
exact) at a scale that flips knife-edges:

- speculative vs plain decode is identical or ``numerics`` with the witness's evidence, never
  ``logic`` (no false failure);
- a planted logic bug (the target trimmed one position short after a rejection) on the same
  case stays ``logic``, its round named.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from conformance.conftest import run_trace
from engine.nonexact import emulate_nonexact, exact
from specparity.cases.case import Case
from specparity.runners import case_paths, load_model, numerics_witness
from traces.diff import diff_traces


def _reasoning_case() -> Case:
    """qwen35/twin under the regex grammar, free until a marker ending at output position 1."""
    import zoo.grammars as G

    ids = G.prompt_ids("json-00")
    free = run_trace("engine", Case("qwen35", None, "json-00", 0, 24, prompt_tokens=ids))
    marker = G.marker_ending_at(list(free.footer["output_ids"]), 1)
    assert marker, "no zoo marker ends at output position 1"
    return Case("qwen35", "twin", "json-00", 3, 40, grammar="regex-sentence", prompt_tokens=ids, reasoning_end=marker)


# kind -> (case, the double's scale): each case flips a knife-edge at that scale (found by search;
# the zoo's heads and tapped drafters are sharp, so some need a large scale)
KINDS: dict[str, tuple[Any, float]] = {
    "dspark": (lambda: Case("gemma4", "dspark-t0", "rnd-00", 4, 32, source="dspark"), 0.3),
    "deepspec": (lambda: Case("gemma4", "deepspec-t0", "nat-03", 4, 32, source="deepspec"), 0.3),
    "assistant": (lambda: Case("gemma4", "gemma4-assistant", "nat-03", 3, 24, source="assistant"), 0.2),
    "mtp": (lambda: Case("qwen35", "qwen35-mtp", "nat-00", 2, 24, source="mtp"), 0.2),
    "native-mtp": (lambda: Case("glm-mtp", "native", "nat-02", 2, 32, source="native-mtp"), 0.1),
    "rotating-exact": (lambda: Case("gemma3", "twin", "rnd-13", 3, 64, rotating="exact"), 0.2),
    "reasoning-end": (_reasoning_case, 0.05),
}


@pytest.fixture(scope="module")
def witness() -> Any:
    return numerics_witness()


@pytest.fixture
def double() -> Iterator[Any]:
    wrapped: list[Any] = []

    def wrap(case: Case, scale: float) -> None:
        from specparity.runners import case_kind

        tdir, ddir = case_paths(case)
        desc = case_kind(case)
        for p in (tdir, ddir if desc is not None and desc.loads_model else None):  # heads are not mlx-lm models
            if p is not None:
                m = load_model(str(p)).model
                if all(m is not w for w in wrapped):
                    emulate_nonexact(m, scale)
                    wrapped.append(m)

    yield wrap
    for m in wrapped:
        exact(m)


@pytest.mark.parametrize("kind", list(KINDS))
def test_no_false_logic_under_the_double(kind: str, double: Any, witness: Any) -> None:
    make, scale = KINDS[kind]
    case = make()
    double(case, scale)
    spec, plain = run_trace("engine", case), run_trace("engine", case.plain())
    assert spec.rounds, f"{case.case_id}: no speculative round ran"
    div = diff_traces(spec, plain, level="tokens", witness=witness)
    assert div is not None, f"{kind}: the double flipped nothing on {case.case_id} (nothing to judge)"
    assert (div.klass, div.basis) == ("numerics", "witness"), f"{kind}: {div.message}"
    paths = div.witness.data["paths"]  # type: ignore[union-attr]
    assert all(p["reproduced"] for p in paths[:2]), div.message


@pytest.mark.parametrize("kind", list(KINDS))
def test_planted_short_trim_stays_logic_under_the_double(kind: str, double: Any, witness: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from conformance.test_witness import _short_trim

    make, scale = KINDS[kind]
    case = make()
    double(case, scale)
    good = run_trace("engine", case)
    if not any(r["k_accept"] < len(r["drafts"]) for r in good.rounds):
        pytest.skip(f"{case.case_id}: no rejected round, a short trim cannot show")
    _short_trim(monkeypatch)
    bad = run_trace("engine", case)
    monkeypatch.undo()
    div = diff_traces(bad, good, level="round", witness=witness)
    assert div is not None, f"{kind}: a short target trim went unnoticed"
    assert div.klass == "logic" and div.where.startswith(("round", "prefill", "plain")), div.message
