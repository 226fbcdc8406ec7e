"""The strict tier: tool-call scaffold rows compiled by scaffold probing (§7, §7.3, §7.4).

Mirrors mlx-bun ``src/fill/schema-rows.ts`` as §7 of
``speculative-decoding.md`` describes it: render the SAME conversation several
ways through the model's own chat template (a plain-content reply, a call of
each of the request's tools with two different argument values, with and
without arguments, a probe name), tokenize each rendering, and diff the id
sequences. The compiler knows nothing about tool-call syntax: JSON
``<tool_call>``, Qwen3.5's ``<function=…>``/``<parameter=…>`` and GLM's
``<arg_key>`` compile through the same diff.

Rows (all ``assert``):

- **scaffold** — triggered by the first id where a call rendering diverges from
  a plain-content rendering (the model's own ``<tool_call>``), through the ids
  all the request's tools share; with one tool, through the sole required key.
- **name** — per tool, when several: triggered by the last shared id plus the
  tool's own disambiguating id(s), through the punctuation to the arguments and,
  when the schema has exactly one required property, the key itself.
- **close** — only when EVERY tool takes exactly one required argument: after
  the value's complete closing delimiter, through the end of the call (cut
  before the end-of-turn EOS: ending the turn stays the model's decision).

Serialization invariants: every row is sliced from a rendering with the REAL
tool names and keys (the diffs only decide where to cut, so every cut is a token
boundary of a producible stream; never ``encode(fragment)``); every trigger
carries letters, leading whitespace-only ids dropped; a row shorter than 2 ids
is not made. :func:`check_rows` is the id-containment gate (not text
containment): a row whose text appears in a real rendering over different ids
is reported with the first differing position.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.fill.proposal import MIN_SPAN, Proposal, TokenView
from traces.diff import common_prefix

VALUE_PROBES = ("Qz", "47")  # different first characters and classes: different first ids
PROSE_PROBES = ("Okay.", "7 ways")
NAME_PROBE = "zzalphatoolqq"


class ChatTokenizer(Protocol):
    """What the compiler needs of a tokenizer (a transformers ``PreTrainedTokenizer``)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def decode(self, ids: Any, **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class Row:
    kind: str  # "scaffold" | "name" | "close"
    tool: str | None  # None: shared by every tool of the request
    trigger: tuple[int, ...]
    ids: tuple[int, ...]
    # where it was sliced: the tool whose real rendering holds trigger + ids, and the index
    source_tool: str = ""
    at: int = 0


@dataclass
class ScaffoldPlan:
    """The compiled rows of one request, plus the real renderings they were sliced from."""

    rows: tuple[Row, ...]
    delimiters: frozenset[int]
    renderings: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tool -> call turn ids
    reason: str = ""  # why no rows, when none


def _name(tool: dict[str, Any]) -> str:
    return str(tool.get("function", tool)["name"])


def required_of(tool: dict[str, Any]) -> list[str]:
    fn = tool.get("function", tool)
    return list((fn.get("parameters") or {}).get("required") or [])


def _call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}


def _suffix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


class _Renderer:
    def __init__(self, tok: ChatTokenizer, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]):
        self.tok = tok
        self.messages = list(messages)
        self.tools = list(tools)
        self.primer_text = self._render(self.messages, True)
        self.primer_ids = self._encode(self.primer_text)

    def _render(self, messages: list[dict[str, Any]], gen: bool) -> str:
        return str(self.tok.apply_chat_template(messages, tools=self.tools, add_generation_prompt=gen,
                                                tokenize=False))

    def _encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def turn(self, reply: dict[str, Any]) -> tuple[int, ...] | None:
        """The assistant turn's ids after the generation primer, or None when the rendering does
        not extend the primer. A primer that stops being an id prefix (a merge across the
        boundary) is cut at the text boundary and the suffix tokenized on its own (§7.3)."""
        full = self._render([*self.messages, reply], False)
        if not full.startswith(self.primer_text):
            return None
        ids = self._encode(full)
        if ids[: len(self.primer_ids)] == self.primer_ids:
            return tuple(ids[len(self.primer_ids) :])
        return tuple(self._encode(full[len(self.primer_text) :]))


