"""dfly-mlx 0.1.0 (PyPI ``dfly-mlx``): DFly drafting on dflash-mlx's runtime, driven unmodified.

Reference: ``dfly_mlx/loading.py`` ``load_runtime(target_ref, draft_ref)``
(``validate_pair``, mlx-lm loader with ``dfly_mlx.model.model_classes``,
``DFlyDraftBackend``) and ``dfly_mlx/generate.py`` ``generate``, which calls
dflash-mlx's ``stream_dflash_generate`` with verify mode ``dflash``,
copyspec off and ``block_tokens = draft_model.block_size``. ``generate`` only
takes a prompt *string* that it turns into tokens with the tokenizer's chat
template (``no_thinking_prompt_tokens``); the zoo tokenizer has no chat
template, so the adapter makes exactly the same ``stream_dflash_generate``
call as ``generate`` with ``prompt_tokens_override`` = the zoo prompt ids and
the case's ``stop_token_ids`` (its EOS list), reading the same events.

Drafter: a tiny DFly drafter in dfly-mlx's own format: its
``DFlyDraftModel`` instantiated from a config derived from the zoo ``qwen3``
target (1 layer, taps 0 and 1, block 4, hidden correction on) with
``target_hidden_size`` / ``target_num_hidden_layers`` for ``validate_pair``,
seeded random parameters saved under its own names. Greedy only.
Trace level: token.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

import zoo
from subjects import Mode
from subjects.base import SubjectCase, SubjectRun, timed
from subjects.common import case_mode, dist_version, eos_for, prompt_ids, require_module
from subjects.dflash_mlx import summary_counters

NAME = "dfly-mlx"
_STOP = "stop_token_ids is the EOS list itself: no separate stop-id parameter"
_GREEDY = "generate / stream_dflash_generate take no temperature"
MODES = {
    "dfly": Mode(targets=("qwen3",), drafter="qwen3-dfly-random",
                 note="dfly load_runtime + the stream_dflash_generate call of dfly generate (token prompt)",
                 unsupported={"stop": _STOP, "distribution": _GREEDY}),
}


def require() -> None:
    require_module("dfly_mlx.loading", NAME)


def version() -> str:
    return dist_version("dfly-mlx")


@cache
def drafter_dir(target: str) -> str:
    from dflash_mlx.model import DFlashDraftModelArgs
    from dfly_mlx.model import DFlyDraftModel

    from subjects.dflash_mlx import drafter_config
    from subjects.drafters import module_checkpoint

    cfg = drafter_config(target)
    cfg["num_target_layers"] = 2
    cfg["target_hidden_size"] = cfg["hidden_size"]
    cfg["target_num_hidden_layers"] = int(
        __import__("json").loads((zoo.model_dir(target) / "config.json").read_text())["num_hidden_layers"])
    cfg["dflash_config"] = {**cfg["dflash_config"], "enable_hidden_correction": True}
    d = module_checkpoint(f"dfly-mlx-{version()}-{target}-random",
                          lambda: DFlyDraftModel(DFlashDraftModelArgs.from_dict(cfg)), cfg, seed=1)
    return str(d)


def drafter_path(case: SubjectCase) -> str | None:
    return drafter_dir(case.target)


@cache
def _bundle(target: str) -> Any:
    from dfly_mlx.loading import load_runtime

    return load_runtime(str(zoo.model_dir(target)), drafter_dir(target))


def generate(case: SubjectCase) -> SubjectRun:
    from dflash_mlx.engine.events import TokenEvent
    from dflash_mlx.runtime import stream_dflash_generate
    from dflash_mlx.runtime.context import build_offline_runtime_context

    case_mode(case, MODES, "dfly-mlx", stop=_STOP, greedy=_GREEDY)
    b = _bundle(case.target)
    ctx = build_offline_runtime_context(verify_mode="dflash")
    if hasattr(ctx.runtime, "copyspec_mode"):
        ctx = replace(ctx, runtime=replace(ctx.runtime, copyspec_mode="off"))

    def run() -> list[Any]:
        return list(stream_dflash_generate(
            target_model=b.target_model, target_ops=b.target_ops, tokenizer=b.tokenizer,
            draft_model=b.draft_model, draft_backend=b.draft_backend, prompt="", max_new_tokens=case.max_tokens,
            use_chat_template=False, block_tokens=int(b.draft_model.block_size),
            stop_token_ids=sorted(eos_for(case.eos_ids)),
            prompt_tokens_override=list(prompt_ids(case.prompt_id)), runtime_context=ctx))

    events, wall = timed(run)
    tokens = [int(e.token_id) for e in events if isinstance(e, TokenEvent)]
    counters, extra = summary_counters(events)
    return SubjectRun(stream=tokens, finish_reason=None, counters=counters, wall_s=wall, extra=extra,
                      hooks=["dfly_mlx.loading.load_runtime", "dflash_mlx.runtime.stream_dflash_generate "
                             "(as dfly_mlx.generate.generate calls it)"])
