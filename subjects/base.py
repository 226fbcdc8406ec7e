"""What a subject adapter takes and returns, and how its run becomes our trace.

A subject is a third-party speculative engine driven unmodified through its
public API (``subjects/<package>.py``). Every adapter turns one
:class:`SubjectCase` into one :class:`SubjectRun`: the token stream exactly as
the engine's API returned it (nothing stripped, nothing clipped), its finish
reason, and its own counters / per-round reports where it exposes them. The
checks (``subjects/checks.py``) judge the run; :func:`to_trace` records it in
our trace format (``traces/INTERPRETING.md``): round level when the engine
exposed per-round drafts, token level (one ``plain`` record per streamed
token, reason ``subject-stream``) otherwise. The trace is faithful, so an
engine that streams an EOS id or overruns the budget gives a trace that
``specparity trace validate`` rejects with the exact line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from traces.records import counters_from_rounds, make_header


class SubjectUnavailable(RuntimeError):
    """The subject's package is not installed in this environment."""


class SubjectUnsupported(RuntimeError):
    """The subject cannot run this case (a mode/target/option it does not offer)."""


@dataclass(frozen=True)
class SubjectCase:
    """One generation request to a subject.

    ``mode`` is the subject's own drafting mode (``two-model``, ``ngram``,
    ``dspark``, ...); ``drafter`` names the drafter (``twin``, ``oracle``, a
    built checkpoint kind) or None. ``eos_ids`` None means the zoo tokenizer's
    EOS; ``()`` means no EOS at all (the plain reference is generated so).
    """

    target: str
    mode: str
    drafter: str | None = None
    prompt_id: str = "nat-00"
    max_tokens: int = 16
    gamma: int = 3
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    eos_ids: tuple[int, ...] | None = None
    stop_ids: tuple[int, ...] = ()

    @property
    def case_id(self) -> str:
        parts = [self.target, self.drafter or "none", self.prompt_id, f"g{self.gamma}", f"n{self.max_tokens}"]
        if self.temperature > 0:
            parts.append(f"t{self.temperature:g}-k{self.top_k}-s{self.seed}")
        if self.eos_ids is not None:
            parts.append("eos" + "-".join(map(str, self.eos_ids)))
        if self.stop_ids:
            parts.append("stop" + "-".join(map(str, self.stop_ids)))
        return f"{self.mode}:" + "/".join(parts)

    def with_(self, **kw: Any) -> SubjectCase:
        return replace(self, **kw)

    @classmethod
    def from_id(cls, case_id: str) -> SubjectCase:
        """Parse :attr:`case_id` back (ValueError with the expected shape otherwise)."""
        shape = "MODE:TARGET/DRAFTER/PROMPT/gG/nN[/tT-kK-sS][/eosA-B][/stopA-B]"
        mode, sep, rest = case_id.partition(":")
        parts = rest.split("/")
        if not sep or len(parts) < 5 or not parts[3].startswith("g") or not parts[4].startswith("n"):
            raise ValueError(f"bad case id {case_id!r}; expected {shape}")
        kw: dict[str, Any] = {}
        try:
            for p in parts[5:]:
                if p.startswith("t"):
                    t, k, s = p[1:].split("-")
                    kw.update(temperature=float(t), top_k=int(k[1:]), seed=int(s[1:]))
                elif p.startswith("eos"):
                    kw["eos_ids"] = tuple(int(x) for x in p[3:].split("-") if x)
                elif p.startswith("stop"):
                    kw["stop_ids"] = tuple(int(x) for x in p[4:].split("-") if x)
                else:
                    raise ValueError(p)
            return cls(target=parts[0], mode=mode, drafter=None if parts[1] == "none" else parts[1],
                       prompt_id=parts[2], gamma=int(parts[3][1:]), max_tokens=int(parts[4][1:]), **kw)
        except ValueError as exc:
            raise ValueError(f"bad case id {case_id!r}; expected {shape}") from exc


@dataclass
class RoundReport:
    """One round as the engine reported it (counts always; tokens when exposed)."""

    drafted: int
    accepted: int
    committed: int
    drafts: list[int] | None = None
    source: str | None = None


