"""The golden manifest and its staleness / corruption check (``specparity/goldens/manifest.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specparity.cases.case import Case
from specparity.goldens import manifest as g
from traces.io import write_trace
from traces.validate import validate_file

CASE = Case("llama", "twin", "nat-00", 3, 32)
KEY_E = g.golden_key("engine", CASE)
KEY_O = g.golden_key("mlx_lm", CASE)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Goldens of one case for both runners, made by regen in this process."""
    from specparity.goldens.regen import regen

    d = tmp_path_factory.mktemp("golden")
    res = regen(d, case_glob=CASE.case_id, workers=0, progress=False)
    assert res.exit_code == 0 and {o.status for o in res.outcomes} == {"new"}
    return d


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_normalize_nulls_timing_and_relativises_zoo_paths() -> None:
    import zoo
    from specparity.runners import run_case

    recs = g.normalize_records(run_case("engine", CASE))
    # zoo/<the model's directory name under the zoo cache>
    assert recs[0]["target"]["path"] == f"zoo/{zoo.model_dir('llama').name}"
    assert recs[0]["drafter"]["path"] == f"zoo/{zoo.model_dir('llama-twin').name}"
    assert all(r["time_s"] is None for r in recs if r["type"] in ("round", "plain"))
    assert recs[-1]["wall_s"] is None
    # margins are kept (they classify divergences)
    assert all(r["margins"] for r in recs if r["type"] == "round")
    assert str(zoo.cache_root()) not in json.dumps(recs)


def test_small_dir_is_valid_and_fresh(small_dir: Path) -> None:
    for key in (KEY_E, KEY_O):
        assert validate_file(g.golden_path(small_dir, key)) == []
    assert g.check_goldens(small_dir, keys=[KEY_E, KEY_O]) == []
    m = g.load_manifest(small_dir)
    assert set(m["goldens"]) == {KEY_E, KEY_O}
    inputs = m["goldens"][KEY_E]["inputs"]
    assert inputs["runner"]["package"] == "specparity"
    assert inputs["target"]["name"] == "llama" and inputs["drafter"]["name"] == "llama-twin"
    assert inputs["params"]["gamma"] == 3 and inputs["schema_version"] == 1
    assert "normalization" in m


def test_corrupt_golden_is_reported(small_dir: Path, tmp_path: Path) -> None:
    d = _copy(small_dir, tmp_path / "g")
    p = g.golden_path(d, KEY_O)
    p.write_bytes(p.read_bytes().replace(b'"k_accept":', b'"k_accept": ', 1))
    probs = g.check_goldens(d, keys=[KEY_E, KEY_O])
    assert [(x.key, x.kind) for x in probs] == [(KEY_O, "corrupt")]
    assert "does not match the manifest" in probs[0].format()


def test_missing_and_unregistered(small_dir: Path, tmp_path: Path) -> None:
    d = _copy(small_dir, tmp_path / "g")
    g.golden_path(d, KEY_E).unlink()
    m = g.load_manifest(d)
    m["goldens"]["mlx_lm/nosuch__case"] = m["goldens"][KEY_O]
    g.save_manifest(m, d)
    kinds = {(x.key, x.kind) for x in g.check_goldens(d)}
    assert (KEY_E, "missing") in kinds
    assert ("mlx_lm/nosuch__case", "unregistered") in kinds


def test_package_version_bump_is_stale_with_the_change(
    small_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = g.package_version
    monkeypatch.setattr(g, "package_version",
                        lambda d: "0.33.0" if d == "mlx-lm" else real(d))
    probs = g.check_goldens(small_dir, keys=[KEY_E, KEY_O])
    assert [(x.key, x.kind) for x in probs] == [(KEY_O, "stale")]
    old = real("mlx-lm")
    assert probs[0].format() == f"{KEY_O}: stale: mlx-lm {old} → 0.33.0"


def test_engine_code_change_is_stale(small_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = g.InputsContext.runner_code
    monkeypatch.setattr(g.InputsContext, "runner_code",
                        lambda self, r: "f" * 64 if r == "engine" else real(self, r))
    probs = g.check_goldens(small_dir, keys=[KEY_E, KEY_O])
    assert [(x.key, x.kind) for x in probs] == [(KEY_E, "stale")]
    assert "engine code digest changed (" in probs[0].reasons[0]
    assert "→ ffffffffffff…)" in probs[0].reasons[0]


def test_input_changes_names_each_input() -> None:
    old = {"runner": {"name": "engine", "package": "specparity", "version": "0.1.0", "commit": None},
           "mlx": "0.32.4", "params": {"gamma": 3}, "prompt": {"id": "nat-00", "sha256": "a"},
           "target": {"name": "llama", "weights_sha256": "0" * 64, "config_sha256": "c"},
           "tokenizer_sha256": "t"}
    new = json.loads(json.dumps(old))
    new["mlx"], new["params"]["gamma"], new["prompt"]["sha256"] = "0.33.0", 5, "b"
    new["target"]["weights_sha256"] = "1" * 64
    assert g.input_changes(old, new) == [
        "mlx 0.32.4 → 0.33.0",
        "target llama weights changed (000000000000… → 111111111111…)",
        "prompt nat-00 token ids changed",
        "params.gamma 3 → 5",
    ]
    assert g.input_changes(old, json.loads(json.dumps(old))) == []


def test_engine_code_digest_covers_engine_not_zoo() -> None:
    files = g._module_files("engine", ("zoo",))
    assert "engine/executor.py" in files and "engine/sources/two_model.py" in files
    assert not any(f.startswith("zoo/") for f in files)
    assert list(g._module_files("oracles.__init__")) == ["oracles/__init__.py"]


def test_save_manifest_is_atomic_and_sorted(tmp_path: Path) -> None:
    g.save_manifest({"goldens": {"b/x": {"sha256": "1"}, "a/y": {"sha256": "2"}}}, tmp_path)
    text = (tmp_path / "manifest.json").read_text()
    assert list(json.loads(text)["goldens"]) == ["a/y", "b/x"]
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_committed_goldens_match_their_manifest() -> None:
    """Every committed golden file has an entry with its sha256 (staleness aside)."""
    m = g.load_manifest()
    files = {p.relative_to(g.GOLDEN_DIR).with_suffix("").as_posix()
             for p in g.GOLDEN_DIR.rglob("*.jsonl")}
    assert files == set(m["goldens"])
    for key, entry in m["goldens"].items():
        assert entry["file"] == f"{key}.jsonl"
        assert g.file_sha256(g.golden_path(g.GOLDEN_DIR, key)) == entry["sha256"], key
    assert sum(p.stat().st_size for p in g.GOLDEN_DIR.rglob("*")) < 5_000_000


def test_golden_writer_is_byte_reproducible(tmp_path: Path) -> None:
    from specparity.runners import run_case

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_trace(a, g.normalize_records(run_case("engine", CASE)))
    write_trace(b, g.normalize_records(run_case("engine", CASE)))
    assert a.read_bytes() == b.read_bytes()
