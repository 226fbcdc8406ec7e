"""mlx-lm-broomva 0.31.3 (PyPI ``mlx-lm-broomva``): a fork of mlx-lm that installs ``mlx_lm``.

Reference: the fork's ``mlx_lm/generate.py`` ``stream_generate`` with
``draft_model`` / ``num_draft_tokens`` (two-model speculative decoding,
``speculative_generate_step``), its public API, unmodified; models loaded with
its ``mlx_lm.load``. Because the package replaces the ``mlx_lm`` module, it
runs in its own environment (``tox -e subject-mlx-lm-broomva``) and is compared
with the real mlx-lm 0.32.2 through the committed goldens, never a live import.

EOS: the ``TokenizerWrapper.eos_token_ids`` set (restored after each run).
The content stream is every response's ``token`` except the final response
that mlx-lm's own convention uses to report an EOS (``finish_reason ==
"stop"`` with an EOS token, empty text), the same reading as
``oracles/mlx_lm.py``. Counters: ``generation_tokens`` of the final response,
``from_draft`` flags (accepted drafts). Two-model modes are recorded at round
level: the target passed to ``stream_generate`` is a call proxy that records
each verify window ``[pending, *drafts]`` (every call after the prefill's
``len(prompt) - 1`` tokens) and each response is attributed to the window that
produced it, with its ``from_draft`` flag as the engine's acceptance. Stop ids: mlx-lm has stop sequences
only in its server (``StopSequences``), not in ``stream_generate``.

Gemma 4 MTP (the fork's addition): ``stream_generate`` dispatches to
``mtp_speculative_generate_step`` when ``is_mtp_drafter(draft_model)``
(``models/gemma4_assistant.py``); the drafter is a zoo ``gemma4_assistant``
head (``zoo/heads.py``), loaded with the fork's ``mlx_lm.utils.load_model``.
Trace level: token.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import zoo
from subjects import Mode
from subjects.base import RoundReport, SubjectCase, SubjectRun, timed
from subjects.common import case_mode, dist_version, eos_for, prompt_ids, require_module

NAME = "mlx-lm-broomva"
_NO_STOP = "stream_generate takes no stop ids (stop sequences live in mlx_lm.server only)"
MODES = {
    "two-model": Mode(targets=("llama", "qwen3"), drafter="twin", two_model=True, samples=True, top_k=5,
                      note="stream_generate(draft_model=zoo twin, num_draft_tokens=gamma)",
                      unsupported={"stop": _NO_STOP}),
    "oracle": Mode(targets=("llama", "qwen3"), drafter="oracle",
                   note="stream_generate(draft_model=oracle drafter: greedy continuation, 1 corrupted / round)",
                   unsupported={"stop": _NO_STOP,
                                "distribution": "graded in two-model (the oracle drafter proposes point masses)"}),
    "mtp-assistant": Mode(targets=("gemma4",), drafter="gemma4-assistant", samples=True, top_k=5,
                          note="Gemma 4 MTP: stream_generate(draft_model=zoo gemma4_assistant head) -> "
                               "mtp_speculative_generate_step",
                          unsupported={"stop": _NO_STOP}),
    "mtp-assistant-self": Mode(targets=("gemma4",), drafter="gemma4-assistant-self",
                               note="Gemma 4 MTP with the zoo 'self' assistant head (accepts often)",
                               unsupported={"stop": _NO_STOP, "distribution": "graded in mtp-assistant"}),
}


def require() -> None:
    require_module("mlx_lm", NAME)
    from importlib import metadata

    try:
        metadata.version("mlx-lm-broomva")
    except metadata.PackageNotFoundError as exc:
        from subjects import SUBJECTS
        from subjects.base import SubjectUnavailable

        raise SubjectUnavailable(f"mlx-lm-broomva is not installed (the mlx_lm here is another "
                                 f"distribution); run it with: {SUBJECTS[NAME].install_hint}") from exc


def version() -> str:
    return dist_version("mlx-lm-broomva")


@cache
def _load(path: str) -> tuple[Any, Any]:
    from mlx_lm import load

    return load(path)


@cache
def _head(name: str) -> Any:
    from mlx_lm.utils import load_model

    from zoo.heads import head_dir

    return load_model(head_dir(name))[0]  # model only: a head directory has no tokenizer


def drafter_path(case: SubjectCase) -> str | None:
    if case.mode == "two-model":
        return str(zoo.pair(case.target, "twin")[1])
    if case.mode.startswith("mtp-"):
        from zoo.heads import head_dir

        return str(head_dir(MODES[case.mode].drafter or ""))
    return None


def generate(case: SubjectCase) -> SubjectRun:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mode = case_mode(case, MODES, "mlx-lm-broomva", stop=_NO_STOP)
    model, tok = _load(str(zoo.model_dir(case.target)))
    ids = list(prompt_ids(case.prompt_id))
    if case.mode == "two-model":
        draft = _load(str(zoo.pair(case.target, "twin")[1]))[0]
    elif case.mode.startswith("mtp-"):
        draft = _head(mode.drafter or "")
    else:
        from subjects.oracle_drafter import OracleDraft, greedy_continuation

        seq = ids + greedy_continuation(model, ids, case.max_tokens + case.gamma + 2)
        draft = OracleDraft(seq, int(model.args.vocab_size), case.gamma)
    eos = eos_for(case.eos_ids)
    saved = set(tok.eos_token_ids)
    tok.eos_token_ids = set(eos)
    mx.random.seed(case.seed)
    target = model if case.mode.startswith("mtp-") else _Windows(model, len(ids) - 1)
    owner: list[int] = []

    def consume() -> list[Any]:
        out = []
        for r in stream_generate(target, tok, mx.array(ids), max_tokens=case.max_tokens, draft_model=draft,
                                 num_draft_tokens=case.gamma,
                                 sampler=make_sampler(temp=case.temperature, top_k=case.top_k)):
            out.append(r)
            owner.append(len(target.windows) - 1 if isinstance(target, _Windows) else -1)
        return out

    try:
        responses, wall = timed(consume)
    finally:
        tok.eos_token_ids = saved
    if not responses:
        return SubjectRun(stream=[], finish_reason=None, hooks=["mlx_lm.stream_generate(draft_model=)"])
    final = responses[-1]
    kept = responses[:-1] if (final.finish_reason == "stop" and int(final.token) in eos) else responses
    stream = [int(r.token) for r in kept]
    counters = {"generation_tokens": int(final.generation_tokens)}
    rounds = None
    if isinstance(target, _Windows) and all(o >= 0 for o in owner[: len(kept)]):
        rounds = []
        for w_i, window in enumerate(target.windows):
            mine = [r for r, o in zip(kept, owner, strict=False) if o == w_i]
            if not mine and w_i == len(target.windows) - 1:
                break  # the verify whose only sample was the EOS / past the budget
            rounds.append(RoundReport(drafted=len(window) - 1, accepted=sum(bool(r.from_draft) for r in mine),
                                      committed=len(mine), drafts=window[1:]))
    hooks = ["mlx_lm.stream_generate(draft_model=, num_draft_tokens=)", "mlx_lm.load"]
    if isinstance(target, _Windows):
        hooks.append("target model call proxy (verify windows), GenerationResponse.from_draft")
    return SubjectRun(stream=stream, finish_reason=final.finish_reason, hooks=hooks, counters=counters,
                      wall_s=wall, rounds=rounds, extra={"from_draft": sum(bool(r.from_draft) for r in kept)})


class _Windows:
    """The target model, recording each verify window (every call after the prefill's tokens).

    mlx-lm's speculative_generate_step prefills ``len(prompt) - 1`` tokens, then calls the
    target once per round with ``[pending, *drafts]``; attribute access is delegated.
    """

    def __init__(self, model: Any, n_prefill: int) -> None:
        self._model, self._left = model, n_prefill
        self.windows: list[list[int]] = []

    def __call__(self, inputs: Any, *a: Any, **kw: Any) -> Any:
        toks = [int(t) for t in inputs.reshape(-1).tolist()]
        if self._left > 0:
            self._left -= len(toks)
        else:
            self.windows.append(toks)
        return self._model(inputs, *a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
