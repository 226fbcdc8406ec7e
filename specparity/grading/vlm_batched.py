"""Grade mlx-vlm's batched speculative loops (MTP, DFlash) for B-invariance; their scoreboard row.

``python -m specparity.grading.vlm_batched [--out DIR] [--mode mtp|dflash] [--pair NAME]``
(in mlx-vlm's environment: ``tox exec -e vlm -- python -m specparity.grading.vlm_batched --out
docs/scoreboard``) drives ``oracles.mlx_vlm_batched.run_batch`` — mlx-vlm 0.7.10's
``BatchGenerator`` with a drafter, unmodified — on zoo pairs (:data:`PAIRS`) at B = 1, 2 and 4
(the prompts and budgets of the run's batched cases, ``specparity.jobs.batched``: 28/16/25/11
prompt tokens, budgets 12/20/7/16, rows finishing at different steps, one by EOS on gemma4),
and grades, per loop (``mtp``: ``_mtp_rounds_batch``; ``dflash``: ``_dflash_rounds_batch``):

- ``B2`` / ``B4`` — B-invariance: each row's tokens among its batch-mates against the same
  row alone (B = 1) through the same loop, ``engine.batched_check``'s verdict words: identical;
  ``numerics`` only with evidence (both verify rows at the first differing token recorded, the
  two within twice the backend's stated bound, each run's token its own row's pick on a
  knife-edge no wider than their difference, both runs reproduced); ``logic`` otherwise
  (on the CPU the bound is 0: every flip is logic). A difference names the row, its prompt,
  the output token, the batch step and the rows present.
- ``seeded`` — the same at B = 4 with sampled rows (T 0.8): the server's sampler for a seeded
  request (``_PositionedTargetSampler``, draws keyed per (seed, row id, position)).
- ``serial`` — identity with our engine: every greedy row (B = 1, 2, 4) emits the engine's
  serial output for the same row (``run_case("engine", Case(...))``: the engine source with
  the same head or drafter, lossless, so also plain greedy decode); at B = 1 the loop's rounds
  (window, accepted count) equal the engine's where the source matches ours round for round
  (``Pair.rounds``: the §3-aligned ``pre-norm`` qwen35 target, as
  ``conformance/test_mtp_references.py`` pairs them).
- ``acceptance`` — what the loop commits per row and step: never more than the row's own walk
  accepted; where the loop declares uniform acceptance (``requires_uniform_batch_acceptance``,
  mlx-vlm #1962) every row of a step commits the same count (the clamp to the earliest
  rejection), otherwise each row its own. Reported with how many drafts the clamp discarded.

Writes ``DIR/mlx_vlm_batched.json`` (``kind: "batched"``, one mode per loop, per-row verdicts)
and regenerates ``DIR/scoreboard.md``/``.html`` (``reports/scoreboard.py``). Exit 0 when every
check passes, 1 on a finding, 2 when mlx-vlm is not installed here.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from subjects.checks import CheckResult, first_divergence

NAME = "mlx_vlm_batched"
TOX_ENV = "vlm"
DEFAULT_OUT = Path("runs/scoreboard")
CHECKS = ("B2", "B4", "seeded", "serial", "acceptance")
SEEDED_T = 0.8
SEED = 3
ROUNDS = "engine serial rounds"
_NUMERIC_BOUND_OFF_CPU = 1e-2  # |Δ logit| the H200 fp32 zoo measurement bounds (docs/backends.md)


@dataclass(frozen=True)
class Pair:
    """One zoo pair a loop runs on, and the engine case that is its serial reference."""

    mode: str  # the loop: "mtp" | "dflash" (mlx-vlm's draft kind)
    target: str
    drafter: str  # the zoo head (zoo.heads) or DSpark artifact (zoo.dspark) mlx-vlm loads
    hidden: str  # oracles.mlx_vlm.load_target: "native" | "pre-norm"
    engine_drafter: str  # the engine case's drafter name
    source: str  # the engine case's source
    gamma: int  # the engine case's γ; mlx-vlm's verify block is γ + 1
    rounds: bool  # at B = 1 the loop's rounds are the engine's (the source matches ours)
    note: str = ""

    @property
    def name(self) -> str:
        return f"{self.target}/{self.drafter}" + ("" if self.hidden == "native" else f"/{self.hidden}")

    def drafter_dir(self) -> Path:
        if self.mode == "dflash":
            from zoo.dspark import artifact_dir

            return Path(artifact_dir(self.drafter))
        from zoo.heads import head_dir

        return Path(head_dir(self.drafter))


PAIRS = (
    Pair("mtp", "qwen35", "qwen35-mtp-self", "pre-norm", "qwen35-mtp-self", "mtp", 2, True,
         "qwen3_5_mtp head on the §3-aligned target adapter (final norm in the head): rounds comparable"),
    Pair("mtp", "qwen35", "qwen35-mtp", "native", "qwen35-mtp", "mtp", 2, False,
         "qwen3_5_mtp head on mlx-vlm's qwen3_5 as is (post-norm hidden: drafts differ from §3, "
         "mlx-vlm-mtp-post-norm-hidden; tokens compared)"),
    Pair("mtp", "gemma4", "gemma4-assistant-self", "native", "gemma4-assistant-self", "assistant", 3, False,
         "gemma4 assistant drafter (kind mtp; one draft position per block, "
         "mlx-vlm-assistant-fixed-draft-position; tokens compared); sliding window 32: rows wrap"),
    Pair("dflash", "gemma4", "gemma4-dspark", "native", "dspark-t0", "dspark", 4, True,
         "DSparkDraftModel bound to the zoo target's untied head (no confidence pruning: the engine at "
         "threshold 0); sliding window 32: rows wrap"),
    Pair("dflash", "gemma4", "gemma4-deepspec-kv", "native", "deepspec-kv-t0", "deepspec", 4, True,
         "Gemma4DSparkDraftModel (its own head) on the non-K≡V artifact"),
)
MODES = {"mtp": "_mtp_rounds_batch (speculative/mtp.py) through BatchGenerator / SpeculativeGenerationBatch",
         "dflash": "_dflash_rounds_batch (speculative/dflash.py; B = 1: _dflash_rounds) through BatchGenerator / "
                   "SpeculativeGenerationBatch"}


def _rows_spec() -> tuple[tuple[str, ...], tuple[int, ...]]:
    from specparity.jobs.batched import ROW_BUDGETS, ROW_PROMPTS

    return ROW_PROMPTS, ROW_BUDGETS


def reproduce(pair: str | None = None, mode: str | None = None) -> str:
    args = (f" --mode {mode}" if mode else "") + (f" --pair {pair}" if pair else "")
    return f"tox exec -e {TOX_ENV} -- python -m specparity.grading.vlm_batched{args}"


# ------------------------------------------------------------------ verdicts (no mlx-vlm needed)


@dataclass
class RowVerdict:
    """One row of a batched run against the run it is compared with."""

    pair: str
    row: int
    prompt: str
    batch: int
    against: str  # "B=1" | "engine serial"
    verdict: str  # "identical" | "numerics" | "logic"
    detail: str = ""
    evidence: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"pair": self.pair, "row": self.row, "prompt": self.prompt, "B": self.batch, "against": self.against,
                "verdict": self.verdict, "detail": self.detail, "evidence": list(self.evidence)}


def _where(row: Any, pos: int) -> str:
    at = row.origin(pos)
    if at is None:
        return "the prefill's first token"
    st, i = at
    return f"batch step {st.step} (window position {i}; rows present: {', '.join(f'r{r}' for r in st.present)})"


def _weigh(batched: Any, alone: Any, pos: int, bound: float, reproduced: bool) -> tuple[str, list[str]]:
    """``numerics`` or ``logic`` for a flip at output token ``pos`` (module docstring)."""
    import numpy as np

    a, b = batched.origin(pos), alone.origin(pos)
    if a is None or b is None or a[0].logits is None or b[0].logits is None:
        return "logic", ["no verify rows at the flip to weigh (the prefill's token, or logits not captured)"]
    la, lb = a[0].logits[a[1]], b[0].logits[b[1]]
    delta = float(np.max(np.abs(la - lb)))
    ta, tb = batched.tokens[pos], alone.tokens[pos]
    picks = [int(np.argmax(la)) == ta, int(np.argmax(lb)) == tb]
    margins = [float(np.diff(np.sort(x)[-2:])[0]) for x in (la, lb)]
    ev = [f"the two verify rows differ by |Δ| {delta:.3g} (stated bound {bound:g})",
          f"each run's token is its own row's pick: {picks}; top-2 margins {margins[0]:.3g} / {margins[1]:.3g}",
          (f"both runs reproduce on a re-run: {reproduced}" if bound > 0 else
           "the backend is bit-exact (stated bound 0): no arithmetic explains a flip")]
    ok = bound > 0 and reproduced and delta <= 2 * bound and all(picks) and min(margins) <= 2 * delta
    return ("numerics" if ok else "logic"), ev


def stream_problem(pair: str, prompt: str, batch: int, row: Any, against: str) -> RowVerdict | None:
    """A row handed tokens its own walk did not emit for it (``RowRun.mismatch``): logic."""
    m = row.mismatch
    if m is None:
        return None
    return RowVerdict(pair, row.row, prompt, batch, against, "logic",
                      f"row r{row.row} ({prompt}) at B = {batch}: output token {m['pos']}, {_where(row, m['pos'])}: "
                      f"the consumer received {m['received']} but the loop's walk emitted {m['walk']} for this row")


def compare_rows(pair: str, prompt: str, batch: int, batched: Any, alone: Any, *, against: str = "B=1",
                 bound: float = 0.0, reproduced: bool = False) -> RowVerdict:
    """A captured row (``oracles.mlx_vlm_batched.RowRun``) against ``alone``: the first differing
    output token, named by row, prompt, batch step and the rows present; identical / numerics / logic."""
    for r, n in ((batched, batch), (alone, 1)):
        bad = stream_problem(pair, prompt, n, r, against)
        if bad is not None:
            return bad
    i = first_divergence(batched.tokens, alone.tokens)
    if i is None and batched.finish == alone.finish:
        return RowVerdict(pair, batched.row, prompt, batch, against, "identical",
                          f"{len(batched.tokens)} tokens, finish {batched.finish}")
    if i is None:
        return RowVerdict(pair, batched.row, prompt, batch, against, "logic",
                          f"row r{batched.row} ({prompt}) at B = {batch}: the same {len(batched.tokens)} tokens but "
                          f"finish {batched.finish!r} != {against} {alone.finish!r}")
    x = batched.tokens[i] if i < len(batched.tokens) else None
    y = alone.tokens[i] if i < len(alone.tokens) else None
    msg = (f"row r{batched.row} ({prompt}) at B = {batch}: output token {i}, {_where(batched, i)}: "
           f"batched {x} != {against} {y}")
    if x is None or y is None:
        return RowVerdict(pair, batched.row, prompt, batch, against, "logic", msg + " (one stream ends there)")
    verdict, ev = _weigh(batched, alone, i, bound, reproduced)
    return RowVerdict(pair, batched.row, prompt, batch, against, verdict, msg, tuple(ev))


def compare_tokens(pair: str, prompt: str, batch: int, row: Any, engine_ids: list[int]) -> RowVerdict:
    """A captured row's content tokens against the engine's serial ``output_ids`` (greedy, lossless)."""
    bad = stream_problem(pair, prompt, batch, row, "engine serial")
    if bad is not None:
        return bad
    i = first_divergence(row.tokens, engine_ids)
    if i is None:
        return RowVerdict(pair, row.row, prompt, batch, "engine serial", "identical", f"{len(row.tokens)} tokens")
    x = row.tokens[i] if i < len(row.tokens) else None
    y = engine_ids[i] if i < len(engine_ids) else None
    return RowVerdict(pair, row.row, prompt, batch, "engine serial", "logic",
                      f"row r{row.row} ({prompt}) at B = {batch}: output token {i}, {_where(row, i)}: "
                      f"mlx-vlm {x} != engine serial {y}")


def compare_rounds(pair: str, prompt: str, row: Any, engine_rounds: list[dict[str, Any]],
                   guarded: bool = False) -> RowVerdict:
    """At B = 1: the loop's rounds against the engine's, round for round: the window and the
    accepted count; the row's last round (cut by its budget or an EOS, where mlx-vlm's walk does
    not stop at the EOS) by its window and the content tokens kept. ``guarded``: the engine left
    speculation at its §2 ring-wrap guard (plain steps after its last round; mlx-vlm keeps
    speculating over its rotating-cache transaction): its rounds are compared as a prefix."""
    def bad(msg: str) -> RowVerdict:
        return RowVerdict(pair, row.row, prompt, 1, ROUNDS, "logic", f"row r{row.row} ({prompt}) at B = 1: {msg}")

    if len(row.steps) < len(engine_rounds) or (len(row.steps) > len(engine_rounds) and not guarded):
        return bad(f"{len(row.steps)} rounds != engine {len(engine_rounds)}")
    for n, (st, er) in enumerate(zip(row.steps, engine_rounds, strict=False)):
        kept, last = row.kept(n)
        last = last and not guarded
        mine = (st.window, kept if last else st.k)
        theirs = (list(er["window"]), list(er["emitted"]) if last else int(er["k_accept"]))
        if mine != theirs:
            what = "window, content tokens kept" if last else "window, k"
            return bad(f"round {n}: ({what}) mlx-vlm {mine} != engine {theirs}")
    tail = f" (of {len(row.steps)}: the engine's ring-wrap guard ends its speculation there)" if guarded else ""
    return RowVerdict(pair, row.row, prompt, 1, ROUNDS, "identical", f"{len(engine_rounds)} rounds{tail}")


def acceptance_problems(pair: str, batch: int, rows: list[Any], uniform: bool) -> tuple[list[str], dict[str, int]]:
    """(problems, counts): row-steps, those committed below the row's own walk (``clamped``), the
    drafts so discarded, and the row-steps whose own count the loop does not expose (``hidden``:
    the deferred uniform walk stops at the first rejection of ANY row)."""
    problems: list[str] = []
    by_step: dict[int, list[tuple[Any, Any]]] = {}
    n = clamped = lost = hidden = 0
    for r in rows:
        for st in r.steps:
            by_step.setdefault(st.step, []).append((r, st))
            n += 1
            hidden += st.k_own is None
            if st.k_own is not None and st.k > st.k_own:
                problems.append(f"{pair} B = {batch} row r{r.row}: batch step {st.step}: committed {st.k} drafts "
                                f"but its own walk accepted {st.k_own}")
            if st.k_own is not None and st.k < st.k_own:
                clamped += 1
                lost += st.k_own - st.k
            if not uniform and st.k_own is not None and st.k != st.k_own:
                problems.append(f"{pair} B = {batch} row r{r.row}: batch step {st.step}: committed {st.k} != its own "
                                f"walk's {st.k_own}, and the loop declares per-row acceptance")
    if uniform:
        for s, group in sorted(by_step.items()):
            ks = {st.k for _, st in group}
            if len(ks) > 1:
                problems.append(f"{pair} B = {batch}: batch step {s}: rows commit {sorted(ks)} drafts, not one count "
                                f"(the loop declares uniform acceptance)")
    return problems, {"row_steps": n, "clamped": clamped, "drafts_discarded": lost, "own_not_exposed": hidden}


# ------------------------------------------------------------------ running (mlx-vlm's environment)


def _target(pair: Pair, cache: dict[tuple[str, str], Any]) -> tuple[Any, Any]:
    """(mlx-vlm's model carrying the zoo target, the target's untied head for DFlash drafters)."""
    import zoo
    from oracles.mlx_vlm import load_target
    from oracles.mlx_vlm_batched import untied_head

    key = (pair.target, pair.hidden)
    if key not in cache:
        cache[key] = load_target(zoo.model_dir(pair.target), hidden=pair.hidden)
    if pair.mode != "dflash":
        return cache[key], None
    if (pair.target, "head") not in cache:
        cache[(pair.target, "head")] = untied_head(zoo.model_dir(pair.target))
    return cache[key], cache[(pair.target, "head")]


def _engine(pair: Pair, prompt: str, budget: int) -> dict[str, Any]:
    from specparity.cases.case import Case
    from specparity.runners import run_case
    from traces.io import Trace

    tr = Trace.from_records(run_case("engine", Case(pair.target, pair.engine_drafter, prompt, pair.gamma, budget,
                                                    source=pair.source)))
    plain = [r for r in tr.records() if r.get("type") == "plain"]
    return {"eos_ids": list(tr.header["eos_ids"]), "ids": list(tr.footer["output_ids"]), "rounds": tr.rounds,
            "guarded": any(r.get("reason") == "ring-wrap" for r in plain)}


def _bound() -> float:
    import mlx.core as mx

    return 0.0 if mx.default_device() == mx.cpu else _NUMERIC_BOUND_OFF_CPU


def grade_pair(pair: Pair, models: dict[tuple[str, str], Any] | None = None) -> dict[str, Any]:
    """Every row of ``pair`` at B = 1, 2, 4 (greedy) and B = 1, 4 (seeded): verdicts per check."""
    import zoo
    from oracles.mlx_vlm_batched import run_batch

    models = {} if models is None else models
    model, head = _target(pair, models)
    prompts, budgets = _rows_spec()
    ids = [list(zoo.prompt(p).token_ids) for p in prompts]
    engine = [_engine(pair, p, b) for p, b in zip(prompts, budgets, strict=True)]
    eos = engine[0]["eos_ids"]
    block = None if pair.mode == "dflash" else pair.gamma + 1
    bound = _bound()

    def batch(n: int, temperature: float = 0.0) -> Any:
        return run_batch(model, pair.drafter_dir(), ids[:n], list(budgets[:n]), eos_ids=eos, block_size=block,
                         temperature=temperature, seed=SEED, head=head)

    def one(i: int, temperature: float = 0.0) -> Any:  # row i alone, numbered as in the batch
        res = run_batch(model, pair.drafter_dir(), [ids[i]], [budgets[i]], eos_ids=eos, block_size=block,
                        temperature=temperature, seed=SEED, head=head)
        return replace(res.rows[0], row=i)

    alone = [one(i) for i in range(len(ids))]
    out: dict[str, Any] = {"pair": pair.name, "verdicts": {c: [] for c in CHECKS}, "acceptance": {}}
    runs = {1: None, 2: batch(2), 4: batch(4)}
    uniform = runs[4].uniform
    out["uniform"], out["loop_drafter"] = uniform, runs[4].drafter
    for n in (2, 4):
        res = runs[n]
        for r in res.rows:
            v = compare_rows(pair.name, prompts[r.row], n, r, alone[r.row], bound=bound)
            if v.verdict == "numerics":  # the evidence includes a re-run of both configurations
                again = batch(n).rows[r.row]
                v = compare_rows(pair.name, prompts[r.row], n, r, alone[r.row], bound=bound,
                                 reproduced=again.tokens == r.tokens and one(r.row).tokens == alone[r.row].tokens)
            out["verdicts"][f"B{n}"].append(v)
        probs, counts = acceptance_problems(pair.name, n, res.rows, uniform)
        out["verdicts"]["acceptance"] += probs
        out["acceptance"][f"B{n}"] = counts
    # serial identity: tokens at every B, rounds at B = 1 where the source matches ours
    for n, rows in ((1, alone), (2, runs[2].rows), (4, runs[4].rows)):
        for r in rows:
            out["verdicts"]["serial"].append(compare_tokens(pair.name, prompts[r.row], n, r, engine[r.row]["ids"]))
    if pair.rounds:
        for r in alone:
            e = engine[r.row]
            out["verdicts"]["serial"].append(compare_rounds(pair.name, prompts[r.row], r, e["rounds"], e["guarded"]))
    # seeded: sampled rows keyed per position, B = 4 vs each alone
    s4 = batch(4, SEEDED_T)
    for r in s4.rows:
        out["verdicts"]["seeded"].append(compare_rows(pair.name, prompts[r.row], 4, r, one(r.row, SEEDED_T),
                                                      bound=bound))
    return out


def _cell(check: str, mode: str, graded: list[dict[str, Any]]) -> tuple[CheckResult, str]:
    """One scoreboard cell of a loop from its pairs' verdicts, and its short summary."""
    if check == "acceptance":
        probs = [p for g in graded for p in g["verdicts"]["acceptance"]]
        if probs:
            pair = probs[0].split(" B = ")[0]
            return CheckResult(check, "fail", probs[0], case=f"{mode}:{probs[0].split(':')[0]}",
                               divergence={"pair": pair}, cases_run=len(graded)), ""
        parts = []
        for g in graded:
            a = g["acceptance"]["B4"]
            if a["own_not_exposed"] == a["row_steps"]:
                parts.append(f"{g['pair']}: own counts not exposed (its deferred walk is uniform: it stops at the "
                             f"first rejection of any row), {a['row_steps']} row-steps")
            else:
                parts.append(f"{g['pair']} {a['clamped']}/{a['row_steps']} row-steps, {a['drafts_discarded']} drafts")
        uni = all(g["uniform"] for g in graded)
        head = ("uniform, as the loop declares (requires_uniform_batch_acceptance, mlx-vlm #1962): every row of a "
                "step commits the earliest rejection, never more than its own walk; at B = 4 the clamp cut "
                if uni else "per row: each row commits its own walk's count; at B = 4 ")
        lost = sum(g["acceptance"]["B4"]["drafts_discarded"] for g in graded)
        res = CheckResult(check, "pass", head + "; ".join(parts), cases_run=len(graded))
        return res, (f"uniform, as declared: {lost} drafts cut at B = 4" if uni else "per row")
    vs: list[RowVerdict] = [v for g in graded for v in g["verdicts"][check]]
    bad = [v for v in vs if v.verdict == "logic"]
    num = [v for v in vs if v.verdict == "numerics"]
    what = {"B2": "rows at B = 2 ≡ the same row alone (B = 1)", "B4": "rows at B = 4 ≡ the same row alone (B = 1)",
            "seeded": f"sampled rows (T {SEEDED_T}, positioned sampler) at B = 4 ≡ alone",
            "serial": "rows (B = 1, 2, 4) ≡ the engine's serial run"}[check]
    if bad:
        v = bad[0]
        return CheckResult(check, "fail", f"logic: {v.detail}", case=f"{mode}:{v.pair}/{v.prompt}/B{v.batch}",
                           divergence={"pair": v.pair, "row": v.row, "prompt": v.prompt, "B": v.batch,
                                       "evidence": list(v.evidence)}, cases_run=len(vs)), ""
    detail = f"{len(vs)} {what}: identical" + (f" ({len(num)} numerics: {num[0].detail})" if num else "")
    summary = f"{len(vs)} rows" + (f", {len(num)} numerics" if num else "")
    if check == "serial":
        rounds = [v for v in vs if v.against == ROUNDS]
        if rounds:
            cut = sum("guard" in v.detail for v in rounds)
            detail = (f"{len(vs) - len(rounds)} rows (B = 1, 2, 4) emit the engine's serial tokens; {len(rounds)} rows "
                      f"at B = 1 also its rounds (window, accepted count)"
                      + (f", {cut} up to the engine's §2 ring-wrap guard" if cut else ""))
            summary = f"{len(vs) - len(rounds)} rows; {len(rounds)} round for round"
    return CheckResult(check, "pass", detail, cases_run=len(vs)), summary


