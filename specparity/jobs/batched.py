"""Batched speculation in the jobs: the zoo matrix's batched cases and their traces.

``specparity run`` (``specparity.jobs.run.batched_comparisons``) adds, for each zoo target of the
selection that batches (a KV, a rotating and a recurrent target with the ``twin`` drafter, and
model-free n-gram rows on ``llama``), batched cases of B = 2 and B = 4 rows
(``engine/batched.py``): mixed prompt lengths (28, 16, 25, 11 tokens) and budgets (12, 20, 7,
16: rows finish at different steps); at B = 4 one row joins mid-flight and one is preempted
and resumed. Every row is an ordinary zoo ``Case`` (its request is what the engine runner
would run, ``specparity.runners.generation_params`` / ``open_for_case``), so each row's trace
— written with the engine runner's header — is compared round for round with the engine's
serial trace of the same case (``traces.diff.diff_traces``; a divergence names the batch step
and the rows present, ``traces.diff.batch_context``). The B = 4 case of each pair also
reports the three invariances (``engine.batched_check``: M, B, seeded; the seeded rows
sampled at T 0.8 with position keys), per engine: ours, and mlx-lm 0.32.2, which has no
batched speculation (``BatchGenerator``: ``is_batchable = draft_model is None``), listed as
such.

Files, under ``OUT/batched/<case>/`` (outside ``OUT/traces/``: the report reads every trace there as a case of its own): ``<row>.jsonl`` (the row's trace),
``<row>.serial.jsonl`` (the serial run), ``batch.jsonl`` (the batch trace: one
``batch_step`` record per step, ``traces/INTERPRETING.md`` "Batch traces"); and
``OUT/batched.json`` (lanes, invariances, per-row verdicts).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specparity.cases.case import Case, file_stem

__all__ = ["BATCH_PAIRS", "ROW_BUDGETS", "ROW_PROMPTS", "ROW_SET_BY_DESIGN", "CASE_FIELDS_NOT_APPLICABLE", "BatchCase", "batch_cases", "batched_comparisons",
           "row_requests"]

BATCH_PAIRS = (("llama", "twin"), ("gemma3", "twin"), ("qwen35", "twin"), ("llama", "ngram"))
ROW_PROMPTS = ("nat-00", "nat-01", "nat-02", "nat-03")  # 28, 16, 25, 11 tokens
ROW_BUDGETS = (12, 20, 7, 16)


@dataclass(frozen=True)
class BatchCase:
    """One batched run: its rows (zoo cases), when each arrives, which one is preempted."""

    name: str
    rows: tuple[Case, ...]
    arrive: tuple[int, ...]
    pause: tuple[tuple[int, int] | None, ...]
    invariances: bool = False

    @property
    def rids(self) -> list[str]:
        return [f"r{i}" for i in range(len(self.rows))]


# The ``Case`` fields a batched row takes from the batched design rather than from the run's case
# (every other field -- EOS ids, stop sequences, top-p/top-k/min-p, processors, min_tokens, quantized KV,
# rotating, grammar -- is the run's: ``tests/test_case_lanes.py`` holds every field to this).
ROW_SET_BY_DESIGN: dict[str, str] = {
    "drafter": "the batched pair's drafter (twin, or ngram for the model-free rows)",
    "source": "the batched pair's source (two-model, or ngram)",
    "prompt_id": "mixed prompt lengths (ROW_PROMPTS: 28, 16, 25, 11 tokens)",
    "prompt_tokens": "the zoo prompts of ROW_PROMPTS",
    "max_tokens": "mixed budgets so rows finish at different steps (ROW_BUDGETS)",
    "gamma": "γ 3 for every row (the batch's verify windows of up to 4)",
    "temperature": "B = 4: rows 0 and 2 sampled at T 0.8 (the seeded invariance), rows 1 and 3 greedy",
    "seed": "one seed per row (its index): rows draw distinct streams",
    "rng": "sampled rows keyed per position (the seeded invariance); greedy rows draw nothing",
}


# The ``Case`` fields for which the batched lane does not apply, each with why.
CASE_FIELDS_NOT_APPLICABLE: dict[str, str] = {
    "target_path": "a user's pair gets no batched cases: the batched pairs are the zoo's (BATCH_PAIRS)",
    "draft_path": "a user's pair gets no batched cases: the batched pairs are the zoo's (BATCH_PAIRS)",
}


def _row(template: Case, drafter: str, i: int, temperature: float = 0.0) -> Case:
    """Row ``i``: the run's case ``template`` with the fields of :data:`ROW_SET_BY_DESIGN` set."""
    source = "ngram" if drafter == "ngram" else "two-model"
    return replace(template, drafter=drafter, source=source, prompt_id=ROW_PROMPTS[i], prompt_tokens=None,
                   max_tokens=ROW_BUDGETS[i], gamma=3, temperature=temperature, seed=i,
                   rng="position" if temperature else "stream")


