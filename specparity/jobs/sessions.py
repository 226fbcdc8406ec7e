"""Prompt-cache sessions: warm ≡ cold, request by request (``specparity run --sessions``).

A session is a list of requests sharing prefixes (``SESSIONS``): follow-ups
(the previous prompt, its stream — completion, EOS included when the turn
ended on one — then a new user turn), regenerations (the same prompt again),
continuations (the previous prompt + stream exactly), a prefix of the previous
prompt and a shared prefix with a new tail. Each request runs twice: WARM
through one ``engine.prompt_cache.PromptCacheSession`` (the saved target and
drafter caches reused) and COLD (fresh caches, the whole prompt prefilled). They
must be token-identical and cache-byte-identical: every record of the warm
trace equals the cold one's (the prefill record's cache digests cover the whole
cache, reused prefix included; every round's feed, drafts, samples, k_accept,
end and target/drafter cache digests), and the footer's output and usage. The
first divergence is named by request index, round and position.

Off the CPU (``engine.backend.arithmetic``: MLX's default device is not the
CPU, or a model is wrapped by the non-exact double ``engine.nonexact``) warm and
cold cannot be byte-equal: a warm request prefills only its suffix, so the same
prompt is prefilled in chunks of other shapes. There the record fields that are
pure arithmetic (cache digests, margins, confidence) are not byte-compared; the
structural ones (feed, drafts, samples, k_accept, end, emitted, usage, output
ids) are, and ``engine.cache_compare.judge_request`` classifies each request:
``identical``, ``numerics`` (the caches at its start, after its prefill and at
its end within the bound calibrated on this device, and every token flip
witnessed: each run's own path gives its own token) or ``logic``. Only ``logic``
fails the run.

Reported, never asserted: the prefix-hit rate (reused prompt tokens / prompt
tokens) and time to first token warm vs cold, paired per request (the order of
the two runs alternates per request).

The plain arm (``run_session(plain=True)``, on in ``specparity run --sessions``):
the same session again under plain decode through
``engine.prompt_cache.PlainPromptCacheSession`` (the same prompt cache, target
segment only), each request warm and cold, held to the same record-for-record
check (a plain warm ≠ cold fails the run too, named ``plain arm: request i ...``).
Each arm builds its prompts from its own streams (a follow-up carries that arm's
answer: the same tokens under greedy, other tokens under seeded sampling), and the
four cells of a request (spec warm, spec cold, plain warm, plain cold) run back to
back in a rotating order. ``paired_summary`` reports per arm the prefix-hit rate
and, over the requests with all four cells, the median time to first token of each
cell and the paired ratios spec/plain (warm, cold) and warm/cold (per arm): medians
with 95 % percentile-bootstrap intervals (``reports.stats.median_ratio``) and the
Wilcoxon signed-rank p of their logs (``scipy.stats.wilcoxon``). Figures, never
asserted.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.backend import Unsupported, run_supported, unsupported_text, unsupported_verdict
from specparity.cases.case import Case
from traces.diff import common_prefix

# session name -> request kinds, in order (the first is always "fresh")
SESSIONS: dict[str, tuple[str, ...]] = {
    "multi-turn": ("fresh", "follow-up", "follow-up"),
    "regenerate": ("fresh", "regenerate", "follow-up", "regenerate"),
    "continue": ("fresh", "continue", "continue"),
    "prefix": ("fresh", "prefix", "shared-prefix", "regenerate"),
    "eos": ("fresh", "continue", "follow-up", "regenerate"),  # an early output token made an EOS id
}
TURN_TOKENS = 6  # tokens of a new user turn (taken from the next prompt)

# Fields of a record never compared (what a warm request legitimately does differently).
_SKIP = {"time_s", "target_tokens", "drafter_tokens", "prompt_cache", "wall_s"}
# ... and, where the backend is not bit-exact, the arithmetic ones (engine.cache_compare.ARITHMETIC_FIELDS).
_ARITHMETIC = {"target_cache_digest", "drafter_cache_digest", "margins", "margin", "confidence"}


def next_prompt(kind: str, prev_prompt: Sequence[int], prev_stream: Sequence[int],
                turn: Sequence[int]) -> list[int]:
    """The prompt of a request of ``kind`` after a request that took ``prev_stream``."""
    if kind == "follow-up":
        return [*prev_stream, *turn[:TURN_TOKENS]]
    if kind == "continue":
        return list(prev_stream)
    if kind == "regenerate":
        return list(prev_prompt)
    if kind == "prefix":
        return list(prev_prompt[: max(2, len(prev_prompt) * 2 // 3)])
    if kind == "shared-prefix":
        return [*prev_prompt[: max(1, len(prev_prompt) // 2)], *turn[:TURN_TOKENS]]
    raise ValueError(f"unknown request kind {kind!r}; known: follow-up, continue, regenerate, prefix, "
                     "shared-prefix")


def _where(rec: dict[str, Any]) -> str:
    if rec["type"] == "prefill":
        return "prefill (before round 0)"
    if rec["type"] == "round":
        return f"round {rec['index']}"
    if rec["type"] == "plain":
        return f"plain step {rec['index']}"
    return str(rec["type"])


def _field_diff(name: str, a: Any, b: Any) -> str:
    if isinstance(a, dict) and isinstance(b, dict) and "layers" in a and "layers" in b:
        j = common_prefix(a["layers"], b["layers"])
        return f"{name} layer {j}: warm {str(a['combined'])[:12]} != cold {str(b['combined'])[:12]}"
    if isinstance(a, list) and isinstance(b, list):
        j = common_prefix(a, b)
        return (f"{name} position {j}: warm {a[j] if j < len(a) else '<end>'} != "
                f"cold {b[j] if j < len(b) else '<end>'}")
    return f"{name}: warm {a!r} != cold {b!r}"


def compare_records(request: int, kind: str, warm: Sequence[dict[str, Any]],
                    cold: Sequence[dict[str, Any]], *, exact: bool = True) -> str | None:
    """The first difference between a warm and a cold request's records (None: identical).

    ``exact=False``: the arithmetic fields (cache digests, margins, confidence) are left out."""
    head = f"request {request} ({kind})"
    skip = _SKIP if exact else _SKIP | _ARITHMETIC
    for a, b in zip(warm, cold, strict=False):
        if a["type"] != b["type"]:
            return f"{head}: {_where(b)}: record type: warm {a['type']} != cold {b['type']}"
        if a["type"] == "footer":
            for k in ("output_ids", "usage", "speculation"):
                if a.get(k) != b.get(k):
                    return f"{head}: footer: {_field_diff(k, a.get(k), b.get(k))}"
            continue
        for k in sorted((set(a) | set(b)) - skip):
            if a.get(k) != b.get(k):
                return f"{head}: {_where(b)}: {_field_diff(k, a.get(k), b.get(k))}"
    if len(warm) != len(cold):
        return f"{head}: warm has {len(warm)} records, cold {len(cold)}"
    return None


@dataclass
class RequestVerdict:
    index: int
    kind: str
    prompt_tokens: int
    target_reused: int
    drafter_reused: int | None
    entry: str | None
    refused: str | None
    end: str | None  # how the request's last round ended (correction/bonus/eos/budget/...)
    divergence: str | None  # the first divergence that is not arithmetic (logic)
    ttft_warm_s: float | None
    ttft_cold_s: float | None
    verdict: str = "identical"  # "identical" | "numerics" | "logic" (off the CPU; on it: identical/logic)
    numerics: str | None = None  # numerics: what differs, and on what basis it is arithmetic
    judgement: dict[str, Any] | None = None  # off the CPU: engine.cache_compare.Judgement.to_dict()

    @property
    def ok(self) -> bool:
        """Warm ≡ cold, or different only by arithmetic (``numerics``)."""
        return self.divergence is None

    @property
    def identical(self) -> bool:
        return self.divergence is None and self.verdict == "identical"


@dataclass
class SessionVerdict:
    label: str  # pair / source / sampling / session name
    session: str
    requests: list[RequestVerdict] = field(default_factory=list)
    error: str | None = None
    plain: list[RequestVerdict] | None = None  # the plain arm's requests (None: not run)
    plain_error: str | None = None
    arithmetic: str | None = None  # not bit-exact: why (engine.backend.arithmetic); None: byte-exact

    @property
    def spec_identical(self) -> bool:
        return self.error is None and all(r.identical for r in self.requests)

    @property
    def plain_identical(self) -> bool:
        return self.plain_error is None and all(r.identical for r in self.plain or ())

    @property
    def identical(self) -> bool:
        """Both arms warm ≡ cold (the plain arm, where it ran)."""
        return self.spec_identical and self.plain_identical

    @property
    def spec_verdict(self) -> str:
        return _arm_verdict(self.error, self.requests)

    @property
    def plain_verdict(self) -> str:
        return _arm_verdict(self.plain_error, self.plain or ())

    @property
    def verdict(self) -> str:
        """``logic`` if either arm has one, else ``numerics`` if either has one, else ``identical``."""
        vs = {self.spec_verdict, self.plain_verdict}
        return next(v for v in ("logic", "unsupported", "numerics", "identical") if v in vs)

    @property
    def ok(self) -> bool:
        """No ``logic`` in either arm (what the run's exit status asks)."""
        return self.verdict != "logic"

    @property
    def spec_first_numerics(self) -> str | None:
        return next((r.numerics for r in self.requests if r.numerics), None)

    @property
    def spec_first_divergence(self) -> str | None:
        if self.error:
            return self.error
        return next((r.divergence for r in self.requests if r.divergence), None)

    @property
    def plain_first_divergence(self) -> str | None:
        if self.plain_error:
            return f"plain arm: {self.plain_error}"
        d = next((r.divergence for r in self.plain or () if r.divergence), None)
        return None if d is None else f"plain arm: {d}"

    @property
    def first_divergence(self) -> str | None:
        return self.spec_first_divergence or self.plain_first_divergence

    @property
    def unsupported(self) -> str | None:
        """``unsupported on <device>: <op>`` when an arm hit an op the backend lacks (engine/backend.py)."""
        return unsupported_verdict(self.error) or unsupported_verdict(self.plain_error)


def _arm_verdict(error: str | None, reqs: Sequence[RequestVerdict]) -> str:
    if unsupported_verdict(error) is not None:  # the backend lacks an op: a fact, not a finding
        return "unsupported"
    if error is not None or any(not r.ok for r in reqs):
        return "logic"
    return "numerics" if any(r.verdict == "numerics" for r in reqs) else "identical"


def _end(records: Sequence[dict[str, Any]]) -> str | None:
    """How the request ended and on what: ``budget@accepted``, ``eos@correction``, ``budget@bonus``,
    ``budget@plain`` ... (each leaves the target and drafter caches at different offsets)."""
    last = next((r for r in reversed(records) if r["type"] in ("round", "plain")), None)
    if last is None:
        return None
    if last["type"] == "plain":
        return f"{last.get('end')}@plain"
    i, d = len(last["samples"]) - 1, len(last["drafts"])
    on = "bonus" if i >= d else ("accepted" if last["samples"][i] == last["drafts"][i] else "correction")
    return f"{last['end']}@{on}"


@dataclass
class NonExact:
    """How a session judges warm vs cold where the backend is not bit-exact (module docstring)."""

    why: str  # engine.backend.arithmetic(...).why
    target: Any
    drafter: Any = None  # the two-model drafter (its caches are a session segment), else None
    kind: str | None = None  # the source kind (None: the plain arm)

    def capture(self) -> Any:
        from engine.prompt_cache import ColdCapture

        return ColdCapture(segment=self.drafter is not None)

    def judge(self, i: int, kind: str, prompt: Sequence[int], params: Any, turn: Any, c: Any,
              capture: Any) -> tuple[str | None, Any]:
        """The request's logic divergence (None: identical or numerics) and its Judgement."""
        from engine.cache_compare import as_trace, judge_request
        from engine.executor import PLAIN_PREFILL_STEP, SPEC_PREFILL_STEP
        from engine.pipeline import SamplingPipeline

        warm = [*turn.result.records, turn.result.footer()]
        cold_recs = [*c.records, c.footer()]
        structural = compare_records(i, kind, warm, cold_recs, exact=False)
        mode = "plain" if self.kind is None else "spec"
        step = params.prefill_step_size or (PLAIN_PREFILL_STEP if mode == "plain" else SPEC_PREFILL_STEP)
        j = judge_request(self.target, self.drafter, as_trace(mode, prompt, params, warm, self.kind),
                          as_trace(mode, prompt, params, cold_recs, self.kind), turn.caches,
                          capture.snapshots(turn.caches.drained), structural, step=step, gamma=params.gamma,
                          drafter_kind=self.kind, kv=params.kv, drafter_kv=params.kv,
                          pipeline=lambda t: SamplingPipeline(params, list(prompt), seed_stream=False))
        head = f"request {i} ({kind})"
        if j.verdict == "logic":
            msg = j.message or "logic"
            return (msg if msg.startswith(head) else f"{head}: {msg}"), j
        return None, j


def _request_verdict(i: int, kind: str, prompt: Sequence[int], turn: Any, c: Any,
                     ttft_c: float | None, judged: tuple[str | None, Any] | None = None) -> RequestVerdict:
    r = turn.reuse
    verdict, numerics, data = "identical", None, None
    if judged is None:
        warm = [*turn.result.records, turn.result.footer()]
        div = compare_records(i, kind, warm, [*c.records, c.footer()])
        verdict = "identical" if div is None else "logic"
    else:
        div, j = judged
        verdict, data = j.verdict, j.to_dict()
        if j.verdict == "numerics":
            head = f"request {i} ({kind})"
            msg = j.message or ""
            numerics = f"{msg if msg.startswith(head) else f'{head}: {msg}'} [{j.basis}]"
    return RequestVerdict(i, kind, len(prompt), r["target_reused"], r["drafter_reused"], r["entry"], r["refused"],
                          _end(turn.result.records), div, turn.ttft_s, ttft_c, verdict, numerics, data)


class _PlainArm:
    """The plain arm of one session: its own prompt cache, prompts built from its own streams."""

    def __init__(self, target_model: Any, first: Sequence[int], factory: Callable[..., Any],
                 nonexact: NonExact | None = None) -> None:
        self.model = target_model
        self.session = factory(target_model)
        self.nonexact = nonexact
        if nonexact is not None:
            self.session.keep_caches, self.session.exact_arithmetic = True, False
        self.prompt: list[int] = list(first)
        self.stream: list[int] = []
        self.out: list[RequestVerdict] = []
        self.error: str | None = None

    def cells(self, i: int, kind: str, turn_tokens: Sequence[int], params: Any, warm_first: bool) -> None:
        from engine.prompt_cache import cold_plain, stream_tokens

        if self.error is not None:
            return
        if i:
            self.prompt = next_prompt(kind, self.prompt, self.stream, turn_tokens)
        cap = None if self.nonexact is None else self.nonexact.capture()
        try:
            if warm_first:
                turn = self.session.generate(self.prompt, params)
                c, ttft_c = cold_plain(self.model, self.prompt, params, reuse=cap)
            else:
                c, ttft_c = cold_plain(self.model, self.prompt, params, reuse=cap)
                turn = self.session.generate(self.prompt, params)
        except Exception as exc:  # an invariant check (PromptCacheError) or an engine error
            # a backend's missing op: "unsupported on <device>: <op> — ..." (engine/backend.py), not a divergence
            self.error = (unsupported_text(exc, f"request {i} ({kind})")
                          or f"request {i} ({kind}): {type(exc).__name__}: {exc}")
            return
        judged = None if self.nonexact is None else self.nonexact.judge(i, kind, self.prompt, params, turn, c, cap)
        self.out.append(_request_verdict(i, kind, self.prompt, turn, c, ttft_c, judged))
        self.stream = stream_tokens(self.prompt, turn.result.records)


def run_session(target_model: Any, make_provider: Callable[[], Any], name: str, first: Sequence[int],
                turns: Sequence[Sequence[int]], params: Any, *, label: str = "",
                session_factory: Callable[..., Any] | None = None,
                on_request: Callable[[int, str, list[int], Any, list[dict[str, Any]]], None] | None = None,
                plain: bool = False, plain_session_factory: Callable[..., Any] | None = None,
                exact: bool | None = None) -> SessionVerdict:
    """Run session ``name`` warm and cold; one verdict per request.

    ``on_request(index, kind, prompt, params, warm_records)`` sees every warm request
    (the command writes its trace). ``plain`` (or a ``plain_session_factory``): the plain
    arm too (module docstring); request ``i``'s four cells run spec pair first when
    ``i // 2`` is even, the plain pair first otherwise, the plain pair's warm/cold order
    the opposite of the spec pair's.

    Where the backend is not bit-exact (``engine.backend.arithmetic``; ``exact``
    overrides it: True forces byte equality, False the tolerance path) each request is
    judged by ``engine.cache_compare.judge_request`` (module docstring)."""
    from engine.backend import arithmetic
    from engine.prompt_cache import (
        PlainPromptCacheSession,
        PromptCacheSession,
        cold,
        reuse_family,
        stream_tokens,
    )

    kinds = SESSIONS[name]
    factory = session_factory or PromptCacheSession
    if name == "eos":
        # a token the first cold request emits early becomes an EOS id: turns end on EOS
        c0, _ = cold(target_model, make_provider(), first, params)
        if len(c0.output_ids) > 3:
            params = replace(params, eos_ids=(*params.eos_ids, c0.output_ids[3]))
    provider = make_provider()
    session = factory(target_model, provider)
    src_kind = str(getattr(provider, "kind", "?"))
    dmodel = getattr(provider, "model", None) if reuse_family(src_kind) == "segment" else None
    arith = arithmetic(target_model, dmodel)
    nonexact = None
    if not (arith.exact if exact is None else exact):
        nonexact = NonExact(arith.why, target_model, dmodel, src_kind)
        session.keep_caches, session.exact_arithmetic = True, False
    out = SessionVerdict(label=label or name, session=name, arithmetic=arith.why if nonexact else None)
    arm = None
    if plain or plain_session_factory is not None:
        arm = _PlainArm(target_model, first, plain_session_factory or PlainPromptCacheSession,
                        None if nonexact is None else replace(nonexact, drafter=None, kind=None))
    prompt: list[int] = list(first)
    stream: list[int] = []
    for i, kind in enumerate(kinds):
        turn_tokens = turns[(i - 1) % len(turns)] if turns else first
        if i:
            prompt = next_prompt(kind, prompt, stream, turn_tokens)
        p_i = replace(params, max_tokens=params.max_tokens + i)  # a budget stop lands elsewhere each turn
        if arm is not None and (i // 2) % 2 == 1:
            arm.cells(i, kind, turn_tokens, p_i, warm_first=i % 2 == 0)
        cap = None if nonexact is None else nonexact.capture()
        try:
            if i % 2 == 0:
                c, ttft_c = cold(target_model, make_provider(), prompt, p_i, reuse=cap)
                turn = session.generate(prompt, p_i)
            else:
                turn = session.generate(prompt, p_i)
                c, ttft_c = cold(target_model, make_provider(), prompt, p_i, reuse=cap)
        except Exception as exc:  # an invariant check (PromptCacheError) or an engine error
            # a backend's missing op: "unsupported on <device>: <op> — ..." (engine/backend.py), not a divergence
            out.error = (unsupported_text(exc, f"request {i} ({kind})")
                         or f"request {i} ({kind}): {type(exc).__name__}: {exc}")
            break
        if on_request is not None:
            on_request(i, kind, list(prompt), p_i, [*turn.result.records, turn.result.footer()])
        judged = None if nonexact is None else nonexact.judge(i, kind, prompt, p_i, turn, c, cap)
        out.requests.append(_request_verdict(i, kind, prompt, turn, c, ttft_c, judged))
        stream = stream_tokens(prompt, turn.result.records)
        if arm is not None and (i // 2) % 2 == 0:
            arm.cells(i, kind, turn_tokens, p_i, warm_first=i % 2 == 0)
    if arm is not None:
        out.plain, out.plain_error = arm.out, arm.error
    return out


# --------------------------------------------------------------------------- cases → sessions

def _params(case: Case, eos: tuple[int, ...]) -> Any:
    from specparity.runners import generation_params

    return generation_params(case, eos)


def _provider_factory(case: Case) -> Callable[[], Any]:
    """A fresh provider per session and per cold run, built as the engine runner builds it
    (``specparity.runners.open_for_case``: the case's kind descriptor opens it)."""
    from specparity.runners import open_for_case

    return open_for_case(case).make


def _group_key(c: Case) -> tuple[Any, ...]:
    return tuple(v for k, v in asdict(c).items() if k not in ("prompt_id", "prompt_tokens"))


def _label(c: Case) -> str:
    """A group's label, and its trace folder's name (``/`` -> ``__``): readable, and different for any
    two groups (:func:`_group_key`: every field but the prompt shows in it — the case id's tail for
    top-p/top-k/min-p, EOS ids, stop sequences, processors, min_tokens, rng and grammar, and a short
    digest of the full model paths for a user's models, whose folder names alone may repeat), so two
    groups never write into one folder (tests/test_sessions_cli.py enumerates the fields)."""
    t = Path(c.target_path).name if c.target_path else c.target
    d = (Path(c.draft_path).name if c.draft_path else c.drafter) if c.drafter else "plain"
    s = f"{t}/{d}/{c.source}/g{c.gamma}/n{c.max_tokens}"
    if c.temperature:
        s += f"/t{c.temperature:g}-s{c.seed}"
        s += (f"p{c.top_p:g}" if c.top_p else "") + (f"k{c.top_k}" if c.top_k else "") + \
            (f"m{c.min_p:g}" if c.min_p else "")
    if c.kv_bits:
        s += f"/kv{c.kv_bits}@{c.quantized_kv_start}" + (f"g{c.kv_group_size}" if c.kv_group_size else "")
    if c.rotating != "guard":
        s += f"/rot-{c.rotating}"
    s += _id_tail(c)
    if c.reasoning_end and not c.grammar:  # (the case id names a marker only beside its grammar)
        s += f"/re-{hashlib.sha256(c.reasoning_end.encode()).hexdigest()[:8]}"
    if c.target_path or c.draft_path:
        who = f"{c.target}\0{c.target_path}\0{c.drafter}\0{c.draft_path}"
        s += "/" + hashlib.sha256(who.encode()).hexdigest()[:8]
    return s


def _id_tail(c: Case) -> str:
    """The parts of ``c``'s case id after its budget that :func:`_label` does not spell itself (EOS ids,
    stop sequences, processors, min_tokens, rng, grammar and its reasoning marker)."""
    bare = replace(c, temperature=0.0, kv_bits=None, kv_group_size=None, quantized_kv_start=None,
                   rotating="guard")
    head = (f"{bare.target}/plain/{bare.prompt_id}/n{bare.max_tokens}" if bare.drafter is None else
            f"{bare.target}/{bare.drafter}/{bare.prompt_id}/g{bare.gamma}/n{bare.max_tokens}")
    cid = bare.case_id
    return cid[len(head):] if cid.startswith(head) else "/" + cid


def _trace_writer(trace_dir: Path, case: Case, name: str) -> Callable[..., None]:
    """Writes each warm request's trace: ``trace_dir/<pair dir>/<session>/r<i>-<kind>.jsonl``.

    The header is the one ``specparity record`` would write for that request as a case
    (its prompt, budget and EOS ids); the prefill record carries ``prompt_cache``."""
    from specparity.runners import case_params, case_paths, tokenizer_digest
    from specparity.runners import model_identity as identity
    from specparity.runners.registry import get
    from traces.io import write_trace
    from traces.records import make_header

    def write(i: int, kind: str, prompt: list[int], p: Any, records: list[dict[str, Any]]) -> None:
        import zoo

        c = replace(case, prompt_id=f"{case.prompt_id}@{name}-r{i}", prompt_tokens=tuple(prompt),
                    max_tokens=p.max_tokens, eos_ids=tuple(p.eos_ids))
        tpath, dpath = case_paths(c)
        header = make_header(
            runner=get("engine").runner_info(), mode="spec", source=c.source, case_id=c.case_id,
            target=identity(str(tpath)), drafter=identity(str(dpath)) if dpath is not None else None,
            tokenizer_sha256=zoo.tokenizer_digest() if c.on_zoo else tokenizer_digest(tpath),
            params=case_params(c, p.prefill),  # None: the kind's own convention, as the run's
            prompt_id=c.prompt_id, prompt_ids=prompt, eos_ids=list(p.eos_ids))
        from specparity.cli.outdir import track

        path = track(trace_dir / _label(case).replace("/", "__") / name / f"r{i}-{kind}.jsonl")
        write_trace(path, [header, *records])

    return write


def sessions_from_cases(cases: Sequence[Case], names: Sequence[str] | None = None,
                        progress: Callable[[str], None] | None = None,
                        trace_dir: Path | None = None, plain: bool = False) -> list[SessionVerdict]:
    """Group ``cases`` by everything but the prompt; run every session on each group
    (``plain``: with the plain arm, ``run_session``)."""
    from specparity.runners import case_paths, load_model, open_for_case

    groups: dict[tuple[Any, ...], list[Case]] = {}
    for c in cases:
        if c.drafter is None:
            continue  # plain cases: nothing speculative to reuse under
        groups.setdefault(_group_key(c), []).append(c)
    out: list[SessionVerdict] = []
    for group in groups.values():
        c0 = group[0]
        tp, _ = case_paths(c0)
        target = load_model(str(tp))
        ids = [_prompt_ids(c) for c in group]
        eos = tuple(getattr(target, "eos_ids", ()) or ())
        params = _params(c0, eos)
        try:
            src = open_for_case(c0)  # as the engine runner runs it
            make, params = src.make, replace(params, prefill=src.prefill)
        except ValueError as exc:
            out.append(SessionVerdict(_label(c0), "-", error=str(exc)))
            continue
        for name in names or SESSIONS:
            label = f"{_label(c0)}/{name}"
            if progress:
                progress(label)
            writer = _trace_writer(trace_dir, c0, name) if trace_dir is not None else None
            v = run_supported(lambda: run_session(target.model, make, name, ids[0], ids[1:], params,  # noqa: B023
                                                  label=label, on_request=writer, plain=plain),  # noqa: B023
                              f"session {label}")
            # a missing op anywhere in the session (a request, the calibration, the witness): its verdict
            out.append(SessionVerdict(label, name, error=v.text) if isinstance(v, Unsupported) else v)
    return out


def request_reach(kinds: Sequence[str], first_len: int, max_tokens: int) -> list[int]:
    """Per request of a session: the most tokens its prompt plus its budget can take (each
    request's budget is ``max_tokens + i``, :func:`run_session`; a follow-up's prompt holds the
    earlier prompt, all its output and a turn of :data:`TURN_TOKENS`)."""
    length, out = first_len, []
    for i, kind in enumerate(kinds):
        if i:
            prev_out = max_tokens + i - 1
            length = {"follow-up": length + prev_out + TURN_TOKENS, "continue": length + prev_out,
                      "regenerate": length, "prefix": max(2, length * 2 // 3),
                      "shared-prefix": max(1, length // 2) + TURN_TOKENS}[kind]
        out.append(length + max_tokens + i)
    return out


# The ``Case`` fields the sessions lane does not take from the run's case, each with why
# (``tests/test_case_lanes.py`` holds every other field to reach the session's requests).
CASE_FIELDS_NOT_APPLICABLE: dict[str, str] = {
    "grammar": "refused by check_sessions: a constrained request's grammar state is not saved with the prompt cache",
    "reasoning_end": "a grammar's reasoning-end marker: grammars are refused (check_sessions)",
}


def check_sessions(cases: Sequence[Case], names: Sequence[str] | None = None) -> None:
    """Refuse (one line, before any model loads) what the sessions cannot honour: a grammar
    (a constrained request's grammar state is not part of a saved prompt cache) and a session
    whose follow-ups could run past the target's context (each follow-up's prompt holds the
    earlier outputs: :func:`request_reach`)."""
    from specparity.cases.prompts import model_limits, read_model_config
    from specparity.runners import case_paths

    if any(c.grammar for c in cases):
        raise ValueError("--sessions: prompt-cache sessions do not run grammar-constrained requests "
                         "(the grammar state is not saved with the cache): drop --grammar (or the "
                         "suite's grammar)")
    groups: dict[tuple[Any, ...], list[Case]] = {}
    for c in cases:
        if c.drafter is not None:
            groups.setdefault(_group_key(c), []).append(c)
    for group in groups.values():
        c0 = group[0]
        _, ctx = model_limits(read_model_config(case_paths(c0)[0]))
        if ctx is None:
            continue
        first = len(_prompt_ids(c0))
        for name in names or SESSIONS:
            reach = request_reach(SESSIONS[name], first, c0.max_tokens)
            i = next((j for j, r in enumerate(reach) if r > ctx), None)
            if i is not None:
                raise ValueError(
                    f"--sessions: session {name!r} of {_label(c0)}: request {i} ({SESSIONS[name][i]}) can "
                    f"reach {reach[i]} tokens (a {first}-token first prompt, then the earlier outputs and "
                    f"turns, --max-tokens {c0.max_tokens} + {i}), past the target's context of {ctx}: "
                    "lower --max-tokens or use a shorter prompt")


def _prompt_ids(c: Case) -> list[int]:
    if c.prompt_tokens is not None:
        return list(c.prompt_tokens)
    import zoo

    return list(zoo.prompt(c.prompt_id).token_ids)


def zoo_session_cases(targets: Sequence[str] | None = None, max_tokens: int = 16,
                      sampling: Sequence[tuple[float, int]] = ((0.0, 0), (0.8, 7))) -> list[Case]:
    """The zoo's session matrix: one pair per cache family, γ 3, two prompts per group.

    KVCache (llama, qwen3), RotatingKVCache (gemma3: sliding window 32, wrapped by the
    sessions' prompts), recurrent ArraysCache (qwen35), quantized KV (llama-kv, 4-bit,
    group 32, from the prefill and from position 36), the model-free ngram source, and
    the sources reading the target's hidden states: an MTP head (qwen35), an assistant
    (gemma4), a DSpark block drafter (qwen3) and native MTP on an MLA target (deepseek-mtp,
    whose one-token forward is not its prefill's arithmetic).
    """
    import zoo

    pids = [p.id for p in zoo.prompts() if p.kind == "natural"][:2]
    rows: list[tuple[str, str, str, dict[str, Any]]] = [
        ("llama", "twin", "two-model", {}), ("qwen3", "twin", "two-model", {}),
        ("gemma3", "twin", "two-model", {}), ("qwen35", "twin", "two-model", {}),
        (zoo.KV_TARGET, "twin", "two-model", {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0}),
        (zoo.KV_TARGET, "twin", "two-model", {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 36}),
        ("llama", "ngram", "ngram", {}),
        # sources reading the target's hidden states: the target's tapped rows are saved with it
        ("qwen35", "qwen35-mtp-self", "mtp", {}), ("gemma4", "gemma4-assistant-self", "assistant", {}),
        ("qwen3", "dspark-t0", "dspark", {}), ("deepseek-mtp", "native", "native-mtp", {}),
    ]
    cases = []
    for t, d, src, kv in rows:
        if targets is not None and t not in targets:
            continue
        for temp, seed in sampling:
            for pid in pids:
                cases.append(Case(target=t, drafter=d, prompt_id=pid, gamma=3, max_tokens=max_tokens,
                                  temperature=temp, seed=seed, source=src,
                                  eos_ids=(zoo.eos_id(),), **kv))
    return cases


# --------------------------------------------------------------------------- report

def summary(verdicts: Sequence[SessionVerdict]) -> dict[str, Any]:
    reqs = [r for v in verdicts for r in v.requests]
    later = [r for r in reqs if r.index > 0]
    prompt = sum(r.prompt_tokens for r in later)
    reused = sum(r.target_reused for r in later)
    pairs = [(r.ttft_warm_s, r.ttft_cold_s) for r in later if r.ttft_warm_s and r.ttft_cold_s]
    ratio = [w / c for w, c in pairs]
    return {
        "sessions": len(verdicts),
        "identical": sum(v.spec_identical for v in verdicts),
        "numerics": sum(v.spec_verdict == "numerics" for v in verdicts),
        "logic": sum(v.spec_verdict == "logic" for v in verdicts),
        "unsupported": sum(v.spec_verdict == "unsupported" for v in verdicts),
        "arithmetic": next((v.arithmetic for v in verdicts if v.arithmetic), None),
        "requests": len(reqs),
        "requests_identical": sum(r.identical for r in reqs),
        "requests_numerics": sum(r.verdict == "numerics" for r in reqs),
        **{f"requests_numerics_{k}": sum(r.verdict == "numerics" and (r.judgement or {}).get("basis") == b
                                         for r in reqs)
           for k, b in (("bytes", "tolerance"), ("witnessed", "witness"), ("not_replayed", "not replayed"))},
        "requests_logic": sum(not r.ok for r in reqs),
        "prefix_hit_rate": (reused / prompt) if prompt else None,
        "requests_reusing": sum(1 for r in later if r.target_reused),
        "later_requests": len(later),
        "ttft_pairs": len(pairs),
        "ttft_warm_median_s": statistics.median(w for w, _ in pairs) if pairs else None,
        "ttft_cold_median_s": statistics.median(c for _, c in pairs) if pairs else None,
        "ttft_warm_over_cold_median": statistics.median(ratio) if ratio else None,
    }


def headline(s: dict[str, Any]) -> str:
    """What the sessions found, every verdict counted (:func:`summary`): ``CONFORMS — N sessions: a
    warm ≡ cold, b numerics, c logic, d unsupported`` with no ``logic`` (exit 0: numerics is
    arithmetic, unsupported a backend's fact), ``DIVERGES — ...`` with some, ``NOTHING COMPARED``
    when every session was unsupported."""
    counts = (f"{s['sessions']} sessions: {s['identical']} warm ≡ cold, {s['numerics']} numerics, "
              f"{s['logic']} logic, {s['unsupported']} unsupported")
    if s["logic"]:
        return f"DIVERGES — {counts}"
    if s["sessions"] and s["unsupported"] == s["sessions"]:
        return f"NOTHING COMPARED — {counts}"
    return f"CONFORMS — {counts}"


def render(verdicts: Sequence[SessionVerdict]) -> str:
    s = summary(verdicts)
    lines = ["# Prompt-cache sessions: warm ≡ cold", "", headline(s) +
             f" ({s['requests_identical']}/{s['requests']} requests warm ≡ cold).", ""]
    if s["arithmetic"]:
        lines[-1:] = [
            "", f"Not bit-exact here ({s['arithmetic']}): cache bytes compared within the bound calibrated on this "
            "device, token flips through the numerics witness. Sessions: "
            f"{s['identical']} identical, {s['numerics']} numerics, {s['logic']} logic; requests: "
            f"{s['requests_identical']} identical, {s['requests_numerics']} numerics "
            f"({s['requests_numerics_bytes']} cache bytes only, {s['requests_numerics_witnessed']} with every flip "
            f"witnessed, {s['requests_numerics_not_replayed']} with a flip the witness cannot replay), "
            f"{s['requests_logic']} logic. Only logic fails the run.", ""]
    hit = s["prefix_hit_rate"]
    lines.append(f"Prefix-hit rate (requests after the first): "
                 f"{'-' if hit is None else f'{hit:.1%}'} of prompt tokens reused; "
                 f"{s['requests_reusing']}/{s['later_requests']} requests reused a prefix.")
    if s["ttft_pairs"]:
        lines.append(f"Time to first token, paired over {s['ttft_pairs']} requests (figures, not a "
                     f"benchmark): median warm {s['ttft_warm_median_s'] * 1e3:.2f} ms, cold "
                     f"{s['ttft_cold_median_s'] * 1e3:.2f} ms, median warm/cold "
                     f"{s['ttft_warm_over_cold_median']:.2f}.")
    lines += ["", "| session | verdict | reused per request (target/drafter of prompt) | ends | first divergence |",
              "|---|---|---|---|---|"]
    for v in verdicts:
        reused = ", ".join(f"{r.target_reused}/{'-' if r.drafter_reused is None else r.drafter_reused}"
                           f" of {r.prompt_tokens}" for r in v.requests)
        ends = ", ".join(str(r.end) for r in v.requests)
        verdict = v.unsupported or {"identical": "warm ≡ cold", "numerics": "numerics",
                                    "logic": "DIVERGENT"}[v.spec_verdict]
        lines.append(f"| {v.label} | {verdict} | {reused} | {ends} | "
                     f"{v.spec_first_divergence or v.spec_first_numerics or ''} |")
    refusals = sorted({f"{v.label} request {r.index}: {r.refused}" for v in verdicts for r in v.requests
                       if r.refused})
    if refusals:
        lines += ["", "Reuse refused (cold prefill instead), first few:", ""]
        lines += [f"- {x}" for x in refusals[:8]]
    numerics = [(f"{v.label}{arm}", r) for v in verdicts
                for arm, reqs in (("", v.requests), (" (plain arm)", v.plain or ())) for r in reqs
                if r.verdict == "numerics"]
    if numerics:
        order = {"witness": 0, "not replayed": 1}  # flips first: they carry the witness's evidence
        numerics.sort(key=lambda t: order.get((t[1].judgement or {}).get("basis") or "", 2))
        lines += ["", f"Numerics (warm ≠ cold by arithmetic alone), {len(numerics)} requests, flips first, "
                  "first few:", ""]
        for label, r in numerics[:6]:
            j = r.judgement or {}
            ev = [e for e in j.get("evidence") or [] if e and e not in (r.numerics or "")][:3]
            lines.append(f"- {label}: {r.numerics}" + "".join(f"\n  - {e}" for e in ev))
    if any(v.plain is not None for v in verdicts):
        lines += render_paired(paired_summary(verdicts), verdicts)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- with and without speculation

CELLS = ("spec_warm", "spec_cold", "plain_warm", "plain_cold")
# ratio name -> (numerator cell, denominator cell)
RATIOS: dict[str, tuple[str, str]] = {
    "spec/plain warm": ("spec_warm", "plain_warm"),
    "spec/plain cold": ("spec_cold", "plain_cold"),
    "warm/cold spec": ("spec_warm", "spec_cold"),
    "warm/cold plain": ("plain_warm", "plain_cold"),
}


def _arm_hits(reqs: Sequence[RequestVerdict]) -> dict[str, Any]:
    later = [r for r in reqs if r.index > 0]
    prompt = sum(r.prompt_tokens for r in later)
    reused = sum(r.target_reused for r in later)
    return {"prefix_hit_rate": (reused / prompt) if prompt else None, "prompt_tokens": prompt,
            "reused_tokens": reused, "requests_reusing": sum(1 for r in later if r.target_reused),
            "later_requests": len(later)}


def ttft_cells(verdicts: Sequence[SessionVerdict]) -> list[dict[str, Any]]:
    """One row per request after the first that has all four cells: its times to first token
    (``spec_warm``, ``spec_cold``, ``plain_warm``, ``plain_cold``, seconds) and both prompts' lengths."""
    rows = []
    for v in verdicts:
        plain = {r.index: r for r in v.plain or ()}
        for r in v.requests:
            q = plain.get(r.index)
            if r.index == 0 or q is None:
                continue
            cells = {"spec_warm": r.ttft_warm_s, "spec_cold": r.ttft_cold_s,
                     "plain_warm": q.ttft_warm_s, "plain_cold": q.ttft_cold_s}
            if all(t is not None and t > 0 for t in cells.values()):
                rows.append({"label": v.label, "index": r.index, "kind": r.kind, **cells,
                             "spec_prompt_tokens": r.prompt_tokens, "plain_prompt_tokens": q.prompt_tokens})
    return rows


def paired_ratio(rows: Sequence[dict[str, Any]], num: str, den: str) -> dict[str, Any] | None:
    """The per-request ratio ``num / den``: median, 95 % percentile-bootstrap interval of the
    median (``reports.stats.median_ratio``) and the two-sided Wilcoxon signed-rank p of the log
    ratios against 0 (``scipy.stats.wilcoxon``; None under 6 pairs or when all are equal)."""
    import math

    from reports.stats import median_ratio

    ratios = [float(r[num]) / float(r[den]) for r in rows]
    if not ratios:
        return None
    ci = median_ratio(ratios)
    p = None
    logs = [math.log(x) for x in ratios]
    if len(logs) >= 6 and any(x != 0 for x in logs):
        from scipy.stats import wilcoxon

        p = float(wilcoxon(logs).pvalue)
    return {"n": ci.n, "median": ci.median, "low": ci.low, "high": ci.high, "confidence": ci.confidence,
            "wilcoxon_p": p, "method": ci.method + "; Wilcoxon signed-rank on log ratios"}


def paired_summary(verdicts: Sequence[SessionVerdict]) -> dict[str, Any]:
    """The report with and without speculation (module docstring): per arm the warm ≡ cold
    count and the prefix-hit rate; the four TTFT cells' medians and the paired ratios."""
    import statistics as st

    ran = [v for v in verdicts if v.plain is not None]
    rows = ttft_cells(ran)
    arms = {
        "spec": {"sessions": len(ran), "identical": sum(v.spec_identical for v in ran),
                 "numerics": sum(v.spec_verdict == "numerics" for v in ran),
                 "logic": sum(v.spec_verdict == "logic" for v in ran),
                 **_arm_hits([r for v in ran for r in v.requests])},
        "plain": {"sessions": len(ran), "identical": sum(v.plain_identical for v in ran),
                  "numerics": sum(v.plain_verdict == "numerics" for v in ran),
                  "logic": sum(v.plain_verdict == "logic" for v in ran),
                  **_arm_hits([r for v in ran for r in v.plain or ()])},
    }
    by_pair: dict[str, dict[str, Any]] = {}
    for pair in dict.fromkeys(_pair_of(v.label) for v in ran):
        vs = [v for v in ran if _pair_of(v.label) == pair]
        prs = [r for r in rows if _pair_of(r["label"]) == pair]
        by_pair[pair] = {
            "spec_hit_rate": _arm_hits([r for v in vs for r in v.requests])["prefix_hit_rate"],
            "plain_hit_rate": _arm_hits([r for v in vs for r in v.plain or ()])["prefix_hit_rate"],
            "pairs": len(prs),
            **{f"{name} median": (st.median(r[a] / r[b] for r in prs) if prs else None)
               for name, (a, b) in RATIOS.items()},
        }
    return {
        "arms": arms,
        "by_pair": by_pair,
        "pairs": len(rows),
        "same_prompt": sum(r["spec_prompt_tokens"] == r["plain_prompt_tokens"] for r in rows),
        "ttft_median_s": {c: (st.median(r[c] for r in rows) if rows else None) for c in CELLS},
        "ratios": {name: paired_ratio(rows, a, b) for name, (a, b) in RATIOS.items()},
        "rows": rows,
    }


def _pair_of(label: str) -> str:
    """The pair part of a session label (``<pair>/<session name>``)."""
    return label.rsplit("/", 1)[0]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f} ms"


def render_paired(p: dict[str, Any], verdicts: Sequence[SessionVerdict]) -> list[str]:
    lines = ["", "## With and without speculation (paired)", "",
             "The same sessions under plain decode through the same prompt cache "
             "(`PlainPromptCacheSession`), each request warm and cold; time to first token over the "
             f"{p['pairs']} requests after the first with all four cells ({p['same_prompt']} with the same "
             "prompt in both arms: a follow-up carries each arm's own answer). Figures, not a benchmark.", "",
             "| arm | sessions warm ≡ cold | prefix-hit rate | requests reusing | TTFT warm (median) | "
             "TTFT cold (median) | warm/cold (median, 95 % CI) |", "|---|---|---|---|---|---|---|"]
    for arm in ("spec", "plain"):
        a, r = p["arms"][arm], p["ratios"][f"warm/cold {arm}"]
        hit = a["prefix_hit_rate"]
        nx = f" ({a['numerics']} numerics, {a['logic']} logic)" if a["numerics"] else ""
        lines.append(f"| {arm} | {a['identical']}/{a['sessions']}{nx} | {'-' if hit is None else f'{hit:.1%}'} | "
                     f"{a['requests_reusing']}/{a['later_requests']} | {_ms(p['ttft_median_s'][f'{arm}_warm'])} | "
                     f"{_ms(p['ttft_median_s'][f'{arm}_cold'])} | {_ratio(r)} |")
    lines += ["", "| paired ratio | median | 95 % CI (bootstrap) | Wilcoxon p | pairs |", "|---|---|---|---|---|"]
    for name, r in p["ratios"].items():
        if r is None:
            lines.append(f"| {name} | - | - | - | 0 |")
            continue
        wp = "-" if r["wilcoxon_p"] is None else f"{r['wilcoxon_p']:.2g}"
        lines.append(f"| {name} TTFT | {r['median']:.2f} | [{r['low']:.2f}, {r['high']:.2f}] | {wp} | {r['n']} |")
    lines += ["", "By pair (prefix-hit rate per arm; medians of the paired TTFT ratios):", "",
              "| pair | spec hit | plain hit | spec/plain warm | spec/plain cold | warm/cold spec | "
              "warm/cold plain | pairs |", "|---|---|---|---|---|---|---|---|"]
    for pair, b in p["by_pair"].items():
        cells = [("-" if b[k] is None else f"{b[k]:.1%}") for k in ("spec_hit_rate", "plain_hit_rate")]
        cells += [("-" if b[f"{n} median"] is None else f"{b[f'{n} median']:.2f}") for n in RATIOS]
        lines.append(f"| {pair} | {' | '.join(cells)} | {b['pairs']} |")
    bad = [v for v in verdicts if v.plain is not None and v.plain_verdict == "logic"]
    if bad:
        lines += ["", "Plain arm DIVERGENT (warm ≠ cold):", ""]
        lines += [f"- {v.label}: {v.plain_first_divergence}" for v in bad]
    return lines


def _ratio(r: dict[str, Any] | None) -> str:
    return "-" if r is None else f"{r['median']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"


def write(out_dir: Path, verdicts: Sequence[SessionVerdict],
          reference: Sequence[dict[str, Any]] = ()) -> str:
    from traces.io import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    text = render(verdicts) + (render_reference(reference) if reference else "")
    data = {"summary": summary(verdicts),
            "sessions": [{**asdict(v), "identical": v.identical, "verdict": v.verdict} for v in verdicts],
            "reference": list(reference)}
    if any(v.plain is not None for v in verdicts):
        data["paired"] = paired_summary(verdicts)
    from specparity.cli.outdir import track  # listed in --out's marker before it is written

    atomic_write_text(track(out_dir / "sessions.json"), json.dumps(data, indent=1) + "\n")
    atomic_write_text(track(out_dir / "sessions.md"), text)
    return text


def main_sessions(cases: Sequence[Case], out_dir: Path, *, quiet: bool = False,
                  names: Sequence[str] | None = None, reference: bool = True, plain: bool = True) -> int:
    """``specparity run --sessions``: exit 0 when every ENGINE session is warm ≡ cold, else 1
    (``plain``: the plain arm too, both arms warm ≡ cold; the paired report). Where the
    backend is not bit-exact, ``numerics`` passes and only ``logic`` fails.

    The reference's sessions are reported beside (its divergences are known entries:
    ``mlx-lm-prompt-cache-*`` in ``traces/known_divergences.toml``), never failing the run."""
    import sys

    t0 = time.perf_counter()

    def say(label: str) -> None:
        if not quiet:
            print(f"session {label}", file=sys.stderr)

    verdicts = sessions_from_cases(cases, names, say, trace_dir=out_dir / "traces" / "sessions", plain=plain)
    ref_rows: list[dict[str, Any]] = []
    if reference:
        from specparity.runners.registry import availability

        ok, why = availability(REFERENCE)
        if ok:
            say(f"reference {REFERENCE}")
            ref_rows = reference_sessions(cases, names)
        elif not quiet:
            print(f"- reference {REFERENCE} skipped: {why}", file=sys.stderr)
    text = write(out_dir, verdicts, ref_rows)
    print(text)
    print(f"sessions written to {out_dir}/sessions.md ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    # a session unsupported on this backend is its verdict, not a divergence; all unsupported: 1
    return 0 if any(not v.unsupported for v in verdicts) and all(v.ok or v.unsupported
                                                                 for v in verdicts) else 1


__all__ = ["SESSIONS", "RequestVerdict", "SessionVerdict", "check_sessions", "compare_records",
           "headline", "main_sessions", "request_reach",
           "next_prompt", "paired_ratio", "paired_summary", "reference_sessions", "run_session",
           "sessions_from_cases", "summary", "ttft_cells", "zoo_session_cases"]


# --------------------------------------------------------------------------- the reference

REFERENCE = "mlx_lm_prompt_cache"


def reference_sessions(cases: Sequence[Case], names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """mlx-lm's own prompt-cache path (``oracles/mlx_lm_prompt_cache.py``) on the two-model groups of
    ``cases``, with the draft model and without (the control); one row per (group, session, lane)."""
    from oracles import mlx_lm_prompt_cache as ref
    from specparity.runners import case_paths

    groups: dict[tuple[Any, ...], list[Case]] = {}
    for c in cases:
        if c.drafter is not None and c.source == "two-model" and c.kv_bits is None:
            groups.setdefault(_group_key(c), []).append(c)
    rows: list[dict[str, Any]] = []
    for group in groups.values():
        c0 = group[0]
        tp, dp = case_paths(c0)
        ids = [_prompt_ids(c) for c in group]
        for name in names or SESSIONS:
            if name == "eos":
                continue  # the reference stops on its tokenizer's EOS set only
            for plain in (False, True):
                got = run_supported(lambda: ref.run_session(  # noqa: B023
                    str(tp), str(dp), SESSIONS[name], ids[0], ids[1:], next_prompt,  # noqa: B023
                    gamma=c0.gamma, max_tokens=c0.max_tokens, temperature=c0.temperature,  # noqa: B023
                    seed=c0.seed, plain=plain), f"reference session {_label(c0)}/{name}")  # noqa: B023
                if isinstance(got, Unsupported):
                    rows.append({"label": f"{_label(c0)}/{name}", "lane": "plain" if plain else "spec",
                                 "compared": False, "identical": False, "tokens_identical": False,
                                 "unsupported": got.text, "first_divergence": got.text, "requests": []})
                    continue
                reqs = got
                cold_error = next((r["cold_error"] for r in reqs if r["cold_error"]), None)
                rows.append({"label": f"{_label(c0)}/{name}", "lane": "plain" if plain else "spec",
                             "compared": cold_error is None,
                             "identical": all(r["identical"] for r in reqs),
                             "tokens_identical": all(r["tokens_identical"] for r in reqs),
                             "first_divergence": next((f"request {r['index']} ({r['kind']}): {r['divergence']}"
                                                       for r in reqs if r["divergence"]), None),
                             "requests": reqs})
    return rows


def render_reference(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["", f"## Reference: mlx-lm's prompt cache ({REFERENCE}: LRUPromptCache + stream_generate)", ""]
    for lane in ("spec", "plain"):
        rs = [r for r in rows if r["lane"] == lane and r["compared"]]
        skipped = sum(1 for r in rows if r["lane"] == lane and not r["compared"])
        if not rs:
            continue
        bad = sum(not r["identical"] for r in rs)
        tok = sum(not r["tokens_identical"] for r in rs)
        lines.append(f"- {lane}: {bad}/{len(rs)} sessions warm ≠ cold ({bad / len(rs):.0%}); "
                     f"{tok}/{len(rs)} with different tokens or an error"
                     + (f"; {skipped} not compared (the cold run itself refused)" if skipped else ""))
    lines += ["", "| session | lane | verdict | first divergence |", "|---|---|---|---|"]
    for r in rows:
        verdict = "not compared" if not r["compared"] else ("warm ≡ cold" if r["identical"] else "DIVERGENT")
        lines.append(f"| {r['label']} | {r['lane']} | {verdict} | "
                     f"{r['first_divergence'] or ''} |")
    return "\n".join(lines) + "\n"


def suite_sessions(path: str | Path) -> list[str] | None:
    """The suite's top-level ``sessions`` key (``run --suite`` then runs prompt-cache sessions,
    docs/prompt-cache.md): ``true`` (every session), a list of session names, or absent (None)."""
    from specparity.cases.suite import SuiteError

    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None  # load_suite reports it in its own words
    v = data.get("sessions")
    if v is None or v is False:
        return None
    if v is True:
        return list(SESSIONS)
    if not isinstance(v, list) or not v or any(n not in SESSIONS for n in v):
        raise SuiteError(f"suite {path}: 'sessions' must be true or a list of {sorted(SESSIONS)}, got {v!r}")
    return list(v)
