"""Zoo fixtures for structured output: grammars, JSON prompts and the JSON-capable pairs.

The zoo's shared tokenizer (``zoo/tokenizer.json``, HF ``tokenizers`` byte-level
BPE, 512 ids: the 256 byte tokens plus merges, see ``build_tokenizer.py``) can
spell ANY UTF-8 text, JSON included, so every zoo target is a JSON-capable
target and no second tokenizer or model is needed: :func:`spells` checks it
(round trip through the tokenizer, and through llguidance's own view of it).
The JSON-capable pairs the run's zoo matrix uses cover the three cache kinds:
``llama`` (KVCache), ``gemma3`` (RotatingKVCache, window 32) and ``qwen35``
(gated-DeltaNet ArraysCache), each with drafter ``twin``.

Grammars (``engine.grammar.GrammarSpec``), referenced by name in cases
(``Case.grammar``) or as a file path (``--grammar FILE``):

- ``json-small``: an object with a boolean, an integer in [0, 99] and an enum:
  completes in ~30 tokens, so termination and EOS land inside the budget;
- ``json-item``: a nested object with a bounded string and a bounded array;
- ``regex-sentence``: a permissive regex (any text without braces, ending in
  ``.`` or ``!``): free drafts are mostly allowed, so rounds accept drafts and
  grammar termination lands mid-burst;
- ``lark-list``: a Lark grammar (comma-separated words ending in ``.``).

Reference: llguidance 1.9 (``LLMatcher.grammar_from_json_schema`` /
``grammar_from_regex`` / ``grammar_from_lark``); ``jsonschema`` validates outputs.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

JSON_SMALL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
JSON_ITEM: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 2},
        "meta": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
                 "additionalProperties": False},
    },
    "required": ["id", "name", "tags", "meta"],
    "additionalProperties": False,
}
REGEX_SENTENCE = r"[^{}<>|]{4,60}[.!]"
LARK_LIST = 'start: item ("," item)* "."\nitem: /[a-z ]{1,12}/\n'

GRAMMARS: dict[str, tuple[str, str]] = {
    "json-small": ("json", json.dumps(JSON_SMALL, sort_keys=True)),
    "json-item": ("json", json.dumps(JSON_ITEM, sort_keys=True)),
    "regex-sentence": ("regex", REGEX_SENTENCE),
    "lark-list": ("lark", LARK_LIST),
}

# Prompts for grammar cases: the zoo's own (text) prompts plus JSON-shaped ones, which give a
# model-free (ngram) drafter earlier JSON to copy from.
JSON_PROMPTS: dict[str, str] = {
    "json-00": 'Answer in JSON. {"n":7,"ok":true,"tag":"blue"} {"n":12,"ok":false,"tag":"red"} ',
    "json-01": 'Items: {"id":3,"meta":{"x":true},"name":"ab","tags":["a"]} next: ',
}

# The JSON-capable zoo pairs of the run's matrix, one per cache kind (the twin drafter: real
# accepts and rejections), with their prompt: the rotating target gets a short text prompt, so
# the ring-wrap guard stops speculating only inside the run (a JSON prompt is longer than its
# 32-token window: the guard would never let it speculate).
PAIRS: tuple[tuple[str, str, str], ...] = (
    ("llama", "twin", "json-00"), ("gemma3", "twin", "nat-03"), ("qwen35", "twin", "json-00"))


def spec(ref: str) -> Any:
    """A zoo grammar by name, or a grammar file (``.json`` schema, ``.regex``, ``.lark``)."""
    from engine.grammar import GrammarSpec

    if ref in GRAMMARS:
        kind, text = GRAMMARS[ref]
        return GrammarSpec(kind, text, ref)
    return _file_spec(str(Path(ref).expanduser().resolve()), _mtime(ref))


def _mtime(ref: str) -> int:
    try:
        return Path(ref).expanduser().stat().st_mtime_ns
    except OSError:
        return -1


@cache
def _file_spec(path: str, mtime: int) -> Any:
    from engine.grammar import GrammarSpec

    return GrammarSpec.from_file(path)


def label(ref: str) -> str:
    """The grammar's label in case ids: the zoo name, or ``<file stem>-<8 hex of its text>``."""
    return ref if ref in GRAMMARS else spec(ref).tag


