"""Numerics witness: does arithmetic alone explain a token flip between two runs?

Reference: ``../shared/reference/speculative-decoding.md`` §2.1 (batched verify
vs stock decode: on a non-bit-exact backend the verify window and one-token
decode may pick different tokens on a knife-edge; a flip the arithmetic does
not explain is a bug) and the paths of mlx-lm 0.32.2 ``mlx_lm/generate.py``
that the engine mirrors (``engine/executor.py``): ``speculative_generate_step``
(ONE target forward over ``[pending, *drafts]`` on the cache holding the
prefix, ``_process_and_sample`` over the block, ``trim_prompt_cache`` rollback)
and ``generate_step`` (one token per forward, ``logits - logsumexp`` over the
row).

Given a :class:`traces.diff.Flip` -- run A sampled ``x_a`` and run B sampled
``x_b`` after the same output prefix -- each run's arithmetic path is replayed
from its own trace, in this process, on MLX's default device:

1. the prefill the trace records (``prefill.target_tokens`` in chunks of
   ``params.prefill_step_size``);
2. every earlier record in order: a ``round`` is its batched verify forward
   over the recorded window followed by the contract's rollback to the kept
   positions ``window[:k_accept + 1]``, done by the witness itself with
   mlx-lm's cache API and never through the engine's rollback code under test
   (:class:`_ExactRound`): ``trim(d - k)`` where a cache can trim exactly; a
   rotating cache whose window would wrap is restored from a pre-window copy
   and given the verify's own K/V cut to the kept positions through
   ``update_and_fetch``; a recurrent ``ArraysCache`` is restored and its mixer
   re-run on the kept positions with the verify's own projections served (the
   spec-round trio). The kept state thus holds the bytes the verify computed,
   as the engine's own rollback does. A ``plain`` record is a one-token forward
   (``initial``: the prefill's last row, nothing fed);
3. the record that sampled the contested token: its verify window (row *p*
   of the block, sampled as the window is) or its one-token step.

So the cache always holds exactly the common prefix, built the way that run
built it, with the contract's rollback -- never a run's own rollback mistake.
Each path's token is the greedy pick of the run's sampler ops. Verdict:
``numerics`` only when A's path reproduces ``x_a`` AND B's path reproduces
``x_b``: the same prefix, two arithmetic paths, two tokens. Otherwise
``logic``: a run sampled a token its own path does not give on the correct
prefix (a wrong cache, a leaked or lost token, a different model...). A plain
serial decode of the same prefix is evaluated as well, as a reference row.
Each run's first record (before any rollback) calibrates its replay: the
replayed margins must equal the recorded ones, and the trace's platform
(mlx, device, backend) must be this process's; otherwise the witness raises
``traces.diff.WitnessDeclined`` (another machine's or an emulation's
arithmetic cannot be replayed here). The witness judges greedy runs only
(``temperature == 0``); a greedy run's logits processors (header
``params.logits_processors``: mlx-lm ``make_logits_processors`` arguments and
``history_prompt``) are applied as the engine applies them
(``engine.sampler.StepSampler``): the history starts at the prompt (all of it,
or its last token) and grows by each record's emitted tokens, and a verify
window's rows see the window's head and the path's own samples. Draft flips of
runs with processors are not judged. It returns ``None`` for sampled runs and
when no model is at hand, and the diff falls back to its eps rule, labelled as
such.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx

from engine.audit import clone_caches
from engine.caches import KVQuantization, quantize_kv
from engine.params import params_from_header, processors_from_block
from engine.pipeline import SamplingPipeline, allowed_top2
from engine.rollback import RECURRENT_MIXERS, is_arrays, is_kv, is_rotating
from engine.sampler import SamplerParams, StepSampler, token_ids
from engine.stream import PLAIN_PREFILL_STEP, SPEC_PREFILL_STEP, prefill_chunks
from traces.diff import Flip, TokenSite, WitnessDeclined, WitnessVerdict
from traces.io import Trace
from traces.records import platform_info

__all__ = [
    "NumericsWitness",
    "PathEval",
    "PipelineFactory",
    "VerifyPath",
    "evaluate_draft_path",
    "evaluate_path",
    "header_pipeline",
    "max_row_delta",
    "pair_delta",
    "path_witness",
    "serial_path",
    "top2_allowed",
    "verify_path",
    "witness_draft_flip",
    "witness_flip",
]

# Replayed vs recorded margins of a run's first record, relative to its largest logit:
# measured 0 on the CPU (engine and mlx-lm traces); GPU arithmetic differences are ~1e-4..1e-3.
# SPECPARITY_WITNESS_TOL overrides it (e.g. on a backend whose kernels are not run-to-run
# deterministic; the message of a declined witness says by how much the replay missed).
CALIBRATION_TOL = 1e-6


def calibration_tol() -> float:
    """``SPECPARITY_WITNESS_TOL`` (``traces.env``; malformed: one line naming it) or :data:`CALIBRATION_TOL`."""
    from traces import env

    return float(env.get("SPECPARITY_WITNESS_TOL", CALIBRATION_TOL))

ModelResolver = Callable[[dict[str, Any]], Any]
"""``resolve(trace_header) -> target model`` (an mlx-lm ``nn.Module``) or ``None``."""


@dataclass
class PathEval:
    """One arithmetic path's view of the contested position.

    Attributes:
        label: Which run and record (``"a round 3 pos 1"``).
        path: How it was computed (``"verify window of 4 (batched)"``).
        token: The path's greedy pick (the run's sampler ops).
        top2: ``((id, logit), (id, logit))`` of the path's row.
        row: The path's float32 logit row (not serialised).
        ran: The token the run recorded there, or ``None`` (reference path).
        recorded_margin: The run's recorded top-1/top-2 margin there.
        notes: Replay notes (e.g. a round rolled back by re-feed).
        calibration: Largest relative |replayed - recorded| margin of the
            run's first record (``None``: nothing to compare).
    """

    label: str
    path: str
    token: int
    top2: tuple[tuple[int, float], tuple[int, float]]
    row: Any
    ran: int | None = None
    recorded_margin: float | None = None
    notes: list[str] = field(default_factory=list)
    calibration: float | None = None

    @property
    def margin(self) -> float:
        return self.top2[0][1] - self.top2[1][1]

    @property
    def reproduced(self) -> bool | None:
        return None if self.ran is None else self.token == self.ran

    def format(self) -> str:
        (i1, l1), (i2, l2) = self.top2
        tail = ""
        if self.ran is not None:
            tail = f"; run sampled {self.ran} ({'reproduced' if self.reproduced else 'NOT reproduced'})"
            if self.recorded_margin is not None:
                tail += f", recorded margin {self.recorded_margin:.6g}"
        return (f"{self.label}: {self.path}: top-2 [{i1}: {l1:.7g}, {i2}: {l2:.7g}] -> {self.token}"
                f" (margin {self.margin:.3g}){tail}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label, "path": self.path, "token": self.token,
            "top2": [list(t) for t in self.top2], "margin": self.margin, "ran": self.ran,
            "reproduced": self.reproduced, "recorded_margin": self.recorded_margin,
            "notes": list(self.notes), "calibration": self.calibration,
        }


def _greedy() -> StepSampler:
    return StepSampler.from_params(SamplerParams())


PipelineFactory = Callable[[Trace], SamplingPipeline]
"""``factory(trace) -> a fresh SamplingPipeline`` of that run, at the request's start."""


