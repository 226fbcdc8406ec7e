"""Runner declaration: ``hf_prompt_lookup``, transformers' ``PromptLookupCandidateGenerator``
(``oracles/hf_prompt_lookup.py``): compared by its conformance test, not per case."""

from __future__ import annotations

from specparity.runners.registry import Runner, oracle_availability

RUNNER = Runner(
    name="hf_prompt_lookup",
    kind="reference",
    package="transformers+torch",
    available=oracle_availability("hf_prompt_lookup"),
    install_hint="tox -e hf  (pip install 'specparity[hf]': torch==2.13.0 CPU + transformers)",
    elsewhere="the transformers prompt-lookup reference is compared by "
              "conformance/test_ngram_references.py (tox -e hf), not per `specparity run` case",
    rank=40,
)