def _template(cases: list[Case], target: str) -> Case | None:
    """The run's case a target's batched rows are built from: its first zoo greedy two-model
    ``twin`` case, one with the zoo matrix's default settings first (none: the run gets no batched
    cases on that target)."""
    twins = [c for c in cases if c.on_zoo and c.target == target and c.drafter == "twin" and c.source == "two-model"
             and c.temperature == 0]
    plain = [c for c in twins if c.kv_bits is None and not c.grammar and not c.processors and not c.min_tokens]
    return (plain or twins)[0] if twins else None


def batch_cases(cases: list[Case]) -> list[BatchCase]:
    """The batched cases for the zoo pairs of ``cases``: a target gets them when ``cases`` holds a
    greedy two-model ``twin`` case on it; every row is that case (:func:`_template`) with the batched
    design's fields set (:data:`ROW_SET_BY_DESIGN`): ``--eos-ids``, stop sequences, top-p/top-k and
    the rest reach the rows."""
    out = []
    for t, d in BATCH_PAIRS:
        tpl = _template(cases, t)
        if tpl is None:
            continue
        out.append(BatchCase(f"{t}/{d}/B2", (_row(tpl, d, 0), _row(tpl, d, 1)), (0, 0), (None, None)))
        # B = 4: rows 0 and 2 sampled (T 0.8, keyed per position), rows 1 and 3 greedy
        temps = (0.8, 0.0, 0.8, 0.0)
        out.append(BatchCase(f"{t}/{d}/B4", tuple(_row(tpl, d, i, temps[i]) for i in range(4)), (0, 0, 0, 2),
                             (None, (3, 5), None, None), invariances=True))
    return out


def row_requests(bc: BatchCase) -> tuple[Any, list[Any], list[dict[str, Any]]]:
    """``(target model, the rows' BatchRequests, their trace headers)``: each row as the engine
    runner runs its case (params, source, γ, prefill, header)."""
    import zoo
    from engine.batched import BatchRequest
    from specparity.runners import (
        case_header,
        case_paths,
        generation_params,
        load_model,
        open_for_case,
        registry,
    )

    tpath, _ = case_paths(bc.rows[0])
    target = load_model(str(tpath))
    info = registry.get("engine").runner_info()
    reqs, headers = [], []
    for rid, case, arrive, pause in zip(bc.rids, bc.rows, bc.arrive, bc.pause, strict=True):
        tp, dp = case_paths(case)
        src = open_for_case(case, target)
        params = replace(generation_params(case, target.eos_ids), gamma=src.gamma, prefill=src.prefill)
        if case.grammar:  # compiled against the target's tokenizer, as the engine runner does
            from specparity.runners.engine import compile_grammar

            params = replace(params, grammar=compile_grammar(case.grammar, target, params.eos_ids,
                                                             case.reasoning_end))
        ids = list(case.prompt_tokens) if case.prompt_tokens is not None else list(zoo.prompt(case.prompt_id).token_ids)
        draft = load_model(str(dp)) if dp is not None and src.kind is not None and src.kind.loads_model else None
        reqs.append(BatchRequest(rid, ids, params, src.make(), arrive=arrive, pause=pause))
        headers.append(case_header(info, case, ids, tpath=tp, dpath=dp, target=target, draft=draft,
                                   prefill=src.prefill))
    return target, reqs, headers


