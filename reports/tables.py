"""pandas tables from the traces of a ``specparity run`` (``traces/INTERPRETING.md``).

- acceptance by draft position: ``accepted_by_pos[i] / drafted_by_pos[i]``
  summed over a (pair, γ) cell's cases (footer ``speculation``);
- acceptance-length histogram: rounds per ``k_accept`` (footer
  ``acceptance_lengths``);
- τ = tokens per target forward (``generation_tokens / target_calls``) per
  (pair, γ). No tok/s or speedup here: a trace's wall time is one unpaired
  measurement (INTERPRETING.md: recorded, never compared) and a ratio of two
  such timings is noise (γ 1 at τ 1.14 once showed a 2× "speedup"). Timings
  come from ``specparity bench`` / ``ab``, which interleave and pair them.

:func:`load_run` reads any folder of traces — a ``specparity run`` output
(``traces/<runner>/*.jsonl``) or any mix of engine, reference and plain traces
— validating every file first (``traces.validate``: a ``schema_version`` 99,
a duplicated round index or a negative id is refused as ``FILE:LINE``), and
keeps one row per case (colliding case ids get the file name appended).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from traces.outdir import LOCK_NAME, RUN_MARKER  # noqa: F401  (the run marker and lock: traces.outdir)

CELL = ["target", "drafter", "gamma"]


@dataclass
class RunData:
    run_dir: Path
    traces: dict[tuple[str, str], Any]  # (runner, case_id) -> traces.io.Trace
    comparisons: list[dict[str, Any]]
    results: list[dict[str, Any]]  # ab.json / bench.json found under run_dir
    has_comparisons: bool = False
    state: tuple[str, str] = ("unknown", "")


def _lock_holder(run_dir: Path) -> dict[str, Any] | None:
    """The lock file's holder info (pid, command, run id) while the lock is held, else None."""
    import fcntl
    import os

    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            info = json.loads(os.read(fd, 1 << 16) or b"{}")
        except ValueError:
            info = {}
        return info if isinstance(info, dict) else {}
    finally:
        os.close(fd)
    return None


def run_state(run_dir: Path) -> tuple[str, str]:
    """``(state, detail)`` of the run that wrote ``run_dir`` from its marker.

    ``complete``; ``failed`` (it raised or was interrupted); ``killed`` (marked
    running, and the directory's lock is not held by that run: the process
    died); ``writing`` (another live process is still writing it); ``self``
    (this process is writing it: a report built from inside the run);
    ``unknown`` (no marker, or a marker that only lists files other commands
    added: a folder of traces, or a run from before markers).
    """
    import os

    from traces.io import regular_file

    path = Path(run_dir) / RUN_MARKER
    if not path.exists():
        return "unknown", ""
    try:
        m = json.loads(regular_file(path, max_bytes=1 << 20).read_text())  # a FIFO: refused
        state = str(m["state"])
    except (OSError, ValueError, KeyError, TypeError):
        return "killed", f"{path}: unreadable run marker"
    who = f"`{m.get('command')}` (run {m.get('run_id')}, pid {m.get('pid')}, started {m.get('started')})"
    if state == "complete":
        return "complete", who
    if state == "failed":
        return "failed", f"the run {who} failed: {m.get('error', '?')}"
    if state != "running":
        return "unknown", ""
    holder = _lock_holder(run_dir)
    if holder is not None and holder.get("run_id", m.get("run_id")) == m.get("run_id") \
            and holder.get("pid", m.get("pid")) == m.get("pid"):
        if m.get("pid") == os.getpid():
            return "self", who
        return "writing", f"the run {who} is still writing this directory"
    return "killed", f"the run {who} stopped before finishing (killed or crashed)"


