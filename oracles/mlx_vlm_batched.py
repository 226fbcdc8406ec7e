"""Oracle runner for mlx-vlm's BATCHED speculative loops (MTP and DFlash), driven unmodified.

Reference: mlx-vlm 0.7.10 ``generate/ar.py`` ``BatchGenerator`` — the continuous-batching
generator its server builds per request batch (``server/generation.py``: prompt ids plus the
``get_input_embeddings`` kwargs per row, ``insert``, ``next`` until no work) — with
``draft_model``/``draft_kind``: ``PromptProcessingBatch.generate`` (one left-padded prefill
forward over every row, the first token of each row) → ``SpeculativeGenerationBatch.next`` →
``speculative/utils.py`` ``run_speculative_server_rounds`` →

- ``draft_kind="mtp"``: ``speculative/mtp.py`` ``_mtp_rounds_batch`` at every B (the zoo
  ``qwen3_5_mtp`` heads on ``qwen35``, the gemma4 ``-assistant`` heads on ``gemma4``);
- ``draft_kind="dflash"``: ``speculative/dflash.py`` ``_dflash_rounds_batch`` for B >= 2,
  ``_dflash_rounds`` for B = 1 (the zoo DSpark drafters ``gemma4-dspark`` — mlx-vlm's
  ``DSparkDraftModel`` — and ``gemma4-deepspec-kv`` — its ``Gemma4DSparkDraftModel``).

Per round: draft per row, ONE target verify forward over ``[B_active, block]``, the per-row walk
(``common._speculative_walk_batch``; sampled: the positioned walks), then — when the drafter or
the target declares ``requires_uniform_batch_acceptance`` (every zoo pair here: qwen3_5 and gemma4
targets, the MTP drafters) and the rows disagree — every row clamped to the earliest rejection
(``_speculative_walk_batch_uniform_acceptance`` / the inline clamp of ``_dflash_rounds_batch``),
because "the target's rectangular batch KV cache (single ``_idx``) cannot represent ragged
accepts" (its issue #1962); then ``commit_speculative_round`` and the emission. A row whose own
budget is reached stays in the round loop until its tokens are dropped by the consumer
(``SpeculativeGenerationBatch``: the loop runs to the LARGEST budget; the consumer cuts each
row at its own ``max_tokens`` and at EOS).

Targets: mlx-vlm's own model classes carrying the zoo weights (``oracles.mlx_vlm.load_target``:
``qwen3_5.Model`` — native, or the §3-aligned ``pre-norm`` adapter — and ``gemma4.Model``).
Instrumentation from outside, for the duration of one run: the module globals
``mtp._mtp_verify_target`` / ``dflash._dflash_verify`` / ``dflash._dflash_verify_greedy`` (each
row's verify window and its float32 logits: ``mtp._mtp_logits_from_hidden`` on the verify hidden,
the verify output's logits for DFlash), the walks (each row's OWN accepted count, before any
clamp) and ``commit_speculative_round`` (what the loop committed per row). The rows present at
a step are the loop's own ``active_idx`` (read from its frame while it runs). Every row's stream
is rebuilt from these records and compared with what the generator handed the consumer
(``RowRun.mismatch``: the first token a row received that its own walk did not emit for it).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from oracles import OracleUnavailable

NAME = "mlx_vlm_batched"
_LOOPS = {"_mtp_rounds_batch", "_dflash_rounds_batch"}
_SERIAL_LOOPS = {"_mtp_rounds", "_dflash_rounds"}


def require() -> None:
    try:
        import mlx_vlm.generate.ar  # noqa: F401
        import mlx_vlm.speculative.dflash  # noqa: F401
        import mlx_vlm.speculative.drafters  # noqa: F401
        import mlx_vlm.speculative.mtp  # noqa: F401
    except ImportError as exc:
        raise OracleUnavailable("mlx-vlm is not installed") from exc


def version() -> str:
    return metadata.version("mlx-vlm")


@dataclass
class RowStep:
    """One row's part of one batch step (a round of the loop)."""

    step: int  # the loop's round index (0 = the first verify)
    slot: int  # the row's slot in the step's batch
    present: list[int]  # the rows in the batch at this step (the caller's row numbers)
    window: list[int]  # [pending, *drafts]
    k_own: int | None  # accepted by the row's OWN walk (None: the walk was uniform already)
    k: int  # what the loop committed for the row
    new: list[int]  # the tokens the loop emitted for the row (before the consumer's cut)
    logits: Any = None  # [len(window), V] float32 verify rows (numpy), None if not captured


