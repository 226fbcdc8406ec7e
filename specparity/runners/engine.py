"""Runner declaration: ``engine``, the engine under our contract (``engine/executor.py``).

Plain decode (``plain_generate``) and speculative decode (``spec_generate``) with
every §3 source, every case option.
"""

from __future__ import annotations

from dataclasses import replace
from importlib import metadata
from typing import Any

from specparity.runners.registry import CaseRun, Runner, sources

OPTIONS = ("sampling", "top_p", "top_k", "eos_ids", "stop_sequences", "logits_processors", "kv_cache",
           "grammar", "reasoning_end")


def run(x: CaseRun) -> list[dict[str, Any]]:
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.sampler import SamplerParams
    from engine.sources import make_provider
    from engine.sources.two_model import TwoModelProvider
    from specparity.runners import (
        DSPARK_SOURCES,
        HEAD_SOURCES,
        NATIVE_SOURCE,
        dspark_drafter,
        kv_params,
        native_conventions,
        processor_params,
    )

    case = x.case
    params = GenerationParams(
        max_tokens=case.max_tokens,
        gamma=case.gamma,
        sampler=SamplerParams(temperature=case.temperature, top_p=case.top_p, top_k=case.top_k,
                              processors=processor_params(case)),
        seed=case.seed,
        eos_ids=case.eos_ids if case.eos_ids is not None else x.target.eos_ids,
        stop_sequences=case.stop_sequences,
        rotating=case.rotating,
        **kv_params(case),
    )
    if case.grammar:
        params = replace(params, grammar=compile_grammar(case.grammar, x.target, params.eos_ids,
                                                         case.reasoning_end))
    if case.drafter is None:
        result = plain_generate(x.target.model, x.ids, params)
    elif case.source in DSPARK_SOURCES:
        assert x.dpath is not None
        provider = make_provider(case.source, model=x.dpath, confidence_threshold=dspark_drafter(case)[1])
        params = replace(params, prefill="full" if case.source == "deepspec" else params.prefill)
        result = spec_generate(x.target.model, provider, x.ids, params)
    elif case.source == "two-model":
        provider = TwoModelProvider(x.draft.model, draft_tokenizer=x.draft.tokenizer)
        provider.check_target(x.target.model, x.target.tokenizer)
        result = spec_generate(x.target.model, provider, x.ids, params)
    elif case.source == "ngram":
        result = spec_generate(x.target.model, make_provider("ngram", gamma=case.gamma), x.ids, params)
    elif case.source == NATIVE_SOURCE:
        provider = make_provider(case.source, path=x.dpath, conventions=native_conventions(case))
        result = spec_generate(x.target.model, provider, x.ids, params)
    elif case.source in HEAD_SOURCES:
        result = spec_generate(x.target.model, make_provider(case.source, path=x.dpath), x.ids, params)
    else:  # unreachable: the registry refuses an undeclared source first
        raise ValueError(f"the engine runner has no source {case.source!r} yet")
    return [*result.records, result.footer()]


def compile_grammar(ref: str, target: Any, eos_ids: tuple[int, ...], reasoning_end: str = "") -> Any:
    """A case's grammar (zoo name or file) compiled against the target's tokenizer and vocabulary
    (engine.grammar.Grammar); the EOS ids are the ones its mask allows at the end; a
    reasoning-end marker text is encoded with the target tokenizer."""
    from engine.grammar import Grammar, model_vocab_size
    from zoo.grammars import spec

    return Grammar.for_tokenizer(spec(ref), target.tokenizer, model_vocab_size(target.model), eos_ids,
                                 reasoning_end)


RUNNER = Runner(
    name="engine",
    kind="engine",
    package="specparity",
    sources=sources(OPTIONS, "plain", "two-model", "ngram", "mtp", "assistant", "deepspec", "dspark",
                    "native-mtp"),
    run=run,
    header=lambda: {"name": "engine", "package": "specparity", "version": metadata.version("specparity")},
    rank=0,
)
