"""``specparity grade DIR``: grade traces written by any engine.

Every ``*.jsonl`` under ``DIR`` (recursively, bounded: :func:`find_traces`; the
output folder and any earlier specparity output excluded) is validated
(``traces.validate.validate_file``) and its header checked against the §3 roster
and the flags' bounds (:func:`header_problems`); an invalid trace is reported as
``FILE:LINE: field: message`` and fails the grade (exit 1) before anything runs. Each
trace's header names its case: the target (and drafter) by path, the source,
the prompt's token ids, the params and the EOS ids. For every case the models
are found (a path as written, else relative to the trace's folder or ``DIR``;
``zoo/<name>`` is the zoo cache), their digests checked against the header's
(``specparity.runners.model_identity``; a mismatch is one clear error — grading
against another model would be meaningless), and plain decode (the engine's
``plain`` runner) and every available live reference re-run on it through the
same task function and backends as ``specparity run`` (``--workers``,
``--ray``). The graded traces go under ``OUT/traces/engine/`` (as the subject
under test; their header keeps the engine's own runner name), the re-runs under
``OUT/traces/<runner>/`` with the graded trace's case id, and the comparisons,
summary and report are the run's (``specparity.jobs.run.finish``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from specparity.cases.case import Case, model_label
from specparity.cli.outdir import track
from specparity.jobs.comparison import (
    Comparison,
    compare_supported,
    not_compared,
    numerics_witness,
    reference_comparison,
    tokens_comparison,
    unsupported_comparison,
)
from specparity.jobs.run import (
    Job,
    RunResult,
    available_runners,
    execute,
    finish,
    skip_reasons,
)
from specparity.runners import runner_supports
from traces.diff import diff_traces
from traces.io import Trace, read_trace, write_trace
from traces.reference import ReferenceRefused

__all__ = ["GradeError", "Graded", "case_from_header", "grade", "grade_main"]


class GradeError(ValueError):
    """A traces folder cannot be graded (invalid trace, missing or different model)."""


@dataclass
class Graded:
    path: Path
    trace: Trace
    case: Case  # the case re-run for the references (its own id)
    key: str = ""  # the header's case id; "<id> [<file>]" when several traces share it

    @property
    def case_id(self) -> str:
        return self.key or str(self.trace.header["case_id"])

    @property
    def warm(self) -> bool:
        """A warm prompt-cache request (``run --sessions``): its prefill reused a saved prefix."""
        return reused_prefix(self.trace) > 0


def reused_prefix(trace: Trace) -> int:
    """Tokens a trace's prefill took from a saved prompt cache (its ``prompt_cache`` block;
    0 for a cold request or a trace without one)."""
    block = (trace.prefill or {}).get("prompt_cache")
    if not isinstance(block, dict):
        return 0
    return max(int(block.get("target_reused") or 0), int(block.get("drafter_reused") or 0))


def warm_as_cold(warm: Trace, cold: Trace, exact: bool = True) -> tuple[Trace, Trace]:
    """The warm-vs-cold rules (``specparity.jobs.sessions.compare_records``): a warm request's prefill
    legitimately prefills only the suffix (``target_tokens``/``drafter_tokens``) and says what it
    reused (``prompt_cache``); everything else — every round, the cache digests after the prefill
    and after each round, the footer — must equal the cold run's. Where the backend is not
    bit-exact the arithmetic fields are left out (``engine.cache_compare.ARITHMETIC_FIELDS``)."""
    from engine.cache_compare import ARITHMETIC_FIELDS

    skip = set() if exact else set(ARITHMETIC_FIELDS)
    like = cold.prefill or {}

    def norm(t: Trace) -> Trace:
        recs = []
        for r in t.records():
            r = {k: v for k, v in r.items() if k not in skip}
            if r["type"] == "prefill":
                r.pop("prompt_cache", None)
                for k in ("target_tokens", "drafter_tokens"):
                    r[k] = like.get(k)
            recs.append(r)
        return Trace.from_records(recs)

    return norm(warm), norm(cold)


def _find_model(ref: dict[str, Any] | None, trace_path: Path, root: Path, what: str) -> Path | None:
    if ref is None:
        return None
    raw = str(ref.get("path") or "")
    if not raw:
        raise GradeError(f"{trace_path}: header {what}.path is empty")
    try:
        first = Path(raw).expanduser()
    except RuntimeError:  # ~nosuchuser (header_problems refuses it first)
        raise GradeError(f"{trace_path}: header {what}.path {raw!r}: no such user") from None
    cands = [first, trace_path.parent / raw, root / raw]
    if raw.startswith("zoo/"):
        import zoo

        name = raw.split("/", 1)[1]
        cands.insert(0, zoo.model_dir(name) if name in zoo.model_names() else zoo.cache_root() / name)
    for c in cands:
        if c.is_dir():
            return c.resolve()
    raise GradeError(f"{trace_path}: {what} model {raw!r} not found (looked at "
                     f"{', '.join(str(c) for c in cands)})")


def _check_vocab(params: dict[str, Any], tpath: Path, trace_path: Path) -> None:
    """A header's ``logit_bias`` ids (and stop-sequence ids) inside the target's vocabulary
    (``config.json`` ``vocab_size``), checked before the model loads."""
    import json

    lp = params.get("logits_processors")
    ids = [t for t, _ in (lp.get("logit_bias") or ())] if isinstance(lp, dict) else []
    if not ids:
        return
    from specparity.cases.prompts import model_limits

    try:
        cfg = json.loads((tpath / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # the model load says why, in one line
    vocab, _ = model_limits(cfg) if isinstance(cfg, dict) else (None, None)
    bad = sorted({int(t) for t in ids if isinstance(t, int) and vocab is not None and not 0 <= t < vocab})
    if bad:
        raise GradeError(f"{trace_path}: header.params.logits_processors.logit_bias: token id(s) "
                         f"{', '.join(map(str, bad[:5]))} outside the target's vocabulary (size {vocab}, "
                         f"{tpath / 'config.json'})")


def _check_identity(path: Path, ref: dict[str, Any], trace_path: Path, what: str) -> None:
    from specparity.runners import model_identity

    mine = model_identity(str(path))
    for key in ("weights_sha256", "config_sha256"):
        want = ref.get(key)
        if want is not None and want != mine[key]:
            raise GradeError(f"{trace_path}: {what} {path}: {key} {mine[key][:12]}… differs from the "
                             f"header's {str(want)[:12]}… (the trace was written with another model)")


def case_from_header(header: dict[str, Any], trace_path: Path, root: Path) -> Case:
    """The case a trace's header names, its models found and checked."""
    from specparity.runners import load_model

    tpath = _find_model(header["target"], trace_path, root, "target")
    assert tpath is not None
    _check_identity(tpath, header["target"], trace_path, "target")
    spec = header["mode"] == "spec"
    source = header.get("source") or ("two-model" if spec else None)
    dpath = _find_model(header.get("drafter"), trace_path, root, "drafter") if spec else None
    if dpath is not None:
        _check_identity(dpath, header["drafter"], trace_path, "drafter")
    if spec:
        from specparity.runners import registry

        engine = registry.get("engine")
        if source not in engine.sources or source == registry.PLAIN:
            raise GradeError(f"{trace_path}: header source {source!r} is not a draft source the "
                             f"harness knows ({', '.join(s for s in engine.sources if s != registry.PLAIN)})")
    p = header["params"]
    eos = tuple(int(t) for t in header["eos_ids"])
    _check_vocab(p, tpath, trace_path)  # before the model loads: the file named, one line
    tok_eos = load_model(str(tpath)).eos_ids
    drafter: str | None = None
    if spec:
        from engine.sources.kind import get
        from specparity.cases.case import drafter_label

        desc = get(source)
        if desc.takes_dir and dpath is None:
            raise GradeError(f"{trace_path}: a {source} trace needs header.drafter (its model path)")
        thr = p.get("confidence_threshold")  # the threshold the trace ran with (None: the checkpoint's)
        conv = p.get("mtp_conventions") if "conventions" in desc.options else None
        conventions = None
        if isinstance(conv, dict):  # re-run with the conventions the trace recorded
            from engine.sources.native_mtp import Conventions

            keys = Conventions().to_json()
            conventions = ",".join(f"{k}={conv[k]}" for k in keys if k in conv)
        drafter = drafter_label(source, dpath if desc.takes_dir else None,
                                confidence_threshold=float(thr) if isinstance(thr, (int, float)) else None,
                                conventions=conventions)
    extra: dict[str, Any] = {}
    try:  # the sampling pipeline the trace recorded (engine.pipeline.header_params)
        from engine.pipeline import sampler_from_header

        sampler = sampler_from_header(p)
    except (TypeError, ValueError) as exc:
        raise GradeError(f"{trace_path}: header params: {exc}") from None
    if sampler.processors.active:
        extra["processors"] = sampler.processors.tag()
    if sampler.min_tokens:
        extra["min_tokens"] = sampler.min_tokens
    if sampler.rng != "stream":
        extra["rng"] = sampler.rng
    if sampler.min_p:  # re-run with the min-p the trace recorded (before: dropped, re-run at 0)
        extra["min_p"] = sampler.min_p
    if p.get("kv_bits") is not None:  # quantized KV (specparity.runners.kv_params)
        extra.update(kv_bits=int(p["kv_bits"]), kv_group_size=int(p.get("kv_group_size", 64)),
                     quantized_kv_start=int(p.get("quantized_kv_start", 5000)))
    if spec and p.get("rotating", "guard") != "guard":
        extra["rotating"] = str(p["rotating"])
    if isinstance(p.get("grammar"), dict):  # re-run under the grammar the trace recorded
        from zoo.grammars import ref_from_header

        try:
            extra["grammar"] = ref_from_header(p["grammar"])
            if isinstance(p["grammar"].get("reasoning_end"), str):
                extra["reasoning_end"] = p["grammar"]["reasoning_end"]
        except ValueError as exc:
            raise GradeError(f"{trace_path}: {exc}") from None
    return Case(
        **extra,
        target=model_label(tpath), drafter=drafter, prompt_id=str(header["prompt"]["id"]),
        gamma=int(p["gamma"] or 0) if spec else 0, max_tokens=int(p["max_tokens"]),
        temperature=float(p["temperature"]), seed=int(p.get("seed") or 0),
        eos_ids=None if tuple(sorted(eos)) == tuple(tok_eos) else eos,
        stop_sequences=tuple(tuple(int(t) for t in s) for s in p.get("stop_sequences") or ()),
        source=source if spec else "two-model", top_p=float(p.get("top_p") or 0.0),
        top_k=int(p.get("top_k") or 0), target_path=str(tpath),
        draft_path=str(dpath) if dpath is not None else None,
        prompt_tokens=tuple(int(t) for t in header["prompt"]["token_ids"]),
    )


