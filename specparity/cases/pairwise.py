"""Pairwise sampling cases: every two stages of the sampling pipeline combined at least once.

The stages (``engine/pipeline.py``): temperature, top-p, top-k, min-p (the draw), each logits
processor (repetition, presence, frequency penalty, logit bias), min_tokens and the grammar
mask; and the lane (plain decode or speculation). A bug in how two stages compose — top-p
applied before the logits processors, min-p taken on the temperature-scaled logits, a bias
after the grammar mask — is invisible to a case that sets one of them, and to spec-vs-plain
(both lanes share the pipeline); only a case setting both, compared with a reference that
composes them itself, sees it. The full product of eleven two-level stages is 2,048 cases; a
strength-2 covering array (every pair of levels of every two stages in some case) holds them
in a handful (:func:`covering_array`: 8 reference rows, 8 pipeline rows).

Two arrays, by what can judge them:

- :func:`reference_cases` — the stages mlx-lm 0.32.2 composes itself (``generate_step`` /
  ``speculative_generate_step``: ``make_logits_processors``, then ``make_sampler``'s top-p,
  min-p and top-k on the log-probabilities, in that order, and temperature only in the
  categorical draw): compared with the ``mlx_lm`` runner round for round. Spec rows
  with a history-dependent penalty start the history where mlx-lm's speculative loop does
  (``+hlast``, known entry ``mlx-lm-spec-processor-history-omits-prompt``).
- :func:`pipeline_cases` — those stages plus min_tokens and a grammar, which mlx-lm has no
  form of together, every row speculative with position-keyed draws (``rng="position"``),
  so each equals its plain decode token for token (the default run's spec-vs-plain
  comparison: a stage the verify window composes differently from plain decode shows).

Both are part of the default run (``specparity.jobs.run.zoo_cases``) and of the default
tests (``conformance/test_sampling_pairwise.py``, which also plants top-p before the
processors, and min-p after the temperature, and sees the reference cases catch each). Reference for the method: pairwise
(strength-2) combinatorial testing, the greedy AETG construction (Cohen et al., 1997).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from specparity.cases.case import Case

PAIR = ("llama", "twin")
GAMMA = 3
MAX_TOKENS = 32
PROMPTS = ("nat-00", "rnd-00")

# Two levels a stage: off, then a setting that moves the draw on the tiny zoo (a top-p that
# cuts the nucleus, a min-p of 0.2 that changed the output of all 7 rows of the array before
# it (0.1: 6 of 7), a bias large enough to bring a token into it, a penalty that rewards
# repetition over a short context so a wrong composition flips picks).
STAGES: dict[str, tuple[Any, Any]] = {
    "lane": ("plain", "spec"),
    "temperature": (0.6, 1.0),
    "top_p": (0.0, 0.8),
    "top_k": (0, 8),
    "min_p": (0.0, 0.2),
    "repetition": ("", "rp1.3c16"),
    "presence": ("", "pp-0.8c8"),
    "frequency": ("", "fp-0.5c8"),
    "logit_bias": ("", "lb5=3,7=-2,11=2.5"),
}
PIPELINE_STAGES: dict[str, tuple[Any, Any]] = {
    **{k: v for k, v in STAGES.items() if k != "lane"},  # every row speculative, judged by its plain decode
    "min_tokens": (0, 6),
    "grammar": ("", "json-small"),
}
REFERENCE_PROCESSORS = ("repetition", "presence", "frequency", "logit_bias")


def covering_array(levels: Sequence[int]) -> list[tuple[int, ...]]:
    """A strength-2 covering array: rows of level indexes such that every pair of levels of
    every two factors appears in some row (deterministic greedy: each row the one covering
    the most pairs not yet covered, the first such in product order; then rows the others
    make redundant are dropped, so every row adds a pair)."""
    factors = range(len(levels))
    todo = {(i, a, j, b) for i, j in itertools.combinations(factors, 2)
            for a in range(levels[i]) for b in range(levels[j])}
    rows: list[tuple[int, ...]] = []
    candidates = list(itertools.product(*(range(n) for n in levels)))
    pairs = list(itertools.combinations(factors, 2))

    def gain(row: tuple[int, ...], todo: set[tuple[int, int, int, int]]) -> int:
        return sum((i, row[i], j, row[j]) in todo for i, j in pairs)

    while todo:
        best = max(candidates, key=lambda r: gain(r, todo))  # max keeps the first of equals
        rows.append(best)
        todo -= {(i, best[i], j, best[j]) for i, j in pairs}
    # then drop each row whose pairs the others cover (the greedy's early rows can end redundant)
    k = 0
    while k < len(rows):
        rest = rows[:k] + rows[k + 1:]
        if all(any(r[i] == rows[k][i] and r[j] == rows[k][j] for r in rest) for i, j in pairs):
            rows = rest
        else:
            k += 1
    return rows


def uncovered_pairs(rows: Sequence[dict[str, Any]], stages: dict[str, tuple[Any, Any]]) -> list[str]:
    """The (stage=level, stage=level) pairs no row combines (empty for a covering array)."""
    missing = []
    for a, b in itertools.combinations(stages, 2):
        for va, vb in itertools.product(stages[a], stages[b]):
            if not any(r[a] == va and r[b] == vb for r in rows):
                missing.append(f"{a}={va!r} with {b}={vb!r}")
    return missing


def _rows(stages: dict[str, tuple[Any, Any]]) -> list[dict[str, Any]]:
    names = list(stages)
    return [{n: stages[n][lv] for n, lv in zip(names, row, strict=True)}
            for row in covering_array([len(stages[n]) for n in names])]


def stage_rows(pipeline: bool = False) -> list[dict[str, Any]]:
    """The covering array's rows as ``{stage: level}`` (``pipeline``: with min_tokens and grammar)."""
    return _rows(PIPELINE_STAGES if pipeline else STAGES)