def _letters(tok: ChatTokenizer, t: int) -> bool:
    return any(unicodedata.category(ch).startswith("L") for ch in tok.decode([t]))


def _blank(tok: ChatTokenizer, t: int) -> bool:
    return tok.decode([t]).strip() == ""


def _anchor(tok: ChatTokenizer, ids: Sequence[int], start: int, stop: int) -> int | None:
    """End (exclusive) of a trigger that starts at ``start`` and runs through its first id
    carrying letters, or None when none does before ``stop``."""
    for j in range(start, stop):
        if _letters(tok, ids[j]):
            return j + 1
    return None


def compile_rows(tok: ChatTokenizer, messages: Sequence[dict[str, Any]],
                 tools: Sequence[dict[str, Any]], eos_ids: Sequence[int] = ()) -> ScaffoldPlan:
    """Compile the strict rows of one request by scaffold probing (module docstring)."""
    if not tools:
        return ScaffoldPlan((), frozenset(), reason="no tools")
    r = _Renderer(tok, messages, tools)
    prose = [r.turn({"role": "assistant", "content": p}) for p in PROSE_PROBES]
    if any(p is None for p in prose):
        return ScaffoldPlan((), frozenset(), reason="a plain reply does not extend the primer")
    eos = set(eos_ids)
    calls: dict[str, list[tuple[int, ...]]] = {}
    empty: dict[str, tuple[int, ...]] = {}
    for tool in tools:
        name, req = _name(tool), required_of(tool)
        probes = [r.turn(_call(name, dict.fromkeys(req, v))) for v in VALUE_PROBES]
        bare = r.turn(_call(name, {}))
        if any(p is None for p in probes) or bare is None:
            return ScaffoldPlan((), frozenset(), reason=f"a call of {name} does not extend the primer")
        calls[name] = [p for p in probes if p is not None]
        empty[name] = bare
    names = list(calls)
    real = {n: calls[n][0] for n in names}
    # the template must render the call and its name: otherwise no rows (degrade to no fill)
    probe_name = r.turn(_call(NAME_PROBE, {}))
    if any(real[n] == prose[0] for n in names) or probe_name is None or any(
            empty[n] == probe_name for n in names):
        return ScaffoldPlan((), frozenset(), real, reason="the template does not render tool calls by name")
    d0 = min(common_prefix(real[n], p) for n in names for p in prose if p is not None)
    # where each tool's argument object starts / its first value starts
    ends: dict[str, int] = {}
    for n in names:
        a, b = calls[n]
        value_at = common_prefix(a, b)
        args_at = common_prefix(a, empty[n])
        ends[n] = value_at if len(required_of(next(t for t in tools if _name(t) == n))) == 1 else args_at
    shared = min(common_prefix(real[n], real[m]) for n in names for m in names if m != n) if len(names) > 1 \
        else len(real[names[0]])
    rows: list[Row] = []
    first = names[0]
    trig_end = _anchor(tok, real[first], d0, len(real[first]))
    if trig_end is not None:
        stop = min(shared, min(ends.values()))
        ids = real[first][trig_end:stop]
        if len(ids) >= MIN_SPAN:
            rows.append(Row("scaffold", None, tuple(real[first][d0:trig_end]), tuple(ids), first, d0))
    if len(names) > 1:
        for n in names:
            own = max(common_prefix(real[n], real[m]) for m in names if m != n)
            end = _anchor(tok, real[n], own, ends[n])
            if end is None or own == 0:
                continue
            start = max(min(shared, own) - 1, d0)
            ids = real[n][end : ends[n]]
            if len(ids) >= MIN_SPAN:
                rows.append(Row("name", n, tuple(real[n][start:end]), tuple(ids), n, start))
    delimiters: set[int] = set()
    closes: dict[tuple[int, ...], tuple[int, ...]] = {}
    one_arg = all(len(required_of(t)) == 1 for t in tools)
    for n in names:
        a, b = calls[n]
        suffix = len(a) - _suffix_len(a, b)
        j = suffix
        while j < len(a) and _blank(tok, a[j]):
            j += 1
        if j < len(a) and a[j] not in eos:
            delimiters.add(a[j])
        if not one_arg:
            continue
        end = _anchor(tok, a, j, len(a))
        if end is None:
            continue
        end = min(end + 1, len(a))  # wait for the complete closing delimiter (§7.4)
        tail = list(a[end:])
        for i, t in enumerate(tail):
            if t in eos:
                tail = tail[:i]
                break
        if len(tail) >= MIN_SPAN:
            trig = tuple(a[j:end])
            if closes.setdefault(trig, tuple(tail)) != tuple(tail):
                closes[trig] = ()  # two tools disagree after the same trigger: no row
            elif not any(x.kind == "close" and x.trigger == trig for x in rows):
                rows.append(Row("close", None, trig, tuple(tail), n, j))
    rows = [x for x in rows if not (x.kind == "close" and closes.get(x.trigger) == ())]
    return ScaffoldPlan(tuple(rows), frozenset(delimiters), real)


