"""Per-position confidence-threshold calibration (§4.1 "Calibration").

Reference: mlx-bun ``src/spec/dspark/calibration.ts`` ``fitStsThresholds``:
per block position, the smallest threshold τ whose Laplace-smoothed
``P(accepted | conf >= τ) = (a + 1) / (n + 2)`` meets the target; position 0
→ 0 (never pruned); under-sampled positions (fewer than ``min_samples``
observations) → 0 (do not prune on thin evidence); a target no τ reaches →
1.0. This fits the RELEASED reference's scheduler shape (per-position
threshold truncation on sigmoid confidence), not the paper's STS/Alg 1.
Observations come from greedy UNPRUNED rounds (:func:`observations`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def fit_thresholds(
    samples: Sequence[Sequence[tuple[float, bool]]],
    target: float = 0.5,
    min_samples: int = 20,
) -> list[float]:
    """``samples[k]`` = ``(confidence, accepted)`` pairs of block position ``k``."""
    out: list[float] = []
    for k, pairs in enumerate(samples):
        if k == 0 or len(pairs) < min_samples:
            out.append(0.0)
            continue
        chosen = 1.0
        for tau in sorted({c for c, _ in pairs}):
            kept = [acc for c, acc in pairs if c >= tau]
            if (sum(kept) + 1) / (len(kept) + 2) >= target:
                chosen = float(tau)
                break
        out.append(chosen)
    return out


def observations(rounds: Iterable[dict[str, Any]], gamma: int) -> list[list[tuple[float, bool]]]:
    """Per-position ``(confidence, accepted)`` from unpruned round records.

    Position ``k`` of a round was accepted when ``k < k_accept``; positions
    past the drafts (budget-clipped rounds) are not observed.
    """
    out: list[list[tuple[float, bool]]] = [[] for _ in range(gamma)]
    for r in rounds:
        conf = r.get("confidence") or []
        for k in range(min(len(r["drafts"]), len(conf), gamma)):
            out[k].append((float(conf[k]), k < int(r["k_accept"])))
    return out


def calibrate(path: Any, target_model: Any, prompts: Sequence[Sequence[int]], *, target: float = 0.5,
              max_tokens: int = 32, min_samples: int = 20, write: bool = True) -> list[float]:
    """Run greedy unpruned rounds with the drafter at ``path``, fit, patch ``dspark.json``."""
    from engine.dspark.module import save_thresholds
    from engine.executor import GenerationParams, spec_generate
    from engine.sources.dspark import DSparkProvider

    provider = DSparkProvider(path, confidence_threshold=0.0, calibrating=True)
    rounds: list[dict[str, Any]] = []
    for ids in prompts:
        res = spec_generate(target_model, provider, list(ids),
                            GenerationParams(max_tokens=max_tokens, gamma=provider.gamma, cache_digests=False))
        rounds += [r for r in res.records if r["type"] == "round"]
    th = fit_thresholds(observations(rounds, provider.gamma), target=target, min_samples=min_samples)
    if write:
        save_thresholds(path, th)
    return th
