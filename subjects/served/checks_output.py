"""The checks of one answer's output: identity, stream, budget, finish_reason, usage, eos, stop, logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence

from subjects.served.cells import CannotGrade, Finding, Unsupported
from subjects.served.ctx import Ctx
from subjects.served.declare import check
from subjects.served.plan import (
    BUDGETS,
    MAX_BUDGET,
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
    nonspace,
    splits_utf8,
    stop_view,
    strip_eos,
    text_diff,
    text_tail,
)
from subjects.served.wire import Reply, Request


@check("identity", title="greedy = plain", needs=(3, 0))
def check_identity(ctx: Ctx) -> str:
    ps = ctx.plan.no_eos("identity")
    gated = ctx.fidelity is not None
    if gated:  # the one finding (prompt_fidelity); the completions cases would only repeat it
        ctx.cases.append(ctx.fidelity)
    for p in ps[:2]:
        req = Request(p.text, 24, logprobs=True, tag="identity")
        with ctx.case(req):
            if gated:
                raise CannotGrade(f"not sent: the server does not complete the prompt {ctx.fidelity_as} (the "
                                  "prompt-fidelity case of this cell): its output cannot be compared with plain "
                                  "decode of it")
            why = compare(ctx.ref, ctx.ask(req), p.out[:24], exact=False)
            if why:
                raise Finding(req, why)
    for p in ps[2:3]:
        req = Request(p.text, 24, chat=True, logprobs=True, tag="identity (chat)")
        with ctx.case(req):
            ids, _ = ctx.ref.expect(req)
            r = ctx.ask(req)
            pt = (r.usage or {}).get("prompt_tokens")
            if gated and pt is not None and pt != len(ctx.ref.prompt_ids(req)):
                raise CannotGrade(f"the server counted {pt} prompt tokens for a chat prompt of "
                                  f"{len(ctx.ref.prompt_ids(req))} (as the prompt-fidelity case of this cell): its "
                                  "output cannot be compared with plain decode of the chat prompt")
            why = compare(ctx.ref, r, ids, exact=False)
            if why:
                raise Finding(req, f"{why} (the chat prompt the server builds, or its decode)")
    if gated:
        return ""
    return "greedy output = plain decode (completions and chat)"


def _stream_pair(ctx: Ctx, req: Request, *, ids_check: bool) -> None:
    """The streamed reply = the non-streamed reply to the same request (text, finish, usage)."""
    plain_req = Request(req.prompt, req.max_tokens, chat=req.chat, stop=req.stop, logprobs=not req.chat,
                        tag=req.tag)
    sreq = Request(req.prompt, req.max_tokens, chat=req.chat, stream=True, stop=req.stop, tag=req.tag)
    with ctx.case(sreq):
        full = ctx.ask(plain_req)
        streamed = ctx.ask(sreq)
        if loose(streamed.text) != loose(full.text):
            raise Finding(sreq, f"streamed deltas concatenated differ from the non-streamed text: "
                                f"{text_diff(loose(streamed.text), loose(full.text), 'stream', 'non-stream')} "
                                f"({streamed.chunks} events)")
        ids = strip_eos(ctx.ref, full.ids)
        whose = "the ids it returned"
        if ids is None and ids_check and isinstance(req.prompt, str):
            # no ids came back: plain decode's, when the text is theirs whitespace aside (else identity judges)
            want_ids, _ = ctx.ref.expect(plain_req)
            if nonspace(ctx.ref.decode(want_ids)) == nonspace(full.text):
                ids, whose = want_ids, "its tokens (plain decode's ids: it returned none)"
        if ids_check and ids is not None and loose(ctx.ref.decode(ids)) != loose(full.text):
            raise Finding(plain_req, f"the text is not the decode of {whose}: "
                                     + text_diff(loose(full.text), loose(ctx.ref.decode(ids)), "text",
                                                  "decode(ids)"))
        if streamed.finish_reason != full.finish_reason:
            raise Finding(sreq, f"streamed finish_reason {streamed.finish_reason!r}, not the non-streamed "
                                f"{full.finish_reason!r}")
        if streamed.usage is None:
            raise Finding(sreq, "no usage chunk although stream_options.include_usage was asked")
        keys = ("prompt_tokens", "completion_tokens", "total_tokens")
        su, fu = ({k: (u or {}).get(k) for k in keys} for u in (streamed.usage, full.usage))
        if full.usage is not None and su != fu:
            raise Finding(sreq, f"streamed usage {su} differs from the non-streamed {fu}")


@check("stream", title="stream = non-stream", needs=(3, 1))
def check_stream(ctx: Ctx) -> str:
    ref, ps = ctx.ref, ctx.plan.no_eos("stream")
    split = sum(splits_utf8(ref, p.out[:24]) for p in ps[:2])
    for p in ps[:2]:
        _stream_pair(ctx, Request(p.text, 24, tag="stream"), ids_check=True)
    for p in ps[2:3]:
        _stream_pair(ctx, Request(p.text, 24, chat=True, tag="stream (chat)"), ids_check=False)
    for p in ctx.plan.eos("stream")[:1]:
        _stream_pair(ctx, Request(p.text, MAX_BUDGET, tag="stream (EOS)"), ids_check=False)
    cases = stop_cases(ref, ps[1]) if len(ps) > 1 else []
    for s, kind, _ in cases[:1]:
        _stream_pair(ctx, Request(ps[1].text, MAX_BUDGET, stop=(s,), tag=f"stream (stop {kind})"), ids_check=False)
    return ("streamed deltas = non-streamed text = decode(ids), same finish_reason and usage"
            + (f"; {split} output(s) split a multi-byte character across tokens" if split else ""))


@check("budget", title="budget", needs=(len(BUDGETS), 0), gated=True)
def check_budget(ctx: Ctx) -> str:
    for m, p in zip(BUDGETS, ctx.plan.no_eos("budget"), strict=False):
        req = Request(p.text, m, logprobs=True, tag="budget")
        with ctx.case(req):
            r = ctx.ask(req)
            n = len(r.ids) if r.ids is not None else None
            if n is not None and n > m:  # the property that broke, first: the budget itself
                raise Finding(req, f"max_tokens={m}: {n} tokens emitted")
            why = compare(ctx.ref, r, p.out[:m], exact=True)
            if why:
                raise Finding(req, f"max_tokens={m}: {why}")
    return f"exactly the budget at max_tokens {list(BUDGETS)}"



def _stop_case(ref: Reference, ps: Sequence[PromptInfo], kind: str, skip: int = 0
               ) -> tuple[PromptInfo, str, int] | None:
    """The ``skip``-th prompt of ``ps`` with a stop case of ``kind`` ('' = any)."""
    n = 0
    for p in ps:
        for s, k, j in stop_cases(ref, p):
            if not kind or k == kind:
                if n == skip:
                    return p, s, j
                n += 1
                break
    return None


def _stopped(ctx: Ctx, req: Request, reply: Reply, full_text: str, s: str) -> None:
    """CannotGrade unless the server's text is plain decode's up to the stop string."""
    want = full_text[: full_text.find(s)]
    if stop_view(reply.text) != stop_view(want):
        raise CannotGrade(f"the server's text {text_tail(reply.text)} is not plain decode's up to the stop {s!r} "
                          f"{text_tail(want)} (the stop check judges that)")


@check("finish_reason", title="finish_reason", needs=(4, 2), gated=True)
def check_finish_reason(ctx: Ctx) -> str:
    ref, ps, es = ctx.ref, ctx.plan.no_eos("finish_reason"), ctx.plan.eos("finish_reason")
    if ps:
        req = Request(ps[0].text, 5, tag="finish_reason (budget)")
        with ctx.case(req):
            r = ctx.ask(req)
            if r.finish_reason != "length":
                raise Finding(req, f"finish_reason {r.finish_reason!r} at the budget, expected 'length'")
    for i, p in enumerate(es[:2]):
        m = MAX_BUDGET if i == 0 else len(p.out) + 1  # the EOS is the budget's last token: EOS wins
        req = Request(p.text, m, tag="finish_reason (EOS)" + ("" if i == 0 else " as the budget's last token"))
        with ctx.case(req):
            r = ctx.ask(req)
            if r.finish_reason != "stop":
                raise Finding(req, f"finish_reason {r.finish_reason!r} on EOS, expected 'stop'")
    for kind, extra, tag in (("", None, "stop string"), ("", 1, "stop string in the budget's last block")):
        found = _stop_case(ref, ps[1:], kind, skip=0 if extra is None else 1)
        label = f"finish_reason ({tag})"
        if found is None:
            with ctx.case(label):
                raise Unsupported("no stop string found in the plain output")
            continue
        p, s, k = found
        m = MAX_BUDGET if extra is None else k + 1 + extra
        req = Request(p.text, m, stop=(s,), tag=label)
        with ctx.case(req):
            r = ctx.ask(req)
            _stopped(ctx, req, r, ref.decode(p.out), s)
            if r.finish_reason != "stop":
                raise Finding(req, f"the stop string {s!r} ended the text but finish_reason is "
                                   f"{r.finish_reason!r}, not 'stop'")
    return "'length' at the budget, 'stop' on EOS and on stop strings (also in the budget's last block)"


def _completion_count(ctx: Ctx, req: Request, r: Reply) -> None:
    u = r.usage
    if not isinstance(u, dict):
        raise Finding(req, f"no usage in the response (got {u!r})")
    pt, ct, tt = u.get("prompt_tokens"), u.get("completion_tokens"), u.get("total_tokens")
    n_prompt = len(ctx.ref.prompt_ids(req))
    if req.chat and isinstance(pt, int) and not isinstance(pt, bool):
        n_prompt = pt  # the chat prompt the server builds is identity's business (one root cause, one cell)
    if pt != n_prompt:
        raise Finding(req, f"usage.prompt_tokens {pt}, the prompt the server builds has {n_prompt} tokens")
    if tt != (pt or 0) + (ct or 0):
        raise Finding(req, f"usage.total_tokens {tt} != prompt_tokens {pt} + completion_tokens {ct}")
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None and not (isinstance(cached, int) and 0 <= cached <= n_prompt):
        raise Finding(req, f"usage cached_tokens {cached!r} outside 0..prompt_tokens {n_prompt}")
    details = u.get("completion_tokens_details") if isinstance(u.get("completion_tokens_details"), dict) else {}
    for k, v in details.items():  # reasoning_tokens, accepted/rejected_prediction_tokens: parts of the count
        if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= (ct or 0):
            raise Finding(req, f"usage completion_tokens_details.{k} {v} outside 0..completion_tokens {ct}")


@check("usage", title="usage", needs=(4, 1), gated=True)
def check_usage(ctx: Ctx) -> str:
    ref, ps, es = ctx.ref, ctx.plan.no_eos("usage"), ctx.plan.eos("usage")
    plain = [(Request(ps[0].text, 9, logprobs=True, tag="usage"), False)] if ps else []
    plain += [(Request(p.text, MAX_BUDGET, logprobs=True, tag="usage (EOS)"), True) for p in es[:1]]
    if ctx.plan.reencode is not None:
        plain.append((Request(ctx.plan.reencode.text, 17, logprobs=True,
                              tag="usage (output re-encodes to another count)"), False))
    for q in ps[3:4] or ps[:1]:  # a chat reply's usage too (its prompt: the chat prompt the server builds)
        plain.append((Request(q.text, 9, chat=True, logprobs=True, tag="usage (chat)"), None))
    for req, eos in plain:
        with ctx.case(req):
            r = ctx.ask(req)
            _completion_count(ctx, req, r)
            ct = r.usage.get("completion_tokens") if r.usage else None
            ids = strip_eos(ref, r.ids)
            n = len(ids) if ids is not None else len(ref.expect(req)[0])
            ended = eos if eos is not None else r.finish_reason == "stop"  # a chat reply: did it end on EOS?
            allowed = (n, n + 1) if ended else (n,)
            if ct not in allowed:
                raise Finding(req, f"usage.completion_tokens {ct}, the server returned {n} token(s)"
                                   + (" (+ at most the EOS)" if ended else ""))
    for kind, extra in (("", None), ("", 1)):
        found = _stop_case(ref, ps[1:], kind, skip=0 if extra is None else 1)
        tag = "usage (stop)" if extra is None else "usage (stop in the budget's last block)"
        if found is None:
            with ctx.case(tag):
                raise Unsupported("no stop string found in the plain output")
            continue
        p, s, k = found
        req = Request(p.text, MAX_BUDGET if extra is None else k + 1 + extra, stop=(s,), tag=tag)
        with ctx.case(req):
            r = ctx.ask(req)
            _completion_count(ctx, req, r)
            _stopped(ctx, req, r, ref.decode(p.out), s)
            ct = r.usage.get("completion_tokens") if r.usage else None
            if ct != k + 1:
                raise Finding(req, f"usage.completion_tokens {ct}, but the stop {s!r} was completed by token {k} "
                                   f"(so {k + 1} tokens)")
    return "prompt, completion (trimmed at a stop) and total token counts exact"


@check("eos", title="EOS", needs=(0, 3), gated=True)
def check_eos(ctx: Ctx) -> str:
    ref, es = ctx.ref, ctx.plan.eos("eos")
    if not es:
        with ctx.case("eos"):
            raise Unsupported(f"no prompt reaches EOS within {MAX_BUDGET} tokens of plain decode")
        return ""
    plans = [(es[0], MAX_BUDGET, "eos")]
    if len(es) > 1:
        plans.append((es[1], len(es[1].out) + 1, "eos (the budget's last token)"))
    if len(es) > 2:
        plans.append((es[2], len(es[2].out) + 3, "eos (inside a block past the budget's end)"))
    for p, m, tag in plans:
        req = Request(p.text, m, logprobs=True, tag=tag)
        with ctx.case(req):
            r = ctx.ask(req)
            for et in ref.eos_text:
                if et and et in r.text:
                    raise Finding(req, f"EOS text {et!r} in the output at character {r.text.index(et)}: "
                                       f"{text_tail(r.text)}")
            why = compare(ref, r, p.out, exact=True)
            if why:
                raise Finding(req, f"plain decode ends on EOS after {len(p.out)} tokens: {why}")
    return "the EOS never in the text, nothing after it"


@check("stop", title="stop strings", needs=(5, 0), gated=True)
def check_stop(ctx: Ctx) -> str:
    ref, ps = ctx.ref, ctx.plan.no_eos("stop")
    wanted = [("a whole token", None), ("inside a token", None), ("", 0), ("", 1)]
    for n, (kind, extra) in enumerate(wanted):
        found = _stop_case(ref, ps[n:] + ps[:n], kind)
        tag = f"stop ({kind or 'any'}" + ("" if extra is None else
                                          f", max_tokens {'at' if extra == 0 else 'one past'} its token") + ")"
        if found is None:
            with ctx.case(tag):
                raise Unsupported(f"no stop string {kind or ''} found in the plain output".replace("  ", " "))
            continue
        p, s, k = found
        req = Request(p.text, MAX_BUDGET if extra is None else k + 1 + extra, stop=(s,), logprobs=True, tag=tag)
        with ctx.case(req):
            r = ctx.ask(req)
            full = ref.decode(p.out)
            want = full[: full.find(s)]
            if stop_view(r.text) != stop_view(want):
                got = stop_view(r.text)
                if s not in r.text and got.startswith(stop_view(want)) and len(got) > len(stop_view(want)):
                    raise Finding(req, f"stop {s!r} did not stop generation: it was cut out of the text, which goes "
                                       f"on past it: {text_tail(r.text)} vs expected {text_tail(want)}")
                extra_s = " (the stop string is in the text)" if s in r.text else ""
                raise Finding(req, f"stop {s!r}: text {text_tail(r.text)} vs expected {text_tail(want)}{extra_s}")
            if r.logprobs is not None and len(r.logprobs) not in (k, k + 1):
                raise Finding(req, f"stop {s!r} was completed by token {k}, but {len(r.logprobs)} logprob entries "
                                   f"came back (ids and logprobs not trimmed where the text was)")
    return "the text ends before the stop string (whole token, inside a token, at the budget's end), ids trimmed"


@check("logprobs", title="logprobs", needs=(2, 0), gated=True)
def check_logprobs(ctx: Ctx) -> str:
    ref, ps = ctx.ref, ctx.plan.no_eos("logprobs")
    for n, p in enumerate(ps[:2]):
        kw = {"logprobs": True, "top_logprobs": TOP_K}
        if n == 0:
            req = Request(p.text, 9, tag="logprobs", **kw)
        label = f"logprobs: {p.text[:30]!r}" + (" by token ids" if n else "")
        with ctx.case(label):
            if n == 0:
                r = ctx.ask(req)
            else:
                req, r = ctx.ask_ids(p.ids, 9, tag="logprobs (token-id prompt)", **kw)
            pids = tuple(ref.prompt_ids(req))
            if not r.logprobs:
                raise Finding(req, "no logprobs in the response")
            got_ids = r.ids
            ids = got_ids if got_ids is not None else ref.expect(req)[0][: len(r.logprobs)]
            want = ref.logprobs(pids, tuple(ids), TOP_K)
            for i, (g, (lp, top)) in enumerate(zip(r.logprobs, want, strict=False)):
                if not logprob_close(g.logprob, lp):
                    raise Finding(req, f"token {i} (id {ids[i]}): logprob {g.logprob:.5f} vs plain {lp:.5f} "
                                       f"(tolerance {LOGPROB_ATOL:g} + {LOGPROB_RTOL:.4g}·|lp|)")
                vals = [v for _, _, v in g.top]
                if len(vals) != TOP_K:
                    raise Finding(req, f"token {i}: {len(vals)} top_logprobs, asked for {TOP_K}")
                if vals != sorted(vals, reverse=True):
                    raise Finding(req, f"token {i}: top_logprobs not sorted by logprob: "
                                       f"{[(t[0], round(t[2], 4)) for t in g.top]}")
                top_id = g.top[0][0] if g.top else None
                if (got_ids is not None and top_id is not None and top_id != ids[i]
                        and not logprob_close(vals[0], g.logprob)):  # greedy: the emitted token is the top entry
                    raise Finding(req, f"token {i}: top_logprobs[0] is id {top_id} ({vals[0]:.5f}), not the emitted "
                                       f"token id {ids[i]} ({g.logprob:.5f})")
                if vals and not g.logprob >= vals[0] - (LOGPROB_ATOL + LOGPROB_RTOL * abs(vals[0])):
                    raise Finding(req, f"token {i}: the emitted (greedy) token's logprob {g.logprob:.5f} is below "
                                       f"the top entry's {vals[0]:.5f}")
                for k, ((_, _, v), (tid, w)) in enumerate(zip(g.top, top, strict=False)):
                    if not logprob_close(v, w):
                        raise Finding(req, f"token {i}: top_logprobs[{k}] {v:.5f} vs plain {w:.5f} (id {tid})")
    return (f"emitted-token logprobs and sorted top_logprobs = plain decode teacher-forced on the server's ids "
            f"(tol {LOGPROB_ATOL:g} + {LOGPROB_RTOL:.4g}·|lp|)")
