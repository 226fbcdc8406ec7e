"""``specparity run``: the main job.

Runs the engine and every available oracle on the cases — the zoo matrix (the
built-in default suite), a user's pair or a TOML suite (``specparity/cases/suite.py``)
— on one of the backends of ``specparity/cli/pool.py`` (in process, a ``spawn``
process pool, or Ray, as ``specparity regen``; the same task function, so identical
traces), writes one trace per (runner, case) under ``OUT/traces/<runner>/``, compares them — engine vs
each oracle round for round, engine speculative vs engine plain at the token
level — and writes the summary (``OUT/summary.md``) and the report
(``OUT/report.md``, ``OUT/report.html``; ``reports/report.py``). Exit status: 0 when every
comparison conforms, 1 when a divergence is found (a spec-vs-plain flip on a
knife-edge is ``numerics`` and is reported, not failed).

A (runner, case) whose run hits an op the backend lacks (``engine/backend.py``: MLX's
``[quantized_matmul] No implementation for problem shape ...`` on CUDA, say) is that
case's verdict, ``unsupported on <device>: <op>`` with MLX's error line, never the end of
the run: every comparison that needs its trace reads ``unsupported`` (not failed, not
identical), the summary lists them in their own section and its headline names them
(``CONFORMS (3 cases unsupported on Device(gpu, 0))``); a run where nothing could be
compared reads NOTHING COMPARED (exit 1).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from specparity.cases.case import DEFAULT_GAMMAS, Case
from specparity.cli.outdir import set_stage, track
from specparity.cli.progress import Progress
from specparity.jobs.comparison import (  # the one comparison contract (re-exported: the run's result types)
    Comparison,
    compare_supported,
    not_compared,
    numerics_witness,
    reference_comparison,
    tokens_comparison,
    unsupported_comparison,
)
from specparity.runners import run_case, runner_supports
from traces.diff import Divergence
from traces.io import Trace, atomic_write_text, write_trace
from traces.reference import ReferenceRefused


@dataclass
class RunResult:
    out_dir: Path
    runners: list[str]
    unavailable: dict[str, str]
    traces: dict[tuple[str, str], Path] = field(default_factory=dict)
    comparisons: list[Comparison] = field(default_factory=list)
    wall_s: float = 0.0
    skipped: dict[str, str] = field(default_factory=dict)  # runner -> cases it does not implement
    fill: list[dict[str, Any]] = field(default_factory=list)  # zoo.fill.run_case rows (§7 fill cases)
    # (runner, case id) -> engine.backend.unsupported_payload: runs the backend could not do
    unsupported: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    @property
    def nothing_compared(self) -> bool:
        """Some run was unsupported on this backend and no comparison was made at all (every
        one unsupported or not compared): not a conformance verdict (``reports.summary``)."""
        from reports.summary import nothing_compared

        return nothing_compared([{"verdict": c.verdict, "unsupported": c.unsupported}
                                 for c in self.comparisons])

    @property
    def ok(self) -> bool:
        return not any(c.fails for c in self.comparisons) and not self.nothing_compared


def run_task(runner: str, case: Case) -> tuple[str, Any]:
    """One (runner, case): ``("ok", records)``, ``("refused", message)`` or
    ``("unsupported", payload)`` (the backend lacks an op: ``engine.backend.unsupported_payload``).

    The one task function of every backend (in process, process pool, Ray), so
    their traces are identical; a refusal and a missing op travel as values, not
    exceptions. Any other error is raised.
    """
    from engine.backend import emulate_from_env, unsupported_payload

    emulate_from_env()  # SPECPARITY_EMULATE_MISSING_OP: the CPU test double of a missing kernel
    try:
        return "ok", run_case(runner, case)
    except ReferenceRefused as exc:
        info = unsupported_payload(exc)  # a reference that re-raised MLX's missing op as a refusal
        return ("unsupported", info) if info is not None else ("refused", exc.message)
    except (RuntimeError, ValueError) as exc:  # MLX raises a missing op as one of these
        info = unsupported_payload(exc)
        if info is None:
            raise
        return "unsupported", info


Job = tuple[str, Case]
OnResult = Callable[[Job, tuple[str, Any]], None]


def execute(jobs: list[Job], on_result: OnResult, *, workers: int = 0,
            ray_address: str | None = None) -> None:
    """Run ``run_task`` on every job and call ``on_result`` in this process as each finishes.

    ``workers=0``: here, in order; ``workers=N``: a ``spawn`` process pool (each
    worker loads its models once); ``ray_address`` not None: Ray ("" = a local
    cluster). The first task error is raised (after the results already in).
    """
    from specparity.cli.pool import execute as run_on_backend

    def done(job: Any, result: Any, exc: BaseException | None) -> None:
        if exc is not None:
            raise exc
        on_result(job, result)

    run_on_backend(run_task, jobs, done, workers=workers, ray_address=ray_address, ray_cpus=workers or None)


def available_runners(runners: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """``(["engine", available per-case references...], {skipped runner: why})``.

    Default: every reference of the registry (``specparity.runners.registry``); a named
    runner that is not available here, or not run per case (a reference exercised by its own
    conformance tests, a subject graded by ``grade --engine``), is skipped with the reason.
    """
    from specparity.runners import registry

    names = runners if runners is not None else registry.names("reference")
    available, unavailable = [], {}
    for name in names:
        if name == "engine":
            continue
        registry.get(name)  # unknown/blank names: one line naming the known runners
        ok, why = registry.run_availability(name)  # available AND run per case (else skipped, why)
        (available.append(name) if ok else unavailable.__setitem__(name, why))
    return ["engine", *available], unavailable


def skip_reasons(runners: list[str], cases: list[Case]) -> dict[str, str]:
    """``{runner: "N case(s) skipped: <first reason>"}``: cases a runner does not implement."""
    from specparity.runners.registry import unsupported

    out: dict[str, tuple[int, str]] = {}
    for r in runners:
        for c in cases:
            why = unsupported(r, c)
            if why is not None:
                n, first = out.get(r, (0, why))
                out[r] = (n + 1, first)
    return {r: f"{n} case(s) skipped: {first}" for r, (n, first) in out.items()}


def zoo_cases(
    *,
    targets: list[str] | None = None,
    drafters: list[str] | None = None,
    gammas: tuple[int, ...] = DEFAULT_GAMMAS,
    n_prompts: int = 8,
    max_tokens: int = 32,
    sampling: tuple[Any, ...] | None = None,
    eos_ids: tuple[int, ...] | None = None,
    truncate: bool = False,
    max_cases: int | None = None,
    cache: dict[str, Any] | None = None,
    grammar: str | None = None,
    reasoning_end: str = "",
) -> list[Case]:
    """The built-in default suite: zoo pairs x gammas x ``n_prompts`` zoo prompts x ``sampling``.

    Built as a suite (``specparity.cases.suite``), so the zoo matrix honours the same
    settings as a pair of one's own (sampling, EOS ids) and its prompts are
    checked against each target's context with ``max_tokens``. Unknown target
    or drafter names are refused with the known ones, never dropped.

    Plus two quantized-KV cases on each of the zoo's quantized-KV pairs, ``llama-kv``/``twin``
    (head dim 32) and ``llama-kv64``/``twin`` (head dim 64) (4-bit KV in groups of 32, one
    prompt, γ 3): converted right after the prefill
    (``quantized_kv_start`` 0: the engine and mlx-lm agree round for round) and inside
    the run (36: mlx-lm converts on the verify window's offset, the known entry
    ``mlx-lm-kv-quantized-on-unverified-offset``). Both pairs run on every backend: MLX's
    CUDA backend has no quantized-matmul kernel for the head-dim-32 pair's attention (its
    cases read ``unsupported on Device(gpu, 0): quantized_matmul``), the head-dim-64 pair
    still exercises the feature there. ``cache``
    (:func:`specparity.cli.kv_args.cache_fields`) replaces every case's cache settings.

    Plus the grammar cases (:func:`grammar_cases`): structured output under speculation
    on the JSON-capable pairs (``zoo/grammars.py``), ``grammar`` (``--grammar``) replacing
    the default grammars.
    """
    import zoo
    from specparity.cases.case import pick_prompts
    from specparity.cases.suite import PairSpec, Sampling, suite_cases
    from specparity.cli.args import zoo_drafters, zoo_targets
    from zoo.native_mtp import MATRIX, MATRIX_PROMPTS

    for names, known, what in ((targets, zoo_targets(), "target"), (drafters, zoo_drafters(), "drafter")):
        bad = [n for n in names or () if n not in known]
        if bad:
            raise ValueError(f"unknown zoo {what}(s) {', '.join(map(repr, bad))}; known: {', '.join(known)}")
    pairs = [(t, d) for (t, d) in zoo.pairs()
             if (targets is None or t in targets) and (drafters is None or d in drafters)]
    kv = [t for t in zoo.KV_TARGETS  # the quantized-KV pairs, head dim 32 and 64
          if (targets is None or t in targets) and (drafters is None or "twin" in drafters)]
    native = [(t, d) for (t, d) in MATRIX  # zoo/native_mtp.py: native-MTP targets, a few prompts
              if (targets is None or t in targets) and (drafters is None or d in drafters)]
    if not pairs and not kv and not native:
        raise ValueError(f"no zoo pair matches targets={targets} drafters={drafters}")
    common: dict[str, Any] = dict(max_tokens=max_tokens, sampling=tuple(sampling or (Sampling(),)),
                                  eos_ids=eos_ids, truncate=truncate)
    specs = [PairSpec(target=t, drafter=d, gammas=tuple(gammas), zoo_prompts=n_prompts, **common,
                      where=f"zoo pair {t}/{d}", **(cache or {}))
             for t, d in pairs]
    if kv:
        g = 3 if 3 in gammas else tuple(gammas)[-1]
        specs += [PairSpec(target=t, drafter="twin", gammas=(g,), zoo_prompts=1, **common,
                           where=f"zoo pair {t}/twin",
                           **{"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": start, **(cache or {})})
                  for t in kv for start in (0, 36)]
    prompt_ids = pick_prompts([p.id for p in zoo.prompts()], n_prompts)[:MATRIX_PROMPTS]
    native_cases = [Case(t, d, p, g, max_tokens, source="native-mtp", eos_ids=eos_ids,
                         temperature=smp.temperature, top_p=smp.top_p, top_k=smp.top_k, seed=smp.seed,
                         processors=smp.processors, min_tokens=smp.min_tokens, rng=smp.rng, min_p=smp.min_p,
                         **(cache or {}))
                    for (t, d) in native for smp in common["sampling"] for g in gammas for p in prompt_ids]
    gcases = grammar_cases(targets=targets, drafters=drafters, gammas=tuple(gammas), max_tokens=max_tokens,
                           sampling=common["sampling"], eos_ids=eos_ids, grammar=grammar, cache=cache,
                           reasoning_end=reasoning_end)
    side = side_state_cases(targets=targets, drafters=drafters, gammas=tuple(gammas), max_tokens=max_tokens,
                            eos_ids=eos_ids, cache=cache) if sampling is None else []
    # the default run: every two sampling stages combined, against mlx-lm and spec-vs-plain
    # (specparity/cases/pairwise.py)
    if targets is None and drafters is None and sampling is None and eos_ids is None and not cache \
            and not grammar:
        from specparity.cases.pairwise import pairwise_cases

        side += pairwise_cases()
    # cache settings given for the whole matrix can make the two quantized-KV cases one
    return list(dict.fromkeys([*suite_cases(specs, max_cases=max_cases), *native_cases, *gcases, *side]))


SIDE_STATE_PAIRS = (("llama", "twin"), ("gemma3", "twin"), ("qwen35", "twin"))  # KV, rotating, recurrent
SIDE_STATE_PROCESSORS = "rp1.3c16+pp0.4c16+fp0.2c16+lb5=1.5"


def side_state_cases(*, targets: list[str] | None = None, drafters: list[str] | None = None,
                     gammas: tuple[int, ...] = DEFAULT_GAMMAS, max_tokens: int = 32,
                     eos_ids: tuple[int, ...] | None = None, cache: dict[str, Any] | None = None) -> list[Case]:
    """The zoo matrix's sampler side-state cases (``engine/pipeline.py``): what a rejected round
    must leave untouched — repetition/presence/frequency penalties and a logit bias on the
    emitted history, min_tokens counted per output position, and (sampled, seeded) the draw at
    each position keyed by (seed, position) so a rejected round's draws are rewound — greedy and
    at temperature 0.8, on a KV, a rotating and a recurrent target, γ 3, two prompts; each
    compared with plain decode token for token (on a non-exact backend: through the witness)."""
    g = 3 if 3 in gammas else tuple(gammas)[-1]
    return [Case(t, d, p, g, max_tokens, temperature=temp, seed=1, processors=SIDE_STATE_PROCESSORS,
                 min_tokens=4, rng="position" if temp else "stream", eos_ids=eos_ids, **(cache or {}))
            for (t, d) in SIDE_STATE_PAIRS
            if (targets is None or t in targets) and (drafters is None or d in drafters)
            for p in ("nat-00", "rnd-00") for temp in (0.0, 0.8)]


def grammar_cases(
    *,
    targets: list[str] | None = None,
    drafters: list[str] | None = None,
    gammas: tuple[int, ...] = DEFAULT_GAMMAS,
    max_tokens: int = 32,
    sampling: tuple[Any, ...] = (),
    eos_ids: tuple[int, ...] | None = None,
    grammar: str | None = None,
    cache: dict[str, Any] | None = None,
    reasoning_end: str = "",
) -> list[Case]:
    """The zoo matrix's grammar cases (engine/grammar.py, docs/grammar.md).

    On the JSON-capable pairs (``zoo.grammars.PAIRS``: a KV, a rotating and a
    recurrent target, each with its prompt), every γ and sampling setting:
    the JSON schema ``json-small`` and the regex ``regex-sentence``, or the one
    ``grammar`` given (``--grammar``), with the matrix's budget (``json-small`` ends
    in about 30 tokens, ``regex-sentence`` within 61 characters). Compared with
    plain decode + the same grammar and with
    mlx-lm + the grammar as a logits processor (``mlx_lm_grammar``, and the stateful
    adapter shape ``mlx_lm_grammar_stateful``). ``reasoning_end`` (``--reasoning-end``):
    every grammar case free until that marker.
    """
    from specparity.cases.suite import Sampling
    from zoo import grammars as G

    grammars = (grammar,) if grammar else ("json-small", "regex-sentence")
    return [Case(t, d, p, g, max_tokens, temperature=smp.temperature, top_p=smp.top_p,
                 top_k=smp.top_k, seed=smp.seed, processors=smp.processors, min_tokens=smp.min_tokens,
                 rng=smp.rng, min_p=smp.min_p, eos_ids=eos_ids,
                 prompt_tokens=G.prompt_ids(p), grammar=gr, **(cache or {}),
                 **({"reasoning_end": reasoning_end} if reasoning_end else {}))
            for (t, d, p) in G.PAIRS
            if (targets is None or t in targets) and (drafters is None or d in drafters)
            for gr in grammars for smp in (sampling or (Sampling(),)) for g in gammas]


def check_unique(cases: list[Case]) -> list[Case]:
    """``cases`` without repeats; two different cases with one id are refused."""
    seen: dict[str, Case] = {}
    for c in dict.fromkeys(cases):
        other = seen.setdefault(c.case_id, c)
        if other is not c:
            raise ValueError(f"two different cases share the id {c.case_id!r} (same prompt id "
                             "with different tokens, or the same model under two paths?)")
    return list(seen.values())


def run(out_dir: Path, **kwargs: Any) -> RunResult:
    """:func:`run_cases` in a run directory owned by this run (``specparity.cli.outdir``).

    ``out_dir`` is probed writable and locked before any case runs (a second
    run into it is refused in one line), a directory holding files no
    specparity command wrote is refused, the outputs of an earlier run there
    are set aside, and its marker says ``complete`` only when the run finished
    (a killed run's report says INCOMPLETE).
    """
    from specparity.cases.suite import check_case_count
    from specparity.cli.args import MAX_CASES

    # Bad runner names / an empty selection / too many cases are refused before the
    # directory is touched.
    available_runners(kwargs.get("runners"))
    max_cases = kwargs.pop("max_cases", MAX_CASES)
    if kwargs.get("cases") is None:
        kwargs["cases"] = zoo_cases(max_cases=max_cases, **{
            k: kwargs[k] for k in ("targets", "drafters", "gammas", "n_prompts", "max_tokens")
            if k in kwargs})
        if kwargs.get("targets") is None and kwargs.get("drafters") is None:
            kwargs.setdefault("fill_cases", fill_cases())
    check_case_count(len(kwargs["cases"]), max_cases)
    return in_run_dir(Path(out_dir), "specparity run", lambda: run_cases(Path(out_dir), **kwargs))


def in_run_dir(out_dir: Path, command: str, work: Callable[[], RunResult]) -> RunResult:
    """``work()`` in ``out_dir`` claimed for one run; an unfinished run says INCOMPLETE.

    Whatever stops ``work`` (an error, a full disk, SIGTERM, Ctrl-C), the
    directory is left with no verdict it did not earn: the report this run
    wrote is removed and ``summary.md`` says INCOMPLETE with what was kept.
    """
    from specparity.cli.outdir import claim_output_dir

    with claim_output_dir(out_dir, command) as claim:
        try:
            return work()
        except BaseException as exc:
            _leave_incomplete(out_dir, claim, exc)
            raise


def _leave_incomplete(out_dir: Path, claim: Any, exc: BaseException) -> None:
    import contextlib

    from reports.summary import incomplete_summary
    from specparity.cli.args import Terminated

    written = set(claim.written)
    for name in ("report.md", "report.html"):  # written from state "self": they would read CONFORMS
        if name in written:
            with contextlib.suppress(OSError):
                (out_dir / name).unlink()
    if isinstance(exc, Terminated):
        why = "interrupted by SIGTERM"
    elif isinstance(exc, KeyboardInterrupt):
        why = "interrupted by Ctrl-C"
    else:
        why = f"stopped by {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    why += f" while {claim.stage}"
    n = sum(1 for w in written if w.startswith("traces/") and (out_dir / w).exists())
    kept = [f"{n} trace(s) under traces/"] if n else []
    if "comparisons.json" in written and (out_dir / "comparisons.json").exists():
        kept.append("comparisons.json")
    claim.note = (f"stopped while {claim.stage}; kept {', '.join(kept) or 'nothing'}; "
                  "summary.md says INCOMPLETE")
    try:
        claim.track(out_dir / "summary.md")
        atomic_write_text(out_dir / "summary.md", incomplete_summary(why, kept))
    except (OSError, ValueError):
        with contextlib.suppress(OSError):  # never leave a verdict behind (disk full: remove it)
            if "summary.md" in set(claim.written):
                (out_dir / "summary.md").unlink()


def run_cases(
    out_dir: Path,
    *,
    targets: list[str] | None = None,
    drafters: list[str] | None = None,
    gammas: tuple[int, ...] = DEFAULT_GAMMAS,
    n_prompts: int = 8,
    max_tokens: int = 32,
    runners: list[str] | None = None,
    cases: list[Case] | None = None,
    workers: int = 0,
    ray_address: str | None = None,
    progress: bool = True,
    fill_cases: list[Any] | None = None,
) -> RunResult:
    """Run ``cases`` (default: the zoo matrix) with the engine and every available oracle.

    Speculative cases get their plain-decode baseline added; traces are written
    by this process as each task finishes (``execute``), then compared.
    ``fill_cases`` (``zoo.fill.FillCase``, the zoo matrix's token fast-forwarding
    cases) run here, each paired with plain decode (:func:`fill_comparisons`).
    """
    t0 = time.perf_counter()
    all_runners, unavailable = available_runners(runners)
    available = all_runners[1:]
    if cases is None:
        cases = zoo_cases(targets=targets, drafters=drafters, gammas=gammas,
                          n_prompts=n_prompts, max_tokens=max_tokens)
    cases = check_unique(cases)
    specs = [c for c in cases if c.drafter is not None]
    plains = check_unique([*(c.plain() for c in specs), *(c for c in cases if c.drafter is None)])
    result = RunResult(out_dir=out_dir, runners=all_runners, unavailable=unavailable)
    traces: dict[tuple[str, str], Trace] = {}
    refusals: dict[tuple[str, str], ReferenceRefused] = {}
    paths: dict[tuple[str, str], Path] = {}
    jobs = [(r, c) for c in [*plains, *specs] for r in all_runners if runner_supports(r, c)]
    result.skipped = skip_reasons(available, [*plains, *specs])

    def on_result(job: Job, res: tuple[str, Any]) -> None:
        runner, case = job
        kind, payload = res
        if kind == "refused":
            refusals[(runner, case.case_id)] = ReferenceRefused(runner, case.case_id, payload)
        elif kind == "unsupported":  # the backend lacks an op: this case's verdict, the run goes on
            result.unsupported[(runner, case.case_id)] = payload
        else:
            path = track(out_dir / "traces" / runner / f"{case.file_stem}.jsonl")
            write_trace(path, payload)
            paths[(runner, case.case_id)] = path
            traces[(runner, case.case_id)] = Trace.from_records(payload)
        bar.update(1)

    if progress:  # the size of the work, said before it starts
        print(f"specparity run: {len(specs) + len(plains)} cases ({len(specs)} speculative, "
              f"{len(plains)} plain), "
              f"{len(jobs)} runs on {', '.join(all_runners)}", file=sys.stderr)
    set_stage(out_dir, f"running {len(jobs)} (runner, case) jobs")
    with Progress(len(jobs), "running cases", enabled=progress) as bar:
        execute(jobs, on_result, workers=workers, ray_address=ray_address)
    set_stage(out_dir, "comparing the traces")
    order = [(r, c.case_id) for r, c in jobs]
    result.traces = {k: paths[k] for k in order if k in paths}
    traces = {k: traces[k] for k in order if k in traces}

    def ref(oracle: str, case_id: str) -> Trace | ReferenceRefused:
        return refusals.get((oracle, case_id)) or traces[(oracle, case_id)]

    named: set[tuple[str, str]] = set()  # unsupported runs some comparison reads as unsupported

    def lacking(kind: str, case_id: str, *needs: tuple[str, str]) -> Comparison | None:
        """The ``unsupported`` entry of a comparison one of whose traces the backend could not make."""
        miss = [k for k in needs if k in result.unsupported]
        named.update(miss)
        return (unsupported_comparison(kind, case_id, [r for r, _ in miss], result.unsupported[miss[0]])
                if miss else None)

    witness = numerics_witness()
    for case in specs:
        eng_key = ("engine", case.case_id)
        for oracle in available:
            if runner_supports(oracle, case):
                result.comparisons.append(
                    lacking(f"engine-vs-{oracle}", case.case_id, eng_key, (oracle, case.case_id))
                    or compare_supported(f"engine-vs-{oracle}", case.case_id, ["engine", oracle],
                                         partial(reference_comparison, oracle, case.case_id, traces[eng_key],
                                                 ref(oracle, case.case_id), witness)))
        if case.temperature == 0 or case.rng == "position":  # else sampled spec and plain draw differently
            plain_key = ("engine", case.plain().case_id)
            result.comparisons.append(
                lacking("spec-vs-plain", case.case_id, eng_key, plain_key)
                or compare_supported("spec-vs-plain", case.case_id, ["engine"],
                                     partial(tokens_comparison, "spec-vs-plain", case.case_id, traces[eng_key],
                                             traces[plain_key], witness)))
        elif not any(runner_supports(o, case) for o in available):
            result.comparisons.append(lacking("reference", case.case_id, eng_key) or not_compared(case))
    for case in plains:
        for oracle in [o for o in available if runner_supports(o, case)]:
            eng_key = ("engine", case.case_id)
            result.comparisons.append(
                lacking(f"engine-vs-{oracle}", case.case_id, eng_key, (oracle, case.case_id))
                or compare_supported(f"engine-vs-{oracle}", case.case_id, ["engine", oracle],
                                     partial(reference_comparison, oracle, case.case_id, traces[eng_key],
                                             ref(oracle, case.case_id), witness)))
    result.comparisons += verify_path_comparisons(specs, traces)
    for (runner, case_id), info in result.unsupported.items():  # a run no comparison needed: listed too
        if (runner, case_id) not in named:
            result.comparisons.append(unsupported_comparison(f"{runner} run", case_id, [runner], info))
    if fill_cases:
        set_stage(out_dir, f"running {len(fill_cases)} fill cases")
        result.fill, fill_cmp = fill_comparisons(fill_cases)
        result.comparisons += fill_cmp
    result.comparisons += batched_comparisons(out_dir, cases)
    result.wall_s = time.perf_counter() - t0
    finish(result, traces)
    return result


def verify_path_comparisons(specs: list[Case], traces: dict[tuple[str, str], Trace]) -> list[Comparison]:
    """Off a bit-exact backend: which arithmetic produced the engine's verify rows
    (``engine.witness.verify_path``), one speculative case per (target, drafter, source) with
    a window of 2 or more. ``serial`` (verified position by position, not the reference's
    batched window) fails as ``logic``; rows that match no path here are reported, not failed.
    On the CPU the two paths are the same bits: nothing to check (none returned)."""
    from engine.backend import arithmetic
    from engine.witness import verify_path
    from specparity.runners import case_paths, load_model

    out: list[Comparison] = []
    seen: set[tuple[Any, ...]] = set()
    for case in specs:
        key = (case.target, case.drafter, case.source)
        trace = traces.get(("engine", case.case_id))
        if key in seen or case.gamma < 2 or trace is None or not trace.rounds:
            continue
        model = load_model(str(case_paths(case)[0])).model
        if arithmetic(model).exact:
            return []
        seen.add(key)
        v = verify_path(model, trace)
        if v.verdict == "serial":
            div = Divergence(level="round", where=f"round {v.rounds[0]['round']}", field="margins", value_a="serial",
                             value_b="batched", klass="logic", margin=None, message=str(v.deviation),
                             basis="witness")
            out.append(Comparison("verify-path", case.case_id, "round", div))
        elif v.verdict in ("batched", "indistinguishable", "no-window"):
            out.append(Comparison("verify-path", case.case_id, "round", None))
        else:
            out.append(Comparison("verify-path", case.case_id, "none", None, status="not-compared",
                                  detail=f"the recorded verify margins match neither the batched window nor "
                                         f"one-token decode replayed here: {v.rounds}"))
    return out


def batched_comparisons(out_dir: Path, cases: list[Case]) -> list[Comparison]:
    """The zoo matrix's batched cases (``specparity.jobs.batched``, docs/batched.md): for each zoo
    target of ``cases`` that batches (llama, gemma3, qwen35 with ``twin``; n-gram rows on llama),
    B = 2 and 4 rows of mixed prompt lengths finishing at different steps (at B = 4 a row joins
    mid-flight and one is preempted), every row compared round for round with its serial engine
    run; the B = 4 case reports the three invariances (M, B, seeded) per engine."""
    from specparity.jobs.batched import batched_comparisons as run_batched

    set_stage(out_dir, "running the batched cases")
    return run_batched(out_dir, cases)


def fill_cases(temperatures: tuple[float, ...] = (0.0,), max_tokens: int = 48) -> list[Any]:
    """The zoo matrix's fill cases (``zoo.fill.matrix``: strict and echo, both syntaxes), at
    each temperature (above 0 they are reported as the §7 behaviour-policy deviation)."""
    from dataclasses import replace

    from zoo.fill import matrix

    return [replace(c, temperature=t) for t in dict.fromkeys(temperatures) for c in matrix(max_tokens)]


def fill_comparisons(cases: list[Any]) -> tuple[list[dict[str, Any]], list[Comparison]]:
    """Run each fill case paired with plain decode; one ``fill-vs-plain`` comparison each:
    identical, a logic divergence (first output position named), or the behaviour-policy
    deviation at temperature > 0 (never failed, never called identical)."""
    from engine.backend import unsupported_payload
    from zoo.fill import run_case

    rows, out = [], []
    for case in cases:
        try:
            row = run_case(case)
        except (RuntimeError, ValueError) as exc:  # the backend lacks an op: this case's verdict
            info = unsupported_payload(exc)
            if info is None:
                raise
            out.append(unsupported_comparison("fill-vs-plain", case.case_id, ["engine"], info))
            continue
        rows.append(row)
        if row["verdict"] == "divergent":
            pos = row["position"]
            div = Divergence(level="tokens", where=f"output token {pos}", field="output_ids",
                             value_a=row["plain_ids"][pos] if pos < len(row["plain_ids"]) else None,
                             value_b=row["fill_ids"][pos] if pos < len(row["fill_ids"]) else None,
                             klass=row.get("class", "logic"), margin=None, message=row["message"], position=pos,
                             basis="witness" if "witness" in row else "structural")
            out.append(Comparison("fill-vs-plain", case.case_id, "tokens", div))
        elif row["verdict"] == "identical":
            out.append(Comparison("fill-vs-plain", case.case_id, "tokens", None))
        else:
            out.append(Comparison("fill-vs-plain", case.case_id, "none", None, status="not-compared",
                                  detail=row["message"]))
    return rows, out


def finish(result: RunResult, traces: dict[tuple[str, str], Trace]) -> None:
    """Write ``comparisons.json``, the report and, last, ``summary.md`` of a run or a grade.

    The summary carries the verdict, so it is written only once everything it
    summarises is on disk (until then it does not exist, and an interrupted
    run leaves it INCOMPLETE: :func:`in_run_dir`).
    """
    from reports.report import build_report
    from reports.summary import write_summary

    out_dir = result.out_dir
    set_stage(out_dir, "writing comparisons.json")
    atomic_write_text(track(out_dir / "comparisons.json"), json.dumps([
        {"kind": c.kind, "case_id": c.case_id, "level": c.level, "verdict": c.verdict,
         "fails": c.fails, "known": c.known, "message": c.message,
         "divergence": c.divergence.to_dict() if c.divergence is not None else None,
         **({"unsupported": c.unsupported} if c.unsupported is not None else {})}
        for c in result.comparisons], indent=1))
    set_stage(out_dir, "writing the report")
    build_report(out_dir, track=track)  # raises ReportError: a report failure fails the run
    set_stage(out_dir, "writing the summary")
    text = write_summary(result, traces, track=track)
    if getattr(result, "fill", None):
        from reports.fill import fill_section

        atomic_write_text(track(out_dir / "fill.json"), json.dumps(result.fill, indent=1))
        atomic_write_text(out_dir / "summary.md", text + fill_section(result.fill))


def case_from_id(case_id: str) -> Case:
    """Inverse of ``Case.case_id`` (for reproduction commands)."""
    parts = case_id.split("/")
    if parts[1] == "plain":
        return Case(parts[0], None, parts[2], 0, int(parts[3][1:]))
    return Case(parts[0], parts[1], parts[2], int(parts[3][1:]), int(parts[4][1:]))