@dataclass
class RowRun:
    """One row of a batched run, as the consumer received it."""

    row: int
    prompt_len: int
    budget: int
    tokens: list[int]  # content tokens (the EOS that ended the row stripped)
    finish: str  # "stop" (EOS) | "length"
    steps: list[RowStep] = field(default_factory=list)
    stream: list[int] = field(default_factory=list)  # as received, the EOS that ended it included
    # the first output token where what the consumer received is not what the loop's walk emitted
    # for this row ({"pos", "received", "walk"}), None when they agree
    mismatch: dict[str, Any] | None = None

    def kept(self, index: int) -> tuple[list[int], bool]:
        """The tokens the consumer kept of step ``index`` (of :attr:`steps`) and whether that step
        is the row's last (cut by the budget or an EOS: its content tokens, EOS stripped)."""
        at = 1 + sum(len(st.new) for st in self.steps[:index])
        new = self.steps[index].new
        seg = self.stream[at : at + len(new)]
        last = at + len(new) >= len(self.stream)
        if last and self.finish == "stop":
            seg = seg[:-1] if seg else seg
        return seg, last

    def origin(self, pos: int) -> tuple[RowStep, int] | None:
        """The step and window position whose sample is output token ``pos`` (None: the first
        token, sampled by the prefill)."""
        if pos < 1:
            return None
        at = 1
        for st in self.steps:
            if pos < at + len(st.new):
                return st, pos - at
            at += len(st.new)
        return None


@dataclass
class BatchRun:
    kind: str  # mlx-vlm's draft kind: "mtp" | "dflash"
    drafter: str  # the drafter class
    uniform: bool  # the loop declares uniform acceptance (requires_uniform_batch_acceptance)
    rows: list[RowRun]
    wall_s: float = 0.0


def load_drafter(drafter_dir: str | Path) -> tuple[Any, str]:
    """mlx-vlm's ``load_drafter`` (kind ``mtp`` or ``dflash``)."""
    require()
    from mlx_vlm.speculative.drafters import load_drafter as vlm_load

    draft, kind = vlm_load(str(drafter_dir))
    if kind not in ("mtp", "dflash"):
        raise RuntimeError(f"mlx-vlm resolved draft kind {kind!r} for {drafter_dir}; the batched loops "
                           "driven here are 'mtp' and 'dflash'")
    return draft, kind


def _keep_plain_head(draft: Any, model: Any) -> None:
    """The §3-aligned ``pre-norm`` target adapter (``oracles.mlx_vlm.load_target``) leaves the plain
    linear head on ``Model.lm_head`` for the drafter (its ``lm_head`` is norm-then-head): the serial
    loop binds the drafter to the ``Model``, which ``bind`` looks up first. ``BatchGenerator`` hands the
    loop the language model instead, so the drafter would borrow norm-then-head; wrap the instance's
    ``bind`` (from outside) so it keeps the plain head there too. Native targets: nothing to do."""
    plain = model.get("lm_head") if isinstance(model, dict) else None  # an mlx Module is a dict of its children
    if plain is None or getattr(model.language_model, "lm_head", None) is plain:
        return
    bind = draft.bind

    def bind_plain_head(target: Any) -> Any:
        out = bind(target)
        draft._lm_head_fn = plain
        return out

    draft.bind = bind_plain_head


