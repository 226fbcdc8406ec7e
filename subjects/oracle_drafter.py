"""An "oracle drafter": a draft model that proposes the target's own greedy continuation.

It exercises a subject's accept AND reject paths without any trained drafter:
at absolute position ``p`` it predicts ``seq[p + 1]`` of ``prompt + greedy
continuation`` (computed once by plain greedy decode of the target, mlx-lm
caches, in the subject's own environment), except at positions
``p % (gamma + 1) == corrupt_at`` where it proposes a different token (one
corrupted position in every window of ``gamma + 1``, so each round of a
``gamma``-draft loop meets at most one rejection). It is an mlx-lm-style
model (``model(inputs, cache=cache)`` -> logits, ``layers``, ``make_cache``)
whose single ``KVCache`` only tracks the offset, so the subject's own
trim/rollback of the draft cache decides which positions it predicts next.
"""

from __future__ import annotations

from typing import Any


def greedy_continuation(model: Any, prompt_ids: list[int], n: int) -> list[int]:
    """Plain greedy decode of ``model`` (mlx-lm caches), ``n`` tokens, no EOS stop."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt_ids)[None], cache=cache)
    out: list[int] = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out


class OracleDraft:
    """Draft model proposing ``seq[p + 1]``, corrupted once per ``gamma + 1`` positions."""

    def __init__(self, seq: list[int], vocab: int, gamma: int, corrupt_at: int = 1) -> None:
        self.seq = list(seq)
        self.vocab = vocab
        self.period = gamma + 1
        self.corrupt_at = corrupt_at % self.period
        self.layers = [None]
        self.proposals: list[tuple[int, int]] = []  # (position, proposed token), for the trace

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        return [KVCache()]

    def predict(self, p: int) -> int:
        nxt = self.seq[p + 1] if p + 1 < len(self.seq) else 0
        if p % self.period == self.corrupt_at:
            nxt = (nxt + 1) % self.vocab
        return nxt

    def __call__(self, inputs: Any, cache: Any = None, **_: Any) -> Any:
        import mlx.core as mx

        n = int(inputs.shape[1])
        c = cache[0]
        start = int(c.offset)
        dummy = mx.zeros((1, 1, n, 1))
        c.update_and_fetch(dummy, dummy)
        rows = []
        for i in range(n):
            tok = self.predict(start + i)
            self.proposals.append((start + i, tok))
            rows.append(tok)
        return mx.eye(self.vocab)[mx.array(rows)][None] * 10.0
