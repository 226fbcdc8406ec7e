"""Oracle runner: mlx-lm decode + a grammar through mlx-lm's ``logits_processors``.

Reference: mlx-lm 0.32.2 ``mlx_lm/generate.py`` — ``generate_step`` (plain:
the processors see the whole prompt + the emitted tokens, one call per step,
one step ahead) and ``speculative_generate_step`` (the SAME processors on
every draft step and every verify row, 2γ+1 calls a round, with a history
``prev_tokens`` that starts at the last prompt token, grows by the drafts /
the target's own row samples and is cut back to the emitted tokens after each
round). mlx-lm runs UNMODIFIED through ``oracles.mlx_lm.run`` (its recorder and
trace rebuild); the only thing this module adds is the processor list, handed
in where ``oracles.mlx_lm.run`` asks ``mlx_lm.sample_utils.make_logits_processors``
for it. The matcher is llguidance 1.9 ``LLMatcher`` (the engine's matcher, so
masks are comparable digest for digest), compiled here from the grammar text
(this layer never imports ``engine``).

Two processors:

- :class:`HistoryPureProcessor` — the correct adapter: the matcher state is a
  function of the history alone (the generated part, ``history[skip:]``),
  recomputed from a fresh matcher each call. Under speculation it
  masks drafts and verify rows from their own histories, so it never drifts.
- :class:`StatefulProcessor` — the adapter shape MLX users run: mlx-vlm 0.7.10
  ``mlx_vlm/structured.py`` ``LLGuidanceLogitsProcessor.__call__`` (first call:
  set up; every later call: ``consume_token(input_ids[-1])``, raise on a matcher
  error), as outlines 1.3's mlxlm backends and xgrammar's ``contrib/mlxlm.py``
  also advance on the last token of each call. Correct in plain decode (one
  call per emitted token); under speculative decoding it consumes draft inputs
  and verify rows that are later cut back, and never rolls back (known entry
  ``mlx-lm-spec-stateful-grammar-processor-drifts``).

Mask digests: every processor call logs ``(role, forward index, digest)`` where
the role is the model whose forward produced the logits (a transparent proxy
over each model marks it); the trace's plain records get ``grammar_mask`` (the
digest the sample was drawn under) and rounds get ``grammar_masks`` (the
verify rows' digests for the walked positions), as ``traces/INTERPRETING.md``
"Grammar" defines them.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from oracles import OracleUnavailable

NAME = "mlx_lm_grammar"
PROCESSORS = ("pure", "stateful", "mlx_vlm", "outlines", "outlines_llguidance", "xgrammar")
# The mask digest logged for a call made before the reasoning-end marker (no mask applied):
# the same 16 hex as engine.grammar.FREE_DIGEST (this layer never imports engine).
FREE_DIGEST = hashlib.sha256(b"reasoning: no grammar mask").hexdigest()[:16]


def require() -> None:
    try:
        import llguidance  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised where a package is absent
        raise OracleUnavailable("mlx-lm and llguidance (a specparity dependency) are needed") from exc


def ll_grammar(kind: str, text: str) -> str:
    """The llguidance grammar of a ``json`` schema / ``regex`` / ``lark`` text (compact JSON)."""
    import llguidance

    if kind == "json":
        return str(llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False}))
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(text))
    if kind == "lark":
        return str(llguidance.LLMatcher.grammar_from_lark(text))
    raise ValueError(f"unknown grammar kind {kind!r}")


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    import llguidance.hf
    import transformers

    inner = tokenizer if isinstance(tokenizer, transformers.PreTrainedTokenizerFast) else tokenizer._tokenizer
    return llguidance.hf.from_tokenizer(inner, n_vocab=vocab_size, eos_token=list(eos_ids))


def _digest(bitmask: bytes) -> str:
    return hashlib.sha256(bitmask).hexdigest()[:16]


def _apply(logits: Any, bitmask: bytes) -> Any:
    """``-inf`` where the llguidance bitmask (u32 words, bit ``i % 32`` of word ``i // 32``) is 0."""
    import mlx.core as mx
    import numpy as np

    width = int(logits.shape[-1])
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:width].astype(bool)
    if bits.size < width:
        bits = np.concatenate([bits, np.zeros(width - bits.size, dtype=bool)])
    return mx.where(mx.array(bits)[None], logits, mx.array(-mx.inf, logits.dtype))


class _Roles:
    """Which model's forward produced the logits the next processor call sees."""

    def __init__(self) -> None:
        self.role = "target"
        self.forwards = {"target": -1, "draft": -1}
        self.calls: list[tuple[str, int, str]] = []  # (role, forward index, mask digest)

    def log(self, digest: str) -> None:
        self.calls.append((self.role, self.forwards[self.role], digest))


