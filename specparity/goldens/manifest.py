"""Golden traces: which exist, the manifest, staleness and comparison helpers.

A golden is one committed trace per (runner, zoo case):
``traces/golden/<runner>/<case file_stem>.jsonl``. ``traces/golden/manifest.json``
records, per golden, the **inputs** that determine it and the sha256 of the
golden file's bytes:

- ``schema_version`` (``traces.io.SCHEMA_VERSION``);
- ``runner``: name, package, package version and commit (from the package's
  PEP 610 ``direct_url.json`` when it was installed from VCS, else null);
- ``code_sha256``: sha256 over the runner's own code. For ``engine`` that is
  every ``engine/**/*.py`` except ``zoo/**`` (the zoo's outputs —
  weights, config, tokenizer, prompt tokens — are recorded as digests of their
  own, so a zoo refactor that builds the same models does not stale anything);
  for an oracle, its ``oracles/<runner>.py`` module and ``oracles/__init__.py``;
- ``harness_sha256``: the code shared by every runner that shapes a trace
  (``specparity/runners/``, ``traces/records.py``, ``traces/digest.py``);
- ``mlx``: the mlx version (the kernels decide the numerics);
- ``target`` / ``drafter``: zoo name, weights and config digests;
- ``tokenizer_sha256``; ``prompt``: id and sha256 of its token ids;
- ``params``: the header ``params`` block of the case.

Goldens are **normalised** so that they are byte-reproducible: the timing
fields (``round.time_s``, ``plain.time_s``, ``footer.wall_s``) are null and
the model paths in the header are ``zoo/<model dir name>`` instead of the
machine's cache path. Nothing the diff compares (nor ``margins``) is touched.

:func:`check_goldens` recomputes the current inputs and reports each golden
that is ``missing`` (the registry expects it), ``corrupt`` (bytes differ from
the recorded sha256, or unreadable), ``stale`` (an input changed, with each
change spelled out, e.g. ``mlx-lm 0.32.2 → 0.33.0``) or ``unregistered``
(a manifest entry no runner/case of the registry produces). A stale golden is
never compared: a comparison against it would report a divergence that is
really an input change. ``specparity regen --stale-only`` refreshes them.

Which goldens exist is the runner registry's: each runner declares its golden
sets in its own module (``Runner.goldens``, ``specparity.runners.registry.GoldenSet``:
which package, which code, which cases; docs/runners.md), and
:func:`specparity.runners.registry.golden_sets` lists them.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from specparity.runners.registry import golden_sets, package_version, supports
from traces.io import SCHEMA_VERSION, Record, Trace, read_trace

__all__ = [
    "GOLDEN_DIR",
    "GoldenComparison",
    "GoldenProblem",
    "GoldenLockError",
    "InputsContext",
    "assert_lock_held",
    "check_goldens",
    "compare_to_goldens",
    "file_sha256",
    "golden_cases",
    "golden_key",
    "golden_path",
    "input_changes",
    "load_manifest",
    "lock_held",
    "normalize_records",
    "package_commit",
    "save_manifest",
]

# Golden traces are data of the trace format package; this job module reads and writes them.
GOLDEN_DIR = Path(__file__).resolve().parents[2] / "traces" / "golden"
MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
HARNESS_MODULES = ("specparity.runners", "traces.records", "traces.digest")
NORMALIZATION = (
    "timing fields (round.time_s, plain.time_s, footer.wall_s) set to null; "
    "header target/drafter paths replaced by zoo/<model dir name>"
)


# ------------------------------------------------------------- which goldens exist


def golden_key(runner: str, case: Any) -> str:
    return f"{runner}/{case.file_stem}"


def golden_path(golden_dir: Path, key: str) -> Path:
    return Path(golden_dir) / f"{key}.jsonl"


def golden_cases(runners: Iterable[str] | None = None) -> dict[str, tuple[str, Any]]:
    """``{key: (runner, case)}`` for every golden the registry expects."""
    out: dict[str, tuple[str, Any]] = {}
    for name in runners if runners is not None else golden_sets():
        info = golden_sets()[name]
        for case in info.cases():
            # a golden is never a plain decode recorded under a speculative label
            if info.supports(case) and (info.produce is not None or supports(name, case)):
                out[golden_key(name, case)] = (name, case)
    return out


# ------------------------------------------------------------------------ inputs


def package_commit(dist: str) -> str | None:
    """The VCS commit ``dist`` was installed from (PEP 610), or None."""
    try:
        text = metadata.distribution(dist).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    try:
        return json.loads(text).get("vcs_info", {}).get("commit_id")
    except (ValueError, AttributeError):
        return None


def _module_files(name: str, exclude: tuple[str, ...] = ()) -> dict[str, Path]:
    if name.endswith(".__init__"):  # a package's __init__.py alone
        spec = find_spec(name[: -len(".__init__")])
        if spec is None or spec.origin is None:
            return {}
        return {name.replace(".", "/") + ".py": Path(spec.origin)}
    spec = find_spec(name)
    if spec is None or spec.origin is None:
        return {}
    origin = Path(spec.origin)
    if spec.submodule_search_locations is None or origin.name != "__init__.py":
        return {name.replace(".", "/") + ".py": origin}
    root = origin.parent
    skip = [root / Path(*e.split(".")[1:]) for e in exclude if e.startswith(name + ".")]
    files: dict[str, Path] = {}
    for p in sorted(root.rglob("*.py")):
        if any(s == p.parent or s in p.parents for s in skip):
            continue
        files[f"{name.replace('.', '/')}/{p.relative_to(root).as_posix()}"] = p
    return files


def code_digest(modules: Iterable[str], exclude: tuple[str, ...] = ()) -> str:
    """sha256 over the sorted (relative path, bytes) of the modules' sources."""
    files: dict[str, Path] = {}
    for m in modules:
        files.update(_module_files(m, exclude))
    h = hashlib.sha256()
    for rel in sorted(files):
        data = files[rel].read_bytes()
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def file_sha256(path: Path | str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@cache
def _head_identity(name: str) -> dict[str, Any]:
    from specparity.runners import model_identity
    from zoo.heads import head_dir

    ident = model_identity(head_dir(name))
    return {"name": name, "weights_sha256": ident["weights_sha256"], "config_sha256": ident["config_sha256"]}


@cache
def _model_identity(name: str) -> dict[str, Any]:
    import zoo
    from zoo.native_mtp import TARGETS as NATIVE_TARGETS

    if name in NATIVE_TARGETS:  # a native-MTP checkpoint (zoo/native_mtp.py): its trunk dir
        from zoo.native_mtp import target_paths

        d = target_paths(name)[0]
    else:
        d = zoo.model_dir(name)
    return {"name": name, "weights_sha256": zoo.weights_digest(d), "config_sha256": zoo.config_digest(d)}


@cache
def _native_checkpoint_identity(name: str) -> dict[str, Any]:
    import zoo
    from zoo.native_mtp import target_paths

    ckpt = target_paths(name)[1]
    return {"name": f"{name} (native MTP checkpoint)", "weights_sha256": zoo.weights_digest(ckpt),
            "config_sha256": zoo.config_digest(ckpt)}


class InputsContext:
    """Computes the current inputs of goldens; per-runner digests are computed once."""

    def __init__(self) -> None:
        self._code: dict[str, str] = {}
        self._harness: str | None = None

    def runner_code(self, runner: str) -> str:
        if runner not in self._code:
            r = golden_sets()[runner]
            self._code[runner] = code_digest(r.code_modules, r.code_exclude)
        return self._code[runner]

    def harness(self) -> str:
        if self._harness is None:
            self._harness = code_digest(HARNESS_MODULES)
        return self._harness

    def inputs(self, runner: str, case: Any) -> dict[str, Any]:
        import zoo
        from specparity.runners import case_params

        info = golden_sets()[runner]
        if case.drafter is not None and case.source in ("mtp", "assistant"):
            drafter = _head_identity(case.drafter)  # a zoo head (draft goldens)
        elif case.drafter is not None and case.source == "native-mtp":
            drafter = _native_checkpoint_identity(case.target)  # the heads inside the checkpoint
        elif case.drafter is None or case.source != "two-model":
            drafter = None
        else:
            drafter = _model_identity(zoo.model_name(case.target, case.drafter))
        ids = [int(t) for t in zoo.prompt(case.prompt_id).token_ids]
        return {
            "schema_version": SCHEMA_VERSION,
            "case_id": case.case_id,
            "runner": {
                "name": runner,
                "package": info.package,
                **({"version": package_version(info.package), "commit": package_commit(info.package)}
                   if info.identity is None else info.identity()),
            },
            "code_sha256": self.runner_code(runner),
            "harness_sha256": self.harness(),
            "mlx": package_version("mlx"),
            "target": _model_identity(case.target),
            "drafter": drafter,
            "tokenizer_sha256": zoo.tokenizer_digest(),
            "prompt": {
                "id": case.prompt_id,
                "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
            },
            "params": case_params(case),
        }


def _short(v: Any) -> str:
    if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
        return v[:12] + "…"
    return str(v)


def input_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human reasons why ``old`` inputs differ from ``new`` (empty if equal)."""
    reasons: list[str] = []
    runner = new.get("runner") or old.get("runner") or {}
    pkg = runner.get("package", "?")
    o_run, n_run = old.get("runner") or {}, new.get("runner") or {}
    if o_run.get("version") != n_run.get("version"):
        reasons.append(f"{pkg} {o_run.get('version')} → {n_run.get('version')}")
    if o_run.get("commit") != n_run.get("commit"):
        reasons.append(f"{pkg} commit {_short(o_run.get('commit'))} → {_short(n_run.get('commit'))}")
    for k in sorted((set(o_run) | set(n_run)) - {"version", "commit"}):
        if o_run.get(k) != n_run.get(k):
            reasons.append(f"runner.{k} {o_run.get(k)} → {n_run.get(k)}")
    name = runner.get("name", "?")
    labels = {
        "schema_version": "schema_version",
        "case_id": "case_id",
        "code_sha256": f"{name} code digest changed",
        "harness_sha256": "harness code digest changed",
        "mlx": "mlx",
        "tokenizer_sha256": "tokenizer digest changed",
    }
    for key in ("schema_version", "case_id", "mlx"):
        if old.get(key) != new.get(key):
            reasons.append(f"{labels[key]} {old.get(key)} → {new.get(key)}")
    for key in ("code_sha256", "harness_sha256", "tokenizer_sha256"):
        if old.get(key) != new.get(key):
            reasons.append(f"{labels[key]} ({_short(old.get(key))} → {_short(new.get(key))})")
    for role in ("target", "drafter"):
        o, n = old.get(role), new.get(role)
        if o == n:
            continue
        if o is None or n is None or o.get("name") != n.get("name"):
            reasons.append(f"{role} {o and o.get('name')} → {n and n.get('name')}")
            continue
        for k, what in (("weights_sha256", "weights"), ("config_sha256", "config")):
            if o.get(k) != n.get(k):
                reasons.append(
                    f"{role} {n['name']} {what} changed ({_short(o.get(k))} → {_short(n.get(k))})"
                )
    if old.get("prompt") != new.get("prompt"):
        reasons.append(f"prompt {(new.get('prompt') or {}).get('id')} token ids changed")
    o_p, n_p = old.get("params") or {}, new.get("params") or {}
    for k in sorted(set(o_p) | set(n_p)):
        if o_p.get(k) != n_p.get(k):
            reasons.append(f"params.{k} {o_p.get(k)} → {n_p.get(k)}")
    known = set(labels) | {"runner", "target", "drafter", "prompt", "params"}
    for k in sorted((set(old) | set(new)) - known):
        if old.get(k) != new.get(k):
            reasons.append(f"{k} {_short(old.get(k))} → {_short(new.get(k))}")
    return reasons


# ---------------------------------------------------------------------- manifest


def load_manifest(golden_dir: Path | str = GOLDEN_DIR) -> dict[str, Any]:
    """The manifest (an empty one when the file does not exist)."""
    p = Path(golden_dir) / MANIFEST_NAME
    if not p.exists():
        return {"manifest_version": MANIFEST_VERSION, "normalization": NORMALIZATION, "goldens": {}}
    return json.loads(p.read_text(encoding="utf-8"))


def save_manifest(manifest: dict[str, Any], golden_dir: Path | str = GOLDEN_DIR) -> None:
    """Write the manifest atomically (temp file, fsync, rename), under the directory's lock.

    Inside ``regen`` (which holds the lock for its whole read-modify-write) the
    lock is this process's already; a standalone call takes it for this one
    write, so a manifest is never written while another process holds it
    (``specparity.cli.outdir.Busy``).
    """
    from specparity.cli.outdir import DirLock

    d = Path(golden_dir)
    d.mkdir(parents=True, exist_ok=True)
    manifest = {**manifest, "manifest_version": MANIFEST_VERSION, "normalization": NORMALIZATION}
    manifest["goldens"] = dict(sorted(manifest.get("goldens", {}).items()))
    text = json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    if lock_held(d):
        atomic_write_text(d / MANIFEST_NAME, text)
        return
    with DirLock(d, "specparity save_manifest", flag="--golden-dir", what="golden directory"):
        assert_lock_held(d, "the manifest")
        atomic_write_text(d / MANIFEST_NAME, text)


class GoldenLockError(RuntimeError):
    """A write into a golden directory by a process that does not hold its lock (a bug)."""


def lock_held(golden_dir: Path | str) -> bool:
    """Whether THIS process holds ``golden_dir``'s lock (``specparity.cli.outdir.DirLock``).

    The kernel's view, not a flag: the lock file's ``flock`` is taken (a probe
    on a new descriptor is refused, even in the holder's own process) and the
    pid the holder wrote into it is ours.
    """
    import fcntl
    import os

    from specparity.cli.outdir import LOCK_NAME

    try:
        fd = os.open(Path(golden_dir) / LOCK_NAME, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # taken: by us?
        else:
            return False  # nobody holds it (closing the probe releases it)
        try:
            info = json.loads(os.read(fd, 1 << 16) or b"{}")
        except ValueError:
            return False
        return isinstance(info, dict) and info.get("pid") == os.getpid()
    finally:
        os.close(fd)


def assert_lock_held(golden_dir: Path | str, what: str) -> None:
    """Raise :class:`GoldenLockError` unless this process holds ``golden_dir``'s lock."""
    if not lock_held(golden_dir):
        raise GoldenLockError(f"{what} in {golden_dir} would be written without holding the "
                              "directory's lock (.specparity.lock): every golden, manifest and "
                              "journal write happens inside specparity.goldens.regen.regen's lock")


def atomic_write_text(path: Path, text: str) -> None:
    """``traces.io.atomic_write_text``: temp file, fsync, rename, mode 0666 & ~umask (not 0600)."""
    from traces.io import atomic_write_text as write

    write(path, text)


def manifest_entry(key: str, inputs: dict[str, Any], path: Path) -> dict[str, Any]:
    return {"file": f"{key}.jsonl", "sha256": file_sha256(path), "inputs": inputs}


# ------------------------------------------------------------------ normalising


def normalize_records(records: Iterable[Record]) -> list[Record]:
    """Records as a golden stores them: timing fields null, zoo-relative paths."""
    out = [copy.deepcopy(r) for r in records]
    import zoo
    from zoo.train import TRAINED_ROOT

    # Built zoo models live under the cache root; the committed trained pair inside
    # the zoo package: both are recorded as zoo/<model dir>, wherever the checkout is.
    roots = {zoo.cache_root().resolve(), TRAINED_ROOT.resolve()}
    for r in out:
        t = r.get("type")
        if t in ("round", "plain") and "time_s" in r:
            r["time_s"] = None
        elif t == "footer" and "wall_s" in r:
            r["wall_s"] = None
        elif t == "header":
            for role in ("target", "drafter"):
                ident = r.get(role)
                if isinstance(ident, dict) and isinstance(ident.get("path"), str):
                    p = Path(ident["path"])
                    if p.resolve().parent in roots:
                        ident["path"] = f"zoo/{p.name}"
    return out


# -------------------------------------------------------------------- staleness


@dataclass(frozen=True)
class GoldenProblem:
    """Why a golden cannot be trusted right now."""

    key: str
    kind: str  # "missing" | "corrupt" | "stale" | "unregistered"
    reasons: tuple[str, ...] = ()

    def format(self) -> str:
        why = "; ".join(self.reasons) if self.reasons else self.kind
        return f"{self.key}: {self.kind}: {why}"


def check_goldens(
    golden_dir: Path | str = GOLDEN_DIR,
    *,
    runners: Iterable[str] | None = None,
    keys: Iterable[str] | None = None,
    ctx: InputsContext | None = None,
) -> list[GoldenProblem]:
    """Every golden (of the registry, or of ``keys``) that is missing, corrupt or stale.

    A golden whose runner package is not installed here (its version is None)
    cannot be checked for version changes; only its other inputs are compared.
    """
    golden_dir = Path(golden_dir)
    ctx = ctx or InputsContext()
    manifest = load_manifest(golden_dir)
    entries: dict[str, Any] = manifest.get("goldens", {})
    expected = golden_cases(runners)
    if keys is not None:
        wanted = set(keys)
        expected = {k: v for k, v in expected.items() if k in wanted}
    problems: list[GoldenProblem] = []
    for key, (runner, case) in expected.items():
        entry = entries.get(key)
        path = golden_path(golden_dir, key)
        if entry is None or not path.exists():
            why = "no manifest entry" if entry is None else f"{path.name} does not exist"
            problems.append(GoldenProblem(key, "missing", (why,)))
            continue
        try:
            got = file_sha256(path)
        except OSError as exc:
            problems.append(GoldenProblem(key, "corrupt", (f"unreadable: {exc}",)))
            continue
        if got != entry.get("sha256"):
            problems.append(GoldenProblem(key, "corrupt", (
                f"file sha256 {_short(got)} does not match the manifest's {_short(entry.get('sha256'))}",)))
            continue
        try:
            current = ctx.inputs(runner, case)
        except Exception as exc:  # e.g. a zoo model that no longer builds
            problems.append(GoldenProblem(key, "stale", (
                f"current inputs cannot be computed: {type(exc).__name__}: {exc}",)))
            continue
        recorded = entry.get("inputs") or {}
        unknown: tuple[str, ...] = ()
        if golden_sets()[runner].identity is not None:  # a checkout: each field unknown on its own
            unknown = tuple(k for k in ("version", "commit") if current["runner"][k] is None)
        elif current["runner"]["version"] is None:  # package absent: cannot check it
            unknown = ("version", "commit")
        if unknown:
            current = {**current, "runner": {**current["runner"], **{
                k: recorded.get("runner", {}).get(k) for k in unknown}}}
        reasons = input_changes(recorded, current)
        if reasons:
            problems.append(GoldenProblem(key, "stale", tuple(reasons)))
    if keys is None:
        prefixes = tuple(f"{r}/" for r in (runners if runners is not None else golden_sets()))
        for key in entries:
            if key.startswith(prefixes) and key not in expected:
                problems.append(GoldenProblem(key, "unregistered", (
                    "in the manifest but no registered runner/case produces it",)))
    return problems


# -------------------------------------------------------------------- comparison


@dataclass
class GoldenComparison:
    """A live trace against one golden."""

    golden_key: str
    status: str  # "identical" | "known" | "divergent" | "skipped"
    divergence: Any = None
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def format(self) -> str:
        if self.status == "divergent":
            return f"vs golden {self.golden_key}: {self.divergence.message}"
        if self.status == "skipped":
            return f"vs golden {self.golden_key}: skipped ({self.reason})"
        if self.status == "known":
            return f"vs golden {self.golden_key}: known reference behaviour ({self.reason})"
        return f"vs golden {self.golden_key}: identical"


def _registered(runner: str, case: Any) -> bool:
    info = golden_sets()[runner]
    return any(c == case for c in _cases_of(runner)) and info.supports(case)


@cache
def _cases_of(runner: str) -> tuple[Any, ...]:
    return tuple(golden_sets()[runner].cases())


def compare_to_goldens(
    live: Trace,
    case: Any,
    problems: Iterable[GoldenProblem] = (),
    *,
    golden_dir: Path | str = GOLDEN_DIR,
    runners: Iterable[str] | None = None,
    level: str = "round",
    witness: Any = None,
) -> list[GoldenComparison]:
    """Compare ``live`` with the golden of ``case`` of each runner (default: all).

    A differing target sample is judged by the numerics witness
    (``engine/witness.py``) on the live trace's models (default: the cached
    loader's; golden headers carry location-independent paths).

    Goldens listed in ``problems`` (stale, corrupt, missing) are skipped, not
    compared: their failure is the staleness check's, not a divergence. The
    engine golden is compared exactly; an oracle golden through the reference
    policy (``traces.reference.compare_with_reference``: rounds up to the
    engine's ring-wrap fallback, known reference divergences named, not failed).
    """
    from traces.diff import diff_traces
    from traces.reference import compare_with_reference

    if witness is None:
        from specparity.runners import numerics_witness

        witness = numerics_witness()
    bad = {p.key: p for p in problems}
    out: list[GoldenComparison] = []
    for runner in runners if runners is not None else golden_sets():
        key = golden_key(runner, case)
        if runners is None and not _registered(runner, case):
            continue  # a runner whose registry has no such case (e.g. deepspec for two-model cases)
        if key in bad:
            out.append(GoldenComparison(key, "skipped", reason=bad[key].format()))
            continue
        path = golden_path(Path(golden_dir), key)
        if not path.exists():
            out.append(GoldenComparison(key, "skipped", reason="no golden"))
            continue
        golden = read_trace(path)
        if runner == "engine" or level != "round":
            div = diff_traces(live, golden, level=level, witness=witness)
            out.append(GoldenComparison(key, "identical" if div is None else "divergent", div))
            continue
        verdict = compare_with_reference(live, golden, runner, witness=witness)
        reason = verdict.known.id if verdict.known is not None else ""
        out.append(GoldenComparison(key, verdict.status, verdict.divergence, reason=reason))
    return out
