"""Structured output under speculation: the constrained verify walk (§2, "Grammar × spec").

Contract (``../shared/reference/speculative-decoding.md`` §2, deliberate
deviation "Grammar × spec"; mlx-bun ``src/spec/serve-loop.ts`` ``samplePos``):

- the drafter runs FREE: no grammar mask in the draft lane (processors such as
  repetition penalties still apply there, as in every lane);
- in the accept walk the grammar mask is applied to position ``i``'s logits
  BEFORE position ``i`` is sampled, from the matcher state after the tokens
  emitted so far (the round's accepted prefix included);
- the matcher advances on EMITTED tokens only; the walk stops at the first
  mismatch, so rejected drafts never reach it and no matcher rollback exists;
- grammar termination (the matcher is stopped after an emitted token: the
  grammar is complete and allows nothing but EOS) ends the stream there and
  truncates the round (end ``grammar``); the EOS the mask would force is counted
  like a stopping EOS when it is one of the request's EOS ids (mlx-lm
  ``stream_generate`` accounting), so usage equals plain decode + the same
  grammar through a logits processor;
- EOS and stop-sequence rules are unchanged.

Plain decode uses the same mask on its ``[1, V]`` row through the same
``StepSampler.sample_plain`` call, so greedy spec + grammar equals greedy plain
+ grammar token for token, and the walk draws one sample per walked position
(at temperature > 0 a model-free source consumes the RNG exactly as plain
decode does).

Matcher: llguidance (``llguidance`` 1.9, ``LLMatcher``: Earley parser + lexer
over the tokenizer's byte trie; ``grammar_from_json_schema`` /
``grammar_from_regex`` / ``grammar_from_lark``; ``compute_bitmask``,
``consume_token``, ``is_stopped``). Chosen over xgrammar and outlines-core
because it is one self-contained wheel with no torch dependency (this harness
runs on CPU-only mlx and on CUDA), compiles JSON Schema, regex and Lark from one
API, computes a mask in microseconds with no per-vocabulary precompilation, and
reads any HF fast tokenizer (``llguidance.hf.from_tokenizer``), so the zoo's
byte-level BPE tokenizer spells JSON as is. Nothing here parses grammars.

Trace digests (``traces/INTERPRETING.md`` "Grammar"): ``mask_digest`` is the
sha256 (16 hex) of the allowed-token bitmask (little-endian u32 words, one bit
per id, ``ceil(V / 32)`` words); ``state_digest`` is the sha256 (16 hex) of the
consumed-token count, the accepting/stopped flags and the bitmask of the next
position: two matchers that consumed the same tokens have the same digest, a
matcher advanced on one token more or less almost never does.

Reasoning models (vLLM ``reasoning_parser`` + structured output; mlx-lm server
and outlines setups with a think block) emit free text until a reasoning-end
marker (``</think>``, possibly several tokens) and only then does the grammar
constrain the output. ``reasoning_end`` (token ids: the marker text encoded with
the target tokenizer) gives that: until the EMITTED tokens end with the whole
marker no mask applies (the mask digest is :data:`FREE_DIGEST`) and the matcher
does not advance; the position right after the marker's last token is the first
masked one, from the matcher's fresh state (the marker is never fed to it). The
walk needs nothing else: the phase flips in :meth:`GrammarMatcher.consume` on an
emitted token, so when the marker ends inside a window the following positions
of the same round are masked from the fresh state (vLLM 0.11
``StructuredOutputManager.should_advance`` / ``ReasoningParser.is_reasoning_end``
on the accepted tokens of each step: the same rule, per emitted token).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.sampler import token_ids

GRAMMAR_KINDS = ("json", "regex", "lark")
_SUFFIX_KIND = {".json": "json", ".regex": "regex", ".lark": "lark"}
INSTALL_HINT = "pip install 'llguidance>=1.9,<2' (a dependency of specparity)"


class GrammarError(ValueError):
    """A grammar that does not compile, or a matcher that left the grammar."""


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar as the user gives it: ``kind`` (``json`` schema, ``regex``, ``lark``) and its text.

    ``name`` labels it in case ids (a file's stem); the digest covers the text.
    """

    kind: str
    text: str
    name: str = "grammar"

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if self.kind == "json":
            try:
                schema = json.loads(self.text)
            except ValueError as exc:
                raise GrammarError(f"grammar {self.name!r}: not a JSON schema: {exc}") from None
            if not isinstance(schema, dict):
                raise GrammarError(f"grammar {self.name!r}: a JSON schema must be an object")

    @classmethod
    def from_file(cls, path: str | Path) -> GrammarSpec:
        """Read ``FILE.json`` (JSON Schema), ``FILE.regex`` or ``FILE.lark`` (kind from the suffix)."""
        p = Path(path)
        kind = _SUFFIX_KIND.get(p.suffix.lower())
        if kind is None:
            raise GrammarError(f"--grammar {p}: the suffix must be .json (JSON schema), .regex or .lark")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise GrammarError(f"--grammar {p}: cannot read: {exc}") from None
        if kind == "regex":
            text = text.strip("\r\n")
        return cls(kind, text, p.stem)

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()

    @property
    def tag(self) -> str:
        """Short label for case ids: ``<name>-<8 hex>``."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.name) or "grammar"
        return f"{safe}-{self.digest[:8]}"

    def llguidance_grammar(self) -> str:
        import llguidance

        if self.kind == "json":
            # compact JSON (no free whitespace): the tiny models would otherwise pad forever
            return llguidance.LLMatcher.grammar_from_json_schema(
                self.text, defaults={"whitespace_flexible": False}
            )
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        return llguidance.LLMatcher.grammar_from_lark(self.text)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "sha256": self.digest, "text": self.text}


def require_llguidance() -> None:
    try:
        import llguidance  # noqa: F401
        import llguidance.hf  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised where llguidance is absent
        raise GrammarError(f"grammar-constrained decoding needs llguidance: {INSTALL_HINT}") from exc


def ll_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    """llguidance's view of an HF fast tokenizer, its vocabulary padded to the logits width."""
    require_llguidance()
    import llguidance.hf
    import transformers

    inner = hf_tokenizer
    if not isinstance(inner, transformers.PreTrainedTokenizerFast):
        inner = getattr(inner, "_tokenizer", inner)  # mlx-lm's TokenizerWrapper holds the HF tokenizer
    eos = [int(t) for t in eos_ids] or None
    try:
        return llguidance.hf.from_tokenizer(inner, n_vocab=vocab_size, eos_token=eos)
    except Exception as exc:  # llguidance's own reader (e.g. a WordPiece decoder it cannot map)
        raise GrammarError(f"grammar: llguidance cannot read this model's tokenizer ({exc}); "
                           "grammar-constrained decoding needs a byte-level BPE or SentencePiece "
                           "tokenizer") from exc