def _processors(row: dict[str, Any]) -> str:
    parts = [row[p] for p in REFERENCE_PROCESSORS if row[p]]
    # the history mlx-lm's speculative loop uses (a penalty's; a bias has no history)
    if row["lane"] == "spec" and any(p[:2] in ("rp", "pp", "fp") for p in parts):
        parts.append("hlast")
    return "+".join(parts)


def row_case(row: dict[str, Any], i: int, *, rng: str = "stream") -> Case:
    """The case of one covering-array row (``i`` picks its prompt and seed)."""
    target, drafter = PAIR
    prompt: str = PROMPTS[i % len(PROMPTS)]
    extra: dict[str, Any] = {}
    if row.get("grammar"):
        from zoo import grammars as G

        target, drafter, prompt = G.PAIRS[0]
        extra.update(grammar=row["grammar"], prompt_tokens=G.prompt_ids(prompt))
    spec = row.get("lane", "spec") == "spec"
    return Case(target, drafter if spec else None, prompt, GAMMA if spec else 0, MAX_TOKENS,
                temperature=row["temperature"], seed=100 + i, top_p=row["top_p"], top_k=row["top_k"],
                min_p=row["min_p"],
                processors=_processors(row) if rng == "stream" else _processors({**row, "lane": "plain"}),
                # position-keyed rows compare spec with plain decode: the whole-prompt history
                min_tokens=row.get("min_tokens", 0), rng=rng, **extra)


def reference_cases() -> list[Case]:
    """The stages mlx-lm composes itself, pairwise, compared with ``mlx_lm`` round for round."""
    return [row_case(r, i) for i, r in enumerate(stage_rows())]


def pipeline_cases() -> list[Case]:
    """Every stage with min_tokens and a grammar, pairwise, position-keyed: spec == plain."""
    return [row_case(r, i, rng="position") for i, r in enumerate(stage_rows(pipeline=True))]


def pairwise_cases(targets: list[str] | None = None, drafters: list[str] | None = None) -> list[Case]:
    """Both arrays (the default run's), or none when the selection leaves out their pairs."""
    from zoo import grammars as G

    keep = {PAIR, G.PAIRS[0][:2]}
    if any((targets is not None and t not in targets) or (drafters is not None and d not in drafters)
           for t, d in keep):
        return []
    return list(dict.fromkeys([*reference_cases(), *pipeline_cases()]))
