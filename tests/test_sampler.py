"""The step sampler's processor handling (engine/sampler.py) against mlx-lm 0.32.2.

History semantics mirror ``mlx_lm/generate.py`` ``speculative_generate_step``
``_step``: a verify window's row i sees the history, then the window's head,
then the target's own samples of rows 0..i-1; the draft lane's step j sees the
request history then drafts 0..j-1. Processors come from mlx-lm's
``make_logits_processors`` with the same keyword names.
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from engine.sampler import ProcessorParams, SamplerParams, StepSampler, margin_array

V = 16


def _recording(seen: list[list[int]]) -> StepSampler:
    def proc(tokens, logits):  # noqa: ANN001, ANN202
        seen.append([] if tokens is None else [int(t) for t in tokens.tolist()])
        return logits

    return StepSampler(make_sampler(temp=0.0), [proc])


def _rows(picks: list[int]) -> mx.array:
    """An ``[m, V]`` block whose greedy pick in row i is ``picks[i]``."""
    out = mx.zeros((len(picks), V))
    for i, t in enumerate(picks):
        out[i, t] = 5.0
    return out


def test_verify_rows_see_history_head_then_own_samples() -> None:
    seen: list[list[int]] = []
    s = _recording(seen)
    # window = [pending 9, drafts 4, 5]; the target samples 4, 6, 7 (second draft rejected)
    out = s.sample_window(_rows([4, 6, 7]), mx.array([1, 2], mx.uint32), [9, 4, 5])
    assert [int(t) for t in out.tolist()] == [4, 6, 7]
    assert seen == [[1, 2, 9], [1, 2, 9, 4], [1, 2, 9, 4, 6]]


def test_draft_lane_grows_with_drafts_and_resets() -> None:
    seen: list[list[int]] = []
    s = _recording(seen)
    with s.drafting(mx.array([1, 2, 9], mx.uint32)):
        s.sample_window(_rows([4]))
        s.sample_window(_rows([5]))
    assert seen == [[1, 2, 9], [1, 2, 9, 4]]
    seen.clear()
    s.sample_window(_rows([3]))  # outside the lane: no history
    assert seen == [[]]


def test_no_processors_is_one_sampler_call() -> None:
    calls: list[tuple[int, ...]] = []

    def sampler(logprobs):  # noqa: ANN001, ANN202
        calls.append(tuple(logprobs.shape))
        return mx.argmax(logprobs, axis=-1)

    s = StepSampler(sampler)
    with s.drafting(mx.array([1], mx.uint32)):
        s.sample_window(_rows([1, 2, 3]), None, [0, 1, 2])
    assert calls == [(3, V)]


@pytest.mark.parametrize("tag", ["rp1.5c4", "pp0.7c3", "fp0.5c5", "lb3=2,7=-1", "rp1.2c20+pp0.3c20+fp0.2c20+lb1=1"])
def test_processors_are_mlx_lms(tag: str) -> None:
    proc = ProcessorParams.parse(tag)
    assert proc.tag() == tag and ProcessorParams.parse(proc.tag()) == proc
    mine = StepSampler.from_params(SamplerParams(processors=proc))
    theirs = make_logits_processors(**proc.kwargs())
    logits = mx.random.normal((1, V), key=mx.random.key(3))
    hist = mx.array([1, 3, 3, 7, 2, 3], mx.uint32)
    expect = logits
    for p in theirs:
        expect = p(hist, expect)
    assert mx.array_equal(mine.process(hist, logits), expect)
    assert len(theirs) == len(mine._processors) == len(tag.split("+"))


def test_parse_and_validation_errors_are_one_line() -> None:
    for bad in ("xx1", "rp", "lb3", "rpx"):
        with pytest.raises(ValueError, match="bad logits-processor part"):
            ProcessorParams.parse(bad)
    with pytest.raises(ValueError, match="repetition_penalty"):
        ProcessorParams(repetition_penalty=-1.0)
    with pytest.raises(ValueError, match="context_size"):
        ProcessorParams(frequency_penalty=1.0, frequency_context_size=0)
    with pytest.raises(ValueError, match="history_prompt"):
        ProcessorParams(history_prompt="none")
    with pytest.raises(ValueError, match="distinct"):
        ProcessorParams(logit_bias=((1, 1.0), (1, 2.0)))


def test_logit_bias_outside_vocab_raises() -> None:
    s = StepSampler.from_params(SamplerParams(processors=ProcessorParams(logit_bias=((V, 1.0),))))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.sample_plain(mx.zeros((1, V)), mx.array([1], mx.uint32))


def test_inactive_processors_build_nothing() -> None:
    assert not ProcessorParams().active and ProcessorParams().tag() == ""
    assert not StepSampler.from_params(SamplerParams()).has_processors
    assert not ProcessorParams(repetition_penalty=0.0, history_prompt="last").active
    # the SamplerParams shorthand still builds mlx-lm's repetition penalty
    assert StepSampler.from_params(SamplerParams(repetition_penalty=1.2)).has_processors


# ---------------------------------------------------------------- compiled margins


def _margin_rows() -> list[mx.array]:
    """Blocks in the three logit dtypes with ties, NaN, +inf, -inf and knife-edge rows."""
    rng = np.random.default_rng(5)
    base = rng.normal(0, 4, size=(6, 1000)).astype(np.float32)
    base[1, [3, 700]] = 50.0  # a tie for the top
    base[2, 10] = np.nan
    base[3, 11] = np.inf
    base[4, :500] = -np.inf
    base[5, 42], base[5, 43] = 9.0, np.nextafter(np.float32(9.0), np.float32(0))  # one ulp apart
    return [mx.array(base).astype(dt) for dt in (mx.float32, mx.bfloat16, mx.float16)]


def _first_differing_row(a: mx.array, b: mx.array) -> int | None:
    na, nb = np.array(a), np.array(b)
    for i in range(na.shape[0]):
        if na[i].tobytes() != nb[i].tobytes():
            return i
    return None


@pytest.mark.skipif(mx.default_device() == mx.cpu and shutil.which("g++") is None,
                    reason="mx.compile on MLX's CPU needs a C++ compiler at run time")
def test_compiled_margins_are_the_same_bits() -> None:
    from engine.sampler import _margins, _margins_compiled

    for block in _margin_rows():
        x = block.astype(mx.float32)
        assert _first_differing_row(_margins(x), _margins_compiled(x)) is None, block.dtype
        # and the path margin_array takes on this device gives them too
        assert _first_differing_row(_margins(x), margin_array(block)) is None


def test_cpu_margins_are_the_same_bits() -> None:
    """The CPU's seven-op margins (``mx.topk``) are :func:`_margins`'s bits on every planted
    row (ties, NaN, +inf, -inf, one ulp, signed zeros, a two-wide vocabulary)."""
    from engine.sampler import _margins, _margins_top2

    zeros = mx.array([[0.0, -0.0, -1.0], [-0.0, 0.0, -1.0], [-0.0, -0.0, -2.0], [-np.inf] * 3,
                      [np.nan] * 3, [np.inf, np.inf, 0.0]], mx.float32)
    for block in [*_margin_rows(), zeros, mx.array([[1.0, 2.0], [2.0, 2.0]])]:
        x = block.astype(mx.float32)
        with mx.stream(mx.cpu):
            assert _first_differing_row(_margins(x), _margins_top2(x)) is None, (block.dtype, _margins(x),
                                                                                   _margins_top2(x))


def test_cpu_margins_see_a_planted_difference() -> None:
    """Not vacuous: a top-2 that took the max twice (no multiplicity) differs on the tie row."""
    from engine.sampler import _margins

    x = _margin_rows()[0]
    wrong = mx.max(x, axis=-1) - mx.max(mx.where(x == mx.max(x, axis=-1, keepdims=True), -mx.inf, x), axis=-1)
    assert _first_differing_row(_margins(x), mx.where(mx.isnan(wrong), mx.nan, wrong)) == 1


def test_margin_comparison_sees_a_one_ulp_change() -> None:
    from engine.sampler import _margins

    x = _margin_rows()[0]
    m = _margins(x)
    bumped = mx.array(np.nextafter(np.array(m), np.float32(np.inf)))
    assert _first_differing_row(m, mx.where(mx.arange(6) == 4, bumped, m)) == 4


def test_token_ids_reads_a_1d_array_without_a_new_lazy_array() -> None:
    """A reshape before the read would be evaluated behind the work queued since (plain
    decode's look-ahead forward): the host would wait for step t+1 to emit step t."""
    from engine.sampler import token_ids

    class OneD:
        ndim = 1

        def tolist(self) -> list[int]:
            return [3, 1, 4]

        def reshape(self, *shape: int) -> OneD:
            raise AssertionError("token_ids made a new lazy array to read a 1-D one")

    assert token_ids(OneD()) == [3, 1, 4]  # type: ignore[arg-type]
    assert token_ids(mx.array([[2, 7]], mx.uint32)) == [2, 7]
    assert token_ids(mx.array(5, mx.uint32)) == [5]
