"""Recording a reference's forwards from outside, shared by the oracle runners.

A runner wraps the reference's model(s) in ``CallRecorder`` — a transparent
proxy whose ``__call__`` runs the real model unchanged and appends
``("call", role, token_ids, margins)`` to a log — and rebuilds round records
from that log. Margins (top-1 minus top-2 logit per position) are diagnostic,
never compared. Deliberately independent of ``engine`` (runners are separate
witnesses).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def top2_margins(block: Any) -> list[float]:
    """Top-1 minus top-2 logit for every row of a ``[T, V]`` block."""
    import mlx.core as mx

    top = mx.topk(block.astype(mx.float32), 2, axis=-1)
    return [float(m) for m in mx.abs(top[:, 0] - top[:, 1]).tolist()]


def accept_walk(
    drafts: list[int], targets: list[int], eos: set[int] | frozenset[int], produced: int, budget: int,
) -> tuple[list[int], list[int], int, str]:
    """A round record's ``samples, emitted, k_accept, end`` from a reference's greedy picks.

    mlx-lm 0.32.2 ``speculative_generate_step``'s accept loop, as the runners
    that rebuild rounds from a reference's own picks (``targets[p]``: the
    target's pick after window position ``p``) need it: walk the window, stop
    at an EOS (counted, never emitted), at the budget (``produced`` tokens
    emitted before this round, ``budget`` in all), or after the first pick
    that is not the draft (``correction``; ``bonus`` when every draft matched).
    """
    samples: list[int] = []
    emitted: list[int] = []
    k, end = 0, "bonus"
    for p in range(len(drafts) + 1):
        t = targets[p]
        samples.append(t)
        matched = p < len(drafts) and t == drafts[p]
        k += matched
        if t in eos:
            end = "eos"
            break
        emitted.append(t)
        if produced + len(emitted) == budget:
            end = "budget"
            break
        if not matched:
            end = "correction" if p < len(drafts) else "bonus"
            break
    return samples, emitted, k, end


class CallRecorder:
    """Transparent proxy over a model that logs each forward.

    ``before(role, token_ids)``, when given, runs before the real forward
    (the mlx-lm runner digests the caches there).
    """

    def __init__(
        self,
        model: Any,
        log: list[tuple],
        role: str = "target",
        before: Callable[[str, list[int]], None] | None = None,
    ) -> None:
        self._model = model
        self._log = log
        self._role = role
        self._before = before

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        tokens = [int(t) for t in inputs[0].tolist()]
        if self._before is not None:
            self._before(self._role, tokens)
        out = self._model(inputs, *args, **kwargs)
        logits = out[0] if isinstance(out, tuple) else out
        self._log.append(("call", self._role, tokens, top2_margins(logits[0])))
        return out
