"""Quantized KV: the engine vs mlx-lm 0.32.2 with ``kv_bits``, round for round, and spec vs plain.

mlx-lm ``speculative_generate_step`` / ``generate_step`` with ``kv_bits``,
``kv_group_size`` 32 and ``quantized_kv_start`` (``maybe_quantize_kv_cache``),
on the head_dim-32 llama pair of ``tests/kv_models.py`` (no zoo model's KV can
be quantized: head dim 16). With ``quantized_kv_start`` 0 (converted right after
the prefill in both) every round's feed, drafts, window, samples, k_accept,
emitted tokens and the target/drafter cache digests (``QuantizedKVCache``) must
be identical, and spec must equal plain. With the threshold inside the run,
mlx-lm converts on an offset that counts the window's drafts and its
speculative output leaves its own plain output: the known entry
``mlx-lm-kv-quantized-on-unverified-offset`` (the engine stays == plain). On a
sliding-window target mlx-lm cannot quantize (``RotatingKVCache`` NYI): known
refusal ``mlx-lm-quantized-kv-rotating-nyi``; the engine stops with one line.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from conformance.conftest import require_oracle, run_trace, witness
from specparity.cases.case import Case
from traces.diff import diff_traces
from traces.reference import ReferenceRefused, compare_with_reference, refusal_verdict

PROMPTS = {"p-ids": (0, 5, 9, 14, 22, 5, 9, 30, 31, 32, 33, 40), "p-short": (30, 31, 32, 33, 34)}
# The known entries this module probes (conformance/test_two_model_vs_mlx_lm.py probes the rest).
KV_PROBED = {"mlx-lm-kv-quantized-on-unverified-offset", "mlx-lm-quantized-kv-rotating-nyi"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests import kv_models

    return kv_models.build(tmp_path_factory.mktemp("kvmodels"))


def case(pair: tuple[Path, Path], prompt: str, gamma: int, bits: int, start: int, n: int = 32) -> Case:
    return Case("kvllama", "kvllama-twin", prompt, gamma, n, target_path=str(pair[0]),
                draft_path=str(pair[1]), prompt_tokens=PROMPTS[prompt], eos_ids=(1,),
                kv_bits=bits, kv_group_size=32, quantized_kv_start=start)


@pytest.mark.oracle
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gamma", [2, 3])
def test_round_for_round_and_spec_vs_plain(pair: tuple[Path, Path], prompt: str, bits: int, gamma: int) -> None:
    require_oracle("mlx_lm")
    c = case(pair, prompt, gamma, bits, 0)
    eng, ref = run_trace("engine", c), run_trace("mlx_lm", c)
    assert eng.rounds and eng.rounds[-1]["target_cache_digest"] is not None, c.case_id
    assert eng.header["params"]["kv_bits"] == bits and c.case_id.endswith(f"/kv{bits}g32s0")
    v = compare_with_reference(eng, ref, "mlx_lm", witness=witness())
    assert v.status == "identical" and v.detail == "round for round", f"{c.case_id}\n{v.format()}"
    plain = run_trace("engine", c.plain())
    assert diff_traces(eng, plain, level="tokens") is None, c.case_id
    pv = compare_with_reference(plain, run_trace("mlx_lm", c.plain()), "mlx_lm", witness=witness())
    assert pv.status == "identical", f"{c.plain().case_id}: engine plain vs generate_step\n{pv.format()}"


@pytest.mark.oracle
@pytest.mark.parametrize(("bits", "start", "gamma"), [(2, 16, 3), (2, 14, 2), (3, 20, 2)])
def test_mid_run_threshold_is_the_known_entry(pair: tuple[Path, Path], bits: int, start: int, gamma: int) -> None:
    """Converted mid-run: the engine == plain; mlx-lm's spec leaves its own plain output and the
    comparison names the known entry (rounds before the threshold round compared as usual)."""
    require_oracle("mlx_lm")
    c = replace(case(pair, "p-ids", gamma, bits, start, n=40), eos_ids=())
    eng, ref = run_trace("engine", c), run_trace("mlx_lm", c)
    assert diff_traces(eng, run_trace("engine", c.plain()), level="tokens") is None, c.case_id
    ref_plain = run_trace("mlx_lm", c.plain())
    assert diff_traces(ref, ref_plain, level="tokens") is not None, f"{c.case_id}: mlx-lm spec == plain now"
    v = compare_with_reference(eng, ref, "mlx_lm", witness=witness())
    assert v.status == "known" and v.known is not None, f"{c.case_id}\n{v.format()}"
    assert v.known.id == "mlx-lm-kv-quantized-on-unverified-offset"


@pytest.mark.oracle
def test_rotating_target_refused_by_both() -> None:
    require_oracle("mlx_lm")
    c = Case("gemma3", "twin", "nat-00", 3, 8, kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    with pytest.raises(ReferenceRefused) as refused:
        run_trace("mlx_lm", c)
    # the verdict names the target from the engine trace's case id; any gemma3 trace will do
    v = refusal_verdict(run_trace("engine", replace(c.plain(), kv_bits=None, kv_group_size=None,
                                                    quantized_kv_start=None)), refused.value)
    assert v.status == "refused" and v.known is not None and v.known.id == "mlx-lm-quantized-kv-rotating-nyi"
    with pytest.raises(ValueError, match=r"layer 0 \(RotatingKVCache\) cannot be quantized: RotatingKVCache "
                                         r"Quantization NYI"):
        run_trace("engine", c)



@pytest.mark.oracle
@pytest.mark.parametrize("target", ["llama-kv", "llama-kv64"])
def test_zoo_matrix_kv_cases(target: str) -> None:
    """The zoo matrix's two quantized-KV cases per pair (``specparity.jobs.run.zoo_cases``, the zoo's
    head-dim-32 and head-dim-64 pairs): identical round for round when converted after the
    prefill, the known entry when converted inside the run; spec == plain in both."""
    require_oracle("mlx_lm")
    from specparity.jobs.run import zoo_cases

    got = []
    for c in zoo_cases(targets=[target], n_prompts=1):
        eng = run_trace("engine", c)
        got.append(compare_with_reference(eng, run_trace("mlx_lm", c), "mlx_lm", witness=witness()))
        assert diff_traces(eng, run_trace("engine", c.plain()), level="tokens") is None, c.case_id
    assert got[0].status == "identical", got[0].format()
    assert got[1].known is not None and got[1].known.id == "mlx-lm-kv-quantized-on-unverified-offset", got[1].format()
