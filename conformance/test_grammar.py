"""Grammar-constrained decoding: the engine vs mlx-lm + the grammar as a logits processor.

References (``oracles/mlx_lm_grammar.py``): mlx-lm 0.32.2 ``generate_step`` and
``speculative_generate_step`` driven unmodified, the grammar handed in as a
logits processor built on llguidance — the history-pure one (``mlx_lm_grammar``)
and the stateful adapter shape MLX users run (``mlx_lm_grammar_stateful``:
mlx-vlm's ``LLGuidanceLogitsProcessor``, outlines/xgrammar mlxlm).

- plain + grammar: the engine equals mlx-lm + the history-pure processor token
  for token and mask for mask, greedy AND seeded sampled (one draw per token in
  both), on the KV, rotating and recurrent targets;
- spec + grammar (greedy, every γ 1–5): equal to mlx-lm's speculative loop with
  the history-pure processor in tokens, usage and per-position masks (the drafts
  differ by design: mlx-lm masks the drafter, the engine's runs free);
- the stateful processor: correct in plain decode; under mlx-lm's speculative
  loop every case is a known entry (a crash or a silent drift), never silently
  "identical", and the counts are the scoreboard row;
- a planted engine walk bug is caught against the reference, round and position named.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from conformance.conftest import require_oracle, run_trace
from specparity.cases.case import Case
from specparity.runners import run_case
from traces.diff import grammar_divergence
from traces.io import Trace
from traces.reference import ReferenceRefused, compare_with_reference, refusal_verdict
from zoo import grammars as G

pytestmark = pytest.mark.oracle

GRAMMARS = ("json-small", "json-item", "regex-sentence", "lark-list")


def _case(target: str, drafter: str | None, grammar: str, gamma: int = 3, prompt: str = "json-00",
          **kw: object) -> Case:
    return Case(target, drafter, prompt, gamma if drafter else 0, 48, grammar=grammar,
                prompt_tokens=G.prompt_ids(prompt), **kw)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _oracle() -> None:
    pytest.importorskip("llguidance")
    require_oracle("mlx_lm_grammar")


def _verdict(case: Case, runner: str) -> object:
    eng = run_trace("engine", case)
    try:
        ref = Trace.from_records(run_case(runner, case))
    except ReferenceRefused as exc:
        return refusal_verdict(eng, exc)
    return compare_with_reference(eng, ref, runner)


@pytest.mark.parametrize("target", ["llama", "gemma3", "qwen35"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_plain_grammar_equals_mlx_lm_processor(target: str, temperature: float) -> None:
    for grammar in GRAMMARS:
        case = _case(target, None, grammar, temperature=temperature, seed=5)
        for runner in ("mlx_lm_grammar", "mlx_lm_grammar_stateful"):
            v = _verdict(case, runner)
            assert v.status == "identical", f"{case.case_id} vs {runner}:\n{v.format()}"


_NIGHTLY = (pytest.mark.slow, pytest.mark.heavy)
# γ 1 and 5 by default (the smallest and the largest window); γ 2, 3 and 4 nightly.
_GAMMAS = [pytest.param(g, marks=() if g in (1, 5) else _NIGHTLY) for g in (1, 2, 3, 4, 5)]


@pytest.mark.parametrize("target", ["llama", "qwen3"])
@pytest.mark.parametrize("gamma", _GAMMAS)
def test_spec_grammar_equals_mlx_lm_spec_with_history_pure_processor(target: str, gamma: int) -> None:
    for grammar in GRAMMARS:
        for drafter in ("twin", "self"):
            case = _case(target, drafter, grammar, gamma)
            v = _verdict(case, "mlx_lm_grammar")
            assert v.status == "identical", f"{case.case_id}:\n{v.format()}"


def test_stateful_processor_under_speculation_is_known_never_silent() -> None:
    """Every speculative case with the stateful processor is a known entry; the counts are the
    scoreboard row (crash / wrong masks / correct)."""
    seen: Counter[str] = Counter()
    for target in ("llama", "qwen3"):
        for grammar in GRAMMARS:
            for prompt in ("json-00", "nat-00"):
                for gamma in (1, 3):
                    case = _case(target, "twin", grammar, gamma, prompt=prompt)
                    v = _verdict(case, "mlx_lm_grammar_stateful")
                    assert v.status in ("refused", "known", "identical"), f"{case.case_id}:\n{v.format()}"
                    seen[v.known.id if v.known else v.status] += 1
    assert seen["mlx-lm-spec-stateful-grammar-processor-crashes"] > 0, seen
    assert seen["identical"] < sum(seen.values()), seen


def test_known_grammar_entry_does_not_excuse_plain_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stateful entries apply to speculative grammar cases only: a plain-lane engine bug (the
    mask of the step before) is still a failure against the same reference."""
    import engine.executor as ex

    real = ex.Request._sample_row
    state: dict[str, object] = {}

    def lagging(self: object, row: object) -> object:
        g = self.grammar  # type: ignore[attr-defined]
        prev = state.get("mask")
        state["mask"] = g.mask(row.shape[-1]) if g is not None else None  # type: ignore[attr-defined]
        if prev is None:
            return real(self, row)  # type: ignore[arg-type]
        y = self.pipe.sample(row, mask=prev)  # type: ignore[attr-defined]
        return y, ex.margin_array(row)

    from engine import grammar as eg

    strict = eg.GrammarMatcher.consume

    def lenient(self: eg.GrammarMatcher, token: int) -> None:  # the bug lets refused tokens through
        try:
            strict(self, token)
        except eg.GrammarError:
            self._m.reset()

    monkeypatch.setattr(ex.Request, "_sample_row", lagging)
    monkeypatch.setattr(eg.GrammarMatcher, "consume", lenient)
    case = _case("llama", None, "json-small")
    eng = run_trace("engine", case)
    ref = Trace.from_records(run_case("mlx_lm_grammar_stateful", case))
    v = compare_with_reference(eng, ref, "mlx_lm_grammar_stateful")
    assert v.status == "divergent", v.format()


