"""A reasoning-end marker under speculation: the grammar applies only after the marker (engine.grammar).

Reasoning models emit free text until a reasoning-end marker (``</think>``,
possibly several tokens); only then does the grammar constrain the output
(vLLM's reasoning parsers + structured output: ``is_reasoning_end`` on the
accepted tokens). Checked here, against plain decode + the same constraint (the
engine's own plain lane, masked through the same ``StepSampler.sample_plain``):

- before the whole marker has been EMITTED no mask applies (mask digest
  ``FREE_DIGEST``) and the matcher does not advance; the position right after
  the marker's last token is the first masked one, from the matcher's fresh
  state (the marker is never fed to it);
- greedy spec ≡ greedy plain, tokens and per-position masks, with the marker
  ending at EVERY window offset 0..γ for γ 1–5 (the self drafter's drafts are
  the target's own free picks, so emitted position j lands at a known offset),
  and with a twin drafter (rejections around the marker);
- 100 % validity of the text after the marker (``jsonschema``);
- planted bugs — the mask applied from the round start instead of after the
  marker, the marker detected on drafted (not emitted) tokens, the matcher fed
  the marker tokens — each caught, the first divergent round and window
  position named.

The markers are zoo tokens the zoo models actually emit: picked from the target's
own free greedy output (text that round-trips through the zoo tokenizer), so the
marker ends exactly where the test wants it.
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
from specparity.cases.case import Case
from specparity.runners import run_case
from tests.helpers import cli as _cli
from traces.diff import diff_traces, grammar_divergence, grammar_sites
from traces.io import Trace
from traces.validate import validate_trace

pytest.importorskip("llguidance")

KV = "llama"
GAMMAS = (1, 2, 3, 4, 5)
# γ 1, 3, 5 in the default run (the smallest, a middle and the largest window; every window
# offset of each); γ 2 and 4 nightly (``-m slow``): the same offsets of other window sizes.
NIGHTLY = (pytest.mark.slow, pytest.mark.heavy)
GAMMA_PARAMS = [pytest.param(g, marks=() if g in (1, 5) else NIGHTLY) for g in GAMMAS]  # the end windows; the rest nightly


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(zoo.tokenizer_path()))


def _trace(case: Case) -> Trace:
    return Trace.from_records(run_case("engine", case))


def _case(drafter: str, gamma: int, marker: str, *, grammar: str = "json-small", prompt: str = "nat-03",
          target: str = KV, max_tokens: int = 64) -> Case:
    return Case(target, drafter, prompt, gamma, max_tokens, grammar=grammar, reasoning_end=marker,
                prompt_tokens=G.prompt_ids(prompt))


def _free(target: str = KV, prompt: str = "nat-03", n: int = 40) -> list[int]:
    """The target's free greedy output (no grammar): what the self drafter drafts."""
    return list(_trace(Case(target, None, prompt, 0, n, prompt_tokens=G.prompt_ids(prompt))).footer["output_ids"])


def _marker_ending_at(free: list[int], j: int, tokenizer: Any) -> str | None:
    """The zoo's marker whose tokens are ``free[j-m+1 : j+1]`` (zoo.grammars.marker_ending_at),
    checked against the HF view of the zoo tokenizer the engine encodes it with."""
    text = G.marker_ending_at(free, j)
    if text is not None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert free[j - len(ids) + 1 : j + 1] == ids, (text, ids)
    return text


def _marker_site(trace: Trace) -> tuple[str, int | None, int]:
    """(record, window position, output index) of the marker's last token: the last unmasked site."""
    sites = grammar_sites(trace)
    j = max(i for i, s in enumerate(sites) if s[3] == eg.FREE_DIGEST)
    assert all(s[3] != eg.FREE_DIGEST for s in sites[j + 1 :]), "a free position after a masked one"
    return sites[j][0], sites[j][1], j


def _identical(spec: Trace, plain: Trace) -> None:
    cid = spec.header["case_id"]
    div = grammar_divergence(spec, plain) or diff_traces(spec, plain, level="tokens")
    assert div is None, f"{cid}: speculative + grammar vs plain + grammar\n{div.message}"


def _valid_after_marker(trace: Trace, j: int, tokenizer: Any) -> None:
    cid = trace.header["case_id"]
    assert trace.footer["usage"]["finish_reason"] == "stop", f"{cid}: budget ran out ({trace.footer['usage']})"
    text = tokenizer.decode(trace.footer["output_ids"][j + 1 :])
    try:
        jsonschema.validate(json.loads(text), G.JSON_SMALL)
    except (ValueError, jsonschema.ValidationError) as exc:
        pytest.fail(f"{cid}: the text after the marker {text!r} is not valid under the schema: {exc}")


# ----------------------------------------------------------------------- units