def header_pipeline(trace: Trace, grammar: Any = None) -> SamplingPipeline:
    """The run's sampling pipeline as its header records it (``engine.params.params_from_header``):
    processors, min_tokens, the draw's RNG mode; ``grammar``: its compiled grammar (needs the
    tokenizer; :class:`NumericsWitness` resolves it)."""
    params = params_from_header(trace.header, grammar)
    return SamplingPipeline(params, [int(t) for t in trace.header["prompt"]["token_ids"]], seed_stream=False)


def _has_grammar(trace: Trace) -> bool:
    return isinstance((trace.header.get("params") or {}).get("grammar"), dict)


def _has_processors(trace: Trace) -> bool:
    lp = (trace.header.get("params") or {}).get("logits_processors")
    return isinstance(lp, dict) and processors_from_block(lp).active


def _kv(trace: Trace) -> KVQuantization | None:
    p = trace.header.get("params") or {}
    if p.get("kv_bits") is None:
        return None
    start = p.get("quantized_kv_start")
    return KVQuantization(int(p["kv_bits"]), int(p.get("kv_group_size") or 64), int(5000 if start is None else start))


def _ids(tokens: list[int]) -> mx.array:
    return mx.array(tokens, mx.uint32)


def top2_allowed(row: mx.array) -> tuple[tuple[int, float], tuple[int, float]]:
    """Top-1 and top-2 of a row among the candidates its pipeline allowed (finite entries;
    a lone allowed candidate's runner-up is ``(-1, -inf)``)."""
    first, second = allowed_top2(row)
    return first, second if second is not None else (-1, float("-inf"))


def _tokens(ids: list[int]) -> mx.array:
    return mx.array(ids, mx.uint32)[None]


def _new_caches(model: Any) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def _prefill(model: Any, trace: Trace, caches: list[Any]) -> mx.array | None:
    params = trace.header.get("params") or {}
    prompt = list(trace.header["prompt"]["token_ids"])
    if trace.prefill is not None:
        drained = list(trace.prefill["target_tokens"])
    else:
        drained = prompt[:-1] if params.get("prefill", "tail-split") == "tail-split" else prompt
    default = SPEC_PREFILL_STEP if trace.header.get("mode") == "spec" else PLAIN_PREFILL_STEP
    return prefill_chunks(model, caches, drained, int(params.get("prefill_step_size") or default), _kv(trace))


class _NoExactRollback(Exception):
    """A cache this module cannot roll back exactly (the round is re-fed instead)."""


def _subclass(obj: Any, name: str, attrs: dict[str, Any], swapped: list[tuple[Any, type]]) -> None:
    swapped.append((obj, type(obj)))
    obj.__class__ = type(f"{name}{type(obj).__name__}", (type(obj),), attrs)


