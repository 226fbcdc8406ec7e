"""Running an arm's checks on one server: the dialect learnt first, the leak probes, prompt fidelity,
then every declared check in order (``run_checks``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from subjects.failure_causes import TRANSPORT
from subjects.http_client import HttpClient, ServerDown, ServerError
from subjects.served.cells import CaseResult, CellResult, cell_from_cases
from subjects.served.counters import SpecCounters
from subjects.served.ctx import Ctx
from subjects.served.declare import CHECKS, check_names, gated
from subjects.served.plan import Plan, make_plan
from subjects.served.reference import Reference
from subjects.served.wire import Request, dialect, send


def prompt_fidelity(ctx: Ctx) -> None:
    """Does the server complete the completions prompt it is sent (or, where its row declares a
    wrapping, the wrapped one)? Two text prompts (the warm-up prompt and its first half: no check's
    words), ``max_tokens`` 1: when the server's ``usage.prompt_tokens`` differs from the prompt's
    length for both, that is one finding, ``ctx.fidelity`` (the identity cell's), and ``ctx.gate`` the
    reason every gated check (``declare.gated``) reads cannot-grade. No usage, an error or a server that stopped
    answering: no verdict here (the checks meet it)."""
    words = ctx.plan.warmup.split()
    texts = [ctx.plan.warmup] + ([" ".join(words[: len(words) // 2])] if len(words) > 1 else [])
    seen: list[tuple[Request, int, int]] = []
    for text in texts:
        req = Request(text, 1, tag="identity (prompt fidelity)")
        ctx.n_requests += 1
        try:
            r = send(ctx.client, req, ctx.counters)
        except (ServerDown, ServerError):
            return
        pt = (r.usage or {}).get("prompt_tokens")
        if isinstance(pt, bool) or not isinstance(pt, int):
            return
        seen.append((req, pt, len(ctx.ref.prompt_ids(req))))
    if not seen or any(pt == n for _, pt, n in seen):
        return
    req, pt, n = seen[0]
    more = "".join(f" (and {p} for one of {k})" for _, p, k in seen[1:])
    if ctx.ref.wrap:
        ctx.fidelity_as = "as its row declares it wraps it"
        short = f"usage.prompt_tokens {pt} where the declared wrapping builds {n}{more}"
        detail = (f"the server does not complete the prompt as its row declares it wraps it: {short} "
                  f"(declared: {ctx.ref.wrap}); every check judged against plain decode of the prompt cannot grade")
    else:
        short = f"usage.prompt_tokens {pt} for a completions prompt of {n} tokens{more}"
        detail = (f"the server does not complete the prompt as sent: {short}: it builds another prompt around it (a "
                  "chat template, a system message); every check judged against plain decode of the prompt as sent "
                  "cannot grade (a row may declare the wrapping: ServedEngine.completions_wrap)")
    ctx.fidelity = CaseResult(req.label, "fail", detail)
    ctx.gate = (f"the server does not complete the prompt {ctx.fidelity_as} ({short}): its output cannot be "
                "compared with plain decode of it; see identity")


def learn_dialect(client: HttpClient, text: str) -> None:
    """One 1-token request of ``text`` (a prompt no check uses) unless the server already answered
    one: what it refuses teaches its dialect (``Dialect``) before any check is judged."""
    d = dialect(client)
    if d.probed:
        return
    with contextlib.suppress(ServerDown, ServerError):
        send(client, Request(text, 1, tag="dialect"))


def run_checks(client: HttpClient, ref: Reference, checks: Sequence[str] | None = None,
               log: Callable[[str], None] | None = None, plan: Plan | None = None,
               counters: SpecCounters | None = None, require_hits: bool = True, *, arm: str = "plain",
               baseline: dict[str, Any] | None = None, reject: bool = False,
               server_log: Callable[[], str] | None = None) -> dict[str, CellResult]:
    """Every check in order (``speculation`` is the grader's: it needs the whole arm);
    once the server stops answering, the rest are ``cannot-grade`` with that reason.

    ``arm``: ``plain`` or ``spec``; ``baseline``: shared by the arms of one grading (the plain
    arm's tool calls, compared on the spec arm); ``reject``: this server's drafts are all rejected.
    With ``leak`` among the checks, its probes are the server's first requests after the one that
    learns its dialect (:func:`learn_dialect`); a chat-only server is graded through chat, against
    its chat prompt. ``server_log``: what the server's log gained since the last call (the evidence
    of an error returned as success)."""
    checks = check_names() if checks is None else checks
    plan = plan if plan is not None else make_plan(ref)
    counters = counters if counters is not None else SpecCounters()
    out: dict[str, CellResult] = {}
    down: str | None = None
    ok, why = client.healthy()
    if not ok:
        down = f"the server was not answering before the first check: {why}"
    else:
        learn_dialect(client, plan.warmup)
        if dialect(client).chat_only:
            ref = ref.through_chat()
            plan = make_plan(ref, checks)
    ctx = Ctx(client, ref, plan, counters, require_hits, arm=arm, baseline=baseline, reject=reject,
              server_log=server_log)
    for name in checks:  # a check's ``before`` (the leak check's probes) runs first, on the fresh server
        before = CHECKS[name].before if name in CHECKS else None
        if before is not None and down is None:
            before(ctx)
    if down is None and any(c in checks for c in ("identity", *gated())) and not any(
            isinstance(v, ServerDown) for v in (ctx.fresh or {}).values()):
        prompt_fidelity(ctx)
    for name in checks:
        fn = CHECKS[name].fn if name in CHECKS else None
        if fn is None:  # judged by the grader over the whole arm (speculation)
            continue
        if down is not None:
            out[name] = CellResult(name, "cannot-grade", f"not graded: {down}")
            continue
        if ctx.gate is not None and CHECKS[name].gated:
            out[name] = CellResult(name, "cannot-grade", ctx.gate)
            if log is not None:
                log(f"{name}: cannot-grade - {ctx.gate}")
            continue
        t0 = time.monotonic()
        ctx.cases = []
        try:
            summary = fn(ctx)
            out[name] = cell_from_cases(name, ctx.cases, summary)
        except ServerDown as d:
            ctx.cases.append(CaseResult(getattr(d, "label", name), "fail", str(d), TRANSPORT))
            out[name] = cell_from_cases(name, ctx.cases, "")
            _, health = client.healthy()
            down = f"the server stopped answering in check {name!r} ({health})"
        if log is not None:
            r = out[name]
            log(f"{name}: {r.status} ({time.monotonic() - t0:.1f}s)" + ("" if r.status == "pass" else f" - {r.detail}")
                + (f" [{r.case}]" if r.case else ""))
    return out
