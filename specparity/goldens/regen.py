"""Regenerate golden traces (``specparity regen``).

The matrix is every golden set the runner registry declares (``Runner.goldens``) × its cases, optionally
narrowed by runner, by a glob on the case id / file stem, or to the goldens
that are stale, corrupt or missing (``--stale-only``). Each (runner, case) is
one task, :func:`regen_task`, run on a local process pool (``spawn``; each
worker loads the zoo models once) or on Ray (``--ray [ADDRESS]``), both from
``specparity.cli.pool`` (shared with the main job): the same function on both
paths, so their goldens are byte-identical.

Only this (parent) process writes. For each result it compares the new trace
with the old golden (``diff_traces`` at round level) and then:

- same inputs, no divergence: the old file is kept (no churn);
- changed inputs or a ``numerics`` divergence: the golden is rewritten
  (atomically, ``traces.io.write_trace``), then its manifest entry is updated
  (the manifest is rewritten atomically after every golden);
- a ``logic`` divergence: the golden is kept and the change reported, unless
  ``accept`` is set; the run then exits 1.

Every write into the golden directory (golden, manifest, journal, temp-file
cleanup) first asserts that this process holds the directory's lock
(``goldens.assert_lock_held``: the kernel's flock and the holder's pid), so a
write path outside :func:`regen`'s lock fails loudly instead of racing another
regen.

Interruption: every golden file is either old or new (atomic rename), and a
golden whose manifest entry was not yet updated is simply regenerated. The
run's progress and drift entries are kept in ``<golden dir>/.regen-journal.json``
(atomic too); a restart with the same selection resumes from it — goldens
already done whose recorded inputs match the current ones are skipped — and
the final drift report covers the whole run. The journal is removed when a run
completes.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from specparity.cli.pool import execute
from specparity.goldens import manifest as g
from specparity.runners import registry

JOURNAL_NAME = ".regen-journal.json"


def regen_task(runner: str, case: Any) -> tuple[str, list[dict[str, Any]]]:
    """Run one (runner, case) and return ``(key, normalised records)``.

    The one task function of both executors (process pool and Ray).
    """
    from specparity.runners import run_case

    produce = registry.golden_sets()[runner].produce
    records = produce(case) if produce is not None else run_case(runner, case)
    return g.golden_key(runner, case), g.normalize_records(records)


@dataclass
class Outcome:
    key: str
    status: str  # unchanged | new | updated | numerics | logic-accepted | logic-refused | error | unavailable
    reasons: list[str] = field(default_factory=list)
    where: str | None = None
    field: str | None = None
    klass: str | None = None
    message: str | None = None

    @property
    def changed(self) -> bool:
        return self.status not in ("unchanged", "unavailable")


@dataclass
class RegenResult:
    outcomes: list[Outcome]
    selected: int
    skipped_done: int
    wall_s: float
    required: tuple[str, ...] = ()  # runners asked for by name: unavailable is then a failure

    @property
    def refused(self) -> list[Outcome]:
        return [
            o for o in self.outcomes
            if o.status in ("logic-refused", "error")
            or (o.status == "unavailable" and o.key.split("/")[0] in self.required)
        ]

    @property
    def regenerated(self) -> int:
        return sum(1 for o in self.outcomes if o.status not in ("error", "unavailable", "logic-refused"))

    @property
    def exit_code(self) -> int:
        return 1 if self.refused else 0


def select(
    golden_dir: Path,
    runners: Iterable[str] | None = None,
    case_glob: str | None = None,
    stale_only: bool = False,
    ctx: g.InputsContext | None = None,
) -> dict[str, tuple[str, Any]]:
    """``{key: (runner, case)}`` of the goldens to regenerate."""
    sets = registry.golden_sets()
    runners = list(runners) if runners else list(sets)
    unknown = [r for r in runners if r not in sets]
    if unknown:
        raise ValueError(f"no goldens for runner(s) {unknown}; known: {', '.join(sets)}")
    chosen = g.golden_cases(runners)
    if case_glob:
        chosen = {k: (r, c) for k, (r, c) in chosen.items()
                  if fnmatchcase(c.case_id, case_glob) or fnmatchcase(c.file_stem, case_glob)
                  or fnmatchcase(k, case_glob)}
    if stale_only:
        bad = {p.key for p in g.check_goldens(golden_dir, runners=runners, keys=chosen, ctx=ctx)}
        chosen = {k: v for k, v in chosen.items() if k in bad}
    return chosen


def _load_journal(golden_dir: Path, args_id: dict[str, Any]) -> dict[str, Any] | None:
    p = golden_dir / JOURNAL_NAME
    if not p.exists():
        return None
    try:
        j = json.loads(p.read_text())
    except ValueError:
        return None
    return j if j.get("args") == args_id else None


def _save_journal(golden_dir: Path, journal: dict[str, Any]) -> None:
    g.assert_lock_held(golden_dir, "the regen journal")
    g.atomic_write_text(golden_dir / JOURNAL_NAME, json.dumps(journal, indent=1, sort_keys=True))


def _remove_leftovers(golden_dir: Path) -> None:
    """Temp files of a killed writer (hidden ``.NAME.*.tmp``; never a golden)."""
    g.assert_lock_held(golden_dir, "removing temp files")
    for p in golden_dir.rglob(".*.tmp"):
        p.unlink(missing_ok=True)


def _progress(total: int) -> Any:
    from specparity.cli.progress import progress

    return progress(total, "regen goldens", "golden")


def regen(
    golden_dir: Path | str = g.GOLDEN_DIR,
    *,
    runners: Iterable[str] | None = None,
    case_glob: str | None = None,
    stale_only: bool = False,
    accept: bool = False,
    workers: int | None = None,
    ray: bool = False,
    ray_address: str | None = None,
    progress: bool = True,
) -> RegenResult:
    """Regenerate the selected goldens into ``golden_dir``; see the module doc.

    ``workers``: process-pool size (None: the CPU count; 0: in this process).
    A second regen on the same directory is refused (``specparity.cli.outdir.Busy``).
    """
    from specparity.cli.outdir import lock_dir

    # One regen per golden directory: a second one is refused (its manifest
    # entries would otherwise overwrite ours); the lock dies with the process.
    with lock_dir(golden_dir, "specparity regen", flag="--golden-dir", what="golden directory"):
        return _regen(Path(golden_dir), runners=runners, case_glob=case_glob,
                      stale_only=stale_only, accept=accept, workers=workers, ray=ray,
                      ray_address=ray_address, progress=progress)


def _regen(
    golden_dir: Path,
    *,
    runners: Iterable[str] | None,
    case_glob: str | None,
    stale_only: bool,
    accept: bool,
    workers: int | None,
    ray: bool,
    ray_address: str | None,
    progress: bool,
) -> RegenResult:
    from traces.diff import diff_traces
    from traces.io import Trace, read_trace, write_trace

    t0 = time.perf_counter()
    runners = list(runners) if runners else None
    _remove_leftovers(golden_dir)  # under the lock: no other writer's temp files
    ctx = g.InputsContext()
    args_id = {"runners": runners, "case": case_glob, "stale_only": stale_only, "accept": accept}
    journal = _load_journal(golden_dir, args_id)
    if journal is not None:
        # Resume: the original selection, minus what was done with current inputs.
        everything = g.golden_cases(runners)
        chosen = {k: everything[k] for k in journal["selection"] if k in everything}
    else:
        chosen = select(golden_dir, runners, case_glob, stale_only, ctx)
        journal = {"args": args_id, "selection": sorted(chosen), "done": {}}
        _save_journal(golden_dir, journal)
    manifest = g.load_manifest(golden_dir)
    entries = manifest.setdefault("goldens", {})
    skipped = 0
    jobs: list[tuple[str, Any]] = []
    unavailable = _unavailable_runners({r for r, _ in chosen.values()})
    for key, (runner, case) in chosen.items():
        if runner in unavailable:
            # Never a raw import error per golden: one clear reason, golden left as it is.
            journal["done"][key] = asdict(Outcome(key, "unavailable", message=unavailable[runner]))
            continue
        entry, path = entries.get(key), g.golden_path(golden_dir, key)
        if (key in journal["done"] and entry is not None and path.exists()
                and entry.get("sha256") == g.file_sha256(path)
                and entry.get("inputs") == ctx.inputs(runner, case)):
            skipped += 1
            continue
        if key in journal["done"] and journal["done"][key]["status"] == "logic-refused":
            skipped += 1  # refused once in this run; not redone on resume
            continue
        jobs.append((runner, case))

    def on_result(key: str, records: Any, exc: BaseException | None) -> None:
        runner, case = chosen[key]
        if exc is not None:
            out = Outcome(key, "error", message=f"{type(exc).__name__}: {exc}")
        else:
            out = _apply(key, runner, case, records)
        journal["done"][key] = asdict(out)
        _save_journal(golden_dir, journal)
        bar.update(1)

    def _apply(key: str, runner: str, case: Any, records: list[dict[str, Any]]) -> Outcome:
        path = g.golden_path(golden_dir, key)
        inputs = ctx.inputs(runner, case)
        entry = entries.get(key)
        old: Trace | None = None
        if path.exists():
            try:
                old = read_trace(path)
            except Exception:  # a corrupt golden is replaced
                old = None
        new = Trace.from_records(records)
        reasons = g.input_changes(entry["inputs"], inputs) if entry else []
        div = diff_traces(old, new, level="round") if old is not None else None
        intact = entry is not None and path.exists() and entry.get("sha256") == g.file_sha256(path)
        if old is not None and div is None and intact and not reasons:
            return Outcome(key, "unchanged")
        if div is not None and div.klass == "logic" and not accept:
            return Outcome(key, "logic-refused", reasons, div.where, div.field, div.klass, div.message)
        g.assert_lock_held(golden_dir, f"golden {key}")  # the read-modify-write is ours alone
        path.parent.mkdir(parents=True, exist_ok=True)
        write_trace(path, records)
        entries[key] = g.manifest_entry(key, inputs, path)
        g.assert_lock_held(golden_dir, "the manifest")
        g.save_manifest(manifest, golden_dir)
        if div is None:
            return Outcome(key, "new" if old is None else "updated", reasons)
        status = "numerics" if div.klass == "numerics" else "logic-accepted"
        return Outcome(key, status, reasons, div.where, div.field, div.klass, div.message)

    with _progress(len(jobs)) if progress else _NoBar() as bar:
        if jobs:
            execute(regen_task, jobs, lambda job, res, exc: on_result(g.golden_key(*job), None if exc else res[1], exc),
                    workers=workers if workers is not None else os.cpu_count() or 1,
                    ray_address=(ray_address or "") if ray else None, ray_cpus=2)
    outcomes = [Outcome(**journal["done"][k]) for k in sorted(journal["done"])]
    g.assert_lock_held(golden_dir, "removing the regen journal")
    (golden_dir / JOURNAL_NAME).unlink(missing_ok=True)
    return RegenResult(outcomes, len(chosen), skipped, time.perf_counter() - t0, tuple(runners or ()))


def _unavailable_runners(names: Iterable[str]) -> dict[str, str]:
    """``{golden set: why}`` for golden sets whose reference is not installed here (a set's
    availability is the availability of the runner that declares it)."""
    out = {}
    for name in names:
        runner = registry.golden_owner(name) if name in registry.golden_sets() else None
        if runner is not None and runner.kind == "reference":
            ok, why = runner.availability()
            if not ok:
                out[name] = f"oracle unavailable: {why}"
    return out


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *a: object) -> None:
        return None

    def update(self, n: int) -> None:
        return None


def drift_report(result: RegenResult) -> str:
    """The Markdown drift report: every golden that changed, why and where."""
    lines = [
        "# Golden regeneration: drift report",
        "",
        f"{result.selected} selected, {result.skipped_done} already done (resumed), "
        f"{result.regenerated} regenerated in {result.wall_s:.1f} s.",
        "",
    ]
    counts: dict[str, int] = {}
    for o in result.outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    lines.append(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "nothing regenerated")
    changed = [o for o in result.outcomes if o.changed]
    if changed:
        lines += ["", "| golden | status | first divergent round | field | class | input changes |",
                  "|---|---|---|---|---|---|"]
        for o in changed:
            lines.append(f"| {o.key} | {o.status} | {o.where or ''} | {o.field or ''} | "
                         f"{o.klass or ''} | {'; '.join(o.reasons)} |")
        details = [o for o in changed if o.message]
        if details:
            lines += ["", "## Details", ""]
            for o in details:
                lines += [f"### {o.key} ({o.status})", "", "```", o.message or "", "```", ""]
    refused = [o for o in result.outcomes if o.status == "logic-refused"]
    errors = [o for o in result.outcomes if o.status == "error"]
    if refused:
        lines += ["", "Not written (run again with `--accept` to take a logic change):", ""]
        lines += [f"- {o.key}: {o.where}, {o.field}" for o in refused]
    if errors:
        lines += ["", "Failed (no golden written):", ""]
        lines += [f"- {o.key}: {o.message}" for o in errors]
    missing: dict[str, list[str]] = {}
    for o in result.outcomes:
        if o.status == "unavailable":
            missing.setdefault(o.message or "", []).append(o.key)
    for why, keys in missing.items():
        runner = keys[0].split("/")[0]
        lines += ["", f"Not regenerated ({len(keys)} {runner} goldens left as they are): {why}"]
    return "\n".join(lines) + "\n"


def write_report(result: RegenResult, out_dir: Path) -> Path:
    from traces.io import atomic_write_json, atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "drift.json", {
        "selected": result.selected, "skipped_done": result.skipped_done,
        "wall_s": result.wall_s, "outcomes": [asdict(o) for o in result.outcomes],
    })
    path = out_dir / "drift.md"
    atomic_write_text(path, drift_report(result))
    return path
