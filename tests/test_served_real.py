"""Real servers, live: each graded as the committed scoreboard says (``tox -e server-<name>``).

Marker ``subject``; runs only with ``SPECPARITY_SERVER_TESTS=1`` (the tox
environments set it) and when the server is installed (mlx-lm's server is
installed in the default environment too, so the variable keeps it out of the
default run). Every check's status in each arm must equal the committed
``docs/scoreboard/server-<name>--<model>.json``: a new failure and a known
failure that went away both fail, so the scoreboard and the ``server:`` entries
of ``traces/known_divergences.toml`` stay true.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specparity.served import SERVERS, grade_served

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "scoreboard"

pytestmark = [
    pytest.mark.subject,
    pytest.mark.skipif(os.environ.get("SPECPARITY_SERVER_TESTS") != "1",
                       reason="real servers run in their tox environments (tox -e server-<name>)"),
]

CASES = [  # (server, model, draft): zoo names or user-pair names under runs/served-models
    ("mlx-lm", "llama", "twin"),
    ("mlx-lm", "phi3-tiny", "phi3-tiny-twin"),
    ("vllm-mlx", "phi3-tiny", None),
    ("fusion-mlx", "phi3-tiny", None),
    ("qmlx-serve", "phi3-tiny", "phi3-tiny-twin"),
    ("flyto-mlx", "phi3-tiny", None),
]


@pytest.fixture(scope="session")
def user_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.foreign import build

    root = tmp_path_factory.mktemp("served-real")
    build(root, ("phi3",))
    return root


@pytest.mark.parametrize("server, model, draft", CASES, ids=[f"{s}-{m}" for s, m, _ in CASES])
def test_server_grades_as_the_committed_scoreboard_says(server, model, draft, user_models, tmp_path) -> None:
    if not SERVERS[server].available():
        pytest.skip(f"{server} is not installed here: tox -e {SERVERS[server].tox_env}")
    m = model if "-" not in model else str(user_models / model)
    d = None if draft is None else (draft if "-" not in draft else str(user_models / draft))
    doc = grade_served(model=m, draft=d, serve=server, out=tmp_path)
    committed_path = COMMITTED / f"server-{server}--{Path(doc['model']['path']).name}.json"
    committed = json.loads(committed_path.read_text())
    got = {arm: {c: r["status"] for c, r in mode["checks"].items()} for arm, mode in doc["modes"].items()}
    want = {arm: {c: r["status"] for c, r in mode["checks"].items()} for arm, mode in committed["modes"].items()}
    assert got == want, {arm: {c: (got.get(arm, {}).get(c), s) for c, s in w.items()
                               if got.get(arm, {}).get(c) != s} for arm, w in want.items()}