def marker_ids(hf_tokenizer: Any, marker: str | Sequence[int]) -> tuple[int, ...]:
    """A reasoning-end marker as token ids: a text is encoded with the target tokenizer
    (no special tokens); ids are taken as they are. An empty text: no marker."""
    if not isinstance(marker, str):
        return tuple(int(t) for t in marker)
    if not marker:
        return ()
    ids = hf_tokenizer.encode(marker, add_special_tokens=False)
    ids = getattr(ids, "ids", ids)
    if not ids:
        raise GrammarError(f"reasoning-end marker {marker!r} encodes to no tokens")
    return tuple(int(t) for t in ids)


def model_vocab_size(model: Any) -> int:
    """The logits width of an mlx-lm model (``args.vocab_size``, or its text model's)."""
    for obj in (model, getattr(model, "language_model", None)):
        args = getattr(obj, "args", None)
        v = getattr(args, "vocab_size", None)
        text_config = getattr(args, "text_config", None)
        if v is None and isinstance(text_config, dict):
            v = text_config.get("vocab_size")
        if isinstance(v, int):
            return v
    raise GrammarError(f"cannot tell the vocabulary size of {type(model).__name__}")


class Grammar:
    """A grammar compiled against one tokenizer; :meth:`matcher` opens a fresh matcher per request."""

    def __init__(self, spec: GrammarSpec, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int],
                 reasoning_end: Sequence[int] = ()) -> None:
        import llguidance

        self.spec = spec
        self.vocab_size = int(vocab_size)
        self.eos_ids = tuple(int(t) for t in eos_ids)
        self.reasoning_end = tuple(int(t) for t in reasoning_end)
        self._tokenizer = tokenizer
        self._grammar = spec.llguidance_grammar()
        err = llguidance.LLMatcher.validate_grammar(self._grammar, tokenizer)
        if err and not err.startswith("WARNING"):
            raise GrammarError(f"grammar {spec.name!r} ({spec.kind}) does not compile: {err.strip()}")

    @classmethod
    def for_tokenizer(
        cls, spec: GrammarSpec, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int],
        reasoning_end: str | Sequence[int] = (),
    ) -> Grammar:
        """``reasoning_end``: the marker text (encoded with ``hf_tokenizer``, no special tokens)
        or its token ids; empty: the grammar applies from the first output token."""
        return cls(spec, ll_tokenizer(hf_tokenizer, vocab_size, eos_ids), vocab_size, eos_ids,
                   marker_ids(hf_tokenizer, reasoning_end))

    def empty_language(self) -> str | None:
        """Why the grammar admits no output at all on this tokenizer (None: it admits some): its
        first constrained position allows no token, or only the end of the output (an EOS
        id), so a constrained run would "succeed" with an empty output."""
        m = self.matcher()
        m.reasoning = False  # the grammar's own first position (after any reasoning marker)
        allowed = m.allowed()
        if not allowed.any():
            return "its first position allows no token of this tokenizer"
        content = allowed.copy()
        content[[t for t in self.eos_ids if 0 <= t < content.size]] = False
        if not content.any():
            return "its first position allows only the end of the output (an EOS id): the empty output"
        return None

    def matcher(self) -> GrammarMatcher:
        import llguidance

        m = llguidance.LLMatcher(self._tokenizer, self._grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"grammar {self.spec.name!r}: {m.get_error()}")
        return GrammarMatcher(m, self.vocab_size, self.eos_ids, self.reasoning_end)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Grammar) and (self.spec, self.vocab_size, self.eos_ids, self.reasoning_end) == (
            other.spec, other.vocab_size, other.eos_ids, other.reasoning_end)

    def __hash__(self) -> int:
        return hash((self.spec, self.vocab_size, self.eos_ids, self.reasoning_end))

    def __repr__(self) -> str:
        marker = f", reasoning_end={list(self.reasoning_end)}" if self.reasoning_end else ""
        return f"Grammar({self.spec.kind}:{self.spec.tag}{marker})"