def test_the_matcher_is_free_until_the_whole_marker_is_emitted(tokenizer: Any) -> None:
    marker = tokenizer.encode("</think>", add_special_tokens=False)
    assert len(marker) > 1  # a several-token marker
    g = eg.Grammar.for_tokenizer(G.spec("json-small"), tokenizer, 512, [1], "</think>")
    plain = eg.Grammar.for_tokenizer(G.spec("json-small"), tokenizer, 512, [1]).matcher()
    assert g.reasoning_end == tuple(marker)
    m = g.matcher()
    for t in tokenizer.encode("x </", add_special_tokens=False) + marker[:-1]:
        assert m.mask(512) is None and m.mask_digest() == eg.FREE_DIGEST and not m.stopped
        before = m.state_digest()
        m.consume(t)  # any token: no grammar yet
        assert m.state_digest() != before
    assert m.reasoning and m.consumed == 0
    m.consume(marker[-1])
    assert not m.reasoning and m.consumed == 0  # the marker is never fed to the grammar
    assert m.mask_digest() == plain.mask_digest() and m.state_digest() == plain.state_digest()
    assert not bool(m.allowed()[marker[0]])  # '<' cannot open a JSON object
    # a fork keeps the phase; the no-marker matcher is byte-identical to before
    f = m.fork()
    assert not f.reasoning and f.state_digest() == m.state_digest()
    assert eg.Grammar.for_tokenizer(G.spec("json-small"), tokenizer, 512, [1], "") == \
        eg.Grammar.for_tokenizer(G.spec("json-small"), tokenizer, 512, [1])


def test_marker_ids_and_case_ids(tokenizer: Any) -> None:
    assert eg.marker_ids(tokenizer, [5, 6]) == (5, 6)
    assert eg.marker_ids(tokenizer, "") == ()
    base = _case("self", 3, "")
    with_marker = replace(base, reasoning_end="</think>")
    assert base.case_id.endswith("/gr-json-small")  # unchanged without a marker
    assert re.search(r"/gr-json-small/re-[0-9a-f]{8}$", with_marker.case_id), with_marker.case_id
    tr = _trace(replace(with_marker, max_tokens=4))
    assert tr.header["params"]["grammar"]["reasoning_end"] == "</think>"
    assert not validate_trace(tr), validate_trace(tr)[:3]
    assert "reasoning_end" not in _trace(replace(base, max_tokens=4)).header["params"]["grammar"]


# ------------------------------------------------------------ identity with plain


@pytest.mark.parametrize("gamma", GAMMA_PARAMS)
def test_marker_ending_at_every_window_offset(gamma: int, tokenizer: Any) -> None:
    """The self drafter drafts the target's free picks, so before the marker every draft is
    accepted and emitted position j (tail-split prefill: the first window's head is the last
    prompt token) is window position j mod (γ + 1). A marker ending at each j < 2(γ + 1): the
    round that emits it masks its following positions from the fresh matcher; identical to plain."""
    free = _free()
    offsets: set[int] = set()
    for j in range(2 * (gamma + 1)):
        marker = _marker_ending_at(free, j, tokenizer)
        if marker is None:
            continue
        case = _case("self", gamma, marker)
        spec, plain = _trace(case), _trace(case.plain())
        _identical(spec, plain)
        assert not validate_trace(spec), validate_trace(spec)[:3]
        name, pos, at = _marker_site(spec)
        assert at == j and spec.footer["output_ids"][: j + 1] == free[: j + 1], (j, marker, name, pos)
        assert name.startswith("round") and pos == j % (gamma + 1), (j, name, pos)
        _valid_after_marker(spec, j, tokenizer)
        offsets.add(pos)
    assert offsets == set(range(gamma + 1)), f"γ={gamma}: the marker ended at window positions {sorted(offsets)}"


@pytest.mark.parametrize("gamma", GAMMA_PARAMS)
def test_marker_with_rejections_equals_plain(gamma: int, tokenizer: Any) -> None:
    """A twin drafter (rejections around the marker) on the KV, rotating and recurrent targets."""
    for target, prompt in ((KV, "nat-03"), ("gemma3", "nat-03"), ("qwen35", "json-00")):
        free = _free(target, prompt)
        markers = [m for m in (_marker_ending_at(free, j, tokenizer) for j in range(2, 12)) if m][:3]
        assert markers, f"{target}: no round-tripping marker in {free[:12]}"
        for marker in markers:
            case = _case("twin", gamma, marker, target=target, prompt=prompt)
            spec, plain = _trace(case), _trace(case.plain())
            assert spec.rounds, case.case_id
            _identical(spec, plain)
            _, _, j = _marker_site(plain)
            if plain.footer["usage"]["finish_reason"] == "stop":
                _valid_after_marker(spec, j, tokenizer)


