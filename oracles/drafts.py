"""Draft-level records: a compact, comparable digest of one draft step's logits.

Draft goldens (``specparity/runners/draft_goldens.py``) carry, in the trace header's
``draft_logits`` (header objects may carry extra keys, ``traces/INTERPRETING.md``),
one list per round record with one digest per drafted token, recorded from
the reference's own drafter while its round loop runs (mlx-vlm 0.7.10's
``qwen3_5_mtp`` drafter, mlx-optiq 0.7.7's ``GemmaAssistantDrafter``). The
live engine's drafter logits are digested by the same function and compared
step by step (``conformance/test_draft_goldens.py`` holds the comparison and
its bounds, so that changing them stales no golden).

A digest of a ``[V]`` logits row:

- ``sha256``: of the row's float32 bytes (where the engine mirrors the
  reference op for op — the assistant drafter vs optiq — the logits are
  bit-identical, and the reference reproduces its own golden bit for bit on
  the same platform);
- ``top``: the ``TOP`` highest-probability tokens ``[id, log-prob]``
  (log-softmax over the row, 6 decimals), for a comparison within a bound
  where the kernels differ (the MTP head vs mlx-vlm's own decoder layer);
- ``sketch``: ``SKETCH`` fixed random projections (seeded normal vectors) of
  the probability vector, so that a change anywhere in the distribution, not
  only in its top, moves the digest. Probabilities, not log-probs: the
  centroid head's unselected tokens (a ``-1e30`` sentinel) contribute 0.
"""

from __future__ import annotations

import hashlib
from functools import cache
from typing import Any

TOP = 8
SKETCH = 8
SKETCH_SEED = 20261130


@cache
def _projection(vocab: int) -> Any:
    import numpy as np

    return np.random.default_rng(SKETCH_SEED).standard_normal((SKETCH, vocab))


def logits_digest(logits: Any) -> dict[str, Any]:
    """Digest of one draft step's logits (an mlx array or anything numpy converts; ``[V]`` or ``[1, .., V]``)."""
    import numpy as np

    try:
        import mlx.core as mx

        if isinstance(logits, mx.array):
            logits = np.array(logits.astype(mx.float32))
    except ImportError:  # pragma: no cover - mlx is a core dependency
        pass
    row = np.asarray(logits, dtype=np.float32).reshape(-1)
    x = row.astype(np.float64)
    x = np.where(np.isfinite(x), x, -np.inf)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    lp = x - lse
    p = np.exp(lp)
    order = np.argsort(-lp, kind="stable")[:TOP]
    return {
        "sha256": hashlib.sha256(row.tobytes()).hexdigest(),
        "top": [[int(i), round(float(lp[i]), 6)] for i in order],
        "sketch": [round(float(v), 6) for v in _projection(row.size) @ p],
    }