def untied_head(target_dir: str | Path) -> Any:
    """The zoo target's own untied ``lm_head`` (mlx-lm's loader), or None when it ties its head.

    ``oracles.mlx_vlm.load_target`` maps the zoo gemma4 target (untied) into mlx-vlm's
    ``gemma4.Model``, whose language model always ties: it installs the untied head as the
    instance's ``logits_from_hidden``, which the target's logits go through. A DFlash drafter that
    borrows the target's head (``DFlashDraftModel.bind``: ``lm_head`` of the model or its language
    model, else ``embed_tokens.as_linear``) would then fall back to the tied embedding — a drafter
    whose drafts echo its input block (anchor, mask, mask, ...). Real Gemma 4 checkpoints tie,
    so this is the mapping's business, not mlx-vlm's: :func:`run_batch` binds such a drafter to
    this head (as ``oracles.mlx_vlm_dspark``'s adapter does, ``LM.lm_head``)."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    src, _ = load_model(Path(target_dir))
    return src.lm_head if "lm_head.weight" in dict(tree_flatten(src.parameters())) else None


def _bind_untied_head(draft: Any, head: Any) -> None:
    """Wrap the drafter instance's ``bind`` so that a fallback to the tied embedding becomes ``head``
    (:func:`untied_head`); a drafter with its own head (``Gemma4DSparkDraftModel``) keeps it."""
    if head is None:
        return
    bind = draft.bind

    def bind_untied(target: Any) -> Any:
        out = bind(target)
        fell_back = getattr(getattr(draft, "lm_head", None), "__self__", None) is getattr(draft, "embed_tokens", 0)
        if fell_back:
            draft.lm_head = head
        return out

    draft.bind = bind_untied


def _loop_rows() -> list[int]:
    """The rows present in the running round loop (its ``active_idx``; [0] in a serial loop)."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_name
        if name in _LOOPS:
            return [int(i) for i in f.f_locals["active_idx"]]
        if name in _SERIAL_LOOPS:
            return [0]
        f = f.f_back
    raise RuntimeError("mlx_vlm_batched: a verify outside mlx-vlm's round loops")


def _ints(x: Any) -> list[int]:
    import mlx.core as mx

    if isinstance(x, int):
        return [int(x)]
    if isinstance(x, mx.array):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


def _rows(x: Any) -> list[list[int]]:
    return [[int(t) for t in row] for row in x.tolist()]


def _host(logits: Any) -> Any:
    import mlx.core as mx
    import numpy as np

    return np.array(logits.astype(mx.float32))