class _Marked:
    """Transparent proxy over a model: marks its forwards for :class:`_Roles`."""

    def __init__(self, model: Any, role: str, roles: _Roles) -> None:
        self._model, self._role, self._roles = model, role, roles

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._roles.role = self._role
        self._roles.forwards[self._role] += 1
        return self._model(*args, **kwargs)


def after_marker(generated: list[int], marker: Sequence[int]) -> list[int] | None:
    """The tokens after the first occurrence of ``marker`` in ``generated`` (all of them when
    there is no marker); None while the marker has not been generated in full."""
    n = len(marker)
    if not n:
        return generated
    for end in range(n, len(generated) + 1):
        if generated[end - n : end] == list(marker):
            return generated[end:]
    return None


class HistoryPureProcessor:
    """Grammar mask whose state is a function of ``history[skip:]`` alone (mlx-lm processor API).

    With a reasoning-end marker (token ids) the history is read as vLLM's reasoning
    parsers read it: until it contains the whole marker the call applies no mask (and
    logs :data:`FREE_DIGEST`); after it, the matcher state is that of the tokens after
    the marker's first occurrence (the marker is never fed to the matcher).
    """

    def __init__(self, grammar: str, tokenizer: Any, skip: int, roles: _Roles | None = None,
                 reasoning_end: Sequence[int] = ()) -> None:
        self._grammar, self._tokenizer = grammar, tokenizer
        self._skip = skip
        self._roles = roles
        self._marker = [int(t) for t in reasoning_end]

    def _state(self, generated: list[int]) -> Any:
        # A fresh matcher every call, never a rolled-back one: llguidance 1.9.1 takes an EOS
        # consumed on a stopped matcher as a no-op, and a later rollback(1) then removes the
        # token before it (docs/grammar.md, "llguidance rollback after EOS").
        import llguidance

        m = llguidance.LLMatcher(self._tokenizer, self._grammar, log_level=0)
        for t in generated:
            if not m.consume_token(int(t)):
                raise ValueError(f"history-pure grammar processor: token {t} after {len(generated)} "
                                 f"generated tokens is outside the grammar: {m.get_error()}")
        return m

    def __call__(self, tokens: Any, logits: Any) -> Any:
        history = [int(t) for t in tokens.tolist()] if tokens is not None else []
        generated = after_marker(history[self._skip:], self._marker)
        if generated is None:  # still reasoning: no mask
            if self._roles is not None:
                self._roles.log(FREE_DIGEST)
            return logits
        bitmask = bytes(self._state(generated).compute_bitmask())
        if self._roles is not None:
            self._roles.log(_digest(bitmask))
        return _apply(logits, bitmask)


class StatefulProcessor:
    """mlx-vlm 0.7.10 ``LLGuidanceLogitsProcessor.__call__``'s state logic, mask applied on the CPU.

    First call: a fresh matcher; every later call: ``consume_token(tokens[-1])``
    and raise ``ValueError`` on a matcher error (as mlx-vlm does). Its Metal mask
    kernel is replaced by the same ``-inf`` mask (:func:`_apply`); nothing else differs.
    """

    def __init__(self, grammar: str, tokenizer: Any, roles: _Roles | None = None) -> None:
        self.grammar, self.llg_tokenizer = grammar, tokenizer
        self.is_first_token = True
        self._roles = roles

    def __call__(self, input_ids: Any, logits: Any) -> Any:
        import llguidance

        if self.is_first_token:
            self.matcher = llguidance.LLMatcher(self.llg_tokenizer, self.grammar, log_level=0)
            self.is_first_token = False
        else:
            self.matcher.consume_token(int(input_ids[-1].item()))
            error = self.matcher.get_error()
            if error:
                raise ValueError(f"LLGuidance matcher error: {error}")
        bitmask = bytes(self.matcher.compute_bitmask())
        if self._roles is not None:
            self._roles.log(_digest(bitmask))
        return _apply(logits, bitmask)


@contextmanager
def _mlx_vlm_on_cpu() -> Iterator[Any]:
    """mlx-vlm 0.7.10's own ``LLGuidanceLogitsProcessor`` class, unmodified, with its Metal mask
    kernel (``mlx_vlm.structured._apply_llguidance_mask``) replaced by the same mask on the CPU
    for the duration (the harness runs on Linux CPU and CUDA; the kernel is Metal only)."""
    import mlx.core as mx
    import mlx_vlm.structured as structured
    import numpy as np

    def cpu_mask(logits: Any, mask: Any) -> Any:
        if logits.ndim == 1:
            logits = logits[None, :]
        if mask.ndim == 1:
            mask = mask[None, :]
        bits = np.unpackbits(np.array(mask).view(np.uint8), axis=-1, bitorder="little")
        allowed = mx.array(bits[:, : logits.shape[-1]].astype(bool))
        return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))

    saved = structured._apply_llguidance_mask
    structured._apply_llguidance_mask = cpu_mask
    try:
        yield structured.LLGuidanceLogitsProcessor
    finally:
        structured._apply_llguidance_mask = saved


