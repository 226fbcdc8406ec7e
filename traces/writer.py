"""Writing traces from any engine: the writer API for engine authors.

A trace is the contract between an engine and the harness: ``specparity grade
DIR`` reads a folder of them, re-runs plain decode and the live references on
the cases their headers name, and grades the engine round for round. An engine
in Python writes one with this module; an engine in another language writes
the same JSONL by hand, following ``traces/schema.json`` and
``traces/INTERPRETING.md`` (normative: what every field means).

Typical use, one trace per request::

    from traces.writer import EngineTrace, model_identity

    tr = EngineTrace(
        runner={"name": "myengine", "package": "myengine", "version": "1.2"},
        case_id="mymodel/mydraft/p1/g3/n64", prompt_id="p1", prompt_ids=ids,
        target=model_identity("models/target"), drafter=model_identity("models/draft"),
        params={"gamma": 3, "max_tokens": 64, "temperature": 0.0}, eos_ids=[2],
    )
    tr.prefill(target_tokens=ids[:-1], drafter_tokens=ids[:-1])
    # per verify step: the drafter's new input, its drafts, the target's samples
    # at the window positions the accept walk looked at, margins (top1 - top2 raw
    # logit at every window position), what was emitted and why the round ended
    tr.round(feed=[pending], drafts=d, pending=pending, samples=s, k_accept=k,
             emitted=e, end="correction", margins=m)
    tr.write("traces/myengine/p1.jsonl")   # footer derived; atomic (tmp + rename)

``params`` keys not given take the harness defaults (``DEFAULT_PARAMS``). The
footer (usage, speculation counters, output ids) is derived from the records
with the definitions of ``INTERPRETING.md`` (``traces.records.counters_from_rounds``),
so it cannot disagree with them. Cache digests are optional (null); give them
(``traces.digest.cache_digest`` over mlx-lm caches) to have cache state compared.

``model_identity`` computes the digests ``grade`` checks a header against:
``weights_sha256`` over the sorted tensor names, dtypes, shapes and raw bytes
of every ``*.safetensors`` file (independent of file layout), ``config_sha256``
the ``config.json`` bytes. This module imports nothing above ``traces``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from traces.digest import weights_digest
from traces.io import Record, TraceWriter, write_trace
from traces.records import (
    counters_from_rounds,
    make_header,
    strict_float,
    strict_floats,
    strict_int,
    strict_ints,
)

__all__ = [
    "DEFAULT_PARAMS",
    "EngineTrace",
    "TraceWriter",
    "footer_record",
    "make_header",
    "model_identity",
    "weights_sha256",
    "write_trace",
]

DEFAULT_PARAMS: dict[str, Any] = {
    "gamma": None, "max_tokens": 64, "temperature": 0.0, "top_p": 0.0, "top_k": 0, "min_p": 0.0,
    "seed": 0, "prefill": "tail-split", "prefill_step_size": 512, "confidence_threshold": None,
}


def weights_sha256(model_dir: str | os.PathLike[str]) -> str:
    """Canonical digest of a model dir's weights (``traces.digest.weights_digest``; needs mlx)."""
    return weights_digest(model_dir)


def model_identity(model_dir: str | os.PathLike[str], *, digests: bool = True) -> dict[str, Any]:
    """``{"path", "weights_sha256", "config_sha256"}`` of a local model directory.

    ``digests=False`` leaves both digests null (``grade`` then cannot check that
    it re-runs the same model and says so).
    """
    from traces.digest import config_digest

    p = Path(model_dir)
    return {
        "path": str(p),
        "weights_sha256": weights_sha256(p) if digests else None,
        "config_sha256": config_digest(p) if digests else None,
    }


def footer_record(records: Sequence[Record], *, prompt_tokens: int, wall_s: float | None = None,
                  speculative: bool | None = None) -> Record:
    """The footer of ``records`` (prefill/round/plain events, no header).

    usage: ``generation_tokens = len(output_ids)`` plus 1 when the last event
    ended on EOS (mlx-lm counts the EOS step); ``finish_reason`` ``"length"``
    when the budget ended it, else ``"stop"``.
    """
    events = [r for r in records if r.get("type") in ("round", "plain")]
    rounds = [r for r in events if r["type"] == "round"]
    plains = [r for r in events if r["type"] == "plain"]
    output = [strict_int(f"{r['type']}.emitted", t) for r in events for t in r["emitted"]]
    last_end = events[-1]["end"] if events else None
    speculative = bool(rounds) if speculative is None else speculative
    return {
        "type": "footer",
        "usage": {
            "prompt_tokens": int(prompt_tokens),
            "generation_tokens": len(output) + (1 if last_end == "eos" else 0),
            "finish_reason": "length" if last_end == "budget" else "stop",
        },
        "speculation": counters_from_rounds(rounds, len(plains)) if speculative else None,
        "output_ids": output,
        "wall_s": wall_s,
    }


