"""mlx-dspark 0.20.3 (PyPI ``mlx-dspark``), driven unmodified through its Python API.

Reference: ``mlx_dspark/generate.py`` ``speculative_generate`` (DSpark drafter,
``lookup_drafts=False`` so every round drafts from the DSpark block) and
``mlx_dspark/lookup.py`` ``lookup_generate`` (drafter-free prompt lookup), both
with the documented ``on_round(drafted, accepted, committed, cap, source)``
callback; targets loaded with ``mlx_dspark.load_target`` (mlx-lm route, tap
probe on), drafters with ``mlx_dspark.load_drafter(path, quantize=False)``.
EOS: ``generate.eos_token_ids(tokenizer)`` reads ``tokenizer.eos_token_ids`` /
``eos_token_id``, so the case's EOS set is passed through a delegating
tokenizer (``subjects.common.EosTokenizer``). Stop: the API takes stop
*strings* only (``stop=[str]``), no stop token ids. Sampling: ``temperature``,
``top_k``, ``seed``.

Trace level: token (``on_round`` reports counts, not draft tokens).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import zoo
from subjects import Mode
from subjects.base import RoundReport, SubjectCase, SubjectRun, SubjectUnsupported, timed
from subjects.common import EosTokenizer, dist_version, eos_for, prompt_ids, require_module

NAME = "mlx-dspark"
HOOKS_SPEC = ["mlx_dspark.speculative_generate(on_round=)", "mlx_dspark.load_target", "mlx_dspark.load_drafter"]
HOOKS_LOOKUP = ["mlx_dspark.lookup_generate(on_round=)", "mlx_dspark.load_target"]

MODES = {
    "dspark": Mode(targets=("qwen3", "llama"), drafter="deepspec-taps01", samples=True, top_k=5,
                   note="DSpark drafter: DeepSpec-format tiny random drafter (taps 0,1), lookup off",
                   unsupported={"stop": "the API takes stop strings (stop=[str]), not stop token ids"}),
    "lookup": Mode(targets=("qwen3", "llama", "gemma3"), samples=True, top_k=5,
                   note="drafter-free prompt lookup (lookup_generate)",
                   unsupported={"stop": "the API takes stop strings (stop=[str]), not stop token ids"}),
}


def require() -> None:
    require_module("mlx_dspark", NAME)


def version() -> str:
    return dist_version("mlx-dspark")


@cache
def _target(target: str) -> tuple[Any, Any]:
    import mlx_dspark as md

    return md.load_target(str(zoo.model_dir(target)), require_tap=True)


@cache
def _drafter(target: str) -> Any:
    import mlx_dspark as md

    from subjects.drafters import deepspec_drafter

    drafter, _cfg = md.load_drafter(str(deepspec_drafter(target)), quantize=False)
    return drafter


def drafter_path(case: SubjectCase) -> str | None:
    if case.mode != "dspark":
        return None
    from subjects.drafters import deepspec_drafter

    return str(deepspec_drafter(case.target))


def generate(case: SubjectCase) -> SubjectRun:
    import mlx_dspark as md

    mode = MODES.get(case.mode)
    if mode is None or case.target not in mode.targets:
        raise SubjectUnsupported(f"mlx-dspark adapter: no mode {case.mode!r} on target {case.target!r}")
    if case.stop_ids:
        raise SubjectUnsupported(mode.unsupported["stop"])
    target, tok = _target(case.target)
    tok = EosTokenizer(tok, eos_for(case.eos_ids))
    reports: list[RoundReport] = []

    def on_round(drafted: int, accepted: int, committed: int, cap: int = 0, source: str | None = None,
                 **_: Any) -> None:
        reports.append(RoundReport(int(drafted), int(accepted), int(committed), source=source))

    kw: dict[str, Any] = dict(prompt_ids=list(prompt_ids(case.prompt_id)), max_new_tokens=case.max_tokens,
                              temperature=case.temperature, top_k=case.top_k, seed=case.seed,
                              on_round=on_round)
    if case.mode == "dspark":
        res, wall = timed(md.speculative_generate, target, tok, _drafter(case.target),
                          max_draft_tokens=case.gamma, lookup_drafts=False, **kw)
        hooks = HOOKS_SPEC
    else:
        res, wall = timed(md.lookup_generate, target, tok, max_draft_tokens=case.gamma, **kw)
        hooks = HOOKS_LOOKUP
    counters = {"emitted": int(res.num_tokens), "generation_tokens": int(res.num_tokens),
                "rounds": int(res.num_rounds)}
    return SubjectRun(stream=[int(t) for t in res.token_ids], finish_reason=res.finish_reason, hooks=hooks,
                      rounds=reports or None, counters=counters, wall_s=wall,
                      prefill_tokens=1 if res.token_ids else 0,
                      extra={"accept_lengths": list(res.accept_lengths), "num_rounds": res.num_rounds})
