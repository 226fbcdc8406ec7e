"""outlines 1.3's MLXLM grammar processors in mlx-lm's own loops (a third-party adapter under test).

outlines 1.3.3 ``outlines/models/mlxlm.py`` ``MLXLM.generate_stream`` passes
``logits_processors=[<the output type's processor>]`` and its inference kwargs
(``draft_model``, ``num_draft_tokens``) to mlx-lm 0.32.2 ``stream_generate``; this
runner builds that same processor through outlines' own API
(``outlines.from_mlxlm`` + ``outlines.backends.get_*_logits_processor``, default
backend per type: ``OutlinesCoreLogitsProcessor`` for JSON schema and regex,
``LLGuidanceLogitsProcessor`` for a Lark CFG) and hands it to mlx-lm exactly so,
through ``oracles.mlx_lm_grammar`` (``processor="outlines"``). Both processors keep
per-call state (``is_first_token``; advance on ``input_ids[-1]``). Only their
Metal mask kernels are replaced by the same mask on the CPU. Own environment:
``tox -e grammar-outlines`` (outlines is not a dependency of the harness).

Not a per-case runner of the registry: outlines constrains to its own language
(its JSON schema compiler allows free whitespace; outlines-core's regex engine is
its own), so its runs are compared with its own plain runs, not with the engine
(``conformance/test_grammar.py``).
"""

from __future__ import annotations

from typing import Any

from oracles import OracleUnavailable
from oracles import mlx_lm_grammar as _base

NAME = "outlines_mlxlm"


def require() -> None:
    _base.require()
    try:
        import outlines  # noqa: F401
        import outlines_core  # noqa: F401
    except ImportError as exc:
        raise OracleUnavailable("outlines is not installed; run tox -e grammar-outlines "
                                "(pip install outlines==1.3.3)") from exc


def run(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    return _base.run(*args, **{"processor": "outlines", **kwargs})
