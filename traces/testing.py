"""Builders for small, consistent in-memory traces (for tests and conformance).

:func:`make_spec_trace` takes a compact description of each speculative round
and fills in everything else (header, prefill, windows, margins, footer
counters) so that the result passes :func:`traces.validate.validate_trace`.
:func:`make_plain_trace` does the same for a plain (non-speculative) run.

Both return a :class:`traces.io.Trace`; use ``trace.records()`` to get the
record list (e.g. to mutate one field or to write it with
:func:`traces.io.write_trace`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from traces.io import SCHEMA_VERSION, Record, Trace
from traces.records import counters_from_rounds

__all__ = [
    "RoundSpec",
    "make_footer",
    "make_header",
    "make_plain_trace",
    "make_spec_trace",
    "clone",
]

RoundSpec = tuple[
    Sequence[int] | None, Sequence[int], Sequence[int], int, Sequence[int], str
]
"""``(feed, drafts, samples, k_accept, emitted, end)``; ``feed=None``: mlx-lm's re-feed."""

DEFAULT_PROMPT = (1, 17, 42, 99)
DEFAULT_EOS = (2,)


def make_header(
    *,
    mode: str = "spec",
    prompt: Sequence[int] = DEFAULT_PROMPT,
    eos_ids: Sequence[int] = DEFAULT_EOS,
    case_id: str = "case-0",
    runner: str = "testing",
    gamma: int | None = 4,
    max_tokens: int = 64,
    prefill: str = "tail-split",
    **extra: Any,
) -> Record:
    """A valid header record with deterministic defaults.

    Args:
        mode: ``"spec"`` or ``"plain"`` (``plain`` drops drafter and gamma).
        prompt: Prompt token ids.
        eos_ids: EOS token ids.
        case_id: The case id.
        runner: ``runner.name``.
        gamma: Draft length parameter.
        max_tokens: Budget.
        prefill: ``"tail-split"`` or ``"full"``.
        **extra: Top-level header keys to override.

    Returns:
        The header dict.
    """
    spec = mode == "spec"
    header: Record = {
        "type": "header",
        "schema_version": SCHEMA_VERSION,
        "runner": {"name": runner, "package": "specparity", "version": "0.1.0", "commit": None},
        "mode": mode,
        "source": None,
        "case_id": case_id,
        "target": {"path": "models/target", "weights_sha256": None, "config_sha256": None},
        "drafter": (
            {"path": "models/drafter", "weights_sha256": None, "config_sha256": None} if spec else None
        ),
        "tokenizer_sha256": None,
        "params": {
            "gamma": gamma if spec else None,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "seed": 0,
            "prefill": prefill,
            "prefill_step_size": 512,
            "confidence_threshold": None,
        },
        "prompt": {"id": f"{case_id}-prompt", "token_ids": list(prompt)},
        "eos_ids": list(eos_ids),
        "platform": {"mlx": "0.0.0", "device": "cpu", "python": "3.11"},
    }
    header.update(extra)
    return header


def make_footer(
    events: Sequence[Record],
    *,
    prompt_len: int,
    spec: bool,
) -> Record:
    """A footer consistent with ``events`` (mlx-lm usage conventions).

    Args:
        events: Round and plain records in file order.
        prompt_len: ``usage.prompt_tokens``.
        spec: Whether to fill ``speculation`` (else ``None``).

    Returns:
        The footer dict.
    """
    output = [t for e in events for t in e["emitted"]]
    last_end = events[-1]["end"] if events else None
    rounds = [e for e in events if e["type"] == "round"]
    n_plain = sum(e["type"] == "plain" for e in events)
    return {
        "type": "footer",
        "usage": {
            "prompt_tokens": prompt_len,
            "generation_tokens": len(output) + (1 if last_end == "eos" else 0),
            "finish_reason": "length" if last_end == "budget" else "stop",
        },
        "speculation": counters_from_rounds(rounds, n_plain) if spec else None,
        "output_ids": output,
        "wall_s": None,
    }


