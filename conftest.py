"""Root pytest configuration: environment header, hypothesis profiles, the shared helpers.

``tests/helpers.py`` (CLI runners, zoo model fixtures, file checks) is registered here as a
plugin, so its fixtures serve ``tests/`` and ``conformance/`` without an import. The session
never reaches the Hugging Face hub (``HF_HUB_OFFLINE``): every model is built locally.
"""

from __future__ import annotations

import os
from importlib import metadata

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