def grade(modes: list[str], pair: str | None = None) -> dict[str, Any]:
    """The result document (``kind: "batched"``) for ``modes`` (every pair, or the one named)."""
    from importlib import metadata

    from traces.records import platform_info

    models: dict[tuple[str, str], Any] = {}
    doc: dict[str, Any] = {"engine": NAME, "kind": "batched", "package": "mlx-vlm", "tox_env": TOX_ENV,
                           "available": True, "reason": "ok", "checks": list(CHECKS), "modes": {}}
    doc["version"] = metadata.version("mlx-vlm")
    doc["deps"] = {d: metadata.version(d) for d in ("mlx-lm", "mlx-vlm")}
    doc["platform"] = platform_info()
    for mode in modes:
        pairs = [p for p in PAIRS if p.mode == mode and (pair is None or p.name == pair)]
        if not pairs:
            continue
        graded = []
        for p in pairs:
            print(f"[vlm-batched] {mode}: {p.name}", file=sys.stderr, flush=True)
            graded.append(grade_pair(p, models))
        cells, summaries = {}, {}
        for c in CHECKS:
            cells[c], summaries[c] = _cell(c, mode, graded)
            cells[c].hooks = [f"mlx_vlm.generate.ar.BatchGenerator(draft_kind={mode!r})", MODES[mode]]
        doc["modes"][mode] = {
            "note": f"{MODES[mode]}; pairs: " + "; ".join(f"{p.name} ({p.note})" for p in pairs),
            "targets": sorted({p.target for p in pairs}),
            "checks": {c: {**r.to_dict(), "summary": summaries[c],
                           "reproduce": reproduce((r.divergence or {}).get("pair")
                                                  or (pairs[0].name if len(pairs) == 1 else None), mode)}
                       for c, r in cells.items()},
            "pairs": [{"pair": g["pair"], "uniform": g["uniform"], "drafter": g["loop_drafter"],
                       "acceptance": g["acceptance"],
                       "rows": [v.to_dict() for c in CHECKS if c != "acceptance" for v in g["verdicts"][c]]}
                      for g in graded],
        }
    return doc