def batched_comparisons(out_dir: Path, cases: list[Case]) -> list[Any]:
    """Run the batched cases of ``cases`` (:func:`batch_cases`), write their traces and return one
    ``batched-vs-serial`` comparison per row and, per pair, ``batched-M``/``-B``/``-seeded`` per
    engine (module docstring)."""
    from engine.backend import Unsupported, run_supported
    from engine.batched import batch_generate
    from engine.batched_check import (
        RowJudge,
        b_invariance,
        backend_bound,
        m_invariance,
        seeded_invariance,
    )
    from specparity.cli.outdir import track
    from specparity.jobs.comparison import Comparison, unsupported_comparison
    from specparity.runners import numerics_witness, run_case
    from traces.diff import Divergence, diff_traces
    from traces.io import Trace, atomic_write_text, dumps_record, write_trace

    out: list[Any] = []
    report: list[dict[str, Any]] = []
    witness = numerics_witness()
    def one(bc: BatchCase) -> tuple[list[Any], dict[str, Any]]:
        got: list[Any] = []
        model, reqs, headers = row_requests(bc)
        bound = backend_bound(model.model)
        res = batch_generate(model.model, reqs)
        judge = RowJudge(model.model, reqs, res, bound=bound)
        folder = out_dir / "batched" / file_stem(bc.name)
        atomic_write_text(track(folder / "batch.jsonl"), "".join(dumps_record(r) + "\n" for r in res.steps))
        entry: dict[str, Any] = {"case": bc.name, "rows": {}, "lanes": res.lanes, "bound": bound}
        for rid, case, header in zip(bc.rids, bc.rows, headers, strict=True):
            row = res.rows[rid]
            records = [header, *row.records, row.footer()]
            write_trace(track(folder / f"{rid}.jsonl"), records)
            serial = run_case("engine", case)
            write_trace(track(folder / f"{rid}.serial.jsonl"), serial)
            div = diff_traces(Trace.from_records(records), Trace.from_records(serial), level="round",
                              witness=witness)
            status = None
            if div is not None:  # the one classification path (engine.batched_check.classify_row)
                v = judge.classify(rid)
                entry["rows"].setdefault(rid, {})["classified"] = v.to_dict()
                if v.verdict != "identical":  # identical records: the trace-level difference stands
                    div = replace(div, klass=v.verdict, basis="witness" if v.verdict == "numerics" else div.basis,
                                  message="\n".join([div.message, f"  batched vs serial: {v.verdict}: {v.message}",
                                                     *(f"    {e}" for e in v.evidence)]))
                status = "numerics" if div.klass == "numerics" else None
            got.append(Comparison("batched-vs-serial", f"{bc.name}/{rid} ({case.case_id})", "round", div,
                                  status=status))
            entry["rows"][rid] = {**entry["rows"].get(rid, {}), "case_id": case.case_id, "lane": res.lanes[rid],
                                  "verdict": "identical" if div is None else div.label}
        if bc.invariances:
            invs = [m_invariance(model.model, reqs, budget=bound), b_invariance(model.model, reqs, res, budget=bound),
                    seeded_invariance(model.model, reqs, res, budget=bound)]
            entry["invariances"] = {"engine": [i.to_dict() for i in invs]}
            for inv in invs:
                got.append(_invariance_comparison(Comparison, Divergence, f"batched-{inv.name}",
                                                  f"engine: {bc.name}", inv))
            for name in ("M", "B", "seeded"):
                got.append(Comparison(f"batched-{name}", f"mlx_lm: {bc.name}", "none", None, status="not-compared",
                                      detail="mlx-lm 0.32.2 has no batched speculation (BatchGenerator: "
                                             "is_batchable = draft_model is None): nothing to compare"))
        return got, entry

    for bc in batch_cases(cases):
        done = run_supported(functools.partial(one, bc), f"batched case {bc.name}")
        if isinstance(done, Unsupported):  # the backend lacks an op: this batched case's verdict
            out.append(unsupported_comparison("batched-vs-serial", bc.name, ["engine"], done.info))
            report.append({"case": bc.name, "unsupported": done.text})
            continue
        out += done[0]
        report.append(done[1])
    if report:
        atomic_write_text(track(out_dir / "batched.json"), json.dumps(report, indent=1))
    return out


def _invariance_comparison(comparison: Any, divergence: Any, kind: str, case_id: str, inv: Any) -> Any:
    if inv.verdict == "holds":
        return comparison(kind, case_id, "round", None, detail=inv.detail)
    if inv.verdict == "n/a":
        return comparison(kind, case_id, "none", None, status="not-compared", detail=inv.detail)
    message = "\n".join([f"{inv.name}: {inv.detail}", *(f"  {e}" for e in inv.evidence)])
    div = divergence(level="round", where=inv.detail.split(":")[0], field=inv.name, value_a=None, value_b=None,
                     klass=inv.verdict, margin=None, message=message,
                     basis="witness" if inv.evidence else "structural")
    return comparison(kind, case_id, "round", div, status="numerics" if inv.verdict == "numerics" else None)