class _ExactRound:
    """One verify forward's writes into every cache, kept to ``window[:keep]`` afterwards (§2).

    Written here, independent of ``engine.rollback`` (the code under test):
    a KV cache that can trim exactly is trimmed (mlx-lm ``trim``); a rotating
    cache whose window would wrap is restored from a copy taken before the
    window and given the verify's own K/V cut to the kept positions through
    mlx-lm's ``update_and_fetch`` (the incoming cache fed only the kept
    positions, same call structure); a recurrent ``ArraysCache`` is restored
    and its mixer re-run on the kept positions with the verify's own
    ``in_proj_*`` outputs served (the spec-round trio's replay). So the kept
    state holds the bytes the verify computed, as the engine's rollback does.
    """

    def __init__(self, model: Any, caches: list[Any], d: int) -> None:
        self.caches = caches
        self.window = d + 1
        self.swapped: list[tuple[Any, type]] = []
        self.before: dict[int, Any] = {}
        self.kv_calls: dict[int, list[tuple[mx.array, mx.array]]] = {}
        self.recurrent: dict[int, dict[str, Any]] = {}
        layers = getattr(model, "layers", [])
        for i, c in enumerate(caches):
            if is_kv(c):
                if c.is_trimmable() and not (is_rotating(c) and int(c.offset) + d + 1 >= int(c.max_size)):
                    continue
                if not is_rotating(c):
                    raise _NoExactRollback(f"layer {i} ({type(c).__name__}) cannot trim")
                self.before[i] = clone_caches([c])[0]
                calls: list[tuple[mx.array, mx.array]] = []
                self.kv_calls[i] = calls
                base: Any = type(c)

                def update(self_: Any, k: mx.array, v: mx.array, _b: Any = base,
                           _calls: list[tuple[mx.array, mx.array]] = calls) -> Any:
                    _calls.append((k, v))
                    return _b.update_and_fetch(self_, k, v)

                _subclass(c, "Recording", {"update_and_fetch": update}, self.swapped)
            elif is_arrays(c) and i < len(layers):
                self._arm_recurrent(i, c, layers[i])
            else:
                raise _NoExactRollback(f"layer {i} ({type(c).__name__})")

    def _arm_recurrent(self, i: int, c: Any, layer: Any) -> None:
        mixer = next((getattr(layer, a) for a in RECURRENT_MIXERS if hasattr(layer, a)), None)
        projections = {} if mixer is None else {
            name: mod for name, mod in mixer.children().items()
            if name.startswith("in_proj") and hasattr(mod, "weight")}
        if not projections:
            raise _NoExactRollback(f"layer {i} ({type(c).__name__}): no recurrent mixer to replay")
        rec: dict[str, Any] = {"cache": c, "mixer": mixer, "projections": projections, "outputs": {},
                               "snapshot": (list(c.cache), c.lengths, c.left_padding)}
        self.recurrent[i] = rec
        mixer_base = type(mixer)

        def call(self_: Any, inputs: Any, mask: Any = None, cache: Any = None) -> Any:
            rec["inputs"], rec["mask"] = inputs, mask
            return mixer_base.__call__(self_, inputs, mask, cache)

        _subclass(mixer, "Recording", {"__call__": call}, self.swapped)
        for name, mod in projections.items():
            proj_base = type(mod)

            def proj(self_: Any, x: Any, _b: type = proj_base, _n: str = name) -> Any:
                out = _b.__call__(self_, x)
                rec["outputs"][_n] = out
                return out

            _subclass(mod, "Recording", {"__call__": proj}, self.swapped)

    def end(self) -> None:
        for obj, cls in reversed(self.swapped):
            obj.__class__ = cls
        self.swapped = []

    def keep(self, keep: int) -> None:
        drop = self.window - keep
        if drop <= 0:
            return
        for i, c in enumerate(self.caches):
            if i in self.kv_calls:
                calls = self.kv_calls[i]
                if len(calls) != 1:
                    raise RuntimeError(f"witness replay: layer {i} saw {len(calls)} cache updates in one window")
                k, v = calls[0]
                fresh = self.before[i]
                fresh.update_and_fetch(k[..., :keep, :], v[..., :keep, :])
                self.caches[i] = fresh
            elif i in self.recurrent:
                self._replay_recurrent(self.recurrent[i], keep)
            elif (got := c.trim(drop)) != drop:
                raise RuntimeError(f"witness replay: layer {i} trimmed {got} of {drop} positions")

    def _replay_recurrent(self, rec: dict[str, Any], keep: int) -> None:
        c = rec["cache"]
        c.cache, c.lengths, c.left_padding = list(rec["snapshot"][0]), rec["snapshot"][1], rec["snapshot"][2]
        swapped: list[tuple[Any, type]] = []
        try:
            for name, mod in rec["projections"].items():
                value = rec["outputs"][name][:, :keep]
                _subclass(mod, "Serving", {"__call__": lambda self_, x, _v=value: _v}, swapped)
            mask = rec["mask"][..., :keep] if rec.get("mask") is not None else None
            rec["mixer"](rec["inputs"][:, :keep], mask, c)
        finally:
            for obj, cls in reversed(swapped):
                obj.__class__ = cls