def _contains(hay: Sequence[int], needle: Sequence[int]) -> int:
    n = len(needle)
    for i in range(len(hay) - n + 1):
        if tuple(hay[i : i + n]) == tuple(needle):
            return i
    return -1


def check_rows(plan: ScaffoldPlan, tok: ChatTokenizer) -> list[str]:
    """The id-containment gate: every row's ``trigger + ids`` must be a contiguous id
    sequence of a real rendering. Text containment is not enough (a probe-name boundary
    gives byte-identical text over different ids); each failure names the row and the
    first position where its ids leave the rendering's."""
    problems = []
    for k, row in enumerate(plan.rows):
        seq = (*row.trigger, *row.ids)
        hits = [n for n, ids in plan.renderings.items() if _contains(ids, seq) >= 0]
        if hits:
            continue
        text = tok.decode(list(seq))
        where = ""
        for n, ids in plan.renderings.items():
            full = tok.decode(list(ids))
            c = full.find(text)
            if c < 0:
                continue
            # the rendering's ids from the one holding char c, compared position by position
            pos, acc = 0, ""
            while pos < len(ids) and len(acc) + len(tok.decode([ids[pos]])) <= c:
                acc += tok.decode([ids[pos]])
                pos += 1
            j = common_prefix(seq, ids[pos:])
            got = seq[j] if j < len(seq) else None
            want = ids[pos + j] if pos + j < len(ids) else None
            where = (f"; its text {text!r} IS in the {n} rendering (char {c}) but the ids differ at row "
                     f"position {j} (trigger {len(row.trigger)} + ids): row id {got} "
                     f"{tok.decode([got]) if got is not None else ''!r} where the rendering has id {want} "
                     f"{tok.decode([want]) if want is not None else ''!r} (text-identical, ids divergent)")
            break
        problems.append(f"row {k} ({row.kind}{':' + row.tool if row.tool else ''}): trigger {list(row.trigger)} "
                        f"+ ids {list(row.ids)} is not id-contained in any real rendering{where}")
    return problems


class StrictSource:
    """Assert proposals from a compiled plan: a row fires when the ids EMITTED so far (never
    the prompt) end with its trigger."""

    name = "strict"
    policies = frozenset({"assert"})

    def __init__(self, plan: ScaffoldPlan) -> None:
        self.plan = plan

    def propose(self, view: TokenView) -> Proposal | None:
        em = view.emitted
        for row in self.plan.rows:
            n = len(row.trigger)
            if len(em) >= n and tuple(em[-n:]) == row.trigger:
                return Proposal(row.ids, "assert", f"strict:{row.kind}" + (f":{row.tool}" if row.tool else ""))
        return None