def test_planted_walk_bug_is_caught_against_mlx_lm(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import grammar as eg
    from tests.test_grammar_walk import _planted

    case = _case("llama", "self", "regex-sentence", 3)
    ref = Trace.from_records(run_case("mlx_lm_grammar", case))
    monkeypatch.setattr(eg, "constrained_walk", _planted("stale-mask"))
    bad = run_trace("engine", case)
    div = grammar_divergence(bad, ref)
    assert div is not None and div.field == "grammar_mask", div
    assert "a at round" in div.message and "window position" in div.message, div.message
    v = compare_with_reference(bad, ref, "mlx_lm_grammar")
    assert v.status == "divergent", v.format()


def test_sampled_spec_is_not_compared_with_processor_references() -> None:
    """mlx-lm samples every verify row and masks its drafter: a sampled speculative grammar case
    draws differently by design, so the references refuse it instead of a false divergence."""
    from specparity.runners import registry

    case = _case("llama", "twin", "json-small", temperature=0.8)
    for runner in ("mlx_lm_grammar", "mlx_lm_grammar_stateful"):
        assert not registry.supports(runner, case)
        assert registry.supports(runner, case.plain())
    assert not registry.supports("mlx_lm", replace(case, temperature=0.0))  # no grammar option


def test_mlx_vlm_llguidance_processor_behaves_as_the_stateful_replica() -> None:
    """mlx-vlm 0.7.10's own ``LLGuidanceLogitsProcessor`` (its class unmodified, the Metal mask
    kernel replaced by the same mask on the CPU; ``tox -e vlm``) in mlx-lm's loops does what the
    stateful runner measures: plain decode identical, speculation the same crash or the same output."""
    pytest.importorskip("mlx_vlm.structured")
    from oracles import mlx_lm_grammar as oracle
    from specparity.runners import load_model
    from zoo import model_dir

    target, draft = load_model(str(model_dir("llama"))), load_model(str(model_dir("llama-twin")))

    def outcome(processor: str, grammar: str, prompt: str, spec: bool) -> tuple[str, object]:
        g = G.spec(grammar)
        try:
            recs = oracle.run(target.model, target.tokenizer, list(G.prompt_ids(prompt)), grammar_kind=g.kind,
                              grammar_text=g.text, vocab_size=512, processor=processor,
                              draft=draft.model if spec else None, gamma=3, max_tokens=48)
        except (oracle.GrammarRunError, ReferenceRefused):
            return "crash", None
        return "ok", recs[-1]["output_ids"]

    rows = Counter()
    for grammar in GRAMMARS:
        for prompt in ("json-00", "nat-00"):
            for spec in (False, True):
                vlm, replica = outcome("mlx_vlm", grammar, prompt, spec), outcome("stateful", grammar, prompt, spec)
                assert vlm == replica, (grammar, prompt, spec, vlm, replica)
                rows[("spec" if spec else "plain", vlm[0])] += 1
    assert rows[("plain", "ok")] == 8 and rows[("spec", "crash")] > 0, rows


# outlines 1.3's MLXLM processors (tox -e grammar-outlines): measured against their own plain runs.
OUTLINES_MATRIX = [(t, g, b, p, gamma) for t in ("llama", "qwen3") for g in GRAMMARS
                   for b in ((None, "llguidance") if g != "lark-list" else (None,))
                   for p in ("json-00", "nat-00", "nat-03") for gamma in (1, 3)]
# (backend, outcome) -> cases, measured on the zoo at temperature 0, max_tokens 40 (docs/grammar.md)
OUTLINES_ROWS = {
    ("outlines_core", "crash"): 32, ("outlines_core", "differs"): 4, ("outlines_core", "identical"): 0,
    ("llguidance", "crash"): 0, ("llguidance", "differs"): 48, ("llguidance", "identical"): 0,
}


def test_outlines_processors_under_speculation_vs_their_own_plain_decode() -> None:
    """outlines' own processor (from its MLXLM API, driven as ``model.stream(..., draft_model=...)``
    hands it to mlx-lm): its speculative output against its plain output, greedy. A correct
    adapter emits the same tokens; the measured outcomes are pinned (docs/grammar.md scoreboard)."""
    pytest.importorskip("outlines")
    from oracles import mlx_lm_grammar as oracle
    from specparity.runners import load_model
    from zoo import model_dir

    rows: Counter[tuple[str, str]] = Counter()
    for target, grammar, backend, prompt, gamma in OUTLINES_MATRIX:
        t, d = load_model(str(model_dir(target))), load_model(str(model_dir(f"{target}-twin")))
        g = G.spec(grammar)
        proc = "outlines_llguidance" if backend == "llguidance" else "outlines"
        run = dict(oracle=oracle, target=t, kind=g.kind, text=g.text, processor=proc,
                   prompt=list(G.prompt_ids(prompt)), gamma=gamma)
        plain = _outlines_output(**run, draft=None)
        assert plain is not None, (target, grammar, backend, prompt, "outlines' plain decode raised")
        spec = _outlines_output(**run, draft=d.model)
        name = backend or ("llguidance" if g.kind == "lark" else "outlines_core")
        rows[(name, "crash" if spec is None else "identical" if spec == plain else "differs")] += 1
    print(dict(rows))
    assert dict(rows) == {k: v for k, v in OUTLINES_ROWS.items() if v}, dict(rows)


def _outlines_output(oracle: Any, target: Any, kind: str, text: str, processor: str, prompt: list[int],
                     gamma: int, draft: Any) -> list[int] | None:
    """Output ids of one outlines-processor run in mlx-lm's loop; None when it raised."""
    try:
        recs = oracle.run(target.model, target.tokenizer, prompt, grammar_kind=kind, grammar_text=text,
                          vocab_size=512, processor=processor, draft=draft, gamma=gamma, max_tokens=40)
    except (oracle.GrammarRunError, ReferenceRefused):
        return None
    return list(recs[-1]["output_ids"])


# A reasoning-end marker (engine.grammar; tests/test_grammar_reasoning.py): the history-pure
# processor applies the grammar after the marker's first occurrence in its history, as the engine
# does after the emitted marker; engine vs mlx-lm stays comparable, plain and speculative.


@pytest.mark.parametrize("gamma", _GAMMAS)
def test_reasoning_marker_engine_equals_mlx_lm_history_pure(gamma: int) -> None:
    from engine.grammar import FREE_DIGEST
    from oracles.mlx_lm_grammar import FREE_DIGEST as ORACLE_FREE
    from tests.test_grammar_reasoning import _free, _marker_ending_at, _marker_site

    assert FREE_DIGEST == ORACLE_FREE
    tok = _zoo_tokenizer()
    free = _free()
    offsets = set()
    for j in range(gamma + 1):
        marker = _marker_ending_at(free, j, tok)
        if marker is None:
            continue
        for drafter in (None, "self", "twin"):
            case = Case("llama", drafter, "nat-03", gamma if drafter else 0, 64, grammar="json-small",
                        reasoning_end=marker, prompt_tokens=G.prompt_ids("nat-03"))
            v = _verdict(case, "mlx_lm_grammar")
            assert v.status == "identical", f"{case.case_id}:\n{v.format()}"
            if drafter == "self":
                offsets.add(_marker_site(run_trace("engine", case))[1])
    assert offsets == set(range(gamma + 1)), offsets


def test_reasoning_marker_refused_by_the_stateful_shape() -> None:
    from specparity.runners import registry

    case = Case("llama", "twin", "nat-03", 3, 16, grammar="json-small", reasoning_end="ll",
                prompt_tokens=G.prompt_ids("nat-03"))
    for runner in ("mlx_lm_grammar_stateful", "xgrammar_mlxlm"):
        why = registry.unsupported(runner, case)
        assert why is not None and "reasoning_end" in why, why
    assert registry.unsupported("mlx_lm_grammar", case) is None


def _zoo_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    import zoo

    return PreTrainedTokenizerFast(tokenizer_file=str(zoo.tokenizer_path()))


# xgrammar's contrib/mlxlm.py processor (tox -e grammar-xgrammar): measured against its own plain
# runs (and its plain runs against the engine's). Lark is not driven: xgrammar reads EBNF.
XGRAMMAR_MATRIX = [(t, g, p, gamma) for t in ("llama", "qwen3") for g in GRAMMARS if g != "lark-list"
                   for p in ("json-00", "nat-00", "nat-03") for gamma in (1, 3)]
# outcome -> cases, measured on the zoo at temperature 0, max_tokens 40 (docs/grammar.md)
XGRAMMAR_ROWS: dict[str, int] = {"plain text == engine": 12, "plain text != engine": 24, "crash": 0,
                                 "identical": 0, "differs-valid": 0, "differs-invalid": 36}


def _xgrammar_outcome(spec: list[int] | None, plain: list[int], grammar: str) -> str:
    if spec is None:
        return "crash"
    if spec == plain:
        return "identical"
    return "differs-valid" if _valid_text(_zoo_tokenizer().decode(spec), grammar) else "differs-invalid"


def _valid_text(text: str, grammar: str) -> bool:
    import json
    import re

    import jsonschema

    g = G.spec(grammar)
    if g.kind == "regex":
        return re.fullmatch(g.text, text) is not None
    try:
        jsonschema.validate(json.loads(text), json.loads(g.text))
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_xgrammar_processor_under_speculation_vs_its_own_plain_decode() -> None:
    """xgrammar's own class driven unmodified as ``mlx_lm.generate(..., logits_processors=[p],
    draft_model=...)`` would: its speculative output against its plain output, greedy. Its plain
    output is the engine's (the same compact JSON / regex language); the measured speculative
    outcomes are pinned (docs/grammar.md scoreboard)."""
    pytest.importorskip("xgrammar")
    from oracles import xgrammar_mlxlm
    from specparity.runners import load_model
    from zoo import model_dir

    xgrammar_mlxlm.require()
    rows: Counter[str] = Counter()
    for target, grammar, prompt, gamma in XGRAMMAR_MATRIX:
        t, d = load_model(str(model_dir(target))), load_model(str(model_dir(f"{target}-twin")))
        g = G.spec(grammar)
        run = dict(oracle=xgrammar_mlxlm._base, target=t, kind=g.kind, text=g.text, processor="xgrammar",
                   prompt=list(G.prompt_ids(prompt)), gamma=gamma)
        plain = _outlines_output(**run, draft=None)
        assert plain is not None, (target, grammar, prompt, "xgrammar's plain decode raised")
        eng = run_trace("engine", Case(target, None, prompt, 0, 40, grammar=grammar,
                                       prompt_tokens=G.prompt_ids(prompt)))
        tok = _zoo_tokenizer()
        same_text = tok.decode(plain) == tok.decode(eng.footer["output_ids"])
        rows["plain text == engine" if same_text else "plain text != engine"] += 1
        spec = _outlines_output(**run, draft=d.model)
        rows[_xgrammar_outcome(spec, plain, grammar)] += 1
    print(dict(rows))
    assert dict(rows) == {k: v for k, v in XGRAMMAR_ROWS.items() if v}, dict(rows)