def bitmask_allowed(bitmask: bytes, vocab_size: int) -> np.ndarray:
    """The allowed ids of an llguidance bitmask (u32 words, bit ``i % 32`` of word ``i // 32``)."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
    if bits.size < vocab_size:
        raise GrammarError(f"grammar mask covers {bits.size} ids, the logits {vocab_size}")
    return bits[:vocab_size].astype(bool)


def _h(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


# The mask digest of a position sampled with no grammar mask (before the reasoning-end marker):
# 16 hex like every mask digest, never the digest of a bitmask (those hash ceil(V/32)*4 bytes).
FREE_DIGEST = _h(b"reasoning: no grammar mask")


class GrammarMatcher:
    """One request's matcher: mask, consume, termination, digests (llguidance ``LLMatcher``)."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: Sequence[int],
                 reasoning_end: Sequence[int] = ()) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.consumed = 0
        self._bitmask: bytes | None = None
        # Reasoning phase (module docstring): free until the emitted tokens end with the marker.
        self.reasoning_end = tuple(int(t) for t in reasoning_end)
        self.reasoning = bool(self.reasoning_end)
        self.free: list[int] = []  # the tokens emitted before the grammar applied (marker included)

    def _marker_done(self) -> bool:
        """Whether the emitted (free) tokens end with the whole reasoning-end marker."""
        n = len(self.reasoning_end)
        return len(self.free) >= n and tuple(self.free[-n:]) == self.reasoning_end

    def bitmask(self) -> bytes:
        if self._bitmask is None:
            self._bitmask = bytes(self._m.compute_bitmask())
        return self._bitmask

    def allowed(self) -> np.ndarray:
        return bitmask_allowed(self.bitmask(), self.vocab_size)

    def mask(self, width: int | None = None) -> mx.array | None:
        """The allowed set as a ``[1, width]`` bool array (ids past the tokenizer: never allowed);
        None before the reasoning-end marker (no mask)."""
        if self.reasoning:
            return None
        allowed = self.allowed()
        width = width or self.vocab_size
        if width != allowed.size:
            pad = np.zeros(width, dtype=bool)
            n = min(width, allowed.size)
            pad[:n] = allowed[:n]
            allowed = pad
        return mx.array(allowed)[None]

    def mask_digest(self) -> str:
        return FREE_DIGEST if self.reasoning else _h(self.bitmask())

    def state_digest(self) -> str:
        if self.reasoning:  # how far into the reasoning, and the tail the marker could still end
            tail = self.free[-(len(self.reasoning_end) - 1):] if len(self.reasoning_end) > 1 else []
            return _h(f"reasoning:{len(self.free)}:{tail}".encode())
        head = f"{self.consumed}:{int(self.accepting)}:{int(self.stopped)}:".encode()
        return _h(head + self.bitmask())

    @property
    def accepting(self) -> bool:
        return not self.reasoning and bool(self._m.is_accepting())

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS), or the matcher failed."""
        return not self.reasoning and bool(self._m.is_stopped())

    def consume(self, token: int) -> None:
        """Advance on one EMITTED token; a token the grammar does not allow raises.

        Before the reasoning-end marker the token is only recorded; the one that completes
        the marker switches the grammar on (the matcher stays at its fresh state)."""
        if self.reasoning:
            self.free.append(int(token))
            self.reasoning = not self._marker_done()
            return
        ok = self._m.consume_token(int(token))
        self._bitmask = None
        if not ok or self._m.is_error():
            raise GrammarError(f"grammar matcher refused token {token} after {self.consumed} tokens: "
                               f"{self._m.get_error().splitlines()[0] if self._m.get_error() else 'error'}")
        self.consumed += 1

    def fork(self) -> GrammarMatcher:
        other = GrammarMatcher(self._m.deep_copy(), self.vocab_size, self.eos_ids, self.reasoning_end)
        other.consumed, other.reasoning, other.free = self.consumed, self.reasoning, list(self.free)
        return other


@dataclass
class WalkResult:
    """One constrained accept walk: what the executor records for the round."""

    walked: list[int]
    emitted: list[int]
    k_accept: int
    end: str
    masks: list[str]


# The hooks a planted-bug test replaces (tests/test_grammar_walk.py): each is one line of the walk.
def _mask_for(matcher: GrammarMatcher, width: int) -> tuple[mx.array | None, str]:
    return matcher.mask(width), matcher.mask_digest()


def constrained_walk(
    sample_row: Callable[[mx.array, int, mx.array | None], mx.array],
    offer: Callable[[int], str | None],
    matcher: GrammarMatcher,
    block: mx.array,
    drafts: Sequence[int],
    terminate: Callable[[], str],
) -> WalkResult:
    """The accept walk of §2 with the grammar mask (exact token-match acceptance).

    ``sample_row(row_logits, i, mask)`` samples window position ``i`` (processors,
    then the mask, then the sampler: ``StepSampler.sample_plain``); ``offer``
    emits a token to the stream and returns its stop kind; ``terminate`` ends
    the stream on grammar termination and returns the round's end.
    """
    d = len(drafts)
    width = int(block.shape[-1])
    walked: list[int] = []
    emitted: list[int] = []
    masks: list[str] = []
    k = 0
    end = "bonus"
    for i in range(d + 1):
        mask, digest = _mask_for(matcher, width)  # the state after every token emitted so far
        masks.append(digest)
        y = sample_row(block[i : i + 1, :], i, mask)
        t = token_ids(y)[0]
        walked.append(t)
        matched = i < d and t == drafts[i]
        if matched:
            k += 1
        stop = offer(t)
        if stop != "eos":
            emitted.append(t)
            matcher.consume(t)  # emitted tokens only
        if stop is not None:
            end = stop
            break
        if matcher.stopped:  # the grammar is complete: the round ends here
            end = terminate()
            break
        if not matched:
            end = "correction" if i < d else "bonus"
            break
    return WalkResult(walked, emitted, k, end, masks)


def grammar_from_header(block: dict[str, Any], hf_tokenizer: Any, vocab_size: int,
                        eos_ids: Sequence[int]) -> Grammar:
    """The grammar a trace header's ``params.grammar`` records (kind, name, text, sha256 and the
    reasoning-end marker text), compiled as the run compiled it (``Grammar.for_tokenizer``)."""
    if not isinstance(block, dict) or not isinstance(block.get("text"), str):
        raise GrammarError("params.grammar must be an object with the grammar's kind and text")
    spec = GrammarSpec(str(block.get("kind")), block["text"], str(block.get("name") or "grammar"))
    if block.get("sha256") not in (None, spec.digest):
        raise GrammarError(f"params.grammar: sha256 {str(block.get('sha256'))[:12]}… does not match its "
                           f"text ({spec.digest[:12]}…)")
    marker = block.get("reasoning_end") or ""
    return Grammar.for_tokenizer(spec, hf_tokenizer, vocab_size, eos_ids, marker)
