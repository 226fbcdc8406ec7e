"""mlx-flash 0.9.2 (PyPI ``mlx-flash``, module ``mlx_flash_compress``): its speculative engines, driven unmodified.

Reference (each an engine class with ``generate(prompt_tokens, max_tokens, callback)``
returning the prompt followed by the generated ids; EOS read from
``tokenizer.eos_token_id`` and checked after a verify step's tokens are appended;
no finish reason, no stop-id parameter):

- ``layerskip.py`` ``LayerSkipEngine`` (self-speculation: the target's first
  ``exit_layer`` layers + its norm and lm-head draft ``num_speculative_tokens``
  tokens with the target's own KV cache; ``_verify_and_accept`` verifies
  ``[last, *drafts]`` by argmax, the first token comes from the prefill);
- ``eagle3.py`` ``EAGLE3Engine`` (an ``EAGLEDraftHead`` predicts the next hidden,
  the target's lm-head turns it into a token; ``verify`` runs the target over the
  whole context + drafts, no cache, argmax);
- ``dflash.py`` ``DFlashEngine`` with a ``BlockDiffusionDrafter`` (``num_spec_tokens``
  drafts from noise conditioned on the target's checkpoint-layer hiddens;
  ``verify_tokens``: argmax at temperature 0, ``mx.random.categorical`` of the
  softmax otherwise);
- ``sequoia.py`` ``SequoiaEngine`` (two-model: a draft model builds a speculation
  tree of ``tree_width`` branches, ``_verify_candidates`` runs the target on the
  FIRST path, ``SpeculationTree.select_accepted`` takes the longest matching path;
  ``offload_layers=False``: no SSD streaming; ``draft_latency_ms=0`` so that
  ``compute_optimal_depth`` always picks ``max_draft_tokens = gamma``). A round's
  drafts are the first path (the one the target verified); its accepted count is
  the common prefix of that path with the tokens the round appended.

The drafters are the engines' own classes with their own seeded random
initialisation (``mx.random.seed(0)`` before construction; mlx-flash ships no
trained head for the zoo targets): they exercise the reject path, and the
twin draft model of the zoo exercises accepts for Sequoia. Rounds are recorded
by wrapping this engine instance's own verify method (the method stays
mlx-flash's): its drafts, its accepted count (``acceptance_counts`` where the
engine keeps one, else the longest common prefix of drafts and committed
tokens) and the tokens the round appended. Trace level: round.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import zoo
from subjects import Mode
from subjects.base import RoundReport, SubjectCase, SubjectRun, timed
from subjects.common import (
    EosTokenizer,
    case_mode,
    dist_version,
    eos_for,
    prompt_ids,
    require_module,
)
from traces.diff import common_prefix

NAME = "mlx-flash"
_NO_STOP = "no stop-id parameter (generate() stops only on tokenizer.eos_token_id)"
_ARGMAX = "verifies by argmax only (the verify step takes no temperature)"
MODES = {
    "layerskip": Mode(targets=("llama", "qwen3"),
                      note="LayerSkipEngine (exit_layer auto = layers // 2, num_speculative_tokens = gamma)",
                      unsupported={"stop": _NO_STOP, "distribution": _ARGMAX}),
    "eagle3": Mode(targets=("llama", "qwen3"), drafter="eagle3-seeded",
                   note="EAGLE3Engine, EAGLEDraftHead of its own seeded init, num_draft_tokens = gamma",
                   unsupported={"stop": _NO_STOP, "distribution": _ARGMAX}),
    "dflash": Mode(targets=("llama", "qwen3"), drafter="dflash-seeded", samples=True,
                   note="DFlashEngine + BlockDiffusionDrafter of its own seeded init, num_spec_tokens = gamma, "
                        "checkpoint_layers = every target layer",
                   unsupported={"stop": _NO_STOP}),
    "sequoia": Mode(targets=("llama", "qwen3"), drafter="twin", two_model=True, samples=True,
                    note="SequoiaEngine(zoo twin draft model), max_draft_tokens = gamma, draft_latency_ms = 0 "
                         "(tree depth = gamma), tree_width 3, offload_layers=False",
                    unsupported={"stop": _NO_STOP}),
}


def require() -> None:
    require_module("mlx_flash_compress.layerskip", NAME)
    for m in ("eagle3", "dflash", "sequoia"):
        require_module(f"mlx_flash_compress.{m}", NAME)


def version() -> str:
    return dist_version("mlx-flash")


@cache
def _load(path: str) -> tuple[Any, Any]:
    from mlx_lm import load

    model, tok = load(path)
    return model, tok


def drafter_path(case: SubjectCase) -> str | None:
    return str(zoo.pair(case.target, "twin")[1]) if case.mode == "sequoia" else None


class _Rounds:
    """Per-round (drafts, accepted, committed tokens) from the instance's own verify calls."""

    def __init__(self) -> None:
        self.rounds: list[RoundReport] = []

    def add(self, drafts: list[int], committed: list[int], accepted: int | None) -> None:
        k = common_prefix(drafts, committed) if accepted is None else int(accepted)
        self.rounds.append(RoundReport(drafted=len(drafts), accepted=k, committed=len(committed),
                                       drafts=list(drafts)))


