"""Batched speculation: ONE target forward over every row's verify window, per-row accept and rollback.

The seed (``../shared/reference/speculative-decoding.md`` §1 "Per-slot readiness") calls
per-slot speculation "the hard part — variable accept length per slot breaks a uniform-B
step"; mlx-lm 0.32.2 has none (``BatchGenerator``: ``is_batchable = draft_model is None``).
This module is that executor, behind the same seam: one ``DraftSource`` per row (opened from
the row's ``DraftProvider`` with the row's sampler, as ``engine.executor.spec_generate``
opens it), one ``SamplingPipeline`` and one ``TokenStream`` per row (``executor.Request``),
so the per-row sampler, processors history, min_tokens, grammar matcher and accounting are
the serial executor's own objects. Per step (§2, every row its own round):

1. each row drafts ``d_b <= n_b = min(gamma, tokens left)``: the two-model rows of one drafter
   together, ONE drafter forward per draft step for all of them (:class:`_Drafters`, below),
   every other source per row (an n-gram lookup is host work, no device call);
2. ONE target forward over the ``[B, W]`` block of every row's window ``[pending, *drafts]``,
   ``W = max_b (d_b + 1)``;
3. each row's accept walk over ITS rows of the block (``logits[b, :d_b + 1]``), through its own
   pipeline, every row's samples, drafts and margins read back in ONE sync (one host transfer
   each);
4. rollback of every row in one operation per cache layer: row ``b`` keeps ``k_b + 1`` of the
   ``W`` positions it wrote (the uniform-B step broken on purpose, see below); the drafter
   batch rolls back likewise; any other source commits ``(d_b, k_b)`` itself;
5. rows that finished release their slot (reset), rows that arrive are prefilled and join.

**Batched drafting** (:class:`_Drafters`): a two-model row whose drafter caches are all plain
``KVCache`` and whose sampler has no logits processors keeps its drafter caches in a batch of
that drafter (the same left-padded layout as the target's). The first draft step runs over the
right-padded feeds and rolls the pad off; each further step feeds every row its previous draft;
a row that drafts fewer (fewer tokens left) stops drawing and drops the extra positions at the
commit, in the one rollback that also applies mlx-lm's ``_rewind_cache`` trim. Each row draws
on its own logits row with its own sampler and generator: its serial draws. Rows that draft
per row say why (``BatchResult.drafting``; the benches print it). By default drafts are batched
only where the backend is bit-exact (``batch_generate(batch_drafts=None)``): elsewhere a batched
drafter forward's arithmetic may depend on the batch and move a row's drafts (never its
tokens) away from its serial run's records; ``batch_drafts=True`` opts in (the throughput bench).

**Layout: left-padded caches, right-padded windows.** mlx-lm's batched caches
(``models/cache.py`` ``BatchKVCache``, ``BatchRotatingKVCache``, the batched ``ArraysCache``)
keep every row right-justified at a shared write index with per-row ``left_padding`` and
``offset`` (the row's RoPE position), and mlx-lm's models build the masks from them: so the
batch is a plain mlx-lm forward with no model code of ours. A window shorter than ``W`` is
padded on the right (the pad positions lie after the row's last real position, invisible to
it under the causal mask, and are dropped by the rollback like rejected drafts). Why not
ragged (one forward per row: no batching) or packed (all windows in one sequence with a
block-diagonal mask: needs attention code over several caches, i.e. another model zoo)?
Left padding is what mlx-lm's models batch with, and on the CPU it is bit-exact: a row of
the batched forward equals the same row's B = 1 forward bit for bit (masked positions add
exact zeros to the softmax and the value sum; measured on every zoo target; the tests
check it per round through the cache digests and every row's margins).

**Per-row rollback per cache family** (:func:`_drops`, :class:`_Batch`):

- KV (``BatchKVCache``) and rotating before the wrap (``BatchRotatingKVCache``): trim the
  fewest dropped positions off the whole batch (``trim(min_b r_b)``), then roll each row
  that drops more right by the difference and grow its left padding by it (mlx-lm's own
  right-padding mechanism, ``BatchKVCache.prepare(right_padding=...)`` + ``finalize``,
  ``dynamic_roll``): the row's kept positions end at the write index again, its rejected
  tail is now padding. Rotating batches always run windows of ``W >= 2`` (the concatenating
  update, temporal order: a ring rotated by one-token in-place writes would order a row's
  keys differently from its serial run).
- Rotating past the wrap: a row whose window would reach its ring (the §2 guard,
  ``offset + n + 1 >= max_size`` on the row's own offset) leaves the batch for the serial
  lane (its caches extracted, ``BatchRotatingKVCache.extract``) and finishes with plain
  decode, as its serial run does (``rotating="guard"``). ``rotating="exact"`` rows with a
  rotating target cache run on the serial lane from the start (``RingRound`` needs the
  row's own ring).
- Recurrent (``ArraysCache``, gated DeltaNet): the spec-round trio per row. The mixer's
  inputs and ``in_proj_*`` outputs of the batched forward are recorded (as
  ``engine.rollback.CacheRollback`` records them); a row keeping fewer than ``W`` positions
  is restored to its pre-forward state and REPLAYED over its kept positions at B = 1 with
  its own recorded projections served, exactly the serial rollback's replay.
- Quantized KV (``kv_bits``): mlx-lm 0.32.2 has no batched quantized cache; such rows run
  on the serial lane (``spec_generate`` itself), reason recorded.

**Rows joining and leaving.** A joining row is prefilled alone (B = 1, the serial
executor's chunks: its prefill record is the serial one), then placed in a free slot
right-justified at the write index (:func:`_join_start`; the batch grows left when the row
is longer). A finished row's slot is released at the end of its step: reset to all padding,
recurrent state zeroed (:func:`_reset_slot`), then reused by a joining row or compacted
away (``filter``). A paused row (preemption: ``BatchRequest.pause``) is swapped out
(``extract``) and swapped back in later, its source and pipeline kept.

**RNG per row.** The draw stages use MLX's global generator (mlx-lm's samplers take no
key). Each sampled row keeps its own generator state (:class:`RowRng`): the state is
switched in around everything the row draws (drafting, window samples, the walk) and read
back after (an MLX key ``[hi, lo]`` is restored exactly by ``mx.random.seed(hi << 32 | lo)``),
so a row consumes exactly the stream its serial run consumes, with ``rng="stream"`` and
with ``rng="position"`` (whose drafter draws still read the global state). Greedy rows
draw nothing.

**Serial lane.** A row that cannot share the batch runs alone through the serial
executor, reason in the batch record: a source with tap layers or an anchor hidden (MTP,
DSpark, DeepSpec, assistant: they read the target's per-row hidden states), quantized KV,
exact rotating rollback, target caches that are not KV/rotating (keep 0)/``ArraysCache``,
or a target that cannot roll back (``spec_generate`` then decodes plainly).

Every row's result and records are those of ``spec_generate`` on the same request alone:
``tests/test_batched.py`` and ``conformance/test_batched_vs_serial.py`` compare them record for record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import mlx.core as mx

from engine.executor import (
    GenerationParams,
    GenerationResult,
    Request,
    draft_round,
    generation_stream,
    lazy_drafts,
    refeed,
    round_record,
    set_rotating,
    source_confidence,
    source_guard,
    source_state,
    spec_generate,
    tap_set,
)
from engine.hooks import NO_OBSERVER
from engine.pipeline import WalkResult
from engine.rollback import (
    RECURRENT_MIXERS,
    CacheRollback,
    recording_mixer,
    recording_projection,
    serving_projection,
)
from engine.sampler import NonFiniteLogits, margin_array
from engine.seam import DraftProvider, DraftSource, PrefillMode, TargetView
from engine.stream import SPEC_PREFILL_STEP, OnToken
from engine.telemetry import active_profile, cache_arrays

__all__ = ["NO_BATCH_OBSERVER", "PAD_ID", "BatchObserver", "BatchRequest", "BatchResult", "RowRng", "batch_generate",
           "batch_record", "drafter_reason", "serial_reason"]

PAD_ID = 0  # the token a short window is right-padded with (never sampled, always dropped)


@dataclass
class BatchRequest:
    """One row of a batched run.

    ``arrive``: the batch step at which the request arrives (joins the batch when a slot is
    free); ``pause``: ``(out, back)`` — the row is preempted (swapped out of the batch) before
    step ``out`` and resumes at step ``back`` (B-invariance: its tokens must not change).
    """

    rid: str
    prompt_ids: list[int]
    params: GenerationParams
    provider: DraftProvider
    arrive: int = 0
    pause: tuple[int, int] | None = None
    on_token: OnToken | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"row {self.rid!r}: prompt_ids must not be empty")
        if self.arrive < 0:
            raise ValueError(f"row {self.rid!r}: arrive must be >= 0, got {self.arrive}")
        if self.pause is not None and not (0 <= self.pause[0] < self.pause[1]):
            raise ValueError(f"row {self.rid!r}: pause must be (out, back) with 0 <= out < back, got {self.pause}")


@dataclass
class BatchResult:
    """``rows``: each request's result, the shape ``spec_generate`` returns; ``steps``: one
    ``batch_step`` record per batch step (:func:`batch_record`)."""

    rows: dict[str, GenerationResult]
    steps: list[dict[str, Any]]
    wall_s: float
    lanes: dict[str, str] = field(default_factory=dict)  # rid -> "batch" or "serial: <reason>"
    # rid -> "batched" (drafts in its drafter's batch) or "per row: <reason>" (batch lane rows only)
    drafting: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------- the observer


class BatchObserver(Protocol):
    """Told about every row's verify block (the M invariance's probe); must not mutate it."""

    def after_verify(self, step: int, rid: str, round_index: int, window: list[int], block: mx.array) -> None: ...

    # optional: ``after_round(step, rid, round_index, caches)``, the row's caches (B = 1, a copy) after
    # its round's rollback (the batched checks compare them with the serial run's within a bound)


class NoBatchObserver:
    """The null :class:`BatchObserver`."""

    def after_verify(self, step: int, rid: str, round_index: int, window: list[int], block: mx.array) -> None:
        return None


NO_BATCH_OBSERVER = NoBatchObserver()


# ---------------------------------------------------------------------- the per-row RNG


class RowRng:
    """One row's MLX generator state, switched in around the row's draws (module docstring)."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.key: int | None = None

    def __enter__(self) -> RowRng:
        if self.active and self.key is not None:
            mx.random.seed(self.key)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            hi, lo = (int(x) for x in cast(list, cast(Any, mx.random.state)[0].tolist()))
            self.key = (hi << 32) | lo