def _load_json(path: Path, what: str) -> Any:
    from traces.io import line_limit, regular_file

    try:
        # regular files of bounded size only: a FIFO named comparisons.json would block read_text
        return json.loads(regular_file(path, max_bytes=64 * line_limit())
                          .read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: not a valid {what} ({exc.__class__.__name__}: "
                         f"{str(exc)[:120]})") from None


def _check_comparisons(path: Path, data: Any) -> list[dict[str, Any]]:
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of comparisons, got {type(data).__name__}")
    need = {"kind": str, "case_id": str, "verdict": str, "fails": bool}
    for i, c in enumerate(data):
        if not isinstance(c, dict):
            raise ValueError(f"{path}: comparison {i} is not a JSON object")
        for k, t in need.items():
            if not isinstance(c.get(k), t):
                raise ValueError(f"{path}: comparison {i}: {k!r} missing or not a {t.__name__}")
    return data


def load_comparisons(path: Path, *, strict: bool = True) -> list[dict[str, Any]]:
    """A run's ``comparisons.json``, checked (ValueError naming the file otherwise).

    ``strict=False`` only requires a list of objects (readers of one field).
    """
    data = _load_json(path, "comparisons.json")
    if strict:
        return _check_comparisons(path, data)
    if not isinstance(data, list) or not all(isinstance(c, dict) for c in data):
        raise ValueError(f"{path}: expected a JSON list of comparison objects")
    return data


_RESULT_KEYS = {"ab": ("target", "drafter_a", "drafter_b", "gamma", "n_prompts", "verdict"),
                "bench": ("target", "drafter", "gamma", "n_prompts", "repeats")}


def _check_result(path: Path, data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    kind = data.get("kind", "bench" if path.name == "bench.json" else "ab")
    missing = [k for k in _RESULT_KEYS.get(kind, ()) if k not in data]
    if kind not in _RESULT_KEYS or missing:
        raise ValueError(f"{path}: not an {path.stem} result (kind {kind!r}, missing {missing})")
    ratios = data.get("ratios", {})
    if not isinstance(ratios, dict) or not all(
            isinstance(iv, dict) and {"n", "median", "low", "high", "confidence"} <= iv.keys()
            for iv in ratios.values()):
        raise ValueError(f"{path}: malformed 'ratios'")
    return data


def load_run(run_dir: Path, *, validate: bool = True) -> RunData:
    """Read a run (or any folder of traces), its ``comparisons.json`` and any A/B/bench JSON.

    Traces: ``RUN_DIR/traces/**/*.jsonl`` when ``traces/`` exists, else every
    ``*.jsonl`` under ``RUN_DIR``; hidden files (a killed writer's temp files)
    are skipped. Every trace is validated first (``validate``).

    Raises:
        FileNotFoundError: no such directory / no traces.
        ValueError: an invalid trace or JSON file, naming it (``FILE:LINE: ...``).
    """
    from traces.io import read_trace
    from traces.validate import validate_file

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: " + ("not a directory" if run_dir.exists()
                                                  else "no such directory"))
    tdir = run_dir / "traces"
    root = tdir if tdir.is_dir() else run_dir
    paths = sorted(p for p in root.rglob("*.jsonl")
                   if not any(part.startswith(".") for part in p.relative_to(root).parts)
                   and p.is_file())
    traces: dict[tuple[str, str], Any] = {}
    for path in paths:
        if validate:
            errs = validate_file(path)
            if errs:
                more = f" (+{len(errs) - 1} more; `specparity trace validate {path}`)" if len(errs) > 1 else ""
                raise ValueError(f"invalid trace {errs[0].format()}{more}")
        tr = read_trace(path)
        runner = (path.parent.name if root == tdir and path.parent != tdir
                  else str((tr.header.get("runner") or {}).get("name", "?")))
        case_id = str(tr.header["case_id"])
        if (runner, case_id) in traces:
            case_id = f"{case_id} [{path.relative_to(root).as_posix()}]"
        traces[(runner, case_id)] = tr
    if not traces:
        raise FileNotFoundError(f"{root}: no traces found (no *.jsonl files)")
    cpath = run_dir / "comparisons.json"
    has = cpath.is_file()
    comparisons = _check_comparisons(cpath, _load_json(cpath, "comparisons.json")) if has else []
    results = []
    found = [*run_dir.rglob("ab.json"), *run_dir.rglob("bench.json")]
    for path in sorted(p for p in found
                       if not any(part.startswith(".") for part in p.relative_to(run_dir).parts)):
        data = _check_result(path, _load_json(path, path.name))
        data["_path"] = str(path.relative_to(run_dir))
        results.append(data)
    return RunData(run_dir, traces, comparisons, results, has, run_state(run_dir))


def incomplete_reasons(data: RunData) -> list[str]:
    """Why ``data`` is not a finished run's full set of comparisons (empty: it is)."""
    reasons = []
    state, detail = data.state
    if state in ("failed", "killed", "writing"):
        reasons.append(detail)
    if not data.has_comparisons:
        reasons.append("no comparisons.json: nothing was compared (a run stopped before comparing, "
                       "or a folder of traces; `specparity run` or `specparity grade` compares)")
        return reasons
    cases = {cid for (r, cid), tr in data.traces.items()
             if r == "engine" and tr.header.get("mode") == "spec"}
    compared = {c["case_id"] for c in data.comparisons}
    missing = sorted(cases - compared)
    if missing:
        reasons.append(f"{len(missing)} of {len(cases)} engine speculative cases have no comparison "
                       f"(first: {missing[0]})")
    if data.comparisons and not cases and not any(r == "engine" for r, _ in data.traces):
        reasons.append("comparisons.json names cases but no engine trace is present")
    return reasons


def _model_name(ident: Any) -> str | None:
    if isinstance(ident, dict) and ident.get("path"):
        return Path(str(ident["path"])).name
    return None


def case_cell(case_id: str, header: dict[str, Any]) -> tuple[str, str]:
    """``(target, drafter)`` of a trace: from a zoo/suite case id, else from the header's models."""
    parts = case_id.split(" [")[0].split("/")
    spec = header.get("mode") == "spec"
    if len(parts) >= 4:
        return parts[0], parts[1] if spec else "plain"
    target = _model_name(header.get("target")) or parts[0]
    if not spec:
        return target, "plain"
    return target, _model_name(header.get("drafter")) or str(header.get("source") or "?")


