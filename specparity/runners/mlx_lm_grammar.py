"""Runner declarations: mlx-lm + a grammar through its ``logits_processors`` (``oracles/mlx_lm_grammar.py``).

- ``mlx_lm_grammar``: the history-pure llguidance processor (the reference for
  plain + grammar, and mlx-lm's speculative loop with the same processor);
- ``mlx_lm_grammar_stateful``: the stateful processor shape MLX adapters use
  (mlx-vlm's ``LLGuidanceLogitsProcessor``, outlines/xgrammar mlxlm): correct in
  plain decode, measured under mlx-lm's speculative loop (known entry
  ``mlx-lm-spec-stateful-grammar-processor-drifts``);
outlines 1.3's own MLXLM processors (``oracles/outlines_mlxlm.py``) constrain to
their own languages (free JSON whitespace, their own regex engine), so they are not
compared with the engine case by case: ``conformance/test_grammar.py`` checks
their speculative runs against their own plain runs (``tox -e grammar-outlines``).

Grammar cases only (the option ``grammar`` is required: without a grammar these
are ``mlx_lm``).
"""

from __future__ import annotations

from typing import Any

from specparity.runners.registry import CaseRun, Runner, oracle_availability, sources

PLAIN_OPTIONS = ("sampling", "top_p", "top_k", "min_p", "eos_ids", "grammar")
# Greedy only under speculation: mlx-lm samples every verify row (d + 1 draws a round) and masks
# the drafter too, the engine walks k + 1 rows with a free drafter, so a sampled run draws
# differently by design and only greedy output is comparable.
SPEC_OPTIONS = ("eos_ids", "grammar")


def grammar_sources(*extra: str) -> dict[str, frozenset[str]]:
    """The options a grammar runner of mlx-lm's loops takes per source (plain, two-model), plus ``extra``
    (shared with ``xgrammar_mlxlm``, the same loops with xgrammar's processor)."""
    return {**sources((*PLAIN_OPTIONS, *extra), "plain"), **sources((*SPEC_OPTIONS, *extra), "two-model")}


NAMES = {"pure": "mlx_lm_grammar", "stateful": "mlx_lm_grammar_stateful", "xgrammar": "xgrammar_mlxlm"}


def _marker(case: Any, tokenizer: Any, processor: str) -> dict[str, Any]:
    """``reasoning_end`` ids (the case's marker text encoded with the target tokenizer, as the
    engine encodes it); only the history-pure processor has the reasoning phase."""
    if not getattr(case, "reasoning_end", ""):
        return {}
    from traces.reference import ReferenceRefused

    if processor != "pure":
        raise ReferenceRefused(NAMES[processor], case.case_id, "no reasoning-end marker in this processor shape")
    ids = tokenizer.encode(case.reasoning_end, add_special_tokens=False)
    return {"reasoning_end": [int(t) for t in getattr(ids, "ids", ids)]}


def grammar_run(processor: str) -> Any:
    """The ``run`` of the grammar runner whose processor shape is ``processor`` (:data:`NAMES`)."""
    def run(x: CaseRun) -> list[dict[str, Any]]:
        from oracles import mlx_lm_grammar as oracle
        from traces.reference import ReferenceRefused
        from zoo.grammars import spec

        case = x.case
        if not case.grammar:
            raise ReferenceRefused(oracle.NAME, case.case_id, "a grammar case only (--grammar FILE)")
        g = spec(case.grammar)
        cfg = getattr(x.target.model, "args", None)
        vocab = getattr(cfg, "vocab_size", None) or (getattr(cfg, "text_config", None) or {}).get("vocab_size")
        try:
            return oracle.run(
                x.target.model, x.target.tokenizer, x.ids,
                grammar_kind=g.kind, grammar_text=g.text, vocab_size=int(vocab), processor=processor,
                draft=x.draft.model if x.draft is not None else None,
                gamma=case.gamma, max_tokens=case.max_tokens, temperature=case.temperature,
                top_p=case.top_p, top_k=case.top_k, min_p=case.min_p, seed=case.seed,
                eos_ids=list(case.eos_ids) if case.eos_ids is not None else None,
                **_marker(case, x.target.tokenizer, processor),
            )
        except (oracle.GrammarRunError, ReferenceRefused) as exc:  # mlx-lm raised mid-run
            msg = exc.message if isinstance(exc, ReferenceRefused) else str(exc)
            raise ReferenceRefused(NAMES[processor], case.case_id, msg.splitlines()[0]) from None

    return run


RUNNERS = (
    Runner(
        name="mlx_lm_grammar",
        kind="reference",
        package="mlx-lm",
        sources=grammar_sources("reasoning_end"),  # the history-pure processor's reasoning phase
        run=grammar_run("pure"),
        available=oracle_availability("mlx_lm_grammar"),
        install_hint="pip install 'specparity[oracles]'  (mlx-lm>=0.32,<0.33, llguidance)",
        rank=11,
        requires=frozenset({"grammar"}),
    ),
    Runner(
        name="mlx_lm_grammar_stateful",
        kind="reference",
        package="mlx-lm",
        sources=grammar_sources(),
        run=grammar_run("stateful"),
        available=oracle_availability("mlx_lm_grammar_stateful"),
        install_hint="pip install 'specparity[oracles]'  (mlx-lm>=0.32,<0.33, llguidance)",
        rank=12,
        requires=frozenset({"grammar"}),
    ),
)
