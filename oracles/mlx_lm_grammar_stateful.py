"""Oracle runner: mlx-lm + the STATEFUL grammar processor shape (``oracles/mlx_lm_grammar.py``).

The processor whose matcher advances on ``tokens[-1]`` every call (mlx-vlm 0.7.10
``mlx_vlm/structured.py`` ``LLGuidanceLogitsProcessor``; outlines 1.3 / xgrammar
mlxlm adapters), under mlx-lm 0.32.2 ``generate_step`` and
``speculative_generate_step``. All of it lives in ``oracles.mlx_lm_grammar``
(``processor="stateful"``); this module names the runner's reference.
"""

from __future__ import annotations

from typing import Any

from oracles import mlx_lm_grammar as _base

NAME = "mlx_lm_grammar_stateful"
require = _base.require


def run(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    return _base.run(*args, **{**kwargs, "processor": "stateful"})
