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

Run nightly (``.github/workflows/nightly.yml``), never in the default tests: each entry runs a
test selection (seconds to a minute on 2 cores). The score and the missed entries go to
``docs/mutation.md``. Reference: the mutation-testing practice of mutmut / cosmic-ray, with a
hand-written catalogue of semantic plants instead of syntactic operators.
"""

from __future__ import annotations

import argparse
import json
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
CATALOGUE = ROOT / "tools" / "mutations.toml"


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


def load(path: Path = CATALOGUE) -> list[Mutation]:
    """The catalogue; a malformed entry is refused naming it."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    out = []
    for i, raw in enumerate(data.get("mutation", [])):
        try:
            m = Mutation(**raw)
        except TypeError as exc:
            raise SystemExit(f"{path}: mutation #{i} ({raw.get('id', '?')}): {exc}") from None
        if not m.tests:
            raise SystemExit(f"{path}: mutation {m.id}: no tests")
        out.append(m)
    ids = [m.id for m in out]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{path}: duplicate ids {sorted({i for i in ids if ids.count(i) > 1})}")
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


def scratch_tree() -> Path:
    """A copy of the working tree (tracked and untracked files, no build outputs)."""
    dest = Path(tempfile.mkdtemp(prefix="specparity-mutation-"))
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    return dest


def run(mutations: list[Mutation], timeout: float, log: bool = True) -> list[Outcome]:
    tree = scratch_tree()
    out: list[Outcome] = []
    try:
        for n, m in enumerate(mutations, 1):
            t0 = time.perf_counter()
            path = tree / m.file
            text = path.read_text(encoding="utf-8") if path.is_file() else ""
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", default=None, metavar="ID", help="run these entries only")
    p.add_argument("--list", action="store_true", help="list the catalogue and exit")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run (default 600)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "mutation", help="report folder")
    args = p.parse_args(argv)
    muts = load()
    if args.only:
        unknown = sorted(set(args.only) - {m.id for m in muts})
        if unknown:
            print(f"unknown mutation id(s) {', '.join(unknown)}; known: {', '.join(m.id for m in muts)}",
                  file=sys.stderr)
            return 2
        muts = [m for m in muts if m.id in args.only]
    if args.list:
        for m in muts:
            print(f"{m.id}: {m.what} ({m.file}; tests {' '.join(m.tests)})")
        return 0
    outcomes = run(muts, args.timeout)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mutation.json").write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    text = report(outcomes)
    (args.out / "mutation.md").write_text(text)
    print(text)
    return 1 if any(o.verdict in ("missed", "stale") for o in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
