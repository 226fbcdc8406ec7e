"""``specparity run``: the main job.

Runs the engine and every available oracle on the zoo cases, writes one trace
per (runner, case) under ``OUT/traces/<runner>/``, compares them — engine vs
each oracle round for round, engine speculative vs engine plain at the token
level — and writes the summary (``OUT/summary.md``) and the report
(``OUT/report.md``, ``OUT/report.html``; ``reports/report.py``). Exit status: 0 when every
comparison conforms, 1 when a divergence is found (a spec-vs-plain flip on a
knife-edge is ``numerics`` and is reported, not failed).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specparity.cases import DEFAULT_GAMMAS, Case, pick_prompts, spec_matrix
from specparity.runners import run_case
from traces.diff import Divergence, diff_traces
from traces.io import Trace, write_trace
from traces.reference import ReferenceRefused, compare_with_reference, refusal_verdict


@dataclass
class Comparison:
    kind: str  # "engine-vs-<oracle>" | "spec-vs-plain"
    case_id: str
    level: str
    divergence: Divergence | None
    known: str | None = None  # id of a known reference behaviour that explains it
    status: str | None = None  # reference verdict status ("refused", "known", ...)
    detail: str = ""

    @property
    def verdict(self) -> str:
        if self.known is not None:
            return f"{self.status}: {self.known}"
        if self.status == "divergent" and self.divergence is None:
            return "unexplained refusal"
        if self.divergence is None:
            return "identical"
        return self.divergence.klass

    @property
    def fails(self) -> bool:
        if self.known is not None:
            return False
        if self.status == "divergent" and self.divergence is None:
            return True
        if self.divergence is None:
            return False
        # Against a reference every difference is a failure; spec vs plain may
        # differ only on knife-edges (batched vs serial verify, §2.1).
        return self.kind != "spec-vs-plain" or self.divergence.klass == "logic"

    @property
    def message(self) -> str | None:
        if self.divergence is not None:
            return self.divergence.message
        return self.detail or None


def _reference_comparison(oracle: str, case_id: str, eng: Trace, ref: Trace | ReferenceRefused) -> Comparison:
    if isinstance(ref, ReferenceRefused):
        v = refusal_verdict(eng, ref)
    else:
        v = compare_with_reference(eng, ref, oracle)
    return Comparison(
        f"engine-vs-{oracle}", case_id, "round", v.divergence,
        known=v.known.id if v.known is not None else None, status=v.status, detail=v.detail,
    )


@dataclass
class RunResult:
    out_dir: Path
    runners: list[str]
    unavailable: dict[str, str]
    traces: dict[tuple[str, str], Path] = field(default_factory=dict)
    comparisons: list[Comparison] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(c.fails for c in self.comparisons)


def _progress(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True,
                disable=None)


def run(
    out_dir: Path,
    *,
    targets: list[str] | None = None,
    drafters: list[str] | None = None,
    gammas: tuple[int, ...] = DEFAULT_GAMMAS,
    n_prompts: int = 8,
    max_tokens: int = 32,
    runners: list[str] | None = None,
) -> RunResult:
    import zoo
    from oracles import RUNNERS, availability

    t0 = time.perf_counter()
    oracle_names = runners if runners is not None else list(RUNNERS)
    available, unavailable = [], {}
    for name in oracle_names:
        ok, why = availability(name)
        (available.append(name) if ok else unavailable.__setitem__(name, why))
    all_runners = ["engine", *available]
    pairs = [(t, d) for (t, d) in zoo.pairs()
             if (targets is None or t in targets) and (drafters is None or d in drafters)]
    if not pairs:
        raise ValueError(f"no zoo pair matches targets={targets} drafters={drafters}")
    prompt_ids = pick_prompts([p.id for p in zoo.prompts()], n_prompts)
    cases = spec_matrix(pairs, prompt_ids, gammas, max_tokens)
    plains = list(dict.fromkeys(c.plain() for c in cases))
    result = RunResult(out_dir=out_dir, runners=all_runners, unavailable=unavailable)
    traces: dict[tuple[str, str], Trace] = {}
    refusals: dict[tuple[str, str], ReferenceRefused] = {}
    jobs = [(r, c) for c in [*plains, *cases] for r in all_runners]
    with _progress(len(jobs), "running cases") as bar:
        for runner, case in jobs:
            try:
                records = run_case(runner, case)
            except ReferenceRefused as exc:
                refusals[(runner, case.case_id)] = exc
                bar.update(1)
                continue
            path = out_dir / "traces" / runner / f"{case.file_stem}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_trace(path, records)
            result.traces[(runner, case.case_id)] = path
            traces[(runner, case.case_id)] = Trace.from_records(records)
            bar.update(1)
    def ref(oracle: str, case_id: str) -> Trace | ReferenceRefused:
        return refusals.get((oracle, case_id)) or traces[(oracle, case_id)]

    for case in cases:
        eng = traces[("engine", case.case_id)]
        for oracle in available:
            result.comparisons.append(_reference_comparison(oracle, case.case_id, eng, ref(oracle, case.case_id)))
        result.comparisons.append(Comparison(
            "spec-vs-plain", case.case_id, "tokens",
            diff_traces(eng, traces[("engine", case.plain().case_id)], level="tokens")))
    for case in plains:
        for oracle in available:
            result.comparisons.append(_reference_comparison(
                oracle, case.case_id, traces[("engine", case.case_id)], ref(oracle, case.case_id)))
    result.wall_s = time.perf_counter() - t0
    from reports.summary import write_summary

    write_summary(result, traces)
    (out_dir / "comparisons.json").write_text(json.dumps([
        {"kind": c.kind, "case_id": c.case_id, "level": c.level, "verdict": c.verdict,
         "fails": c.fails, "known": c.known, "message": c.message}
        for c in result.comparisons], indent=1))
    from reports.report import build_report

    build_report(out_dir)  # raises ReportError: a report failure fails the run
    return result


def case_from_id(case_id: str) -> Case:
    """Inverse of ``Case.case_id`` (for reproduction commands)."""
    parts = case_id.split("/")
    if parts[1] == "plain":
        return Case(parts[0], None, parts[2], 0, int(parts[3][1:]))
    return Case(parts[0], parts[1], parts[2], int(parts[3][1:]), int(parts[4][1:]))
