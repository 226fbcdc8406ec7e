"""Black-box checks of an OpenAI-compatible server (a served engine) over HTTP: a package, one module
per concept.

- ``wire.py``: requests, replies, the server's dialect (learnt from its refusals), ``send``;
- ``counters.py``: speculation counters (``/metrics``, ``/health``, usage) and the ``speculation`` cell;
- ``reference.py``: the reference (plain decode in process) and the comparators of a reply with it;
- ``cells.py``: cases and cells, their four states; ``ctx.py``: what a check works with, and the verdict
  on each request it sends (each failure classified: ``subjects/failure_causes.py``);
- ``declare.py``: each check declared ONCE (``@check``: name, title, the prompts it needs, gated or
  not, its server); the ``--check`` choices, the plan, the gate, the grader's server groups and the
  scoreboard's columns are derived from it;
- ``plan.py``: each check's own prompts; ``checks_output.py``, ``checks_state.py``,
  ``checks_server.py``: the checks; ``orchestrate.py``: ``run_checks``.

The request and response shapes are those of mlx-lm 0.32.2 ``mlx_lm/server.py``
(``APIHandler.do_POST``, ``generate_response``, ``handle_completion``,
``completion_usage_response``, ``handle_health_check``): ``POST /v1/completions``
(a text prompt, or a token-id array as the OpenAI completions API allows) and
``/v1/chat/completions`` (``stream`` as Server-Sent Events ending
``data: [DONE]``; ``stream_options.include_usage``), ``max_tokens``, ``stop``,
``logprobs`` / ``top_logprobs`` (``choices[0].logprobs.content[i]`` =
``{id, token, logprob, top_logprobs}``; the legacy completions shape
``{tokens, token_logprobs, top_logprobs}`` is read too), ``usage``
(``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
``prompt_tokens_details.cached_tokens``), ``finish_reason``; ``GET /health``,
``/v1/models`` and, where a server has it, ``/metrics``. Every request goes
through the one bounded client, ``subjects/http_client.py``.

A server exposes no rounds, so it is judged against a :class:`Reference`
computed in process by the grader (``specparity/grading/http_servers.py``: plain greedy decode
of the same weights on the prompt the server builds — the tokenizer's encoding,
the token ids sent, its chat template or mlx-lm's ``convert_chat``).

**Four states per cell.** Each check runs every one of its cases (none stops at
its first failing case) and each case is ``pass``, ``fail`` (a finding: the
request and the first divergence), ``cannot-grade`` (the case could not be set
up: a chat endpoint refused for a model without a chat template, a cache hit the
server did not make, a stop string the output lacks) or ``n/a``. A cell is
``fail`` when a case failed, else ``pass`` when one passed, else
``cannot-grade``, else ``n/a`` (``unsupported``); a set-up failure never reads
fail. A spec arm whose server never speculated is ``not-engaged`` (set by the
grader from the ``speculation`` cell), never ``pass``.

**One root cause, one cell.** Each check owns one property and uses prompts no
other check uses (first words distinct, :func:`make_plan`); the properties:

- ``identity``: greedy output ids = plain decode (completions; chat through the
  template the server builds), prefix only (lengths belong to the budget/EOS checks);
- ``stream``: streamed deltas concatenated = the non-streamed text = decode of the
  server's own ids (byte-level models: at split multi-byte characters), the same
  finish_reason and usage (the server against itself, no reference);
- ``budget``: ``max_tokens`` 1, 2, 5, 9, 17, 33 (ending inside a speculative
  round): exactly that output;
- ``finish_reason``: ``length`` at the budget, ``stop`` on EOS, on a stop string,
  and when the stop or EOS lands in the same block as the budget (the stop wins);
- ``usage``: ``prompt_tokens`` = the built prompt, ``completion_tokens`` = the ids
  returned (+ at most the EOS), trimmed at a stop to the token that completed it,
  ``total_tokens`` the sum, ``cached_tokens`` within the prompt; on a byte-level
  model a case whose text re-encodes to another count;
- ``eos``: the EOS never in the text, generation ends where plain decode's does
  (also when the EOS is the budget's last token or inside a block past it);
- ``stop``: the text ends right before the first occurrence of the stop string
  (a whole token, inside a token, in a block that crosses ``max_tokens``), and
  the returned ids / logprobs are trimmed to the token that completed it;
- ``logprobs``: each emitted token's logprob and the sorted top_logprobs agree with
  the reference teacher-forced on the server's own ids (tolerance
  ``LOGPROB_ATOL + LOGPROB_RTOL·|lp|``: bf16-like rounding passes);
- ``cache``: a repeated identical request, a shared-prefix follow-up and an exact
  continuation (prompt ids + the server's completion ids, sent as a token-id
  prompt where the server takes one; as text only when the ids round-trip),
  each = cold plain decode and credited only when the server's own
  ``usage.prompt_tokens`` / ``cached_tokens`` show the hit meant was made;
- ``concurrency``: requests in flight together (asserted: all sent before any
  answered) each = plain decode; reported in the B-invariance words of docs/batched.md
  (``engine.batched_check``: holds / identical, or ``logic``: over HTTP there is no
  numerics witness, so a flip is never called ``numerics``);
- ``seeded``: a seeded sampled request (temperature 1, ``seed``) with batch-mates in
  flight together (asserted, 3 bursts) draws what it draws alone (server against
  itself; cannot-grade when the seed is not reproducible alone, when temperature is
  ignored, or when its logprobs show batch-mates moved the computation itself, which
  is ``concurrency``'s finding); the seeded invariance's words, as ``concurrency``'s;
- ``tools``: the tool calls a server parses (chat ``tools``; streamed deltas
  reassembled) under speculation = without (the plain arm's, request for request);
  on the plain arm streamed = non-streamed; n/a where the model has no chat template
  or the server parses no tool call;
- ``reject``: on a server started with the spec arm's drafter zeroed (it proposes
  token 0 every time: every draft rejected, confirmed by the server's counters),
  exactly plain decode's tokens, no stray or placeholder id, usage = those tokens;
  n/a on the plain arm and for model-free speculation;
- ``leak``: the same request (greedy with logprobs; and seeded) as the fresh server's
  first request = after every other check's requests and unrelated ones with
  ``logit_bias``, a seed, a stop, a stream, a chat and a long prompt;
- ``liveness``: ``/health`` (or ``/v1/models``) answers, and ``/v1/models``;
- ``speculation``: the spec arm drafted tokens (the server's ``/metrics``
  counters, or draft/accept counters in ``usage``/``timings``); 0 drafted =
  ``not-engaged``; no counters = ``cannot-grade``.

**Prompt fidelity.** Before the checks (:func:`prompt_fidelity`), two completions prompts:
where the server's ``usage.prompt_tokens`` differs from the prompt's length for both, it does
not complete the prompt as sent (a chat template, an injected system message): ONE finding, in
the ``identity`` cell, and every check of ``GATED`` (judged against plain decode of the prompt)
reads ``cannot-grade`` pointing there. A row that declares the server's wrapping
(``Reference.completion_prompt`` / ``wrap``, from ``ServedEngine.completions_wrap``) is judged
against plain decode of the wrapped prompt, while ``usage.prompt_tokens`` agrees with it.

A server that stops answering fails the case in progress (``ServerDown``) and
every later check of the arm is ``cannot-grade`` without waiting again.
"""