def _ids(x: Any) -> list[int]:
    import numpy as np

    return [int(t) for t in np.array(x).reshape(-1).tolist()]


def _build(case: SubjectCase, tokenizer: Any, rec: _Rounds) -> tuple[Any, list[str]]:
    import mlx.core as mx

    model, _ = _load(str(zoo.model_dir(case.target)))
    if case.mode == "layerskip":
        from mlx_flash_compress.layerskip import LayerSkipConfig, LayerSkipEngine

        eng = LayerSkipEngine(model, tokenizer, LayerSkipConfig(num_speculative_tokens=case.gamma))
        verify = eng._verify_and_accept

        def ls_verify(last: int, drafts: list[int], cache_: Any) -> Any:
            new, k = verify(last, drafts, cache_)
            rec.add(list(drafts), [int(t) for t in new], k)
            return new, k

        eng._verify_and_accept = ls_verify
        return eng, ["mlx_flash_compress.layerskip.LayerSkipEngine.generate",
                     "LayerSkipEngine._verify_and_accept (instance wrapper)"]
    if case.mode == "eagle3":
        from mlx_flash_compress.eagle3 import EAGLE3Config, EAGLE3Engine

        mx.random.seed(0)
        eng = EAGLE3Engine(model, tokenizer, EAGLE3Config(num_draft_tokens=case.gamma))
        everify = eng.verify

        def e_verify(input_ids: Any, drafts: Any) -> Any:
            acc, n = everify(input_ids, drafts)
            rec.add(_ids(drafts), _ids(acc), eng.stats["acceptance_counts"][-1])
            return acc, n

        eng.verify = e_verify
        return eng, ["mlx_flash_compress.eagle3.EAGLE3Engine.generate", "EAGLE3Engine.verify (instance wrapper)"]
    if case.mode == "dflash":
        from mlx_flash_compress.dflash import BlockDiffusionDrafter, DFlashConfig, DFlashEngine

        n_layers = len(model.model.layers)
        args = model.args
        mx.random.seed(0)
        drafter = BlockDiffusionDrafter(int(args.vocab_size), int(args.hidden_size), num_layers=2,
                                        num_heads=int(args.num_attention_heads),
                                        num_draft_positions=case.gamma, num_checkpoint_layers=n_layers)
        cfg = DFlashConfig(num_spec_tokens=case.gamma, checkpoint_layers=list(range(n_layers)),
                           temperature=case.temperature)
        eng = DFlashEngine(model, drafter, cfg, tokenizer)
        dverify = eng.verify_tokens

        def d_verify(input_ids: Any, drafts: Any) -> Any:
            acc, n = dverify(input_ids, drafts)
            rec.add(_ids(drafts), _ids(acc), None)
            return acc, n

        eng.verify_tokens = d_verify
        return eng, ["mlx_flash_compress.dflash.DFlashEngine.generate", "DFlashEngine.verify_tokens (instance wrapper)"]
    from mlx_flash_compress.sequoia import SequoiaConfig, SequoiaEngine

    draft, _ = _load(str(zoo.pair(case.target, "twin")[1]))
    # draft_latency_ms=0: compute_optimal_depth's throughput then grows with depth, so every tree is
    # max_draft_tokens = gamma deep and its first path is the draft model's greedy chain (mlx-lm's drafts)
    cfg = SequoiaConfig(max_draft_tokens=case.gamma, offload_layers=False, draft_latency_ms=0.0,
                        temperature=case.temperature)
    eng = SequoiaEngine(draft, model, tokenizer, cfg)
    sverify, select = eng._verify_candidates, eng.tree.select_accepted
    seen: dict[str, list[int]] = {}

    def s_verify(context: Any, candidates: Any) -> Any:
        import numpy as np

        first = np.array(candidates)
        first = first[0] if first.ndim == 2 else first
        seen["drafts"] = [int(t) for t in first.tolist() if t >= 0]
        return sverify(context, candidates)

    def s_select(tree: Any, verified: Any) -> Any:
        acc = select(tree, verified)
        rec.add(seen.get("drafts", []), _ids(acc), None)
        return acc

    eng._verify_candidates, eng.tree.select_accepted = s_verify, s_select
    return eng, ["mlx_flash_compress.sequoia.SequoiaEngine.generate",
                 "SequoiaEngine._verify_candidates / SpeculationTree.select_accepted (instance wrappers)"]


