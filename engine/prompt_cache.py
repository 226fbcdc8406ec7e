"""Prompt-cache reuse under speculation: save, fetch the longest prefix, trim or extend.

Reference: mlx-lm 0.32.2 ``mlx_lm/models/cache.py`` ``LRUPromptCache``
(``fetch_nearest_cache``: the longest cached prefix, ``copy.deepcopy`` of the
entry, ``can_trim_prompt_cache`` / ``trim_prompt_cache`` to the common prefix;
``insert_cache`` after the request) as ``mlx_lm/server.py``
``ResponseGenerator._serve_single`` drives it with a draft model. Contract:
``../shared/reference/speculative-decoding.md`` §2 (the prompt-cache bypass on
the spec path, "Spec × prompt-cache composition" of §8, is what this closes) and §4.8 (a recurrent state is reused only at the exact boundary it
was saved at, never trimmed).

What differs from mlx-lm's server, on purpose:

- The target and the drafter are two SEGMENTS, each with its own key (the
  tokens its caches hold). mlx-lm keeps both in one list under one key
  (prompt + every generated token), which is wrong for both after a
  speculative turn: the target holds ``prompt + out[:-1]`` after a correction
  or a bonus, ``prompt + out`` after a budget stop inside a window or an EOS
  correction, ``prompt + out + [eos]`` after an accepted EOS draft; the
  drafter lags the target by one after an all-accept round. Here each key is
  the stream (prompt, then every sample the walk took, EOS included) cut to
  the segment's own offset, and every save checks that each layer's offset
  equals its key length (``PromptCacheError`` naming the request and segment).
- Two boundaries are saved per request: after the prefill (the prompt) and
  after the last round (the stream), so a regeneration or a shorter prefix
  can reuse a segment that cannot trim.
- Per cache family, what a fetch may do (``reuse_rule``):
  ``KVCache`` and a ``RotatingKVCache`` that never wrapped: trim to the common
  prefix; an ``ArraysCache`` (qwen3_5 gated DeltaNet) or a ring that wrapped
  (``offset >= max_size``): only at the exact boundary the segment was saved
  at, never trimmed; a ring that wrapped during DECODE (one-token in-place
  ring writes after its prefill) is refused: its K/V past the wrap were not
  computed by the windowed-mask prefill a cold run does; a ``QuantizedKVCache``
  is refused: positions at or past ``quantized_kv_start`` were computed
  against quantized K/V in decode, the cold prefill computes them against
  full-precision K/V (mlx-lm ``maybe_quantize_kv_cache`` runs after the
  whole prefill chunk).
- Every fetch is checked: the key each segment was saved with agrees with the
  new prompt over the reused length, and after the trim each layer holds
  exactly that length (no hole, no duplicate position).
- ``split_profile``: reuse splits a prefill where a cold run does not, so it is
  exact only for a model whose cache bytes do not depend on the split (probed
  once per model); mlx-lm ``deepseek_v3`` (MLA) differs for one-token forwards.
  Where the backend is not bit-exact (``exact_arithmetic = False``) every split
  differs by arithmetic: the probe is skipped and warm ≡ cold is judged within a
  calibrated tolerance (``engine.cache_compare``).

Sources: ``two-model`` keeps its drafter caches (a segment like the target's);
``ngram`` is model-free and re-reads the whole prompt (its history IS the
token list, rebuilt exactly); a source that reads the target's hidden states
(mtp, assistant, native-mtp, dspark, deepspec) gets the whole prompt's tapped
rows, the reused prefix's saved with the target segment and the suffix's from
its prefill (executor hooks ``tap_context`` / ``after_round``), so its state
is rebuilt exactly rather than saved.

Cache snapshots (``PromptCacheSession.keep_caches``, off by default): each
``Turn.caches`` holds copies of the caches the warm request started from (the
fetched target prefix, the installed drafter prefix), after its prefill and at
its end; ``ColdCapture`` (passed as ``cold(..., reuse=...)``) takes the same of
a cold run. ``engine.cache_compare`` compares them within a calibrated
arithmetic tolerance on a backend that is not bit-exact.

The control arm, ``PlainPromptCacheSession``: the same prompt cache under plain
decode (``engine.executor.plain_generate(target_caches=..., reuse=...)``, mlx-lm
``server.py`` without a draft model), one target segment per entry, the same two
boundaries, invariant checks and reuse rules; ``cold_plain`` is its cold run.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.executor import (
    GenerationParams,
    GenerationResult,
    OnToken,
    plain_generate,
    spec_generate,
)
from engine.rollback import is_arrays, is_rotating
from engine.seam import DraftProvider
from traces.diff import common_prefix


def reuse_family(kind: str) -> str | None:
    """The source kind's reuse family (``engine.sources.kind.Reuse``), None for an unknown kind.

    ``segment``: the session saves and restores the drafter's own caches; ``reread``:
    model-free, prefilled from the full prompt every time; ``tapped``: a function of the
    target's tapped hidden rows, saved with the target's caches, the source re-reading
    the whole prompt's rows (saved + new).
    """
    from engine.sources.kind import find

    desc = find(kind)
    return desc.reuse if desc is not None else None


def _kinds_of(family: str) -> tuple[str, ...]:
    from engine.sources.kind import all_kinds

    return tuple(k.name for k in all_kinds() if k.reuse == family)


def __getattr__(name: str) -> Any:  # PEP 562: the per-kind tables, derived from the descriptors
    if name in ("SEGMENT_SOURCES", "REREAD_SOURCES", "TAPPED_SOURCES"):
        return _kinds_of(name.split("_")[0].lower())
    if name == "FULL_PREFILL":  # the kinds whose convention is §2.1 "full"
        from engine.sources.kind import all_kinds

        return tuple(k.name for k in all_kinds() if k.prefill == "full")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class PromptCacheError(RuntimeError):
    """A saved or fetched cache segment breaks the offset == key length invariant."""


@dataclass
class Segment:
    """One model's caches and the tokens they hold (``key``), saved at one boundary."""

    name: str  # "target" | "drafter"
    key: tuple[int, ...]
    caches: list[Any]
    boundary: str  # "prefill" | "end"
    request: int
    wrapped_in_decode: bool = False
    hidden: dict[int, Any] | None = None  # tapped target rows, one per key position (tapped sources)
    one_token_forwards: bool = False  # some position came from a one-token forward (see split_profile)

    def reuse_rule(self) -> tuple[str, str | None]:
        """``("trim" | "exact" | "refuse", why)``: what a fetch may do with this segment."""
        for i, c in enumerate(self.caches):
            kind = type(c).__name__
            if "Quantized" in kind:
                return "refuse", (
                    f"{self.name} layer {i} {kind}: positions past quantized_kv_start were computed "
                    "over quantized K/V in decode; a cold prefill computes them over full precision"
                )
            if is_rotating(c) and int(c.offset) >= int(c.max_size) and self.wrapped_in_decode:
                return "refuse", (
                    f"{self.name} layer {i} {kind} wrapped during decode (offset {int(c.offset)} >= "
                    f"max_size {int(c.max_size)}): one-token ring writes, not a cold prefill"
                )
        for i, c in enumerate(self.caches):
            if is_arrays(c):
                return "exact", f"{self.name} layer {i} {type(c).__name__} (recurrent: no trim)"
            if is_rotating(c) and int(c.offset) >= int(c.max_size):
                return "exact", f"{self.name} layer {i} {type(c).__name__} wrapped (no trim)"
        return "trim", None

    def usable(self, drained: Sequence[int]) -> tuple[int, str | None]:
        """How many of ``drained`` this segment can supply, and why not more."""
        n = common_prefix(self.key, drained)
        rule, why = self.reuse_rule()
        if rule == "refuse":
            return 0, why
        if rule == "exact":
            if n == len(self.key):
                return n, None
            return 0, f"{why}: saved at {len(self.key)} tokens, prompt shares {n}"
        return n, None


