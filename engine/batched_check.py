"""Checks of the batched executor (``engine.batched``): row ≡ serial, and the three invariances.

References: ``../shared/reference/speculative-decoding.md`` §2 (a row's output is its serial
run's: the target's own samples, the same rounds); vLLM's
``tests/v1/e2e/spec_decode/test_stochastic_batch_invariance.py`` (seeded T > 0, forced
preemption: serial token ids ≡ batched) and vLLM RFC #54506 (M = 1 vs M = k + 1 for the
same row), which nothing on MLX asserts.

- :func:`compare_row` — a batched row's result against its serial run (``spec_generate`` on
  the request alone), record for record (every field but ``time_s``) then the footer; the
  first divergence names the row, the batch step, the row's round and the rows present.
- **M** (:func:`m_invariance`) — every verify row of the batched forward against one-token
  decode of the same prefix, in ULPs of float32 (0 on the CPU: bitwise). On a backend that is
  not bit-exact (the CPU double ``engine.nonexact``) the rows differ; the difference is
  ``numerics`` only with evidence: the prefix is the same (the replay's cache digest equals
  the row's recorded ``target_cache_digest`` after every round), the batched blocks
  reproduce when the batch is re-run, and every |Δ| is within the backend's stated bound.
- **B** (:func:`b_invariance`) — a row's tokens and rounds do not change when batch-mates
  join, leave or are preempted: the row run alone (a batch of one) against the same row in
  the mixed batch. A token flip is ``numerics`` only with evidence (the prefixes agree,
  both runs reproduce on a re-run, the two paths' rows at the flip differ within the bound
  and each run's pick is its own row's top choice on a knife-edge); otherwise ``logic``.
- **seeded** (:func:`seeded_invariance`) — a sampled row keyed per (request, position)
  (``rng="position"``) emits plain decode's tokens (the stream is fixed per position, so
  neither drafts nor batch-mates move it) and the same tokens alone and batched.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from engine.batched import BatchRequest, BatchResult, batch_generate
from engine.executor import GenerationResult, plain_generate, spec_generate

__all__ = ["ARITHMETIC_FIELDS", "FIELD_ORDER", "Invariance", "RowDivergence", "RowJudge", "RowVerdict", "BlockRecorder",
           "b_invariance", "backend_bound", "check_rows", "classify_row", "compare_row", "logit_spread", "m_invariance",
           "seeded_invariance", "serial_flip", "serial_results", "step_of", "ulp_distance"]

# A record's fields in the order a divergence is named (the earliest cause first).
FIELD_ORDER = ("type", "index", "feed", "drafts", "window", "samples", "margins", "k_accept", "emitted", "end",
               "target_tokens", "drafter_tokens", "input", "sample", "margin", "reason",
               "target_cache_digest", "drafter_cache_digest", "confidence", "grammar_masks", "grammar_state",
               "grammar_mask")
_IGNORED = {"time_s", "detail", "batch"}  # batch: where the row ran, not what it did
# Record fields that are pure arithmetic: byte-compared only where the backend is bit-exact (the
# same set as ``engine.cache_compare.ARITHMETIC_FIELDS``, warm ≡ cold's).
ARITHMETIC_FIELDS = frozenset({"target_cache_digest", "drafter_cache_digest", "margins", "margin", "confidence"})
# Fields in which a token flip first shows (the target's samples, what the walk emitted).
_TOKEN_FIELDS = ("samples", "emitted", "k_accept", "end", "sample", "output_ids")


@dataclass
class RowDivergence:
    """The first place a batched row differs from the run it is compared with."""

    row: str
    where: str  # "batch step S (round R)", "prefill", "serial lane: plain P", "footer"
    field: str
    batched: Any
    other: Any
    neighbours: list[str] = dataclasses.field(default_factory=list)
    step: int | None = None
    round: int | None = None
    against: str = "serial"

    @property
    def message(self) -> str:
        with_ = f"; rows present: {', '.join(self.neighbours) or 'none'}" if self.step is not None else ""
        return (f"row {self.row}: {self.where}{with_}: {self.field}: batched {_short(self.batched)} != "
                f"{self.against} {_short(self.other)}")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 160 else text[:157] + "..."


def step_of(steps: list[dict[str, Any]], rid: str, round_index: int) -> dict[str, Any] | None:
    """The batch step in which row ``rid`` ran its round ``round_index`` (None: not batched)."""
    for st in steps:
        for e in st.get("rows", []):
            if e["row"] == rid and e["round"] == round_index:
                return {"step": st["index"], **e}
    return None


def _where(steps: list[dict[str, Any]], rid: str, rec: dict[str, Any]) -> tuple[str, int | None, int | None,
                                                                                 list[str]]:
    kind = rec.get("type")
    if kind == "round":
        at = step_of(steps, rid, int(rec["index"]))
        if at is None:
            return f"serial lane round {rec['index']}", None, int(rec["index"]), []
        return f"batch step {at['step']} (round {rec['index']})", at["step"], int(rec["index"]), list(at["neighbours"])
    if kind == "plain":
        return f"serial lane: plain step {rec['index']}", None, None, []
    return str(kind), None, None, []


def _first_field(a: dict[str, Any], b: dict[str, Any], ignore: frozenset[str] = frozenset()) -> str | None:
    keys = [k for k in FIELD_ORDER if k in a or k in b]
    keys += sorted(k for k in set(a) | set(b) if k not in keys and k not in _IGNORED)
    for k in keys:
        if k in _IGNORED or k in ignore:
            continue
        if a.get(k) != b.get(k):
            return k
    return None


def compare_row(rid: str, batched: GenerationResult, other: GenerationResult, steps: list[dict[str, Any]],
                against: str = "serial", *, records: bool = True,
                ignore: frozenset[str] = frozenset()) -> RowDivergence | None:
    """The first divergence of a batched row from ``other`` (None: identical).

    ``records``: compare record for record (the serial run); False: tokens, rounds' ``k_accept``
    and the footer only (a run of another shape, e.g. the row alone vs mixed). ``ignore``: record
    fields left out (:data:`ARITHMETIC_FIELDS` off a bit-exact backend).
    """
    ra, rb = batched.records, other.records
    if records:
        for i in range(max(len(ra), len(rb))):
            a = ra[i] if i < len(ra) else {"type": None}
            b = rb[i] if i < len(rb) else {"type": None}
            f = _first_field(a, b, ignore)
            if f is not None:
                where, step, rnd, nbrs = _where(steps, rid, a if a.get("type") else b)
                return RowDivergence(rid, where, f, a.get(f), b.get(f), nbrs, step, rnd, against)
    else:
        rounds_a = [r for r in ra if r["type"] == "round"]
        rounds_b = [r for r in rb if r["type"] == "round"]
        for a, b in zip(rounds_a, rounds_b, strict=False):
            for f in ("emitted", "k_accept", "end"):
                if a.get(f) != b.get(f):
                    where, step, rnd, nbrs = _where(steps, rid, a)
                    return RowDivergence(rid, where, f, a.get(f), b.get(f), nbrs, step, rnd, against)
    for f, x, y in (("output_ids", batched.output_ids, other.output_ids),
                    ("usage", batched.usage.to_dict(), other.usage.to_dict()),
                    ("speculation", None if batched.speculation is None else batched.speculation.to_dict(),
                     None if other.speculation is None else other.speculation.to_dict())):
        if x != y:
            return RowDivergence(rid, "footer", f, x, y, against=against)
    return None


def serial_results(model: Any, requests: list[BatchRequest]) -> dict[str, GenerationResult]:
    """Each request run alone through the serial executor (``spec_generate``)."""
    return {r.rid: spec_generate(model, r.provider, r.prompt_ids, r.params) for r in requests}


def check_rows(model: Any, requests: list[BatchRequest], result: BatchResult,
               serial: dict[str, GenerationResult] | None = None) -> list[RowDivergence]:
    """Every row of ``result`` against its serial run; the divergences (empty: every row ≡ serial)."""
    serial = serial if serial is not None else serial_results(model, requests)
    out = []
    for r in requests:
        div = compare_row(r.rid, result.rows[r.rid], serial[r.rid], result.steps)
        if div is not None:
            out.append(div)
    return out


# ---------------------------------------------------------------------- the invariances


@dataclass
class Invariance:
    """One invariance's verdict for one engine: ``holds`` (bitwise / token for token),
    ``numerics`` (a difference the evidence explains), ``logic`` (a bug), ``n/a``."""

    name: str
    verdict: str
    detail: str
    evidence: list[str] = dataclasses.field(default_factory=list)
    checked: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict, "detail": self.detail, "evidence": self.evidence,
                "checked": self.checked}


def ulp_distance(a: float, b: float) -> int:
    """float32 units in the last place between ``a`` and ``b`` (0: bitwise equal)."""

    def ordered(x: float) -> int:
        i = struct.unpack("<i", struct.pack("<f", x))[0]
        return i if i >= 0 else -(i & 0x7FFFFFFF)

    return abs(ordered(a) - ordered(b))


class BlockRecorder:
    """A ``BatchObserver`` keeping every row's verify block (float32, on the host) and, with
    ``caches``, a copy of every row's caches after each of its rounds (``after_round``)."""

    def __init__(self, caches: bool = False) -> None:
        self.blocks: dict[tuple[str, int], tuple[int, list[int], Any]] = {}
        self.caches: dict[tuple[str, int], list[Any]] = {}
        self._keep = caches

    def after_verify(self, step: int, rid: str, round_index: int, window: list[int], block: mx.array) -> None:
        import numpy as np

        self.blocks[(rid, round_index)] = (step, list(window), np.array(block.astype(mx.float32)))

    def after_round(self, step: int, rid: str, round_index: int, caches: list[Any]) -> None:
        if self._keep:
            from engine.audit import clone_caches

            self.caches[(rid, round_index)] = clone_caches(caches)