def test_a_marker_that_never_comes_leaves_the_output_free(tokenizer: Any) -> None:
    free = _free(n=24)
    case = replace(_case("twin", 3, "</think>"), max_tokens=24)
    spec, plain = _trace(case), _trace(case.plain())
    _identical(spec, plain)
    assert spec.footer["output_ids"] == free
    assert {s[3] for s in grammar_sites(spec)} == {eg.FREE_DIGEST}


# ------------------------------------------------------------------ planted bugs


Walk = Callable[..., eg.WalkResult]


def _planted(variant: str) -> Walk:
    """The constrained walk with one deliberate reasoning-marker bug (never in shipped code)."""

    def walk(sample_row: Any, offer: Any, matcher: eg.GrammarMatcher, block: Any, drafts: Any,
             terminate: Any) -> eg.WalkResult:
        d, width = len(drafts), int(block.shape[-1])
        masked_from_start = False
        if variant == "round-start" and matcher.reasoning:
            # "the round that ends the reasoning is constrained": a dry walk finds that the
            # marker ends inside this window, and the mask is applied from position 0
            dry = matcher.fork()
            for i in range(d + 1):
                t = eg.token_ids(sample_row(block[i : i + 1, :], i, None))[0]
                dry.consume(t)
                if not dry.reasoning:
                    masked_from_start = True
                    break
                if i >= d or t != drafts[i]:
                    break
        walked: list[int] = []
        emitted: list[int] = []
        masks: list[str] = []
        k, end = 0, "bonus"
        for i in range(d + 1):
            if masked_from_start and matcher.reasoning:
                fresh = matcher.fork()
                fresh.reasoning = False
                mask, digest = fresh.mask(width), fresh.mask_digest()
            else:
                mask, digest = matcher.mask(width), matcher.mask_digest()
            masks.append(digest)
            y = sample_row(block[i : i + 1, :], i, mask)
            t = eg.token_ids(y)[0]
            walked.append(t)
            matched = i < d and t == drafts[i]
            k += matched
            stop = offer(t)
            if stop != "eos":
                emitted.append(t)
                was = matcher.reasoning
                if was and variant == "drafted" and i < d:
                    matcher.consume(drafts[i])  # the marker looked for in the drafts
                elif not was and (matcher.stopped or not matcher.allowed()[t]):
                    pass  # a planted masked_from_start pick the real state refuses: keep walking
                else:
                    matcher.consume(t)
                if was and not matcher.reasoning and variant == "fed-marker":
                    matcher._m.consume_tokens(list(matcher.reasoning_end))  # the grammar eats the marker
                    matcher._bitmask = None
            if stop is not None:
                end = stop
                break
            if matcher.stopped:
                end = terminate()
                break
            if not matched:
                end = "correction" if i < d else "bonus"
                break
        return eg.WalkResult(walked, emitted, k, end, masks)

    return walk


def _drafted_marker_case(tokenizer: Any) -> Case:
    """A twin-drafter case whose drafter drafts a token the target then rejects, that token never
    emitted before: that token, as the marker, is drafted (and rejected) before it is emitted."""
    for prompt in ("json-00", "nat-00"):
        probe = _trace(_case("twin", 3, "</think>", prompt=prompt))
        out, n = probe.footer["output_ids"], 0
        for r in probe.rounds:
            n += len(r["emitted"])
            k = r["k_accept"]
            if k >= len(r["drafts"]):
                continue
            x = r["drafts"][k]
            text = tokenizer.decode([x])
            if x in out[:n] or "\ufffd" in text or tokenizer.encode(text, add_special_tokens=False) != [x]:
                continue
            return _case("twin", 3, text, prompt=prompt)
    raise AssertionError("no rejected draft usable as a marker")


def _plant_case(variant: str, tokenizer: Any) -> Case:
    free = _free()
    if variant == "drafted":
        return _drafted_marker_case(tokenizer)
    if variant == "fed-marker":  # a marker the list grammar accepts: fed to it, it shifts the state
        for j in range(3, 20):
            m = _marker_ending_at(free, j, tokenizer)
            if m and re.fullmatch(r"[a-z ]{1,11}", m):
                return _case("self", 3, m, grammar="lark-list")
        raise AssertionError("no list-grammar-acceptable marker in the free output")
    m = _marker_ending_at(free, 2, tokenizer)
    assert m is not None
    return _case("self", 3, m)