def _replay_round(model: Any, caches: list[Any], rec: dict[str, Any], notes: list[str]) -> mx.array | None:
    """One earlier round: the verify forward, then the contract's rollback to ``window[:k + 1]``.

    The witness rolls back on its own (:class:`_ExactRound`), never through
    the engine's rollback code under test (a planted trim bug must not be
    replayed as if it were the contract). A cache it cannot roll back exactly
    gets the kept positions re-fed as one forward from a pre-window copy.
    """
    window, d, k = list(rec["window"]), len(rec["drafts"]), int(rec["k_accept"])
    if k == d:
        block = model(_tokens(window), cache=caches)[0, -len(window):, :]
        mx.eval(block)
        return block
    try:
        exact = _ExactRound(model, caches, d)
    except _NoExactRollback as why:
        restored = clone_caches(caches)
        mx.eval(model(_tokens(window[: k + 1]), cache=restored))
        caches[:] = restored
        notes.append(f"round {rec['index']}: kept positions re-fed as one forward ({why})")
        return None
    try:
        block = model(_tokens(window), cache=caches)[0, -len(window):, :]
        mx.eval(block)
    finally:
        exact.end()
    exact.keep(k + 1)
    mx.eval([c.state for c in caches])
    return block


def _margins(rows: mx.array) -> list[float]:
    top = mx.topk(rows.astype(mx.float32), 2, axis=-1)
    return [float(m) for m in cast(list, mx.abs(top[:, 0] - top[:, 1]).tolist())]


def _calibration(rec: dict[str, Any], rows: mx.array | None, skip: int | None) -> float | None:
    """Largest |replayed - recorded| margin of a record's rows (relative to its top logit), row ``skip`` left out."""
    if rows is None:
        return None
    recorded = rec.get("margins") if rec["type"] == "round" else [rec.get("margin")]
    replayed = _margins(rows)
    top = float(cast(float, mx.max(mx.abs(rows.astype(mx.float32))).item()))
    pairs = [(r, x) for i, (r, x) in enumerate(zip(recorded or [], replayed, strict=False))
             if i != skip and isinstance(r, int | float)]
    if not pairs:
        return None
    return max(abs(float(r) - x) for r, x in pairs) / max(1.0, top)


def evaluate_path(model: Any, trace: Trace, site: TokenSite, label: str,
                  pipeline: PipelineFactory = header_pipeline,
                  start_caches: list[Any] | None = None) -> PathEval:
    """Replay ``trace``'s own schedule up to ``site`` and evaluate the contested row (module doc).

    The contested row goes through the run's own sampling pipeline (``pipeline(trace)``,
    advanced on every token the run emitted before it): processors, min_tokens, the grammar
    mask at that position, the draw. The path's top-2 are among the candidates it allowed.
    The first record (before any rollback) also calibrates the replay: its replayed margins
    must equal the recorded ones (``PathEval.calibration``), else the run's arithmetic is
    not this process's (another device, mlx, kernels, or an emulation that is not active here).

    ``start_caches``: the caches the run started from (a warm prompt-cache request's reused
    prefix; cloned, never mutated) instead of fresh ones; the recorded prefill then extends them.
    """
    pipe = pipeline(trace)
    kv = _kv(trace)
    caches = clone_caches(start_caches) if start_caches is not None else _new_caches(model)
    last = _prefill(model, trace, caches)
    notes: list[str] = []
    events = trace.events
    calibration: float | None = None
    for i, rec in enumerate(events[: site.event]):
        pipe.advance([int(t) for t in rec.get("emitted") or []])
        if rec["type"] == "round":
            block = _replay_round(model, caches, rec, notes)
            quantize_kv(caches, kv)  # on the committed offset, as the executor converts
            if i == 0:
                calibration = _calibration(rec, block, None)
        elif rec.get("reason") != "initial":
            row1 = model(_tokens(list(rec["input"])), cache=caches)[:, -1, :]
            quantize_kv(caches, kv)
            mx.eval(row1)
            if i == 0:
                calibration = _calibration(rec, row1, None)
        elif i == 0 and last is not None:
            calibration = _calibration(rec, last[:, -1, :], None)
    rec = events[site.event]
    stages = _stages(pipe)
    if rec["type"] == "round":
        window = list(rec["window"])
        block = model(_tokens(window), cache=caches)[0, -len(window):, :]
        assert site.position is not None
        token, view = pipe.token_at(block, window, site.position)
        shape = "one row at a time in the constrained walk" if pipe.row_wise else "batched"
        path = f"verify window of {len(window)} tokens ({shape}), row {site.position}{stages}"
        if site.event == 0:
            calibration = _calibration(rec, block, site.position)
    else:
        if rec.get("reason") == "initial":
            assert last is not None, "an initial plain record without prefill logits"
            row2 = last[:, -1, :]
            path = "last row of the prefill forward"
        else:
            row2 = model(_tokens(list(rec["input"])), cache=caches)[:, -1, :]
            path = "one-token decode step"
        view = pipe.view(row2)
        token = token_ids(pipe.draw(view - mx.logsumexp(view, keepdims=True), pipe.generated))[0]
        path += stages
    row = view[0].astype(mx.float32)
    mx.eval(row)
    out = PathEval(f"{label} {site.record}" + (f" pos {site.position}" if site.position is not None else ""),
                   path, token, top2_allowed(row), row, site.token, site.margin, notes)
    out.calibration = calibration
    return out