def _row_rng(row: _Row) -> RowRng:
    """The generator a row draws with (plant seam: a shared one is the classic bug)."""
    return row.rng


# ---------------------------------------------------------------------- plant seams (pure)


def _drops(keeps: list[int], width: int) -> list[int]:
    """Positions each row drops after a ``width``-wide forward, keeping ``keeps[b]``."""
    return [width - k for k in keeps]


def _drafter_keeps(d: int, k: int) -> int:
    """Of the ``d - 1`` positions a row's further draft steps wrote, those its drafter keeps
    after accepting ``k`` (mlx-lm ``_rewind_cache``: trim ``max(d - k - 1, 0)``)."""
    return min(k, d - 1)


def _join_start(idx: int, length: int) -> int:
    """Where a joining row's ``length`` positions start in a batch written up to ``idx``
    (right-justified: its last position is the batch's last)."""
    return idx - length


# ---------------------------------------------------------------------- the row


class _Row:
    """One request in the batch: the serial executor's per-request state plus its round state."""

    def __init__(self, spec: BatchRequest, model: Any) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.spec = spec
        self.rid = spec.rid
        self.rng = RowRng(active=spec.params.sampler.temperature != 0.0)
        with _row_rng(self):
            self.req = Request(model, make_prompt_cache(model), spec.prompt_ids, spec.params, spec.on_token)
        self.source: DraftSource | None = None
        self.pending: list[int] = []
        self.feed: list[int] = []
        self.round_index = 0
        self.result: GenerationResult | None = None
        self.lane = "batch"
        self.swapped: list[Any] | None = None  # caches while paused

    @property
    def done(self) -> bool:
        return self.result is not None

    def finish(self) -> None:
        self.result = self.req.result(speculative=True)


def serial_reason(model: Any, caches: list[Any], source: DraftSource | None, params: GenerationParams) -> str | None:
    """Why a row cannot share the batch (None: it can). See the module docstring."""
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    if params.kv is not None:
        return f"quantized KV (kv_bits {params.kv_bits}): mlx-lm has no batched quantized cache"
    if source is not None and (tuple(source.tap_layers) or source.wants_anchor_hidden):
        return f"the {type(source).__name__} source reads the target's hidden states (taps)"
    for i, c in enumerate(caches):
        t = type(c)
        if t is KVCache or t is ArraysCache:
            continue
        if t is RotatingKVCache:
            if int(c.keep) != 0:
                return f"layer {i} RotatingKVCache keep={int(c.keep)}"
            if params.rotating == "exact":
                return f"rotating='exact': layer {i} RotatingKVCache rolls back through its own ring (RingRound)"
            continue
        return f"layer {i} {t.__name__} has no batched form here"
    if not CacheRollback(model, caches).capable:
        return "the target caches can neither trim nor replay"
    return None


# ---------------------------------------------------------------------- the batch's caches


def _is_rot(c: Any) -> bool:
    return hasattr(c, "max_size") and hasattr(c, "_offset")


def _is_kv(c: Any) -> bool:
    return hasattr(c, "keys") and hasattr(c, "left_padding")


