"""The reference a server is judged against (plain greedy decode of the served weights, in process)
and the comparators of a reply with it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from subjects.checks import first_divergence
from subjects.served.wire import Reply, Request

LOGPROB_ATOL = 1e-3
LOGPROB_RTOL = 2.0**-7  # one bf16 ulp, relative: a bf16 logprob rounds within half of it


@dataclass
class Reference:
    """Plain greedy decode of the served weights, in process (built by the grader).

    ``encode``: the tokenizer's encoding of a text (the ids a token-id prompt sends);
    ``chat_prompt``: the prompt ids the server builds for a chat request;
    ``completion_prompt``: the prompt ids the server builds for a completions text prompt where a
    row declares that it wraps it (``wrap``, its description; None: ``encode``, the prompt as sent);
    ``greedy(ids, n)``: (output ids without EOS, ended on EOS);
    ``logprobs(ids, out, k)``: per output position the emitted token's logprob and the
    top-k ``(id, logprob)`` sorted descending, teacher-forced on ``out``; ``prompts``:
    prompt texts to use (each check takes its own, :func:`make_plan`).
    """

    encode: Callable[[str], list[int]]
    chat_prompt: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    greedy: Callable[[tuple[int, ...], int], tuple[list[int], bool]]
    logprobs: Callable[[tuple[int, ...], tuple[int, ...], int], list[tuple[float, list[tuple[int, float]]]]]
    eos_ids: tuple[int, ...]
    prompts: list[str]
    eos_text: tuple[str, ...] = ()
    has_chat_template: bool = True
    bos_id: int | None = None
    completion_prompt: Callable[[str], list[int]] | None = None
    wrap: str | None = None  # the declared wrapping of a completions prompt, in words (None: sent as is)

    def through_chat(self) -> Reference:
        """This reference for a server without ``/v1/completions``: every text prompt is sent as a chat
        message, so the prompt it completes is the chat prompt."""
        return replace(self, completion_prompt=self.chat_prompt,
                       wrap="sent through /v1/chat/completions (the server has no /v1/completions): the "
                            "reference is plain decode of the chat prompt")

    def completion_ids(self, text: str) -> list[int]:
        """The prompt the server builds for a completions request of ``text``."""
        return list(self.completion_prompt(text) if self.completion_prompt is not None else self.encode(text))

    def prompt_ids(self, req: Request) -> list[int]:
        if isinstance(req.prompt, tuple):
            return list(req.prompt)
        return list(self.chat_prompt(req.prompt) if req.chat else self.completion_ids(req.prompt))

    def expect(self, req: Request) -> tuple[list[int], bool]:
        return self.greedy(tuple(self.prompt_ids(req)), req.max_tokens)

    def text_for(self, ids: Sequence[int]) -> str | None:
        """Text whose encoding is exactly ``ids`` (a leading BOS added back by ``encode``), or None."""
        body = list(ids[1:]) if self.bos_id is not None and ids and ids[0] == self.bos_id else list(ids)
        text = self.decode(body)
        return text if list(self.encode(text)) == list(ids) else None


def norm_text(s: str) -> str:
    return re.sub("\ufffd+", "\ufffd", s)


def loose(s: str) -> str:
    """``s`` without U+FFFD: invalid UTF-8 bytes (a byte-level model's garbage, or a character cut by
    the budget) may be replaced or dropped by a server; neither is judged."""
    return s.replace("\ufffd", "")


def nonspace(s: str) -> str:
    return re.sub(r"\s+", "", loose(s))


def stop_view(s: str) -> str:
    """What the stop checks judge of a text: where it ends, its non-space characters (whitespace and
    U+FFFD are the detokenizer's, judged by the stream check)."""
    return nonspace(s)


def token_at(ref: Reference, ids: Sequence[int], char: int) -> int:
    """The index of the reference token whose text covers character ``char``."""
    for k in range(len(ids)):
        if len(norm_text(ref.decode(ids[: k + 1]))) > char:
            return k
    return len(ids)


def splits_utf8(ref: Reference, ids: Sequence[int]) -> bool:
    """Whether some prefix of ``ids`` ends inside a character the whole output decodes (byte-level
    tokenizers: a streamed delta must hold those bytes back)."""
    full = ref.decode(ids)
    for k in range(1, len(ids)):
        pre = ref.decode(ids[:k])
        if pre.endswith("\ufffd"):
            head = pre.rstrip("\ufffd")
            if full.startswith(head) and len(full) > len(head) and full[len(head)] != "\ufffd":
                return True
    return False


def strip_eos(ref: Reference, ids: list[int] | None) -> list[int] | None:
    if ids and ids[-1] in ref.eos_ids:
        return ids[:-1]  # mlx-lm lists the EOS it stopped on (its text is judged by the eos check)
    return ids


def compare(ref: Reference, reply: Reply, ids: list[int], *, exact: bool) -> str | None:
    """Why ``reply`` is not the reference output ``ids`` (None when it is).

    The server's ids when it returned them, else its text against ``decode(ids)``
    (runs of U+FFFD collapsed). ``exact``: the whole output must match; otherwise
    only the common prefix is judged (a length difference belongs to the budget/EOS checks).
    """
    got_ids = strip_eos(ref, reply.ids)
    if not exact and ids and (got_ids == [] or (got_ids is None and not reply.text)):
        return f"no output where plain decode emits {len(ids)} tokens (finish_reason {reply.finish_reason!r})"
    if got_ids is not None:
        i = first_divergence(got_ids, ids) if exact else first_divergence(got_ids[: len(ids)], ids[: len(got_ids)])
        if i is None:
            return None
        a = got_ids[i] if i < len(got_ids) else "<end>"
        b = ids[i] if i < len(ids) else "<end>"
        return f"output token {i}: server id {a} vs plain decode {b} (server {len(got_ids)} tokens, plain {len(ids)})"
    want = nonspace(ref.decode(ids))  # no ids: the text, whitespace and U+FFFD aside (the stream check owns those)
    got = nonspace(reply.text)
    if not exact:
        n = min(len(want), len(got))
        want, got = want[:n], got[:n]
    if got == want:
        return None
    i = next((k for k, (x, y) in enumerate(zip(got, want, strict=False)) if x != y), min(len(got), len(want)))
    tok = next((k for k in range(len(ids)) if len(nonspace(ref.decode(ids[: k + 1]))) > i), len(ids))
    return (f"text differs at non-space character {i} (plain token {tok}): server {got[max(0, i - 12): i + 12]!r} "
            f"vs plain {want[max(0, i - 12): i + 12]!r} (server {len(got)}, plain {len(want)} non-space characters; "
            "no ids came back)")


def text_diff(a: str, b: str, an: str, bn: str) -> str:
    """Where two texts first differ, with a little context (U+FFFD removed by the caller)."""
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return (f"at character {i}: {an} {a[max(0, i - 8): i + 8]!r} vs {bn} {b[max(0, i - 8): i + 8]!r} "
            f"({len(a)} vs {len(b)} chars)")


def text_tail(s: str, n: int = 24) -> str:
    return repr(s if len(s) <= n else "…" + s[-n:]) + f" ({len(s)} chars)"


def logprob_close(a: float, b: float) -> bool:
    return abs(a - b) <= LOGPROB_ATOL + LOGPROB_RTOL * abs(b)