def _stages(pipe: SamplingPipeline) -> str:
    """The pipeline stages a path's row went through (its description's tail)."""
    parts = []
    if pipe.sampler.has_processors:
        parts.append("logits processors")
    if pipe.min_tokens:
        parts.append(f"min_tokens {pipe.min_tokens}")
    if pipe.matcher is not None:
        parts.append("the grammar mask of its position")
    if pipe.positional:
        parts.append(f"the draw keyed by (seed {pipe.seed}, position)")
    return "" if not parts else ", " + ", ".join(parts) + " applied"


def _draft_steps(model: Any, caches: list[Any], feed: list[int], drafts: list[int], n: int,
                 sampler: StepSampler, kv: KVQuantization | None = None) -> tuple[list[int], mx.array]:
    """The two-model drafter's ``n`` steps (``engine.sources.two_model`` / mlx-lm
    ``_draft_generate``): the feed as one forward, then each sampled draft fed back;
    ``drafts`` are the recorded ones fed back (the run's own path). ``kv``: the run's
    quantized KV, converted after every drafter forward as the drafter converts it
    (mlx-lm ``maybe_quantize_kv_cache``). Returns the picks and the last step's row."""
    y, picks, row = list(feed), [], None
    for j in range(n):
        row = model(_tokens(y), cache=caches)[:, -1, :]
        quantize_kv(caches, kv, "two-model drafter")
        picks.append(token_ids(sampler.sample_window(row))[0])
        y = [drafts[j]] if j < len(drafts) else [picks[-1]]
    assert row is not None
    mx.eval(row)
    return picks, row[0]


def evaluate_draft_path(model: Any, trace: Trace, site: TokenSite, label: str,
                        start_caches: list[Any] | None = None) -> PathEval:
    """Replay ``trace``'s two-model drafter up to draft ``site.position`` of round ``site.event``.

    Prefill ``prefill.drafter_tokens``; per earlier round: the feed, the drafts
    fed back one at a time (the last draft is never fed), then the drafter's
    rollback ``trim(max(d - k - 1, 0))`` (mlx-lm ``_rewind_cache``), done here
    with mlx-lm's cache API; where no exact trim exists the round is re-run
    from a copy taken before it, feeding only the kept inputs the same way.
    ``start_caches``: as for :func:`evaluate_path` (the drafter's reused prefix).
    """
    sampler = _greedy()
    caches = clone_caches(start_caches) if start_caches is not None else _new_caches(model)
    params = trace.header.get("params") or {}
    kv = _kv(trace)  # the drafter converts its caches as the target's (engine.sources.two_model)
    assert trace.prefill is not None and trace.prefill.get("drafter_tokens") is not None
    prefill_chunks(model, caches, list(trace.prefill["drafter_tokens"]),
                    int(params.get("prefill_step_size") or SPEC_PREFILL_STEP), kv)
    notes: list[str] = []
    for rec in trace.events[: site.event]:
        if rec["type"] != "round":
            raise WitnessDeclined("the drafter's path after a plain step is not replayed")
        feed, drafts, k = list(rec["feed"]), list(rec["drafts"]), int(rec["k_accept"])
        d = len(drafts)
        if d == 0:
            continue
        drop = max(d - k - 1, 0)
        before = clone_caches(caches) if drop else None
        _draft_steps(model, caches, feed, drafts, d, sampler, kv)
        mx.eval([c.state for c in caches])
        if not drop:
            continue
        if all(is_kv(c) and c.is_trimmable() for c in caches):
            for i, c in enumerate(caches):
                if (got := c.trim(drop)) != drop:
                    raise RuntimeError(f"witness replay: drafter layer {i} trimmed {got} of {drop}")
            continue
        assert before is not None
        caches[:] = before
        _draft_steps(model, caches, feed, drafts, k + 1, sampler, kv)  # inputs feed + drafts[:k]
        mx.eval([c.state for c in caches])
        notes.append(f"round {rec['index']}: drafter re-run on its kept inputs (no exact trim there)")
    rec = trace.events[site.event]
    assert site.position is not None
    picks, row = _draft_steps(model, caches, list(rec["feed"]), list(rec["drafts"]), site.position + 1,
                              sampler, kv)
    row = row.astype(mx.float32)
    mx.eval(row)
    return PathEval(f"{label} {site.record} draft {site.position}",
                    f"two-model drafter, step {site.position} after the feed", picks[-1], top2_allowed(row), row,
                    site.token, None, notes)


def prefix_of(trace: Trace, site: TokenSite) -> list[int]:
    """The output tokens before the contested one, as ``trace`` produced them."""
    out: list[int] = []
    for rec in trace.events[: site.event]:
        out += list(rec.get("emitted") or [])
    rec = trace.events[site.event]
    if rec["type"] == "round" and site.position:
        out += list(rec["window"][1 : site.position + 1])
    return out


