"""Runner declaration: ``engine``, the engine under our contract (``engine/executor.py``).

Plain decode (``plain_generate``) and speculative decode (``spec_generate``) with
every §3 source (each declared kind, ``engine/sources/<kind>.py``), every case option.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

from specparity.cases.golden_cases import default_cases
from specparity.runners.registry import CaseRun, GoldenSet, Runner, sources

OPTIONS = ("sampling", "top_p", "top_k", "min_p", "eos_ids", "stop_sequences", "logits_processors", "kv_cache",
           "grammar", "reasoning_end", "min_tokens", "rng_position")


def run(x: CaseRun) -> list[dict[str, Any]]:
    from engine.executor import plain_generate, spec_generate
    from specparity.runners import generation_params, open_for_case

    case = x.case
    params = generation_params(case, x.target.eos_ids)
    if case.grammar:
        params = replace(params, grammar=compile_grammar(case.grammar, x.target, params.eos_ids,
                                                         case.reasoning_end))
    if case.drafter is None:
        result = plain_generate(x.target.model, x.ids, params)
    else:  # every source kind: its descriptor opens it (specparity.runners.open_for_case)
        src = open_for_case(case, x.target)
        params = replace(params, gamma=src.gamma, prefill=src.prefill)  # as the header says
        result = spec_generate(x.target.model, src.make(), x.ids, params)
    return [*result.records, result.footer()]


def compile_grammar(ref: str, target: Any, eos_ids: tuple[int, ...], reasoning_end: str = "") -> Any:
    """A case's grammar (zoo name or file) compiled against the target's tokenizer and vocabulary
    (engine.grammar.Grammar); the EOS ids are the ones its mask allows at the end; a
    reasoning-end marker text is encoded with the target tokenizer."""
    from engine.grammar import Grammar, GrammarError, model_vocab_size
    from zoo.grammars import spec

    g = Grammar.for_tokenizer(spec(ref), target.tokenizer, model_vocab_size(target.model), eos_ids,
                              reasoning_end)
    why = g.empty_language()  # never a run that "succeeds" with an empty output
    if why is not None:
        raise GrammarError(f"--grammar {ref}: admits no output on {Path(str(target.path)).name}'s "
                           f"tokenizer: {why}; check the grammar")
    return g


class EveryKind(Mapping[str, frozenset[str]]):
    """``plain`` and every declared source kind (``engine/sources/<kind>.py``), each with every
    option: derived on each read, so a kind declared in-process is one the engine runs."""

    def _all(self) -> dict[str, frozenset[str]]:
        from engine.sources import names

        return sources(OPTIONS, "plain", *names())

    def __getitem__(self, key: str) -> frozenset[str]:
        return self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


RUNNER = Runner(
    name="engine",
    kind="engine",
    package="specparity",
    sources=EveryKind(),
    run=run,
    header=lambda: {"name": "engine", "package": "specparity", "version": metadata.version("specparity")},
    rank=0,
    # its code: every engine/**/*.py (the zoo's outputs are inputs of their own)
    goldens=(GoldenSet("engine", "specparity", ("engine",), cases=default_cases, oracle=False),),
)
