"""The project's own mutation run: plant semantic bugs, see which tests catch them.

Each entry of ``tools/mutations.toml`` is one deliberate bug the project wrote itself (a file,
an exact snippet that occurs once, its replacement, what it breaks and the tests that should
catch it). For each, on a scratch copy of the tree: the snippet is replaced, the entry's tests
run (``pytest -x``), the file is restored. A mutation is **caught** when its tests fail, and
the report names the test that failed first; **missed** when they pass (a blind spot: the
next issue is the project's own, found here, not from outside); **broken** when pytest could
not even collect (caught too, but by an import error, not by a check).

Before any mutation, each entry's tests run on the clean tree and must pass (a stale
catalogue is refused entry by entry, never scored).

    python tools/mutation.py                 # every entry, report in runs/mutation/
    python tools/mutation.py --only ID ...   # some entries
    python tools/mutation.py --list          # the catalogue
    python tools/mutation.py --catalogue F   # another catalogue (same form)

Run nightly (``.github/workflows/nightly.yml``), never in the default tests: each entry runs a
test selection (seconds to a minute on 2 cores). The score and the missed entries go to
``docs/mutation.md``. Reference: the mutation-testing practice of mutmut / cosmic-ray, with a
hand-written catalogue of semantic plants instead of syntactic operators.

Hostile input (issue 41): a catalogue that is not UTF-8, not TOML, or whose fields have the
wrong types is refused in one line naming the entry and the field (exit 2); an entry's
``file`` must be a relative path to a tracked file of this tree (absolute paths, ``..`` and
links leading outside are refused before anything runs). Plants are only ever written into
the scratch copy, never the working tree, so a ``kill -9`` leaves the tree untouched (the
scratch copy of a killed run is removed by the next run: its pid is recorded in it).
``--out`` goes through the project's ownership mechanism
(``specparity.cli.outdir.add_outputs``): a folder holding files no specparity command
wrote, or a ``mutation.md`` the user wrote, is refused before any mutation runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as ``python tools/mutation.py``: the tree's own packages
    sys.path.insert(0, str(ROOT))
CATALOGUE = ROOT / "tools" / "mutations.toml"
SCRATCH_PREFIX = "specparity-mutation-"
PID_FILE = ".specparity-mutation.pid"
COMMAND = "python tools/mutation.py"


class CatalogueError(ValueError):
    """A catalogue that cannot be used: one line naming the file, the entry and the field."""


@dataclass
class Mutation:
    id: str
    file: str
    find: str
    replace: str
    what: str
    tests: list[str]
    k: str = ""


@dataclass
class Outcome:
    id: str
    what: str
    verdict: str  # caught | missed | broken | stale | error
    caught_by: str | None = None
    seconds: float = 0.0
    detail: str = ""
    tests: list[str] = field(default_factory=list)


_FIELDS = {"id": str, "file": str, "find": str, "replace": str, "what": str, "tests": list, "k": str}
_REQUIRED = ("id", "file", "find", "replace", "what", "tests")


def _tracked(root: Path) -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return set()
    return set(out.splitlines())


def check_file(path: Path, where: str, rel: str, root: Path = ROOT, tracked: set[str] | None = None) -> str:
    """``rel`` as a path of a file of this tree, or a :class:`CatalogueError` saying why not
    (absolute, ``..``, a link leading outside, not a tracked file)."""
    p = Path(rel)
    if not rel or p.is_absolute() or rel.startswith("~"):
        raise CatalogueError(f"{path}: {where}: file {rel!r} is not a path relative to the tree "
                             f"({root}); a mutation plants only files of this tree")
    if ".." in p.parts:
        raise CatalogueError(f"{path}: {where}: file {rel!r} leads outside the tree ({root}); a mutation "
                             "plants only files of this tree")
    real = (root / p).resolve()
    if root.resolve() not in real.parents:
        raise CatalogueError(f"{path}: {where}: file {rel!r} resolves to {real}, outside the tree ({root})")
    norm = p.as_posix()
    if (tracked and norm not in tracked) or not real.is_file():  # tracked: git ls-files (none in a scratch copy)
        raise CatalogueError(f"{path}: {where}: file {rel!r} is not a file of this tree (git ls-files)")
    return norm


def load(path: Path = CATALOGUE, root: Path = ROOT) -> list[Mutation]:
    """The catalogue; anything malformed is refused in one line naming the entry and field."""
    try:
        raw_bytes = path.read_bytes()
    except OSError as exc:
        raise CatalogueError(f"{path}: cannot read the catalogue ({exc.strerror or exc})") from None
    try:
        text = raw_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw_bytes[:exc.start].count(b"\n") + 1
        raise CatalogueError(f"{path}: not UTF-8 text (byte {exc.start}, line {line})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CatalogueError(f"{path}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"mutation"})
    if unknown:
        raise CatalogueError(f"{path}: unknown top-level key(s) {', '.join(unknown)}; expected [[mutation]] "
                             "tables")
    entries = data.get("mutation", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise CatalogueError(f"{path}: 'mutation' must be an array of tables ([[mutation]])")
    tracked = _tracked(root)
    out = []
    for i, raw in enumerate(entries):
        name = raw.get("id") if isinstance(raw.get("id"), str) else "?"
        where = f"mutation #{i + 1} ({name})"
        extra = sorted(set(raw) - set(_FIELDS))
        if extra:
            raise CatalogueError(f"{path}: {where}: unknown field(s) {', '.join(extra)}; known: "
                                 f"{', '.join(_FIELDS)}")
        missing = [f for f in _REQUIRED if f not in raw]
        if missing:
            raise CatalogueError(f"{path}: {where}: missing field(s) {', '.join(missing)}")
        for f, typ in _FIELDS.items():
            if f in raw and not isinstance(raw[f], typ):
                want = "an array of test paths" if typ is list else "a string"
                raise CatalogueError(f"{path}: {where}: field {f!r} must be {want}, got "
                                     f"{type(raw[f]).__name__} {str(raw[f])[:60]!r}")
        tests = raw["tests"]
        if not tests:
            raise CatalogueError(f"{path}: {where}: no tests")
        if not all(isinstance(t, str) and t.strip() for t in tests):
            raise CatalogueError(f"{path}: {where}: field 'tests' must hold non-empty strings, got {tests!r}")
        for t in tests:
            test_file = t.split("::", 1)[0]
            if test_file.startswith("-"):
                raise CatalogueError(f"{path}: {where}: test {t!r} is an option, not a test path")
            check_file(path, where, test_file, root, tracked)
        if not raw["id"].strip() or not raw["find"]:
            raise CatalogueError(f"{path}: {where}: 'id' and 'find' must not be empty")
        check_file(path, where, raw["file"], root, tracked)
        out.append(Mutation(**raw))
    ids = [m.id for m in out]
    if len(set(ids)) != len(ids):
        raise CatalogueError(f"{path}: duplicate ids {sorted({i for i in ids if ids.count(i) > 1})}")
    return out


def _pytest(tree: Path, m: Mutation, timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf", *m.tests]
    if m.k:
        cmd += ["-k", m.k]
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "timed out"
    return p.returncode, p.stdout + p.stderr


def _first_failed(output: str) -> str | None:
    hit = re.search(r"^FAILED (\S+)", output, re.M)
    return hit.group(1) if hit else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_scratch(base: Path | None = None) -> list[Path]:
    """Remove the scratch copies of earlier runs that were killed (their recorded pid is gone)."""
    base = Path(base or tempfile.gettempdir())
    gone = []
    for d in sorted(base.glob(f"{SCRATCH_PREFIX}*")):
        try:
            pid = int((d / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            continue  # not recognisably ours: left alone
        if not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def scratch_tree(root: Path = ROOT) -> Path:
    """A copy of the working tree (tracked and untracked files, no build outputs); every plant
    goes into this copy, never into ``root``."""
    remove_stale_scratch()
    dest = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))
    (dest / PID_FILE).write_text(f"{os.getpid()}\n")
    files = sorted(_tracked(root)) or [  # not a git checkout (a scratch copy): every file but caches
        p.relative_to(root).as_posix() for p in root.rglob("*")
        if p.is_file() and not {"__pycache__", ".git", "runs", ".ci"} & set(p.relative_to(root).parts)]
    for f in files:
        src = root / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    return dest


def _plant_path(tree: Path, m: Mutation) -> Path:
    """The scratch copy's file; a path leading out of the copy is refused (never planted)."""
    path = (tree / m.file).resolve()
    if tree.resolve() not in path.parents:
        raise CatalogueError(f"mutation {m.id}: file {m.file!r} leads outside the scratch tree")
    return path