def _max_ulp(a: Any, b: Any) -> float:
    """Largest |a - b| in float32 ULPs at the row's scale (the spacing of its largest |logit|):
    entry-wise ULP counts explode near zero, where a tiny absolute difference spans many."""
    import numpy as np

    scale = float(np.max(np.abs(a))) if a.size else 0.0
    spacing = float(np.spacing(np.float32(max(scale, 1e-30))))
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) / spacing if a.size else 0.0


def _decode_rows(model: Any, caches: list[Any], tokens: list[int]) -> list[Any]:
    import numpy as np

    rows = []
    for t in tokens:
        row = model(mx.array([t], mx.uint32)[None], cache=caches)[0, -1, :]
        mx.eval(row)
        rows.append(np.array(row.astype(mx.float32)))
    return rows


def _last_row(model: Any, tokens: list[int], sizes: list[int]) -> Any:
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    caches, pos, row = make_prompt_cache(model), 0, None
    for n in sizes:
        row = model(mx.array(tokens[pos : pos + n], mx.uint32)[None], cache=caches)[0, -1, :]
        pos += n
    assert row is not None
    return np.array(row.astype(mx.float32))


def logit_spread(model: Any, tokens: list[int], gamma: int) -> float:
    """The largest |Δ| of the last logit row of ``tokens`` between correct forward paths of this
    backend: one forward, one token at a time, chunks of 2 and of γ + 1 (0 where bit-exact): what
    its arithmetic alone moves a row by, the cache writes' reach included (the logit analogue of
    ``engine.cache_compare.calibrate``)."""
    import numpy as np

    if len(tokens) < 2:
        return 0.0
    ref = _last_row(model, tokens, [len(tokens)])
    worst = 0.0
    for w in dict.fromkeys((1, 2, gamma + 1)):
        sizes = [w] * (len(tokens) // w) + ([len(tokens) % w] if len(tokens) % w else [])
        worst = max(worst, float(np.max(np.abs(_last_row(model, tokens, sizes) - ref))))
    return worst


def m_invariance(model: Any, requests: list[BatchRequest], run: Callable[[BatchRequest | None], Any] | None = None,
                 *, budget: float = 0.0, max_rounds: int | None = None) -> Invariance:
    """M: each batched verify row against one-token decode of the same prefix (module docstring).

    ``budget``: the stated bound on |batched row - one-token row| of this backend (0 on the CPU:
    bitwise; the double's logit noise scale under ``engine.nonexact``).
    """
    import numpy as np

    from engine.audit import clone_caches
    from engine.cache_compare import calibrate, check_caches
    from engine.caches import cache_digest
    from engine.stream import SPEC_PREFILL_STEP, prefill_chunks

    rec = BlockRecorder(caches=budget > 0)
    result = batch_generate(model, requests, observer=rec)
    again = BlockRecorder()
    batch_generate(model, requests, observer=again)
    from mlx_lm.models.cache import make_prompt_cache

    worst_ulp, worst_abs, checked = 0.0, 0.0, 0
    where = ""
    evidence: list[str] = []
    same_prefix = True
    cache_rounds, closest, ratio, tol, spread = 0, "", -1.0, None, 0.0
    judged: list[tuple[float, float, str, list[int]]] = []  # (|Δ|, ULP, where, the row's tokens up to it)
    for r in requests:
        rounds = [x for x in result.rows[r.rid].records if x["type"] == "round"]
        caches = make_prompt_cache(model)
        step_size = r.params.prefill_step_size or SPEC_PREFILL_STEP
        prefill_chunks(model, caches, r.prompt_ids[:-1], step_size)
        if budget > 0:  # off a bit-exact backend: caches within the calibrated bound, not byte-equal
            drained = r.prompt_ids[:-1] if len(r.prompt_ids) > 1 else r.prompt_ids
            tol = calibrate(model, drained, 0, step_size, r.params.gamma)[0]
            spread = max(spread, logit_spread(model, list(r.prompt_ids), r.params.gamma))
        seq = list(r.prompt_ids[:-1])  # the tokens one-token decode has consumed before the round
        for i, x in enumerate(rounds):
            if max_rounds is not None and i >= max_rounds:
                break
            key = (r.rid, int(x["index"]))
            if key not in rec.blocks:
                break  # the row left for the serial lane
            step, window, block = rec.blocks[key]
            if not np.array_equal(block, again.blocks[key][2]):
                return Invariance("M", "logic", f"row {r.rid}: batch step {step} (round {x['index']}): the batched "
                                  "verify block does not reproduce when the batch is re-run", checked=checked)
            k = int(x["k_accept"])
            kept = _decode_rows(model, caches, window[: k + 1])
            tail = _decode_rows(model, clone_caches(caches), window[k + 1 :]) if k + 1 < len(window) else []
            for pos, one in enumerate(kept + tail):
                u, a = _max_ulp(block[pos], one), float(np.max(np.abs(block[pos] - one)))
                checked += 1
                here = f"row {r.rid}: batch step {step} (round {x['index']}) position {pos}"
                if budget > 0 and a > budget:
                    judged.append((a, u, here, seq + list(window[: pos + 1])))
                if u > worst_ulp:
                    worst_ulp, worst_abs = u, a
                    where = here
            seq += list(window[: k + 1])
            digest = x.get("target_cache_digest")
            if tol is not None and key in rec.caches:
                chk = check_caches(rec.caches[key], caches, tol, f"batch step {step} (round {x['index']})",
                                   ("batched", "one-token decode"))
                if not chk.ok:
                    return Invariance("M", "logic", f"row {r.rid}: batch step {step} (round {x['index']}): the row's "
                                      f"cache after the round is not one-token decode's cache of the kept prefix: "
                                      f"{chk.error}", [tol.describe()], checked=checked)
                cache_rounds += 1
                if chk.ratio > ratio:
                    ratio, closest = chk.ratio, f"row {r.rid}: batch step {step} (round {x['index']}): {chk.worst}"
            elif digest is not None and cache_digest(caches)["combined"] != digest["combined"]:
                same_prefix = False
                return Invariance("M", "logic", f"row {r.rid}: batch step {step} (round {x['index']}): the row's "
                                  "cache after the round is not one-token decode's cache of the kept prefix",
                                  checked=checked)
    if worst_ulp == 0:
        return Invariance("M", "holds", f"bitwise: {checked} verify rows equal one-token decode (0 ULP)",
                          checked=checked)
    evidence.append(f"largest difference at {where}: {worst_ulp:.3g} ULP at the row's scale, |Δ| {worst_abs:.3g}")
    evidence.append("every batched block reproduced on a re-run of the same batch")
    if tol is not None:
        evidence.append(f"same prefix within the calibrated bound: every row's caches after {cache_rounds} rounds vs "
                        f"one-token decode of the kept prefix (closest: {closest or 'byte-equal'}); {tol.describe()}")
    elif same_prefix:
        evidence.append("same prefix: the replay's cache digest equals the row's after every round")
    limit, said = budget, "the stated bound"
    if 2 * spread > budget:  # the arithmetic measured between correct paths reaches further
        limit, said = 2 * spread, f"2 × the |Δ| {spread:.3g} measured between correct forward paths of the prompts"
    if worst_abs <= limit:
        return Invariance("M", "numerics", f"{checked} verify rows within {said} |Δ| <= {limit:.3g} "
                          f"(largest {worst_abs:.3g}, {worst_ulp:.3g} ULP)", evidence, checked)
    if budget <= 0:  # bit-exact backend: any difference is a bug
        return Invariance("M", "logic", f"{where}: |Δ| {worst_abs:.3g} beyond {said} {limit:.3g} "
                          f"({worst_ulp:.3g} ULP)", evidence, checked)
    # A row beyond the prompts' spread is weighed against the spread of ITS OWN tokens at that depth:
    # a recurrent state (gated DeltaNet) carries the arithmetic of every earlier round, so a GPU's
    # correct paths drift further at round 3 than at the prompt. Structural (logic) only when the
    # row's |Δ| is beyond 2 × what correct forward paths of the very same tokens differ by.
    gamma = max((r.params.gamma for r in requests), default=1)
    local: dict[int, float] = {}
    worst_local = (0.0, 0.0, "", 0.0)
    for a, u, here, toks in sorted((j for j in judged if j[0] > limit), key=lambda j: -j[0]):
        if len(toks) not in local:
            local[len(toks)] = logit_spread(model, toks, gamma)
        own = local[len(toks)]
        if a > 2 * own:
            return Invariance("M", "logic", f"{here}: |Δ| {a:.3g} beyond {said} {limit:.3g} and beyond 2 × the "
                              f"|Δ| {own:.3g} measured between correct forward paths of the row's own "
                              f"{len(toks)} tokens ({u:.3g} ULP)", evidence, checked)
        if a / max(2 * own, 1e-30) > worst_local[0] / max(2 * worst_local[3], 1e-30):
            worst_local = (a, u, here, own)
    a, u, here, own = worst_local
    evidence.append(f"{len(local)} row(s) beyond {said} weighed at their own depth: each within 2 × the |Δ| "
                    f"measured between correct forward paths of its own tokens (closest: {here}: |Δ| {a:.3g} "
                    f"<= 2 × {own:.3g})")
    return Invariance("M", "numerics", f"{checked} verify rows within the arithmetic measured at their depth "
                      f"(largest {worst_abs:.3g}, {worst_ulp:.3g} ULP; {said} {limit:.3g})", evidence, checked)


def _alone(r: BatchRequest) -> BatchRequest:
    return BatchRequest(r.rid, r.prompt_ids, r.params, r.provider, arrive=0, pause=None, on_token=r.on_token)


def _row_blocks(model: Any, requests: list[BatchRequest], rid: str) -> dict[int, Any]:
    """Row ``rid``'s verify blocks (round -> float32 rows) in a batched run of ``requests``."""
    rec = BlockRecorder()
    batch_generate(model, requests, observer=rec)
    return {rnd: block for (row, rnd), (_step, _w, block) in rec.blocks.items() if row == rid}


class _SerialBlocks:
    """A ``RoundObserver`` keeping the serial executor's verify blocks (float32, host)."""

    observing = True

    def __init__(self) -> None:
        self.blocks: dict[int, Any] = {}

    def before_verify(self, index: int, window: list[int], caches: list[Any]) -> None:
        return None

    def after_verify(self, index: int, window: list[int], block: mx.array, caches: list[Any]) -> None:
        import numpy as np

        self.blocks[index] = np.array(block.astype(mx.float32))

    def after_rollback(self, index: int, k_accept: int, caches: list[Any]) -> None:
        return None


def _serial_blocks(model: Any, r: BatchRequest) -> dict[int, Any]:
    obs = _SerialBlocks()
    spec_generate(model, r.provider, r.prompt_ids, r.params, observer=obs)
    return obs.blocks


def emitted_before(records: list[dict[str, Any]], round_index: int) -> int:
    """Tokens a run emitted before its round ``round_index`` (the output position of the round's
    first window row)."""
    n = 0
    for x in records:
        if x.get("type") == "round":
            if int(x["index"]) >= round_index:
                break
            n += len(x.get("emitted") or [])
        elif x.get("type") == "plain":
            n += 1
    return n


def _redraw(r: BatchRequest, row: Any, position: int) -> int | None:
    """The token a position-keyed sampled row draws from logit ``row`` at output ``position``
    (the row's own pipeline, ``engine.pipeline``); None where a draw cannot be replayed alone
    (processors or a grammar read a history)."""
    from engine.pipeline import SamplingPipeline

    pipe = SamplingPipeline(r.params, r.prompt_ids, seed_stream=False)
    if not pipe.positional or pipe.history is not None or pipe.matcher is not None:
        return None
    return int(cast(int, pipe.sample(mx.array(row)[None], position=position, mask=None).reshape(-1)[0].item()))


def _weigh(name: str, r: BatchRequest, div: RowDivergence, budget: float, checked: int,
           paths: tuple[Callable[[], dict[int, Any]], Callable[[], dict[int, Any]]], what: str,
           before: int | None = None) -> Invariance:
    """A row's token flip between two runs: ``numerics`` only with evidence (both runs' blocks at
    the contested round reproduce on a re-run, they differ within the stated bound, and each run's
    token is its own row's draw: for a greedy row its top choice on a knife-edge no wider than that
    difference, for a sampled row keyed per position (``before``: tokens emitted before the round)
    the draw replayed at its position); otherwise ``logic`` (a sampled row keyed by one stream
    cannot be replayed at a position: its flip stays ``logic``)."""
    import numpy as np

    if budget <= 0 or div.round is None or div.field not in ("emitted", "samples"):
        return Invariance(name, "logic", div.message, checked=checked)
    first = [paths[0](), paths[1]()]
    again = [paths[0](), paths[1]()]
    if any(div.round not in x for x in first):
        return Invariance(name, "logic", div.message + " (no verify block to weigh)", checked=checked)
    a, b = first[0][div.round], first[1][div.round]
    reproduced = all(div.round in x and np.array_equal(x[div.round], y[div.round]) for x, y in zip(again, first,
                                                                                              strict=True))
    ea, eb = list(div.batched or []), list(div.other or [])
    pos = next((i for i, (x, y) in enumerate(zip(ea, eb, strict=False)) if x != y), min(len(ea), len(eb)))
    pos = min(pos, len(a) - 1, len(b) - 1)
    delta = float(np.max(np.abs(a[pos] - b[pos])))
    evidence = [div.message, f"re-runs reproduce both blocks: {reproduced}",
                f"window position {pos}: the two rows differ by |Δ| {delta:.3g} (bound {budget:g})"]
    ok = reproduced and delta <= 2 * budget
    if r.params.sampler.temperature == 0 and pos < len(ea) and pos < len(eb):
        top2 = [np.sort(x[pos])[-2:] for x in (a, b)]
        margins = [float(t[1] - t[0]) for t in top2]
        picks = [int(np.argmax(a[pos])) == ea[pos], int(np.argmax(b[pos])) == eb[pos]]
        evidence.append(f"each run's token is its own row's pick: {picks}; top-2 margins {margins[0]:.3g} / "
                        f"{margins[1]:.3g}")
        ok = ok and all(picks) and min(margins) <= 2 * delta
    elif pos < len(ea) and pos < len(eb):
        got = None if before is None else (_redraw(r, a[pos], before + pos), _redraw(r, b[pos], before + pos))
        if got is None or None in got:
            evidence.append("a sampled row whose draw cannot be replayed at its position (keyed by one stream, or "
                            "reading a history): the flip is not witnessed")
            ok = False
        else:
            picks = [got[0] == ea[pos], got[1] == eb[pos]]
            evidence.append(f"each run's token is its own row's draw at output position {(before or 0) + pos} (replayed "
                            f"with the position key): {picks}")
            ok = ok and all(picks)
    if ok:
        return Invariance(name, "numerics", f"row {r.rid} flips at {div.where}: arithmetic of {what} within "
                          f"the bound {budget:g}", evidence, checked)
    return Invariance(name, "logic", div.message, evidence, checked)


def _flip_verdict(name: str, model: Any, requests: list[BatchRequest], r: BatchRequest, div: RowDivergence,
                  budget: float, checked: int, records: list[dict[str, Any]]) -> Invariance:
    """A row's flip between the mixed batch and the row alone (:func:`_weigh`)."""
    return _weigh(name, r, div, budget, checked,
                  (lambda: _row_blocks(model, requests, r.rid), lambda: _row_blocks(model, [_alone(r)], r.rid)),
                  "the batch composition", emitted_before(records, div.round or 0))


def serial_flip(model: Any, requests: list[BatchRequest], rid: str, result: BatchResult,
                serial: GenerationResult | None = None, *, budget: float) -> Invariance | None:
    """A batched row whose tokens differ from its serial run (``spec_generate`` alone; run here
    when not given), weighed off a bit-exact backend (:func:`_weigh`: the batched forward vs the
    serial verify window at the flip); None when the tokens and rounds agree."""
    r = next(x for x in requests if x.rid == rid)
    serial = serial if serial is not None else spec_generate(model, r.provider, r.prompt_ids, r.params)
    div = compare_row(rid, result.rows[rid], serial, result.steps, "serial", records=False)
    if div is None:
        return None
    return _weigh("row", r, div, budget, 1,
                  (lambda: _row_blocks(model, requests, rid), lambda: _serial_blocks(model, r)),
                  "the batched forward vs the serial verify window",
                  emitted_before(result.rows[rid].records, div.round or 0))


def b_invariance(model: Any, requests: list[BatchRequest], result: BatchResult | None = None,
                 *, budget: float = 0.0) -> Invariance:
    """B: each row alone (a batch of one) against the same row in the mixed batch ``requests``."""
    result = result if result is not None else batch_generate(model, requests)
    divs = []
    for r in requests:
        alone = batch_generate(model, [_alone(r)])
        div = compare_row(r.rid, result.rows[r.rid], alone.rows[r.rid], result.steps, "alone", records=False)
        if div is not None:
            divs.append((r, div))
    moved = [r.rid for r in requests if r.arrive]
    what = (f"{len(requests)} rows, mixed batch (joining mid-flight: {', '.join(moved) or 'none'}; preempted: "
            f"{', '.join(r.rid for r in requests if r.pause) or 'none'}) vs each row alone")
    if not divs:
        return Invariance("B", "holds", f"token for token: {what}", checked=len(requests))
    r, div = divs[0]
    return _flip_verdict("B", model, requests, r, div, budget, len(requests), result.rows[r.rid].records)


def seeded_invariance(model: Any, requests: list[BatchRequest], result: BatchResult | None = None,
                      *, budget: float = 0.0) -> Invariance:
    """seeded: every sampled row draws from its own fixed stream: the same tokens batched and
    alone (a flip weighed as for B); keyed per (request, position) (``rng="position"``) they are
    also plain decode's tokens (on a bit-exact backend)."""
    result = result if result is not None else batch_generate(model, requests)
    sampled = [r for r in requests if r.params.sampler.temperature > 0 and r.params.seed is not None]
    if not sampled:
        return Invariance("seeded", "n/a", "no seeded sampled row")
    for r in sampled:
        alone = batch_generate(model, [_alone(r)])
        div = compare_row(r.rid, result.rows[r.rid], alone.rows[r.rid], result.steps, "alone", records=False)
        if div is not None:
            return _flip_verdict("seeded", model, requests, r, div, budget, len(sampled),
                                 result.rows[r.rid].records)
        if budget > 0 or r.params.sampler.rng != "position":
            continue  # plain decode: bit-exact backend, position keys only
        plain = plain_generate(model, r.prompt_ids, r.params)
        got = result.rows[r.rid].output_ids
        if got != plain.output_ids:
            i = next((j for j, (x, y) in enumerate(zip(got, plain.output_ids, strict=False)) if x != y),
                     min(len(got), len(plain.output_ids)))
            return Invariance("seeded", "logic", f"row {r.rid}: output position {i}: batched "
                              f"{got[i] if i < len(got) else None} != plain decode "
                              f"{plain.output_ids[i] if i < len(plain.output_ids) else None} (seed {r.params.seed})",
                              checked=len(sampled))
    keyed = sum(r.params.sampler.rng == "position" for r in sampled)
    mates = len(requests) - len(sampled)
    plain_note = f"; the {keyed} keyed per position emit plain decode's tokens" if keyed and budget <= 0 else ""
    return Invariance("seeded", "holds", f"{len(sampled)} sampled rows emit the same tokens batched and alone"
                      f"{plain_note} (with {mates} greedy rows beside them)", checked=len(sampled))


# ---------------------------------------------------------------------- one row, classified


def backend_bound(model: Any) -> float:
    """The stated bound on |batched row - one-token row| of a logit row on this backend: 0 where
    bit-exact (``engine.backend.arithmetic``); under the CPU double (``engine.nonexact``) its logit
    scale plus the reach of its cache-write noise into later rows, ``ARITHMETIC_FACTOR`` (16, the
    audit's) × its cache scale; else the MLX 0.32.4 CUDA fp32 zoo measurement, 1e-2
    (docs/backends.md)."""
    from engine.audit import ARITHMETIC_FACTOR
    from engine.backend import arithmetic
    from engine.nonexact import emulated_kv_scale, is_emulated

    if arithmetic(model).exact:
        return 0.0
    em = is_emulated(model)
    return float(em[0]) + ARITHMETIC_FACTOR * emulated_kv_scale(model) if em is not None else 1e-2


@dataclass
class RowVerdict:
    """One batched row against its serial run: ``identical`` (byte for byte), ``numerics`` (a
    difference the evidence attributes to arithmetic: tokens flipped on a knife-edge witnessed in
    the row's own batch, caches within the calibrated bound) or ``logic`` (a bug); ``message``:
    the first divergence, naming the row, the batch step and the row's round."""

    row: str
    verdict: str
    message: str = ""
    evidence: list[str] = dataclasses.field(default_factory=list)
    step: int | None = None
    round: int | None = None
    field: str | None = None

    @property
    def ok(self) -> bool:
        return self.verdict in ("identical", "numerics")

    def to_dict(self) -> dict[str, Any]:
        return {"row": self.row, "verdict": self.verdict, "message": self.message, "evidence": self.evidence,
                "step": self.step, "round": self.round, "field": self.field}


class _SerialCaches(_SerialBlocks):
    """A ``RoundObserver`` keeping the serial executor's verify blocks and caches after each round."""

    def __init__(self) -> None:
        super().__init__()
        self.caches: dict[int, list[Any]] = {}

    def after_rollback(self, index: int, k_accept: int, caches: list[Any]) -> None:
        from engine.audit import clone_caches

        self.caches[index] = clone_caches(caches)


class RowJudge:
    """Classifies the rows of one batched run against their serial runs (:func:`classify_row`),
    sharing the replays: one re-run of the batch recording every row's caches, one serial run
    per row recording its caches, one calibration per row."""

    def __init__(self, model: Any, requests: list[BatchRequest], result: BatchResult,
                 serial: dict[str, GenerationResult] | None = None, *, bound: float | None = None) -> None:
        self.model = model
        self.requests = requests
        self.result = result
        self.bound = backend_bound(model) if bound is None else float(bound)
        self._serial = dict(serial or {})
        self._batch: BlockRecorder | None = None
        self._serial_caches: dict[str, _SerialCaches] = {}

    def _request(self, rid: str) -> BatchRequest:
        return next(x for x in self.requests if x.rid == rid)

    def serial(self, rid: str) -> GenerationResult:
        if rid not in self._serial:
            r = self._request(rid)
            self._serial[rid] = spec_generate(self.model, r.provider, r.prompt_ids, r.params)
        return self._serial[rid]

    def _batched_caches(self) -> dict[tuple[str, int], list[Any]]:
        if self._batch is None:
            self._batch = BlockRecorder(caches=True)
            batch_generate(self.model, self.requests, observer=self._batch)
        return self._batch.caches

    def _serial_round_caches(self, rid: str) -> dict[int, list[Any]]:
        if rid not in self._serial_caches:
            r = self._request(rid)
            obs = _SerialCaches()
            spec_generate(self.model, r.provider, r.prompt_ids, r.params, observer=obs)
            self._serial_caches[rid] = obs
        return self._serial_caches[rid].caches

    def _tolerance(self, r: BatchRequest) -> Any:
        from engine.cache_compare import calibrate
        from engine.stream import SPEC_PREFILL_STEP

        drained = r.prompt_ids[:-1] if len(r.prompt_ids) > 1 else r.prompt_ids
        return calibrate(self.model, drained, 0, r.params.prefill_step_size or SPEC_PREFILL_STEP,
                         r.params.gamma, name="target")[0]

    def classify(self, rid: str) -> RowVerdict:
        r = self._request(rid)
        batched, serial = self.result.rows[rid], self.serial(rid)
        div = compare_row(rid, batched, serial, self.result.steps)
        if div is None:
            return RowVerdict(rid, "identical")
        if self.bound <= 0:
            return RowVerdict(rid, "logic", div.message, ["bit-exact backend: a row must equal its serial run byte "
                                                          "for byte"], div.step, div.round, div.field)
        evidence: list[str] = []
        upto: int | None = None  # rounds before the first structural difference have their caches weighed
        sdiv = compare_row(rid, batched, serial, self.result.steps, ignore=ARITHMETIC_FIELDS)
        if (sdiv is not None and sdiv.field == "drafts" and sdiv.round is not None
                and self.result.drafting.get(rid) == "batched"):
            # The row drafted in a drafter batch: its proposals come from the drafter's batched
            # forward, whose arithmetic (like the target's) depends on the batch off a bit-exact
            # backend. Proposals only steer the verifier: a lossless verify emits the same tokens
            # whatever was drafted, so the row is held to its serial run's output, token for token.
            if batched.output_ids != serial.output_ids:
                n = next((i for i, (x, y) in enumerate(zip(batched.output_ids, serial.output_ids, strict=False))
                          if x != y), min(len(batched.output_ids), len(serial.output_ids)))
                return RowVerdict(rid, "logic", f"{sdiv.message}; the emitted tokens then differ at output token {n} "
                                  "(drafts steer a lossless verifier, never its output)",
                                  ["drafts moved by the drafter batch, and the output moved with them"],
                                  sdiv.step, sdiv.round, "output_ids")
            evidence.append(f"{sdiv.message} -- the row drafted in a drafter batch (the drafter's batched "
                            f"forward is arithmetic off a bit-exact backend); the verify is lossless: all "
                            f"{len(batched.output_ids)} emitted tokens equal the serial run's")
            upto = sdiv.round
        elif sdiv is not None:
            if sdiv.field not in ("samples", "emitted") or sdiv.round is None:
                return RowVerdict(rid, "logic", sdiv.message + " (structural: not an arithmetic field)",
                                  [f"arithmetic fields ({', '.join(sorted(ARITHMETIC_FIELDS))}) aside, the "
                                   "records differ"], sdiv.step, sdiv.round, sdiv.field)
            before = emitted_before(batched.records, sdiv.round)
            # The bound a flip is weighed against: the stated one, or what correct forward paths of
            # this row's own tokens differ by on this backend, whichever is larger (a bf16 model's
            # logits move further than the stated 1e-2 on a GPU; calibrated like the caches).
            own = logit_spread(self.model, list(r.prompt_ids) + list(serial.output_ids[:before]), r.params.gamma)
            bound = max(self.bound, own)
            if own > self.bound:
                evidence.append(f"the flip weighed against |Δ| {own:.3g} measured between correct forward paths of "
                                f"the row's own {len(r.prompt_ids) + before} tokens (above the stated {self.bound:g})")
            flip = _weigh("row", r, sdiv, bound, 1,
                          (lambda: _row_blocks(self.model, self.requests, rid), lambda: _serial_blocks(self.model, r)),
                          "the batched forward vs the serial verify window", before)
            if flip.verdict != "numerics":
                return RowVerdict(rid, "logic", sdiv.message, flip.evidence[1:], sdiv.step, sdiv.round, sdiv.field)
            evidence += flip.evidence
            upto = sdiv.round
        checked, worst, ratio = 0, "", -1.0
        rounds = [x for x in batched.records if x.get("type") == "round" and (upto is None or int(x["index"]) < upto)]
        if any(x.get("target_cache_digest") != y.get("target_cache_digest")
               for x, y in zip(batched.records, serial.records, strict=False) if x.get("type") == "round"):
            from engine.cache_compare import check_caches

            tol = self._tolerance(r)
            mine, theirs = self._batched_caches(), self._serial_round_caches(rid)
            for x in rounds:
                i = int(x["index"])
                if (rid, i) not in mine or i not in theirs:
                    continue  # a serial-lane round: the serial executor's own arithmetic
                at = step_of(self.result.steps, rid, i)
                where = f"batch step {at['step'] if at else '?'} (round {i})"
                chk = check_caches(mine[(rid, i)], theirs[i], tol, where, ("batched", "serial"))
                checked += 1
                if not chk.ok:
                    return RowVerdict(rid, "logic", f"row {rid}: {chk.error}", [tol.describe()],
                                      at["step"] if at else None, i, "target_cache_digest")
                if chk.ratio > ratio:
                    ratio, worst = chk.ratio, f"{where}: {chk.worst}" if chk.worst else worst
            evidence.append(f"target caches after {checked} batched rounds within the calibrated bound "
                            f"(closest: {worst or 'byte-equal'}); {tol.describe()}")
        if sdiv is None:
            evidence.insert(0, f"{div.message} -- only arithmetic fields differ "
                               f"({', '.join(sorted(ARITHMETIC_FIELDS))}); tokens and rounds agree")
        return RowVerdict(rid, "numerics", (sdiv or div).message, evidence, (sdiv or div).step, (sdiv or div).round,
                          (sdiv or div).field)


def classify_row(model: Any, requests: list[BatchRequest], rid: str, result: BatchResult,
                 serial: GenerationResult | None = None, *, bound: float | None = None) -> RowVerdict:
    """Row ``rid`` of the batched run ``result`` (of ``requests`` on ``model``) against its serial
    run (``spec_generate`` alone; run here when ``serial`` is None), by the one classification
    path of docs/batched.md: byte and token equality where the backend is bit-exact (``bound``
    0: any difference is ``logic``); elsewhere (``bound``: the logit bound, default
    :func:`backend_bound`) the record fields that are pure arithmetic (:data:`ARITHMETIC_FIELDS`)
    are set aside, a token flip is weighed by replaying the row in its own batch and alone
    (:func:`serial_flip`'s evidence), and the target caches after every batched round before it
    are held to the serial run's within the calibrated bound (``engine.cache_compare``:
    ``calibrate``, ``check_caches``); any other difference is ``logic``."""
    judge = RowJudge(model, requests, result, None if serial is None else {rid: serial}, bound=bound)
    return judge.classify(rid)