MAX_WALK_DEPTH = 16
"""Folders deeper than this under ``DIR`` are not searched (refused in one line when met)."""
MAX_WALK_ENTRIES = 100_000
"""Directory entries looked at before the search is refused (``grade /`` must not walk a disk)."""
MAX_TRACES = 10_000
"""Traces graded in one call (each is re-run by every reference)."""


def _is_run_output(folder: Path) -> bool:
    """Whether ``folder`` is a ``run``/``grade`` output (its marker names a run).

    A folder whose marker lists only files other commands added (``record --out``,
    ``bench``, ``ab``: state ``outputs``) is a user's folder holding traces, and is
    graded; an unreadable marker counts as a run output (never graded by mistake).
    """
    import json

    from reports.tables import RUN_MARKER

    marker = folder / RUN_MARKER
    if not marker.exists():
        return False
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True
    return not (isinstance(data, dict) and data.get("state") == "outputs" and not data.get("run_id"))


def find_traces(trace_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """The ``*.jsonl`` regular files under ``trace_dir``, bounded and without specparity outputs.

    Skipped: the output folder ``out_dir``, any folder that is a specparity run or
    grade output (it holds the run marker ``.specparity-run.json``: an earlier
    ``grade --out`` inside ``DIR`` must not be graded as the engine's traces),
    symlinked folders (no cycles, no escape) and special files (FIFOs, devices).
    The walk is refused in one line past :data:`MAX_WALK_DEPTH` levels,
    :data:`MAX_WALK_ENTRIES` entries or :data:`MAX_TRACES` traces.
    """
    import os

    from reports.tables import RUN_MARKER

    root = Path(trace_dir)
    if not root.is_dir():
        raise GradeError(f"{str(root)!r} is not a directory of traces")
    if _is_run_output(root):
        raise GradeError(f"{root} is a specparity run/grade output ({RUN_MARKER}), not an engine's "
                         f"traces; give the engine's trace folder (a run's own: {root / 'traces' / 'engine'})")
    skip = out_dir.resolve() if out_dir is not None else None
    files: list[Path] = []
    seen = 0
    base_depth = len(root.resolve().parts)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        depth = len(here.resolve().parts) - base_depth
        seen += len(dirnames) + len(filenames)
        if seen > MAX_WALK_ENTRIES:
            raise GradeError(f"{root}: more than {MAX_WALK_ENTRIES} files and folders under it; "
                             "give the folder that holds the traces, not a whole disk")
        keep = []
        for d in sorted(dirnames):
            sub_dir = here / d
            if sub_dir.is_symlink() or (skip is not None and sub_dir.resolve() == skip):
                continue
            if _is_run_output(sub_dir):
                continue  # a specparity output (e.g. an earlier grade --out): never graded
            if depth + 1 > MAX_WALK_DEPTH:
                raise GradeError(f"{root}: folders nested deeper than {MAX_WALK_DEPTH} levels "
                                 f"({sub_dir}); give the folder that holds the traces")
            keep.append(d)
        dirnames[:] = keep
        for name in sorted(filenames):
            f = here / name
            if name.endswith(".jsonl") and f.is_file():  # regular files (FIFOs never opened)
                files.append(f)
                if len(files) > MAX_TRACES:
                    raise GradeError(f"{root}: more than {MAX_TRACES} traces; grade them in parts")
    return sorted(files)


def header_problems(header: dict[str, Any]) -> list[tuple[str, str]]:
    """``[(field, message)]``: a header's source and params checked as the flags check them.

    The source must be one of the §3 roster the engine knows (a plain trace has
    none); γ, max_tokens, the sampling params, prompt and EOS ids go through the
    validators of ``--gammas``, ``--max-tokens``, ``--temps``, ``--top-p``,
    ``--top-k``, ``--seed`` and ``--prompt-ids`` (``specparity.cli.args``), so a header
    γ of 10^9 is refused here instead of driving per-γ work.
    """
    from specparity.cli import args

    out: list[tuple[str, str]] = []
    source, mode = header.get("source"), header.get("mode")
    known = args.source_names()
    if mode == "plain" and source is not None:
        out.append(("header.source", f"{source!r} in a plain trace (a plain decode has no draft source)"))
    elif source is not None and source not in known:
        out.append(("header.source", f"unknown draft source {source!r}; known: {', '.join(known)}"))
    p = header.get("params") or {}
    checks: list[tuple[str, Any, Any]] = [
        ("params.max_tokens", args.max_tokens, p.get("max_tokens")),
        ("params.temperature", args.nonneg_float, p.get("temperature")),
        ("params.top_p", args.probability, p.get("top_p")),
        ("params.top_k", args.nonneg_int, p.get("top_k")),
        ("prompt.token_ids", args.token_id_list, (header.get("prompt") or {}).get("token_ids")),
    ]
    if p.get("seed") is not None:  # null: the engine did not say
        checks.append(("params.seed", args.seed, p["seed"]))
    if header.get("eos_ids"):
        checks.append(("eos_ids", args.token_id_list, header["eos_ids"]))
    g = p.get("gamma")
    if g is not None and (mode == "spec" or g != 0):  # a plain trace may say 0
        checks.append(("params.gamma", args.gamma, g))
    if p.get("kv_bits") is not None:  # quantized KV: the flags' bounds (specparity.cli.kv_args)
        checks += [("params.kv_bits", args.kv_bits, p["kv_bits"]),
                   ("params.kv_group_size", args.kv_group_size, p.get("kv_group_size", 64)),
                   ("params.quantized_kv_start", args.nonneg_int, p.get("quantized_kv_start", 5000))]
    if p.get("rotating", "guard") not in ("guard", "exact"):
        out.append(("header.params.rotating", f"expected \"guard\" or \"exact\", got {p['rotating']!r}"))
    # the rest of what a re-run reads, through the validators of the flags that set it
    if p.get("min_tokens") is not None:
        checks.append(("params.min_tokens", args.nonneg_int, p["min_tokens"]))
    if p.get("rng") is not None:
        checks.append(("params.rng", args.rng_mode, p["rng"]))
    if p.get("min_p") is not None:
        checks.append(("params.min_p", args.min_p, p["min_p"]))
    if p.get("confidence_threshold") is not None:
        checks.append(("params.confidence_threshold", args.finite_float, p["confidence_threshold"]))
    if p.get("mtp_conventions") is not None:
        checks.append(("params.mtp_conventions", args.conventions_block, p["mtp_conventions"]))
    for i, seq in enumerate(p.get("stop_sequences") or ()):
        checks.append((f"params.stop_sequences[{i}]", args.token_id_list, seq))
    out += _grammar_problems(p.get("grammar"))
    if p.get("logits_processors") is not None:
        from engine.pipeline import processors_from_block

        try:  # the validator a suite's `processors` and the processor flags' values go through
            processors_from_block(p["logits_processors"])
        except (TypeError, ValueError) as exc:
            out.append(("header.params.logits_processors", str(exc)))
    for role in ("target", "drafter"):
        ref = header.get(role)
        if isinstance(ref, dict) and isinstance(ref.get("path"), str) and ref["path"]:
            checks.append((f"{role}.path", args.user_path, ref["path"]))
    prompt_id = (header.get("prompt") or {}).get("id")
    if prompt_id is not None and not isinstance(prompt_id, str | int):
        out.append(("header.prompt.id", f"expected a string, got {prompt_id!r}"))
    for fld, parse, value in checks:
        try:
            args.check_value(parse, value, "")
        except args.UsageError as exc:
            out.append((f"header.{fld}", str(exc).removeprefix(": ")))
    return out


def _grammar_problems(block: Any) -> list[tuple[str, str]]:
    """``params.grammar`` checked as ``--grammar``/``--reasoning-end`` check theirs."""
    from specparity.cli import args

    if block is None:
        return []
    if not isinstance(block, dict):
        return [("header.params.grammar", f"expected an object (kind, name, text, sha256), got {block!r}")]
    out: list[tuple[str, str]] = []
    if block.get("kind") not in ("json", "regex", "lark"):
        out.append(("header.params.grammar.kind", f"expected \"json\", \"regex\" or \"lark\", got "
                                                  f"{block.get('kind')!r}"))
    for key in ("name", "text", "sha256"):
        if block.get(key) is not None and not isinstance(block[key], str):
            out.append((f"header.params.grammar.{key}", f"expected a string, got {block[key]!r}"))
    if block.get("reasoning_end") is not None:
        try:
            args.check_value(args.reasoning_end, block["reasoning_end"], "")
        except args.UsageError as exc:
            out.append(("header.params.grammar.reasoning_end", str(exc).removeprefix(": ")))
    return out


def _is_batch_trace(path: Path) -> bool:
    """Whether a (validated) ``*.jsonl`` is a batch trace: its first record a ``batch_step``."""
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            first = fh.readline(1 << 20)
        rec = json.loads(first)
    except (OSError, ValueError):
        return False
    return isinstance(rec, dict) and rec.get("type") == "batch_step"


def collect(trace_dir: Path, out_dir: Path | None = None) -> list[Graded]:
    """Validate and read every trace under ``trace_dir``; the cases they name."""
    from traces.validate import validate_file

    trace_dir = Path(trace_dir)
    files = find_traces(trace_dir, out_dir)
    if not files:
        raise GradeError(f"{trace_dir}: no *.jsonl traces found")
    problems = [f"{e.path}:{e.line or 0}: {e.field}: {e.message}"
                for f in files for e in validate_file(f)]
    traces: list[tuple[Path, Trace]] = []
    if not problems:
        # a batch trace (a run's batched/<case>/batch.jsonl: batch_step records) is valid but is
        # no request's trace: validated above, not graded (its rows' own traces are)
        files = [f for f in files if not _is_batch_trace(f)]
        if not files:
            raise GradeError(f"{trace_dir}: only batch traces (batch_step records) here, no request "
                             "traces to grade")
        for f in files:
            tr = read_trace(f)
            problems += [f"{f}:1: {fld}: {msg}" for fld, msg in header_problems(tr.header)]
            traces.append((f, tr))
    if problems:
        more = f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise GradeError(f"{len(problems)} problem(s) in the traces:\n" + "\n".join(problems[:20]) + more)
    graded: list[Graded] = []
    counts: dict[str, int] = {}
    for f, tr in traces:
        cid = str(tr.header["case_id"])
        counts[cid] = counts.get(cid, 0) + 1
        graded.append(Graded(f, tr, case_from_header(tr.header, f, trace_dir), cid))
    for g in graded:
        # Engines that reuse one id for many requests are graded per file (the
        # report's "<id> [<file>]" convention), never collapsed into one row.
        if counts[g.key] > 1:
            g.key = f"{g.key} [{g.path.relative_to(trace_dir).as_posix()}]"
    return graded


def _stem(case_id: str) -> str:
    """A file stem for any engine's case id (a digest keeps sanitized or cut ids distinct; an id
    longer than ``STEM_MAX_BYTES`` is cut: a 5,000-character id is a file name the OS refuses)."""
    import hashlib

    raw = case_id.replace("/", "__")
    safe = "".join(c if c.isalnum() or c in "-_.+=" else "_" for c in raw)
    safe = f"_{safe}" if safe.startswith(".") else safe  # never a hidden file
    from specparity.cases.case import STEM_MAX_BYTES

    if safe == raw and len(safe.encode()) <= STEM_MAX_BYTES:  # the id itself (every short safe id)
        return safe
    return f"{safe[:120]}-{hashlib.sha256(case_id.encode()).hexdigest()[:8]}"  # a long id: never ENAMETOOLONG


def _relabel(records: list[dict[str, Any]], case_id: str) -> list[dict[str, Any]]:
    return [{**records[0], "case_id": case_id}, *records[1:]]


def grade(
    trace_dir: Path | str,
    out_dir: Path | str | None = None,
    *,
    runners: list[str] | None = None,
    workers: int = 0,
    ray_address: str | None = None,
    progress: bool = True,
) -> RunResult:
    """Grade every trace under ``trace_dir``; see the module doc."""

    t0 = time.perf_counter()
    trace_dir = Path(trace_dir)
    out = Path(out_dir) if out_dir is not None else trace_dir / "graded"
    graded = collect(trace_dir, out)  # before claiming OUT: a bad folder leaves OUT as it was
    from specparity.jobs.run import in_run_dir

    return in_run_dir(out, "specparity grade",
                      lambda: _grade(graded, out, runners, workers, ray_address, progress, t0))


def _grade(graded: list[Graded], out: Path, runners: list[str] | None, workers: int,
           ray_address: str | None, progress: bool, t0: float) -> RunResult:
    from specparity.cli.progress import Progress

    all_runners, unavailable = available_runners(runners)
    oracles = all_runners[1:]
    result = RunResult(out_dir=out, runners=all_runners, unavailable=unavailable)
    traces: dict[tuple[str, str], Trace] = {}
    for g in graded:
        stem = _stem(g.case_id)
        path = track(out / "traces" / "engine" / f"{stem}.jsonl")
        write_trace(path, _relabel(g.trace.records(), g.case_id))
        result.traces[("engine", g.case_id)] = path
        traces[("engine", g.case_id)] = g.trace
    # Re-runs: plain decode of every spec case (our engine), every oracle on every case.
    by_job: dict[tuple[str, str], list[str]] = {}  # (runner, our case id) -> graded keys
    jobs: list[Job] = []
    for g in graded:
        if g.warm:  # its cold re-run: compared with it by the warm-vs-cold rules, and with the references
            jobs.append(("engine", g.case))
            by_job.setdefault(("engine", g.case.case_id), []).append(f"{g.case_id}#cold")
        if g.case.drafter is not None:
            jobs.append(("engine", g.case.plain()))
            by_job.setdefault(("engine", g.case.plain().case_id), []).append(f"{g.case_id}#plain")
        for r in oracles:
            if not runner_supports(r, g.case):
                continue
            jobs.append((r, g.case))
            by_job.setdefault((r, g.case.case_id), []).append(g.case_id)
    refusals: dict[tuple[str, str], ReferenceRefused] = {}

    def on_result(job: Job, res: tuple[str, Any]) -> None:
        runner, case = job
        kind, payload = res
        for cid in dict.fromkeys(by_job[(runner, case.case_id)]):
            if kind == "refused":
                refusals[(runner, cid)] = ReferenceRefused(runner, cid, payload)
                continue
            key = "plain" if cid.endswith("#plain") else COLD if cid.endswith("#cold") else runner
            if kind == "unsupported":  # the backend lacks an op: that comparison's verdict (issue 31)
                result.unsupported[(key, cid)] = payload
                continue
            bare = cid.removesuffix("#plain").removesuffix("#cold")
            records = _relabel(payload, bare)
            path = track(out / "traces" / key / f"{_stem(bare)}.jsonl")
            write_trace(path, records)
            result.traces[(key, cid)] = path
            traces[(key, cid)] = Trace.from_records(records)
        bar.update(1)

    result.skipped = skip_reasons(oracles, [g.case for g in graded])  # a header's source/options
    unique_jobs = list(dict.fromkeys(jobs))
    if progress:  # the size of the work, said before it starts
        print(f"specparity grade: {len(graded)} traces, {len(unique_jobs)} re-runs on "
              f"{', '.join(['engine', *oracles])}", file=sys.stderr)
    with Progress(len(unique_jobs), "grading (re-runs)", enabled=progress) as bar:
        execute(unique_jobs, on_result, workers=workers, ray_address=ray_address)
    witness = numerics_witness()  # judges a flip by replaying each run's path (engine/witness.py)
    for g in graded:
        eng = g.trace
        if g.warm:
            if (COLD, f"{g.case_id}#cold") in result.unsupported:
                result.comparisons.append(unsupported_comparison(
                    "warm-vs-cold", g.case_id, ["engine"], result.unsupported[(COLD, f"{g.case_id}#cold")]))
                continue
            cold = traces[(COLD, f"{g.case_id}#cold")]
            result.comparisons.append(compare_supported("warm-vs-cold", g.case_id, ["engine"],
                                                        partial(_warm_comparison, g, cold, witness)))
            eng = cold  # the references judge the cold run the warm one was found equal to
        for oracle in oracles:
            if not runner_supports(oracle, g.case):
                continue
            if (oracle, g.case_id) in result.unsupported:
                result.comparisons.append(unsupported_comparison(
                    f"engine-vs-{oracle}", g.case_id, [oracle], result.unsupported[(oracle, g.case_id)]))
                continue
            ref = refusals.get((oracle, g.case_id)) or traces[(oracle, g.case_id)]
            result.comparisons.append(compare_supported(
                f"engine-vs-{oracle}", g.case_id, ["engine", oracle],
                partial(reference_comparison, oracle, g.case_id, eng, ref, witness)))
        if g.case.drafter is not None and g.case.temperature == 0:
            if ("plain", f"{g.case_id}#plain") in result.unsupported:
                result.comparisons.append(unsupported_comparison(
                    "spec-vs-plain", g.case_id, ["engine"], result.unsupported[("plain", f"{g.case_id}#plain")]))
                continue
            plain = traces[("plain", f"{g.case_id}#plain")]
            result.comparisons.append(compare_supported(
                "spec-vs-plain", g.case_id, ["engine"],
                partial(tokens_comparison, "spec-vs-plain", g.case_id, eng, plain, witness)))
        elif not any(runner_supports(o, g.case) for o in oracles):
            result.comparisons.append(not_compared(g.case, g.case_id))
    # the report reads OUT/traces/<runner>/: the plain re-runs are plain-mode traces
    report_traces = {(k[0], k[1].removesuffix("#plain").removesuffix("#cold")): v
                     for k, v in traces.items()}
    result.wall_s = time.perf_counter() - t0
    finish(result, report_traces)
    return result


COLD = "engine-cold"
"""Where a warm trace's cold re-run goes (``OUT/traces/engine-cold/``)."""


def _warm_comparison(g: Graded, cold: Trace, witness: Any) -> Comparison:
    """``warm-vs-cold``: a warm prompt-cache trace against its cold re-run, by the warm-vs-cold
    rules (:func:`warm_as_cold`); a flip the witness calls arithmetic is ``numerics`` (reported,
    not failed, as the sessions report it off a bit-exact backend), anything else ``logic``."""
    from engine.backend import arithmetic
    from specparity.runners import case_paths, load_model

    tpath, _ = case_paths(g.case)
    exact = arithmetic(load_model(str(tpath)).model, None).exact
    warm, c = warm_as_cold(g.trace, cold, exact=exact)
    d = diff_traces(warm, c, level="round", witness=witness)
    status = "numerics" if d is not None and d.klass == "numerics" else None
    detail = (f"warm prompt-cache request (reused {reused_prefix(g.trace)} prompt tokens) vs its cold "
              "re-run; the references are compared with the cold run")
    return Comparison("warm-vs-cold", g.case_id, "round", d, status=status, detail=detail)


def grade_main(args: argparse.Namespace) -> int:
    """``specparity grade DIR`` (see ``specparity/commands/grade.py``)."""
    try:
        result = grade(args.dir, args.out, runners=args.runners, workers=args.workers,
                       ray_address=args.ray, progress=not getattr(args, "quiet", False))
    except GradeError as exc:
        print(f"specparity grade: error: {exc}", file=sys.stderr)
        return 1
    print((result.out_dir / "summary.md").read_text())
    print(f"graded {sum(1 for k in result.traces if k[0] == 'engine')} traces; verdicts and report "
          f"written to {result.out_dir}/", file=sys.stderr)
    return 0 if result.ok else 1