from __future__ import annotations

from subjects.http_client import HttpClient, ServerDown, ServerError

# the checks register themselves, in this order (declaration order is the checks' order)
# isort: off
from subjects.served import checks_output  # noqa: F401  (registration)
from subjects.served import checks_state  # noqa: F401  (registration)
from subjects.served import checks_server  # noqa: F401  (registration)
# isort: on
from subjects.served.cells import (
    STATUSES,
    CannotGrade,
    CaseResult,
    CellResult,
    Finding,
    Unsupported,
    cell_from_cases,
)
from subjects.served.counters import SpecCounters, health_counters, metrics, speculation_cell
from subjects.served.ctx import Ctx
from subjects.served.declare import CHECKS, Check, check, check_names, declare, gated, titles
from subjects.served.orchestrate import learn_dialect, prompt_fidelity, run_checks
from subjects.served.plan import BUDGETS, MAX_BUDGET, TOP_K, Plan, PromptInfo, make_plan
from subjects.served.reference import LOGPROB_ATOL, LOGPROB_RTOL, Reference, compare
from subjects.served.wire import Dialect, Reply, Request, dialect, send

SERVER_CHECKS = check_names()  # the checks declared by this package (a check declared later: check_names())

__all__ = ["BUDGETS", "CHECKS", "LOGPROB_ATOL", "LOGPROB_RTOL", "MAX_BUDGET", "SERVER_CHECKS", "STATUSES", "TOP_K",
           "CannotGrade", "CaseResult", "CellResult", "Check", "Ctx", "Dialect", "Finding", "HttpClient", "Plan",
           "PromptInfo", "Reference", "Reply", "Request", "ServerDown", "ServerError", "SpecCounters", "Unsupported",
           "cell_from_cases", "check", "check_names", "compare", "declare", "dialect", "gated", "health_counters",
           "learn_dialect", "make_plan", "metrics", "prompt_fidelity", "run_checks", "send", "speculation_cell",
           "titles"]
