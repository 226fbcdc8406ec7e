"""The checks a subject (a third-party speculative engine) is graded on.

Every check takes the subject's ``generate(case) -> SubjectRun`` and the
references as plain callables, so each one is exercised model-free on fake
subjects with planted bugs (``tests/test_subjects_checks.py``). The contract is
``../shared/reference/speculative-decoding.md`` §2 (exact-match greedy verify is
token-identical to plain decode; EOS is never emitted as content, ends
generation, is counted once, finish reason ``stop``; the budget is exact,
finish reason ``length``) and the footer counter definitions of
``traces/INTERPRETING.md``.

- ``identity``: greedy output equals plain greedy decode of the same target on
  the same device (our engine's ``plain_generate``), token for token over the
  tokens both produced (lengths are judged by ``budget`` / ``eos``).
- ``mlx_lm``: two-model subjects only: the whole output equals mlx-lm 0.32.2
  ``speculative_generate_step`` on the same pair (``oracles/mlx_lm.py``).
- ``budget``: with no EOS in reach, exactly ``max_tokens`` tokens, finish
  ``length``; several budgets so the limit falls inside a round.
- ``eos``: an EOS id planted at a token plain decode emits at position j (first
  occurrence): output is plain[:j], the EOS never appears in the stream, an
  engine token count (when exposed) counts it at most once, finish ``stop``.
  A subject whose API exposes no finish reason (``finish_reason`` None) is
  judged on its stream alone.
- ``stop``: a stop token id planted the same way: nothing after it (the stop
  token itself may or may not be kept), finish ``stop``.
- ``counters``: the engine's own counters agree with its stream: per round
  0 <= accepted <= drafted and committed <= accepted + 1; committed tokens sum
  to the stream length; totals (drafted, accepted, rounds, emitted) equal the
  per-round sums.
- ``distribution``: at temperature > 0 the joint law of the first two tokens
  equals plain sampling (chi-square homogeneity, the test of
  ``conformance/test_losslessness_stats.py``: N = 300 per arm, cells with
  expected count < 5 pooled, alpha = 0.01).
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from subjects.base import SubjectCase, SubjectRun, SubjectUnsupported

CHECKS = ("identity", "mlx_lm", "budget", "eos", "stop", "counters", "distribution")
Generate = Callable[[SubjectCase], SubjectRun]
Reference = Callable[[SubjectCase], list[int]]

DIST_N = 300
DIST_ALPHA = 0.01
BUDGETS = (1, 2, 5, 9)


@dataclass
class CheckResult:
    check: str
    status: str  # "pass" | "fail" | "unsupported"
    detail: str
    case: str | None = None
    divergence: dict[str, Any] | None = None
    cases_run: int = 0
    hooks: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, the shorter length when one is a prefix, or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _show(seq: Sequence[int], i: int, width: int = 4) -> str:
    lo = max(0, i - width)
    return ("…" if lo else "") + str(list(seq[lo : i + width + 1])) + ("…" if i + width + 1 < len(seq) else "")


def _fail(check: str, case: SubjectCase, msg: str, n: int, hooks: list[str], **div: Any) -> CheckResult:
    return CheckResult(check, "fail", msg, case=case.case_id, divergence=div or None, cases_run=n, hooks=hooks)


def _unsupported(check: str, why: str, n: int = 0) -> CheckResult:
    return CheckResult(check, "unsupported", why, cases_run=n)


class SubjectCrashed(RuntimeError):
    """The subject raised on a case (its exception is the finding)."""

    def __init__(self, case: SubjectCase, exc: BaseException) -> None:
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].filename.split('site-packages/')[-1]}:{tb[-1].lineno}" if tb else ""
        msg = " ".join(str(exc).split())
        msg = msg if len(msg) <= 240 else msg[:240] + "…"
        super().__init__(f"raised {type(exc).__name__}: {msg}{where}")
        self.case = case


def _run(gen: Generate, case: SubjectCase) -> SubjectRun:
    try:
        return gen(case)
    except SubjectUnsupported:
        raise
    except Exception as exc:  # noqa: BLE001 - the subject's own crash, kept with its case
        raise SubjectCrashed(case, exc) from exc


def plant(ref_full: Sequence[int], start: int = 3) -> int | None:
    """A position j >= start whose token does not occur earlier in ``ref_full``."""
    for j in range(start, len(ref_full)):
        if ref_full[j] not in ref_full[:j]:
            return j
    return None


@dataclass
class _Tally:
    """One check's runs so far: how many, and the subject's hooks on the last one."""

    check: str
    n: int = 0
    hooks: list[str] = field(default_factory=list)

    def fail(self, case: SubjectCase, msg: str, **div: Any) -> CheckResult:
        return _fail(self.check, case, msg, self.n, self.hooks, **div)

    def passed(self, detail: str) -> CheckResult:
        return CheckResult(self.check, "pass", detail, cases_run=self.n, hooks=self.hooks)


Judge = Callable[[SubjectCase, SubjectRun, Any, _Tally], CheckResult | None]


def _each_run(check: str, gen: Generate, planned: Iterable[tuple[SubjectCase, Any]], judge: Judge,
              none: str = "no case") -> tuple[CheckResult | None, _Tally]:
    """The loop every per-case check shares: run the subject on each planned ``(case, context)``
    in turn (``planned`` is consumed lazily, so a reference call that plans a case happens just
    before the subject's run of it) and let ``judge(case, run, context, tally)`` return a failure
    or None. Ends at the first failure, or unsupported: the subject declined a case (with the runs
    so far), or no case was run (``none``). ``(None, tally)`` when every run was judged sound."""
    t = _Tally(check)
    for case, ctx in planned:
        try:
            run = _run(gen, case)
        except SubjectUnsupported as exc:
            return _unsupported(check, str(exc), t.n), t
        t.n += 1
        t.hooks = run.hooks
        bad = judge(case, run, ctx, t)
        if bad is not None:
            return bad, t
    if t.n == 0:
        return _unsupported(check, none), t
    return None, t


def check_identity(gen: Generate, plain: Reference, cases: Iterable[SubjectCase]) -> CheckResult:
    def judge(case: SubjectCase, run: SubjectRun, _: Any, t: _Tally) -> CheckResult | None:
        ref = plain(case)
        k = min(len(run.stream), len(ref))
        i = first_divergence(run.stream[:k], ref[:k])
        if i is not None:
            return t.fail(case, f"output token {i}: subject {run.stream[i]} vs plain {ref[i]} "
                          f"(subject {_show(run.stream, i)}, plain {_show(ref, i)})",
                          index=i, subject=run.stream[i], expected=ref[i])
        return None

    res, t = _each_run("identity", gen, ((c, None) for c in cases), judge)
    return res or t.passed(f"{t.n} case(s) token-identical to plain greedy decode")


RefRounds = Callable[[SubjectCase], list[tuple[list[int], int, list[int]]]]


def check_mlx_lm(gen: Generate, reference: Reference | None, cases: Iterable[SubjectCase],
                 why_not: str = "not a two-model subject", rounds: RefRounds | None = None) -> CheckResult:
    """Output identical to mlx-lm's; round for round (drafts, accepted, emitted) when both expose rounds."""
    if reference is None:
        return _unsupported("mlx_lm", why_not)
    by_round = 0

    def judge(case: SubjectCase, run: SubjectRun, _: Any, t: _Tally) -> CheckResult | None:
        nonlocal by_round
        ref = reference(case)
        i = first_divergence(run.stream, ref)
        if i is not None:
            a = run.stream[i] if i < len(run.stream) else "<end>"
            b = ref[i] if i < len(ref) else "<end>"
            return t.fail(case, f"output token {i}: subject {a} vs mlx-lm {b} "
                          f"(subject {len(run.stream)} tokens, mlx-lm {len(ref)})",
                          index=i, subject=a, expected=b)
        if rounds is None or not run.rounds or any(r.drafts is None for r in run.rounds) or run.prefill_tokens:
            return None  # rounds compared only under mlx-lm's tail-split prefill (no token from the prefill)
        ref_rounds, pos = rounds(case), run.prefill_tokens
        by_round += 1
        for k, (r, (drafts, acc, emitted)) in enumerate(zip(run.rounds, ref_rounds, strict=False)):
            mine = (list(r.drafts or []), r.accepted, run.stream[pos : pos + r.committed])
            pos += r.committed
            for field_name, x, y in zip(("drafts", "accepted", "emitted"), mine, (drafts, acc, emitted),
                                        strict=True):
                if x != y:
                    return t.fail(case, f"round {k} {field_name}: subject {x} vs mlx-lm {y}",
                                  index=k, subject=x, expected=y)
        if len(run.rounds) != len(ref_rounds):
            return t.fail(case, f"{len(run.rounds)} rounds vs mlx-lm {len(ref_rounds)}",
                          subject=len(run.rounds), expected=len(ref_rounds))
        return None

    res, t = _each_run("mlx_lm", gen, ((c, None) for c in cases), judge)
    how = f", {by_round} of them round for round" if by_round else ""
    return res or t.passed(f"{t.n} case(s) identical to mlx-lm speculative decoding{how}")


def check_budget(gen: Generate, plain: Reference, cases: Iterable[SubjectCase],
                 budgets: Sequence[int] = BUDGETS) -> CheckResult:
    def planned() -> Iterator[tuple[SubjectCase, int]]:
        for base in cases:
            for m in budgets:
                case = base.with_(max_tokens=m, eos_ids=())
                if len(plain(case)) == m:  # the reference itself must run to the budget
                    yield case, m

    def judge(case: SubjectCase, run: SubjectRun, m: int, t: _Tally) -> CheckResult | None:
        if len(run.stream) != m:
            return t.fail(case, f"max_tokens={m}: {len(run.stream)} tokens emitted "
                          f"(finish_reason {run.finish_reason!r})",
                          index=min(m, len(run.stream)), subject=len(run.stream), expected=m)
        if run.finish_reason not in ("length", None):  # None: the API exposes no finish reason
            return t.fail(case, f"max_tokens={m} reached but finish_reason is "
                          f"{run.finish_reason!r}, not 'length'", subject=run.finish_reason, expected="length")
        return None

    res, t = _each_run("budget", gen, planned(), judge)
    return res or t.passed(f"{t.n} run(s) at budgets {list(budgets)}: exactly max_tokens, finish 'length'")


def _planted(plain: Reference, cases: Iterable[SubjectCase], start: int,
             at: Callable[[SubjectCase, int], SubjectCase]) -> Iterator[tuple[SubjectCase, tuple[list[int], int]]]:
    """Each base case's plain output (no EOS) and a position ``j`` to plant a token at
    (:func:`plant`); the case ``at(base, full[j])`` to run. Bases with no such position are skipped."""
    for base in cases:
        full = plain(base.with_(eos_ids=()))
        j = plant(full, start)
        if j is not None:
            yield at(base, full[j]), (full, j)


def check_eos(gen: Generate, plain: Reference, cases: Iterable[SubjectCase]) -> CheckResult:
    def judge(case: SubjectCase, run: SubjectRun, ctx: tuple[list[int], int], t: _Tally) -> CheckResult | None:
        full, j = ctx
        e = full[j]
        expect = list(full[:j])
        if e in run.stream:
            at = run.stream.index(e)
            how = ("as the final token (it stops right after it; the tokens before it equal plain decode)"
                   if run.stream == expect + [e] else f"as output token {at} (stream {_show(run.stream, at)})")
            return t.fail(case, f"EOS id {e} emitted {how}", index=at, subject=e, expected=None)
        i = first_divergence(run.stream, expect)
        if i is not None:
            return t.fail(case, f"EOS {e} planted at plain position {j}: output differs at token {i} "
                          f"({len(run.stream)} tokens, expected {len(expect)})",
                          index=i, subject=len(run.stream), expected=len(expect))
        counted = run.counters.get("generation_tokens")
        if counted is not None and counted not in (j, j + 1):
            return t.fail(case, f"engine counts {counted} generated tokens for {j} content tokens "
                          "+ 1 EOS (EOS counted more than once)", subject=counted, expected=j + 1)
        if run.finish_reason not in ("stop", None):
            return t.fail(case, f"ended on EOS but finish_reason is {run.finish_reason!r}, not 'stop'",
                          subject=run.finish_reason, expected="stop")
        return None

    planned = _planted(plain, cases, 3, lambda base, e: base.with_(eos_ids=(e,)))
    res, t = _each_run("eos", gen, planned, judge, none="no case with a plantable EOS")
    return res or t.passed(f"{t.n} case(s): stops at the planted EOS, never emitted, finish 'stop'")


def check_stop(gen: Generate, plain: Reference, cases: Iterable[SubjectCase]) -> CheckResult:
    def judge(case: SubjectCase, run: SubjectRun, ctx: tuple[list[int], int], t: _Tally) -> CheckResult | None:
        full, j = ctx
        s = full[j]
        if run.stream not in (list(full[:j]), list(full[: j + 1])):
            i = first_divergence(run.stream, full[: j + 1])
            return t.fail(case, f"stop id {s} planted at plain position {j}: {len(run.stream)} tokens "
                          f"emitted, expected {j} or {j + 1}; first difference at token {i}",
                          index=i, subject=len(run.stream), expected=j + 1)
        if run.finish_reason not in ("stop", None):
            return t.fail(case, f"stopped on a stop id but finish_reason is {run.finish_reason!r}",
                          subject=run.finish_reason, expected="stop")
        return None

    planned = _planted(plain, cases, 4, lambda base, s: base.with_(eos_ids=(), stop_ids=(s,)))
    res, t = _each_run("stop", gen, planned, judge, none="no case with a plantable stop id")
    return res or t.passed(f"{t.n} case(s): ends at the stop id, finish 'stop'")


def counter_problems(run: SubjectRun) -> list[str]:
    """Every disagreement between the engine's own counters and its stream."""
    out: list[str] = []
    c = run.counters
    if run.rounds is not None:
        for i, r in enumerate(run.rounds):
            if not 0 <= r.accepted <= r.drafted:
                out.append(f"round {i}: accepted {r.accepted} outside 0..drafted {r.drafted}")
            if r.committed > r.accepted + 1:
                out.append(f"round {i}: committed {r.committed} > accepted {r.accepted} + 1")
            if r.drafts is not None and len(r.drafts) != r.drafted:
                out.append(f"round {i}: {len(r.drafts)} draft tokens reported but drafted={r.drafted}")
        total = sum(r.committed for r in run.rounds) + run.prefill_tokens
        if total != len(run.stream):
            pre = f" (+ {run.prefill_tokens} from the prefill)" if run.prefill_tokens else ""
            out.append(f"rounds report {total - run.prefill_tokens} committed tokens{pre} but the stream "
                       f"has {len(run.stream)}")
        sums = {"drafted": sum(r.drafted for r in run.rounds), "accepted": sum(r.accepted for r in run.rounds),
                "rounds": len(run.rounds)}
        for key, v in sums.items():
            if key in c and c[key] != v:
                out.append(f"engine counter {key}={c[key]} but its rounds sum to {v}")
    reported = run.extra.get("reported_ids")
    if reported is not None and list(reported) != list(run.stream):
        i = first_divergence(list(reported), list(run.stream))
        out.append(f"the engine's own record of its output differs from its stream at token {i} "
                   f"({len(reported)} vs {len(run.stream)} tokens)")
    if "generation_tokens" in c and c["generation_tokens"] not in (len(run.stream), len(run.stream) + 1):
        out.append(f"engine counts generation_tokens={c['generation_tokens']} for a stream of "
                   f"{len(run.stream)} tokens (at most one EOS step may be added)")
    if "emitted" in c and c["emitted"] != len(run.stream):
        out.append(f"engine counter emitted={c['emitted']} but the stream has {len(run.stream)} tokens")
    if "rejected" in c and "accepted" in c and "drafted" in c and c["accepted"] + c["rejected"] > c["drafted"]:
        out.append(f"engine counters accepted={c['accepted']} + rejected={c['rejected']} exceed "
                   f"drafted={c['drafted']}")
    if "accepted" in c and "drafted" in c and not 0 <= c["accepted"] <= c["drafted"]:
        out.append(f"engine counters accepted={c['accepted']} outside 0..drafted={c['drafted']}")
    return out


def check_counters(gen: Generate, cases: Iterable[SubjectCase]) -> CheckResult:
    seen = False
    none = "the engine exposes no acceptance counters or per-round reports"

    def judge(case: SubjectCase, run: SubjectRun, _: Any, t: _Tally) -> CheckResult | None:
        nonlocal seen
        if run.rounds is None and not run.counters:
            return None
        seen = True
        probs = counter_problems(run)
        return t.fail(case, "; ".join(probs[:3]), problems=probs[:10]) if probs else None

    res, t = _each_run("counters", gen, ((c, None) for c in cases), judge, none=none)
    if res is None and not seen:
        return _unsupported("counters", none, t.n)
    return res or t.passed(f"{t.n} run(s): engine counters agree with its stream")


def chi2_p_value(a: Counter, b: Counter) -> float:
    """Chi-square homogeneity p-value, cells with expected count < 5 pooled (as the engine's test)."""
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b))
    total = sum(a.values()) + sum(b.values())
    small = min(sum(a.values()), sum(b.values()))
    big = [k for k in keys if (a[k] + b[k]) * small / total >= 5]
    rows = [
        [a[k] for k in big] + [sum(a[k] for k in keys if k not in big)],
        [b[k] for k in big] + [sum(b[k] for k in keys if k not in big)],
    ]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    if len(rows[0]) < 2:
        return 1.0
    return float(chi2_contingency(rows)[1])


