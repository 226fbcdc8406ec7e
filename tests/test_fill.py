"""Unit tests of token fast-forwarding (``engine/fill``, §7 / §7.1–7.2): the interface and
its policies, the apply primitive's span rules and alignment assert, the refusals, the echo
index, the strict compiler on the zoo fill tokenizer, and the planted bugs each gate must
catch with the position named (the model-level gates are ``conformance/test_fill_vs_plain.py``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from engine.executor import GenerationParams, plain_generate
from engine.fill import proposal as fp
from engine.fill.echo import EchoSource
from engine.fill.proposal import (
    FillAlignmentError,
    FillRefused,
    Proposal,
    TokenView,
    check_events,
    cut_at_eos,
    fill_generate,
)
from engine.fill.strict import NAME_PROBE, Row, ScaffoldPlan, StrictSource, check_rows, compile_rows
from engine.sampler import SamplerParams
from zoo import fill as zf


class Scripted:
    """A source that proposes ``make(view)`` once per output position (tests only)."""

    name = "scripted"

    def __init__(self, make: Any, policy: str = "assert", at: int | None = None) -> None:
        self.make, self.policy, self.at = make, policy, at
        self.policies = frozenset({policy})
        self.fired: set[int] = set()

    def propose(self, view: TokenView) -> Proposal | None:
        pos = len(view.emitted)
        if pos in self.fired or (self.at is not None and pos != self.at):
            return None
        ids = self.make(view)
        if ids is None:
            return None
        self.fired.add(pos)
        return Proposal(tuple(ids), self.policy, "scripted")  # type: ignore[arg-type]


PARAMS = GenerationParams(max_tokens=40, eos_ids=(zf.EOS_ID,), cache_digests=False)


@pytest.fixture(scope="module")
def xml() -> dict[str, Any]:
    conv = zf.conversation_by_id("fill-01")
    model = zf.load("xml")
    ids = zf.prompt_ids("xml", conv)
    plain = plain_generate(model, ids, PARAMS)
    return {"conv": conv, "model": model, "ids": ids, "plain": plain.output_ids, "tok": zf.tokenizer("xml")}


# ----------------------------------------------------------------------- interface, spans


def test_proposal_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="policy must be one of"):
        Proposal((1, 2), "maybe", "x")  # type: ignore[arg-type]


def test_cut_at_eos_keeps_ids_before_the_first_eos() -> None:
    assert cut_at_eos([5, 6, 1, 7, 1], [1]) == (5, 6)
    assert cut_at_eos([5, 6], [1]) == (5, 6)
    assert cut_at_eos([1, 5], [1, 9]) == ()


def test_check_events_names_the_eos_position_and_short_spans() -> None:
    ev = [{"event": 0, "origin": "echo:2", "position": 7, "ids": [4, 5, 1, 6]},
          {"event": 1, "origin": "strict:close", "position": 20, "ids": [3]}]
    problems = check_events(ev, [1])
    assert any("append 0" in p and "span index 2" in p and "output position 9" in p for p in problems), problems
    assert any("append 1" in p and "shorter than 2" in p for p in problems), problems
    assert check_events([{"event": 0, "origin": "x", "position": 0, "ids": [4, 5]}], [1]) == []


def test_refusals() -> None:
    src = StrictSource(ScaffoldPlan((), frozenset()))
    with pytest.raises(FillRefused, match="compiled grammar"):
        fill_generate(None, [1, 2], replace(PARAMS, grammar=object()), [src])
    hot = GenerationParams(max_tokens=4, sampler=SamplerParams(temperature=0.7), seed=3)
    with pytest.raises(FillRefused, match="user-fixed seed at temperature 0.7"):
        fill_generate(None, [1, 2], hot, [src], user_seed=True)
    # a verify-only source keeps the seed's meaning (it never skips the sampler): not refused here
    fp.check_refusals([EchoSource(assert_corroborated=False)], hot, user_seed=True)
    fp.check_refusals([src], hot, user_seed=False)


def test_span_shorter_than_two_ids_is_rejected(xml: dict[str, Any]) -> None:
    plain = xml["plain"]
    src = Scripted(lambda v: plain[len(v.emitted) : len(v.emitted) + 1], at=3)
    res = fill_generate(xml["model"], xml["ids"], PARAMS, [src])
    assert res.stats.rejected_short == 1 and res.stats.appends == 0, res.stats
    assert res.output_ids == plain


def test_assert_span_of_the_models_own_ids_is_token_identical(xml: dict[str, Any]) -> None:
    plain = xml["plain"]
    src = Scripted(lambda v: plain[len(v.emitted) : len(v.emitted) + 5], at=2)
    res = fill_generate(xml["model"], xml["ids"], PARAMS, [src])
    assert res.stats.appends == 1 and res.stats.asserted == 5 and res.stats.wasted_samples == 1, res.stats
    assert res.output_ids == plain, zf.first_divergence(plain, res.output_ids)
    # one forward carried five ids: four forwards saved
    assert res.stats.forwards == len(plain) + 1 - 4


def test_span_is_cut_at_the_first_eos(xml: dict[str, Any]) -> None:
    plain = xml["plain"]
    src = Scripted(lambda v: [*plain[len(v.emitted) : len(v.emitted) + 3], zf.EOS_ID, 40, 41], at=1)
    res = fill_generate(xml["model"], xml["ids"], PARAMS, [src])
    assert res.stats.eos_cuts == 1 and res.events[0]["ids"] == plain[1:4], res.events
    assert check_events(res.events, [zf.EOS_ID]) == []
    assert res.output_ids == plain


def test_planted_missing_eos_cut_is_caught(xml: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    plain = xml["plain"]
    monkeypatch.setattr(fp, "cut_at_eos", lambda ids, eos: tuple(ids))  # the plant
    src = Scripted(lambda v: [*plain[len(v.emitted) : len(v.emitted) + 3], zf.EOS_ID, 40, 41], at=1)
    res = fill_generate(xml["model"], xml["ids"], PARAMS, [src])
    problems = check_events(res.events, [zf.EOS_ID])
    assert problems and "append 0" in problems[0] and "output position 4" in problems[0], problems
    # and the identity gate sees the turn ended for the model
    assert zf.first_divergence(plain, res.output_ids) == 4 and res.usage.finish_reason == "stop"


def test_alignment_holds_on_both_sides_of_every_append(xml: dict[str, Any]) -> None:
    plain = xml["plain"]
    src = Scripted(lambda v: plain[len(v.emitted) : len(v.emitted) + 4])
    res = fill_generate(xml["model"], xml["ids"], PARAMS, [src])
    assert res.stats.appends >= 3
    for ev in res.events:  # after the append the cache holds the prompt + every id emitted so far
        assert ev["offset_after"] == len(xml["ids"]) + ev["position"] + ev["kept"], ev
    assert res.output_ids == plain


def test_planted_duplicated_trigger_is_caught(xml: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    plain = xml["plain"]
    monkeypatch.setattr(fp, "span_input", lambda trigger, ids: [trigger, *ids])  # the plant
    src = Scripted(lambda v: plain[len(v.emitted) : len(v.emitted) + 4], at=5)
    with pytest.raises(FillAlignmentError, match=r"after append 0 \(scripted, output position 5\): "
                                                 r"cache offset (\d+) != prompt"):
        fill_generate(xml["model"], xml["ids"], PARAMS, [src])


# ----------------------------------------------------------------------- verify policy


def test_verify_never_changes_tokens(xml: dict[str, Any]) -> None:
    plain = xml["plain"]

    def wrong_middle(v: TokenView) -> list[int]:
        ids = list(plain[len(v.emitted) : len(v.emitted) + 5])
        if len(ids) >= 3:
            ids[2] = (ids[2] + 1) % zf.VOCAB_SIZE
        return ids

    def wrong_first(v: TokenView) -> list[int]:
        ids = list(plain[len(v.emitted) : len(v.emitted) + 4])
        return [(ids[0] + 1) % zf.VOCAB_SIZE, *ids[1:]] if ids else []

    for make, field in ((wrong_middle, "verify_rejected"), (wrong_first, "verify_first_rejected")):
        res = fill_generate(xml["model"], xml["ids"], PARAMS, [Scripted(make, "verify")])
        assert res.output_ids == plain, (make.__name__, zf.first_divergence(plain, res.output_ids))
        assert getattr(res.stats, field) > 0, res.stats  # the wrong guesses were really made


def test_recurrent_caches_take_assert_fills_and_drop_verify() -> None:
    """qwen35 (gated-DeltaNet ArraysCache + KVCache): an assert span advances the recurrent
    state in one forward; a verify span cannot be trimmed off it, so it is dropped and counted
    (§7.1 ``verifyUnsupported``), never applied."""
    from mlx_lm.utils import load_model

    import zoo

    model = load_model(zoo.model_dir("qwen35"))[0]
    ids = list(zoo.prompts()[0].token_ids)
    params = GenerationParams(max_tokens=24, cache_digests=False)
    plain = plain_generate(model, ids, params).output_ids

    def own(v: TokenView) -> list[int] | None:
        n = len(v.emitted)
        return None if n % 5 else plain[n : n + 4]

    res = fill_generate(model, ids, params, [Scripted(own, "assert")])
    assert res.output_ids == plain and res.stats.appends == 5, res.stats
    res = fill_generate(model, ids, params, [Scripted(own, "verify")])
    assert res.output_ids == plain and res.stats.appends == 0 and res.stats.verify_unsupported == 5, res.stats


# ----------------------------------------------------------------------- echo index


def test_echo_branch_stop_and_corroboration() -> None:
    src = EchoSource(k=2, delimiters=[9])
    # one earlier occurrence of (1, 2): a copy, not a pattern -> verify, runs to the context end
    p = src.propose(TokenView((1, 2, 3, 4, 5, 1, 2), ()))
    assert p is not None and p.policy == "verify" and p.ids == (3, 4, 5, 1, 2), p
    # two occurrences agree on (3, 9) then fork (5 vs 6): assert, clamped at the delimiter
    src = EchoSource(k=2, delimiters=[9])
    p = src.propose(TokenView((1, 2, 3, 9, 5, 0, 1, 2, 3, 9, 6, 0, 1, 2), ()))
    assert p is not None and p.policy == "assert" and p.ids == (3, 9), p
    # forked immediately: nothing to propose
    src = EchoSource(k=2)
    assert src.propose(TokenView((1, 2, 3, 1, 2, 4, 1, 2), ())) is None
    # no delimiter in the agreed span: verify
    src = EchoSource(k=2, delimiters=[9])
    p = src.propose(TokenView((1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2), ()))
    assert p is not None and p.policy == "verify" and p.ids == (3, 4), p


def test_echo_index_grows_incrementally_and_resets() -> None:
    src = EchoSource(k=2)
    assert src.propose(TokenView((1, 2, 3), ())) is None
    p = src.propose(TokenView((1, 2, 3), (7, 1, 2)))
    assert p is not None and p.ids == (3, 7, 1, 2), p
    assert src.propose(TokenView((5, 6), ())) is None  # a new request rebuilds the index


# ----------------------------------------------------------------------- strict compiler


def _real_call_ids(tok: Any, conv: Any, name: str, value: str) -> list[int]:
    from engine.fill.strict import _call, _Renderer, required_of

    r = _Renderer(tok, conv.messages, conv.tools)
    tool = next(t for t in conv.tools if t["function"]["name"] == name)
    turn = r.turn(_call(name, dict.fromkeys(required_of(tool), value)))
    assert turn is not None
    return list(turn)


@pytest.mark.parametrize("syntax", zf.SYNTAXES)
def test_strict_rows_are_id_contained_and_follow_the_schema(syntax: str) -> None:
    tok = zf.tokenizer(syntax)
    for conv in zf.prompts():
        plan = compile_rows(tok, conv.messages, conv.tools, eos_ids=[zf.EOS_ID])
        assert plan.rows, (conv.id, plan.reason)
        assert check_rows(plan, tok) == [], conv.id
        kinds = [r.kind for r in plan.rows]
        assert kinds[0] == "scaffold" and tok.decode(list(plan.rows[0].trigger)) == "<tool_call>"
        one_arg = all(len(t["function"]["parameters"]["required"]) == 1 for t in conv.tools)
        # a close row only when every tool takes exactly one required argument (XML: JSON's
        # close has no letter-carrying anchor before the end of the turn)
        assert ("close" in kinds) == (one_arg and syntax == "xml"), (conv.id, kinds)
        for r in plan.rows:
            assert zf.EOS_ID not in r.ids and len(r.ids) >= 2


def test_xml_merged_name_token_stays_in_the_scaffold() -> None:
    tok = zf.tokenizer("xml")
    # context vs isolation: '=get' is one id inside <function=...>, 'get' alone in isolation
    assert tok.convert_ids_to_tokens(tok.encode("<function=get_weather>"))[1] == "=get"
    assert tok.convert_ids_to_tokens(tok.encode("get_weather"))[0] == "get"
    conv = zf.Conversation("t", ({"role": "user", "content": "Weather in Oslo?"},), (zf.TOOLS["get_weather"],))
    plan = compile_rows(tok, conv.messages, conv.tools, eos_ids=[zf.EOS_ID])
    scaffold = [tok.decode([t]) for t in plan.rows[0].ids]
    assert "=get" in scaffold and scaffold[-1] == ">\n", scaffold


def test_no_rows_when_the_template_does_not_render_calls() -> None:
    tok = zf.tokenizer("xml")

    class NoCalls:
        def apply_chat_template(self, conversation: Any, **kw: Any) -> Any:
            msgs = [dict(m, tool_calls=None) for m in conversation]
            return tok.apply_chat_template(msgs, **kw)

        def encode(self, text: str, **kw: Any) -> list[int]:
            return list(tok.encode(text, **kw))

        def decode(self, ids: Any, **kw: Any) -> str:
            return str(tok.decode(ids, **kw))

    conv = zf.prompts()[0]
    plan = compile_rows(NoCalls(), conv.messages, conv.tools, eos_ids=[zf.EOS_ID])
    assert plan.rows == () and "does not render" in plan.reason


def probe_boundary_plan(tok: Any, conv: Any, name: str) -> ScaffoldPlan:
    """The planted probe-name bug: the scaffold is cut where the NAME begins in a call
    rendered with a probe name, and its ids are sliced from that PROBE rendering: it ends in
    a bare '=' (``… = zzalpha…``), a boundary the real name's merged '=get' never has."""
    real = _real_call_ids(tok, conv, name, "Qz")
    probe_tool = {"type": "function", "function": {**conv.tools[0]["function"], "name": NAME_PROBE}}
    probe = _real_call_ids(tok, zf.Conversation("probe", conv.messages, (probe_tool,)), NAME_PROBE, "Qz")
    name_at = next(i for i, t in enumerate(probe) if tok.decode(probe[: i + 1]).endswith("="))
    rows = (Row("scaffold", None, tuple(probe[:1]), tuple(probe[1 : name_at + 1]), name, 0),)
    return ScaffoldPlan(rows, frozenset(), {name: tuple(real)})