def schema_of(ref: str) -> dict[str, Any] | None:
    """The JSON schema of a JSON grammar (for ``jsonschema`` validation), else None."""
    s = spec(ref)
    return json.loads(s.text) if s.kind == "json" else None


@cache
def _tokenizer() -> Any:
    from tokenizers import Tokenizer

    import zoo

    return Tokenizer.from_file(str(zoo.tokenizer_path()))


def prompt_ids(prompt_id: str) -> tuple[int, ...]:
    """Token ids of a grammar prompt (``json-*``) or of a zoo prompt."""
    if prompt_id in JSON_PROMPTS:
        return tuple(_tokenizer().encode(JSON_PROMPTS[prompt_id], add_special_tokens=False).ids)
    import zoo

    return tuple(zoo.prompt(prompt_id).token_ids)


def marker_ending_at(output: list[int], j: int, max_tokens: int = 3) -> str | None:
    """A reasoning-end marker for the zoo (engine.grammar ``reasoning_end``) made of tokens a zoo
    model actually emitted: the text of ``output[j-m+1 : j+1]`` (m = 1..``max_tokens``, shortest
    first) that the zoo tokenizer encodes back to exactly those ids and whose first occurrence in
    ``output`` ends at ``j`` -- so with that marker the free part of a greedy run is ``output[:j+1]``
    and the grammar applies from output position ``j + 1``. None when no such text exists (a token
    inside a UTF-8 sequence)."""
    tok = _tokenizer()
    for m in range(1, max_tokens + 1):
        if j - m + 1 < 0:
            break
        ids = list(output[j - m + 1 : j + 1])
        text = tok.decode(ids)
        if "\ufffd" in text or tok.encode(text, add_special_tokens=False).ids != ids:
            continue
        first = next(e for e in range(m - 1, len(output)) if list(output[e - m + 1 : e + 1]) == ids)
        if first == j:
            return str(text)
    return None


def spells(text: str) -> bool:
    """Whether the zoo tokenizer round-trips ``text`` (byte-level BPE: every UTF-8 text)."""
    tok = _tokenizer()
    return bool(tok.decode(tok.encode(text, add_special_tokens=False).ids) == text)


_SUFFIX = {"json": ".json", "regex": ".regex", "lark": ".lark"}


def ref_from_header(block: dict[str, Any]) -> str:
    """A grammar reference (zoo name or file) for a trace header's ``params.grammar`` block.

    A zoo grammar with the recorded digest is named as such; any other grammar's
    recorded text is written once, content-addressed, under
    ``$SPECPARITY_CACHE_DIR/grammars`` (default ``~/.cache/specparity/grammars``),
    so ``grade`` re-runs the case with the grammar the trace was made under.
    """
    import hashlib

    from engine.grammar import GrammarError, GrammarSpec

    kind, name, text = block.get("kind"), str(block.get("name") or "grammar"), block.get("text")
    shown = name if len(name) <= 80 else f"{name[:60]}…({len(name)} characters)"
    if name in GRAMMARS and spec(name).digest == block.get("sha256"):
        return name
    if not isinstance(text, str) or kind not in _SUFFIX:
        raise GrammarError(f"trace header params.grammar {shown!r}: no grammar text to re-run it with")
    g = GrammarSpec(str(kind), text, name)
    if g.digest != block.get("sha256"):
        raise GrammarError(f"trace header params.grammar {shown!r}: its text does not match its sha256")
    from traces import env

    root = env.get("SPECPARITY_CACHE_DIR", Path.home() / ".cache" / "specparity")
    path = root / "grammars" / hashlib.sha256(g.digest.encode()).hexdigest()[:16] / (
        "".join(c if c.isalnum() or c in "-_." else "_" for c in name[:100]) + _SUFFIX[str(kind)])
    if not path.exists():  # a unique temp name: concurrent writers (parallel test workers) never share one
        from traces.io import atomic_write_text

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    return str(path)