def _set_row(a: mx.array, slot: int, value: int) -> mx.array:
    """A copy of 1-D ``a`` with ``a[slot] = value`` (never in place: snapshots may share it)."""
    return mx.where(mx.arange(a.shape[0]) == slot, mx.array(value, a.dtype), a)


def _reset_slot(batch: _Batch, slot: int) -> None:
    """A released slot holds nothing: all padding, recurrent state zeroed."""
    for c in batch.caches:
        if _is_kv(c):
            idx = int(c._idx)
            c.left_padding = _set_row(c.left_padding, slot, idx)
            c.offset = _set_row(c.offset, slot, 0)
        else:
            c.cache = [None if a is None else
                       mx.where((mx.arange(a.shape[0]) == slot).reshape((-1,) + (1,) * (a.ndim - 1)),
                                mx.zeros_like(a), a)
                       for a in c.cache]


class _Batch:
    """The batch's target caches (mlx-lm's batched classes), one slot per row."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.caches: list[Any] = []
        self.slots: list[_Row | None] = []
        self.rotating = False
        self._recurrent: list[dict[str, Any]] = []

    @property
    def rows(self) -> list[_Row]:
        return [r for r in self.slots if r is not None]

    def slot(self, row: _Row) -> int:
        return self.slots.index(row)

    # -------------------------------------------------------------- joining and leaving
    def join(self, row: _Row, caches: list[Any]) -> int:
        """Place ``row`` (its B = 1 mlx-lm caches) in a free slot; return the slot."""
        from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, KVCache

        if not self.slots:
            out: list[Any] = []
            for c in caches:
                if isinstance(c, KVCache):
                    out.append(BatchKVCache([0]))
                elif _is_rotating_row(c):
                    out.append(BatchRotatingKVCache(int(c.max_size), [0]))
                    self.rotating = True
                else:
                    out.append(ArraysCache(len(c.cache)))
            self.caches = out
            self.slots = [None]
        if None not in self.slots:
            self._add_slot()
        slot = self.slots.index(None)
        for b, r in zip(self.caches, caches, strict=True):
            _place(b, slot, r, len(self.slots))
        self.slots[slot] = row
        return slot

    def _add_slot(self) -> None:
        for c in self.caches:
            if _is_kv(c):
                if c.keys is not None:
                    c.keys = mx.concatenate([c.keys, mx.zeros((1, *c.keys.shape[1:]), c.keys.dtype)])
                    c.values = mx.concatenate([c.values, mx.zeros((1, *c.values.shape[1:]), c.values.dtype)])
                c.left_padding = mx.concatenate([c.left_padding, mx.array([int(c._idx)])])
                c.offset = mx.concatenate([c.offset, mx.array([0])])
            else:
                c.cache = [None if a is None else mx.concatenate([a, mx.zeros((1, *a.shape[1:]), a.dtype)])
                           for a in c.cache]
        self.slots.append(None)

    def release(self, row: _Row) -> None:
        """A finished or paused row gives its slot back (reset, reusable by a joining row)."""
        slot = self.slot(row)
        _reset_slot(self, slot)
        self.slots[slot] = None

    def compact(self) -> None:
        """Drop the free slots (mlx-lm ``filter``); an empty batch forgets its caches."""
        keep = [i for i, r in enumerate(self.slots) if r is not None]
        if len(keep) == len(self.slots):
            return
        if not keep:
            self.caches, self.slots, self.rotating = [], [], False
            return
        idx = mx.array(keep)
        for c in self.caches:
            c.filter(idx)
            if _is_rot(c):
                _drop_common_padding([c])  # BatchKVCache.filter does it itself
        self.slots = [self.slots[i] for i in keep]

    def extract(self, row: _Row) -> list[Any]:
        """The row's caches as B = 1 mlx-lm caches (``extract``: live region, copied)."""
        from mlx_lm.models.cache import KVCache

        slot = self.slot(row)
        out: list[Any] = []
        for c in self.caches:
            if _is_kv(c) and (c.keys is None or int(c.offset[slot].item()) == 0):
                out.append(_empty_ring(c) if _is_rot(c) else KVCache())  # nothing held yet
                continue
            out.append(c.extract(slot))
        return out

    # -------------------------------------------------------------- the round
    def forward(self, inputs: mx.array) -> mx.array:
        """ONE target forward over ``inputs [B, W]``, the recurrent layers recorded."""
        for c in self.caches:
            if _is_rot(c) and c.keys is not None and (c.rotated or c._offset != c._idx
                                                      or c._idx >= int(c.max_size)):
                raise RuntimeError(
                    f"batched rotating cache reached its ring (write index {c._idx}, written {c._offset}, "
                    f"max_size {c.max_size}): per-row rollback is exact only before the wrap")
        layers = getattr(self.model, "layers", [])
        self._recurrent = []
        swapped: list[tuple[Any, type]] = []
        try:
            for i, c in enumerate(self.caches):
                if _is_kv(c):
                    continue
                mixer = next((getattr(layers[i], a) for a in RECURRENT_MIXERS if hasattr(layers[i], a)), None)
                if mixer is None:
                    raise RuntimeError(f"batched rollback: layer {i} {type(c).__name__} has no recurrent mixer")
                rec = _RecurrentRound(i, c, mixer)
                swapped.append((mixer, type(mixer)))
                mixer.__class__ = recording_mixer(type(mixer), rec)  # type: ignore[arg-type]
                for name, mod in rec.projections.items():
                    swapped.append((mod, type(mod)))
                    mod.__class__ = recording_projection(type(mod), rec, name)  # type: ignore[arg-type]
                self._recurrent.append({"rec": rec})
            return self.model(inputs, cache=self.caches)
        finally:
            for obj, cls in reversed(swapped):
                obj.__class__ = cls

    def rollback(self, keeps: list[int], width: int, *, drop_padding: bool = True) -> None:
        """Row ``b`` keeps ``keeps[b]`` of the ``width`` positions the forward(s) wrote, in ONE
        operation per layer for every row (a trim, then one roll of the rows that drop more).
        ``drop_padding=False`` leaves the padding every row shares for the next rollback to cut
        (no host read of the padding: the drafter's mid-round rollback)."""
        drops = _drops(keeps, width)
        live = [i for i, r in enumerate(self.slots) if r is not None]
        if len(live) != len(self.slots):
            raise RuntimeError(f"batched rollback with free slots {self.slots}")
        m = min(drops)
        for c in self.caches:
            if not _is_kv(c):
                continue
            if m:
                got = c.trim(m)
                if got != m:
                    raise RuntimeError(f"batched rollback: {type(c).__name__} trimmed {got} of {m}")
            extra = [dr - m for dr in drops]
            if any(extra):
                _roll_rows(c, extra)
        for entry in self._recurrent:
            rec: _RecurrentRound = entry["rec"]
            rec.rollback([width - dr for dr in drops], width)
        self._recurrent = []
        if drop_padding:
            _drop_common_padding([c for c in self.caches if _is_kv(c)])


