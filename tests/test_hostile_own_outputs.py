"""The harness's own outputs as input: every kind of trace a specparity command writes passes
``specparity trace validate`` and ``grade`` with the verdict it was written with.

Planted here: the traces of ``run`` (engine spec and plain), ``generate --trace`` for each draft
source kind and each header param a re-run reads (sampling, processors, min-tokens and the
position RNG, a grammar, quantized KV, native MTP on a DeepSeek-style checkpoint given as the
user's own target, MTP conventions, a block drafter's confidence threshold), ``record --trace``
(a reference's trace) and ``run --sessions``' warm prompt-cache traces (graded by the warm-vs-cold
rules against a cold re-run, never a false ``logic``: issue 35). No command writes fill traces
(``run`` writes the fill cases' rows to ``fill.json``). A warm trace tampered after the prefill is
caught by the warm-vs-cold comparison, first divergence named.

What each test checks, and the catalogue of inputs: ``tests/test_hostile_catalogue.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import zoo
from tests.helpers import cli_rc, read_records, write_records

# one worker builds this module's module-scoped fixture (seconds) once: `--dist loadgroup`
pytestmark = pytest.mark.xdist_group("hostile-own-outputs")


def _generate(out: Path, name: str, argv: list[Any]) -> None:
    rc = cli_rc("generate", "-n", "6", "--prompt-ids", "5,6,7,8", "--trace", out / f"{name}.jsonl", *argv)
    assert rc == 0, name


SESSIONS_SUITE = """sessions = ["prefix", "multi-turn"]
gammas = [2]
max_tokens = 4
zoo_prompts = 2
[[pair]]
target = "llama"
drafter = "twin"
"""


@pytest.fixture(scope="module")
def own_traces(tmp_path_factory: pytest.TempPathFactory, tiny_run: Path) -> dict[str, Path]:
    """``{kind: trace}``: one trace of each kind the commands write, in one folder."""
    import shutil

    from zoo.dspark import case_paths as block_paths
    from zoo.heads import case_paths as head_paths
    from zoo.native_mtp import model_dir as native_dir

    out = tmp_path_factory.mktemp("own") / "traces"
    out.mkdir()
    llama, twin = zoo.pair("llama", "twin")
    for mode in ("spec", "plain"):
        src = next(p for p in sorted((tiny_run / "traces" / "engine").glob("*.jsonl"))
                   if read_records(p)[0]["mode"] == mode)
        shutil.copy(src, out / f"run-engine-{mode}.jsonl")
    deepseek, glm = native_dir("deepseek-mtp"), native_dir("glm-mtp")
    qwen3, dspark = block_paths("qwen3", "dspark-t0")
    qwen35, mtp_head = head_paths("qwen35", "qwen35-mtp-self")
    kv_target, kv_twin = zoo.pair(zoo.KV_TARGET, "twin")
    plans: dict[str, list[Any]] = {
        "generate two-model": ["--target", llama, "--draft", twin],
        "generate plain": ["--target", llama],
        "generate ngram": ["--target", llama, "--source", "ngram"],
        "generate sampled": ["--target", llama, "--draft", twin, "--temp", "0.7", "--seed", "3", "--top-k", "20"],
        "generate processors": ["--target", llama, "--draft", twin, "--repetition-penalty", "1.3",
                                "--logit-bias", "7=1.5"],
        "generate min-tokens rng": ["--target", llama, "--draft", twin, "--temp", "0.7", "--seed", "5",
                                    "--min-tokens", "3", "--rng", "position"],
        "generate grammar": ["--target", llama, "--draft", twin, "--grammar", "regex-sentence"],
        "generate kv": ["--target", kv_target, "--draft", kv_twin, "--kv-bits", "4", "--kv-group-size", "32",
                        "--quantized-kv-start", "0"],
        "generate native-mtp (own target)": ["--source", "native-mtp", "--target", deepseek, "--draft", deepseek],
        "generate native-mtp conventions": ["--target", glm, "--draft", glm, "--mtp-conventions",
                                            "hidden=pre-norm,trim=rebuild"],
        "generate dspark": ["--target", qwen3, "--draft", dspark, "--confidence-threshold", "0.5"],
        "generate mtp head": ["--target", qwen35, "--draft", mtp_head],
    }
    for name, argv in plans.items():
        _generate(out, name.replace(" ", "-"), argv)
    assert cli_rc("record", "--runner", "mlx_lm", "--target", llama, "--draft", twin, "-n", "6",
                  "--prompt-ids", "5,6,7,8", "--trace", out / "record-mlx_lm.jsonl") == 0
    suite = out.parent / "sessions.toml"
    suite.write_text(SESSIONS_SUITE)
    sessions = out.parent / "sessions"
    assert cli_rc("run", "--suite", suite, "--out", sessions, "--quiet") == 0
    found = sorted((sessions / "traces" / "sessions").rglob("*.jsonl"))
    assert found, "run --sessions wrote its warm traces"
    kinds = {p.stem.replace("-", " ").replace("_", " ").strip(): p for p in sorted(out.glob("*.jsonl"))}
    for p in found:
        warm = (read_records(p)[1].get("prompt_cache") or {}).get("target_reused", 0) > 0
        key = f"run --sessions {p.parent.name} {p.stem} ({'warm' if warm else 'cold'})"
        dest = out / f"{key.replace(' ', '_').replace('(', '').replace(')', '')}.jsonl"
        shutil.copy(p, dest)
        kinds[key] = dest
    return kinds


def test_every_kind_is_planted(own_traces: dict[str, Path]) -> None:
    warm = [k for k in own_traces if k.endswith("(warm)")]
    assert len(warm) >= 4, sorted(own_traces)
    assert len(own_traces) >= 20


def test_own_traces_validate(own_traces: dict[str, Path]) -> None:
    from traces.validate import validate_file

    bad = {k: [str(e) for e in validate_file(p)][:2] for k, p in own_traces.items() if validate_file(p)}
    assert not bad, bad


def test_own_traces_grade_with_the_verdict_they_were_written_with(
        own_traces: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One grade of the whole folder: CONFORMS, every comparison of every trace identical (a warm
    trace by warm-vs-cold against its cold re-run, its references against that cold run)."""
    from tests.helpers import cli

    folder = next(iter(own_traces.values())).parent
    out = tmp_path / "graded"
    rc, _, err = cli(["grade", folder, "--out", out, "--quiet"], capsys)
    comparisons = json.loads((out / "comparisons.json").read_text()) if (out / "comparisons.json").exists() else []
    failing = [(c["kind"], c["case_id"], c.get("verdict"), (c.get("message") or c.get("detail") or "")[:200])
               for c in comparisons if c.get("fails")]
    assert rc == 0, (err[-2000:], failing)
    assert not failing
    graded = {p.name for p in (out / "traces" / "engine").glob("*.jsonl")}
    assert len(graded) == len(own_traces), "every trace graded (none collapsed)"
    kinds = {c["kind"] for c in comparisons}
    assert {"warm-vs-cold", "spec-vs-plain", "engine-vs-mlx_lm"} <= kinds, kinds
    warm = [c for c in comparisons if c["kind"] == "warm-vs-cold"]
    assert len(warm) == len([k for k in own_traces if k.endswith("(warm)")])
    assert all(c["verdict"] == "identical" for c in warm), warm


