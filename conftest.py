"""Root pytest configuration: environment header, hypothesis profiles, the shared helpers.

``tests/helpers.py`` (CLI runners, zoo model fixtures, file checks) is registered here as a
plugin, so its fixtures serve ``tests/`` and ``conformance/`` without an import. The session
never reaches the Hugging Face hub (``HF_HUB_OFFLINE``): every model is built locally.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from hypothesis import HealthCheck, settings

pytest_plugins = ("tests.helpers",)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# No wall clock in any verdict: no per-example deadline and no "too slow" health check
# (both time the test machine, which is shared and loaded: 2 cores for several runs).
NO_CLOCK = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=50, **NO_CLOCK)
settings.register_profile("ci", max_examples=100, **NO_CLOCK)
settings.register_profile("nightly", max_examples=2000, **NO_CLOCK)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_report_header(config):  # noqa: ANN001, ANN201
    versions = []
    for pkg in ("mlx", "mlx-lm", "numpy", "jsonschema", "hypothesis"):
        try:
            versions.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{pkg} absent")
    return ["specparity: " + ", ".join(versions)]


# ------------------------------------------------------------------ shared plants
import pytest  # noqa: E402


@pytest.fixture
def short_target_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: the target cache is trimmed one position too few (§2 step 5 says ``trim(d - k)``).

    Patches ``engine.caches.trim``, which every rollback path (the executor's
    plan, the audit, the state machines) goes through; the drafter's trims are
    left alone.
    """
    from engine import caches

    real = caches.trim

    def trim(cs: list, n: int, who: str = "cache") -> None:  # noqa: ANN001
        real(cs, n - 1 if who == "target" and n > 0 else n, who)

    monkeypatch.setattr(caches, "trim", trim)


# ------------------------------------------------------------------ parallel workers
# The default run is ``python -m pytest -n auto --dist loadgroup`` (pytest-xdist): tests run in
# several processes at once, so none may write into the checkout's ``runs/`` (the default output
# folders ``runs/latest``, ``runs/ab``, ``runs/bench``, ``runs/regen``): two workers would collide
# on one folder's lock, and a user's own runs would be overwritten. Give ``--out tmp_path`` or use
# the ``in_tmp`` fixture. Folders the tox environments build on purpose are left out.
_RUNS = Path(__file__).resolve().parent / "runs"
_RUNS_OWNED_BY_TOX = {"served-models", "scoreboard"}


def runs_entries(runs: Path = _RUNS) -> set[str]:
    """The entries of the checkout's ``runs/`` a test may not add."""
    try:
        return {p.name for p in runs.iterdir()} - _RUNS_OWNED_BY_TOX
    except FileNotFoundError:
        return set()


def runs_written(before: set[str], runs: Path = _RUNS) -> str | None:
    """The one-line failure when entries were added to ``runs/`` since ``before``, else None."""
    new = sorted(runs_entries(runs) - before)
    if not new:
        return None
    return (f"this test wrote into the checkout's runs/ ({', '.join(new)}): unsafe under parallel "
            "workers; give --out under tmp_path or use the in_tmp fixture")


@pytest.fixture(autouse=True)
def _no_writes_into_the_checkouts_runs() -> Iterator[None]:
    before = runs_entries()
    yield
    why = runs_written(before)
    if why:
        pytest.fail(why, pytrace=False)


# ------------------------------------------------------------------ heavy matrices
def pytest_runtest_setup(item):  # noqa: ANN001, ANN201
    """``@pytest.mark.heavy`` tests (whole-zoo matrices of minutes) run only when asked for:
    ``-m slow`` / ``-m heavy`` or ``SPECPARITY_PROMPTS=all`` (the nightly workflow); the
    default run keeps a few minutes on 2 cores."""
    if item.get_closest_marker("heavy") is None:
        return
    expr = str(item.config.getoption("-m") or "")
    asked = any(m in expr and f"not {m}" not in expr for m in ("slow", "heavy"))
    if not (asked or os.environ.get("SPECPARITY_PROMPTS") == "all"):
        pytest.skip("heavy matrix: run with -m slow or SPECPARITY_PROMPTS=all (nightly)")