def _is_rotating_row(c: Any) -> bool:
    return hasattr(c, "max_size") and hasattr(c, "_idx") and not hasattr(c, "_offset")


def _empty_ring(c: Any) -> Any:
    from mlx_lm.models.cache import RotatingKVCache

    return RotatingKVCache(int(c.max_size))


def _lp_known(c: Any) -> list[int] | None:
    """The host copy of ``c.left_padding`` while it is the array it was taken from (None: unknown).

    The per-round rollback keeps it current (:func:`_roll_rows`, :func:`_drop_common_padding`), so
    a steady batch reads no padding back; a join, release or compaction replaces the array and
    the next rollback reads every layer's padding in one transfer."""
    if _is_rot(c):
        return None  # mlx-lm's rotating update may shift the padding in place: always read
    m = getattr(c, "_lp_mirror", None)
    return m[1] if m is not None and m[0] is c.left_padding else None


def _lp_set(c: Any, values: list[int]) -> None:
    c._lp_mirror = (c.left_padding, values)


def _drop_common_padding(caches: list[Any]) -> None:
    """Cut the padding every row has (``BatchKVCache.filter``'s left shift): the write index
    stays at the longest row, so a rotating batch never reaches its ring through padding alone
    (mlx-lm's concatenating update would cut its front, after which a trim no longer matches
    its mask). The padding is known on the host (:func:`_lp_known`) or read for every layer in
    one transfer."""
    live = [c for c in caches if c.keys is not None and not (_is_rot(c) and c.rotated)]
    unknown = [c for c in live if _lp_known(c) is None]
    read = {id(c): [int(v) for v in vals] for c, vals in
            zip(unknown, cast(list, mx.stack([c.left_padding for c in unknown]).tolist()) if unknown else [],
                strict=True)}
    for c in live:
        known = _lp_known(c)
        if known is None:
            known = read[id(c)]
            _lp_set(c, known)
        m = min(known)
        if m <= 0:
            continue
        c.keys, c.values = c.keys[..., m:, :], c.values[..., m:, :]
        c._idx -= m
        if _is_rot(c):
            c._offset -= m
        c.left_padding = c.left_padding - m
        _lp_set(c, [v - m for v in known])


def _roll_rows(c: Any, extra: list[int]) -> None:
    """Roll each row right by ``extra[b]`` (mlx-lm ``dynamic_roll``): its dropped tail
    becomes left padding (``BatchKVCache.finalize``'s right-padding move). mlx-lm's batch caches
    cannot mask a gap inside a row (``make_mask`` knows the write index and the left padding
    only), so the kept positions must move. Rolling only the rows that move (gather, roll,
    scatter back) was measured no cheaper on the CPU (the scatter copies the whole array: 0.60
    vs 0.60 ms at [8, 4, 256, 16] f32, 22.3 vs 25.0 ms at [8, 8, 1024, 64] bf16, one row of 8
    moving), so the whole batch rolls at once."""
    from mlx_lm.models.cache import dynamic_roll

    known = _lp_known(c)
    e = mx.array(extra)
    c.keys = dynamic_roll(c.keys, e[:, None], axis=2)
    c.values = dynamic_roll(c.values, e[:, None], axis=2)
    c.offset = c.offset - e
    c.left_padding = c.left_padding + e
    if known is not None:
        _lp_set(c, [v + x for v, x in zip(known, extra, strict=True)])


def _place(c: Any, slot: int, r: Any, nslots: int) -> None:
    """Write a row's B = 1 cache ``r`` into free slot ``slot`` of batched cache ``c``."""
    if not _is_kv(c):
        for e, a in enumerate(r.cache):
            if a is None:
                continue
            cur = c.cache[e]
            if cur is None:
                cur = mx.zeros((nslots, *a.shape[1:]), a.dtype)
            sel = (mx.arange(nslots) == slot).reshape((-1,) + (1,) * (a.ndim - 1))
            c.cache[e] = mx.where(sel, mx.broadcast_to(a, cur.shape), cur)
        return
    length = int(r.offset)
    if _is_rot(c) and length >= int(c.max_size):
        raise RuntimeError(f"a row past its ring wrap (offset {length} >= max_size {c.max_size}) cannot join")
    if length == 0:
        return
    keys = r.keys[..., :length, :]
    values = r.values[..., :length, :]
    if c.keys is None:
        c.keys = mx.zeros((nslots, keys.shape[1], 0, keys.shape[3]), keys.dtype)
        c.values = mx.zeros((nslots, values.shape[1], 0, values.shape[3]), values.dtype)
    idx = int(c._idx)
    if length > idx:  # grow every row to the left
        g = length - idx
        pad = [(0, 0), (0, 0), (g, 0), (0, 0)]
        c.keys, c.values = mx.pad(c.keys, pad), mx.pad(c.values, pad)
        c.left_padding = c.left_padding + g
        c._idx = idx = length
        if _is_rot(c):
            c._offset += g
    if c.keys.shape[2] < idx:
        extra = [(0, 0), (0, 0), (0, idx - c.keys.shape[2]), (0, 0)]
        c.keys, c.values = mx.pad(c.keys, extra), mx.pad(c.values, extra)
    start = _join_start(idx, length)
    k = mx.array(c.keys)
    v = mx.array(c.values)
    k[slot : slot + 1, :, start : start + length, :] = keys
    v[slot : slot + 1, :, start : start + length, :] = values
    c.keys, c.values = k, v
    # the slot held nothing (reset: all padding, offset 0): it now holds ``length`` positions
    lp = int(c.left_padding[slot].item())
    off = int(c.offset[slot].item())
    c.left_padding = _set_row(c.left_padding, slot, lp - length)
    c.offset = _set_row(c.offset, slot, off + length)


class _RecurrentRound:
    """One batched ``ArraysCache`` layer across one forward: snapshot, recording, per-row replay."""

    def __init__(self, index: int, cache: Any, mixer: Any) -> None:
        self.index = index
        self.cache = cache
        self.mixer = mixer
        self.projections = {name: mod for name, mod in mixer.children().items()
                            if name.startswith("in_proj") and hasattr(mod, "weight")}
        if not self.projections:
            raise RuntimeError(f"batched rollback: layer {index} has no in_proj_* to record")
        self.snapshot = list(cache.cache)
        self.recorded: dict[str, Any] = {}
        self.inputs: Any = None
        self.mask: Any = None

    def rollback(self, keeps: list[int], width: int) -> None:
        from mlx_lm.models.cache import ArraysCache

        redo = [b for b, k in enumerate(keeps) if k < width]
        if not redo:
            return
        rows: dict[int, list[Any]] = {}
        for b in redo:
            keep = keeps[b]
            tmp = ArraysCache(len(self.snapshot))
            tmp.cache = [None if a is None else a[b : b + 1] for a in self.snapshot]
            served = {name: out[b : b + 1, :keep] for name, out in self.recorded.items()}
            swapped = []
            try:
                for name, mod in self.projections.items():
                    swapped.append((mod, type(mod)))
                    mod.__class__ = serving_projection(type(mod), served[name])
                mask = self.mask[b : b + 1, ..., :keep] if self.mask is not None else None
                self.mixer(self.inputs[b : b + 1, :keep], mask, tmp)
            finally:
                for obj, cls in reversed(swapped):
                    obj.__class__ = cls
            rows[b] = list(tmp.cache)
        new: list[Any] = []
        for e, a in enumerate(self.cache.cache):
            if a is None:
                new.append(None)
                continue
            parts = [rows[b][e] if b in rows else a[b : b + 1] for b in range(a.shape[0])]
            new.append(mx.concatenate(parts, axis=0))
        self.cache.cache = new
        mx.eval([a for a in new if a is not None])