PROG = "python -m specparity.grading.vlm_batched"


def main(argv: list[str] | None = None) -> int:
    import contextlib

    from specparity.cli.args import UsageError, writable_dir
    from specparity.cli.outdir import add_outputs, refusal
    from specparity.grading.engines import engine_output

    ap = argparse.ArgumentParser(prog=PROG,
                                 description="grade mlx-vlm's batched MTP/DFlash loops (B-invariance) and write "
                                             "their scoreboard row")
    ap.add_argument("--out", type=writable_dir, default=DEFAULT_OUT,
                    help="folder of the scoreboard's result documents")
    ap.add_argument("--mode", choices=sorted(MODES), action="append", help="a loop (repeatable; default: both)")
    ap.add_argument("--pair", choices=[p.name for p in PAIRS], help="one pair only (a reproduction)")
    args = ap.parse_args(argv)
    try:
        with contextlib.ExitStack() as stack:
            claim = None
            if args.pair is None:  # a reproduction writes nothing
                claim = stack.enter_context(add_outputs(args.out, PROG, recognise=engine_output))
                for name in (f"{NAME}.json", "scoreboard.md", "scoreboard.html"):
                    claim.check(args.out / name)  # refused before anything runs if not ours
            return _grade_main(args, claim)
    except UsageError as exc:
        return refusal(PROG, exc)


def _grade_main(args: argparse.Namespace, claim: Any) -> int:
    from specparity.runners.registry import get

    ok, why = get(NAME).availability()
    if not ok:
        print(f"vlm_batched: {why}", file=sys.stderr)
        return 2
    doc = grade(args.mode or list(MODES), args.pair)
    if not doc["modes"]:
        print(f"vlm_batched: no pair {args.pair!r} in the modes asked for", file=sys.stderr)
        return 2
    fails = 0
    for mode, m in doc["modes"].items():
        for c in CHECKS:
            r = m["checks"][c]
            fails += r["status"] == "fail"
            print(f"{mode:7s} {c:10s} {r['status']:5s} {r['detail']}")
    if claim is not None:
        from reports.scoreboard import write_scoreboard
        from traces.io import atomic_write_text

        atomic_write_text(claim.track(args.out / f"{NAME}.json"), json.dumps(doc, indent=1, sort_keys=True) + "\n")
        for p in write_scoreboard(args.out, claim.track):
            print(p)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