_SPLIT: dict[int, tuple[Any, str]] = {}  # id(model) -> (the model, kept alive so the id stays its, profile)


def split_profile(model: Any, tokens: Sequence[int]) -> str:
    """Whether ``model``'s caches come out byte-identical however a prefill is split.

    ``"exact"``: one chunk, two halves and ``n - 1`` + 1 give the same cache bytes (reuse
    can split anywhere); ``"multi"``: only the one-token forward differs (mlx-lm
    ``deepseek_v3`` MLA takes its absorbed-weights path when ``L == 1``), so a reused prefix
    needs a suffix of at least two tokens and positions that no one-token forward wrote;
    ``"none"``: splits change the bytes (no reuse). Measured once per model object on
    ``tokens`` (the session's first prompt).
    """
    key = id(model)
    if key not in _SPLIT:
        from mlx_lm.models.cache import make_prompt_cache

        from traces.digest import cache_digest

        ids = list(tokens)
        while len(ids) < 8:
            ids = ids + ids
        ids = ids[:16]

        def fill(splits: list[int]) -> str:
            caches = make_prompt_cache(model)
            pos = 0
            for n in splits:
                model(mx.array(ids[pos : pos + n], mx.uint32)[None], cache=caches)
                pos += n
            mx.eval([c.state for c in caches])
            return str(cache_digest(caches)["combined"])

        one = fill([len(ids)])
        halves = fill([len(ids) // 2, len(ids) - len(ids) // 2])
        last = fill([len(ids) - 1, 1])
        _SPLIT[key] = (model, "none" if halves != one else ("exact" if last == one else "multi"))
    return _SPLIT[key][1]


def positions(c: Any) -> int | None:
    """How many positions a cache layer holds (None: a recurrent state has no offset)."""
    off = getattr(c, "offset", None)
    return None if off is None else int(off)


def held(caches: Sequence[Any]) -> int | None:
    """The position count every offset-carrying layer agrees on (None: none carries one)."""
    offs = {p for p in (positions(c) for c in caches) if p is not None}
    if len(offs) > 1:
        raise PromptCacheError(f"cache layers disagree on their offset: {sorted(offs)}")
    return offs.pop() if offs else None


def check_segment(seg: Segment, n: int, what: str) -> None:
    """Every layer of ``seg`` holds exactly ``n`` positions (``what``: save/fetch, for the message)."""
    for i, c in enumerate(seg.caches):
        p = positions(c)
        if p is not None and p != n:
            hole = "a hole" if p < n else "duplicate positions"
            raise PromptCacheError(
                f"request {seg.request}: {what}: {seg.name} segment ({seg.boundary} boundary) layer {i} "
                f"({type(c).__name__}) holds {p} positions, its key has {n}: {hole}"
            )
        if p is None and n > 0 and is_arrays(c) and all(a is None for a in c.cache):
            raise PromptCacheError(
                f"request {seg.request}: {what}: {seg.name} segment layer {i} ({type(c).__name__}) "
                f"holds no state, its key has {n} tokens: a hole"
            )


def copy_caches(caches: Sequence[Any]) -> list[Any]:
    """A deep copy whose arrays no later in-place cache write can reach (mlx-lm: ``copy.deepcopy``)."""
    out = copy.deepcopy(list(caches))
    mx.eval([c.state for c in out if not _empty(c)])
    return out


def _empty(c: Any) -> bool:
    if is_arrays(c):
        return all(a is None for a in c.cache)
    return getattr(c, "keys", None) is None


def trim_to(seg: Segment, n: int) -> list[Any]:
    """A copy of ``seg``'s caches holding its first ``n`` positions."""
    caches = copy_caches(seg.caches)
    cut = len(seg.key) - n
    if cut > 0:
        for i, c in enumerate(caches):
            if not c.is_trimmable():
                raise PromptCacheError(
                    f"request {seg.request}: fetch: {seg.name} layer {i} ({type(c).__name__}) "
                    f"cannot trim {cut} positions"
                )
            got = c.trim(cut)
            if got != cut:
                raise PromptCacheError(
                    f"request {seg.request}: fetch: {seg.name} layer {i} trimmed {got} of {cut}"
                )
    return caches


def stream_tokens(prompt: Sequence[int], records: Sequence[dict[str, Any]]) -> list[int]:
    """The prompt then every sample the request took, in order (EOS included: it may be in a cache)."""
    out = list(prompt)
    for r in records:
        if r["type"] == "round":
            out.extend(int(t) for t in r["samples"])
        elif r["type"] == "plain":
            out.append(int(r["sample"]))
    return out


@dataclass
class Entry:
    target: Segment
    drafter: Segment | None


@dataclass
class Fetch:
    """What the executor is told (``engine.executor.spec_generate(reuse=...)``)."""

    session: PromptCacheSession
    request: int
    drained: list[int]
    target_prefix: int = 0
    drafter_prefix: int | None = None
    drafter: Segment | None = None
    entry: Entry | None = None
    refused: list[str] = field(default_factory=list)
    prefill_target: list[Any] | None = None
    prefill_drafter: list[Any] | None = None
    hidden: dict[int, Any] | None = None  # the reused prefix's tapped rows
    prefill_hidden: dict[int, Any] | None = None
    rows: dict[int, list[Any]] | None = None  # tapped rows of every kept position, in order
    untapped_rounds: int = 0
    start_drafter: list[Any] | None = None  # the installed drafter prefix (keep_caches)

    def open_source(self, source: Any) -> int:
        if reuse_family(self.session.kind) in ("reread", "tapped"):
            return 0  # re-derived from the whole prompt (tapped: the saved rows + the new ones)
        if reuse_family(self.session.kind) != "segment":
            if self.target_prefix:
                raise PromptCacheError(f"request {self.request}: a {self.session.kind} source cannot resume")
            return 0
        n = self.drafter_prefix or 0
        if self.drafter is not None and n:
            self.session.install_drafter(source, self.drafter, n, self)
            if self.session.keep_caches:
                self.start_drafter = copy_caches(source.caches)
            seg = Segment("drafter", tuple(self.drained[:n]), source.caches, "fetch", self.request)
            check_segment(seg, n, "fetch")
        return n

    def tap_context(self, ctx: Any, drained: list[int]) -> Any:
        """The prefill's tap context over the whole ``drained``: the saved rows, then the new ones."""
        from engine.seam import TapContext

        if not self.target_prefix:
            return ctx
        saved = self.hidden or {}
        n = self.target_prefix
        hidden = {}
        for i, h in ctx.hidden.items():
            if i not in saved or int(saved[i].shape[0]) != n:
                have = None if i not in saved else int(saved[i].shape[0])
                raise PromptCacheError(
                    f"request {self.request}: fetch: target tap layer {i}: {have} saved rows for "
                    f"{n} reused positions: a hole")
            hidden[i] = mx.concatenate([saved[i], h], axis=0)
        return TapContext(tokens=list(drained), hidden=hidden)

    def after_prefill(self, caches: list[Any], source: Any, ctx: Any = None) -> None:
        self.prefill_target = copy_caches(caches)
        own = self.session.drafter_caches(source)
        self.prefill_drafter = None if own is None else copy_caches(own)
        if ctx is not None:
            self.prefill_hidden = dict(ctx.hidden)
            self.rows = {i: [h] for i, h in ctx.hidden.items()}

    def after_round(self, ctx: Any, k: int) -> None:
        if self.rows is None:
            return
        if ctx is None:
            self.untapped_rounds += 1
            return
        for i, parts in self.rows.items():
            parts.append(ctx.hidden[i][: k + 1])

    def record(self) -> dict[str, Any]:
        return {
            "target_reused": self.target_prefix,
            "drafter_reused": self.drafter_prefix,
            "entry": None if self.entry is None else
            f"request {self.entry.target.request} {self.entry.target.boundary}",
            "refused": "; ".join(self.refused) if self.refused else None,
        }


@dataclass
class CacheSnapshots:
    """Copies of one request's caches at the points warm and cold are compared (``keep_caches``).

    ``start_*``: what the request started from (the reused prefix; None: fresh caches);
    ``prefill_*``: after its prefill; ``end_*``: after its last round. ``drained`` is the
    prompt part the prefill covers, ``target_prefix``/``drafter_prefix`` how much of it the
    start caches held. Drafter entries are None for a source whose caches are not saved.
    """

    drained: list[int]
    target_prefix: int = 0
    drafter_prefix: int | None = None
    start_target: list[Any] | None = None
    start_drafter: list[Any] | None = None
    prefill_target: list[Any] | None = None
    prefill_drafter: list[Any] | None = None
    end_target: list[Any] | None = None
    end_drafter: list[Any] | None = None


@dataclass
class Turn:
    """One request of a session: the executor's result and what was reused."""

    index: int
    prompt: list[int]
    result: GenerationResult
    reuse: dict[str, Any]
    ttft_s: float | None
    caches: CacheSnapshots | None = None  # keep_caches: the snapshots engine.cache_compare compares


class PromptCacheSession:
    """Speculative requests sharing saved target and drafter caches (module docstring).

    ``generate(prompt_ids, params)`` fetches the longest usable prefix, runs
    ``spec_generate`` on it, and saves the two boundaries. ``max_entries``
    bounds the saved entries (least recently used dropped first). ``keep_caches``
    (set it on the instance): every ``Turn`` carries its ``CacheSnapshots``.
    """

    keep_caches = False
    # False where the backend is not bit-exact (engine.backend.arithmetic): every split of a
    # prefill changes the cache bytes there, so the byte probe (split_profile) is skipped and
    # reuse splits anywhere; warm ≡ cold is then judged within a calibrated tolerance.
    exact_arithmetic = True

    def __init__(self, target_model: Any, provider: DraftProvider, *, max_entries: int = 8,
                 enabled: bool = True) -> None:
        self.model = target_model
        self.provider = provider
        self.kind = str(getattr(provider, "kind", "?"))
        self.max_entries = max_entries
        self.enabled = enabled
        self.entries: list[Entry] = []
        self.requests = 0
        self.last_source: Any = None

    def prefill_mode(self, params: GenerationParams) -> str:
        from engine.sources.kind import find

        desc = find(self.kind)
        return params.prefill or (desc.prefill if desc is not None else "tail-split")

    def saves(self) -> bool:
        """Whether this session's source leaves state the session can save (or re-derive)."""
        return reuse_family(self.kind) is not None

    def run(self, prompt_ids: list[int], params: GenerationParams, tick: OnToken, caches: list[Any],
            f: Fetch) -> tuple[GenerationResult, Any]:
        """The request on the fetched ``caches``: its result and the source it opened."""
        holder: list[Any] = []
        provider = _Capture(self.provider, holder)
        result = spec_generate(self.model, provider, prompt_ids, params, on_token=tick,
                               target_caches=caches, reuse=f)
        return result, holder[0] if holder else None

    # -- hooks a subclass (a planted bug, another source) may override
    def drafter_caches(self, source: Any) -> list[Any] | None:
        """The source's own caches, when the session saves them (two-model)."""
        return source.caches if reuse_family(self.kind) == "segment" else None

    def install_drafter(self, source: Any, seg: Segment, n: int, fetch: Fetch) -> None:
        """Put ``seg`` cut to ``n`` positions into ``source`` (same list object: the source's
        per-layer flags were computed from caches of the same model)."""
        source.caches[:] = trim_to(seg, n)

    def save(self, entry: Entry) -> None:
        for seg in (entry.target, entry.drafter):
            if seg is not None:
                check_segment(seg, len(seg.key), "save")
        self.entries.append(entry)
        while len(self.entries) > self.max_entries:
            self.entries.pop(0)

    # -- the request
    def fetch(self, prompt_ids: Sequence[int], params: GenerationParams) -> tuple[Fetch, list[Any]]:
        from mlx_lm.models.cache import make_prompt_cache

        index = self.requests
        full = self.prefill_mode(params) == "full"
        # tail-split: the last prompt token heads the first window; full: the prefill's own last
        # forward gives the first token, so at least one prompt token is always prefilled
        drained = list(prompt_ids) if full else list(prompt_ids[:-1])
        cap = len(drained) - 1 if full else len(drained)
        f = Fetch(self, index, drained)
        if not self.enabled:
            return f, make_prompt_cache(self.model)
        if not self.saves():
            f.refused.append(f"the {self.kind} source keeps state the session cannot save: cold prefill")
            return f, make_prompt_cache(self.model)
        tsplit = split_profile(self.model, prompt_ids) if self.exact_arithmetic else "exact"
        dmodel = getattr(self.provider, "model", None) if reuse_family(self.kind) == "segment" else None
        dsplit = split_profile(dmodel, prompt_ids) if dmodel is not None and self.exact_arithmetic else "exact"
        if tsplit == "none":
            f.refused.append("the target's caches depend on how a prefill is split: no reuse")
            return f, make_prompt_cache(self.model)
        if tsplit == "multi" or dsplit == "multi":
            cap = min(cap, len(drained) - 2)  # never a one-token suffix forward
        best: tuple[int, int, int] = (0, 0, -1)
        missed: list[tuple[int, str]] = []  # (prefix it shares, why it gives less)
        for j, e in enumerate(self.entries):
            nt, why = e.target.usable(drained[:max(cap, 0)])
            if reuse_family(self.kind) == "tapped" and e.target.hidden is None:
                nt, why = 0, "saved without the tapped hidden rows"
            if nt and tsplit == "multi" and e.target.one_token_forwards:
                nt, why = 0, ("target segment written by one-token forwards; this target's one-token "
                              "forward is not its prefill's arithmetic (split_profile 'multi')")
            if why:
                missed.append((common_prefix(e.target.key, drained),
                               f"request {e.target.request} {e.target.boundary}: {why}"))
            nd = 0
            if e.drafter is not None and nt and not (dsplit != "exact" and e.drafter.one_token_forwards):
                nd, dwhy = e.drafter.usable(drained[:max(cap, 0)])
                if dwhy:
                    missed.append((min(nt, common_prefix(e.drafter.key, drained)),
                                   f"request {e.drafter.request} {e.drafter.boundary}: {dwhy}"))
            if (nt, nd) > best[:2]:
                best = (nt, nd, j)
        nt, nd, j = best
        # Only the refusals that cost something: an entry sharing more than what is reused.
        f.refused = list(dict.fromkeys(w for n, w in sorted(missed, key=lambda m: -m[0]) if n > nt))[:3]
        if j < 0 or nt == 0:
            return f, make_prompt_cache(self.model)
        e = self.entries.pop(j)
        self.entries.append(e)  # most recently used last
        for seg, n in ((e.target, nt), (e.drafter, nd)):
            if seg is not None and n and tuple(seg.key[:n]) != tuple(drained[:n]):
                raise PromptCacheError(
                    f"request {index}: fetch: {seg.name} segment (request {seg.request} {seg.boundary}) "
                    f"key differs from the prompt within the {n} reused positions")
        f.entry, f.target_prefix = e, nt
        if reuse_family(self.kind) == "segment":
            f.drafter, f.drafter_prefix = e.drafter, nd
        if e.target.hidden is not None:
            f.hidden = {i: h[:nt] for i, h in e.target.hidden.items()}
        caches = trim_to(e.target, nt)
        check_segment(Segment("target", tuple(drained[:nt]), caches, "fetch", index), nt, "fetch")
        return f, caches

    def generate(self, prompt_ids: Sequence[int], params: GenerationParams, *,
                 on_token: OnToken | None = None) -> Turn:
        index = self.requests
        t0 = time.perf_counter()
        first: list[float] = []

        def tick(t: int) -> bool | None:
            if not first:
                first.append(time.perf_counter() - t0)
            return on_token(t) if on_token is not None else None

        f, caches = self.fetch(prompt_ids, params)
        start = copy_caches(caches) if self.keep_caches and f.target_prefix else None
        result, source = self.run(list(prompt_ids), params, tick, caches, f)
        self.requests += 1
        self.last_source = source
        snaps = None
        if self.keep_caches:
            own = self.drafter_caches(source) if source is not None else None
            snaps = CacheSnapshots(  # copies: the saved entries may be changed later (trimmed, a plant)
                list(f.drained), f.target_prefix, f.drafter_prefix, start, f.start_drafter,
                None if f.prefill_target is None else copy_caches(f.prefill_target),
                None if f.prefill_drafter is None else copy_caches(f.prefill_drafter),
                copy_caches(caches), None if own is None else copy_caches(own))
        if self.enabled and self.saves():
            self._save_turn(index, list(prompt_ids), f, caches, source, result)
        return Turn(index, list(prompt_ids), result, f.record(), first[0] if first else None, snaps)

    def _save_turn(self, index: int, prompt: list[int], f: Fetch, caches: list[Any], source: Any,
                   result: GenerationResult) -> None:
        drained = f.drained
        tapped = reuse_family(self.kind) == "tapped"
        if f.prefill_target is not None and (f.prefill_hidden is not None or not tapped):
            dpre = None
            if f.prefill_drafter is not None:
                dpre = Segment("drafter", tuple(drained), f.prefill_drafter, "prefill", index)
            self.save(Entry(Segment("target", tuple(drained), f.prefill_target, "prefill", index,
                                    hidden=f.prefill_hidden), dpre))
        stream = stream_tokens(prompt, result.records)
        decoded = len(stream) > len(prompt)
        tn = held(caches)
        if tn is None:
            return  # no layer says how many positions it holds: nothing to key it by
        if tn > len(stream):
            raise PromptCacheError(
                f"request {index}: save: target holds {tn} positions, the stream has {len(stream)}")
        hidden = None
        if tapped:
            if f.rows is None or f.untapped_rounds:
                return  # plain steps (the ring guard, §6) fed positions no tap saw
            hidden = {i: mx.concatenate(parts, axis=0) for i, parts in f.rows.items()}
            if any(int(h.shape[0]) != tn for h in hidden.values()):
                return  # positions no tap saw (a plain fallback): nothing exact to save
        # a verify window of one position (no drafts) or a plain step is a one-token forward
        one = any(r["type"] == "plain" or (r["type"] == "round" and not r["drafts"]) for r in result.records)
        target = Segment("target", tuple(stream[:tn]), copy_caches(caches), "end", index,
                         wrapped_in_decode=decoded, hidden=hidden, one_token_forwards=one)
        drafter = None
        own = self.drafter_caches(source) if source is not None else None
        if own is not None:
            dn = held(own)
            if dn is not None and dn <= len(stream):
                drafter = Segment("drafter", tuple(stream[:dn]), copy_caches(own), "end", index,
                                  wrapped_in_decode=decoded, one_token_forwards=decoded)  # drafting steps
        self.save(Entry(target, drafter))


class _Capture:
    """The provider, remembering the source it opened (the session saves its caches)."""

    def __init__(self, provider: DraftProvider, holder: list[Any]) -> None:
        self.provider = provider
        self.kind = provider.kind
        self.holder = holder

    def __getattr__(self, name: str) -> Any:
        return getattr(self.provider, name)

    def open(self, sampler: Any, target: Any) -> Any:
        source = self.provider.open(sampler, target)
        self.holder.append(source)
        return source


class ColdCapture:
    """The executor's ``reuse`` hooks for a COLD run (nothing reused): its ``CacheSnapshots``.

    ``cold(..., reuse=ColdCapture())`` runs exactly as without it (``target_prefix`` 0, the
    source opened fresh, the tap context untouched); it copies the caches after the prefill
    and, on ``snapshots()``, at the end. ``segment``: the source's own caches are a session
    segment (two-model), so they are captured too.
    """

    target_prefix = 0
    drafter_prefix: int | None = None

    def __init__(self, segment: bool = False) -> None:
        self.segment = segment
        self.source: Any = None
        self.caches: list[Any] | None = None
        self.drained: list[int] = []
        self.prefill_target: list[Any] | None = None
        self.prefill_drafter: list[Any] | None = None

    def open_source(self, source: Any) -> int:
        self.source = source
        return 0

    def tap_context(self, ctx: Any, drained: list[int]) -> Any:
        return ctx

    def after_prefill(self, caches: list[Any], source: Any, ctx: Any = None) -> None:
        self.caches = caches
        self.prefill_target = copy_caches(caches)
        if self.segment and source is not None:
            self.prefill_drafter = copy_caches(source.caches)

    def after_round(self, ctx: Any, k: int) -> None:
        return None

    def record(self) -> None:
        return None

    def snapshots(self, drained: Sequence[int]) -> CacheSnapshots:
        end_d = copy_caches(self.source.caches) if self.segment and self.source is not None else None
        return CacheSnapshots(list(drained), 0, None, None, None, self.prefill_target, self.prefill_drafter,
                              None if self.caches is None else copy_caches(self.caches), end_d)


def cold(target_model: Any, provider: DraftProvider, prompt_ids: Sequence[int],
         params: GenerationParams, *, on_token: OnToken | None = None,
         reuse: Any = None) -> tuple[GenerationResult, float | None]:
    """The cold run a warm request is held to: fresh caches, the whole prompt prefilled
    (``reuse``: a ``ColdCapture`` taking its cache snapshots)."""
    from mlx_lm.models.cache import make_prompt_cache

    t0 = time.perf_counter()
    first: list[float] = []

    def tick(t: int) -> bool | None:
        if not first:
            first.append(time.perf_counter() - t0)
        return on_token(t) if on_token is not None else None

    res = spec_generate(target_model, provider, list(prompt_ids), params, on_token=tick,
                        target_caches=make_prompt_cache(target_model), reuse=reuse)
    return res, first[0] if first else None


class PlainPromptCacheSession(PromptCacheSession):
    """The same prompt cache under plain (non-speculative) decode: the control arm.

    One segment per entry (the target's), saved at the same two boundaries, keyed by
    the stream cut to its offset and held to the same invariants (``check_segment``
    after every save and fetch, the key check on every fetch) and reuse rules
    (``Segment.reuse_rule``, ``split_profile``). It runs ``plain_generate(reuse=...)``
    where ``PromptCacheSession`` runs ``spec_generate``; every decode step is a
    one-token forward, so a ``multi`` target reuses only its prefill boundaries.
    """

    def __init__(self, target_model: Any, provider: Any = None, *, max_entries: int = 8,
                 enabled: bool = True) -> None:
        super().__init__(target_model, _NoSource(), max_entries=max_entries, enabled=enabled)
        self.kind = PLAIN

    def prefill_mode(self, params: GenerationParams) -> str:
        return params.prefill or "tail-split"  # plain_generate's

    def saves(self) -> bool:
        return True

    def drafter_caches(self, source: Any) -> list[Any] | None:
        return None

    def run(self, prompt_ids: list[int], params: GenerationParams, tick: OnToken, caches: list[Any],
            f: Fetch) -> tuple[GenerationResult, Any]:
        return plain_generate(self.model, prompt_ids, params, on_token=tick, target_caches=caches,
                              reuse=f), None


PLAIN = "plain"


class _NoSource:
    """Stands for the provider of a plain session (there is no drafter)."""

    kind = PLAIN

    def open(self, sampler: Any, target: Any) -> Any:
        raise PromptCacheError("a plain session has no drafter to open")


def cold_plain(target_model: Any, prompt_ids: Sequence[int], params: GenerationParams, *,
               on_token: OnToken | None = None, reuse: Any = None) -> tuple[GenerationResult, float | None]:
    """The cold run a warm plain request is held to: fresh caches, the whole prompt prefilled
    (passed as ``target_caches`` like the warm run's, so both take the same decode loop;
    ``reuse``: a ``ColdCapture`` taking its cache snapshots)."""
    from mlx_lm.models.cache import make_prompt_cache

    t0 = time.perf_counter()
    first: list[float] = []

    def tick(t: int) -> bool | None:
        if not first:
            first.append(time.perf_counter() - t0)
        return on_token(t) if on_token is not None else None

    res = plain_generate(target_model, list(prompt_ids), params, on_token=tick,
                         target_caches=make_prompt_cache(target_model), reuse=reuse)
    return res, first[0] if first else None
