"""The ``native-mtp`` source (§3 "GLM native" row) on the zoo checkpoints carrying MTP layers.

Targets (``zoo/native_mtp.py``): ``glm-mtp`` (glm4_moe, one MTP layer as
``model.layers.{N}``), ``deepseek-mtp`` (deepseek_v3 MLA, two MTP layers,
chained) and ``qwen35-native`` (qwen3_5 with ``mtp.*``, DeltaNet rollbacks). Losslessness (§2.1): greedy speculation is token-identical to plain
greedy decode (full prefill) at γ 1–4 on tie-free prompts, under the family's
conventions and under every non-default convention value; at temperature > 0
every round is the exact-match walk over the target's own samples (emitted =
samples[:k+1], drafts[:k] = samples[:k], a rejected draft differs from the
sample at its row) and a seed reproduces its trace. The loader check: plain
decode never reads the MTP tensors, and stock mlx-lm misloads the DeepSeek
layout (so the zoo's plain reference is a checkpoint without them).
"""

from __future__ import annotations

import pytest

from engine.executor import GenerationParams, plain_generate, spec_generate
from engine.sampler import SamplerParams

TARGETS = ("glm-mtp", "deepseek-mtp", "qwen35-native")
PROMPTS = ("nat-00", "rnd-00", "nat-01")
TIE_EPS = 1e-3
VARIANTS = ("hidden=pre-norm", "concat=h;e", "position_base=1", "mask_pos0=false",
            "depth=chain", "depth=reuse", "chain_hidden=pre-norm", "trim=rebuild")


@pytest.fixture(scope="module")
def models():
    from specparity.runners import load_model
    from zoo.native_mtp import target_paths

    out = {}
    for t in TARGETS:
        tpath, cpath = target_paths(t)
        out[t] = (load_model(str(tpath)).model, cpath)
    return out


def _ids(pid: str) -> list[int]:
    import zoo

    return list(zoo.prompt(pid).token_ids)


def _provider(cpath, conventions=None):
    from engine.sources import make_provider

    return make_provider("native-mtp", path=cpath, conventions=conventions)


_PLAIN: dict[tuple[int, str, int], object] = {}


def _plain(model, pid: str, n: int = 24):
    """Plain greedy decode of ``pid`` (deterministic): run once per model and prompt, shared by
    every γ and convention compared with it."""
    key = (id(model), pid, n)
    if key not in _PLAIN:
        _PLAIN[key] = plain_generate(model, _ids(pid), GenerationParams(max_tokens=n, prefill="full"))
    return _PLAIN[key]


def _tie_free(res) -> bool:
    return min(r["margin"] for r in res.records if r["type"] == "plain") > TIE_EPS