def serial_path(model: Any, prompt: list[int], prefix: list[int], label: str = "serial",
                like: Trace | None = None, pipeline: PipelineFactory = header_pipeline) -> PathEval:
    """Plain decode's path on ``prompt + prefix``: tail-split prefill, then one token per forward,
    the row through the sampling pipeline of run ``like`` (when given) advanced over ``prefix``."""
    caches = _new_caches(model)
    kv = None if like is None else _kv(like)
    prefill_chunks(model, caches, prompt[:-1], PLAIN_PREFILL_STEP, kv)
    row = None
    for tok in [prompt[-1], *prefix]:
        row = model(_tokens([tok]), cache=caches)[:, -1, :]
        quantize_kv(caches, kv)
        mx.eval(row)
    assert row is not None
    if like is None:
        view, token = row, token_ids(_greedy().sample_plain(row))[0]
        stages = ""
    else:
        pipe = pipeline(like)
        pipe.advance(prefix)
        view = pipe.view(row)
        token = token_ids(pipe.draw(view - mx.logsumexp(view, keepdims=True), pipe.generated))[0]
        stages = _stages(pipe)
    r = view[0].astype(mx.float32)
    mx.eval(r)
    return PathEval(label, f"plain one-token decode of the {len(prefix)}-token prefix{stages}", token,
                    top2_allowed(r), r)


def pair_delta(p: PathEval, x: int, y: int) -> float:
    return float(cast(float, p.row[x].item())) - float(cast(float, p.row[y].item()))


def max_row_delta(a: mx.array, b: mx.array) -> float:
    """Largest |a - b| over the entries both rows allowed (a masked entry is -inf in both)."""
    both = mx.isfinite(a) & mx.isfinite(b)
    return float(cast(float, mx.max(mx.where(both, mx.abs(a - b), mx.array(0.0))).item()))


def witness_draft_flip(drafter: Any, a: Trace, b: Trace, flip: Flip) -> WitnessVerdict:
    """Replay both runs' two-model drafter paths and judge a differing draft.

    ``numerics`` only when each run's drafter path reproduces its own draft;
    with the same feeds and earlier rounds the paths are the same arithmetic,
    so a run whose draft its path does not give is named (``logic``).
    """
    pa = evaluate_draft_path(drafter, a, flip.a, "a")
    pb = evaluate_draft_path(drafter, b, flip.b, "b")
    xa, xb = flip.a.token, flip.b.token
    max_row = max_row_delta(pa.row, pb.row)
    da, db = (pair_delta(p, xa, xb) for p in (pa, pb))
    evidence = [pa.format(), pb.format(),
                f"Δ = logit[{xa}] - logit[{xb}]: a {da:+.4g}, b {db:+.4g}; max |row a - row b| {max_row:.3g}",
                *pa.notes, *pb.notes]
    if pa.reproduced and pb.reproduced:
        klass, reason = "numerics", f"each run's drafter path gives its own draft ({xa} vs {xb}): arithmetic alone"
    else:
        klass = "logic"
        reason = "; ".join(f"{p.label} drafted {p.ran} but its drafter path gives {p.token}"
                           for p in (pa, pb) if not p.reproduced) + ": the arithmetic does not explain it"
    data = {"lane": "drafter", "paths": [pa.to_dict(), pb.to_dict()],
            "delta": {"tokens": [xa, xb], "a": da, "b": db}, "max_abs_row_delta": max_row,
            "device": str(mx.default_device())}
    return WitnessVerdict(klass, reason, tuple(evidence), data)


def witness_flip(model: Any, a: Trace, b: Trace, flip: Flip,
                 pipeline: PipelineFactory = header_pipeline) -> WitnessVerdict:
    """Replay both runs' paths on the same prefix and judge the flip (module doc); each row goes
    through its run's sampling pipeline (``pipeline(trace)``)."""
    pa = evaluate_path(model, a, flip.a, "a", pipeline)
    pb = evaluate_path(model, b, flip.b, "b", pipeline)
    for p, t in ((pa, a), (pb, b)):
        if p.calibration is not None and p.calibration > calibration_tol():
            raise WitnessDeclined(
                f"run {p.label.split()[0]}'s first record does not replay here (margins differ by "
                f"{p.calibration:.3g} of the top logit): it ran on other arithmetic ({_platform(t)}, "
                f"or a non-bit-exact emulation not active here)")
    prefix = prefix_of(a, flip.a)
    if prefix != prefix_of(b, flip.b):
        return WitnessVerdict("logic", "the two runs' prefixes differ before the contested token",
                              (pa.format(), pb.format()), {"paths": [pa.to_dict(), pb.to_dict()]})
    ref = serial_path(model, list(a.header["prompt"]["token_ids"]), prefix, like=a, pipeline=pipeline)
    xa, xb = flip.a.token, flip.b.token
    max_row = max_row_delta(pa.row, pb.row)
    da, db, ds = (pair_delta(p, xa, xb) for p in (pa, pb, ref))
    evidence = [
        pa.format(),
        pb.format(),
        f"{ref.label} (reference): {ref.format().split(': ', 1)[1]}",
        f"Δ = logit[{xa}] - logit[{xb}]: a {da:+.4g}, b {db:+.4g}, serial {ds:+.4g}; "
        f"max |row a - row b| {max_row:.3g}",
        *pa.notes, *pb.notes,
    ]
    if pa.reproduced and pb.reproduced:
        klass = "numerics"
        reason = (f"on the same {len(prefix)}-token prefix, a's path gives {xa} and b's gives {xb}: "
                  f"arithmetic alone (rows differ by up to {max_row:.3g})")
    else:
        klass = "logic"
        bad = [f"{p.label} sampled {p.ran} but its path gives {p.token}"
               for p in (pa, pb) if not p.reproduced]
        reason = "; ".join(bad) + ": the arithmetic does not explain the flip"
    data = {
        "paths": [pa.to_dict(), pb.to_dict(), ref.to_dict()],
        "delta": {"tokens": [xa, xb], "a": da, "b": db, "serial": ds},
        "max_abs_row_delta": max_row,
        "prefix_len": len(prefix),
        "device": str(mx.default_device()),
    }
    return WitnessVerdict(klass, reason, tuple(evidence), data)


