"""What a check works with (:class:`Ctx`): the client, the reference, its prompts, its cases so far,
and the verdict on every request it sends (each failure classified: ``subjects/failure_causes.py``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from subjects.failure_causes import SETUP, TRANSPORT, WRONG_OUTPUT, classify_error, error_as_success
from subjects.http_client import HttpClient, ServerDown, ServerError
from subjects.served.cells import CannotGrade, CaseResult, Finding, Unsupported
from subjects.served.counters import SpecCounters
from subjects.served.reference import Reference
from subjects.served.wire import Reply, Request, dialect, send

if TYPE_CHECKING:
    from subjects.served.plan import Plan


class Ctx:
    """What a check works with: the client, the reference, its prompts, and its cases so far."""

    def __init__(self, client: HttpClient, ref: Reference, plan: Plan, counters: SpecCounters,
                 require_hits: bool = True, *, arm: str = "plain", baseline: dict[str, Any] | None = None,
                 reject: bool = False, server_log: Callable[[], str] | None = None) -> None:
        self.client, self.ref, self.plan, self.counters = client, ref, plan, counters
        self.server_log = server_log  # what the server's log gained since the last call ("" without a log)
        self.last: Reply | None = None  # the last reply of the case in progress
        self.require_hits = require_hits  # False: an attribution rerun judges outputs only
        self.cases: list[CaseResult] = []
        self.token_prompts: bool | None = None  # learnt: does /v1/completions take token-id prompts?
        self.sent: list[str] = []  # the requests sent in the case in progress
        self.arm = arm  # "plain" (no speculation) or "spec"
        self.baseline = baseline if baseline is not None else {}  # what the plain arm saw (tools), by request
        self.reject = reject  # this server's drafter has zero weights: its drafts are (all but) always rejected
        self.fresh: dict[str, Reply | BaseException] | None = None  # leak: the probes on the fresh server
        self.fresh_at = 0  # leak: requests answered when the probes were sent
        self.n_requests = 0  # requests sent to this server so far (by the checks)
        self.fidelity: CaseResult | None = None  # the prompt-fidelity finding (prompt_fidelity), else None
        self.fidelity_as = "as sent"  # or "as its row declares it wraps it"
        self.gate: str | None = None  # why a check judged against plain decode of the prompt cannot grade

    @contextlib.contextmanager
    def case(self, what: Request | str) -> Iterator[None]:
        """Run one case: a Finding is ``fail``, CannotGrade ``cannot-grade``, Unsupported ``n/a``."""
        label = self.label(what) if isinstance(what, Request) else what
        self.sent: list[str] = []
        self.last = None
        if self.server_log is not None:
            self.server_log()  # what the log said before this case is not this case's evidence
        try:
            yield
        except Finding as f:
            detail, cause = str(f), f.cause
            if cause is None:
                hidden = self.hidden_error()
                cause = hidden.kind if hidden is not None else WRONG_OUTPUT
                if hidden is not None:
                    detail = f"{detail} ({hidden.kind}: {hidden.evidence})"
            self.cases.append(CaseResult(self.label(f.req) if f.req is not None else label, "fail", detail, cause))
        except CannotGrade as g:
            self.cases.append(CaseResult(label, "cannot-grade", str(g), g.cause))
        except Unsupported as u:
            self.cases.append(CaseResult(label, "unsupported", str(u)))
        else:
            self.cases.append(CaseResult(self.sent[-1] if self.sent and not isinstance(what, Request) else label,
                                         "pass", "ok"))

    def label(self, req: Request) -> str:
        """``req``'s label as the server is sent it (a chat-only server's: through chat)."""
        try:
            return dialect(self.client).adapt(req).label
        except ServerError:
            return req.label

    def hidden_error(self) -> Any:
        """An error the last reply hid behind HTTP 200 (``failure_causes.error_as_success``), or None."""
        if self.last is None:
            return None
        return error_as_success(self.last.doc, self.last.text, self.server_log() if self.server_log else "")

    def ask(self, req: Request, optional: str | None = None) -> Reply:
        """Send ``req``: its reply, or the case's verdict raised (``optional``: what a 4xx refusal
        means the server does not take, e.g. ``"tools"``: that case is n/a, not a finding)."""
        self.sent.append(self.label(req))
        self.n_requests += 1
        try:
            self.last = send(self.client, req, self.counters)
            return self.last
        except ServerDown as exc:
            raise self._on_down(req, exc) from None
        except ServerError as exc:
            raise self._refused(req, exc, optional) from None

    def verdict_on(self, req: Request, exc: BaseException) -> Exception:
        """The case's verdict on an exception a request sent outside :meth:`ask` raised (sent together)."""
        if isinstance(exc, ServerError):
            return self._refused(req, exc)
        if isinstance(exc, ServerDown):
            return self._on_down(req, exc)
        cause = classify_error(exc, req.path)
        return Finding(req, f"bad response: {exc}", cause.kind)

    def _refused(self, req: Request, exc: ServerError, optional: str | None = None) -> Exception:
        """The case's verdict on an error answer, classified (``failure_causes.classify_error``): a
        set-up or dialect refusal cannot grade, a 5xx or a non-API answer is a finding."""
        cause = classify_error(exc, req.path)
        if not self.ref.has_chat_template and exc.status is not None and exc.status >= 400 and (
                req.chat or _TEMPLATE.search(str(exc))):
            where = "the chat endpoint" if req.chat else "the server (it routes this through a chat template)"
            return CannotGrade(f"{where} refused ({exc}); the model has no chat template, so the server "
                               "cannot build a chat prompt")
        if optional and exc.status is not None and 400 <= exc.status < 500:
            return Unsupported(f"the server refuses {optional}: {exc}")
        if cause.kind == SETUP or (exc.status in (404, 405)):
            return CannotGrade(f"{cause.kind}: {cause.evidence}", cause.kind)
        if exc.status is None:  # the connection closed mid-answer: is the server still there?
            alive, why = self.client.healthy()
            if not alive:
                return server_down(req, f"{exc} ({why})")
        return Finding(req, f"bad response: {exc}", cause.kind)

    def _on_down(self, req: Request, exc: ServerDown) -> Exception:
        """A Finding when the connection closed without an answer but the server is still up (it
        crashed on this request), else ServerDown (it stopped answering: the arm stops here)."""
        if getattr(exc, "kind", "closed") == "closed":
            alive, why = self.client.healthy()
            if alive:
                return Finding(req, f"no answer: {exc} (the server is still up)", TRANSPORT)
            return server_down(req, f"{exc} ({why})")
        return server_down(req, exc)

    def ask_ids(self, ids: Sequence[int], max_tokens: int, tag: str, **kw: Any) -> tuple[Request, Reply]:
        """A completions request for exactly ``ids``: a token-id prompt where the server takes one,
        else the text whose encoding round-trips to ``ids`` (CannotGrade when none does)."""
        req = Request(tuple(int(i) for i in ids), max_tokens, tag=tag, **kw)
        if self.token_prompts is not False:
            self.sent.append(req.label)
            self.n_requests += 1
            try:
                reply = self.last = send(self.client, req, self.counters)
                pt = (reply.usage or {}).get("prompt_tokens")
                if pt is not None and pt != len(ids):
                    raise CannotGrade(f"the server counted {pt} prompt tokens for a token-id prompt of "
                                      f"{len(ids)}: it did not take the ids as sent")
                self.token_prompts = True
                return req, reply
            except ServerDown as exc:
                raise self._on_down(req, exc) from None
            except ServerError as exc:
                if self.token_prompts or exc.status is None or exc.status < 400 or exc.status >= 500:
                    raise self._refused(req, exc) from None
                self.token_prompts = False  # it refuses token-id prompts: text, where the ids round-trip
        text = self.ref.text_for(ids)
        if text is None:
            raise CannotGrade("the server takes no token-id prompt and these ids do not round-trip through "
                              "text (decode then encode gives other ids)")
        treq = Request(text, max_tokens, tag=tag + " (as text: the ids round-trip)", **kw)
        return treq, self.ask(treq)


_TEMPLATE = re.compile(r"chat[ _-]?template|chat_generation", re.I)


def server_down(req: Request, why: object) -> ServerDown:
    exc = ServerDown(f"server stopped answering: {req.label}: {why}")
    exc.label = req.label  # type: ignore[attr-defined]
    return exc
