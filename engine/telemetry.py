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