# ---------------------------------------------------------------------- the executor


def batch_record(index: int, width: int, entries: list[dict[str, Any]], joined: list[str],
                 left: list[dict[str, str]], time_s: float | None) -> dict[str, Any]:
    """A ``batch_step`` record (``traces/INTERPRETING.md``, Batch traces): the step's width, each
    row's round (slot, round index, drafts, k_accept, tokens emitted, end, the rows beside it),
    the rows that joined before it and the rows that left (done, preempted, serial lane)."""
    return {"type": "batch_step", "index": index, "width": width, "rows": entries, "joined": joined,
            "left": left, "time_s": time_s}


def batch_generate(target_model: Any, requests: list[BatchRequest], *, max_batch: int | None = None,
                   observer: BatchObserver | None = None, batch_drafts: bool | None = None) -> BatchResult:
    """Run ``requests`` as one batch (module docstring); each row's result is its serial run's.

    ``max_batch``: the most rows in the batch at once (None: no limit); arrivals beyond it
    wait, in request order, for a slot. ``observer`` sees every row's verify block. Runs on
    the serial executor's generation stream. ``batch_drafts``: whether the two-model rows draft
    as one batch (:class:`_Drafters`); None (default): where the backend is bit-exact
    (``engine.backend.arithmetic``), so that off it each row's drafts stay its serial run's
    (a batched drafter forward's arithmetic may depend on the batch, moving drafts and rounds,
    never tokens); True opts in everywhere (the throughput bench), False never.
    """
    with mx.stream(generation_stream()):
        return _batch_generate(target_model, requests, max_batch, observer or NO_BATCH_OBSERVER, batch_drafts)


def _batch_generate(target_model: Any, requests: list[BatchRequest], max_batch: int | None,
                    observer: BatchObserver, batch_drafts: bool | None = None) -> BatchResult:
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    ids = [r.rid for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"row ids must be unique, got {ids}")
    t0 = time.perf_counter()
    batch = _Batch(target_model)
    waiting = sorted(requests, key=lambda r: r.arrive)  # stable: request order within a step
    rows: dict[str, _Row] = {}
    paused: list[_Row] = []
    steps: list[dict[str, Any]] = []
    lanes: dict[str, str] = {}
    drafting: dict[str, str] = {}
    if batch_drafts is None:
        from engine.backend import arithmetic

        batch_drafts = arithmetic(target_model).exact
        off_why = "the backend is not bit-exact (batch_drafts=True opts in)"
    else:
        off_why = "batch_drafts=False"
    drafters = _Drafters(batch_drafts)
    step = 0
    while waiting or batch.rows or paused:
        ts = time.perf_counter()
        left: list[dict[str, str]] = []
        joined: list[str] = []
        # preemption: rows pausing now leave, rows resuming now come back
        for row in list(batch.rows):
            if row.spec.pause is not None and row.spec.pause[0] == step:
                row.swapped = batch.extract(row)
                batch.release(row)
                drafters.leave(row, keep=True, eligible=True)
                paused.append(row)
                left.append({"row": row.rid, "why": "preempted"})
        for row in list(paused):
            if row.spec.pause is not None and row.spec.pause[1] <= step and _room(batch, max_batch):
                assert row.swapped is not None
                batch.join(row, row.swapped)
                row.swapped = None
                paused.remove(row)
                joined.append(row.rid)
        while waiting and waiting[0].arrive <= step and _room(batch, max_batch):
            spec = waiting.pop(0)
            row = _Row(spec, target_model)
            rows[row.rid] = row
            reason = _start(row, target_model)
            if reason is not None:
                lanes[row.rid] = f"serial: {reason}"
                left.append({"row": row.rid, "why": f"serial: {reason}"})
                continue
            lanes[row.rid] = "batch"
            if row.done:  # e.g. a full prefill whose first sample ended the request
                left.append({"row": row.rid, "why": "done"})
                continue
            batch.join(row, row.req.caches)
            assert row.source is not None
            why = drafter_reason(row.source, row.req.sampler) if batch_drafts else off_why
            drafting[row.rid] = "batched" if drafters.admit(row) else f"per row: {why}"
            joined.append(row.rid)
        batch.compact()
        active = batch.rows
        if not active:
            if joined or left:  # an idle step is written only when a row came or went
                steps.append(batch_record(step, 0, [], joined, left, time.perf_counter() - ts))
            nxt = [r.arrive for r in waiting] + [r.spec.pause[1] for r in paused if r.spec.pause is not None]
            step = max(step + 1, min(nxt)) if nxt else step + 1
            continue
        entries, width = _step(batch, drafters, active, step, left, observer)
        steps.append(batch_record(step, width, entries, joined, left, time.perf_counter() - ts))
        for row in list(batch.rows):
            if row.done:
                batch.release(row)
                drafters.leave(row)
        step += 1
    results = {rid: row.result for rid, row in rows.items() if row.result is not None}
    missing = [rid for rid in ids if rid not in results]
    if missing:
        raise RuntimeError(f"batched run ended without results for rows {missing}")
    return BatchResult(results, steps, time.perf_counter() - t0, lanes, drafting)


def _room(batch: _Batch, max_batch: int | None) -> bool:
    return max_batch is None or len(batch.rows) < max_batch


def _start(row: _Row, model: Any) -> str | None:
    """Open the row's source and prefill it alone (``spec_generate``'s opening, B = 1).

    Returns why the row runs on the serial lane instead (it has then run to completion)."""
    req = row.req
    params = req.params
    source = row.spec.provider.open(req.sampler, TargetView(model=model, caches=req.caches))
    reason = serial_reason(model, req.caches, source, params)
    if reason is not None:
        # the serial executor, on a fresh request (its own source, pipeline and caches)
        with _row_rng(row):
            row.result = spec_generate(model, row.spec.provider, row.spec.prompt_ids, params,
                                       on_token=row.spec.on_token)
        row.lane = "serial"
        return reason
    if params.rotating != "guard":
        set_rotating(source, params.rotating)  # the source's own rotating caches (a drafter's)
    assert not tap_set(source, len(model.layers))
    row.source = source
    mode: PrefillMode = params.prefill or source.prefill_mode
    drained = req.drained(mode)
    with _row_rng(row):
        drafter_tokens = source.prefill(drained, None)
        last_logits = req.prefill(drained, params.prefill_step_size, SPEC_PREFILL_STEP)
        req.prefill_record(drained, list(drafter_tokens),
                           source.cache_digest() if params.cache_digests else None)
        row.pending = [req.first_input(mode, last_logits)]
    row.feed = list(row.pending)
    if req.stream.done:
        row.finish()
    return None