def test_planted_probe_name_boundary_is_caught_by_id_containment() -> None:
    tok = zf.tokenizer("xml")
    conv = zf.Conversation("t", ({"role": "user", "content": "Weather in Oslo?"},), (zf.TOOLS["get_weather"],))
    plan = probe_boundary_plan(tok, conv, "get_weather")
    # text containment would pass: the rows' text IS the real rendering's text
    real_text = tok.decode(list(plan.renderings["get_weather"]))
    assert all(tok.decode([*r.trigger, *r.ids]) in real_text for r in plan.rows)
    problems = check_rows(plan, tok)
    assert problems, "the id-containment gate missed the probe-name boundary"
    assert "row 0 (scaffold)" in problems[0] and "text-identical, ids divergent" in problems[0], problems
    assert "row id" in problems[0] and "'='" in problems[0] and "'=get'" in problems[0], problems[0]


# ----------------------------------------------------------------------- harness and report


def test_paired_interval() -> None:
    from reports.fill import paired_interval

    assert paired_interval([10, 10], [7, 7]) == (3.0, 3.0, 3.0)  # every pair saves the same
    mean, lo, hi = paired_interval([10, 20, 30, 25], [8, 12, 30, 20])
    assert mean == 3.75 and lo < mean < hi and lo < 0  # one pair saved nothing: the bound says so


