"""One model identity: the header's ``config_sha256`` is computed one way everywhere.

Before, ``traces.writer.model_identity`` hashed ``config.json`` while the runners hashed a
DSpark drafter's ``dspark.json``: an engine author's trace of a DSpark drafter carried another
``config_sha256`` than the one ``grade`` computes, and grading it stopped on "the trace was
written with another model". Now both are ``traces.digest.config_digest``.
"""

from __future__ import annotations

from pathlib import Path

import zoo
from specparity.runners import model_identity
from traces.digest import config_digest
from traces.writer import model_identity as writer_identity


def _dspark_dir() -> Path:
    from zoo.dspark import artifact_dir

    return Path(artifact_dir("qwen3-dspark"))


def test_every_builder_agrees_on_a_dspark_drafter_and_a_model() -> None:
    for d in (_dspark_dir(), zoo.model_dir("llama")):
        ours, theirs = model_identity(d), writer_identity(d)
        assert ours == theirs, (d, ours, theirs)
        assert ours["config_sha256"] == config_digest(d) is not None


def test_a_dspark_drafter_is_identified_by_its_dspark_json() -> None:
    import hashlib

    d = _dspark_dir()
    want = hashlib.sha256((d / "dspark.json").read_bytes()).hexdigest()
    assert writer_identity(d)["config_sha256"] == want  # before: config.json's digest


def test_a_dir_without_a_config_has_none(tmp_path: Path) -> None:
    assert config_digest(tmp_path) is None
    assert writer_identity(tmp_path, digests=False)["config_sha256"] is None