def _platform(trace: Trace) -> str:
    p = trace.header.get("platform") or {}
    return " ".join(str(p[k]) for k in ("device", "backend", "mlx") if p.get(k))


def _platform_mismatch(trace: Trace) -> str | None:
    here = platform_info()
    p = trace.header.get("platform") or {}
    for key in ("mlx", "device", "backend"):
        if p.get(key) != here.get(key):
            return f"{trace.label()} ran on {_platform(trace) or 'an unknown platform'}, " \
                   f"this process on {' '.join(str(here[k]) for k in ('device', 'backend', 'mlx') if here.get(k))}"
    return None


def _greedy_trace(trace: Trace) -> bool:
    return not (trace.header.get("params") or {}).get("temperature")


def _replayable(trace: Trace) -> bool:
    """Greedy, or sampled with a key per (seed, output position) (``rng: position``): a draw
    that is a function of the row and the position alone. A run drawing from one RNG stream
    in order (mlx-lm's) is not replayed at a single position."""
    params = trace.header.get("params") or {}
    if not params.get("temperature"):
        return True
    return params.get("rng") == "position" and params.get("seed") is not None


class NumericsWitness:
    """A ``traces.diff.Witness``: finds the models of the traces and judges flips.

    ``resolve(header)`` returns the target model for a trace header, or
    ``None`` when it is not at hand; ``resolve_drafter(header)`` the same for
    a two-model drafter (draft flips); ``resolve_tokenizer(header)`` the target's
    tokenizer (a run under a grammar: its mask is compiled against it). The
    witness judges greedy runs and runs sampled with position keys, of one
    target and prompt (equal ``weights_sha256`` where both headers have one),
    recorded on this platform.
    """

    def __init__(self, resolve: ModelResolver, resolve_drafter: ModelResolver | None = None,
                 resolve_tokenizer: ModelResolver | None = None) -> None:
        self.resolve = resolve
        self.resolve_drafter = resolve_drafter
        self.resolve_tokenizer = resolve_tokenizer
        self.judged = 0
        self._grammars: dict[tuple[str, str, int], Any] = {}

    def pipeline_factory(self, model: Any) -> PipelineFactory:
        """The runs' pipelines: built from their headers, a grammar compiled against the
        target's tokenizer (``resolve_tokenizer``); a run under a grammar whose tokenizer is
        not at hand is declined, never replayed without its mask."""
        from engine.grammar import grammar_from_header, model_vocab_size

        def make(trace: Trace) -> SamplingPipeline:
            if not _has_grammar(trace):
                return header_pipeline(trace)
            block = trace.header["params"]["grammar"]
            tok = self.resolve_tokenizer(trace.header) if self.resolve_tokenizer is not None else None
            if tok is None:
                raise WitnessDeclined(f"{trace.label()} ran under a grammar and its tokenizer is not at "
                                      "hand: its mask cannot be replayed")
            eos = tuple(int(t) for t in trace.header.get("eos_ids") or ())
            key = (str(block.get("sha256")), str(block.get("reasoning_end") or ""), hash(eos))
            if key not in self._grammars:
                self._grammars[key] = grammar_from_header(block, tok, model_vocab_size(model), eos)
            return header_pipeline(trace, self._grammars[key])

        return make

    @classmethod
    def for_model(cls, model: Any, drafter: Any = None) -> NumericsWitness:
        return cls(lambda header: model, (lambda header: drafter) if drafter is not None else None)

    def _model(self, resolve: ModelResolver | None, role: str, a: Trace, b: Trace) -> Any:
        sha = [(t.header.get(role) or {}).get("weights_sha256") for t in (a, b)]
        if sha[0] and sha[1] and sha[0] != sha[1]:
            raise WitnessDeclined(f"the two runs used different {role} models")
        if resolve is None:
            return None
        model = resolve(a.header)
        return model if model is not None else resolve(b.header)

    def __call__(self, a: Trace, b: Trace, flip: Flip) -> WitnessVerdict | None:
        if not (_replayable(a) and _replayable(b)):
            return None
        for t in (a, b):
            if (why := _platform_mismatch(t)) is not None:
                raise WitnessDeclined(f"{why}: its arithmetic cannot be replayed here")
        if list(a.header["prompt"]["token_ids"]) != list(b.header["prompt"]["token_ids"]):
            raise WitnessDeclined("the two runs have different prompts")
        if flip.lane == "drafter":
            if any(t.header.get("source") not in (None, "two-model") for t in (a, b)):
                raise WitnessDeclined("only a two-model drafter's path is replayed")
            if any(_has_processors(t) or _has_grammar(t) or not _greedy_trace(t) for t in (a, b)):
                return None  # the draft lane's processor history and draws are not replayed
            drafter = self._model(self.resolve_drafter, "drafter", a, b)
            if drafter is None:
                return None
            self.judged += 1
            return witness_draft_flip(drafter, a, b, flip)
        model = self._model(self.resolve, "target", a, b)
        if model is None:
            return None
        self.judged += 1
        return witness_flip(model, a, b, flip, self.pipeline_factory(model))