def check_distribution(gen: Generate, plain_sample: Reference | None, case: SubjectCase | None,
                       n: int = DIST_N, alpha: float = DIST_ALPHA, why_not: str = "") -> CheckResult:
    if plain_sample is None or case is None:
        return _unsupported("distribution", why_not or "the subject does not sample")
    spec: Counter = Counter()
    plain: Counter = Counter()
    hooks: list[str] = []
    try:
        for s in range(n):
            run = _run(gen, case.with_(seed=s, max_tokens=2, eos_ids=()))
            hooks = run.hooks
            spec[tuple(run.stream[:2])] += 1
    except SubjectUnsupported as exc:
        return _unsupported("distribution", str(exc))
    for s in range(n, 2 * n):
        plain[tuple(plain_sample(case.with_(seed=s, max_tokens=2, eos_ids=()))[:2])] += 1
    if len(spec | plain) < 3:
        return _unsupported("distribution", "degenerate outcome space (< 3 outcomes): no power")
    p = chi2_p_value(spec, plain)
    if p < alpha:
        worst = max(set(spec) | set(plain), key=lambda k: abs(spec[k] - plain[k]))
        return _fail("distribution", case, f"joint law of the first 2 tokens differs from plain sampling: "
                     f"p={p:.2e} < {alpha} (N={n} per arm; largest gap {list(worst)}: subject "
                     f"{spec[worst]} vs plain {plain[worst]})", n, hooks, p=p)
    return CheckResult("distribution", "pass", f"p={p:.3f} >= {alpha} (N={n} per arm, "
                       f"T={case.temperature}, top_k={case.top_k})", cases_run=n, hooks=hooks)


def guarded(check: str, fn: Callable[[], CheckResult]) -> CheckResult:
    """Run one check; an exception from the subject is a failure with its exact error."""
    try:
        return fn()
    except SubjectUnsupported as exc:
        return _unsupported(check, str(exc))
    except SubjectCrashed as exc:
        return CheckResult(check, "fail", str(exc), case=exc.case.case_id)
    except Exception as exc:  # noqa: BLE001 - the subject's own crash is the finding
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].filename.split('site-packages/')[-1]}:{tb[-1].lineno}" if tb else ""
        return CheckResult(check, "fail", f"raised {type(exc).__name__}: {exc}{where}")
