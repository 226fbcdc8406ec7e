"""Throughput of batched speculation (``engine/batched.py``): figures, never a gate.

``python -m specparity.measure.bench_batched [--target llama] [--drafter twin|ngram|self|small]
[--size tiny|small|1b] [--rows 1,2,4,8] [--repeats 5] [--max-tokens 32] [--gamma 3]
[--json FILE]`` — for each batch size B: B requests (zoo prompts of mixed lengths, greedy) run
as ONE batch (``batch_generate``) and as B serial runs (``spec_generate`` one after the other),
both with cache digests off; the two arms alternate order every repeat (AB, BA, ...) after one
untimed warm-up of each, and every row's output is compared between the two arms (below). Printed per B: rows per second of each arm (median over repeats), tokens
per second, and the paired speedup ``serial wall / batched wall`` — the median of the
per-repeat ratios with its 95 % percentile-bootstrap interval (``reports.stats.median_ratio``), and
the same ratio of the process's CPU time (``time.process_time``: steadier than wall time on a
machine shared with other work, where the wall ratio swings with the load).

``--size 1b`` builds the seeded ≥1B bf16 pair (``zoo/big.py``, GPU-only in practice):
``python -m specparity.measure.bench_batched --size 1b --rows 1,2,4,8 --repeats 5 --max-tokens 64``.

``--profile`` adds, per B, one untimed run of each arm under ``engine.telemetry.profiling``:
the per-phase split of a row's round (draft, window assembly, target forward, sync, walk,
rollback, commit, records), each phase's device work evaluated at its end. Off, the timed
repeats carry no profiling cost (the executors read one global per generation).

Identity of every row: each repeat compares every row batched vs serial, record for record then
its output (``engine.batched_check.compare_row``; cache digests are off in both arms). Equal:
``identical``. Different: classified (``engine.batched_check.classify_row``: on a bit-exact
backend any difference is ``logic``; elsewhere a token flip the numerics witness explains is
``numerics``). Throughput is reported over identical-or-``numerics`` rows (the counts are
printed); a ``logic`` row refuses the figure in one line naming the row and its round, exit 1.
A missing op (``engine.backend.run_supported``, MLX's own error for an op the backend lacks) is
that batch size's verdict, ``unsupported on <device>: <op>``, in the table, the JSON (``unsupported``,
``verdict``, ``info``) and a section listing each; the other batch sizes are measured. Exit 0 when at
least one batch size has a figure; 1 when every one is unsupported (no figure) or a row is ``logic``;
2 on a usage error.
Printed too: each row's lane (batched, or serial with the reason: taps, quantized KV, a
rotating ring past its wrap) and how it drafts (in its drafter's batch, or per row, why).

``--per-row-drafts`` makes every row draft on its own (the executor's ``batch_drafts=False``): the
gain of batched drafting, on the same rows.

``--json FILE`` goes through the project's ownership mechanism (``specparity.cli.args.output_file``
at parse time, ``specparity.cli.outdir.claim_output_file`` around the work and the write): a
directory, or an existing file this tool did not write (its ``kind`` is not ``bench-batched``), is
refused in one line before measuring; no flag overwrites a user's file; the file is written atomically.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MAX_ROWS", "RowLogic", "bench_batched", "classify", "main", "markdown"]

KIND = "bench-batched"  # the ``kind`` of the JSON this tool writes (an existing --json FILE must carry it)
MAX_ROWS = 64  # the most rows in one batch (--rows)


def _ours(p: Path) -> bool:
    """Whether the existing file at ``p`` is this tool's JSON (``kind`` bench-batched)."""
    from specparity.cli.outdir import json_of_kind

    return json_of_kind(KIND)(p)


class RowLogic(RuntimeError):
    """A row differs batched vs serial in a way arithmetic does not explain: no figure."""


def classify(model: Any, requests: list[Any], rid: str, result: Any, serial: Any) -> dict[str, Any]:
    """Row ``rid`` batched vs serial through the one classification path,
    ``engine.batched_check.classify_row`` (the ``bench-identity`` kind of
    ``specparity.jobs.comparison.KINDS``): ``{"verdict": "identical"|"numerics"|"logic", "message",
    "round", "step", "field", "evidence"}``."""
    from engine.batched_check import classify_row

    v = classify_row(model, requests, rid, result, serial)
    return {"verdict": v.verdict, "message": v.message, "round": v.round, "step": v.step, "field": v.field,
            "evidence": list(v.evidence)}


