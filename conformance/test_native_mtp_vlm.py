"""The ``native-mtp`` source on the Qwen ``mtp.*`` checkpoint vs mlx-vlm 0.7.10 (``tox -e vlm``).

mlx-vlm implements this family (``oracles/mlx_vlm_native_mtp.py``): its
``load_drafter`` reads the zoo ``qwen35-native`` checkpoint directly (splitter
registry), its ``Qwen3_5MTPDraftModel`` computes the reference draft logits on
the SAME inputs (the target's post-final-norm hidden rows, as mlx-vlm's verifier
hands them) — draft logits within ``BOUND`` (mlx-vlm's float32 floor as in
``test_mtp_references.py``; measured worst 6e-6) at every round-0 draft position,
greedy chained tokens identical; and its own round loop
(``oracles.mlx_vlm.run_mtp``: ``generate_step`` unmodified, mlx-vlm's native
qwen3_5 model, the drafter split by mlx-vlm's own splitter) is identical round for
round to the engine under the ``qwen`` family conventions (which are mlx-vlm's):
6 runs, 161 rounds with 13 all-accept and 11 partial-accept rounds and DeltaNet
rollbacks (measured 2026-12-01).
Planted convention bugs (pre/post-norm swapped, concat order, chain rows one
position late, a position-0 mask Qwen does not have) are each caught at a named
draft row. (A UNIFORM position shift is invisible: RoPE attention depends on
relative positions only, so ``position_base`` is observable only through the
position-0 mask or a shift between rows.)
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from conformance.conftest import require_oracle

BOUND = 1e-3
PROMPTS = ("nat-00", "nat-03", "rnd-00")
GAMMA = 3


def _rows(pid: str, plant: str | None = None) -> list[str]:
    """Round-0 draft rows of the engine vs mlx-vlm's drafter: one line per row beyond BOUND."""
    import mlx.core as mx

    import zoo
    from engine.executor import GenerationParams, spec_generate
    from engine.sources import make_provider
    from engine.sources import native_mtp as nm
    from engine.taps import capture_layers
    from oracles.mlx_vlm import draft_logits
    from specparity.runners import load_model
    from zoo.native_mtp import target_paths

    tpath, ckpt = target_paths("qwen35-native")
    target = load_model(str(tpath)).model
    provider = make_provider("native-mtp", path=ckpt)
    assert provider.header_params()["family"] == "qwen"
    if plant == "position":  # chain rows one position late (a uniform shift is invisible to RoPE)
        real_run = nm.NativeMTPSource._run

        def late(self, j, t, h, pos):
            return real_run(self, j, t, h, pos + (1 if pos > self._round_start else 0))
        mp = pytest.MonkeyPatch()
        mp.setattr(nm.NativeMTPSource, "_run", late)
    elif plant is not None:
        real_open = nm.NativeMTPProvider.open

        def open_(self, sampler, tv):  # the source reads another value than the one it records
            src = real_open(self, sampler, tv)
            src.conv = replace(src.conv, **{"hidden": {"hidden": "pre-norm"}, "concat": {"concat": "h;e"},
                                            "mask": {"mask_pos0": True}}[plant])
            return src
        provider.open = open_.__get__(provider)
    provider.logit_log = []
    ids = list(zoo.prompt(pid).token_ids)
    try:
        res = spec_generate(target, provider, ids, GenerationParams(max_tokens=GAMMA + 2, gamma=GAMMA))
    finally:
        if plant == "position":
            mp.undo()
    first = next(r for r in res.records if r["type"] == "plain")["emitted"][0]
    n = len(target.layers)
    with capture_layers(target, [n - 1]) as cap:
        mx.eval(target(mx.array(ids)[None]), cap)
    lm = target.language_model
    hidden = lm.model.norm(cap[n - 1][0])  # mlx-vlm's verifier: the post-final-norm hidden
    rows, chain = draft_logits(ckpt, lm.model.embed_tokens.weight, lm.lm_head.weight,
                               ids[1:] + [first], hidden, GAMMA - 1)
    ref = [rows[-1], *chain]
    eng = [v for _, _, v in provider.logit_log[:GAMMA]]
    bad = []
    for i, (a, b) in enumerate(zip(eng, ref, strict=True)):
        d = float(mx.max(mx.abs((a - mx.logsumexp(a)) - (b - mx.logsumexp(b)))).item())
        if d > BOUND or int(mx.argmax(a)) != int(mx.argmax(b)):
            bad.append(f"qwen35-native/{pid}: round 0, position {i}: |Δ log-prob| {d:.3g}, "
                       f"greedy {int(mx.argmax(a))} vs mlx-vlm {int(mx.argmax(b))}")
    return bad


@pytest.mark.oracle
@pytest.mark.parametrize("pid", PROMPTS)
def test_draft_logits_agree_with_mlx_vlm(pid: str) -> None:
    require_oracle("mlx_vlm_native_mtp")
    bad = _rows(pid)
    assert not bad, bad


@pytest.mark.oracle
@pytest.mark.parametrize("plant,first", [("hidden", 0), ("concat", 0), ("position", 1), ("mask", 0)])
def test_planted_convention_bug_is_caught_by_mlx_vlm(plant: str, first: int) -> None:
    require_oracle("mlx_vlm_native_mtp")
    bad = _rows("nat-00", plant)
    assert bad, f"planted {plant} went unnoticed"
    assert f": round 0, position {first}:" in bad[0], bad[0]


@pytest.fixture(scope="module")
def vlm_split(tmp_path_factory):
    require_oracle("mlx_vlm_native_mtp")
    from oracles.mlx_vlm_native_mtp import split
    from zoo.native_mtp import target_paths

    return split(target_paths("qwen35-native")[1], tmp_path_factory.mktemp("qwen35-native-split"))


@pytest.mark.oracle
@pytest.mark.parametrize("gamma", [1, 2])
@pytest.mark.parametrize("pid", ["nat-00", "nat-01", "rnd-00"])
def test_round_for_round_vs_mlx_vlm_loop(vlm_split, pid: str, gamma: int) -> None:
    require_oracle("mlx_vlm_native_mtp")
    import zoo
    from conformance.conftest import run_trace
    from oracles.mlx_vlm import load_target, run_mtp, version
    from specparity.cases.case import Case
    from traces.io import Trace
    from traces.reference import compare_with_reference

    case = Case("qwen35-native", "native", pid, gamma, 32, source="native-mtp")
    eng = run_trace("engine", case)
    header = dict(eng.records()[0])
    body, _ = run_mtp(zoo.model_dir("qwen35"), vlm_split, list(header["prompt"]["token_ids"]),
                      gamma=gamma, max_tokens=32, eos_ids=list(header["eos_ids"]),
                      model=load_target(zoo.model_dir("qwen35")))
    header["runner"] = {"name": "mlx_vlm_native_mtp", "package": "mlx-vlm", "version": version()}
    verdict = compare_with_reference(eng, Trace.from_records([header, *body]), "mlx_vlm")
    assert verdict.status == "identical", f"{case.case_id}: engine vs mlx-vlm\n{verdict.format()}"
