"""Structured output under speculation: the constrained verify walk (§2 "Grammar × spec").

engine/grammar.py against plain decode + the same grammar (the engine's own plain
lane, masked through the same ``StepSampler.sample_plain`` call):

- greedy: the speculative output equals plain decode + grammar token for token
  AND position for position in the allowed sets (mask digests, traces.diff
  ``grammar_divergence``), on a KV (llama), a rotating (gemma3) and a recurrent
  (qwen35) target at γ 1–5, JSON schema / regex / Lark grammars;
- seeded sampled: with a model-free drafter (ngram: no draws of its own) the walk
  draws exactly one sample per emitted token, as plain decode does, so the
  sampled output equals plain + grammar too; with a model drafter the output is
  valid and a function of the seed;
- 100 % validity: every output that ended (EOS or grammar termination) parses
  and validates with ``jsonschema`` (JSON) / matches the regex;
- grammar termination and EOS at every window offset 0..γ, each identical to plain;
- planted walk bugs (matcher advanced on a rejected draft; mask applied after
  sampling; mask of position i from the state before i−1; termination not
  truncating the round) are each caught, the first divergent round and window
  position named.

Reference mirrored: ../shared/reference/speculative-decoding.md §2 (mlx-bun
``samplePos``), mlx-lm 0.32.2 ``generate_step`` for plain decode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import zoo
import zoo.grammars as G
from engine import grammar as eg
from engine.grammar import GrammarError, GrammarSpec
from specparity.cases.case import Case
from specparity.runners import run_case
from tests.helpers import cli as _cli
from traces.diff import diff_traces, grammar_divergence
from traces.io import Trace, read_trace
from traces.validate import validate_trace

pytest.importorskip("llguidance")

KV, ROTATING, RECURRENT = "llama", "gemma3", "qwen35"


def _trace(case: Case) -> Trace:
    return Trace.from_records(run_case("engine", case))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(zoo.tokenizer_path()))


def _case(target: str, drafter: str, grammar: str, gamma: int, *, prompt: str = "json-00",
          max_tokens: int = 48, **kw: Any) -> Case:
    return Case(target, drafter, prompt, gamma, max_tokens, grammar=grammar,
                prompt_tokens=G.prompt_ids(prompt), **kw)


def _check_valid(trace: Trace, grammar: str, tokenizer: Any) -> None:
    """Every output that ended is a complete sentence of the grammar (jsonschema for JSON)."""
    usage = trace.footer["usage"]
    cid = trace.header["case_id"]
    assert usage["finish_reason"] == "stop", f"{cid}: the budget ran out before the grammar ended ({usage})"
    text = tokenizer.decode(trace.footer["output_ids"])
    spec = G.spec(grammar)
    if spec.kind == "json":
        try:
            jsonschema.validate(json.loads(text), json.loads(spec.text))
        except (ValueError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{cid}: output {text!r} is not valid under the schema: {exc}")
    elif spec.kind == "regex":
        assert re.fullmatch(spec.text, text), f"{cid}: output {text!r} does not match {spec.text!r}"


def _identical(spec: Trace, plain: Trace, *, validate: bool = True) -> None:
    cid = spec.header["case_id"]
    div = grammar_divergence(spec, plain) or diff_traces(spec, plain, level="tokens")
    assert div is None, f"{cid}: speculative + grammar vs plain + grammar\n{div.message}"
    if validate:  # the schema, with the optional grammar fields
        assert not validate_trace(spec), validate_trace(spec)[:3]


# ----------------------------------------------------------------------- units


def test_grammar_files_by_suffix(tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text(json.dumps(G.JSON_SMALL))
    (tmp_path / "r.regex").write_text(G.REGEX_SENTENCE + "\n")
    (tmp_path / "l.lark").write_text(G.LARK_LIST)
    kinds = {p.suffix: GrammarSpec.from_file(p).kind for p in tmp_path.iterdir()}
    assert kinds == {".json": "json", ".regex": "regex", ".lark": "lark"}
    assert GrammarSpec.from_file(tmp_path / "r.regex").text == G.REGEX_SENTENCE
    (tmp_path / "x.txt").write_text("a")
    with pytest.raises(GrammarError, match="suffix must be .json"):
        GrammarSpec.from_file(tmp_path / "x.txt")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(GrammarError, match="must be an object"):
        GrammarSpec.from_file(tmp_path / "bad.json")


def test_a_grammar_that_does_not_compile_is_refused(tokenizer: Any) -> None:
    with pytest.raises(GrammarError, match="does not compile"):
        eg.Grammar.for_tokenizer(GrammarSpec("lark", "start: undefined_rule", "bad"), tokenizer, 512, [1])


def test_the_zoo_tokenizer_spells_json() -> None:
    assert G.spells('{"a": [1, -2.5e3, true, null, "\\u00e9 x"], "b": {}}')
    assert G.spells('{"name":"ab","tags":["a","b"]}')


def test_mask_digests_track_the_matcher(tokenizer: Any) -> None:
    g = eg.Grammar.for_tokenizer(G.spec("json-small"), tokenizer, 512, [1])
    a, b = g.matcher(), g.matcher()
    assert a.mask_digest() == b.mask_digest() and a.state_digest() == b.state_digest()
    ids = tokenizer.encode('{"n":', add_special_tokens=False)
    for t in ids:
        a.consume(t)
    assert a.state_digest() != b.state_digest()
    for t in ids:
        b.consume(t)
    assert a.state_digest() == b.state_digest()
    assert int(a.allowed().sum()) == 10  # a digit
    with pytest.raises(GrammarError, match="refused token"):
        a.consume(tokenizer.encode("x", add_special_tokens=False)[0])


# ------------------------------------------------------------ identity with plain


GAMMAS = (1, 2, 3, 4, 5)


@pytest.mark.parametrize("grammar", ["json-small", "regex-sentence"])
@pytest.mark.parametrize("gamma", GAMMAS)
def test_greedy_spec_equals_plain_kv(gamma: int, grammar: str, tokenizer: Any) -> None:
    for drafter in ("twin", "self"):
        case = _case(KV, drafter, grammar, gamma)
        spec, plain = _trace(case), _trace(case.plain())
        _identical(spec, plain)
        _check_valid(spec, grammar, tokenizer)


ROTATING_MODES = {  # (prompt, rotating): the guard stops speculating inside the run; exact never
    "guard": ("nat-03", "guard"),
    "exact": ("json-00", "exact"),
}


@pytest.mark.parametrize("target", [ROTATING, RECURRENT])
@pytest.mark.parametrize("gamma", (1, 3, 5))
def test_greedy_spec_equals_plain_rotating_and_recurrent(target: str, gamma: int, tokenizer: Any) -> None:
    for grammar in ("json-small", "regex-sentence"):
        for prompt, rotating in (ROTATING_MODES.values() if target == ROTATING else [("json-00", "guard")]):
            case = _case(target, "twin", grammar, gamma, prompt=prompt, rotating=rotating)
            spec, plain = _trace(case), _trace(case.plain())
            assert spec.rounds, f"{case.case_id}: no speculative round"
            _identical(spec, plain)
            _check_valid(spec, grammar, tokenizer)


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("target", [KV, ROTATING, RECURRENT, "qwen3", "gemma4"])
@pytest.mark.parametrize("grammar", list(G.GRAMMARS))
def test_greedy_spec_equals_plain_matrix(target: str, grammar: str, tokenizer: Any) -> None:
    """Every target, grammar, prompt kind, drafter and γ 1–5 (the nightly matrix)."""
    rotating = _rot(target)
    for prompt in ("json-00", "json-01", "nat-00", "nat-03"):
        plain = _trace(_case(target, "twin", grammar, 1, prompt=prompt).plain())
        for drafter in ("self", "twin", "small"):
            for gamma in GAMMAS:
                spec = _trace(_case(target, drafter, grammar, gamma, prompt=prompt, rotating=rotating))
                _identical(spec, plain)
                if plain.footer["usage"]["finish_reason"] == "stop":
                    _check_valid(spec, grammar, tokenizer)


def test_the_identity_is_not_vacuous() -> None:
    """Drafts get accepted and rejected, and the mask changes what greedy decode emits."""
    case = _case(KV, "self", "regex-sentence", 3)
    spec = _trace(case)
    sp = spec.footer["speculation"]
    assert sp["accepted"] > 0 and sp["rejected"] > 0, sp
    assert max(len(r["grammar_masks"]) for r in spec.rounds) > 1  # multi-position walks
    free = _trace(replace(case, grammar=""))
    assert free.footer["output_ids"] != spec.footer["output_ids"]


def test_greedy_spec_with_ngram_drafts_equals_plain(tokenizer: Any) -> None:
    for target in (KV, ROTATING, RECURRENT):
        case = _case(target, "ngram", "json-small", 4, source="ngram", rotating=_rot(target))
        spec = _trace(case)
        assert spec.rounds, case.case_id
        _identical(spec, _trace(case.plain()))


def _rot(target: str) -> str:
    """Rotating targets speculate past their 32-token window (the JSON prompts are longer)."""
    return "exact" if target in (ROTATING, "gemma4") else "guard"


# ---------------------------------------------------------------- sampled


@pytest.mark.parametrize("target", [KV, ROTATING, RECURRENT])
def test_seeded_sampled_ngram_spec_equals_plain(target: str, tokenizer: Any) -> None:
    """A model-free drafter draws nothing: the walk's one draw per emitted token is plain decode's."""
    for grammar, seed in (("json-small", 1), ("regex-sentence", 2)):
        for gamma in (1, 3, 5):
            case = _case(target, "ngram", grammar, gamma, source="ngram", temperature=0.8, seed=seed,
                         rotating=_rot(target))
            spec, plain = _trace(case), _trace(case.plain())
            assert spec.rounds, case.case_id
            _identical(spec, plain)
            _check_valid(spec, grammar, tokenizer)


def test_seeded_sampled_model_drafter_is_valid_and_seeded(tokenizer: Any) -> None:
    outs = set()
    for seed in range(4):
        case = _case(KV, "twin", "json-small", 3, temperature=1.0, seed=seed)
        a, b = _trace(case), _trace(case)
        assert a.footer["output_ids"] == b.footer["output_ids"], case.case_id
        _check_valid(a, "json-small", tokenizer)
        outs.add(tuple(a.footer["output_ids"]))
    assert len(outs) > 1, "four seeds gave one output"


# ---------------------------------------------------- termination and EOS offsets


def _end_positions(trace: Trace, end: str) -> set[int]:
    return {len(r["samples"]) - 1 for r in trace.rounds if r["end"] == end}


def _literal(text: str) -> str:
    """A regex matching exactly ``text`` (every non-alphanumeric char as ``\\x{..}``)."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _free_greedy(tokenizer: Any, gamma: int) -> tuple[Case, list[int]]:
    """A case whose self drafter's drafts are the target's own free greedy picks, and those picks."""
    case = _case(KV, "self", "regex-sentence", gamma, prompt="nat-03", max_tokens=40)
    free = _trace(replace(case, grammar="")).footer["output_ids"]
    return case, free


