"""Grade a third-party MLX speculative engine (a subject) and write the scoreboard.

``specparity grade --engine NAME [--out DIR]`` (``NAME``: a ``subject`` of the
runner registry, ``specparity/runners/subjects.py`` from ``subjects.SUBJECTS``,
or ``all``) runs every mode of the subject on zoo cases
and the checks of ``subjects/checks.py`` against references computed here,
independently of the subject:

- plain decode: our engine's ``engine.executor.plain_generate`` on the same
  target directory, on the same device (greedy, or sampled for the
  distribution check with the same temperature/top-k);
- mlx-lm speculative decoding: the committed mlx-lm 0.32.2 goldens
  (``traces/golden/mlx_lm``, two-model pairs), so a subject that replaces the
  ``mlx_lm`` module (mlx-lm-broomva) is still compared with the real one.

Writes ``DIR/<engine>.json`` (one result per mode × check), the subject's
traces under ``DIR/traces/<engine>/`` and regenerates ``DIR/scoreboard.md`` /
``.html`` from every ``DIR/*.json`` (``reports/scoreboard.py``), so runs in
separate environments (one per subject: their pins conflict) add up to one
scoreboard. Exit 0 when every engine asked for was graded and nothing failed,
1 when a check failed, 2 on usage or when a named engine is not installed here
(with its install hint; ``all``: when none is).

Reproduce one case: ``python -m specparity.grading.engines ENGINE --case CASE_ID``
prints the subject's stream beside plain decode and the check verdicts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from specparity.runners.registry import availability
from subjects import SUBJECTS, Mode, load
from subjects.base import SubjectCase, SubjectRun, to_trace
from subjects.checks import (
    CHECKS,
    CheckResult,
    check_budget,
    check_counters,
    check_distribution,
    check_eos,
    check_identity,
    check_mlx_lm,
    check_stop,
    guarded,
)
from traces.io import read_trace, write_trace
from traces.records import platform_info

DEFAULT_OUT = Path("runs/grade-engines")
PROMPTS = ("nat-00", "rnd-00")
MAX_TOKENS = 24
GOLDEN_MAX = 32


def _log(msg: str) -> None:
    print(f"[grade] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ references


@cache
def _target_model(target: str) -> Any:
    import zoo
    from specparity.runners import load_model

    return load_model(str(zoo.model_dir(target))).model


def _eos(case: SubjectCase) -> tuple[int, ...]:
    import zoo

    return (zoo.eos_id(),) if case.eos_ids is None else tuple(case.eos_ids)


@cache
def _plain_cached(target: str, prompt_id: str, max_tokens: int, eos: tuple[int, ...],
                  temperature: float, top_k: int, seed: int) -> tuple[int, ...]:
    import zoo
    from engine.executor import GenerationParams, plain_generate
    from engine.sampler import SamplerParams

    params = GenerationParams(max_tokens=max_tokens, gamma=0, seed=seed, eos_ids=eos, cache_digests=False,
                              sampler=SamplerParams(temperature=temperature, top_k=top_k))
    res = plain_generate(_target_model(target), list(zoo.prompt(prompt_id).token_ids), params)
    return tuple(res.output_ids)


def plain(case: SubjectCase) -> list[int]:
    """Greedy plain decode of the case's target (our engine), honouring EOS and budget."""
    return list(_plain_cached(case.target, case.prompt_id, case.max_tokens, _eos(case), 0.0, 0, 0))


def plain_sample(case: SubjectCase) -> list[int]:
    return list(_plain_cached(case.target, case.prompt_id, case.max_tokens, _eos(case),
                              case.temperature, case.top_k, case.seed))


def _golden(case: SubjectCase) -> Any:
    name = f"{case.target}__{case.drafter}__{case.prompt_id}__g{case.gamma}__n{GOLDEN_MAX}.jsonl"
    return read_trace(Path(__file__).resolve().parents[2] / "traces" / "golden" / "mlx_lm" / name)


def golden_mlx_lm(case: SubjectCase) -> list[int]:
    """mlx-lm 0.32.2's two-model output for the case, from the committed golden."""
    return list(_golden(case).footer["output_ids"])[: case.max_tokens]