def make_spec_trace(
    rounds: Sequence[RoundSpec],
    *,
    prompt: Sequence[int] = DEFAULT_PROMPT,
    eos_ids: Sequence[int] = DEFAULT_EOS,
    margin: float = 5.0,
    margins: Mapping[tuple[int, int], float] | None = None,
    prefill: bool = True,
    plains_after: Sequence[tuple[int, int, str | None]] = (),
    **header_kwargs: Any,
) -> Trace:
    """Build a consistent speculative trace.

    ``window`` is ``[pending] + drafts`` where ``pending`` is the last prompt
    token for round 0 (tail-split prefill) and afterwards the last token
    emitted so far.  The default ``feed`` (the drafter's input) follows
    mlx-lm's re-feed rule: ``[pending]`` for round 0, then ``[correction]``,
    or ``[last draft, bonus]`` after an all-accept round.

    Args:
        rounds: ``(feed, drafts, samples, k_accept, emitted, end)`` per round;
            ``feed=None`` means the default re-feed.
        prompt: Prompt token ids.
        eos_ids: EOS ids.
        margin: Margin at every window position (and for plain records).
        margins: Overrides ``{(round_index, window_pos): margin}``.
        prefill: Include a prefill record.
        plains_after: Plain records appended after the rounds, as
            ``(sample, emitted_len, end)`` with ``emitted_len`` 0 or 1.
        **header_kwargs: Passed to :func:`make_header`.

    Returns:
        The trace.
    """
    overrides = dict(margins or {})
    header = make_header(mode="spec", prompt=prompt, eos_ids=eos_ids, **header_kwargs)
    records: list[Record] = [header]
    if prefill:
        records.append(
            {
                "type": "prefill",
                "target_tokens": list(prompt[:-1]),
                "drafter_tokens": list(prompt[:-1]),
                "target_cache_digest": None,
                "drafter_cache_digest": None,
            }
        )
    events: list[Record] = []
    pending = prompt[-1]
    default_feed = [pending]
    for i, (feed, drafts, samples, k, emitted, end) in enumerate(rounds):
        window = [pending, *drafts]
        events.append(
            {
                "type": "round",
                "index": i,
                "feed": list(default_feed if feed is None else feed),
                "drafts": list(drafts),
                "window": window,
                "samples": list(samples),
                "k_accept": k,
                "emitted": list(emitted),
                "end": end,
                "margins": [overrides.get((i, p), margin) for p in range(len(window))],
                "confidence": None,
                "target_cache_digest": None,
                "drafter_cache_digest": None,
                "time_s": None,
            }
        )
        if emitted:
            pending = emitted[-1]
        default_feed = [drafts[-1], pending] if drafts and k == len(drafts) else [pending]
    for j, (sample, n_emit, p_end) in enumerate(plains_after):
        events.append(
            {
                "type": "plain",
                "index": j,
                "input": [pending],
                "sample": sample,
                "margin": margin,
                "emitted": [sample] if n_emit else [],
                "end": p_end,
                "reason": "ring-wrap",
                "target_cache_digest": None,
                "time_s": None,
            }
        )
        if n_emit:
            pending = sample
    records.extend(events)
    records.append(make_footer(events, prompt_len=len(prompt), spec=True))
    return Trace.from_records(records)


def make_plain_trace(
    tokens: Sequence[int],
    *,
    end: str = "eos",
    prompt: Sequence[int] = DEFAULT_PROMPT,
    eos_ids: Sequence[int] = DEFAULT_EOS,
    margin: float = 5.0,
    margins: Mapping[int, float] | None = None,
    **header_kwargs: Any,
) -> Trace:
    """Build a consistent plain (one token per step) trace.

    Args:
        tokens: Content tokens to emit (no EOS).
        end: ``"eos"`` appends a final step that samples ``eos_ids[0]`` and emits
            nothing; ``"budget"`` / ``"stop"`` mark the last content step.
        prompt: Prompt token ids.
        eos_ids: EOS ids.
        margin: Default margin of every step.
        margins: Overrides ``{step_index: margin}``.
        **header_kwargs: Passed to :func:`make_header`.

    Returns:
        The trace.
    """
    overrides = dict(margins or {})
    header = make_header(mode="plain", prompt=prompt, eos_ids=eos_ids, **header_kwargs)
    records: list[Record] = [
        header,
        {
            "type": "prefill",
            "target_tokens": list(prompt[:-1]),
            "drafter_tokens": None,
            "target_cache_digest": None,
            "drafter_cache_digest": None,
        },
    ]
    steps: list[tuple[int, bool]] = [(t, True) for t in tokens]
    if end == "eos":
        steps.append((eos_ids[0], False))
    pending = prompt[-1]
    events: list[Record] = []
    for i, (tok, emit) in enumerate(steps):
        last = i == len(steps) - 1
        events.append(
            {
                "type": "plain",
                "index": i,
                "input": [pending],
                "sample": tok,
                "margin": overrides.get(i, margin),
                "emitted": [tok] if emit else [],
                "end": end if last else None,
                "reason": "baseline",
                "target_cache_digest": None,
                "time_s": None,
            }
        )
        pending = tok
    records.extend(events)
    records.append(make_footer(events, prompt_len=len(prompt), spec=False))
    return Trace.from_records(records)


def clone(trace: Trace) -> Trace:
    """A deep copy of ``trace`` (safe to mutate)."""
    return Trace.from_records(copy.deepcopy(trace.records()), path=trace.path)


def round_samples_agree(a: Trace, b: Trace, where: str) -> bool:
    """Whether the target samples of round ``where`` (a divergence's ``"round N"``) agree
    on their common prefix in both traces: a difference there is the drafter's alone."""
    idx = int(where.split()[1])
    ra = next(r for r in a.rounds if r["index"] == idx)
    rb = next(r for r in b.rounds if r["index"] == idx)
    return all(x == y for x, y in zip(ra["samples"], rb["samples"], strict=False))