@dataclass
class SubjectRun:
    """What the engine's API returned for one case, unnormalised."""

    stream: list[int]
    finish_reason: str | None
    hooks: list[str]
    rounds: list[RoundReport] | None = None
    counters: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # "reported_ids": the engine's own output record
    wall_s: float | None = None
    prefill_tokens: int = 0  # tokens emitted from the prefill logits, before any round


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def _round_records(run: SubjectRun, window_start: int, eos: set[int], budget: int) -> list[dict[str, Any]] | None:
    """Round records when every round exposed its drafts and the committed tokens tile the stream."""
    if not run.rounds or any(r.drafts is None for r in run.rounds):
        return None
    if run.prefill_tokens > 1 or sum(r.committed for r in run.rounds) + run.prefill_tokens != len(run.stream):
        return None
    out: list[dict[str, Any]] = []
    pos, pending = 0, window_start
    if run.prefill_tokens:  # the first token is sampled from the prefill's logits
        tok = run.stream[0]
        out.append({"type": "plain", "index": 0, "input": [window_start], "sample": tok, "margin": 0.0,
                    "emitted": [] if tok in eos else [tok], "end": "eos" if tok in eos else None,
                    "reason": "initial", "target_cache_digest": None, "time_s": None})
        pos, pending = 1, tok
    for i, r in enumerate(run.rounds):
        toks = run.stream[pos : pos + r.committed]
        pos += r.committed
        drafts = list(r.drafts or [])
        last = i == len(run.rounds) - 1
        end = "correction" if r.accepted < len(drafts) else "bonus"
        if last and run.finish_reason in ("length", None) and pos >= budget:
            end = "budget"
        out.append({
            "type": "round", "index": i, "feed": [pending], "drafts": drafts,
            "window": [pending, *drafts], "samples": list(toks), "k_accept": int(r.accepted),
            "emitted": list(toks), "end": end, "margins": [0.0] * (len(drafts) + 1),
            "confidence": None, "target_cache_digest": None, "drafter_cache_digest": None,
            "time_s": None,
        })
        if toks:
            pending = toks[-1]
    return out


def to_trace(info: dict[str, Any], case: SubjectCase, run: SubjectRun, prompt_ids: list[int],
             eos_ids: list[int], target: dict[str, Any], drafter: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Header-to-footer records of ``run`` (``info``: ``{name, package, version}``)."""
    eos = set(eos_ids)
    header = make_header(
        runner={**info, "hooks": list(run.hooks)},
        mode="spec", source=f"subject:{case.mode}", case_id=case.case_id,
        target=target, drafter=drafter, tokenizer_sha256=None,
        params={"gamma": case.gamma, "max_tokens": case.max_tokens, "temperature": case.temperature,
                "top_p": 0.0, "top_k": case.top_k, "min_p": 0.0, "seed": case.seed,
                "prefill": "full", "prefill_step_size": 512, "confidence_threshold": None,
                "stop_ids": list(case.stop_ids)},
        prompt_id=case.prompt_id, prompt_ids=prompt_ids, eos_ids=eos_ids,
    )
    rounds = _round_records(run, prompt_ids[-1], eos, case.max_tokens)
    level = "round" if rounds is not None else "token"
    header["runner"]["level"] = level
    events: list[dict[str, Any]]
    if rounds is not None:
        events = rounds
    else:
        events = []
        prev = prompt_ids[-1]
        for i, tok in enumerate(run.stream):
            events.append({"type": "plain", "index": i, "input": [prev], "sample": tok, "margin": 0.0,
                           "emitted": [tok], "end": None, "reason": "subject-stream",
                           "target_cache_digest": None, "time_s": None})
            prev = tok
        if events:
            fr = run.finish_reason
            events[-1]["end"] = "budget" if fr == "length" else ("stop" if fr == "stop" else None)
    spec = None
    if run.rounds is not None:
        spec = counters_from_rounds([{"drafts": [0] * r.drafted, "k_accept": r.accepted} for r in run.rounds],
                                    n_plain=run.prefill_tokens if rounds is not None else 0)
    footer = {
        "type": "footer",
        "usage": {"prompt_tokens": len(prompt_ids), "generation_tokens": len(run.stream),
                  "finish_reason": run.finish_reason if run.finish_reason in ("length", "stop") else "stop"},
        "speculation": spec,
        "output_ids": list(run.stream),
        "wall_s": run.wall_s,
    }
    return [header, *events, footer]