def golden_mlx_lm_rounds(case: SubjectCase) -> list[tuple[list[int], int, list[int]]]:
    """mlx-lm 0.32.2's rounds for the case: (drafts, k_accept, emitted) each."""
    return [(list(r["drafts"]), int(r["k_accept"]), list(r["emitted"])) for r in _golden(case).rounds]


def _golden_cases(mode: Mode, base: list[SubjectCase]) -> list[SubjectCase]:
    out = []
    for c in base:
        if c.target in ("llama", "qwen3") and c.drafter == "twin" and c.gamma in (1, 3):
            out.append(c.with_(max_tokens=GOLDEN_MAX, eos_ids=None))
    return out


# ------------------------------------------------------------------ grading


class Recorder:
    """Wraps a subject's ``generate``: caches runs and writes each as a trace."""

    def __init__(self, name: str, mod: Any, trace_dir: Path) -> None:
        self.name, self.mod, self.dir = name, mod, trace_dir
        self.runs: dict[SubjectCase, SubjectRun] = {}
        self.info = {"name": name, "package": SUBJECTS[name].package.split("==")[0], "version": mod.version()}

    def __call__(self, case: SubjectCase) -> SubjectRun:
        if case in self.runs:
            return self.runs[case]
        run = self.mod.generate(case)
        self.runs[case] = run
        if case.temperature == 0:
            try:
                self._write(case, run)
            except (OSError, ValueError) as exc:  # a trace the harness cannot write is not the subject's fault
                _log(f"{self.name}: trace of {case.case_id} not written: {exc}")
        return run

    def _write(self, case: SubjectCase, run: SubjectRun) -> None:
        import zoo
        from specparity.runners import model_identity

        ids = list(zoo.prompt(case.prompt_id).token_ids)
        target = model_identity(zoo.model_dir(case.target))
        dpath = getattr(self.mod, "drafter_path", lambda c: None)(case)
        drafter = {"path": dpath, "weights_sha256": None, "config_sha256": None} if dpath else None
        recs = to_trace(self.info, case, run, ids, list(_eos(case)), target, drafter)
        safe = case.case_id.replace(":", "__").replace("/", "__")
        from specparity.cli.outdir import track

        write_trace(track(self.dir / f"{safe}.jsonl"), recs)


def _eos_cases(base: list[SubjectCase], plain_ref: Callable[[SubjectCase], list[int]]) -> list[SubjectCase]:
    """The base cases with an EOS planted inside the generation (as the eos check does)."""
    from subjects.checks import plant

    out = []
    for c in base:
        full = plain_ref(c.with_(eos_ids=()))
        j = plant(full)
        if j is not None:
            out.append(c.with_(eos_ids=(full[j],)))
    return out


def grade_mode(name: str, gen: Callable[[SubjectCase], SubjectRun], mode_name: str, mode: Mode,
               plain_ref: Callable[[SubjectCase], list[int]] = plain,
               sample_ref: Callable[[SubjectCase], list[int]] = plain_sample,
               mlx_lm_ref: Callable[[SubjectCase], list[int]] = golden_mlx_lm,
               dist_n: int | None = None,
               mlx_lm_rounds: Callable[[SubjectCase], list[tuple[list[int], int, list[int]]]] | None
               = golden_mlx_lm_rounds) -> dict[str, CheckResult]:
    """Every check on one mode of a subject."""
    base = [SubjectCase(target=t, mode=mode_name, drafter=mode.drafter, prompt_id=p, max_tokens=MAX_TOKENS)
            for t in mode.targets[:2] for p in PROMPTS]
    out: dict[str, CheckResult] = {}

    def run(check: str, fn: Callable[[], CheckResult]) -> None:
        if check in mode.unsupported:
            out[check] = CheckResult(check, "unsupported", mode.unsupported[check])
            return
        t0 = time.perf_counter()
        out[check] = guarded(check, fn)
        _log(f"{name}/{mode_name}: {check}: {out[check].status} ({time.perf_counter() - t0:.1f}s)"
             + ("" if out[check].status == "pass" else f" - {out[check].detail}"))

    run("identity", lambda: check_identity(gen, plain_ref, base))
    golden = _golden_cases(mode, base)
    run("mlx_lm", lambda: check_mlx_lm(
        gen, mlx_lm_ref if (mode.two_model and golden) else None, golden,
        why_not="not a two-model mode" if not mode.two_model else "no mlx-lm golden for this pair",
        rounds=mlx_lm_rounds))
    run("budget", lambda: check_budget(gen, plain_ref, base[:2]))
    run("eos", lambda: check_eos(gen, plain_ref, base))
    run("stop", lambda: check_stop(gen, plain_ref, base[:2]))
    run("counters", lambda: check_counters(gen, base + [c.with_(max_tokens=m, eos_ids=()) for c in base[:1]
                                                         for m in (2, 5, 9)] + _eos_cases(base, plain_ref)))
    if mode.samples:
        dcase = SubjectCase(target=mode.targets[0], mode=mode_name, drafter=mode.drafter, prompt_id="nat-00",
                            max_tokens=2, temperature=0.7, top_k=mode.top_k)
        kw = {} if dist_n is None else {"n": dist_n}
        run("distribution", lambda: check_distribution(gen, sample_ref, dcase, **kw))
    else:
        run("distribution", lambda: check_distribution(gen, None, None, why_not=mode.unsupported.get(
            "distribution", "greedy only: the speculative path takes no temperature")))
    return out