def cases_frame(traces: dict[tuple[str, str], Any]) -> pd.DataFrame:
    """One row per trace: runner, cell, prompt, tokens, forwards, counters, wall."""
    rows = []
    for (runner, case_id), tr in traces.items():
        h, f = tr.header, tr.footer
        spec = f.get("speculation") or {}
        target, drafter = case_cell(case_id, h)
        rows.append({
            "runner": runner, "case_id": case_id, "mode": h["mode"], "target": target,
            "drafter": drafter,
            "gamma": int(h["params"].get("gamma") or 0), "prompt_id": h["prompt"]["id"],
            "tokens": int(f["usage"]["generation_tokens"]),
            "target_calls": int(spec.get("target_calls") or len(tr.plains)),
            "drafted": int(spec.get("drafted", 0)), "accepted": int(spec.get("accepted", 0)),
            "wall_s": float(f.get("wall_s") or 0.0),
        })
    return pd.DataFrame(rows)


def _spec_cells(traces: dict[tuple[str, str], Any], runner: str) -> Any:
    """``(target, drafter, gamma, speculation counters)`` of each speculative trace of ``runner``."""
    for (r, case_id), tr in traces.items():
        spec = tr.footer.get("speculation")
        if r != runner or tr.header["mode"] != "spec" or not spec:
            continue
        t, d = case_cell(case_id, tr.header)
        yield t, d, int(tr.header["params"].get("gamma") or 0), spec


def acceptance_by_position(traces: dict[tuple[str, str], Any], runner: str = "engine") -> pd.DataFrame:
    rows = []
    for t, d, g, spec in _spec_cells(traces, runner):
        drafted, accepted = spec["drafted_by_pos"], spec["accepted_by_pos"]
        for i, n in enumerate(drafted):
            rows.append({"target": t, "drafter": d, "gamma": g, "position": i + 1, "drafted": n,
                         "accepted": accepted[i] if i < len(accepted) else 0})
    if not rows:
        return pd.DataFrame(columns=[*CELL, "position", "drafted", "accepted", "acceptance"])
    df = pd.DataFrame(rows).groupby([*CELL, "position"], as_index=False).sum()
    df["acceptance"] = (df["accepted"] / df["drafted"]).round(3)
    return df


def acceptance_lengths(traces: dict[tuple[str, str], Any], runner: str = "engine") -> pd.DataFrame:
    rows = []
    for t, d, g, spec in _spec_cells(traces, runner):
        for k in spec["acceptance_lengths"]:
            rows.append({"target": t, "drafter": d, "gamma": g, "k_accept": int(k)})
    if not rows:
        return pd.DataFrame(columns=[*CELL, "k_accept", "rounds", "share"])
    df = pd.DataFrame(rows).groupby([*CELL, "k_accept"]).size().reset_index(name="rounds")
    df["share"] = (df["rounds"] / df.groupby(CELL)["rounds"].transform("sum")).round(3)
    return df


def tau_table(traces: dict[tuple[str, str], Any], runner: str = "engine") -> pd.DataFrame:
    """Per (pair, γ): cases, acceptance and τ (no timings: see the module doc)."""
    cf = cases_frame(traces)
    cols = [*CELL, "cases", "drafted", "accepted", "acceptance", "tau"]
    if cf.empty:
        return pd.DataFrame(columns=cols)
    cf = cf[cf["runner"] == runner]
    spec = cf[cf["mode"] == "spec"]
    if spec.empty:
        return pd.DataFrame(columns=cols)
    agg = spec.groupby(CELL, as_index=False).agg(
        cases=("case_id", "count"), drafted=("drafted", "sum"), accepted=("accepted", "sum"),
        tokens=("tokens", "sum"), target_calls=("target_calls", "sum"))
    agg["acceptance"] = (agg["accepted"] / agg["drafted"].where(agg["drafted"] > 0)).round(3)
    agg["tau"] = (agg["tokens"] / agg["target_calls"].where(agg["target_calls"] > 0)).round(3)
    return agg[cols]


def verdict_table(comparisons: list[dict[str, Any]]) -> pd.DataFrame:
    if not comparisons:
        return pd.DataFrame(columns=["comparison", "verdict", "cases", "failing"])
    df = pd.DataFrame(comparisons)
    return (df.groupby(["kind", "verdict"], as_index=False)
            .agg(cases=("case_id", "count"), failing=("fails", "sum"))
            .rename(columns={"kind": "comparison"}))


def ratio_table(results: list[dict[str, Any]]) -> pd.DataFrame:
    """Every paired ratio interval found in A/B and bench results."""
    rows = []
    for res in results:
        for name, iv in res.get("ratios", {}).items():
            rows.append({"source": res["_path"], "ratio": name, "n": iv["n"],
                         "median": round(iv["median"], 3), "low": round(iv["low"], 3),
                         "high": round(iv["high"], 3),
                         "confidence": iv["confidence"]})
    return pd.DataFrame(rows, columns=["source", "ratio", "n", "median", "low", "high", "confidence"])