class EngineTrace:
    """Collects one request's records; :meth:`write` adds the footer and writes atomically."""

    def __init__(self, *, runner: dict[str, Any], case_id: str, prompt_id: str,
                 prompt_ids: Sequence[int], target: dict[str, Any], eos_ids: Sequence[int],
                 drafter: dict[str, Any] | None = None, source: str | None = None,
                 params: dict[str, Any] | None = None, tokenizer_sha256: str | None = None,
                 mode: str | None = None) -> None:
        mode = mode or ("spec" if drafter is not None or source is not None else "plain")
        self.header = make_header(
            runner=runner, mode=mode,
            source=(source or ("two-model" if drafter is not None else None)) if mode == "spec" else None,
            case_id=case_id, target=target, drafter=drafter, tokenizer_sha256=tokenizer_sha256,
            params={**DEFAULT_PARAMS, **(params or {})}, prompt_id=prompt_id,
            prompt_ids=prompt_ids, eos_ids=eos_ids,
        )
        self.records: list[Record] = []
        self._t0 = time.perf_counter()

    def prefill(self, *, target_tokens: Sequence[int], drafter_tokens: Sequence[int] | None = None,
                target_cache_digest: Any = None, drafter_cache_digest: Any = None) -> None:
        self.records.append({
            "type": "prefill", "target_tokens": strict_ints("prefill.target_tokens", target_tokens),
            "drafter_tokens": (None if drafter_tokens is None
                               else strict_ints("prefill.drafter_tokens", drafter_tokens)),
            "target_cache_digest": target_cache_digest, "drafter_cache_digest": drafter_cache_digest,
        })

    def _index(self, kind: str) -> int:
        return sum(1 for r in self.records if r["type"] == kind)

    def round(self, *, feed: Sequence[int], pending: int, drafts: Sequence[int],
              samples: Sequence[int], k_accept: int, emitted: Sequence[int], end: str,
              margins: Sequence[float], confidence: Sequence[float] | None = None,
              target_cache_digest: Any = None, drafter_cache_digest: Any = None,
              time_s: float | None = None) -> None:
        """One verify step; ``window`` is ``[pending] + drafts``."""
        d = strict_ints("round.drafts", drafts)
        self.records.append({
            "type": "round", "index": self._index("round"), "feed": strict_ints("round.feed", feed),
            "drafts": d, "window": [strict_int("round.pending", pending), *d],
            "samples": strict_ints("round.samples", samples),
            "k_accept": strict_int("round.k_accept", k_accept),
            "emitted": strict_ints("round.emitted", emitted), "end": end,
            "margins": strict_floats("round.margins", margins),
            "confidence": None if confidence is None else strict_floats("round.confidence", confidence),
            "target_cache_digest": target_cache_digest,
            "drafter_cache_digest": drafter_cache_digest, "time_s": time_s,
        })

    def plain(self, *, input: Sequence[int], sample: int, margin: float, emitted: Sequence[int],
              end: str | None, reason: str = "baseline", target_cache_digest: Any = None,
              time_s: float | None = None) -> None:
        """One non-speculative target step (``reason``: see INTERPRETING.md)."""
        self.records.append({
            "type": "plain", "index": self._index("plain"), "input": strict_ints("plain.input", input),
            "sample": strict_int("plain.sample", sample), "margin": strict_float("plain.margin", margin),
            "emitted": strict_ints("plain.emitted", emitted),
            "end": end, "reason": reason, "target_cache_digest": target_cache_digest,
            "time_s": time_s,
        })

    def all_records(self) -> list[Record]:
        footer = footer_record(self.records, prompt_tokens=len(self.header["prompt"]["token_ids"]),
                               wall_s=time.perf_counter() - self._t0,
                               speculative=self.header["mode"] == "spec")
        return [self.header, *self.records, footer]

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write header, events and the derived footer to ``path`` atomically."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        write_trace(p, self.all_records())
        return p