@dataclass
class _Plan:
    row: _Row
    drafts: list[int]
    drafts_arr: mx.array | None
    d: int
    window_arr: mx.array
    confidence: list[float] | None
    tr0: float
    drafter: _Batch | None = None  # the row drafted in this drafter batch (its commit is the batch's)
    samples: mx.array | None = None
    margins: mx.array | None = None


def _plan(row: _Row, drafts: list[int], drafts_arr: mx.array | None, n: int, tr0: float,
          drafter: _Batch | None = None) -> _Plan:
    assert row.source is not None
    d = len(drafts) if drafts_arr is None else int(drafts_arr.shape[0])
    if d > n:
        raise RuntimeError(f"row {row.rid}: draft source returned {d} tokens, more than n={n}")
    head = mx.array(row.pending, mx.uint32)
    tail = mx.array(drafts, mx.uint32) if drafts_arr is None else drafts_arr.astype(mx.uint32)
    return _Plan(row, drafts, drafts_arr, d, mx.concatenate([head, tail]), source_confidence(row.source, d), tr0,
                 drafter)


def _step(batch: _Batch, drafters: _Drafters, active: list[_Row], step: int, left: list[dict[str, str]],
          observer: BatchObserver) -> tuple[list[dict[str, Any]], int]:
    """One batch step: every active row's round, ONE target forward, ONE host sync."""
    prof = active_profile()
    if prof is not None:
        prof.start()
    plans: list[_Plan] = []
    grouped: list[tuple[_Row, int, float]] = []  # rows drafting in a drafter batch
    rounds: list[tuple[_Row, int, float]] = []
    for row in active:
        req, source = row.req, row.source
        assert source is not None
        tr0 = time.perf_counter()
        n = min(req.params.gamma, req.stream.left)
        guard = _ring_guard(batch, row, n) or source_guard(source, row.feed, n)
        if guard is not None:
            # the serial run stops speculating here: the row leaves for the serial lane
            drafters.leave(row)
            req.caches = batch.extract(row)
            with _row_rng(row):
                req.plain_loop(row.pending[-1], guard.split(":")[0], guard)
            row.finish()
            batch.release(row)
            left.append({"row": row.rid, "why": f"serial: {guard.split(':')[0]}"})
            continue
        rounds.append((row, n, tr0))
    drafters.rebalance([row for row, _, _ in rounds])
    for row, n, tr0 in rounds:
        if drafters.holds(row):
            grouped.append((row, n, tr0))
            continue
        assert row.source is not None
        with _row_rng(row):
            drafts, drafts_arr = draft_round(row.req, row.source, row.feed, n, None, NO_OBSERVER, ())
        plans.append(_plan(row, drafts, drafts_arr, n, tr0))
    for row, n, tr0, arr, dbatch in drafters.draft(grouped):
        plans.append(_plan(row, [], arr, n, tr0, dbatch))
    batch.compact()
    if not plans:
        return [], 0
    if prof is not None:
        prof.lap("draft", [p.drafts_arr for p in plans])
    width = max(p.d + 1 for p in plans)
    if batch.rotating:
        width = max(width, 2)  # the concatenating update (module docstring)
    slots = [batch.slot(p.row) for p in plans]
    order = sorted(range(len(plans)), key=lambda i: slots[i])
    plans = [plans[i] for i in order]
    inputs = mx.stack([mx.concatenate([p.window_arr, mx.full((width - p.d - 1,), PAD_ID, mx.uint32)])
                       for p in plans])
    if prof is not None:
        prof.lap("window", inputs)
    logits = batch.forward(inputs)
    if prof is not None:
        prof.lap("forward", logits)
    # every row's margins in one call over the block (top-2 per logits row: no row reads another)
    vocab = int(logits.shape[-1])
    all_margins = margin_array(logits.reshape(-1, vocab))
    all_margins = None if all_margins is None else all_margins.reshape(len(plans), width)
    # the rows whose window draw is plain greedy (argmax of the log-softmax, nothing else): one call
    greedy = _greedy_group([p.row for p in plans])
    if greedy:
        pick = logits if len(greedy) == len(plans) else logits[mx.array(greedy)]
        flat = pick.reshape(-1, vocab)
        drawn = greedy_draw(flat).reshape(len(greedy), width)
        for j, b in enumerate(greedy):
            plans[b].samples = drawn[j, : plans[b].d + 1]
    for b, p in enumerate(plans):
        if p.samples is None:
            block = logits[b, : p.d + 1, :]
            window = p.row.pending + p.drafts
            with _row_rng(p.row):
                p.samples = p.row.req.pipe.window_samples(block, window)
        p.margins = None if all_margins is None else all_margins[b, : p.d + 1]
    # the step's one sync, every row's samples, drafts and margins in one host transfer each
    ids = mx.concatenate([p.samples.astype(mx.uint32).reshape(-1) for p in plans if p.samples is not None]
                         + [p.drafts_arr.astype(mx.uint32).reshape(-1) for p in plans if p.drafts_arr is not None])
    margin_arrs = [p.margins for p in plans if p.margins is not None]
    flat_margins = mx.concatenate(margin_arrs) if margin_arrs else None
    mx.eval(ids, *([flat_margins] if flat_margins is not None else []))
    host_ids = [int(t) for t in cast(list, ids.tolist())]
    host_margins = [float(m) for m in cast(list, flat_margins.tolist())] if flat_margins is not None else []
    at, mat = 0, 0
    samples: list[list[int]] = []
    margins: list[list[float]] = []
    for p in plans:
        assert p.samples is not None
        count = p.samples.size  # d + 1, or none for a row-wise (constrained) pipeline
        samples.append(host_ids[at : at + count])
        at += count
        if p.margins is None:
            margins.append([float("inf")] * (p.d + 1))
        else:
            margins.append(host_margins[mat : mat + p.d + 1])
            mat += p.d + 1
    for p in plans:
        if p.drafts_arr is not None:
            p.drafts = host_ids[at : at + p.d]
            at += p.d
    for b, row_margins in enumerate(margins):
        bad = [i for i, m in enumerate(row_margins) if m != m]
        if bad:
            raise NonFiniteLogits(f"the model produced non-finite logits (NaN or +inf) in row {bad[0]} "
                                  f"of a step (batch row {plans[b].row.rid}): its weights or inputs are "
                                  "broken; no output is produced from them")
    if prof is not None:
        prof.lap("sync")
    walks: list[WalkResult] = []
    for b, p in enumerate(plans):
        row, req = p.row, p.row.req
        window = row.pending + p.drafts
        block = logits[b, : p.d + 1, :]
        observer.after_verify(step, row.rid, row.round_index, window, block)
        with _row_rng(row):
            walk = req.pipe.walk(block, p.drafts, samples[b], req.stream.offer, req.stream.terminate)
        walks.append(walk)
    if prof is not None:
        prof.lap("walk")
    batch.rollback([w.k_accept + 1 for w in walks], width)
    if prof is not None:
        prof.lap("rollback", cache_arrays(batch.caches))
    drafters.commit([(p.row, p.drafter, p.d, w.k_accept) for p, w in zip(plans, walks, strict=True)])
    for p, walk in zip(plans, walks, strict=True):
        if p.drafter is None:
            assert p.row.source is not None
            with _row_rng(p.row):
                p.row.source.commit(p.d, walk.k_accept, None, None, p.drafts[: walk.k_accept])
    if prof is not None:
        prof.lap("commit", drafters.arrays(), *[source_state(p.row.source) for p in plans if p.drafter is None])
    entries: list[dict[str, Any]] = []
    rids = [p.row.rid for p in plans]
    for b, (p, walk) in enumerate(zip(plans, walks, strict=True)):
        row, req = p.row, p.row.req
        assert row.source is not None
        k = walk.k_accept
        window = row.pending + p.drafts
        req.counters.record_round(p.d, k)
        if req.params.cache_digests:
            req.caches = batch.extract(row)
            drafters.sync_back(row)
        after_round = getattr(observer, "after_round", None)  # the batched checks' cache probe (optional)
        if after_round is not None:
            after_round(step, row.rid, row.round_index, req.caches if req.params.cache_digests else batch.extract(row))
        rec = round_record(req, row.source, row.round_index, row.feed, p.drafts, window, walk, margins[b],
                           p.confidence, p.tr0)
        neighbours = [r for r in rids if r != row.rid]
        rec["batch"] = {"row": row.rid, "step": step, "slot": b, "width": width, "neighbours": neighbours}
        req.records.append(rec)
        entries.append({"row": row.rid, "slot": b, "round": row.round_index, "d": p.d, "k_accept": k,
                        "emitted": len(walk.emitted), "end": walk.end, "neighbours": neighbours})
        row.round_index += 1
        if req.stream.done:
            row.finish()
            continue
        row.pending = [walk.walked[k]]
        row.feed = refeed(p.drafts, k, walk.walked[k])
    if prof is not None:
        prof.lap("records")
        prof.end_round(len(plans))
    return entries, width