def run(mutations: list[Mutation], timeout: float, log: bool = True) -> list[Outcome]:
    tree = scratch_tree()
    out: list[Outcome] = []
    try:
        for n, m in enumerate(mutations, 1):
            t0 = time.perf_counter()
            path = _plant_path(tree, m)
            try:
                text = path.read_text(encoding="utf-8") if path.is_file() else ""
            except UnicodeDecodeError:
                text = ""
            if text.count(m.find) != 1:
                o = Outcome(m.id, m.what, "stale", detail=f"{m.file}: the snippet occurs {text.count(m.find)} "
                            "times (expected once): the catalogue is out of date", tests=m.tests)
            else:
                rc, log_text = _pytest(tree, m, timeout)
                if rc != 0:
                    o = Outcome(m.id, m.what, "stale", detail=f"its tests fail on the clean tree (exit {rc}): "
                                f"{_first_failed(log_text) or log_text.strip().splitlines()[-1:]}", tests=m.tests)
                else:
                    path.write_text(text.replace(m.find, m.replace), encoding="utf-8")
                    try:
                        rc, log_text = _pytest(tree, m, timeout)
                    finally:
                        path.write_text(text, encoding="utf-8")
                    if rc == 0:
                        o = Outcome(m.id, m.what, "missed", tests=m.tests)
                    elif rc == 1:
                        o = Outcome(m.id, m.what, "caught", _first_failed(log_text), tests=m.tests)
                    elif rc == 124:
                        o = Outcome(m.id, m.what, "caught", "timeout (the plant hangs a test)", tests=m.tests)
                    else:
                        o = Outcome(m.id, m.what, "broken", detail=f"pytest exit {rc}: "
                                    f"{' '.join(log_text.strip().splitlines()[-1:])[:200]}", tests=m.tests)
            o.seconds = round(time.perf_counter() - t0, 1)
            out.append(o)
            if log:
                print(f"mutation {n}/{len(mutations)} {m.id}: {o.verdict}"
                      + (f" by {o.caught_by}" if o.caught_by else "") + (f" ({o.detail})" if o.detail else "")
                      + f" [{o.seconds} s]", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    return out


def report(outcomes: list[Outcome]) -> str:
    scored = [o for o in outcomes if o.verdict in ("caught", "missed", "broken")]
    caught = [o for o in scored if o.verdict != "missed"]
    lines = [f"**{len(caught)}/{len(scored)} planted bugs caught**"
             + (f" ({sum(o.verdict == 'stale' for o in outcomes)} stale entries not scored)"
                if any(o.verdict == "stale" for o in outcomes) else ""), "",
             "| mutation | what it breaks | verdict | caught by | s |", "|---|---|---|---|---:|"]
    for o in outcomes:
        lines.append(f"| `{o.id}` | {o.what} | {o.verdict} | {o.caught_by or o.detail or ''} | {o.seconds} |")
    return "\n".join(lines) + "\n"


def _timeout(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return v


def _out_dir(text: str) -> Path:
    from specparity.cli.args import writable_dir

    return writable_dir(text)


_out_dir.output = "folder"  # type: ignore[attr-defined]  # a writing flag (specparity.cli.outdir.MODULE_WRITERS)


def is_report(p: Path) -> bool:
    """A ``mutation.md``/``mutation.json`` this tool wrote (before output markers existed)."""
    from specparity.cli.args import read_small_json

    if p.suffix == ".json":
        doc = read_small_json(p)
        return isinstance(doc, list) and all(isinstance(o, dict) and {"id", "verdict"} <= set(o) for o in doc)
    try:
        with open(p, encoding="utf-8") as fh:
            head = fh.read(200)
    except (OSError, UnicodeDecodeError):
        return False
    return bool(re.match(r"\*\*\d+/\d+ planted bugs caught\*\*", head))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", default=None, metavar="ID", help="run these entries only")
    p.add_argument("--list", action="store_true", help="list the catalogue and exit")
    p.add_argument("--catalogue", type=Path, default=CATALOGUE, metavar="FILE",
                   help="the catalogue (default tools/mutations.toml)")
    p.add_argument("--timeout", type=_timeout, default=600.0, help="seconds per pytest run (default 600)")
    p.add_argument("--out", type=_out_dir, default=ROOT / "runs" / "mutation",
                   help="report folder (a new folder, or one this tool wrote)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    from specparity.cli.args import UsageError

    try:
        muts = load(args.catalogue)
    except CatalogueError as exc:
        print(f"{COMMAND}: error: {exc}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {m.id for m in muts})
        if unknown:
            print(f"{COMMAND}: error: unknown mutation id(s) {', '.join(unknown)}; known: "
                  f"{', '.join(m.id for m in muts)}", file=sys.stderr)
            return 2
        muts = [m for m in muts if m.id in args.only]
    if args.list:
        for m in muts:
            print(f"{m.id}: {m.what} ({m.file}; tests {' '.join(m.tests)})")
        return 0
    from specparity.cli.outdir import add_outputs

    try:
        with add_outputs(args.out, COMMAND, flag="--out", own_folder=True, recognise=is_report) as claim:
            for name in ("mutation.json", "mutation.md"):
                claim.check(args.out / name)  # refused before any mutation runs
            outcomes = run(muts, args.timeout)
            text = report(outcomes)
            from traces.io import atomic_write_text

            atomic_write_text(claim.track(args.out / "mutation.json"),
                              json.dumps([asdict(o) for o in outcomes], indent=1))
            atomic_write_text(claim.track(args.out / "mutation.md"), text)
    except (UsageError, CatalogueError) as exc:
        print(f"{COMMAND}: error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 1 if any(o.verdict in ("missed", "stale") for o in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
