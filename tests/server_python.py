"""A virtualenv on a Python new enough for a server that needs one (tox ``commands_pre``).

Some served engines require a newer Python than the harness's (yunshu 0.1.5: Python >= 3.13);
their tox environment builds the server's own virtualenv on one::

    python -m tests.server_python --min 3.13 --venv {envdir}/server

The interpreter is, in order: ``$SPECPARITY_SERVER_PYTHON`` (used as given, refused when too
old), ``python3.N`` on ``PATH`` from the minimum up, pyenv's installed versions
(``$PYENV_ROOT``, default ``~/.pyenv``), uv's managed Pythons (``~/.local/share/uv/python``);
the oldest that is new enough. None: one line naming where it looked and how to point at one,
exit 1 (a set-up failure of that environment, never a finding about the server).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ENV = "SPECPARITY_SERVER_PYTHON"
PROBE = "import sys; print('%d.%d' % sys.version_info[:2])"


def version_of(python: str) -> tuple[int, int] | None:
    """``(major, minor)`` of the interpreter at ``python``, None when it does not run."""
    try:
        out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.fullmatch(r"(\d+)\.(\d+)", out.stdout.strip())
    return (int(m.group(1)), int(m.group(2))) if out.returncode == 0 and m else None


def _candidates(minimum: tuple[int, int]) -> Iterator[str]:
    for minor in range(minimum[1], minimum[1] + 6):
        found = shutil.which(f"python{minimum[0]}.{minor}")
        if found:
            yield found
    roots = [Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions",
             Path.home() / ".local" / "share" / "uv" / "python"]
    for root in roots:
        if root.is_dir():
            for d in sorted(root.iterdir(), key=lambda p: [int(x) for x in re.findall(r"\d+", p.name)[:3]]):
                for name in (f"python{minimum[0]}", "python"):
                    exe = d / "bin" / name
                    if exe.is_file():
                        yield str(exe)
                        break


def find_python(minimum: tuple[int, int]) -> str:
    """The interpreter to build on (see the module docstring); ``LookupError`` with the one line when none."""
    want = f"{minimum[0]}.{minimum[1]}"
    given = os.environ.get(ENV)
    if given:
        got = version_of(given)
        if got is None:
            raise LookupError(f"{ENV}={given} does not run as a Python interpreter")
        if got < minimum:
            raise LookupError(f"{ENV}={given} is Python {got[0]}.{got[1]}; this server needs Python >= {want}")
        return given
    for exe in _candidates(minimum):
        got = version_of(exe)
        if got is not None and got >= minimum:
            return exe
    raise LookupError(f"no Python >= {want} found (looked for python{want} and newer on PATH, in pyenv's "
                      f"versions and uv's Pythons); install one or set {ENV}=/path/to/python{want}")


def _version(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: give a version as MAJOR.MINOR, e.g. 3.13")
    return int(m.group(1)), int(m.group(2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.server_python", description=__doc__.split("\n\n")[0])
    ap.add_argument("--min", type=_version, required=True, help="the oldest Python the server runs on (3.13)")
    ap.add_argument("--venv", type=Path, required=True, help="the virtualenv to create (kept when it exists)")
    a = ap.parse_args(argv)
    if (a.venv / "bin" / "python").exists() and (version_of(str(a.venv / "bin" / "python")) or (0, 0)) >= a.min:
        print(f"{a.venv}: exists, kept", file=sys.stderr)
        return 0
    try:
        python = find_python(a.min)
    except LookupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{a.venv}: on {python}", file=sys.stderr)
    return subprocess.run([python, "-m", "venv", str(a.venv)]).returncode


if __name__ == "__main__":
    sys.exit(main())