def _warm(own_traces: dict[str, Path]) -> Path:
    return next(p for k, p in own_traces.items() if k.endswith("(warm)"))


@pytest.mark.parametrize("plant,where", [
    (lambda recs: recs[1]["target_cache_digest"].update(combined="0" * 64), "target_cache_digest"),
    (lambda recs: next(r for r in recs if r["type"] == "round")["drafter_cache_digest"].update(
        combined="1" * 64), "drafter_cache_digest"),
], ids=["prefill cache digest", "a round's drafter cache"])
def test_a_tampered_warm_trace_is_caught_by_warm_vs_cold(own_traces: dict[str, Path], tmp_path: Path,
                                                         plant: Any, where: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The warm-vs-cold comparison can fail: a warm trace whose prefill left other cache bytes, or
    whose round differs from the cold run's, is ``logic``, the first divergence named."""
    from tests.helpers import cli
    from traces.validate import validate_file

    d = tmp_path / "warm"
    d.mkdir()
    recs = read_records(_warm(own_traces))
    plant(recs)
    write_records(d / "t.jsonl", recs)
    assert validate_file(d / "t.jsonl") == []
    rc, _, err = cli(["grade", d, "--out", tmp_path / "g", "--runners", "", "--quiet"], capsys)
    assert rc == 1, err
    comparisons = json.loads((tmp_path / "g" / "comparisons.json").read_text())
    (c,) = [c for c in comparisons if c["kind"] == "warm-vs-cold"]
    assert c["fails"] and c["verdict"] == "logic", c
    assert where in json.dumps(c), c


def test_no_command_writes_fill_traces(tiny_run: Path) -> None:
    """The fill cases' results are rows (``fill.json``), not traces: nothing to grade."""
    assert not [p for p in tiny_run.rglob("*.jsonl") if "fill" in p.name]
