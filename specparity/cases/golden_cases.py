"""The cases that have golden traces: which (zoo pair, prompt, params) each golden set covers.

A runner declares its golden sets (``specparity.runners.registry.GoldenSet``) in its own
module of ``specparity/runners/``; the cases of each set are built here:

- :func:`default_cases`: the engine's and mlx-lm's goldens: every zoo pair × γ ∈ {1, 3} ×
  2 prompts, 32 tokens, greedy, the plain decode of each (target, prompt), and the
  logits-processor cases (:func:`processor_cases`);
- :func:`deepspec_cases`: DeepSpec's (torch) block-drafter goldens on the zoo ``gemma4``;
- :func:`mtp_draft_cases`, :func:`native_draft_cases`, :func:`assistant_draft_cases`: the
  draft-level goldens (``specparity/runners/draft_goldens.py``).
"""

from __future__ import annotations

from typing import Any

from specparity.cases.case import Case, pick_prompts, spec_matrix

GOLDEN_GAMMAS = (1, 3)
GOLDEN_PROMPTS = 2
GOLDEN_MAX_TOKENS = 32


def default_cases() -> list[Any]:
    """Every zoo pair × γ ∈ {1, 3} × 2 prompts (one natural, one random), 32
    tokens, greedy, plus the plain decode of each (target, prompt)."""
    import zoo

    prompt_ids = pick_prompts([p.id for p in zoo.prompts()], GOLDEN_PROMPTS)
    spec = spec_matrix(zoo.pairs(), prompt_ids, GOLDEN_GAMMAS, GOLDEN_MAX_TOKENS)
    plains = list(dict.fromkeys(c.plain() for c in spec))
    return [*plains, *spec, *processor_cases()]


def processor_cases() -> list[Any]:
    """Logits-processor goldens (``Case.processors``, engine.sampler.ProcessorParams tags):
    ``+hlast`` spec cases start the history where mlx-lm's speculative_generate_step does (both
    runners); the default (whole-prompt) history in spec mode is the engine's alone (mlx-lm
    refuses it: known entry mlx-lm-spec-processor-history-omits-prompt), in plain mode both."""
    n = GOLDEN_MAX_TOKENS
    return [
        # rewarding repetition over a short context: a wrong history flips picks, so these
        # catch the planted history bugs of conformance/test_logits_processors.py
        Case("llama", "twin", "nat-00", 3, n, processors="fp-1c8+hlast"),
        Case("llama", "twin", "nat-00", 3, n, processors="rp0.7c6+hlast"),
        Case("llama", "twin", "nat-00", 3, n, temperature=0.8, processors="rp0.7c6+fp-0.5c8+hlast"),
        Case("llama", "twin", "nat-00", 3, n, temperature=0.8, processors="pp-1.5c4+fp1c16+hlast"),
        Case("qwen3", "twin", "nat-01", 1, n, processors="fp-1c8+hlast"),
        Case("llama", "small", "rnd-01", 3, n, temperature=0.8, processors="pp0.5c20+fp1c64+lb5=1.5,7=-2+hlast"),
        Case("llama", "twin", "nat-00", 3, n, processors="rp1.3c64"),
        Case("llama", "twin", "nat-00", 3, n, processors="lb5=1.5,7=-2"),
        Case("llama", None, "nat-00", 0, n, processors="rp1.3c64"),
        Case("qwen3", None, "nat-01", 0, n, processors="fp-1c8"),
    ]


DEEPSPEC_PROMPTS = ("nat-03", "nat-09", "nat-22", "rnd-14", "rnd-15")
DEEPSPEC_MAX_TOKENS = 14


def deepspec_cases() -> list[Any]:
    """DeepSpec (torch) goldens: the zoo ``gemma4`` target + its DeepSpec-format drafter
    (block 4), confidence thresholds 0 and 0.5, five prompts short enough that prompt +
    budget + block stays inside the target's 32-token sliding window, 14 tokens; plus
    EOS-inside-accepted-drafts cases (an extra EOS id, 281, that the drafter proposes
    and the target accepts mid-block); plus the non-K≡V drafter (v_proj + v_norm).
    Regenerate with DeepSpec present (README "DSpark block drafters")."""
    out = [Case("gemma4", f"deepspec-t{t}", p, 4, DEEPSPEC_MAX_TOKENS, source="deepspec")
           for t in ("0", "0.5") for p in DEEPSPEC_PROMPTS]
    out += [Case("gemma4", f"deepspec-t{t}", p, 4, DEEPSPEC_MAX_TOKENS, eos_ids=(1, 281), source="deepspec")
            for t in ("0", "0.5") for p in ("nat-09", "nat-03")]
    # the v_proj + v_norm path (attention_k_eq_v False), taps [0]: also run by mlx-vlm
    out += [Case("gemma4", f"deepspec-kv-t{t}", p, 4, DEEPSPEC_MAX_TOKENS, source="deepspec")
            for t in ("0", "0.5") for p in ("nat-03", "rnd-14")]
    return out


MTP_HEADS = ("qwen35-mtp", "qwen35-mtp-self")
MTP_PROMPTS = ("nat-00", "nat-02", "rnd-00")
MTP_GAMMAS = (1, 2)  # the zoo MTP heads' block_size is 3
MTP_MAX_TOKENS = 24
ASSISTANT_HEADS = ("gemma4-assistant", "gemma4-assistant-self", "gemma4-assistant-centroid-self")
ASSISTANT_PROMPTS = ("nat-03", "rnd-14")  # prompt + budget + block inside gemma4's 32-token window
ASSISTANT_GAMMAS = (1, 3)
ASSISTANT_MAX_TOKENS = 14


NATIVE_PROMPTS = ("nat-00", "nat-01", "rnd-00")
NATIVE_GAMMAS = (1, 2)  # mlx-vlm's splitter writes block_size = depth + 2 = 3


def native_draft_cases() -> list[Any]:
    """``native-mtp`` on the Qwen ``mtp.*`` checkpoint (``zoo/native_mtp.py`` ``qwen35-native``),
    the family mlx-vlm implements: the qwen conventions with §3's pre-norm hidden (mlx-vlm's
    draft logits are recorded on its pre-norm target adapter, as for ``mlx_vlm_mtp``)."""
    return [Case("qwen35-native", "native+hidden=pre-norm", p, g, MTP_MAX_TOKENS, source="native-mtp")
            for p in NATIVE_PROMPTS for g in NATIVE_GAMMAS]


def mtp_draft_cases() -> list[Any]:
    return [Case("qwen35", h, p, g, MTP_MAX_TOKENS, source="mtp")
            for h in MTP_HEADS for p in MTP_PROMPTS for g in MTP_GAMMAS]


def assistant_draft_cases() -> list[Any]:
    return [Case("gemma4", h, p, g, ASSISTANT_MAX_TOKENS, source="assistant")
            for h in ASSISTANT_HEADS for p in ASSISTANT_PROMPTS for g in ASSISTANT_GAMMAS]
