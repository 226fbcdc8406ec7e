"""One check for "nothing corrupt under a final name", shared by the hostile-input suite and
the crash tests: every visible file is non-empty, traces validate, JSON parses."""

from __future__ import annotations

import json
from pathlib import Path


def assert_whole_files(root: Path, *, killed_writers: bool = False) -> None:
    """``killed_writers``: a SIGKILLed writer may leave its hidden ``.*.tmp`` file (never
    under a final name; readers skip it); otherwise none may be left behind."""
    from traces.validate import validate_file

    for p in root.rglob("*"):
        if not p.is_file() or p.name.startswith("."):
            continue
        assert p.stat().st_size > 0, f"0-byte file under a final name: {p}"
        if p.suffix == ".jsonl":
            assert validate_file(p) == [], p
        elif p.suffix == ".json":
            json.loads(p.read_text())
    if not killed_writers:
        assert not list(root.rglob(".*.tmp")), "temp files left behind"