def test_run_summary_reports_fill_cases_and_fails_a_divergent_one(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from specparity.jobs.run import run_cases, zoo_cases

    zc = zoo_cases(targets=["llama"], drafters=["self"], gammas=(3,), n_prompts=1, max_tokens=4)
    cases = [zf.FillCase("xml", "strict", "fill-05"), zf.FillCase("xml", "echo", "fill-05"),
             zf.FillCase("xml", "strict", "fill-05", temperature=0.8)]
    res = run_cases(tmp_path / "ok", cases=zc, runners=["engine"], fill_cases=cases, progress=False)
    text = (tmp_path / "ok" / "summary.md").read_text()
    assert res.ok and "## Token fast-forwarding (fill, §7)" in text, text
    assert "| strict | xml      |    0   |       1 | 1 identical" in text, text
    assert "1 deviation" in text and (tmp_path / "ok" / "fill.json").is_file()
    # a planted bad row (the '=get' id replaced by a bare '='): the run fails, position named
    real = zf.sources_for

    def planted(tier: str, syntax: str, conv: Any, plan: Any = None) -> list[Any]:
        good = zf.plan_for(syntax, conv)
        tok = zf.tokenizer(syntax)
        rows = [Row(r.kind, r.tool, r.trigger, tuple(t if tok.decode([t]) != "=get" else
                                                     tok.encode("=", add_special_tokens=False)[0]
                                                     for t in r.ids), r.tool)
                for r in good.rows]
        return [StrictSource(ScaffoldPlan(tuple(rows), good.delimiters, good.renderings))] \
            if tier == "strict" else real(tier, syntax, conv, plan)

    monkeypatch.setattr(zf, "sources_for", planted)
    res = run_cases(tmp_path / "bad", cases=zc, runners=["engine"], fill_cases=cases[:1], progress=False)
    text = (tmp_path / "bad" / "summary.md").read_text()
    assert not res.ok and "fill diverges from plain decode at output token 3" in text, text


def test_close_row_waits_for_the_complete_delimiter() -> None:
    """§7.4: a close trigger ending at ``</parameter`` fires inside a value that goes on as
    ``</parameterization>``; ours runs through the ``>`` and the newline, so it waits."""
    tok = zf.tokenizer("xml")
    conv = zf.Conversation("t", ({"role": "user", "content": "Weather in Oslo?"},), (zf.TOOLS["get_weather"],))
    plan = compile_rows(tok, conv.messages, conv.tools, eos_ids=[zf.EOS_ID])
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"

    def fired(src: StrictSource, text: str) -> Proposal | None:
        return src.propose(TokenView((), tuple(tok.encode(head + text, add_special_tokens=False))))

    close = next(r for r in plan.rows if r.kind == "close")
    assert fired(StrictSource(plan), "</parameter") is None  # could still be </parameterization>
    done = fired(StrictSource(plan), "</parameter>\n")
    assert done is not None and done.origin == "strict:close"
    assert tok.decode(list(done.ids)) == "</function>\n</tool_call>"
    # the short trigger of §7.4 (planted) does fire before the delimiter is complete
    short = ScaffoldPlan((Row("close", None, close.trigger[:2], close.ids),), plan.delimiters)
    assert tok.decode(list(close.trigger[:2])) == "</parameter"
    assert fired(StrictSource(short), "</parameter") is not None


def test_the_cli_zoo_matrix_carries_the_fill_cases(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import specparity.jobs.run
    from specparity.cli import main

    calls: list[dict[str, Any]] = []

    class Started(Exception):
        pass

    def run(out: Any, **kwargs: Any) -> None:
        calls.append(kwargs)
        raise Started

    monkeypatch.setattr(specparity.jobs.run, "run", run)
    for argv in (["--temps", "0,0.8"], ["--targets", "llama"]):
        main(["run", "--out", str(tmp_path / "o"), *argv])  # the stub stops the job once called
    default, narrowed = calls
    cells = {(c.syntax, c.tier, c.temperature) for c in default["fill_cases"]}
    assert cells == {(s, t, temp) for s in zf.SYNTAXES for t in zf.TIERS for temp in (0.0, 0.8)}
    assert len(default["fill_cases"]) == 2 * 2 * 2 * zf.MATRIX_PROMPTS
    assert narrowed["fill_cases"] is None  # --targets picks pairs of the spec matrix only


def test_fill_models_are_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    import copy

    man = copy.deepcopy(zf.manifest())
    man["models"]["fill-xml"]["weights_sha256"] = "0" * 64
    monkeypatch.setattr(zf, "manifest", lambda: man)
    zf._verified.cache_clear()
    try:
        with pytest.raises(zf.FillDriftError, match="fill-xml: model.safetensors .* manifest expects 0000"):
            zf._verified("fill-xml")
        man["models"]["fill-xml"]["spec"] = {**man["models"]["fill-xml"]["spec"], "steps": 1}
        with pytest.raises(zf.FillDriftError, match="its spec differs"):
            zf._verified("fill-xml")
    finally:
        zf._verified.cache_clear()
