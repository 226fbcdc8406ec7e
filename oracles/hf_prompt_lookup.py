"""Oracle: Hugging Face transformers' prompt-lookup candidate generator.

Reference: transformers 5.24 ``transformers/generation/candidate_generator.py``
``PromptLookupCandidateGenerator.get_candidates`` (torch CPU 2.13.0), driven
unmodified on given token histories: the proposal is what it appends to
``input_ids``. Its rule differs from §3 where ``conformance/reference_rules.toml``
says so (an occurrence may overlap the trailing n-gram; no minimum n-gram size).
"""

from __future__ import annotations

from importlib import metadata

from oracles import OracleUnavailable

NAME = "hf_prompt_lookup"


def require() -> None:
    try:
        import torch  # noqa: F401
        from transformers.generation.candidate_generator import (  # noqa: F401
            PromptLookupCandidateGenerator,
        )
    except ImportError as exc:
        raise OracleUnavailable("torch/transformers missing") from exc


def version() -> str:
    return f"transformers {metadata.version('transformers')}, torch {metadata.version('torch')}"


def propose(history: list[int], n: int, ngram_max: int = 3) -> list[int]:
    """The candidate tokens HF proposes after ``history`` (at most ``n``)."""
    require()
    import torch
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    if n <= 0 or len(history) == 0:
        return []
    gen = PromptLookupCandidateGenerator(
        num_output_tokens=n, max_matching_ngram_size=ngram_max, max_length=len(history) + n + 2
    )
    ids = torch.tensor([history], dtype=torch.long)
    out, _ = gen.get_candidates(ids)
    return [int(t) for t in out[0, len(history) :].tolist()]