def test_grammar_termination_at_every_window_offset(tokenizer: Any) -> None:
    """A grammar that is exactly the first m tokens of the free greedy output: the self drafter's
    drafts are all accepted, so the round that completes the grammar is cut at position
    (m - 1) mod (γ + 1); each run is identical to plain + grammar."""
    gamma, seen = 3, set()
    case, free = _free_greedy(tokenizer, gamma)
    for m in range(3, 3 + 3 * (gamma + 1)):
        text = tokenizer.decode(free[:m])
        if "\ufffd" in text or tokenizer.decode(free[:m - 1]) == text:
            continue  # a token prefix ending inside a UTF-8 sequence: no literal to match
        spec_g = GrammarSpec("regex", _literal(text), f"lit{m}")
        spec, plain = _run_with(case, spec_g), _run_with(case.plain(), spec_g)
        _identical(spec, plain, validate=False)
        assert spec.footer["output_ids"] == free[:m], (m, spec.footer["output_ids"], free[:m])
        assert spec.rounds[-1]["end"] == "grammar", spec.rounds[-1]
        assert spec.footer["usage"] == plain.footer["usage"], (spec.footer["usage"], plain.footer["usage"])
        seen |= _end_positions(spec, "grammar")
    assert seen == set(range(gamma + 1)), f"termination landed at window positions {sorted(seen)} only"