@contextmanager
def _capture(steps: list[dict[str, Any]]):  # noqa: ANN202
    """Wrap the loops' module globals (module docstring); one dict per round in ``steps``."""
    from mlx_vlm.speculative import dflash as vdf
    from mlx_vlm.speculative import mtp as vmtp

    orig = {(m, n): getattr(m, n) for m, n in (
        (vmtp, "_mtp_verify_target"), (vmtp, "_speculative_walk_batch"),
        (vmtp, "_speculative_walk_batch_deferred_greedy"), (vmtp, "_speculative_walk_batch_deferred_uniform"),
        (vmtp, "commit_speculative_round"), (vdf, "_dflash_verify"), (vdf, "_dflash_verify_greedy"),
        (vdf, "_speculative_walk_batch"), (vdf, "_speculative_walk"), (vdf, "_sample_dflash_target_walk"),
        (vdf, "commit_speculative_round"))}  # fmt: skip
    depth = {"walk": 0, "verify": 0}
    pending: dict[str, Any] = {"logits": None}
    project = vmtp._mtp_logits_from_hidden

    def open_step(window: Any) -> dict[str, Any]:
        st = {"present": _loop_rows(), "window": _rows(window), "logits": None, "own": None, "new": None,
              "k": None}
        steps.append(st)
        return st

    def mtp_verify(lm: Any, verify_input: Any, *a: Any, **k: Any) -> Any:
        res = orig[(vmtp, "_mtp_verify_target")](lm, verify_input, *a, **k)
        st = open_step(verify_input)
        st["logits"] = _host(project(lm, res.hidden))
        return res

    def df_verify(lm: Any, inputs: Any, *a: Any, **k: Any) -> Any:
        out = orig[(vdf, "_dflash_verify")](lm, inputs, *a, **k)
        logits = None if out[0].logits is None else _host(out[0].logits)
        if depth["verify"]:  # inside _dflash_verify_greedy: it opens the step
            pending["logits"] = logits
        else:
            open_step(inputs)["logits"] = logits
        return out

    def df_verify_greedy(lm: Any, verify_input: Any, *a: Any, **k: Any) -> Any:
        depth["verify"] += 1
        pending["logits"] = None
        try:
            out = orig[(vdf, "_dflash_verify_greedy")](lm, verify_input, *a, **k)
        finally:
            depth["verify"] -= 1
        open_step(verify_input)["logits"] = pending["logits"]
        return out

    def walk_of(key: tuple[Any, str], own: bool, single: bool = False) -> Any:
        def walk(*a: Any, **k: Any) -> Any:
            depth["walk"] += 1
            try:
                res = orig[key](*a, **k)
            finally:
                depth["walk"] -= 1
            if depth["walk"] == 0:
                accepted, new = ([res[0]], [res[1]]) if single else res
                steps[-1]["own"] = [int(x) for x in accepted] if own else None
                steps[-1]["new"] = [[int(t) for t in row] for row in new]
            return res

        return walk

    def commit_of(key: tuple[Any, str]) -> Any:
        def commit(model: Any, caches: Any, state: Any, accepted: Any, block_size: int) -> Any:
            steps[-1]["k"] = _ints(accepted)
            return orig[key](model, caches, state, accepted, block_size)

        return commit

    patch = {
        (vmtp, "_mtp_verify_target"): mtp_verify,
        (vmtp, "_speculative_walk_batch"): walk_of((vmtp, "_speculative_walk_batch"), True),
        (vmtp, "_speculative_walk_batch_deferred_greedy"):
            walk_of((vmtp, "_speculative_walk_batch_deferred_greedy"), True),
        (vmtp, "_speculative_walk_batch_deferred_uniform"):
            walk_of((vmtp, "_speculative_walk_batch_deferred_uniform"), False),
        (vmtp, "commit_speculative_round"): commit_of((vmtp, "commit_speculative_round")),
        (vdf, "_dflash_verify"): df_verify,
        (vdf, "_dflash_verify_greedy"): df_verify_greedy,
        (vdf, "_speculative_walk_batch"): walk_of((vdf, "_speculative_walk_batch"), True),
        (vdf, "_speculative_walk"): walk_of((vdf, "_speculative_walk"), True, single=True),
        (vdf, "_sample_dflash_target_walk"): walk_of((vdf, "_sample_dflash_target_walk"), True),
        (vdf, "commit_speculative_round"): commit_of((vdf, "commit_speculative_round")),
    }
    try:
        for (m, n), fn in patch.items():
            setattr(m, n, fn)
        yield
    finally:
        for (m, n), fn in orig.items():
            setattr(m, n, fn)