@pytest.mark.parametrize("variant", ["round-start", "drafted", "fed-marker"])
def test_planted_reasoning_bug_is_caught(variant: str, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    case = _plant_case(variant, tokenizer)
    plain = _trace(case.plain())
    good = _trace(case)
    assert grammar_divergence(good, plain) is None
    monkeypatch.setattr(eg, "constrained_walk", _planted(variant))
    bad = _trace(case)
    div = grammar_divergence(bad, plain) or diff_traces(bad, plain, level="tokens")
    assert div is not None, f"{variant}: the planted bug went unnoticed on {case.case_id}"
    assert re.search(r"a at round \d+ window position \d+", div.message), div.message
    sites_bad, sites_plain = grammar_sites(bad), grammar_sites(plain)
    first = next(j for j, (x, y) in enumerate(zip(sites_bad, sites_plain, strict=False))
                 if (x[2], x[3]) != (y[2], y[3]))
    assert div.position == first, (div.position, first, div.message)
    _, _, marker_at = _marker_site(plain)
    if variant == "round-start":  # the marker's own round, from its first position
        assert sites_bad[first][1] == 0 and first <= marker_at, (first, marker_at, div.message)
    elif variant == "fed-marker":  # the first masked position
        assert first == marker_at + 1, (first, marker_at, div.message)
    else:  # drafted: before the marker was emitted
        assert first <= marker_at or marker_at is None, (first, marker_at, div.message)


# ------------------------------------------------------------------------ harness


def test_generate_record_and_grade_with_a_reasoning_marker(tokenizer: Any, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from traces.io import read_trace

    free = _free()
    marker = _marker_ending_at(free, 3, tokenizer)
    assert marker is not None
    tdir, ddir = zoo.pair(KV, "twin")
    common = ["--target", tdir, "--draft", ddir, "--prompt-ids", ",".join(map(str, G.prompt_ids("nat-03"))),
              "-n", 64, "--gamma", 3, "--grammar", "json-small", "--reasoning-end", marker]
    rc, out, err = _cli(["generate", *common, "--trace", tmp_path / "g.jsonl"], capsys)
    assert rc == 0, err
    trace = read_trace(tmp_path / "g.jsonl")
    assert not validate_trace(trace), validate_trace(trace)[:3]
    assert trace.header["params"]["grammar"]["reasoning_end"] == marker
    assert re.search(r"/re-[0-9a-f]{8}$", trace.header["case_id"]), trace.header["case_id"]
    _, _, j = _marker_site(trace)
    assert j == 3 and trace.footer["output_ids"][:4] == free[:4]
    _valid_after_marker(trace, j, tokenizer)
    rc, _, err = _cli(["record", *common, "--runner", "engine,mlx_lm_grammar", "--out", tmp_path / "rec"], capsys)
    assert rc == 0, err
    eng = read_trace(next((tmp_path / "rec" / "engine").glob("*.jsonl")))
    ref = read_trace(next((tmp_path / "rec" / "mlx_lm_grammar").glob("*.jsonl")))
    assert grammar_divergence(eng, ref) is None
    # grade re-runs plain decode and the reference under the marker the header recorded
    rc, out, err = _cli(["grade", tmp_path / "rec" / "engine", "--out", tmp_path / "graded"], capsys)
    assert rc == 0, err + out
    comps = json.loads((tmp_path / "graded" / "comparisons.json").read_text())
    kinds = {c["kind"]: c["verdict"] for c in comps}
    assert kinds.get("engine-vs-mlx_lm_grammar") == "identical" and kinds.get("spec-vs-plain") == "identical", comps


@pytest.mark.parametrize("argv, msg", [
    (["--reasoning-end", "</think>"], "--reasoning-end needs --grammar"),
    (["--grammar", "json-small", "--reasoning-end", ""], "--reasoning-end: expected a non-empty marker"),
])
def test_reasoning_end_without_grammar_is_one_line_exit_2(argv: list[str], msg: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _cli(["generate", "--target", zoo.model_dir(KV), "--prompt", "x", "-n", 2, *argv], capsys)
    assert rc == 2 and msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_suite_key_reasoning_end(tmp_path: Path) -> None:
    from specparity.cases.suite import SuiteError, load_suite, suite_cases

    suite = tmp_path / "s.toml"
    suite.write_text('gammas = [2]\nmax_tokens = 24\nzoo_prompts = 1\nreasoning_end = "</think>"\n'
                     '[[pair]]\ntarget = "llama"\ndrafter = "twin"\ngrammar = "json-small"\n')
    cases = suite_cases(load_suite(suite))
    assert cases and {c.reasoning_end for c in cases} == {"</think>"}, cases
    assert all("/re-" in c.case_id for c in cases)
    suite.write_text('reasoning_end = "</think>"\n[[pair]]\ntarget = "llama"\n')
    with pytest.raises(SuiteError, match="reasoning_end needs grammar"):
        suite_cases(load_suite(suite))
    suite.write_text('reasoning_end = 3\n[[pair]]\ntarget = "llama"\n')
    with pytest.raises(SuiteError, match="expected the marker text"):
        load_suite(suite)
