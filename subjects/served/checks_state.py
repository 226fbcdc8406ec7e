"""The checks of state across requests: cache, concurrency, seeded, tools, reject, leak.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from subjects.checks import first_divergence
from subjects.failure_causes import TRANSPORT, classify_error
from subjects.http_client import HttpClient, ServerDown, ServerError
from subjects.served.cells import CannotGrade, Finding, Unsupported
from subjects.served.counters import SpecCounters, metrics
from subjects.served.ctx import Ctx, server_down
from subjects.served.declare import check
from subjects.served.plan import (
    CACHE_ROUNDS,
    CONCURRENT,
    MAX_BUDGET,
    REJECT_MAX_ACCEPT,
    SEED,
    SEED_BURSTS,
    SEED_TEMPERATURE,
    TOOL,
    TOP_K,
    PromptInfo,
    stop_cases,
)
from subjects.served.reference import (
    LOGPROB_ATOL,
    LOGPROB_RTOL,
    Reference,
    compare,
    logprob_close,
    loose,
    strip_eos,
    text_diff,
    text_tail,
)
from subjects.served.wire import Reply, Request, send
from traces.diff import common_prefix


def _hit(ctx: Ctx, req: Request, r: Reply, n_prompt: int, need: int, what: str) -> str | None:
    """CannotGrade when the server's usage shows the hit meant was not made; a note when unverifiable."""
    if not ctx.require_hits:
        return None
    u = r.usage or {}
    pt = u.get("prompt_tokens")
    if pt is not None and pt != n_prompt:
        raise CannotGrade(f"{what}: the server counted {pt} prompt tokens, {n_prompt} were sent: not the request "
                          "meant")
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        return "hit unverified (no cached_tokens)"
    if not isinstance(cached, int) or cached < need:
        raise CannotGrade(f"{what}: the server reused {cached!r} cached tokens, the case needs ≥ {need}: the warm "
                          "path was not exercised")
    return None


@check("cache", title="warm = cold", needs=(2, 0), gated=True, server="cache-on")
def check_cache(ctx: Ctx) -> str:
    ref, ps = ctx.ref, ctx.plan.no_eos("cache")
    if not ps:
        with ctx.case("cache"):
            raise Unsupported("no unused prompt for a cold request")
        return ""
    p = ps[0]
    notes: set[str] = set()
    cold_reply: Reply | None = None
    cold_built = list(p.ids)
    with ctx.case("cache: cold"):
        req, cold_reply = ctx.ask_ids(p.ids, 17, tag="cache: cold", logprobs=True)
        cold_built = ref.prompt_ids(req)  # the prompt the server completed (a declared wrapping applied)
        why = compare(ref, cold_reply, ref.expect(req)[0], exact=False)
        if why:
            raise Finding(req, f"first (cold) request: {why}")
    # the cold request failed: the warm cases still run (every case runs), against plain decode
    out = (strip_eos(ref, cold_reply.ids) if cold_reply is not None else None) or p.out[:17]
    other = ps[1].ids if len(ps) > 1 else p.out[17:20]
    body = list(other[1:]) if ref.bos_id is not None and other and other[0] == ref.bos_id else list(other)
    plan = [  # (case, ids sent, the cached tokens it needs given the prompt the server builds from them)
        ("cache: repeated identical request", list(p.ids), lambda b: len(b) - 1),
        ("cache: shared-prefix follow-up", list(p.ids) + body, lambda b: max(1, common_prefix(b, cold_built) - 1)),
        ("cache: exact continuation (prompt ids + the server's completion ids)", list(p.ids) + list(out),
         lambda b: len(cold_built) + 1),  # more than the cold prompt: its generated tokens reused
    ]
    for rnd in range(CACHE_ROUNDS):  # each property over many requests, with and without the optional field
        lp = rnd % 2 == 0
        for kind, ids, need in plan:
            tag = f"{kind} [{rnd + 1}/{CACHE_ROUNDS}, {'with' if lp else 'without'} logprobs]"
            with ctx.case(tag):
                req, r = ctx.ask_ids(ids, 17, tag=tag, logprobs=lp)
                built = ref.prompt_ids(req)
                note = _hit(ctx, req, r, len(built), need(built), tag)
                if note:
                    notes.add(note)
                want, _ = ref.greedy(tuple(built), 17)
                why = compare(ref, r, want, exact=False)  # lengths are the budget check's
                if why:
                    raise Finding(req, f"warm != cold plain decode ({'with' if lp else 'without'} logprobs): {why}")
    n_warm = len(plan) * CACHE_ROUNDS
    warm = ctx.cases[-n_warm:]
    if all(c.status == "cannot-grade" for c in warm) and ctx.cases[-n_warm - 1].status == "pass":
        ctx.cases.pop(-n_warm - 1)  # the cold request alone tests no cache: not credited
    return (f"repeated, shared-prefix and continuation requests (by token id), {CACHE_ROUNDS} rounds with and "
            "without logprobs = cold plain decode") + (
        "; " + "; ".join(sorted(notes)) if notes else "")