def path_witness(load: Callable[[str], Any], load_tokenizer: Callable[[str], Any] | None = None) -> NumericsWitness:
    """A witness whose models are ``load(header.target.path)`` / ``load(header.drafter.path)``
    when that path is a local directory (and the target's tokenizer ``load_tokenizer(path)``).

    ``load`` should return the very model object the runs used (e.g. a cached
    loader), so a wrapped model (``engine.nonexact``) is witnessed as it ran.
    """
    from pathlib import Path

    def resolver(role: str, fn: Callable[[str], Any]) -> ModelResolver:
        def resolve(header: dict[str, Any]) -> Any:
            path = (header.get(role) or {}).get("path")
            return fn(str(path)) if path and Path(path).is_dir() else None

        return resolve

    return NumericsWitness(resolver("target", load), resolver("drafter", load),
                           resolver("target", load_tokenizer) if load_tokenizer is not None else None)


# ---------------------------------------------------------------------- which verify path ran


@dataclass
class VerifyPath:
    """Which arithmetic produced a speculative trace's verify rows (:func:`verify_path`).

    ``verdict``: ``batched`` (the recorded margins are the batched verify window's, as the
    reference's ``speculative_generate_step`` computes them), ``serial`` (they are one-token
    decode's: the window verified position by position, a deviation from the reference's verify
    path), ``indistinguishable`` (the two paths give the same bits here: a bit-exact backend),
    ``neither`` (the rows match no path replayed here: another device, or an engine bug) or
    ``no-window`` (no round verified a draft). ``rounds``: per round checked, the largest
    |recorded - replayed| margin (relative to the top logit) of each path.
    """

    verdict: str
    rounds: list[dict[str, Any]]

    @property
    def deviation(self) -> str | None:
        if self.verdict != "serial":
            return None
        r = next(x for x in self.rounds if x["path"] == "serial")
        return (f"round {r['round']}: the recorded verify margins match one-token decode "
                f"(|Δ| {r['serial']:.3g}), not the batched verify window (|Δ| {r['batched']:.3g}) the "
                "trace claims: the window was verified position by position (a deviation from the "
                "reference's verify path, invisible on a bit-exact backend)")


def verify_path(model: Any, trace: Trace, max_rounds: int = 3, tol: float | None = None) -> VerifyPath:
    """Replay ``trace``'s prefill and its first rounds that verified a draft, computing each
    window both ways on the same prefix — ONE batched forward over the window, and one
    one-token forward per window position — and say which the recorded margins match.

    Only rounds before the first rollback that dropped positions are judged (until then the
    cache holds the same bytes whichever path the run used); at most ``max_rounds`` of them.
    """
    tol = calibration_tol() if tol is None else tol
    caches = _new_caches(model)
    kv = _kv(trace)
    _prefill(model, trace, caches)
    rounds: list[dict[str, Any]] = []
    for rec in trace.events:
        if rec["type"] != "round":
            break
        window, d, k = list(rec["window"]), len(rec["drafts"]), int(rec["k_accept"])
        if d and isinstance(rec.get("margins"), list) and len(rounds) < max_rounds:
            before = clone_caches(caches)
            block = model(_tokens(window), cache=before)[0, -len(window):, :]
            serial_caches = clone_caches(caches)
            rows = [model(_tokens([t]), cache=serial_caches)[0, -1:, :] for t in window]
            serial = mx.concatenate(rows, axis=0)
            mx.eval(block, serial)
            top = float(cast(float, mx.max(mx.abs(block.astype(mx.float32))).item()))
            rec_m = [float(m) for m in rec["margins"]]
            db = max(abs(a - b) for a, b in zip(rec_m, _margins(block), strict=False)) / max(1.0, top)
            ds = max(abs(a - b) for a, b in zip(rec_m, _margins(serial), strict=False)) / max(1.0, top)
            apart = max(abs(a - b) for a, b in zip(_margins(block), _margins(serial), strict=False)) / max(1.0, top)
            path = ("indistinguishable" if apart <= tol else "batched" if db <= tol < ds
                    else "serial" if ds <= tol < db else "neither")
            rounds.append({"round": rec["index"], "batched": db, "serial": ds, "apart": apart, "path": path})
        if k < d or len(rounds) >= max_rounds:
            break
        mx.eval(model(_tokens(window), cache=caches))  # an all-accept round keeps every position
        quantize_kv(caches, kv)
    paths = {r["path"] for r in rounds}
    if not rounds:
        verdict = "no-window"
    elif "serial" in paths and "batched" not in paths:
        verdict = "serial"
    elif "batched" in paths and "serial" not in paths:
        verdict = "batched"
    elif paths == {"indistinguishable"}:
        verdict = "indistinguishable"
    else:
        verdict = "neither"
    return VerifyPath(verdict, rounds)