def test_eos_at_every_window_offset(tokenizer: Any) -> None:
    """The free greedy output's m-th token made the EOS id (of the request and the grammar): it
    arrives as an accepted draft at window position m mod (γ + 1), ends the stream there and is
    never emitted; each run is identical to plain + grammar."""
    gamma, seen = 4, set()
    case, free = _free_greedy(tokenizer, gamma)
    anything = GrammarSpec("regex", "(.|\\n)*", "any")
    for m in range(2, 14):
        if free[m] in free[:m]:
            continue  # an earlier occurrence would end the stream first
        eos = (free[m],)
        plain = _run_with(case.plain(), anything, eos)
        if plain.footer["output_ids"] != free[:m]:
            continue  # the grammar refused a free pick first (a byte token inside a UTF-8 sequence)
        spec = _run_with(case, anything, eos)
        _identical(spec, plain, validate=False)
        assert spec.rounds[-1]["end"] == "eos" and spec.footer["usage"] == plain.footer["usage"]
        seen |= _end_positions(spec, "eos")
    assert seen == set(range(gamma + 1)), f"EOS landed at window positions {sorted(seen)} only"


def _run_with(case: Case, spec: GrammarSpec, eos_ids: tuple[int, ...] | None = None) -> Trace:
    """Run ``case`` with an ad-hoc grammar (not a zoo name): engine.executor directly."""
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.sampler import SamplerParams
    from engine.sources.two_model import TwoModelProvider
    from specparity.runners import load_model, processor_params
    from traces.records import make_header

    tdir, ddir = zoo.pair(case.target, case.drafter) if case.drafter else (zoo.model_dir(case.target), None)
    target = load_model(str(tdir))
    eos = eos_ids if eos_ids is not None else tuple(target.eos_ids)
    g = eg.Grammar.for_tokenizer(spec, target.tokenizer, eg.model_vocab_size(target.model), eos)
    params = GenerationParams(max_tokens=case.max_tokens, gamma=case.gamma, eos_ids=eos, seed=case.seed,
                              sampler=SamplerParams(temperature=case.temperature,
                                                    processors=processor_params(case)), grammar=g)
    ids = list(case.prompt_tokens or ())
    if ddir is None:
        res = plain_generate(target.model, ids, params)
    else:
        res = spec_generate(target.model, TwoModelProvider(load_model(str(ddir)).model), ids, params)
    header = make_header(runner={"name": "engine", "package": "specparity", "version": "0", "commit": None},
                         mode="plain" if ddir is None else "spec", source=None if ddir is None else "two-model",
                         case_id=f"{case.case_id}/{spec.tag}", target={"path": str(tdir)}, drafter=None,
                         tokenizer_sha256=None, params={"gamma": case.gamma, "max_tokens": case.max_tokens},
                         prompt_id=case.prompt_id, prompt_ids=ids, eos_ids=eos)
    return Trace.from_records([header, *res.records, res.footer()])


