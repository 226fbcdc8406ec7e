"""Runner declaration: ``mlx_lm_prompt_cache``, mlx-lm 0.32.2's server prompt cache with a draft
model (``oracles/mlx_lm_prompt_cache.py``: ``LRUPromptCache`` + ``stream_generate`` in process).

Not run per case: a session of requests is its unit. ``specparity run --sessions`` grades it
with the engine's warm ≡ cold checks (``specparity/jobs/sessions.py``), with and without the draft
model; what it gets wrong is in ``traces/known_divergences.toml``.
"""

from __future__ import annotations

from specparity.runners.registry import Runner, oracle_availability, sources

RUNNER = Runner(
    name="mlx_lm_prompt_cache",
    kind="reference",
    package="mlx-lm",
    sources=sources(("sampling",), "plain", "two-model"),
    run=None,
    elsewhere="graded by specparity run --sessions (warm vs cold sessions; docs/prompt-cache.md)",
    available=oracle_availability("mlx_lm_prompt_cache"),
    install_hint="pip install 'specparity[oracles]'  (mlx-lm>=0.32,<0.33)",
    rank=90,
)