def grade_engine(name: str, out: Path) -> dict[str, Any]:
    """Grade subject ``name`` here; returns (and writes) its result document."""
    info = SUBJECTS[name]
    from subjects.common import dist_version

    doc: dict[str, Any] = {"engine": name, "package": info.package.split("==")[0], "pinned": info.package,
                           "tox_env": info.tox_env, "platform": platform_info(), "modes": {},
                           "deps": {d: dist_version(d) for d in ("mlx-lm", "mlx-vlm", "transformers")}}
    ok, why = availability(name)
    if not ok:
        doc.update(available=False, reason=why, version=None)
        _log(f"{name}: not available: {why}")
        return doc
    mod = load(name)
    doc.update(available=True, reason="ok", version=mod.version())
    if not mod.MODES:
        doc.update(available=False, reason=f"{info.package.split('==')[0]} {mod.version()} installed; "
                   + getattr(mod, "NOT_DRIVEN", "no mode driven"))
        _log(f"{name}: {doc['reason']}")
        return doc
    rec = Recorder(name, mod, out / "traces" / name)
    for mode_name, mode in mod.MODES.items():
        _log(f"{name}: mode {mode_name} ({mode.note})")
        results = grade_mode(name, rec, mode_name, mode)
        doc["modes"][mode_name] = {
            "note": mode.note, "drafter": mode.drafter, "targets": list(mode.targets[:2]),
            "checks": {c: results[c].to_dict() for c in CHECKS if c in results},
        }
    return doc


def _failed(doc: dict[str, Any]) -> bool:
    return any(r["status"] == "fail" for m in doc.get("modes", {}).values() for r in m["checks"].values())


def engine_names(given: str) -> list[str]:
    """``--engine``'s subjects: one registry subject, or every one for ``all`` (one-line
    RunnerUnsupported, exit 2, for a blank or unknown name or a runner that is not a subject)."""
    from specparity.runners import registry

    if given == "all":
        return registry.names("subject")
    return [registry.get(given, kind="subject", what="engine").name]