# ------------------------------------------------------------------ planted bugs


Walk = Callable[..., eg.WalkResult]


def _planted(variant: str) -> Walk:
    """A constrained walk with one deliberate bug (never in shipped code)."""

    def walk(sample_row: Any, offer: Any, matcher: eg.GrammarMatcher, block: Any, drafts: Any,
             terminate: Any) -> eg.WalkResult:
        d, width = len(drafts), int(block.shape[-1])
        walked: list[int] = []
        emitted: list[int] = []
        masks: list[str] = []
        k, end = 0, "bonus"
        stale: tuple[Any, str] | None = None
        for i in range(d + 1):
            if matcher.stopped and variant == "no-truncation":
                mask, digest = None, matcher.mask_digest()  # "a finished grammar constrains nothing"
            elif variant == "stale-mask" and i > 0 and stale is not None:
                mask, digest = stale  # the state before position i-1's token
            else:
                mask, digest = matcher.mask(width), matcher.mask_digest()
            stale = (mask, digest)
            masks.append(digest)
            y = sample_row(block[i : i + 1, :], i, None if variant == "mask-after-sample" else mask)
            t = eg.token_ids(y)[0]
            walked.append(t)
            matched = i < d and t == drafts[i]
            k += matched
            stop = offer(t)
            if stop != "eos":
                emitted.append(t)
                if not matcher.stopped and matcher.allowed()[t]:
                    nxt = drafts[i] if (variant == "advance-on-draft" and i < d
                                        and matcher.allowed()[drafts[i]]) else t
                    matcher.consume(nxt)
            if stop is not None:
                end = stop
                break
            if matcher.stopped and variant != "no-truncation":
                end = terminate()
                break
            if not matched:
                end = "correction" if i < d else "bonus"
                break
        return eg.WalkResult(walked, emitted, k, end, masks)

    return walk


PLANTS = {
    # (variant, case): each case exercises the bug within its budget
    "advance-on-draft": _case(KV, "twin", "regex-sentence", 3),
    "mask-after-sample": _case(KV, "twin", "json-small", 3),
    "stale-mask": _case(KV, "self", "regex-sentence", 3),
    "no-truncation": _case(KV, "self", "regex-sentence", 3),
}


