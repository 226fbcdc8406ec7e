"""Fixtures the served-grading tests share (tests/test_served*.py): one word-level model pair and one
set of long-lived fake servers per test process (an xdist worker), instead of one of each per file.

``pair``: ``tests/foreign.py``'s phi3-tiny + its twin, built once; ``fakes``: the fake server
processes ``tests.fake_server.Shared`` starts, one per (model, drafter), reset through their control
route at every launch (a fresh server state: no test sees another's), stopped at the end of the
session. A test module may define its own fixture of the same name (the module's wins).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.foreign import build

    return build(tmp_path_factory.mktemp("served-models"), ("phi3",))["phi3"]


@pytest.fixture(scope="session")
def fakes() -> Iterator[dict[Any, Any]]:
    from tests.fake_server import Shared

    procs: dict[Any, Any] = {}
    yield procs
    Shared.stop_all(procs)