def _together(client: HttpClient, reqs: Sequence[Request]
              ) -> tuple[dict[int, Reply | BaseException], dict[int, tuple[float, float]]]:
    """Send ``reqs`` from one thread each, released together; each reply and its (sent, answered) times."""
    results: dict[int, Reply | BaseException] = {}
    times: dict[int, tuple[float, float]] = {}
    gate = threading.Barrier(len(reqs))

    def go(i: int, req: Request) -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            gate.wait(10)
        t0 = time.monotonic()
        try:
            results[i] = send(client, req)
        except BaseException as exc:  # noqa: BLE001 - reported with its request
            results[i] = exc
        times[i] = (t0, time.monotonic())

    threads = [threading.Thread(target=go, args=(i, r), daemon=True) for i, r in enumerate(reqs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(client.limits.deadline + 15)
    return results, times


def _overlapping(ctx: Ctx, reqs: Sequence[Request], what: str) -> dict[int, Reply | BaseException] | None:
    """``reqs`` sent together until they were in flight together (every one sent before any was
    answered; 3 tries): their replies, or None (a cannot-grade case recorded as ``what``)."""
    for _try in range(3):
        results, times = _together(ctx.client, reqs)
        ctx.n_requests += len(reqs)
        for i, req in enumerate(reqs):
            res = results.get(i)
            if res is None or isinstance(res, ServerDown):
                raise server_down(req, res or "no answer")
        if len(times) == len(reqs) and max(t[0] for t in times.values()) < min(t[1] for t in times.values()):
            return results
    with ctx.case(what):
        raise CannotGrade(f"the {len(reqs)} requests were not in flight together (one was answered before the "
                          "last was sent, 3 tries)")
    return None


@check("concurrency", title="batch-mates", needs=(CONCURRENT, 0), gated=True)
def check_concurrency(ctx: Ctx) -> str:
    ref, ps = ctx.ref, ctx.plan.no_eos("concurrency")
    reqs = [Request(p.text, 17, logprobs=True, tag=f"concurrent {i + 1}/{len(ps)}") for i, p in enumerate(ps)]
    if len(reqs) < 2:
        with ctx.case("concurrency"):
            raise Unsupported("fewer than 2 prompts")
        return ""
    results = _overlapping(ctx, reqs, "concurrency: requests in flight together")
    if results is None:
        return ""
    for i, req in enumerate(reqs):
        with ctx.case(req):
            res = results[i]
            if isinstance(res, BaseException):
                raise ctx.verdict_on(req, res)
            ctx.last = res
            why = compare(ref, res, ps[i].out[:17], exact=False)
            if why:
                raise Finding(req, f"B-invariance: logic (no numerics witness over HTTP): sent with {len(reqs) - 1} "
                                   f"others in flight: {why}")
    return f"B-invariance holds (identical): {len(reqs)} requests in flight together: each = plain decode"


def _out(ref: Reference, r: Reply) -> list[int] | str:
    """A reply's output: its ids (without a final EOS) where it returned them, else its text."""
    ids = strip_eos(ref, r.ids)
    return ids if ids is not None else loose(r.text)


def same_reply(ref: Reference, a: Reply, b: Reply, an: str, bn: str, *, logprobs: bool = True) -> str | None:
    """Why two of the server's replies to the same request differ (None when they agree): the
    output (ids where both have them, else the text), finish_reason, and each emitted token's
    logprob within the logprobs check's tolerance."""
    oa, ob = _out(ref, a), _out(ref, b)
    if isinstance(oa, list) and isinstance(ob, list):
        i = first_divergence(oa, ob)
        if i is not None:
            x = oa[i] if i < len(oa) else "<end>"
            y = ob[i] if i < len(ob) else "<end>"
            return f"output token {i}: {an} id {x} vs {bn} id {y} ({an} {len(oa)} tokens, {bn} {len(ob)})"
    elif loose(a.text) != loose(b.text):
        return "text " + text_diff(loose(a.text), loose(b.text), an, bn)
    if a.finish_reason != b.finish_reason:
        return f"finish_reason {an} {a.finish_reason!r} vs {bn} {b.finish_reason!r}"
    if logprobs and a.logprobs and b.logprobs:
        for i, (x, y) in enumerate(zip(a.logprobs, b.logprobs, strict=False)):
            if not logprob_close(x.logprob, y.logprob):
                return (f"token {i}: logprob {an} {x.logprob:.5f} vs {bn} {y.logprob:.5f} (tolerance "
                        f"{LOGPROB_ATOL:g} + {LOGPROB_RTOL:.4g}·|lp|)")
    return None


def _logits_moved(ctx: Ctx, req: Request, r: Reply) -> str | None:
    """Why ``r``'s logprobs for its own (sampled) tokens are not the reference's teacher-forced on
    them (None when they agree, or cannot be told: no ids or logprobs came back). At temperature 1
    a logprob is the model's: a difference means the computation moved, not the draw."""
    ids = r.ids
    if not ids or not r.logprobs:
        return None
    want = ctx.ref.logprobs(tuple(ctx.ref.prompt_ids(req)), tuple(ids), 1)
    for i, (g, (lp, _)) in enumerate(zip(r.logprobs, want, strict=False)):
        if not logprob_close(g.logprob, lp):
            return f"token {i} (id {ids[i]}): logprob {g.logprob:.5f} vs the reference {lp:.5f}"
    return None


@check("seeded", title="seeded + batch-mates", needs=(CONCURRENT, 0))
def check_seeded(ctx: Ctx) -> str:
    """The same seeded request (temperature SEED_TEMPERATURE) alone = with batch-mates in flight:
    the same draws. A burst whose logprobs show the computation itself moved (the concurrency
    check's finding) cannot be graded here."""
    ref, ps = ctx.ref, ctx.plan.no_eos("seeded")
    if len(ps) < 2:
        with ctx.case("seeded"):
            raise Unsupported("fewer than 2 prompts")
        return ""
    kw: dict[str, Any] = {"logprobs": True, "temperature": SEED_TEMPERATURE}
    alone = Request(ps[0].text, 17, seed=SEED, tag="seeded (alone)", **kw)
    a1: Reply | None = None
    with ctx.case("seeded: the request alone, twice"):
        try:
            a1 = ctx.ask(alone, optional="seeded sampling (temperature, seed)")
        except Finding as f:  # logprobs are the logprobs check's: without them, text only
            if "bad response" not in str(f):
                raise
            kw["logprobs"] = False
            alone = Request(ps[0].text, 17, seed=SEED, tag="seeded (alone, no logprobs)", **kw)
            a1 = ctx.ask(alone, optional="seeded sampling (temperature, seed)")
        a2 = ctx.ask(alone, optional="seeded sampling (temperature, seed)")
        why = same_reply(ref, a2, a1, "second", "first", logprobs=False)
        if why:
            raise CannotGrade(f"two identical seeded requests sent alone came back different ({why}): the server's "
                              "seeded sampling is not reproducible, so batch-mates cannot be judged")
        if _out(ref, a1) in (ps[0].out[: len(_out(ref, a1))], loose(ref.decode(ps[0].out[:17]))):
            raise CannotGrade(f"the seeded request at temperature {SEED_TEMPERATURE:g} came back as greedy decode: "
                              "the server ignores temperature (nothing sampled to compare)")
    if a1 is None or ctx.cases[-1].status != "pass":
        return ""
    ctx.cases.pop()  # the request alone tests nothing by itself: not credited
    mates = [Request(p.text, 17, seed=SEED + 1 + i, tag=f"seeded batch-mate {i + 1}", **kw)
             for i, p in enumerate(ps[1:CONCURRENT])]
    for burst in range(SEED_BURSTS):  # several bursts: a server need not batch every one of them
        probe = Request(ps[0].text, 17, seed=SEED, tag=f"seeded (with {len(mates)} batch-mates in flight, burst "
                                                      f"{burst + 1}/{SEED_BURSTS})", **kw)
        results = _overlapping(ctx, [probe, *mates], f"seeded: burst {burst + 1}: requests in flight together")
        if results is None:
            continue
        with ctx.case(probe):
            res = results[0]
            if isinstance(res, BaseException):
                raise ctx.verdict_on(probe, res)
            why = same_reply(ref, res, a1, "with batch-mates", "alone", logprobs=False)
            if why:
                moved = _logits_moved(ctx, probe, res)
                if moved:
                    raise CannotGrade(f"with batch-mates the output differs ({why}), but so do the logprobs of its own "
                                      f"tokens ({moved}): batch-mates changed the computation itself (the concurrency "
                                      "check's finding), so the draws cannot be judged")
                raise Finding(probe, f"seeded invariance: logic: the same seeded request (seed {SEED}, temperature "
                                     f"{SEED_TEMPERATURE:g}) with "
                                     f"{len(mates)} batch-mates in flight draws other tokens than alone (the "
                                     f"logprobs are the model's): {why}")
    return (f"seeded invariance holds (identical): a seeded sampled request with {len(mates)} batch-mates in flight "
            f"({SEED_BURSTS} bursts) = the same request alone")


def _calls(r: Reply) -> list[tuple[str, Any]]:
    """A reply's tool calls as (name, parsed arguments); arguments that are not JSON stay a string."""
    out: list[tuple[str, Any]] = []
    for c in r.tool_calls or []:
        try:
            args: Any = json.loads(c["arguments"]) if c["arguments"] else {}
        except ValueError:
            args = ("not JSON", c["arguments"])
        out.append((c["name"], args))
    return out


def _calls_diff(a: list[tuple[str, Any]], b: list[tuple[str, Any]], an: str, bn: str) -> str | None:
    if a == b:
        return None
    if len(a) != len(b):
        return f"{len(a)} tool call(s) {an} vs {len(b)} {bn}: {a!r:.120} vs {b!r:.120}"
    i = next(k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    (na, xa), (nb, xb) = a[i], b[i]
    if na != nb:
        return f"tool call {i}: name {na!r} {an} vs {nb!r} {bn}"
    sa, sb = json.dumps(xa, sort_keys=True), json.dumps(xb, sort_keys=True)
    return f"tool call {i} ({na}) arguments " + text_diff(sa, sb, an, bn)


@check("tools", title="tool calls spec = plain", needs=(2, 0))
def check_tools(ctx: Ctx) -> str:
    """Tool calls the server parses under speculation = without (the plain arm's, request for request),
    streamed (deltas reassembled) and not; on the plain arm, streamed = non-streamed."""
    ref, ps = ctx.ref, ctx.plan.no_eos("tools")
    if not ref.has_chat_template:
        with ctx.case("tools"):
            raise Unsupported("the model has no chat template: a server builds no tool-call prompt for it")
        return ""
    compared = 0
    for p in ps[:2]:
        same_gen: bool | None = None
        own: list[tuple[str, Any]] | None = None
        for stream in (False, True):
            req = Request(p.text, 17, chat=True, stream=stream, logprobs=not stream, tools=(TOOL,), tag="tools")
            with ctx.case(req):
                r = ctx.ask(req, optional="tools")
                calls = _calls(r)
                if not calls:
                    raise Unsupported(f"no tool call parsed (content {text_tail(r.text)}): the server has no tool parser, "
                                      "or the output holds no call")
                key = f"tools: {req.label}"
                base = ctx.baseline.get(key) if ctx.arm != "plain" else None
                if ctx.arm == "plain":
                    ctx.baseline[key] = (calls, strip_eos(ref, r.ids))
                if not stream:
                    own = calls
                if base is not None:
                    bcalls, bids = base
                    ids = strip_eos(ref, r.ids)
                    if not stream and ids is not None and bids is not None:
                        same_gen = ids == bids
                    if same_gen is False:
                        raise CannotGrade("the spec arm generated other tokens than the plain arm for this request "
                                          "(the identity check's finding): its tool calls cannot be compared")
                    why = _calls_diff(calls, bcalls, "with speculation", "without")
                    if why:
                        raise Finding(req, f"the tool call parsed under speculation differs from the one without: "
                                           f"{why}")
                    compared += 1
                elif stream and own is not None:
                    why = _calls_diff(calls, own, "streamed", "non-streamed")
                    if why:
                        raise Finding(req, f"streamed tool-call deltas reassembled differ from the non-streamed "
                                           f"tool call: {why}")
    if ctx.arm == "plain":
        return "tool calls parsed; streamed = non-streamed (the spec arm is compared with these)"
    if not compared:
        return "tool calls parsed; streamed = non-streamed (no plain arm to compare with)"
    return f"{compared} tool call(s) parsed under speculation = without (streamed and not)"


@check("reject", title="all drafts rejected", needs=(3, 1), gated=True, server="rejecting")
def check_reject(ctx: Ctx) -> str:
    """On a server whose drafter's every draft is rejected (rounds that emit only the target's own
    token): exactly plain decode's tokens (no stray, placeholder or rejected-draft id), usage
    counting exactly those tokens; the server's counters confirm the drafts were rejected."""
    ref = ctx.ref
    if not ctx.reject:
        with ctx.case("reject"):
            raise Unsupported("only on a server started with a drafter whose drafts are all rejected (the grader "
                              "starts one for a spec arm with a two-model drafter)")
        return ""
    m0 = metrics(ctx.client)
    c0 = SpecCounters(ctx.counters.drafted, ctx.counters.accepted)
    plans = [(p, MAX_BUDGET, False) for p in ctx.plan.no_eos("reject")[:3]]
    plans += [(p, MAX_BUDGET, True) for p in ctx.plan.eos("reject")[:1]]
    for p, m, eos in plans:
        req = Request(p.text, m, logprobs=True, tag="all drafts rejected" + (" (EOS)" if eos else ""))
        with ctx.case(req):
            r = ctx.ask(req)
            why = compare(ref, r, p.out[:m], exact=True)
            if why:
                raise Finding(req, f"with every draft rejected: {why}")
            ct = (r.usage or {}).get("completion_tokens")
            ids = strip_eos(ref, r.ids)
            n = len(ids) if ids is not None else len(p.out[:m])
            if ct not in ((n, n + 1) if eos else (n,)):
                raise Finding(req, f"with every draft rejected: usage.completion_tokens {ct}, plain decode emits {n}"
                                   + (" (+ the EOS)" if eos else ""))
    with ctx.case("all drafts rejected: the server's counters"):
        m1 = metrics(ctx.client)
        got = m1.minus(m0) if m1 is not None and m0 is not None else m1
        used = ctx.counters.minus(c0)
        if got is None or not got.sources:
            got = used if ctx.counters.sources else None
        if got is None:
            raise Unsupported("the server reports no speculation counters: that the drafts were rejected is not "
                              "confirmed (the outputs above are judged all the same)")
        if got.drafted <= 0:
            raise CannotGrade(f"the server drafted nothing with the rejecting drafter ({', '.join(sorted(got.sources))}"
                              "): the cases above judged plain decode, not rejected drafts")
        if got.accepted > REJECT_MAX_ACCEPT * got.drafted:
            raise CannotGrade(f"{got.accepted:g} of {got.drafted:g} drafts accepted: the drafter was not rejected")
    confirmed = ctx.cases[-1].status == "pass"
    return ("every draft rejected: exactly plain decode's tokens, no stray id, usage = the tokens"
            + ("" if confirmed else " (the rejection is not confirmed: the server reports no speculation counters)"))


def _leak_probes(p: PromptInfo) -> tuple[Request, Request]:
    """The leak check's two requests: greedy with logprobs, and seeded sampled."""
    return (Request(p.text, 17, logprobs=True, tag="leak (greedy)"),
            Request(p.text, 17, logprobs=True, temperature=SEED_TEMPERATURE, seed=SEED, tag="leak (seeded)"))


def fresh_probes(ctx: Ctx) -> None:
    """The leak check's probes on the fresh server (before any other check): the greedy request,
    then the seeded one twice (is seeded sampling reproducible at all?)."""
    ps = ctx.plan.no_eos("leak")
    ctx.fresh = {}
    if not ps:
        return
    g, sd = _leak_probes(ps[0])
    for key, req in (("greedy", g), ("seeded", sd), ("seeded again", sd)):
        ctx.n_requests += 1
        try:
            ctx.fresh[key] = send(ctx.client, req, ctx.counters)
        except (ServerDown, ServerError) as exc:
            ctx.fresh[key] = exc
    ctx.fresh_at = ctx.n_requests


@check("leak", title="no state leak", needs=(5, 0), before=fresh_probes)
def check_leak(ctx: Ctx) -> str:
    """The same request on the fresh server = after N unrelated ones (other prompts, shapes and
    sampling parameters: logit_bias, a seed, a stop, a stream, a chat, a long prompt): the same
    ids, finish_reason and logprobs (within the logprobs check's tolerance)."""
    ref, ps = ctx.ref, ctx.plan.no_eos("leak")
    if len(ps) < 3:
        with ctx.case("leak"):
            raise Unsupported("fewer than 3 prompts")
        return ""
    if ctx.fresh is None:
        fresh_probes(ctx)
    assert ctx.fresh is not None
    g, sd = _leak_probes(ps[0])
    others = ps[1:]
    seen = set(ps[0].out[:17]) | set(ref.eos_ids)
    bias_tok = next((t for p in others for t in p.out if t not in seen), None)
    unrelated = [
        Request(others[0].text, 5, tag="leak: unrelated (logit_bias)",
                logit_bias=((bias_tok, 100.0),) if bias_tok is not None else ()),
        Request(others[1].text, 9, temperature=SEED_TEMPERATURE, seed=SEED + 99, tag="leak: unrelated (seeded)"),
        Request(" ".join(p.text for p in others), MAX_BUDGET, stream=True, tag="leak: unrelated (long, streamed)"),
        Request(others[-1].text, 9, chat=True, tag="leak: unrelated (chat)"),
    ]
    if len(others) > 2:
        found = stop_cases(ref, others[2])
        if found:
            unrelated.append(Request(others[2].text, MAX_BUDGET, stop=(found[0][0],), top_logprobs=TOP_K,
                                     logprobs=True, tag="leak: unrelated (stop, top_logprobs)"))
    refused = 0
    for u in unrelated:  # not judged here: each is another check's business
        try:
            ctx.ask(u)
        except (Finding, CannotGrade, Unsupported):
            refused += 1
    n = ctx.n_requests - ctx.fresh_at
    for key, req in (("greedy", g), ("seeded", sd)):
        again = Request(req.prompt, req.max_tokens, logprobs=True, temperature=req.temperature, seed=req.seed,
                        tag=f"leak ({key}, after the other requests)")  # N in the detail: arms compare labels
        with ctx.case(again):
            first = ctx.fresh.get(key)
            if isinstance(first, BaseException) or first is None:
                why = f"{classify_error(first, g.path).kind}: {first}" if first is not None else "no answer"
                raise CannotGrade(f"the request on the fresh server got no usable answer ({why}): nothing to "
                                  "compare with", TRANSPORT if first is None else classify_error(first).kind)
            if key == "seeded":
                second = ctx.fresh.get("seeded again")
                if isinstance(second, BaseException) or second is None or same_reply(
                        ref, second, first, "second", "first", logprobs=False):
                    raise CannotGrade("the seeded request sent twice back to back on the fresh server came back "
                                      "different: the server's seeded sampling is not reproducible")
            r = ctx.ask(again, optional="seeded sampling" if key == "seeded" else None)
            why = same_reply(ref, r, first, "now", "on the fresh server")
            if why:
                raise Finding(again, f"the same request after {n} unrelated requests differs from its answer on "
                                     f"the fresh server: {why}")
    return (f"the same request (greedy, and seeded) on the fresh server = after {n} unrelated requests"
            + (f" ({refused} unrelated request(s) refused)" if refused else ""))