def _cpu_bitmask_apply(logits: Any, mask_np: Any) -> Any:
    """``apply_token_bitmask(logits, mask)`` of outlines_core / llguidance's MLX kernels, on the CPU."""
    import mlx.core as mx
    import numpy as np

    if logits.ndim == 1:
        logits = logits[None, :]
    mask = np.asarray(mask_np).astype(np.int32)
    if mask.ndim == 1:
        mask = mask[None, :]
    bits = np.unpackbits(mask.view(np.uint8), axis=-1, bitorder="little")[:, : logits.shape[-1]]
    return mx.where(mx.array(bits.astype(bool)), logits, mx.array(-mx.inf, logits.dtype))


@contextmanager
def _outlines_processor(model: Any, tokenizer: Any, kind: str, text: str, backend: str | None) -> Iterator[Any]:
    """outlines 1.3's own processor for an MLXLM model (``outlines.from_mlxlm`` and
    ``outlines.backends.get_*_logits_processor``: what ``model.stream(prompt, output_type,
    draft_model=...)`` hands mlx-lm), unmodified; its Metal mask kernels
    (``outlines_core.kernels.mlx`` / ``llguidance.mlx`` ``apply_token_bitmask``) replaced by
    the same mask on the CPU for the duration. ``backend`` None: outlines' default per type
    (outlines_core for JSON schema and regex, llguidance for a Lark CFG)."""
    import llguidance.mlx as llg_mlx
    import outlines
    import outlines.backends as ob
    import outlines_core.kernels.mlx as oc_mlx

    om = outlines.from_mlxlm(model, tokenizer)
    saved = (oc_mlx.apply_token_bitmask, llg_mlx.apply_token_bitmask)
    oc_mlx.apply_token_bitmask = llg_mlx.apply_token_bitmask = _cpu_bitmask_apply
    try:
        if kind == "json":
            yield ob.get_json_schema_logits_processor(backend or ob.JSON_SCHEMA_DEFAULT_BACKEND, om, text)
        elif kind == "regex":
            yield ob.get_regex_logits_processor(backend or ob.REGEX_DEFAULT_BACKEND, om, text)
        else:
            yield ob.get_cfg_logits_processor(backend or ob.CFG_DEFAULT_BACKEND, om, text)
    finally:
        oc_mlx.apply_token_bitmask, llg_mlx.apply_token_bitmask = saved


def _xgrammar_compiled(tokenizer: Any, kind: str, text: str, vocab_size: int) -> Any:
    """The grammar compiled by xgrammar (``GrammarCompiler`` over ``TokenizerInfo.from_huggingface``,
    as ``contrib/mlxlm.py``'s ``main`` builds it): JSON schema compact (``any_whitespace=False``,
    ``separators=(",", ":")``: the engine's language), regex; a Lark grammar is refused (xgrammar reads GBNF/EBNF)."""
    import transformers
    import xgrammar

    inner = tokenizer if isinstance(tokenizer, transformers.PreTrainedTokenizerFast) else tokenizer._tokenizer
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(inner, vocab_size=vocab_size))
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
    if kind == "regex":
        return compiler.compile_regex(text)
    raise GrammarRunError(f"xgrammar reads EBNF, not a {kind} grammar")


@contextmanager
def _xgrammar_processor(tokenizer: Any, kind: str, text: str, vocab_size: int) -> Iterator[Any]:
    """xgrammar's ``contrib/mlxlm.py`` ``XGrammarLogitsProcessor``, unmodified (its ``__call__``:
    ``accept_token(tokens[-1])``, and on a refused token ``reset()`` then ``accept_token`` again;
    no mask once terminated). Its ``apply_token_bitmask_mlx`` (an ``mx.compile``d gather, runs on
    any MLX backend) is kept as is."""
    from xgrammar.contrib import mlxlm as xg_mlxlm

    yield xg_mlxlm.XGrammarLogitsProcessor(_xgrammar_compiled(tokenizer, kind, text, vocab_size))


