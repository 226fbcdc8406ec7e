"""Quantized DSpark/DeepSpec drafters and their acceptance A/B (§4.3, §4.5 phases 1a–1d).

§4.3: drafter numerics move ACCEPTANCE, never correctness, so the whole quality
gate of a drafter quantization is one paired acceptance A/B on the same target
and prompts at temperature 0. This module writes the mlx affine siblings
(:func:`engine.dspark.deepspec_module.quantize_dir`) and runs the A/B with the
paired harness's own pieces (``specparity.measure.ab``: AB/BA order per prompt, one
untimed warm-up per arm, McNemar on per-emitted-token "accepted draft"
outcomes paired up to the first differing token, bootstrap wall-time ratio,
``reports.stats.ab_verdict``), for drafters the two-model harness cannot load
(a DeepSpec drafter needs the tapped ``deepspec`` source). Each arm also
reports its weight bytes and **acceptance per MiB** (§4.5 exit criterion 3:
the acceptance-per-byte curve).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

from engine.dspark.deepspec_module import quantize_dir

__all__ = ["deepspec_arms", "quantize_dir", "run_drafter_ab"]


def run_drafter_ab(
    target_model: Any,
    arms: dict[str, tuple[Any, int]],
    prompts: list[list[int]],
    *,
    baseline: str,
    max_tokens: int = 32,
    max_drop: float = 3.0,
    eos_ids: tuple[int, ...] = (),
    prefill: str = "full",
    timing: Any = None,
) -> dict[str, Any]:
    """Paired A/B of each arm against ``baseline``.

    Args:
        target_model: The loaded target (mlx-lm model).
        arms: ``{label: (provider, weight_bytes)}``; providers expose ``gamma``.
        prompts: Prompt token ids (the same for every arm).
        baseline: The label of arm A; every other arm is a B.
        timing: ``timing(arm, prompt_index, result) -> seconds`` of each timed run
            (``specparity.measure.ab.Timing``; default: the run's measured wall clock).
    """
    from engine.executor import GenerationParams, spec_generate
    from reports.stats import ab_verdict, median_ratio, paired_drop
    from specparity.measure.ab import (
        accepted_flags,
        common_prefix,
        measured_wall,
        time_ratios,
        timed,
    )

    labels = list(arms)
    gamma = {lab: int(arms[lab][0].gamma) for lab in labels}

    def go(label: str, ids: list[int]) -> Any:
        params = GenerationParams(max_tokens=max_tokens, gamma=gamma[label], eos_ids=eos_ids,
                                  prefill=prefill, cache_digests=False)  # type: ignore[arg-type]
        return spec_generate(target_model, arms[label][0], ids, params)

    for label in labels:  # untimed warm-up
        go(label, prompts[0])
    per: dict[str, list[Any]] = {lab: [] for lab in labels}
    for i, ids in enumerate(prompts):
        order = labels if i % 2 == 0 else list(reversed(labels))
        for label in order:
            per[label].append(go(label, ids))

    secs = timed(per, timing or measured_wall)
    rows = []
    for label in labels:
        res = per[label]
        drafted = sum(r.speculation.drafted for r in res)
        accepted = sum(r.speculation.accepted for r in res)
        tokens = sum(r.usage.generation_tokens for r in res)
        calls = sum(r.speculation.target_calls for r in res)
        nbytes = int(arms[label][1])
        acc = accepted / drafted if drafted else float("nan")
        rows.append({
            "arm": label, "weights_bytes": nbytes, "drafted": drafted, "accepted": accepted,
            "acceptance": round(acc, 4), "acceptance_per_mib": round(acc / (nbytes / 2**20), 4),
            "tau": round(tokens / calls, 4), "tokens": tokens,
            "by_position": [
                round(sum(r.speculation.accepted_by_pos[j] for r in res if j < len(r.speculation.accepted_by_pos))
                      / max(1, sum(r.speculation.drafted_by_pos[j] for r in res
                                   if j < len(r.speculation.drafted_by_pos))), 4)
                for j in range(max(gamma.values()))
            ],
        })
    comparisons = []
    for label in labels:
        if label == baseline:
            continue
        fa: list[bool] = []
        fb: list[bool] = []
        differing = 0
        for ra, rb in zip(per[baseline], per[label], strict=True):
            n = common_prefix(ra.output_ids, rb.output_ids)
            differing += n != len(ra.output_ids) or n != len(rb.output_ids)
            fa += accepted_flags(ra.records)[:n]
            fb += accepted_flags(rb.records)[:n]
        ratios = time_ratios(per[baseline], secs[baseline], per[label], secs[label])
        drop = paired_drop(fa, fb, max_drop_pts=max_drop)
        wall = median_ratio(ratios)
        comparisons.append({
            "a": baseline, "b": label, "units": len(fa), "prompts_with_differing_streams": differing,
            "verdict": ab_verdict(drop, wall).to_dict(),
        })
    return {
        "kind": "drafter-ab", "baseline": baseline, "n_prompts": len(prompts), "max_tokens": max_tokens,
        "order": "rotating per prompt; one untimed warm-up per arm", "arms": rows,
        "comparisons": comparisons, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def deepspec_arms(target: str, variants: tuple[str, ...] = ("", "-q8", "-q4"),
                  confidence_threshold: float = 0.0) -> dict[str, tuple[Any, int]]:
    """``{label: (DeepSpecProvider, bytes)}`` for the zoo DeepSpec drafter and its siblings.

    The bytes are the checkpoint's stored tensor bytes (bf16, or packed
    weights + scales + biases), which is what a quantization saves.
    """
    import mlx.core as mx

    from engine.sources.deepspec import DeepSpecProvider
    from zoo.dspark import artifact_dir

    out = {}
    for v in variants:
        path = Path(artifact_dir(f"{target}-deepspec{v}"))
        tensors = cast(dict[str, Any], mx.load(str(path / "model.safetensors")))
        stored = sum(a.nbytes for a in tensors.values())
        label = {"": "bf16", "-q8": "8-bit", "-q4": "4-bit"}.get(v, v)
        out[label] = (DeepSpecProvider(path, confidence_threshold=confidence_threshold), int(stored))
    return out

