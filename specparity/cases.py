"""Conformance cases built from the tiny zoo: (pair, prompt, params)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

DEFAULT_GAMMAS = (1, 2, 3, 5)


@dataclass(frozen=True)
class Case:
    """One generation: a zoo target, an optional drafter, a prompt and params.

    ``drafter=None`` is a plain (non-speculative) decode. ``source`` is the
    draft-source kind (§3 roster); for ``two-model`` the drafter is a zoo
    drafter name (``self``/``twin``/``small``), for model-free sources it
    names the source's configuration (e.g. ``ngram``).
    """

    target: str
    drafter: str | None
    prompt_id: str
    gamma: int = 3
    max_tokens: int = 32
    temperature: float = 0.0
    seed: int = 0
    eos_ids: tuple[int, ...] | None = None  # None: the tokenizer's own EOS set
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    source: str = "two-model"
    top_p: float = 0.0
    top_k: int = 0

    @property
    def mode(self) -> str:
        return "plain" if self.drafter is None else "spec"

    @property
    def case_id(self) -> str:
        if self.drafter is None:
            base = f"{self.target}/plain/{self.prompt_id}/n{self.max_tokens}"
        else:
            base = f"{self.target}/{self.drafter}/{self.prompt_id}/g{self.gamma}/n{self.max_tokens}"
        if self.temperature:
            base += f"/t{self.temperature:g}s{self.seed}"
            if self.top_p:
                base += f"p{self.top_p:g}"
            if self.top_k:
                base += f"k{self.top_k}"
        if self.eos_ids is not None:
            base += "/eos" + "-".join(str(t) for t in self.eos_ids)
        if self.stop_sequences:
            base += "/stop" + "+".join("-".join(str(t) for t in s) for s in self.stop_sequences)
        return base

    @property
    def file_stem(self) -> str:
        return self.case_id.replace("/", "__")

    def plain(self) -> Case:
        """The plain-decode baseline of this case."""
        return replace(self, drafter=None, gamma=0, source="two-model")


def spec_matrix(
    pairs: Iterable[tuple[str, str]],
    prompt_ids: Iterable[str],
    gammas: Iterable[int] = DEFAULT_GAMMAS,
    max_tokens: int = 32,
) -> list[Case]:
    prompt_ids = list(prompt_ids)
    gammas = list(gammas)
    return [
        Case(t, d, p, g, max_tokens)
        for (t, d) in pairs
        for g in gammas
        for p in prompt_ids
    ]


def pick_prompts(all_ids: list[str], n: int) -> list[str]:
    """``n`` prompt ids, alternating natural and random kinds for coverage."""
    nat = [p for p in all_ids if p.startswith("nat")]
    rnd = [p for p in all_ids if not p.startswith("nat")]
    out: list[str] = []
    while len(out) < min(n, len(all_ids)):
        for group in (nat, rnd):
            if group and len(out) < n:
                out.append(group.pop(0))
    return out