def bench_batched(target: str | None = None, drafter: str | None = None, *, size: str | None = None,
                  rows: Sequence[int] = (1, 2, 4, 8), repeats: int = 5, max_tokens: int = 32, gamma: int = 3,
                  seed: int = 0, profile: bool = False, batch_drafts: bool = True,
                  log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time batched vs serial at each batch size (module docstring); the result as a dict.

    Raises :class:`RowLogic` when a row differs in a way the numerics witness does not explain."""
    import zoo
    from engine.backend import Unsupported, emulate_from_env, run_supported
    from engine.batched import BatchRequest, batch_generate
    from engine.executor import GenerationParams, spec_generate
    from engine.sources.ngram import NgramProvider
    from engine.sources.two_model import TwoModelProvider
    from engine.telemetry import profiling
    from reports.stats import median_ratio
    from specparity.cli.devices import describe_device
    from specparity.measure.ab import choose_prompts as _pick_prompts
    from specparity.measure.bench import resolve_pair as _resolve
    from specparity.runners import load_model

    emulate_from_env()  # SPECPARITY_EMULATE_MISSING_OP: the missing-op double here too
    say = log or (lambda _m: None)
    if repeats < 1 or not rows or min(rows) < 1:
        raise ValueError("--repeats and every --rows value must be >= 1")
    n_prompts = len(zoo.prompts())
    if max(rows) > min(n_prompts, MAX_ROWS):
        raise ValueError(f"--rows {max(rows)}: at most {min(n_prompts, MAX_ROWS)} rows (one zoo prompt per row; "
                         f"the zoo has {n_prompts}, the limit is {MAX_ROWS})")
    ngram = drafter == "ngram"
    tname, dname, tpath, dpath = _resolve(target, None if ngram else drafter, size, seed, say)
    if ngram:
        dname = "ngram"
    tgt = load_model(str(tpath))
    drf = None if ngram else load_model(str(dpath))
    prompts = _pick_prompts(max(rows), tpath, None, max_tokens)

    def provider() -> Any:
        return NgramProvider(gamma=gamma) if drf is None else TwoModelProvider(drf.model)

    params = GenerationParams(max_tokens=max_tokens, gamma=gamma, eos_ids=tgt.eos_ids, cache_digests=False)

    def requests(b: int) -> list[Any]:
        return [BatchRequest(f"r{i}", list(prompts[i].token_ids), params, provider()) for i in range(b)]

    def batched(b: int) -> tuple[float, float, Any, list[Any]]:
        reqs = requests(b)
        t0, c0 = time.perf_counter(), time.process_time()
        res = batch_generate(tgt.model, reqs, batch_drafts=batch_drafts)
        return time.perf_counter() - t0, time.process_time() - c0, res, reqs

    def serial(b: int) -> tuple[float, float, list[Any]]:
        t0, c0 = time.perf_counter(), time.process_time()
        outs = [spec_generate(tgt.model, provider(), list(prompts[i].token_ids), params) for i in range(b)]
        return time.perf_counter() - t0, time.process_time() - c0, outs

    def one(b: int) -> dict[str, Any]:
        say(f"B = {b}: warm-up")
        _, _, first, _ = batched(b)
        serial(b)
        walls: dict[str, list[float]] = {"batched": [], "serial": []}
        cpus: dict[str, list[float]] = {"batched": [], "serial": []}
        status: dict[str, str] = {f"r{i}": "identical" for i in range(b)}
        notes: dict[str, str] = {}
        tokens = 0
        for rep in range(repeats):
            order = ("batched", "serial") if rep % 2 == 0 else ("serial", "batched")
            got: dict[str, Any] = {}
            for arm in order:
                if arm == "batched":
                    wall, cpu, res, reqs = batched(b)
                    got["batched"] = (res, reqs)
                else:
                    wall, cpu, outs = serial(b)
                    got["serial"] = outs
                walls[arm].append(wall)
                cpus[arm].append(cpu)
            res, reqs = got["batched"]
            outs = got["serial"]
            tokens = sum(len(res.rows[f"r{i}"].output_ids) for i in range(b))
            for i in range(b):
                rid = f"r{i}"  # every row, record for record (identical rows cost one comparison, no replay)
                v = classify(tgt.model, reqs, rid, res, outs[i])
                if v["verdict"] == "logic":
                    where = f"round {v['round']}" if v["round"] is not None else "its footer"
                    step = f" (batch step {v['step']})" if v["step"] is not None else ""
                    raise RowLogic(f"B = {b}, repeat {rep}: row {rid} differs batched vs serial at {where}{step}: "
                                   f"logic: {v['message']}; no throughput figure")
                if v["verdict"] == "numerics":
                    status[rid] = "numerics"
                    notes[rid] = v["message"]
            say(f"B = {b}: repeat {rep + 1}/{repeats}: batched {walls['batched'][-1]:.3f} s, "
                f"serial {walls['serial'][-1]:.3f} s")
        ratio = median_ratio([s / bt for s, bt in zip(walls["serial"], walls["batched"], strict=True)])
        cpu_ratio = median_ratio([s / bt for s, bt in zip(cpus["serial"], cpus["batched"], strict=True)])
        med = {arm: sorted(w)[len(w) // 2] for arm, w in walls.items()}
        entry: dict[str, Any] = {
            "rows": b, "tokens": tokens, "repeats": repeats,
            "batched_wall_s": walls["batched"], "serial_wall_s": walls["serial"],
            "batched_rows_per_s": b / med["batched"], "serial_rows_per_s": b / med["serial"],
            "batched_tokens_per_s": tokens / med["batched"], "serial_tokens_per_s": tokens / med["serial"],
            "batched_cpu_s": cpus["batched"], "serial_cpu_s": cpus["serial"],
            "speedup": ratio.to_dict(), "cpu_speedup": cpu_ratio.to_dict(),
            "identical_outputs": all(v == "identical" for v in status.values()),
            "row_status": status, "numerics_notes": notes,
            "lanes": dict(first.lanes), "drafting": dict(getattr(first, "drafting", {}))}
        if profile:
            with profiling() as pb:
                batched(b)
            with profiling() as ps:
                serial(b)
            entry["profile"] = {"batched": pb.to_dict(), "serial": ps.to_dict()}
        return entry

    table: list[dict[str, Any]] = []
    for b in rows:
        # a missing op (engine.backend.run_supported): this batch size's verdict, the bench goes on
        got = run_supported(functools.partial(one, b), f"B = {b}")
        if isinstance(got, Unsupported):
            say(f"B = {b}: {got.text}")
            table.append({"rows": b, "verdict": got.verdict, "unsupported": got.text, "info": got.info})
        else:
            table.append(got)
    return {"kind": KIND, "target": tname, "drafter": dname, "gamma": gamma, "max_tokens": max_tokens,
            "batch_drafts": batch_drafts, "device": describe_device(), "table": table}


def markdown(res: dict[str, Any]) -> str:
    from engine.telemetry import phase_table

    lines = [f"Batched vs serial speculation: {res['target']} / {res['drafter']}, γ {res['gamma']}, "
             f"{res['max_tokens']} tokens per row, greedy, drafts "
             f"{'batched' if res.get('batch_drafts', True) else 'per row'}, on {res['device']}; throughput over rows "
             "identical or `numerics` in both arms.",
             "",
             "| B | tokens | batched rows/s | serial rows/s | batched tok/s | serial tok/s | speedup (serial/batched wall), "
             "median [95% CI] | CPU-time speedup [95% CI] | rows identical / numerics | repeats |",
             "|---:|---:|---:|---:|---:|---:|:---|:---|:---|---:|"]
    for r in res["table"]:
        if "unsupported" in r:
            lines.append(f"| {r['rows']} | {r['verdict']} | - | - | - | - | - | - | - | - |")
            continue
        s, c = r["speedup"], r["cpu_speedup"]
        st = list(r.get("row_status", {}).values())
        lines.append(f"| {r['rows']} | {r['tokens']} | {r['batched_rows_per_s']:.2f} | {r['serial_rows_per_s']:.2f} | "
                     f"{r['batched_tokens_per_s']:.1f} | {r['serial_tokens_per_s']:.1f} | "
                     f"{s['median']:.2f} [{s['low']:.2f}, {s['high']:.2f}] | "
                     f"{c['median']:.2f} [{c['low']:.2f}, {c['high']:.2f}] | "
                     f"{st.count('identical')} / {st.count('numerics')} | {r['repeats']} |")
    measured = [r for r in res["table"] if "unsupported" not in r]
    last = measured[-1] if measured else None
    if last is not None:
        lines += ["", f"Rows at B = {last['rows']}:", "", "| row | identity | lane | drafting |", "|:---|:---|:---|:---|"]
        for rid, verdict in last.get("row_status", {}).items():
            lines.append(f"| {rid} | {verdict} | {last['lanes'].get(rid, '?')} | {last['drafting'].get(rid, '-')} |")
        for rid, note in last.get("numerics_notes", {}).items():
            lines.append(f"\n{rid} (numerics): {note}")
    gone = [r for r in res["table"] if "unsupported" in r]
    if gone:
        lines += ["", f"Unsupported on this backend ({len(gone)} of {len(res['table'])} batch sizes; no figure for "
                      "them, the others are measured):", ""]
        lines += [f"- B = {r['rows']}: `{r['unsupported']}`" for r in gone]
    for r in res["table"]:
        if "profile" in r:
            lines += ["", f"Per-phase split of a row's round at B = {r['rows']} (one untimed run per arm, "
                      "each phase evaluated at its end):", "", phase_table(r["profile"]).rstrip("\n")]
    return "\n".join(lines) + "\n"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the flag (``bench_batched: error: argument --rows: ...``), exit 2."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        print(f"bench_batched: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _rows(text: str) -> tuple[int, ...]:
    from specparity.cli import args as a

    out = a.positive_int_list(text)
    if max(out) > MAX_ROWS:
        raise argparse.ArgumentTypeError(f"{max(out)} rows is too many (limit {MAX_ROWS})")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from specparity.cli import args as a

    p = _Parser(prog="python -m specparity.measure.bench_batched", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", default=None, help="a zoo drafter (twin, self, small) or ngram")
    p.add_argument("--size", default=None, choices=("tiny", "small", "1b"))
    p.add_argument("--rows", type=_rows, default=(1, 2, 4, 8), help=f"batch sizes, e.g. 1,2,4,8 (each <= {MAX_ROWS})")
    p.add_argument("--repeats", type=a.positive_int, default=5)
    p.add_argument("--max-tokens", type=a.max_tokens, default=32)
    p.add_argument("--gamma", type=a.gamma, default=3)
    p.add_argument("--seed", type=a.seed, default=0)
    p.add_argument("--profile", action="store_true", help="also print each arm's per-phase split of a round")
    p.add_argument("--per-row-drafts", action="store_true",
                   help="every row drafts on its own (batch_generate(batch_drafts=False)): the gain of batched drafting")
    p.add_argument("--json", type=a.output_file(_ours, "bench-batched JSON"), default=None,
                   help="also write the figures as JSON to FILE (a new file, or one this tool wrote)")
    args = p.parse_args(list(argv) if argv is not None else None)  # a bad value: one line, SystemExit(2)
    if args.json is None:
        return _run(args)
    from specparity.cli.args import UsageError
    from specparity.cli.outdir import claim_output_file, refusal

    try:
        with claim_output_file(args.json, "bench_batched", flag="--json", what="bench-batched JSON",
                               ours=_ours) as dest:
            return _run(args, dest)
    except UsageError as exc:  # a user's file appeared, or another writer holds it: one line, nothing written
        return refusal("bench_batched", exc)


def _run(args: argparse.Namespace, dest: Path | None = None) -> int:
    """Measure, print, and write ``dest`` (held by :func:`claim_output_file`) if given."""
    try:
        res = bench_batched(args.target, args.drafter, size=args.size, rows=args.rows, repeats=args.repeats,
                            max_tokens=args.max_tokens, gamma=args.gamma, seed=args.seed, profile=args.profile,
                            batch_drafts=not args.per_row_drafts,
                            log=lambda m: print(m, file=sys.stderr))
    except RowLogic as exc:
        print(f"bench_batched: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"bench_batched: error: {exc}", file=sys.stderr)
        return 2
    print(markdown(res))
    gone = [r for r in res["table"] if "unsupported" in r]
    if gone and len(gone) == len(res["table"]):  # nothing measured: never read as success
        print(f"bench_batched: no figure: every batch size unsupported ({gone[0]['verdict']})", file=sys.stderr)
    if dest is not None:
        from traces.io import atomic_write_json

        try:
            atomic_write_json(dest, res, nan_as_null=True)
        except OSError as exc:
            print(f"bench_batched: --json {dest}: {exc.strerror or exc} (the figures above are complete; "
                  "the file was not written)", file=sys.stderr)
            return 1
    return 1 if gone and len(gone) == len(res["table"]) else 0

if __name__ == "__main__":
    raise SystemExit(main())