def _plain_greedy(row: _Row) -> bool:
    """Whether the row's every draw is mlx-lm's greedy sampler on the log-softmax alone (no
    processors, grammar, min_tokens, position keys, temperature): then rows draw together."""
    from mlx_lm.sample_utils import greedy_sampler

    pipe, sampler = row.req.pipe, row.req.sampler
    return (sampler.greedy and sampler.draw_fn is greedy_sampler and not sampler.has_processors
            and pipe.stateless and not pipe.row_wise)


def _greedy_group(rows: list[_Row]) -> list[int]:
    """The indices of ``rows`` that draw plain greedy (:func:`_plain_greedy`)."""
    return [i for i, r in enumerate(rows) if _plain_greedy(r)]


def greedy_draw(logits: mx.array) -> mx.array:
    """mlx-lm's greedy draw on every row of ``[m, V]`` logits: ``argmax(logits - logsumexp)``
    (``_process_and_sample`` + ``greedy_sampler``); each row's result is its own row's alone."""
    from mlx_lm.sample_utils import greedy_sampler

    return greedy_sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


# ---------------------------------------------------------------------- batched drafting


def drafter_reason(source: DraftSource, sampler: Any) -> str | None:
    """Why a row's source drafts on its own rather than in a drafter batch (None: it batches).

    Batched: the two-model source whose drafter caches are all plain ``KVCache`` (no rotating
    ring, no recurrent layer to replay, no quantized KV), drafting through its lazy
    ``draft_array`` (no logits processors: their history needs each draft's value), with no
    padded-vocabulary check on its drafts. Every other source drafts per row (an n-gram
    lookup is host work with no device call to batch)."""
    from mlx_lm.models.cache import KVCache

    from engine.sources.two_model import TwoModelSource

    if type(source) is not TwoModelSource:
        return f"the {type(source).__name__} source drafts per row"
    src = cast(TwoModelSource, source)
    if lazy_drafts(src, NO_OBSERVER, (), sampler) is None:
        return "logits processors read each draft's value (the list path)"
    if src.kv_quantization is not None or src.rings or src.target_vocab is not None:
        return "quantized KV, exact rings or a wider drafter vocabulary"
    if not all(type(c) is KVCache for c in src.caches):
        return "drafter caches other than KVCache (rotating or recurrent)"
    return None


