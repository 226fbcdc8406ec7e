"""The DeepSpec port's loader, quantized siblings and trace conventions (§4.3)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import zoo
from engine.dspark import deepspec_module as dsm
from specparity.runners import load_model
from zoo.dspark import artifact_dir


def test_config_requires_the_architecture_stamp(tmp_path: Path) -> None:
    dst = tmp_path / "d"
    shutil.copytree(artifact_dir("gemma4-deepspec"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["Gemma4ForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Gemma4DSparkModel"):
        dsm.load(dst)


def test_checkpoint_layout_matches_deepspec() -> None:
    import mlx.core as mx

    d = artifact_dir("gemma4-deepspec")
    w = mx.load(str(d / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for v in w.values())
    assert not any(k.startswith("model.") for k in w), "DeepSpec checkpoints carry no key prefix"
    assert "layers.0.self_attn.v_proj.weight" not in w, "K≡V: no v_proj"
    assert w["layers.0.self_attn.k_proj.weight"].shape == (32, 64), "one KV head × head_dim 32"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma4DSparkModel"] and cfg["attention_k_eq_v"] is True


@pytest.mark.parametrize(("bits", "min_agree"), [(8, 1.0), (4, 0.5)])
def test_quantized_siblings_load_and_track_bf16(bits: int, min_agree: float) -> None:
    from engine.executor import GenerationParams, spec_generate
    from engine.sources.deepspec import DeepSpecProvider

    q = dsm.load(artifact_dir(f"gemma4-deepspec-q{bits}"))
    assert isinstance(q.lm_head, __import__("mlx.nn").nn.QuantizedLinear)
    assert isinstance(q.embed_tokens, __import__("mlx.nn").nn.QuantizedEmbedding)
    assert not isinstance(q.confidence_head.proj, __import__("mlx.nn").nn.QuantizedLinear)
    assert dsm.weights_bytes(q) < dsm.weights_bytes(dsm.load(artifact_dir("gemma4-deepspec")))
    target = load_model(str(zoo.model_dir("gemma4"))).model
    agree = total = 0
    for pid in ("nat-03", "nat-09", "rnd-14"):
        ids = list(zoo.prompt(pid).token_ids)
        p = GenerationParams(max_tokens=14, gamma=4, prefill="full")
        a = spec_generate(target, DeepSpecProvider(artifact_dir("gemma4-deepspec")), ids, p)
        b = spec_generate(target, DeepSpecProvider(q), ids, p)
        assert a.output_ids == b.output_ids, "a drafter never changes what is emitted"
        ra = [r["drafts"] for r in a.records if r["type"] == "round"]
        rb = [r["drafts"] for r in b.records if r["type"] == "round"]
        agree += sum(x == y for x, y in zip(ra, rb, strict=False))
        total += max(len(ra), len(rb))
    assert agree / total >= min_agree, (bits, agree, total)


def test_validate_accepts_the_cut_position_confidence_only_below_threshold() -> None:
    from specparity.goldens.manifest import GOLDEN_DIR
    from traces.io import read_trace
    from traces.validate import validate_records

    g = read_trace(GOLDEN_DIR / "deepspec" / "gemma4__deepspec-t0.5__nat-03__g4__n14.jsonl")
    records = [g.header, *([g.prefill] if g.prefill else []), *g.events, g.footer]
    def check(recs: list) -> list:  # noqa: ANN001
        return validate_records(list(enumerate(recs, start=1)))

    assert not check(records)
    cut = next(i for i, r in enumerate(records) if r.get("type") == "round"
               and len(r["confidence"]) == len(r["drafts"]) + 1)
    # Each plant is refused AT the planted record (its line, a confidence field), then the message.
    line = cut + 1
    bad = [dict(r) for r in records]
    bad[cut] = {**bad[cut], "confidence": [*bad[cut]["confidence"][:-1], 0.9]}
    errs = check(bad)
    assert [(e.line, e.field.startswith("round.confidence")) for e in errs] == [(line, True)], errs
    assert "not below the threshold" in errs[0].message
    bad0 = [dict(r) for r in records]
    bad0[0] = {**bad0[0], "params": {**bad0[0]["params"], "confidence_threshold": 0.0}}
    errs = check(bad0)
    assert errs and all(e.field.startswith("round.confidence") for e in errs), errs
    assert any(e.line == line and "no positive params.confidence_threshold" in e.message for e in errs)
    bad2 = [dict(r) for r in records]
    bad2[cut] = {**bad2[cut], "confidence": [*bad2[cut]["confidence"], 0.1]}
    errs = check(bad2)
    assert [(e.line, e.field.startswith("round.confidence")) for e in errs] == [(line, True)], errs
    assert "at most one per draft plus the cut" in errs[0].message


@pytest.mark.parametrize(("source", "art", "thr"), [("deepspec", "gemma4-deepspec", "0.5"), ("dspark", "gemma4-dspark", "0")])
def test_generate_cli_runs_the_block_drafters(tmp_path: Path, source: str, art: str, thr: str) -> None:
    from specparity.cli import main
    from traces.io import read_trace
    from traces.validate import validate_file

    trace = tmp_path / "t.jsonl"
    rc = main(["generate", "--target", str(zoo.model_dir("gemma4")), "--draft", str(artifact_dir(art)),
               "--source", source, "--prompt-ids", ",".join(map(str, zoo.prompt("nat-03").token_ids)),
               "-n", "12", "--confidence-threshold", thr, "--trace", str(trace)])
    assert rc == 0 and not validate_file(trace)
    t = read_trace(trace)
    assert t.header["params"]["gamma"] == 4 and t.header["params"]["prefill"] == "full"
    assert t.header["params"]["confidence_threshold"] == float(thr)
    assert any(r["type"] == "round" and r["k_accept"] for r in t.events)