@contextmanager
def _processors_given(processors: list[Any]) -> Iterator[None]:
    """``mlx_lm.sample_utils.make_logits_processors`` returns ``processors`` inside the block
    (where ``oracles.mlx_lm.run`` asks it for the list it passes to mlx-lm)."""
    import mlx_lm.sample_utils as su

    saved = su.make_logits_processors
    su.make_logits_processors = lambda **_: list(processors)  # type: ignore[assignment]
    try:
        yield
    finally:
        su.make_logits_processors = saved  # type: ignore[assignment]


class GrammarRunError(RuntimeError):
    """mlx-lm raised inside the run (a stateful processor's matcher error, typically)."""


def run(
    target: Any,
    tokenizer: Any,
    prompt_ids: list[int],
    *,
    grammar_kind: str,
    grammar_text: str,
    vocab_size: int,
    processor: str = "pure",
    draft: Any = None,
    gamma: int = 3,
    max_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = 0,
    eos_ids: list[int] | None = None,
    cache_digests: bool = True,
    reasoning_end: Sequence[int] = (),
) -> list[dict[str, Any]]:
    """Run mlx-lm with the grammar processor on one case; the trace records after the header.

    ``draft=None`` runs plain ``generate_step``, else ``speculative_generate_step``
    with ``num_draft_tokens=gamma``. ``processor``: ``pure`` or ``stateful`` (or a
    third-party adapter: ``mlx_vlm``, ``outlines``, ``outlines_llguidance``, ``xgrammar``).
    ``reasoning_end`` (token ids): the history-pure processor applies the grammar only
    after the marker (:class:`HistoryPureProcessor`); the other processors refuse it.
    Raises :class:`GrammarRunError` when mlx-lm raises mid-run (the processor's error).
    """
    require()
    from oracles import mlx_lm as base

    if processor not in PROCESSORS:
        raise ValueError(f"processor must be one of {PROCESSORS}, got {processor!r}")
    eos = list(eos_ids) if eos_ids is not None else sorted(int(t) for t in tokenizer.eos_token_ids)
    grammar = ll_grammar(grammar_kind, grammar_text)
    llt = ll_tokenizer(tokenizer, vocab_size, eos)
    roles = _Roles()
    spec = draft is not None
    skip = 1 if spec else len(prompt_ids)  # where mlx-lm's processor history starts
    if reasoning_end and processor != "pure":
        raise ValueError(f"processor {processor!r} has no reasoning-end marker (the history-pure one has)")
    with contextlib.ExitStack() as stack:
        if processor == "pure":
            proc: Any = HistoryPureProcessor(grammar, llt, skip, roles, reasoning_end)
        elif processor == "stateful":
            proc = StatefulProcessor(grammar, llt, roles)
        elif processor == "mlx_vlm":  # mlx-vlm's own class (tox -e vlm); no mask digests
            proc = stack.enter_context(_mlx_vlm_on_cpu())(grammar, llt)
        elif processor == "xgrammar":  # xgrammar's contrib/mlxlm.py class (tox -e grammar-xgrammar)
            proc = stack.enter_context(_xgrammar_processor(tokenizer, grammar_kind, grammar_text, vocab_size))
        else:  # outlines 1.3's own processor (tox -e grammar-outlines); no mask digests
            backend = "llguidance" if processor == "outlines_llguidance" else None
            proc = stack.enter_context(_outlines_processor(target, tokenizer, grammar_kind, grammar_text, backend))
        stack.enter_context(_processors_given([proc]))
        try:
            records = base.run(
                _Marked(target, "target", roles), tokenizer, prompt_ids,
                draft=_Marked(draft, "draft", roles) if spec else None,
                gamma=gamma, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                min_p=min_p, seed=seed, eos_ids=eos_ids, cache_digests=cache_digests,
                logits_processors={"grammar": grammar_kind},
            )
        except (ValueError, RuntimeError) as exc:  # a processor's own error (outlines-core: ValueError)
            raise GrammarRunError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    _attach_masks(records, roles.calls)
    return records


def _attach_masks(records: list[dict[str, Any]], calls: list[tuple[str, int, str]]) -> None:
    """Mask digests onto the rebuilt records (plain: one per step; rounds: the verify rows walked)."""
    target_calls = [c for c in calls if c[0] == "target"]
    by_forward: dict[int, list[str]] = {}
    for _, fwd, digest in target_calls:
        by_forward.setdefault(fwd, []).append(digest)
    decode = [by_forward[f] for f in sorted(by_forward)]  # prefill forwards run no processor
    plains = [r for r in records if r["type"] == "plain"]
    for rec, digests in zip(plains, decode, strict=False):
        rec["grammar_mask"] = digests[-1]
    rounds = [r for r in records if r["type"] == "round"]
    for rec, digests in zip(rounds, decode, strict=False):
        rec["grammar_masks"] = digests[: len(rec["samples"])]