# The field of the grammar comparison that names each plant: a wrong mask is a mask digest
# (before any token differs: advance-on-draft shows 3 tokens before the output does), a token
# sampled without its mask is the sample the mask would not allow.
OWN_FIELD = {"advance-on-draft": "grammar_mask", "mask-after-sample": "sample", "stale-mask": "grammar_mask",
             "no-truncation": "grammar_mask"}


@pytest.mark.parametrize("variant", list(PLANTS))
def test_planted_walk_bug_is_caught(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = PLANTS[variant]
    plain = _trace(case.plain())
    good = _trace(case)
    assert grammar_divergence(good, plain) is None
    monkeypatch.setattr(eg, "constrained_walk", _planted(variant))
    bad = _trace(case)
    div = grammar_divergence(bad, plain)  # the grammar comparison itself, not the token diff
    assert div is not None, f"{variant}: the planted bug went unnoticed on {case.case_id}"
    assert div.field == OWN_FIELD[variant], (variant, div.field, div.message)
    assert re.search(r"a at round \d+ window position \d+", div.message), div.message
    # the divergence is the first place the bug changed something
    first = next(j for j, (x, y) in enumerate(zip(_sites(bad), _sites(plain), strict=False)) if x != y)
    assert div.position == first, (div.position, first, div.message)


def _sites(trace: Trace) -> list[tuple[int, str]]:
    from traces.diff import grammar_sites

    return [(tok, dig) for _, _, tok, dig in grammar_sites(trace)] + [(-1, "end")]


# ------------------------------------------------------------------------ harness


@pytest.fixture
def schema_file(tmp_path: Path) -> Path:
    p = tmp_path / "answer.json"
    p.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"},
                                                              "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                             "required": ["ok", "n"], "additionalProperties": False}))
    return p


def test_generate_record_and_grade_with_a_grammar_file(schema_file: Path, tmp_path: Path, tokenizer: Any,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    tdir, ddir = zoo.pair(KV, "twin")
    common = ["--target", tdir, "--draft", ddir, "--prompt", "Answer: ", "-n", 24, "--gamma", 3,
              "--grammar", schema_file]
    rc, out, err = _cli(["generate", *common, "--trace", tmp_path / "g.jsonl"], capsys)
    assert rc == 0, err
    jsonschema.validate(json.loads(out.strip()), json.loads(schema_file.read_text()))
    trace = read_trace(tmp_path / "g.jsonl")
    assert not validate_trace(trace), validate_trace(trace)[:3]
    assert trace.header["params"]["grammar"]["sha256"] == GrammarSpec.from_file(schema_file).digest
    assert all("grammar_masks" in r and "grammar_state" in r for r in trace.rounds)
    assert trace.header["case_id"].endswith(f"/gr-{GrammarSpec.from_file(schema_file).tag}")
    rc, _, err = _cli(["record", *common, "--runner", "engine,mlx_lm_grammar", "--out", tmp_path / "rec"],
                      capsys)
    assert rc == 0, err
    eng = next((tmp_path / "rec" / "engine").glob("*.jsonl"))
    ref = next((tmp_path / "rec" / "mlx_lm_grammar").glob("*.jsonl"))
    assert grammar_divergence(read_trace(eng), read_trace(ref)) is None
    # grade re-runs plain decode and the references under the grammar the header recorded
    schema_file.unlink()  # from the header's text, not the user's file
    rc, out, err = _cli(["grade", tmp_path / "rec" / "engine", "--out", tmp_path / "graded"], capsys)
    assert rc == 0, err + out
    comps = json.loads((tmp_path / "graded" / "comparisons.json").read_text())
    kinds = {c["kind"]: c["verdict"] for c in comps}
    assert kinds.get("engine-vs-mlx_lm_grammar") == "identical", comps
    assert any(c["known"] == "mlx-lm-spec-stateful-grammar-processor-crashes" for c in comps), comps


@pytest.mark.parametrize("text, suffix, msg", [
    ("a", ".txt", "suffix must be .json"),
    ("[1]", ".json", "must be an object"),
    ("{", ".json", "not a JSON schema"),
])
def test_a_bad_grammar_file_is_one_line_exit_2(tmp_path: Path, text: str, suffix: str, msg: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / f"g{suffix}"
    p.write_text(text)
    rc, _, err = _cli(["generate", "--target", zoo.model_dir(KV), "--prompt", "x", "-n", 2, "--grammar", p],
                      capsys)
    assert rc == 2 and msg in err and "Traceback" not in err, err


def test_a_grammar_that_does_not_compile_is_refused_before_decoding(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bad.lark"
    p.write_text("start: missing_rule\n")
    rc, _, err = _cli(["generate", "--target", zoo.model_dir(KV), "--prompt", "x", "-n", 2, "--grammar", p],
                      capsys)
    assert rc == 2 and "does not compile" in err and "Traceback" not in err, err


def test_suite_key_grammar(schema_file: Path, tmp_path: Path) -> None:
    from specparity.cases.suite import SuiteError, load_suite, suite_cases

    suite = tmp_path / "s.toml"
    suite.write_text('gammas = [2]\nmax_tokens = 24\nzoo_prompts = 1\ngrammar = "answer.json"\n'
                     '[[pair]]\ntarget = "llama"\ndrafter = "twin"\n'
                     '[[pair]]\ntarget = "qwen35"\ndrafter = "twin"\ngrammar = "lark-list"\n')
    cases = suite_cases(load_suite(suite))
    assert {c.grammar for c in cases} == {str(schema_file.resolve()), "lark-list"}, cases
    assert all("/gr-" in c.case_id for c in cases)
    for bad, msg in (('grammar = ""', "expected a grammar file"), ('grammar = "nope.json"', "no such file")):
        suite.write_text(f'{bad}\n[[pair]]\ntarget = "llama"\n')
        with pytest.raises(SuiteError, match=msg):
            load_suite(suite)


def test_zoo_matrix_has_grammar_cases_on_every_cache_kind() -> None:
    from specparity.jobs.run import grammar_cases, zoo_cases

    cases = grammar_cases(gammas=(1, 3))
    assert {(c.target, c.prompt_id) for c in cases} == {(KV, "json-00"), (ROTATING, "nat-03"),
                                                        (RECURRENT, "json-00")}
    assert {c.grammar for c in cases} == {"json-small", "regex-sentence"}
    assert all(c.max_tokens == 32 and c.prompt_tokens for c in cases)
    assert {c.grammar for c in grammar_cases(gammas=(3,), grammar="lark-list")} == {"lark-list"}
    matrix = zoo_cases(targets=[KV], drafters=["twin"], gammas=(3,), n_prompts=1)
    assert [c.case_id for c in matrix if c.grammar] == [
        "llama/twin/json-00/g3/n32/gr-json-small", "llama/twin/json-00/g3/n32/gr-regex-sentence"]
    assert all(not c.grammar for c in matrix if c.prompt_id != "json-00")  # the other cases as before


@pytest.mark.parametrize("processors", ["rp1.3c64", "pp0.5c20+fp1c64+lb5=1.5"])
def test_grammar_with_logits_processors_spec_equals_plain(processors: str, tokenizer: Any) -> None:
    """Processors run before the mask in every lane; a walked row's history is the request history
    plus the round's tokens emitted before it (never a rejected draft)."""
    for drafter, gamma in (("self", 3), ("twin", 2), ("twin", 5)):
        case = _case(KV, drafter, "regex-sentence", gamma, processors=processors)
        spec, plain = _trace(case), _trace(case.plain())
        _identical(spec, plain)
        _check_valid(spec, "regex-sentence", tokenizer)
    free = _trace(replace(case, processors=""))
    assert free.footer["output_ids"] != spec.footer["output_ids"], "the processors changed nothing"


def test_a_tokenizer_llguidance_cannot_read_is_one_clear_error(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A user's word-level (WordPiece-decoder) tokenizer: llguidance cannot map it; `run --grammar`
    says so in one line naming the tokenizer (exit 2), no llguidance-internal text alone."""
    from specparity.cli import main
    from tests import foreign

    t = foreign.write_model("phi3", tmp_path / "t")
    d = foreign.write_model("phi3", tmp_path / "d", drafter=True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "text": "ba de fi"}\n')
    (tmp_path / "g.regex").write_text("(ba |de )+")
    rc = main(["run", "--target", str(t), "--draft", str(d), "--prompts-file", str(prompts), "--gammas", "2",
               "--max-tokens", "4", "--grammar", str(tmp_path / "g.regex"), "--out", str(tmp_path / "out"),
               "--quiet"])
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert rc == 2 and len(errors) == 1 and "llguidance cannot read this model's tokenizer" in errors[0], err
    assert "Traceback" not in err
