"""nunspark 0.13.0 (PyPI ``nunspark``), driven unmodified through its Python API.

Reference: ``nunspark/generate.py`` ``speculative_generate`` (two-model: a
resident mlx-lm draft model verified by the streamed target,
``accept_top_k=1`` = lossless) and ``ngram_speculative_generate`` (prompt
lookup with ``nunspark.ngram_drafter.NGramDrafter``), both generators of
token ids with a ``SpecStats`` tally (``tokens_emitted``,
``draft_tokens_proposed``, ``accepted_total``, ``target_passes``). The target
is packed from the zoo directory with ``nunspark.packer.pack`` and opened as
``nunspark.engine.StreamingEngine`` (prefetch off, no wiring). EOS: the
``eos_id`` parameter (one id; the CLI breaks on it after it is yielded).
There is no stop-id parameter, no finish reason and no temperature on the
speculative paths (argmax verify).

Drafters: the zoo ``twin`` (mlx-lm format) and the oracle drafter
(``subjects/oracle_drafter.py``: the target's greedy continuation, one
corrupted position per gamma + 1). Trace level: round. The engine instance's own
``verify_forward`` (the window ``[b, *q]``: the round's drafts), ``commit_verified``
(``accepted_len``: the engine's acceptance) and one-token ``forward`` (a plain step of the
n-gram path) are wrapped on the instance, so each yielded token is attributed to the round
that produced it; the first token comes from the prefill.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import zoo
from subjects import Mode
from subjects.base import RoundReport, SubjectCase, SubjectRun, timed
from subjects.common import case_mode, dist_version, eos_for, prompt_ids, require_module

NAME = "nunspark"
_NO_STOP = "no stop-token parameter (speculative_generate takes one eos_id)"
_GREEDY = "the speculative paths verify by argmax only (no temperature)"
MODES = {
    "two-model": Mode(targets=("llama", "qwen3"), drafter="twin", two_model=True,
                      note="speculative_generate, zoo twin draft model, accept_top_k=1",
                      unsupported={"stop": _NO_STOP, "distribution": _GREEDY}),
    "oracle": Mode(targets=("llama", "qwen3"), drafter="oracle",
                   note="speculative_generate, oracle draft model (greedy continuation, 1 corrupted / round)",
                   unsupported={"stop": _NO_STOP, "distribution": _GREEDY}),
    "ngram": Mode(targets=("llama", "qwen3"),
                  note="ngram_speculative_generate, NGramDrafter(max_ngram=3, adaptive=False)",
                  unsupported={"stop": _NO_STOP, "distribution": _GREEDY}),
}


def require() -> None:
    require_module("nunspark.generate", NAME)


def version() -> str:
    return dist_version("nunspark")


@cache
def _packed(target: str) -> str:
    from nunspark.packer import pack

    from subjects.drafters import subjects_dir

    d = subjects_dir() / f"nunspark-{version()}-{target}"
    if not (d / ".complete").exists():
        pack(str(zoo.model_dir(target)), d)
        (d / ".complete").write_text("")
    return str(d)


def _engine(target: str) -> Any:
    from pathlib import Path

    from nunspark.engine import StreamingEngine
    from nunspark.manifest import Manifest

    root = _packed(target)
    return StreamingEngine(root, Manifest.load(Path(root) / "manifest.json"), budget_bytes=1 << 33,
                           prefetch=False, wire_limit=False)


@cache
def _mlx_model(path: str) -> Any:
    from mlx_lm import load

    return load(path)[0]


def drafter_path(case: SubjectCase) -> str | None:
    return str(zoo.pair(case.target, "twin")[1]) if case.mode == "two-model" else None


def _oracle(case: SubjectCase, n: int) -> Any:
    from subjects.oracle_drafter import OracleDraft, greedy_continuation

    model = _mlx_model(str(zoo.model_dir(case.target)))
    ids = list(prompt_ids(case.prompt_id))
    seq = ids + greedy_continuation(model, ids, n + case.gamma + 2)
    return OracleDraft(seq, int(model.args.vocab_size), case.gamma)


def generate(case: SubjectCase) -> SubjectRun:
    from nunspark.generate import SpecStats, ngram_speculative_generate, speculative_generate

    case_mode(case, MODES, "nunspark", stop=_NO_STOP, greedy=_GREEDY, single_eos=True)
    eos = eos_for(case.eos_ids)
    eos_id = next(iter(eos)) if eos else None
    stats = SpecStats()
    engine = _engine(case.target)
    ids = list(prompt_ids(case.prompt_id))
    try:
        if case.mode == "ngram":
            from nunspark.ngram_drafter import NGramDrafter

            gen = ngram_speculative_generate(engine, NGramDrafter(max_ngram=3, num_draft_tokens=case.gamma,
                                                                  adaptive=False),
                                             ids, max_tokens=case.max_tokens, eos_id=eos_id, stats=stats)
            hooks = ["nunspark.generate.ngram_speculative_generate(stats=SpecStats)", "nunspark.packer.pack"]
        else:
            draft = (_mlx_model(str(zoo.pair(case.target, "twin")[1])) if case.mode == "two-model"
                     else _oracle(case, case.max_tokens))
            gen = speculative_generate(engine, draft, ids, max_tokens=case.max_tokens,
                                       num_draft_tokens=case.gamma, accept_top_k=1, eos_id=eos_id, stats=stats)
            hooks = ["nunspark.generate.speculative_generate(stats=SpecStats)", "nunspark.packer.pack"]
        marks = _spy(engine)
        (stream, rounds), wall = timed(_consume, gen, marks)
    finally:
        engine.close()
    counters = {"emitted": stats.tokens_emitted, "drafted": stats.draft_tokens_proposed,
                "accepted": stats.accepted_total, "target_passes": stats.target_passes}
    hooks = hooks + ["StreamingEngine.verify_forward/commit_verified/forward (instance wrappers)"]
    return SubjectRun(stream=stream, finish_reason=None, hooks=hooks, counters=counters, wall_s=wall,
                      rounds=rounds, prefill_tokens=1 if stream else 0)


def _spy(engine: Any) -> list[tuple[str, list[int], int]]:
    """Wrap this engine instance's verify/commit/forward calls (the methods stay nunspark's own).

    ``verify_forward(tokens=[b, *q])`` is a round's window, ``commit_verified(..., accepted_len)``
    its acceptance (``accepted_len = m + 1``), a one-token ``forward`` a plain step.
    """
    marks: list[tuple[str, list[int], int]] = []
    window: list[list[int]] = [[]]
    verify, commit, forward = engine.verify_forward, engine.commit_verified, engine.forward

    def verify_forward(tokens: Any, kv: Any, *a: Any, **kw: Any) -> Any:
        window[0] = [int(t) for t in tokens[0].tolist()]
        return verify(tokens, kv, *a, **kw)

    def commit_verified(kv: Any, recs: Any, accepted_len: int, *a: Any, **kw: Any) -> Any:
        marks.append(("round", window[0][1:], int(accepted_len) - 1))
        return commit(kv, recs, accepted_len, *a, **kw)

    def one_step(tokens: Any, *a: Any, **kw: Any) -> Any:
        if int(tokens.shape[-1]) == 1:
            marks.append(("plain", [], 0))
        return forward(tokens, *a, **kw)

    engine.verify_forward, engine.commit_verified, engine.forward = verify_forward, commit_verified, one_step
    return marks


def _consume(gen: Any, marks: list[tuple[str, list[int], int]]) -> tuple[list[int], list[RoundReport]]:
    """The stream, and per verify round / plain step the tokens it yielded (the first is the prefill's)."""
    stream: list[int] = []
    rounds: list[RoundReport] = []
    seen = None
    for t in gen:
        if seen is None:  # the prefill's token: every forward so far was the prefill
            seen = len(marks)
        elif len(marks) > seen:
            kind, drafts, m = marks[-1]
            seen = len(marks)
            rounds.append(RoundReport(drafted=len(drafts), accepted=m, committed=0, drafts=drafts,
                                      source=kind))
        if rounds and stream:
            rounds[-1].committed += 1
        stream.append(int(t))
    return stream, rounds
