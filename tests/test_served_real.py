"""Real servers, live: each graded as the committed scoreboard says (``tox -e server-<name>``).

Marker ``subject``; runs only with ``SPECPARITY_SERVER_TESTS=1`` (the tox
environments set it) and when the server is installed (mlx-lm's server is
installed in the default environment too, so the variable keeps it out of the
default run). Two promises per server:

- a set-up failure never reads fail: a cell that says the server did not start,
  or that an endpoint needs a chat template the model lacks, is never ``fail``:
  ``cannot-grade`` with the reason (and the server's log line where it gave one),
  n/a (``tools`` on a model without a chat template), or a pass on its other
  cases with the set-up case could-not-grade;
- every cell's status in each arm equals the committed
  ``docs/scoreboard/server-<name>--<model>.json`` when that row was graded by the
  current checks (``checks_version``): a new failure and a known failure that went
  away both fail. A row graded by older checks (``stale``) is not compared: the test
  says to regenerate it. Checks added since the row was graded (not in its
  ``checks``) are not compared either: regenerating the row pins them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from specparity.grading.http_servers import grade_served
from subjects.server_rows import SERVERS

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "scoreboard"
SETUP = re.compile(r"server did not start|chat template|not installed", re.I)

pytestmark = [
    pytest.mark.subject,
    pytest.mark.skipif(os.environ.get("SPECPARITY_SERVER_TESTS") != "1",
                       reason="real servers run in their tox environments (tox -e server-<name>)"),
]

CASES = [  # (server, model, draft): zoo names, or the user pairs built under runs/served-models
    ("mlx-lm", "llama", "twin"),
    ("mlx-lm", "runs/served-models/phi3-tiny", "runs/served-models/phi3-tiny-twin"),
    ("vllm-mlx", "runs/served-models/phi3-tiny", None),
    ("fusion-mlx", "runs/served-models/phi3-chat64", None),  # a chat template: its completions use one
    ("qmlx-serve", "runs/served-models/phi3-tiny", "runs/served-models/phi3-tiny-twin"),
    ("flyto-mlx", "runs/served-models/phi3-tiny", None),
    ("rapid-mlx", "runs/served-models/phi3-tiny", None),
    ("yunshu", "runs/served-models/phi3-chat64", None),  # head dim 64: it quantizes in groups of 64
    ("vmlx", "runs/served-models/phi3-tiny", "runs/served-models/phi3-tiny-twin"),
    ("mlx-vlm", "runs/served-models/phi3-chat64", None),  # chat only: a chat template
]


@pytest.fixture(scope="session")
def user_models() -> Path:
    from tests.foreign import build, build_chat64

    root = ROOT / "runs" / "served-models"
    if not (root / "phi3-tiny" / "config.json").is_file():
        build(root, ("phi3",))
    build_chat64(root)  # phi3-chat64: builds only what is missing
    return root


@pytest.mark.parametrize("server, model, draft", CASES, ids=[f"{s}-{Path(m).name}" for s, m, _ in CASES])
def test_server_grades_as_the_committed_scoreboard_says(server, model, draft, user_models, tmp_path,
                                                        monkeypatch) -> None:
    if not SERVERS[server].available():
        pytest.skip(f"{server} is not installed here: tox -e {SERVERS[server].tox_env}")
    monkeypatch.chdir(ROOT)  # rows name the user pair by its path relative to the checkout
    doc = grade_served(model=model, draft=draft, serve=server, out=tmp_path)
    for arm, mode in doc["modes"].items():
        for c, r in mode["checks"].items():
            if SETUP.search(r["detail"]) and "(the server is still up)" not in r["detail"]:
                # set-up: never a finding (the cell may be n/a where the check does not apply, `tools` on a model
                # without a chat template, or pass on its other cases, the chat case could-not-grade)
                assert r["status"] != "fail", (arm, c, r)
            if r["status"] == "cannot-grade":
                assert r["detail"].strip(), (arm, c, r)  # always with the reason
    committed_path = COMMITTED / f"server-{server}--{Path(model).name}.json"
    if not committed_path.is_file():
        pytest.skip(f"no committed row {committed_path.name} yet: commit runs/scoreboard/{committed_path.name} "
                    f"from this run (tox -e {SERVERS[server].tox_env})")
    committed = json.loads(committed_path.read_text())
    if committed.get("checks_version") != doc["checks_version"]:
        pytest.skip(f"{committed_path.name} was graded by checks version {committed.get('checks_version', 1)}, "
                    f"these are version {doc['checks_version']}: regenerate it (tox -e {SERVERS[server].tox_env}) "
                    "and commit runs/scoreboard/" + committed_path.name)
    pinned = set(committed.get("checks") or [])  # checks added since the row was graded are not pinned yet
    got = {arm: {c: r["status"] for c, r in mode["checks"].items() if c in pinned}
           for arm, mode in doc["modes"].items()}
    want = {arm: {c: r["status"] for c, r in mode["checks"].items()} for arm, mode in committed["modes"].items()}
    assert got == want, {arm: {c: (got.get(arm, {}).get(c), s) for c, s in w.items()
                               if got.get(arm, {}).get(c) != s} for arm, w in want.items()}
