"""Runner declaration: xgrammar's ``contrib/mlxlm.py`` processor in mlx-lm's loops (``oracles/xgrammar_mlxlm.py``).

xgrammar 0.2.9 ``XGrammarLogitsProcessor`` driven unmodified through
``oracles.mlx_lm_grammar`` (``processor="xgrammar"``) under mlx-lm 0.32.2
``generate_step`` / ``speculative_generate_step``; own environment
``tox -e grammar-xgrammar`` (xgrammar needs torch). Grammar cases only, JSON
schema and regex (xgrammar reads EBNF: a Lark grammar is refused). Its plain
decode constrains to xgrammar's own languages (its regex engine, its JSON schema
compiler), so per-case comparison with the engine is informative only;
``conformance/test_grammar.py`` grades its speculative runs against its own plain
runs (known entry ``xgrammar-mlxlm-spec-processor-resets``). No mask digests.
"""

from __future__ import annotations

from specparity.runners.mlx_lm_grammar import grammar_run, grammar_sources
from specparity.runners.registry import Runner, oracle_availability

RUNNER = Runner(
    name="xgrammar_mlxlm",
    kind="reference",
    package="xgrammar",
    sources=grammar_sources(),
    run=grammar_run("xgrammar"),
    available=oracle_availability("xgrammar_mlxlm"),
    install_hint="tox -e grammar-xgrammar  (pip install torch xgrammar 'specparity[oracles]')",
    rank=13,
    requires=frozenset({"grammar"}),
)
