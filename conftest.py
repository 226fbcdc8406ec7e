"""Root pytest configuration: environment header and hypothesis profiles."""

from __future__ import annotations

import os
from importlib import metadata

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("nightly", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_report_header(config):  # noqa: ANN001, ANN201
    versions = []
    for pkg in ("mlx", "mlx-lm", "numpy", "jsonschema", "hypothesis"):
        try:
            versions.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{pkg} absent")
    return ["specparity: " + ", ".join(versions)]
