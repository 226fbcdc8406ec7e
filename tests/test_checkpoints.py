"""The checkpoints users have: fp32/fp16/bf16 × unquantized/q4/q8 (group 32, 64)/mxfp4 ×
single-file/sharded, each built by mlx-lm 0.32.2's own ``mlx_lm.convert.convert``
(``quantize_model``, ``save_model`` / ``make_shards``) from a seeded tests/foreign.py phi3
(``convert_checkpoint``; nothing downloaded), and ``run``, ``grade``, ``record`` and
``audit`` (the CLI's ``main``, in process) on each: 1 prompt, 6 tokens, γ 2.

The full product (36 combinations, a target and a twin drafter each) takes longer than a
default test should on one core, so the default run covers it (:data:`COVER`): every
value of every axis at least once and every command on every dtype; the full product is
``test_full_matrix`` under the ``slow`` marker. ``bench``'s checkpoint facts
(``specparity.measure.bench.checkpoint_facts``) are tested on the q4 and bf16 builds.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import foreign
from tests.helpers import cli_rc

Combo = tuple[str, str, bool]  # (dtype, quantization, sharded)
FULL: list[Combo] = list(itertools.product(foreign.DTYPES, foreign.QUANTS, (False, True)))
COVER: list[Combo] = [
    ("float32", "none", False), ("float16", "q4g32", True), ("bfloat16", "q4g64", False),
    ("float32", "q8g32", True), ("float16", "q8g64", False), ("bfloat16", "mxfp4", True),
    ("bfloat16", "none", False),  # the single-file bf16 checkpoint (issue 22's first finding)
]


def _name(c: Combo) -> str:
    return f"{c[0]}-{c[1]}-{'sharded' if c[2] else 'single'}"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Combo], tuple[Path, Path, Path]]:
    """``combo -> (target dir, drafter dir, prompts file)``, built once per session."""
    root = tmp_path_factory.mktemp("checkpoints")
    src = foreign.write_quantizable("phi3", root / "src")
    srcd = foreign.write_quantizable("phi3", root / "src-twin", drafter=True)
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "text": "ba de fi go ku la me"}) + "\n")
    built: dict[Combo, tuple[Path, Path, Path]] = {}

    def get(c: Combo) -> tuple[Path, Path, Path]:
        if c not in built:
            kw = {"dtype": c[0], "quant": c[1], "sharded": c[2]}
            built[c] = (foreign.convert_checkpoint(src, root / _name(c), **kw),
                        foreign.convert_checkpoint(srcd, root / f"{_name(c)}-twin", **kw), prompts)
        return built[c]

    return get


def _commands_on(c: Combo, t: Path, d: Path, prompts: Path, out: Path) -> None:
    from traces.digest import weights_digest

    shards = sorted(p.name for p in t.glob("*.safetensors"))
    assert (len(shards) > 1) == c[2], shards
    cfg = json.loads((t / "config.json").read_text())
    q = foreign.QUANTS[c[1]]
    assert (cfg.get("quantization") is not None) == (q is not None), cfg.get("quantization")
    run = out / "run"
    assert cli_rc("run", "--target", str(t), "--draft", str(d), "--prompts-file", str(prompts),
                  "--gammas", "2", "--max-tokens", "6", "--runners", "mlx_lm", "--out", str(run),
                  "--quiet") == 0, f"{_name(c)}: run"
    verdicts = {(c["kind"], c["verdict"]) for c in json.loads((run / "comparisons.json").read_text())}
    assert verdicts == {("engine-vs-mlx_lm", "identical"), ("spec-vs-plain", "identical")}, \
        (_name(c), verdicts)
    traces = sorted((run / "traces" / "engine").glob("*.jsonl"))
    assert traces, _name(c)
    head = json.loads(traces[0].read_text().splitlines()[0])
    assert head["target"]["weights_sha256"] == weights_digest(t), _name(c)
    assert cli_rc("grade", str(run / "traces" / "engine"), "--out", str(out / "graded")) == 0, \
        f"{_name(c)}: grade"
    rec = out / "rec.jsonl"
    assert cli_rc("record", "--runner", "mlx_lm", "--target", str(t), "--draft", str(d),
                  "--prompt", "ba de fi go", "-n", "6", "--gamma", "2", "--trace", str(rec)) == 0, \
        f"{_name(c)}: record"
    assert json.loads(rec.read_text().splitlines()[-1])["usage"]["generation_tokens"] == 6
    aj = out / "audit.json"
    assert cli_rc("audit", "--target", str(t), "--draft", str(d), "--prompts-file", str(prompts),
                  "--max-tokens", "6", "--gamma", "2", "--json", str(aj)) == 0, f"{_name(c)}: audit"
    assert aj.is_file()


def test_cover_spans_every_axis_and_every_command_on_every_dtype() -> None:
    for axis, values in ((0, foreign.DTYPES), (1, tuple(foreign.QUANTS)), (2, (False, True))):
        assert {c[axis] for c in COVER} == set(values), axis


@pytest.mark.parametrize("combo", COVER, ids=_name)
def test_commands_on_checkpoint(checkpoints, combo: Combo, tmp_path: Path) -> None:  # noqa: ANN001
    _commands_on(combo, *checkpoints(combo), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("combo", [c for c in FULL if c not in COVER], ids=_name)
def test_full_matrix(checkpoints, combo: Combo, tmp_path: Path,  # noqa: ANN001
                     request: pytest.FixtureRequest) -> None:
    expr = str(request.config.getoption("-m") or "")
    if not (("slow" in expr and "not slow" not in expr) or os.environ.get("SPECPARITY_PROMPTS") == "all"):
        pytest.skip("the full 36-checkpoint matrix: run with -m slow or SPECPARITY_PROMPTS=all (~100 s)")
    _commands_on(combo, *checkpoints(combo), tmp_path)


def test_grade_refuses_a_checkpoint_changed_since_the_trace(checkpoints, tmp_path: Path,  # noqa: ANN001
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Planted: one bit of a sharded bf16 q4 checkpoint flipped after its traces were written."""
    import shutil

    t0, d, prompts = checkpoints(("bfloat16", "q4g64", True))
    t = tmp_path / "t"
    shutil.copytree(t0, t)
    assert cli_rc("run", "--target", str(t), "--draft", str(d), "--prompts-file", str(prompts),
                  "--gammas", "2", "--max-tokens", "6", "--runners", "mlx_lm", "--out",
                  str(tmp_path / "run"), "--quiet") == 0
    shard = sorted(t.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli_rc("grade", str(tmp_path / "run" / "traces" / "engine"), "--out", str(tmp_path / "g")) != 0
    assert "weights_sha256" in capsys.readouterr().err


# ---------------------------------------------------------------- bench's checkpoint facts


def test_bench_reports_quantization_dtype_and_disk_size(checkpoints) -> None:  # noqa: ANN001
    from specparity.measure.bench import checkpoint_facts, describe_checkpoint
    from specparity.runners import load_model

    full = {}
    for c in (("bfloat16", "none", False), ("bfloat16", "q4g64", False), ("float16", "q8g32", True),
              ("float32", "mxfp4", False)):
        t = checkpoints(c)[0]
        full[c] = checkpoint_facts(t, load_model(str(t)).model)
        assert full[c]["disk_bytes"] == sum(p.stat().st_size for p in t.glob("*.safetensors"))
        assert full[c]["dtype"] == c[0], (c, full[c])  # not uint32 (packed) nor uint8 (mxfp4 scales)
    bf16, q4 = full[("bfloat16", "none", False)], full[("bfloat16", "q4g64", False)]
    assert bf16["quantization"] is None
    assert q4["quantization"] == {"bits": 4, "group_size": 64, "mode": "affine"}
    assert full[("float16", "q8g32", True)]["quantization"] == {"bits": 8, "group_size": 32, "mode": "affine"}
    assert full[("float32", "mxfp4", False)]["quantization"]["mode"] == "mxfp4"
    # the logical parameter count survives quantization (packed words are unpacked)
    assert {f["parameters"] for f in full.values()} == {bf16["parameters"]}
    assert q4["disk_bytes"] < bf16["disk_bytes"]
    assert "q4 g64 affine" in describe_checkpoint(q4) and "bfloat16" in describe_checkpoint(q4)


def test_bench_command_on_a_q4_pair(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    t, d, prompts = checkpoints(("bfloat16", "q4g64", False))
    assert cli_rc("bench", "--target", str(t), "--drafter", str(d), "--prompts-file", str(prompts),
                  "--prompts", "1", "--repeats", "1", "--max-tokens", "4", "--gamma", "2",
                  "--out", str(tmp_path)) == 0
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["dtype"] == "bfloat16"
    assert res["target_checkpoint"]["quantization"] == {"bits": 4, "group_size": 64, "mode": "affine"}
    assert "q4 g64 affine" in (tmp_path / "bench.md").read_text()
