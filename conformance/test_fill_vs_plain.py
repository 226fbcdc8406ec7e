"""Conformance gates of token fast-forwarding on the zoo fill models (§7 of
``speculative-decoding.md``; the unit tests and most plants are ``tests/test_fill.py``).

- strict tier at temperature 0: token-identical to ordinary generation (id
  containment, not text containment), rows really firing;
- the verify policy (echo tier, verify only) never changes a token;
- stop sequences fire mid-burst exactly where plain decode stops;
- at temperature > 0 an assert fill is reported as the behaviour-policy
  deviation §7 names, never compared as identity;
- planted: a close row on a request with a two-argument tool drops a parameter,
  and a probe-name boundary row changes the ids, each caught at the output
  position named.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.executor import GenerationParams, plain_generate
from engine.fill.echo import EchoSource
from engine.fill.proposal import check_events, fill_generate
from engine.fill.strict import Row, ScaffoldPlan, StrictSource
from zoo import fill as zf

PROMPTS = [c.id for c in zf.prompts()]


@pytest.mark.parametrize("syntax", zf.SYNTAXES)
def test_strict_tier_is_token_identical_at_temperature_0(syntax: str) -> None:
    injected = 0
    for pid in PROMPTS:
        res = zf.run_case(zf.FillCase(syntax, "strict", pid))
        assert res["verdict"] == "identical", res["message"]
        assert check_events(res["events"], [zf.EOS_ID]) == [], res["case_id"]
        assert res["fill_tokens"] == res["plain_forwards"], res["case_id"]  # same accounting
        # every injected id saved a forward, every append cost one
        assert res["fill_forwards"] == res["plain_forwards"] - res["stats"]["injected"] + res["stats"]["appends"]
        injected += res["stats"]["injected"]
    assert injected > 0, f"{syntax}: no strict row fired on any prompt (the gate would be vacuous)"


@pytest.mark.parametrize("syntax", zf.SYNTAXES)
def test_echo_verify_never_changes_tokens(syntax: str) -> None:
    accepted = 0
    for pid in PROMPTS:
        conv = zf.conversation_by_id(pid)
        res = zf.run_case(zf.FillCase(syntax, "echo", pid),
                          sources=[EchoSource(assert_corroborated=False)])
        del conv
        assert res["verdict"] == "identical", res["message"]
        accepted += res["stats"]["verify_accepted"]
    assert accepted > 0, f"{syntax}: the echo tier never verified a span (the gate would be vacuous)"


@pytest.mark.parametrize("syntax", zf.SYNTAXES)
def test_stop_sequence_fires_mid_burst_where_plain_stops(syntax: str) -> None:
    model, tok = zf.load(syntax), zf.tokenizer(syntax)
    checked = 0
    for pid in PROMPTS:
        conv = zf.conversation_by_id(pid)
        ids = zf.prompt_ids(syntax, conv)
        base = zf.run_case(zf.FillCase(syntax, "strict", pid))
        ev = next((e for e in base["events"] if e["kept"] >= 3), None)
        if ev is None:
            continue
        stop = tuple(ev["ids"][:2])  # completes at the burst's second id: mid-burst
        at = ev["position"] + 1
        assert tuple(base["fill_ids"][at - 1 : at + 1]) == stop
        first = next(i for i in range(1, len(base["fill_ids"]))
                     if tuple(base["fill_ids"][i - 1 : i + 1]) == stop)
        params = GenerationParams(max_tokens=48, eos_ids=(zf.EOS_ID,), cache_digests=False,
                                  stop_sequences=(stop,))
        plain = plain_generate(model, ids, params)
        filled = fill_generate(model, ids, params, zf.sources_for("strict", syntax, conv))
        assert filled.output_ids == plain.output_ids, (pid, zf.first_divergence(plain.output_ids, filled.output_ids))
        assert len(filled.output_ids) == first + 1 and filled.usage.finish_reason == "stop"
        fired = [e for e in filled.events if e["position"] < len(filled.output_ids) < e["position"] + e["kept"]]
        if first == at:
            assert fired, f"{pid}: the stop {tok.decode(list(stop))!r} did not fire inside a burst"
        checked += bool(fired)
    assert checked > 0, "no stop sequence fired mid-burst (the gate would be vacuous)"


@pytest.mark.parametrize("syntax", zf.SYNTAXES)
def test_assert_fill_at_temperature_above_0_is_a_deviation_not_identity(syntax: str) -> None:
    verdicts = set()
    for pid in PROMPTS[:6]:
        res = zf.run_case(zf.FillCase(syntax, "strict", pid, temperature=0.8))
        verdicts.add(res["verdict"])
        assert res["verdict"] in ("deviation", "not-compared"), res
        if res["stats"]["asserted"]:
            assert res["verdict"] == "deviation" and "behaviour-policy deviation" in res["message"]
    assert "deviation" in verdicts, f"{syntax}: no assert fill fired at temperature 0.8"


def _calls_search_web(syntax: str) -> tuple[str, dict[str, Any]]:
    for pid in PROMPTS:
        res = zf.run_case(zf.FillCase(syntax, "strict", pid))
        text = zf.tokenizer(syntax).decode(res["plain_ids"])
        if "search_web" in text and "limit" in text:
            return pid, res
    pytest.skip(f"no held-out prompt makes fill-{syntax} call search_web")


def test_planted_close_row_with_two_required_arguments_drops_a_parameter() -> None:
    syntax = "xml"
    pid, base = _calls_search_web(syntax)
    conv = zf.conversation_by_id(pid)
    tok = zf.tokenizer(syntax)
    plan = zf.plan_for(syntax, conv)
    assert not any(r.kind == "close" for r in plan.rows), "a close row beside a two-argument tool"
    # the plant: the close row a one-argument request would get, injected anyway
    single = zf.plan_for(syntax, zf.Conversation("one", conv.messages, (zf.TOOLS["get_weather"],)))
    close = next(r for r in single.rows if r.kind == "close")
    bad = ScaffoldPlan((*plan.rows, close), plan.delimiters, plan.renderings)
    res = zf.run_case(zf.FillCase(syntax, "strict", pid), sources=[StrictSource(bad)])
    assert res["verdict"] == "divergent", "the identity gate missed the dropped parameter"
    ev = next(e for e in res["events"] if e["origin"] == "strict:close")
    assert res["position"] == ev["position"] and f"output token {ev['position']}" in res["message"], res["message"]
    assert "inside append" in res["message"] and "strict:close" in res["message"]
    assert "<parameter=limit>" in tok.decode(base["plain_ids"])
    assert "<parameter=limit>" not in tok.decode(res["fill_ids"])  # the parameter was dropped


def test_planted_probe_name_boundary_changes_the_ids() -> None:
    syntax = "xml"
    tok = zf.tokenizer(syntax)
    for pid in PROMPTS:
        conv = zf.conversation_by_id(pid)
        if len(conv.tools) != 1 or len(conv.tools[0]["function"]["parameters"]["required"]) != 1:
            continue
        good = zf.plan_for(syntax, conv)
        scaffold = good.rows[0]
        cut = next(i for i, t in enumerate(scaffold.ids) if tok.decode([t]).startswith("="))
        base = zf.run_case(zf.FillCase(syntax, "strict", pid))
        if tok.decode([scaffold.ids[cut]]) == "=" or not any(
                e["origin"] == "strict:scaffold" for e in base["events"]):
            continue  # the name's first id is not merged with '=', or the model wrote no call
        # the plant: the probe-name boundary: '=get' replaced by a bare '=' (byte-identical text
        # once the model writes 'get', divergent ids)
        bare = tuple(tok.encode("=", add_special_tokens=False))
        bad_row = Row("scaffold", None, scaffold.trigger, (*scaffold.ids[:cut], *bare), None)
        bad = ScaffoldPlan((bad_row,), good.delimiters, good.renderings)
        res = zf.run_case(zf.FillCase(syntax, "strict", pid), sources=[StrictSource(bad)])
        assert res["verdict"] == "divergent", "the identity gate missed the probe-name boundary"
        ev = res["events"][0]
        assert res["position"] == ev["position"] + cut, res["message"]
        assert f"output token {res['position']}" in res["message"]
        assert "inside append 0 (strict:scaffold" in res["message"], res["message"]
        return
    pytest.skip("no held-out prompt with one one-argument tool")