@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
@pytest.mark.parametrize("target", TARGETS)
def test_native_mtp_greedy_identical_to_plain(models, target: str, gamma: int) -> None:
    model, cpath = models[target]
    provider = _provider(cpath)
    for pid in PROMPTS:
        plain = _plain(model, pid)
        assert _tie_free(plain), f"{target}/{pid}: prompt not tie-free"
        spec = spec_generate(model, provider, _ids(pid), GenerationParams(max_tokens=24, gamma=gamma))
        assert spec.output_ids == plain.output_ids, (
            f"{target}/native-mtp/{pid}/g{gamma}: spec {spec.output_ids} != plain {plain.output_ids}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_convention_is_lossless(models, variant: str) -> None:
    for target in TARGETS:
        model, cpath = models[target]
        provider = _provider(cpath, variant)
        for pid in PROMPTS[:2]:
            plain = _plain(model, pid)
            spec = spec_generate(model, provider, _ids(pid), GenerationParams(max_tokens=24, gamma=3))
            assert spec.output_ids == plain.output_ids, f"{target}/{pid}/{variant}: spec != plain"


def _timeless(records) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time_s"} for r in records]


def _walk_errors(records) -> list[str]:
    errs = []
    for i, r in enumerate(x for x in records if x["type"] == "round"):
        d, k, s, e = r["drafts"], r["k_accept"], r["samples"], r["emitted"]
        if d[:k] != s[:k] or (k < len(d) and d[k] == s[k]) or e != s[: len(e)] or len(e) > k + 1:
            errs.append(f"round {i}: drafts {d} samples {s} k {k} emitted {e}")
    return errs


@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
@pytest.mark.parametrize("target", TARGETS)
def test_native_mtp_sampled_is_the_targets_samples(models, target: str, gamma: int) -> None:
    model, cpath = models[target]
    provider = _provider(cpath)
    params = GenerationParams(max_tokens=24, gamma=gamma, sampler=SamplerParams(temperature=0.8), seed=5)
    a = spec_generate(model, provider, _ids("nat-00"), params)
    b = spec_generate(model, provider, _ids("nat-00"), params)
    assert _timeless(a.records) == _timeless(b.records), f"{target}/g{gamma}: the same seed gave another trace"
    assert not _walk_errors(a.records), f"{target}/g{gamma}: {_walk_errors(a.records)[:2]}"
    assert a.usage.generation_tokens == 24


def test_walk_check_catches_a_planted_emission() -> None:
    rec = [{"type": "round", "drafts": [3, 4], "samples": [3, 5, 9], "k_accept": 1, "emitted": [3, 4]}]
    assert _walk_errors(rec) == ["round 0: drafts [3, 4] samples [3, 5, 9] k 1 emitted [3, 4]"]


def test_accept_paths_and_both_depths_are_exercised(models) -> None:
    seen: dict[str, set[str]] = {t: set() for t in TARGETS}
    for target in TARGETS:
        model, cpath = models[target]
        for gamma in (1, 2, 3):
            for pid in PROMPTS:
                res = spec_generate(model, _provider(cpath), _ids(pid),
                                    GenerationParams(max_tokens=24, gamma=gamma))
                for r in (r for r in res.records if r["type"] == "round"):
                    d, k = len(r["drafts"]), r["k_accept"]
                    seen[target].add("all" if k == d else ("zero" if k == 0 else "partial"))
    assert all(s == {"all", "zero", "partial"} for s in seen.values()), seen
    _, ds = models["deepseek-mtp"]
    assert _provider(ds).conventions.depth == "chain" and len(_provider(ds).head.blocks) == 2


# --------------------------------------------------------------------- loader


def test_plain_reference_weights_are_the_checkpoint_without_mtp(models) -> None:
    """The model plain decode runs holds exactly the checkpoint's trunk tensors."""
    import mlx.core as mx

    from engine.models import parameters
    from engine.sources.native_mtp import read_layout
    from zoo.native_mtp import target_paths

    for target in TARGETS:
        model, cpath = models[target]
        ckpt = dict(mx.load(str(cpath / "model.safetensors")))
        _, _, mtp = read_layout(cpath)
        trunk = {k: v for k, v in ckpt.items() if k not in mtp}
        loaded = parameters(model)
        assert set(loaded) == set(trunk), f"{target}: {sorted(set(loaded) ^ set(trunk))[:4]}"
        bad = [k for k in trunk if not mx.array_equal(loaded[k], trunk[k]).item()]
        assert not bad, f"{target}: plain reference tensors differ from the checkpoint: {bad[:3]}"
        plain = "deepseek-mtp-plain" if target == "deepseek-mtp" else target
        assert target_paths(target)[0].name.startswith(f"native-{plain}-")


def test_stock_mlx_lm_misloads_the_deepseek_layout() -> None:
    """mlx-lm 0.32.2 deepseek_v3 ``sanitize`` drops only ``model.layers.61``: the strict load
    of a checkpoint carrying ``model.layers.{N}`` fails, so plain decode reads ``-plain``."""
    from mlx_lm.utils import load_model

    from zoo.native_mtp import model_dir

    with pytest.raises(ValueError, match=r"model\.layers\.2\."):
        load_model(model_dir("deepseek-mtp"))
    load_model(model_dir("deepseek-mtp-plain"))  # the stripped checkpoint loads


def test_glm_and_qwen_layouts_are_dropped_by_stock_sanitize(models) -> None:
    from mlx_lm.utils import load_model

    from engine.models import parameters
    from zoo.native_mtp import model_dir

    model = load_model(model_dir("glm-mtp"))[0]
    assert not any(k.startswith("model.layers.2.") for k in parameters(model))
    model = load_model(model_dir("qwen35-native"))[0]
    assert not any("mtp" in k for k in parameters(model))


def test_detect_and_layout() -> None:
    from engine.sources.detect import detect_kind
    from engine.sources.native_mtp import read_layout
    from zoo.native_mtp import model_dir

    assert detect_kind(model_dir("glm-mtp")) == "native-mtp"
    assert detect_kind(model_dir("deepseek-mtp")) == "native-mtp"
    assert detect_kind(model_dir("deepseek-mtp-plain")) == "two-model"
    assert read_layout(model_dir("deepseek-mtp"))[:2] == ("layers", 2)
    assert read_layout(model_dir("qwen35-native"))[:2] == ("mtp", 1)
    assert detect_kind(model_dir("qwen35-native")) == "native-mtp"


def test_bad_convention_is_refused_in_one_line() -> None:
    from engine.sources.native_mtp import Conventions

    with pytest.raises(ValueError, match="convention hidden='mid'"):
        Conventions.parse("hidden=mid")
    with pytest.raises(ValueError, match="unknown convention 'concat_order'"):
        Conventions.parse("concat_order=h;e")
    assert Conventions.parse("position_base=1,mask_pos0=false").position_base == 1


# ----------------------------------------------------------- run matrix, header


def test_zoo_matrix_has_native_cases_for_two_conventions() -> None:
    from specparity.jobs.run import zoo_cases

    cases = zoo_cases(targets=["glm-mtp", "deepseek-mtp"], n_prompts=2, gammas=(1, 3))
    assert {(c.target, c.drafter, c.source) for c in cases} == {
        ("glm-mtp", "native", "native-mtp"), ("deepseek-mtp", "native", "native-mtp"),
        ("glm-mtp", "native-qwen", "native-mtp")}
    assert not [c for c in zoo_cases(targets=["llama"], n_prompts=2) if c.source == "native-mtp"]


@pytest.mark.parametrize("target,drafter,want", [
    ("deepseek-mtp", "native", {"family": "deepseek", "depth": "chain", "depth_layers": 2,
                                "chain_hidden": "pre-norm", "mask_pos0": True}),
    ("glm-mtp", "native-qwen", {"family": "glm", "depth": "reuse", "mask_pos0": False}),
])
def test_header_records_every_convention(target: str, drafter: str, want: dict) -> None:
    from engine.sources.native_mtp import Conventions
    from specparity.cases.case import Case
    from specparity.runners import run_case

    recs = run_case("engine", Case(target, drafter, "nat-00", 2, 8, source="native-mtp"))
    conv = recs[0]["params"]["mtp_conventions"]
    assert set(Conventions().to_json()) <= set(conv), conv
    assert {k: conv[k] for k in want} == want
    assert recs[0]["params"]["prefill"] == "full"
    assert any(r["type"] == "round" for r in recs)


# ---------------------------------------------------------------- command line


def test_cli_records_and_grades_the_conventions(tmp_path, capsys) -> None:
    """generate detects the source; record --mtp-conventions records them; grade re-runs them;
    a bad value or the flag on another source is refused in one line (exit 2)."""
    import json

    from specparity.cli import main
    from zoo.native_mtp import model_dir

    ck = str(model_dir("glm-mtp"))
    assert main(["generate", "--target", ck, "--draft", ck, "-n", "6", "--prompt-ids", "5,6,7"]) == 0
    assert "source native-mtp" in capsys.readouterr().err
    out = tmp_path / "rec"
    assert main(["record", "--runner", "engine", "--target", ck, "--draft", ck, "--source", "native-mtp",
                 "-n", "8", "--prompt-ids", "5,6,7,8", "--mtp-conventions", "hidden=pre-norm,trim=rebuild",
                 "--out", str(out)]) == 0
    (trace,) = (out / "engine").glob("*.jsonl")
    conv = json.loads(trace.read_text().splitlines()[0])["params"]["mtp_conventions"]
    assert (conv["hidden"], conv["trim"], conv["family"]) == ("pre-norm", "rebuild", "glm")
    assert main(["grade", str(out), "--out", str(tmp_path / "grade")]) == 0
    capsys.readouterr()
    assert main(["record", "--runner", "engine", "--target", ck, "--draft", ck, "--source", "native-mtp",
                 "-n", "4", "--prompt-ids", "5,6", "--mtp-conventions", "depth=deep",
                 "--out", str(tmp_path / "bad")]) == 2
    assert "convention depth='deep'" in capsys.readouterr().err
    assert main(["generate", "--target", ck, "--source", "ngram", "-n", "4", "--prompt-ids", "5,6",
                 "--mtp-conventions", "hidden=pre-norm"]) == 2
    assert "applies to the native-mtp source" in capsys.readouterr().err
