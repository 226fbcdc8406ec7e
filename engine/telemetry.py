"""Usage and speculation counters (§2 "Telemetry", ``usage.speculation``).

``generation_tokens`` follows mlx-lm 0.32.2 ``stream_generate``'s final
accounting (``generation_tokens = n + 1``): a stopping EOS is counted once and
never emitted as content.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length"]


@dataclass
class Usage:
    prompt_tokens: int
    generation_tokens: int = 0
    finish_reason: FinishReason = "length"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SpecCounters:
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    target_calls: int = 0
    rounds: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    drafted_by_pos: list[int] = field(default_factory=list)
    accepted_by_pos: list[int] = field(default_factory=list)

    def record_round(self, d: int, k_accept: int) -> None:
        self.rounds += 1
        self.target_calls += 1
        self.drafted += d
        self.accepted += k_accept
        self.rejected += d - k_accept
        self.acceptance_lengths.append(k_accept)
        for by_pos, upto in ((self.drafted_by_pos, d), (self.accepted_by_pos, k_accept)):
            if len(by_pos) < upto:
                by_pos.extend([0] * (upto - len(by_pos)))
            for i in range(upto):
                by_pos[i] += 1

    def record_plain(self) -> None:
        self.target_calls += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------- per-phase profile

PHASES = ("draft", "window", "forward", "sync", "walk", "rollback", "commit", "records")
"""A speculative round's phases, in order (``--profile`` of the benches):

- ``draft``: the source's drafts, evaluated (every drafter forward of the round);
- ``window``: the verify window built (host ids or the lazy draft array, padding);
- ``forward``: the target's verify forward, evaluated (logits on the device);
- ``sync``: the window's samples and margins computed and read back (the round's host sync);
- ``walk``: the accept walk (host, through the pipeline);
- ``rollback``: the target caches rolled back to the kept prefix, evaluated;
- ``commit``: the source's commit (drafter trim or replay), evaluated;
- ``records``: counters and the round's trace record (digests when they are on)."""


class PhaseProfile:
    """Wall time per round phase, summed over the rounds of every generation run while active.

    Honest boundaries: a phase's lap evaluates the arrays it produced (``mx.eval``) before
    reading the clock, so device work lands in the phase that queued it, not in the next
    sync. The extra evaluations change no value (the same graph, the same kernels); they do
    remove the overlap of host and device work that a run without the profile has, so the
    profiled total is an upper bound of the plain run's. Off (no :func:`profiling` block),
    the executors read one module global per generation and do nothing else.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.rounds = 0
        self._t = 0.0

    def start(self) -> None:
        """A round starts now."""
        import time

        self._t = time.perf_counter()

    def lap(self, phase: str, *arrays: Any) -> None:
        """``phase`` ends now: its arrays evaluated, its time added."""
        import time

        import mlx.core as mx

        live = _flat(arrays)
        if live:
            mx.eval(*live)
        now = time.perf_counter()
        self.seconds[phase] += now - self._t
        self._t = now

    def end_round(self, rows: int = 1) -> None:
        self.rounds += rows

    def to_dict(self) -> dict[str, Any]:
        total = sum(self.seconds.values())
        return {"rounds": self.rounds, "total_s": total,
                "phases": {p: {"s": s, "share": (s / total) if total > 0 else 0.0,
                               "per_round_ms": (1e3 * s / self.rounds) if self.rounds else 0.0}
                           for p, s in self.seconds.items()}}


def _flat(x: Any) -> list[Any]:
    """The arrays in a nest of lists/tuples (None and host values left out)."""
    if isinstance(x, (list, tuple)):
        return [a for e in x for a in _flat(e)]
    return [] if x is None or isinstance(x, (int, float, str)) else [x]


def cache_arrays(caches: Any) -> list[Any]:
    """The arrays a list of mlx-lm caches holds now (empty caches give none)."""
    out: list[Any] = []
    for c in caches or ():
        try:
            out += _flat(c.state)
        except (AttributeError, TypeError):  # an empty KVCache's state reads keys of None
            continue
    return out


_ACTIVE: PhaseProfile | None = None


def active_profile() -> PhaseProfile | None:
    """The profile being collected (None: profiling is off, the executors do nothing extra)."""
    return _ACTIVE


class profiling:  # noqa: N801  (a context manager used as ``with profiling() as prof``)
    """Collect a :class:`PhaseProfile` over the generations run inside the block."""

    def __init__(self) -> None:
        self.profile = PhaseProfile()
        self._prev: PhaseProfile | None = None

    def __enter__(self) -> PhaseProfile:
        global _ACTIVE
        self._prev, _ACTIVE = _ACTIVE, self.profile
        return self.profile

    def __exit__(self, *exc: Any) -> None:
        global _ACTIVE
        _ACTIVE = self._prev


def phase_table(profiles: dict[str, dict[str, Any]]) -> str:
    """A markdown table: one column per profiled arm (``PhaseProfile.to_dict``), ms per round
    and the share of the round per phase."""
    names = list(profiles)
    head = "| phase | " + " | ".join(f"{n}: ms/round (share)" for n in names) + " |"
    rule = "|:---|" + "---:|" * len(names)
    lines = [head, rule]
    for p in PHASES:
        cells = [f"{profiles[n]['phases'][p]['per_round_ms']:.3f} ({profiles[n]['phases'][p]['share']:.0%})"
                 for n in names]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines.append("| rounds | " + " | ".join(str(profiles[n]["rounds"]) for n in names) + " |")
    return "\n".join(lines) + "\n"