def _counters(case: SubjectCase, eng: Any, rounds: list[RoundReport]) -> dict[str, int]:
    """The engine's own tallies, under the names the counters check defines."""
    if case.mode in ("layerskip", "eagle3"):
        s = eng.stats
        return {"drafted": int(s["total_draft_tokens"]), "accepted": int(sum(s["acceptance_counts"])),
                "rounds": int(s["total_verify_steps"])}
    if case.mode == "dflash":
        s = eng.stats
        return {"drafted": int(s.total_drafts), "rounds": int(s.total_target_calls)}
    return {"rounds": int(eng._total_verify_rounds)}


def _clip(rounds: list[RoundReport], emitted: int) -> None:
    """A round's committed count is what reached the output: a loop that cuts a verify's tokens
    (at the budget, before an EOS) committed only those (mlx-flash 0.9.2 appends them all)."""
    for r in rounds:
        r.committed = max(0, min(r.committed, emitted))
        emitted -= r.committed


def generate(case: SubjectCase) -> SubjectRun:
    import mlx.core as mx

    mode = case_mode(case, MODES, "mlx-flash", stop=_NO_STOP, single_eos=True)
    if case.temperature > 0 and not mode.samples:
        from subjects.base import SubjectUnsupported

        raise SubjectUnsupported(mode.unsupported.get("distribution", _ARGMAX))
    _, tok = _load(str(zoo.model_dir(case.target)))
    tokenizer = EosTokenizer(tok, eos_for(case.eos_ids))
    rec = _Rounds()
    eng, hooks = _build(case, tokenizer, rec)
    ids = list(prompt_ids(case.prompt_id))
    mx.random.seed(case.seed)
    out, wall = timed(eng.generate, mx.array(ids), max_tokens=case.max_tokens)
    full = _ids(out)
    if full[: len(ids)] != ids:
        raise RuntimeError(f"generate() did not return the prompt first: {full[:len(ids)]} vs {ids}")
    stream = full[len(ids):]
    prefill = 1 if case.mode == "layerskip" and stream else 0
    _clip(rec.rounds, len(stream) - prefill)
    return SubjectRun(stream=stream, finish_reason=None, hooks=hooks, rounds=rec.rounds,
                      counters=_counters(case, eng, rec.rounds), wall_s=wall, prefill_tokens=prefill,
                      extra={"note": "generate() returns prompt + output; the prompt is cut here"})