# ------------------------------------------------------------------ which oracles ran (tox summary)
# Every pytest run under tox (or with SPECPARITY_RESULTS_DIR set) writes one JSON into
# $SPECPARITY_RESULTS_DIR, else $TOX_WORK_DIR/results/: its environment, each reference/subject/
# server runner's availability there (with the reason when missing), and the outcome and its
# reason (skip reason, xfail reason, a failure's first line) of every `oracle`/`subject`-marked
# test. `tox -e summary` (last in `tox -m oracles`, `-m subjects`, `-m servers`) combines them:
# reports/oracle_runs.py.
_MARKED = ("oracle", "subject")


def results_dir() -> Path | None:
    d = os.environ.get("SPECPARITY_RESULTS_DIR")
    if d:
        return Path(d)
    return Path(os.environ["TOX_WORK_DIR"]) / "results" if os.environ.get("TOX_WORK_DIR") else None


_RESULTS: list[dict] | None = None  # the controller's records (xdist workers keep None)


_OWNER = "SPECPARITY_RESULTS_OWNER"  # set by the recording run: a pytest a test starts does not record


def pytest_configure(config):  # noqa: ANN001, ANN201
    global _RESULTS
    if os.environ.get(_OWNER) or hasattr(config, "workerinput"):
        return  # a pytest run inside a recording one, or an xdist worker (the controller records)
    if results_dir() is not None:
        _RESULTS = []
        os.environ[_OWNER] = str(os.getpid())


def pytest_runtest_logreport(report):  # noqa: ANN001, ANN201
    if _RESULTS is None or not any(m in report.keywords for m in _MARKED):
        return
    if report.when != "call" and report.outcome == "passed":
        return  # setup/teardown that passed: the call's report says it
    outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    reason = ""
    if outcome == "xfailed":  # why it was expected to fail: the known entry or the numerics it names
        reason = _first_line(str(report.wasxfail))
    elif report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.failed:
        crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
        message = _first_line(str(getattr(crash, "message", "") or ""))
        reason = f"failed in {report.when}" + (f": {message}" if message else "")
    _RESULTS.append({"id": report.nodeid, "outcome": outcome, "reason": reason,
                     "markers": [m for m in _MARKED if m in report.keywords]})


def _first_line(text: str, limit: int = 300) -> str:
    """A reason's first non-empty line, at most ``limit`` characters (a verdict can run to pages)."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def pytest_sessionfinish(session, exitstatus):  # noqa: ANN001, ANN201
    out = results_dir()
    if _RESULTS is None or out is None:
        return
    import hashlib
    import json
    import time

    try:
        from specparity.runners.registry import all_runners

        runners = {}
        for name, r in sorted(all_runners().items()):
            if r.kind in ("reference", "subject", "server"):
                ok, why = r.availability()
                runners[name] = {"kind": r.kind, "available": ok, "why": "" if ok else why}
    except Exception as exc:  # the summary names it instead of losing the run's results
        runners = {"<registry>": {"kind": "error", "available": False, "why": f"{type(exc).__name__}: {exc}"}}
    env = os.environ.get("TOX_ENV_NAME", "local")
    args = " ".join(session.config.invocation_params.args)
    doc = {"env": env, "args": args, "exitstatus": int(exitstatus), "finished": time.strftime(
        "%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "runners": runners, "tests": _RESULTS}
    out.mkdir(parents=True, exist_ok=True)
    name = f"{env}--{hashlib.sha256(args.encode()).hexdigest()[:8]}.json"
    from traces.io import atomic_write_text

    atomic_write_text(out / name, json.dumps(doc, indent=1, sort_keys=True) + "\n")
