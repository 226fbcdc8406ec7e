"""What a failed request to a server IS: one classification, applied wherever a request is sent.

Every failure the served checks meet (``subjects/served/``: each check's requests, the prompt
fidelity probe, the leak probes, requests sent together; ``specparity/grading/http_servers.py``:
the warm-up) is one of :data:`CAUSES`, with the evidence quoted:

- ``transport``: no complete answer (refused, reset, closed mid-answer, past its deadline);
- ``protocol/dialect``: the server does not speak the request's dialect (no such route: HTTP
  404/405) or answers outside the API's shape (not JSON, no ``choices``, a stream without
  ``[DONE]``, a 4xx refusal of a request of the API);
- ``set-up``: the request cannot be served as set up (the model name refused, no chat template
  for a chat request, a cache hit not made): never a finding;
- ``server error returned as an error``: HTTP 5xx (the server knows it failed);
- ``server error returned as success``: HTTP 200 whose body carries an ``error`` object, or an
  empty text while the server's log shows an exception raised meanwhile (a finding: the client
  is told all went well);
- ``wrong output``: a well-formed answer whose content is wrong (the checks' findings).

``classify_error`` maps a client exception; ``error_as_success`` looks at a reply and the log
lines written while it was answered. Both are pure: the callers decide pass / fail / cannot-grade
(a ``set-up`` or dialect refusal never reads fail).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from subjects.http_client import ServerDown, ServerError

TRANSPORT = "transport"
PROTOCOL = "protocol/dialect"
SETUP = "set-up"
SERVER_ERROR = "server error returned as an error"
ERROR_AS_SUCCESS = "server error returned as success"
WRONG_OUTPUT = "wrong output"
CAUSES = (TRANSPORT, PROTOCOL, SETUP, SERVER_ERROR, ERROR_AS_SUCCESS, WRONG_OUTPUT)
NOT_FINDINGS = (SETUP,)  # causes that read cannot-grade, never fail

_MODEL = re.compile(r"model.{0,60}(not found|unknown|does not exist|not available|not loaded|not served|invalid)"
                    r"|(unknown|invalid|no such|unsupported) model"
                    r"|failed to load model", re.I)  # mlx-vlm 0.7.10 (server/generation.py load_model_resources)
_EXCEPTION = re.compile(r"^\s*(?:[A-Za-z_][\w.]*(?:Error|Exception)\b.*|Traceback \(most recent call last\):.*)$")


@dataclass(frozen=True)
class Cause:
    """One classified failure: its class (``CAUSES``), the evidence quoted, and whether it is a finding."""

    kind: str
    evidence: str

    @property
    def finding(self) -> bool:
        return self.kind not in NOT_FINDINGS


def no_route(status: int | None) -> bool:
    """The server has no such route (the request's dialect is not its own)."""
    return status in (404, 405)


def refuses_model_name(status: int | None, text: str, name: str = "default_model") -> bool:
    """A 4xx refusal of the model name ``name`` sent (it quotes the name, or says the model is unknown)."""
    if status is None or not 400 <= status < 500:
        return False
    return (name in text and "model" in text.lower()) or bool(_MODEL.search(text))


def classify_error(exc: BaseException, path: str = "") -> Cause:
    """The class of a client exception (``ServerDown`` / ``ServerError``) for a request to ``path``."""
    msg = " ".join(str(exc).split())
    if isinstance(exc, ServerDown):
        return Cause(TRANSPORT, msg)
    if isinstance(exc, ServerError):
        st = exc.status
        if st is None:
            return Cause(TRANSPORT, msg)
        if no_route(st):
            return Cause(PROTOCOL, f"{path or 'the route'}: {msg}")
        if refuses_model_name(st, msg):
            return Cause(SETUP, f"the model name was refused: {msg}")
        if st >= 500:
            return Cause(SERVER_ERROR, msg)
        return Cause(PROTOCOL, msg)
    return Cause(TRANSPORT, f"{type(exc).__name__}: {msg}")


def exception_lines(text: str, n: int = 2) -> list[str]:
    """The first distinct exception lines (``ValueError: ...``) of a piece of server log."""
    out: list[str] = []
    for ln in text.splitlines():
        t = ln.strip()
        if _EXCEPTION.match(t) and not t.startswith("Traceback") and t not in out:
            out.append(t[:300])
    return out[:n]


def error_as_success(doc: dict[str, Any] | None, text: str, log_since: str = "") -> Cause | None:
    """An HTTP-200 answer that hides an error: an ``error`` object in its body, or an empty text while
    the server's log (``log_since``: what it wrote while answering) shows an exception. None: no
    evidence of one."""
    if isinstance(doc, dict) and doc.get("error"):
        err = doc["error"]
        what = err.get("message", err) if isinstance(err, dict) else err
        return Cause(ERROR_AS_SUCCESS, f"HTTP 200 carrying an error: {' '.join(str(what).split())[:200]}")
    if text:
        return None
    lines = exception_lines(log_since)
    if lines:
        return Cause(ERROR_AS_SUCCESS, "HTTP 200 with an empty text while the server's log shows: "
                     + " | ".join(lines))
    return None