class _Drafters:
    """The two-model rows' drafter caches as one batch per drafter model (while two or more
    of its rows draft in a step; a lone row drafts through its own source, :meth:`rebalance`).

    The batch is a :class:`_Batch` of the drafter (left-padded ``BatchKVCache`` per layer,
    one slot per row). A round drafts every row in ``max_b n_b`` drafter forwards: the first
    over the right-padded feeds (``[correction]`` or ``[last draft, bonus]``), each row's first
    draft read at its last feed position and the pad rolled off (the target's per-row
    rollback), then one forward per further draft step over every row's previous draft. A
    row drafting fewer than the longest (fewer tokens left) keeps writing and drops the extra
    positions at the commit, in the same one rollback that applies each row's
    ``_rewind_cache`` trim (``max(d - k - 1, 0)``). The row's draws are its own sampler's,
    on its own logits row, under its own generator (:class:`RowRng`): the serial run's draws.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.batches: dict[int, _Batch] = {}
        self.of: dict[str, _Batch] = {}
        self.eligible: set[str] = set()

    def holds(self, row: _Row) -> bool:
        return row.rid in self.of

    def admit(self, row: _Row) -> bool:
        """A joining row may draft in its drafter's batch (False: it drafts alone); it does once
        a second such row is in the batch (:meth:`rebalance`)."""
        source = row.source
        if not self.enabled or source is None or drafter_reason(source, row.req.sampler) is not None:
            return False
        self.eligible.add(row.rid)
        return True

    def rebalance(self, rows: list[_Row]) -> None:
        """Before a step's drafting: the eligible rows of each drafter draft as one batch when
        there are two or more of them; a lone one drafts through its own source (its caches
        back from the batch): B = 1 gains nothing from the batched caches' masks and padding."""
        groups: dict[int, list[_Row]] = {}
        for row in rows:
            if row.rid in self.eligible:
                groups.setdefault(id(cast(Any, row.source).model), []).append(row)
        for key, members in groups.items():
            if len(members) >= 2:
                model = cast(Any, members[0].source).model
                b = self.batches.setdefault(key, _Batch(model))
                for row in members:
                    if row.rid not in self.of:
                        b.join(row, cast(Any, row.source).caches)
                        self.of[row.rid] = b
            else:
                self.leave(members[0], keep=True, eligible=True)

    def leave(self, row: _Row, keep: bool = False, eligible: bool = False) -> None:
        """The row leaves its drafter batch; ``keep``: its caches go back to its source first;
        ``eligible``: it may join again (a lone row, a paused one)."""
        if not eligible:
            self.eligible.discard(row.rid)
        b = self.of.pop(row.rid, None)
        if b is None:
            return
        if keep:
            cast(Any, row.source).caches = b.extract(row)
        b.release(row)

    def sync_back(self, row: _Row) -> None:
        """The row's source sees its caches as they are now (its cache digest reads them)."""
        b = self.of.get(row.rid)
        if b is not None:
            cast(Any, row.source).caches = b.extract(row)

    def arrays(self) -> list[Any]:
        return [a for b in self.batches.values() for a in cache_arrays(b.caches)]

    def draft(self, grouped: list[tuple[_Row, int, float]]) -> list[tuple[_Row, int, float, mx.array, _Batch]]:
        out: list[tuple[_Row, int, float, mx.array, _Batch]] = []
        by_batch: dict[int, list[tuple[_Row, int, float]]] = {}
        for item in grouped:
            by_batch.setdefault(id(self.of[item[0].rid]), []).append(item)
        for items in by_batch.values():
            b = self.of[items[0][0].rid]
            b.compact()
            arrs = self._draft_batch(b, {row.rid: (row, n) for row, n, _ in items})
            out += [(row, n, tr0, arrs[row.rid], b) for row, n, tr0 in items]
        return out

    def _draft_batch(self, b: _Batch, want: dict[str, tuple[_Row, int]]) -> dict[str, mx.array]:
        rows = b.rows
        if {r.rid for r in rows} != set(want):
            raise RuntimeError(f"drafter batch holds rows {[r.rid for r in rows]} but rows "
                               f"{sorted(want)} draft this step")
        ns = [want[r.rid][1] for r in rows]
        if min(ns) < 1:
            raise RuntimeError(f"drafter batch: a row with n = {min(ns)} drafts (rows {[r.rid for r in rows]})")
        feeds = [list(r.feed) for r in rows]
        for r, feed in zip(rows, feeds, strict=True):
            src = cast(Any, r.source)
            if src.vocab is not None and any(int(t) >= src.vocab for t in feed):
                src.draft_array(feed, want[r.rid][1], 0, None)  # raises the serial run's VocabMismatchError
            src._first_feed = False
        width = max(len(f) for f in feeds)
        steps = max(ns)
        inputs = mx.array([f + [PAD_ID] * (width - len(f)) for f in feeds], mx.uint32)
        logits = b.forward(inputs)
        greedy = _greedy_group(rows)
        last = mx.array([len(f) - 1 for f in feeds])
        ys = self._draws(rows, greedy, logits[mx.arange(len(rows)), last][:, None, :], [True] * len(rows))
        if width > min(len(f) for f in feeds):
            b.rollback([len(f) for f in feeds], width, drop_padding=False)
        drafts: list[list[mx.array]] = [[y] for y in ys]
        for t in range(1, steps):
            y = mx.concatenate(ys)[:, None]
            logits = b.forward(y)
            # a row past its own n draws nothing more (its generator must not move): it re-feeds
            # its last draft, and the commit drops those positions
            live = [t < n for n in ns]
            got = self._draws(rows, greedy, logits[:, -1:, :], live)
            ys = [g if ok else ys[i] for i, (g, ok) in enumerate(zip(got, live, strict=True))]
            for i, y_i in enumerate(ys):
                if live[i]:
                    drafts[i].append(y_i)
        return {r.rid: mx.concatenate(drafts[i]) for i, r in enumerate(rows)}

    def _draws(self, rows: list[_Row], greedy: list[int], logits: mx.array, live: list[bool]) -> list[mx.array]:
        """Every row's draw on its ``[1, 1, V]`` row of ``logits [B, 1, V]``: the plain greedy
        rows in one call, each other live row through its own sampler and generator (a row
        that is not live draws nothing: its entry is a placeholder the caller drops)."""
        out: list[mx.array | None] = [None] * len(rows)
        if greedy:
            pick = logits if len(greedy) == len(rows) else logits[mx.array(greedy)]
            drawn = greedy_draw(pick.reshape(len(greedy), -1))
            mx.async_eval(drawn)
            for j, i in enumerate(greedy):
                out[i] = drawn[j : j + 1]
        for i, r in enumerate(rows):
            if out[i] is None:
                out[i] = self._sample(r, logits[i : i + 1]) if live[i] else mx.zeros((1,), mx.uint32)
        return cast(list, out)

    @staticmethod
    def _sample(row: _Row, logits: mx.array) -> mx.array:
        """The row's draw on its ``[1, 1, V]`` logits (the serial ``draft_array``'s step)."""
        req = row.req
        with _row_rng(row), req.sampler.drafting(req.pipe.history):
            y = req.sampler.sample_window(logits.squeeze(0))
        mx.async_eval(y)
        return y

    def commit(self, rounds: list[tuple[_Row, _Batch | None, int, int]]) -> None:
        """Every drafter batch's rollback after the walk: row ``b`` keeps ``min(k_b, n_b - 1)``
        of the ``max n - 1`` positions its further draft steps wrote (the serial source's
        ``max(d - k - 1, 0)`` trim, plus the steps it ran only because a batch-mate drafted more)."""
        by_batch: dict[int, tuple[_Batch, dict[str, tuple[int, int]]]] = {}
        for row, b, d, k in rounds:
            if b is not None:
                by_batch.setdefault(id(b), (b, {}))[1][row.rid] = (d, k)
        for b, dk in by_batch.values():
            rows = b.rows
            steps = max(dk[r.rid][0] for r in rows) - 1
            keeps = [_drafter_keeps(*dk[r.rid]) for r in rows]
            if steps > 0:
                b.rollback(keeps, steps)
            else:
                _drop_common_padding([c for c in b.caches if _is_kv(c)])


def _ring_guard(batch: _Batch, row: _Row, n: int) -> str | None:
    """The §2 ring-wrap guard on the row's own offset (the serial plan's message)."""
    if not batch.rotating:
        return None
    slot = batch.slot(row)
    for c in batch.caches:
        if _is_rot(c) and int(c.offset[slot].item()) + n + 1 >= int(c.max_size):
            return CacheRollback(batch.model, batch.extract(row)).ring_guard(n)
    return None

