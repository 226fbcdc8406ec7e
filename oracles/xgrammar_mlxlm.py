"""xgrammar's mlx-lm logits processor in mlx-lm's own loops (a third-party adapter under test).

xgrammar 0.2.9 ``xgrammar/contrib/mlxlm.py`` ``XGrammarLogitsProcessor``: built on
``xgrammar.GrammarMatcher`` over a ``CompiledGrammar`` (``GrammarCompiler`` +
``TokenizerInfo.from_huggingface``, as the module's ``main`` builds it); its
``__call__(tokens, logits)`` does ``accept_token(tokens[-1])`` (first call: the
last prompt token), and when the matcher refuses the token ``reset()`` then
``accept_token(tokens[-1])`` again, fills the next-token bitmask and applies it
with ``apply_token_bitmask_mlx`` (an ``mx.compile``d gather: runs on any MLX
backend, kept as is); once terminated it applies no mask. The class is handed
to mlx-lm 0.32.2 ``generate_step`` / ``speculative_generate_step`` unmodified
through ``oracles.mlx_lm_grammar`` (``processor="xgrammar"``).

Own environment: ``tox -e grammar-xgrammar`` (xgrammar needs torch; not a
harness dependency). xgrammar compiles JSON schema (``any_whitespace=False``:
the engine's compact language) and regex; Lark grammars are not driven (xgrammar
reads EBNF). Compared with its own plain runs, like outlines
(``conformance/test_grammar.py``).
"""

from __future__ import annotations

from typing import Any

from oracles import OracleUnavailable
from oracles import mlx_lm_grammar as _base

NAME = "xgrammar_mlxlm"


def require() -> None:
    _base.require()
    try:
        import xgrammar  # noqa: F401
        from xgrammar.contrib import mlxlm  # noqa: F401
    except ImportError as exc:
        raise OracleUnavailable("xgrammar is not installed") from exc


def run(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    return _base.run(*args, **{"processor": "xgrammar", **kwargs})