def run_batch(
    model: Any,
    drafter_dir: str | Path,
    prompts: list[list[int]],
    budgets: list[int],
    *,
    eos_ids: list[int],
    block_size: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    prefill_step_size: int | None = None,
    head: Any = None,
) -> BatchRun:
    """mlx-vlm's batched loop on ``len(prompts)`` rows, all admitted together (module docstring).

    ``block_size``: the verify block (γ + 1; None: the drafter's own). ``temperature > 0``: the
    server's sampler for a request with a seed (``_PositionedTargetSampler``: draws keyed per
    (seed, row id, output position); the server passes row id 0 for every row).
    ``head``: the target's own untied head for a drafter that borrows it (:func:`untied_head`).
    ``prefill_step_size=None``: one prefill forward per batch (``PromptProcessingBatch`` unchunked;
    the MTP drafter then gets every prompt row, §3 ``prefill_mode = "full"``).
    """
    require()
    from types import SimpleNamespace

    import mlx.core as mx
    from mlx_vlm.generate.ar import BatchGenerator, _PositionedTargetSampler
    from mlx_vlm.speculative.common import _requires_uniform_batch_acceptance
    from mlx_vlm.utils import StoppingCriteria

    if len(prompts) != len(budgets) or not prompts:
        raise ValueError(f"mlx_vlm_batched: {len(prompts)} prompts for {len(budgets)} budgets")
    draft, kind = load_drafter(drafter_dir)
    lm = model.language_model
    _keep_plain_head(draft, model)
    _bind_untied_head(draft, head)
    eos = [int(e) for e in eos_ids]
    sampler = None if temperature == 0 else _PositionedTargetSampler(temperature=temperature, top_p=0.0, seed=seed)
    processor = SimpleNamespace(stopping_criteria=StoppingCriteria(eos, tokenizer=None))
    gen = BatchGenerator(lm, processor, sampler=sampler, draft_model=draft, draft_kind=kind,
                         draft_block_size=block_size, greedy_sampling=temperature == 0,
                         prefill_batch_size=len(prompts), completion_batch_size=len(prompts),
                         prefill_step_size=prefill_step_size)  # fmt: skip
    kwargs = []
    for ids in prompts:
        emb = model.get_input_embeddings(mx.array([ids]), None)
        kwargs.append({k: v for k, v in emb.to_dict().items() if v is not None})
    steps: list[dict[str, Any]] = []
    streams: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    order: list[int] = []  # the loop's row i is the request uid order[i] (insert sorts by length)
    t0 = time.perf_counter()
    with _capture(steps):
        try:
            uids = gen.insert([list(p) for p in prompts], list(budgets), prompt_kwargs=kwargs)
            streams = {u: [] for u in uids}
            while gen.has_work:
                _, responses = gen.next()
                order = order or list(getattr(gen._generation_batch, "_all_uids", None) or [])
                for r in responses:
                    if r.token is not None:
                        streams[r.uid].append(int(r.token))
                    if r.finish_reason:
                        finish[r.uid] = r.finish_reason
        finally:
            gen.close()
    wall = time.perf_counter() - t0
    if sorted(order) != sorted(uids):
        raise RuntimeError(f"mlx_vlm_batched: the speculative batch holds uids {order}, inserted {uids}")
    for st in steps:  # the rows present, as the caller numbers them
        st["rows"] = [uids.index(order[i]) for i in st["present"]]
    rows = [_rebuild(i, order.index(u), prompts[i], budgets[i], streams[u], finish.get(u), steps, set(eos))
            for i, u in enumerate(uids)]
    return BatchRun(kind, type(draft).__name__, bool(_requires_uniform_batch_acceptance(draft, lm)), rows, wall)


def _rebuild(row: int, loop_row: int, prompt: list[int], budget: int, stream: list[int], finish: str | None,
             steps: list[dict[str, Any]], eos: set[int]) -> RowRun:
    """Row ``row`` (the loop's row ``loop_row``)'s steps from the loop's records. Its stream rebuilt
    from the walks and commits should be what the consumer received; where it is not (the loop
    handed a row tokens its own walk did not emit for it) :attr:`RowRun.mismatch` names the first
    such output token and batch step, for the grading to report."""
    if not stream:
        raise RuntimeError(f"mlx_vlm_batched row {row}: no token received")
    out = RowRun(row, len(prompt), budget, [], "stop" if stream[-1] in eos else (finish or "length"))
    rebuilt = [stream[0]]
    for s, st in enumerate(steps):
        if loop_row not in st["present"]:
            continue
        if st["new"] is None or st["k"] is None:
            raise RuntimeError(f"mlx_vlm_batched step {s}: no walk or no commit recorded")
        j = st["present"].index(loop_row)
        k = st["k"][j] if len(st["k"]) > 1 else st["k"][0]
        new = st["new"][j][: k + 1]
        own = None if st["own"] is None else st["own"][j]
        logits = None if st["logits"] is None else st["logits"][j]
        out.steps.append(RowStep(s, j, list(st["rows"]), st["window"][j], own, k, new, logits))
        rebuilt += new
    cut = []
    for t in rebuilt:
        cut.append(t)
        if t in eos or len(cut) >= budget:
            break
    if cut != stream:
        pos = next((i for i, (x, y) in enumerate(zip(cut, stream, strict=False)) if x != y), min(len(cut), len(stream)))
        out.mismatch = {"pos": pos, "received": stream[pos] if pos < len(stream) else None,
                        "walk": cut[pos] if pos < len(cut) else None}
    out.tokens = stream[:-1] if stream[-1] in eos else list(stream)
    out.stream = list(stream)
    # the steps whose tokens the consumer took (a row finished by its budget runs on until the
    # loop's largest budget; those rounds are dropped)
    kept, n = [], 1
    for st in out.steps:
        if n >= len(stream):
            break
        kept.append(st)
        n += len(st.new)
    out.steps = kept
    return out