def grade_engine_main(args: argparse.Namespace) -> int:
    """``specparity grade --engine NAME|all [--out DIR]``.

    Exit 0 when every engine asked for was graded here and no check failed, 1 when a check
    failed, 2 when a named engine is not installed here (its install hint: each subject runs in
    its own environment) or, for ``all``, when none is; ``all`` grades the installed ones and
    names the others (their scoreboard rows come from their own environments).
    """
    from specparity.runners import RunnerUnsupported

    try:
        names = engine_names(args.engine)
    except RunnerUnsupported as exc:
        print(f"specparity grade: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if getattr(args, "out", None) else DEFAULT_OUT
    from specparity.cli.outdir import add_outputs

    with add_outputs(out, "specparity grade --engine", recognise=engine_output) as claim:
        for n in names:  # refused before any engine runs if one of these is not ours
            claim.check(out / f"{n}.json")
        for name in ("scoreboard.md", "scoreboard.html"):
            claim.check(out / name)
        return _grade_engines(args, names, out, claim)


def engine_output(p: Path) -> bool:
    """Whether an existing file is one ``grade --engine`` wrote (before output markers existed)."""
    from specparity.cli.args import is_trace, read_small_json

    if p.suffix == ".jsonl":
        return is_trace(p)
    if p.suffix == ".json":
        doc = read_small_json(p)
        return isinstance(doc, dict) and "engine" in doc and "modes" in doc
    try:
        if not p.is_file():
            return False
        with open(p, encoding="utf-8") as fh:
            head = fh.read(200)
    except (OSError, UnicodeDecodeError):
        return False
    return head.startswith(("# Scoreboard:", "<!doctype html><html><head><meta charset='utf-8'>"
                                             "<title>Scoreboard</title>"))


def _grade_engines(args: argparse.Namespace, names: list[str], out: Path, claim: Any) -> int:
    from specparity.runners import registry
    from traces.io import atomic_write_text

    failed = False
    unavailable: dict[str, str] = {}
    for n in names:
        path = out / f"{n}.json"
        installed, why = registry.availability(n)
        if not installed:
            unavailable[n] = why
        doc = grade_engine(n, out)
        if not doc["available"] and path.exists() and json.loads(path.read_text()).get("available"):
            # never clobber a grade made in the engine's own environment with "not installed here"
            _log(f"{n}: not available here; kept {path} (graded in its own environment)")
            continue
        atomic_write_text(claim.track(path), json.dumps(doc, indent=2, sort_keys=True) + "\n")
        failed |= _failed(doc)
    from reports.scoreboard import write_scoreboard

    md, html = write_scoreboard(out, track=claim.track)
    print(f"scoreboard: {md} {html}")
    for n, why in unavailable.items():
        hint = registry.get(n).install_hint
        print(f"specparity grade: {n} is not installed here: {why}"
              + ("" if hint in why else f"; run it with: {hint}"), file=sys.stderr)
    if failed:
        return 1
    if unavailable and (args.engine != "all" or len(unavailable) == len(names)):
        return 2  # nothing graded for the engine(s) asked for: never a silent success
    return 0


# ------------------------------------------------------------------ reproduction


def reproduce(name: str, case_id: str) -> int:
    case = SubjectCase.from_id(case_id)
    ok, why = availability(name)
    if not ok:
        print(f"{name}: not available here: {why}", file=sys.stderr)
        return 2
    mod = load(name)
    run = mod.generate(case)
    ref = plain(case)
    print(f"engine {name} {mod.version()} case {case.case_id}")
    print(f"  subject stream ({len(run.stream)}): {run.stream}  finish_reason={run.finish_reason!r}")
    print(f"  plain decode   ({len(ref)}): {ref}")
    print(f"  eos ids {list(_eos(case))}, stop ids {list(case.stop_ids)}, max_tokens {case.max_tokens}")
    if run.rounds is not None:
        print(f"  rounds (drafted, accepted, committed): {[(r.drafted, r.accepted, r.committed) for r in run.rounds]}")
    if run.counters:
        print(f"  engine counters: {run.counters}")
    from subjects.checks import counter_problems, first_divergence

    i = first_divergence(run.stream, ref)
    print("  identical to plain decode" if i is None else f"  first difference at output token {i}")
    for p in counter_problems(run):
        print(f"  counters: {p}")
    return 0 if i is None else 1


def main(argv: list[str] | None = None) -> int:
    from specparity.cli.args import writable_dir

    p = argparse.ArgumentParser(prog="python -m specparity.grading.engines",
                                description="grade a subject, or reproduce one of its cases")
    p.add_argument("engine")
    p.add_argument("--case", default=None, help="a case id from the scoreboard: run it and show the difference")
    p.add_argument("--out", type=writable_dir, default=None)
    a = p.parse_args(argv)
    from specparity.cli.args import UsageError
    from specparity.cli.outdir import refusal
    from specparity.runners import RunnerUnsupported

    try:
        engine_names(a.engine)
    except RunnerUnsupported as exc:
        p.error(str(exc))
    if a.case is not None:
        try:
            return reproduce(a.engine, a.case)
        except ValueError as exc:
            print(f"specparity.grading.engines: error: {exc}", file=sys.stderr)
            return 2
    try:
        return grade_engine_main(a)
    except UsageError as exc:  # --out holding a user's file: one line, before any engine runs
        return refusal(p.prog, exc)


if __name__ == "__main__":
    sys.exit(main())
