"""A backend's missing op is one case's verdict, never the end of the run (issue 31).

``engine/backend.py`` recognises MLX's own "no kernel / no implementation" errors (the
strings below are MLX's, from the throw sites its docstring names) and nothing else; the
CPU test double (``SPECPARITY_EMULATE_MISSING_OP=quantized_matmul``) makes MLX's quantized
matmul raise MLX 0.32.4 CUDA's exact error where that backend has no kernel (the head-dim-32
``llama-kv`` pair's quantized attention), so the CPU proves: the run goes on, those cases read
``unsupported on Device(cpu, 0): quantized_matmul``, the summary lists them, the headline is
never a bare CONFORMS, the head-dim-64 pair ``llama-kv64`` still runs quantized KV, and a
genuine error of ours is still a crash, not ``unsupported``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from engine.backend import (
    EMULATE_ENV,
    cuda_qmm_error,
    emulate_cuda_quantized_matmul,
    missing_op,
    unsupported_text,
    unsupported_verdict,
)

# (exception type MLX raises it as, MLX's message, the op) -- each from an MLX 0.32 throw site
MLX_MISSING = [
    pytest.param(RuntimeError, '[quantized_matmul] No implementation for problem shape: 1x28x32x2, transpose: '
                 'true, activation: float32, bits: 4, group size: 32, mode: "affine".', "quantized_matmul",
                 id="cuda/quantized/quantized.cpp"),
    pytest.param(RuntimeError, "[quantized_matmul] No implementation for problem shape: 1x28x32x2, transpose: "
                 "true, activation: float32, bits: 4, group size: 32", "quantized_matmul",
                 id="as-quoted-in-issue-31"),
    pytest.param(RuntimeError, '[gather_qmm] No implementation for problem shape: 4x64x32x8, transpose: true, '
                 'activation: bfloat16, bits: 4, group size: 32, mode: "affine".', "gather_qmm",
                 id="cuda/quantized/quantized.cpp-gather"),
    pytest.param(RuntimeError, "QRF has no CUDA implementation.", "QRF", id="cuda/primitives.cpp"),
    pytest.param(RuntimeError, "Eigh has no GPU implementation.", "Eigh", id="no_gpu/primitives.cpp"),
    pytest.param(RuntimeError, "Inverse has no CPU implementation.", "Inverse", id="no_cpu/primitives.cpp"),
    pytest.param(RuntimeError, "[AllReduce::eval_gpu] has no GPU implementation.", "AllReduce",
                 id="metal/distributed.cpp"),
    pytest.param(RuntimeError, "[QRF::eval_gpu] Metal QR factorization NYI.", "QRF", id="metal/primitives.cpp"),
    pytest.param(RuntimeError, "[Load::eval_gpu] Not implemented.", "Load", id="metal/primitives.cpp-load"),
    pytest.param(RuntimeError, "[RandomBits::eval_gpu] Large size unsupported", "RandomBits", id="cuda/random.cu"),
    pytest.param(RuntimeError, "[QQMatmul::eval_gpu] QQMM is only supported with CUDA 12.8 or higher.",
                 "QQMatmul", id="cuda/quantized/no_qqmm_impl.cpp"),
    pytest.param(RuntimeError, "[QQMatmul] NYI for the general case", "QQMatmul", id="cpu/quantized.cpp"),
    pytest.param(RuntimeError, "[quantized_matmul] Group size 16 is not supported.", "quantized_matmul",
                 id="cuda/quantized/qmm/qmv.cu"),
    pytest.param(ValueError, "[quantized_matmul] 3-bit quantization is not supported.", "quantized_matmul",
                 id="cuda/quantized/qmm/qmm_utils.h"),
    pytest.param(ValueError, "[quantized_matmul] Unsupported dtype: float64.", "quantized_matmul",
                 id="cuda/quantized/qmm/qmm_utils.h-dtype"),
    pytest.param(ValueError, "[linalg::qr] This op is not yet supported on the GPU. Explicitly pass a CPU "
                 "stream to run it.", "linalg::qr", id="linalg.cpp"),
    pytest.param(RuntimeError, "[FFT] GPU FFT is not supported for size 7919, the largest supported size is "
                 "16777216. Run the FFT on the CPU stream instead.", "FFT", id="metal/fft.cpp"),
    pytest.param(RuntimeError, "[FFT] Unsupported cuFFT input transform type.", "FFT", id="cuda/fft.cu"),
]


@pytest.mark.parametrize(("kind", "message", "op"), MLX_MISSING)
def test_mlx_missing_op_messages_are_recognised(kind: type[Exception], message: str, op: str) -> None:
    m = missing_op(kind(message))
    assert m is not None and m.op == op and m.line == message, (message, m)
    assert m.verdict("Device(gpu, 0)") == f"unsupported on Device(gpu, 0): {op}"


class EngineBug(RuntimeError):
    """An error our own code raises (a RuntimeError subclass)."""


def _raised_by_mlx(fn: Any) -> BaseException:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the exception is the value under test
        return exc
    raise AssertionError("expected MLX to raise")


def test_genuine_errors_are_not_missing_ops() -> None:
    """A shape error, a ValueError of ours, MLX's op-level argument checks (the same on every
    backend), a subclass we raise, a transform's NYI: none is ``unsupported``."""
    genuine: list[BaseException] = [
        ValueError("engine: verify window of 4 rows but 3 drafts (round 2)"),
        ValueError("[quantized_matmul] No implementation for problem shape: 1x2"),  # not MLX's type for it
        RuntimeError("target cache offset 31 != committed 32 after round 4"),
        EngineBug("[quantized_matmul] No implementation for problem shape: 1x28x32x2"),  # ours, not MLX's
        NotImplementedError("RotatingKVCache Quantization NYI"),
        RuntimeError("[Primitive::vjp] Not implemented for Foo"),
        RuntimeError("[scatter] JVP not yet implemented"),
        RuntimeError("[uniform] Unsupported type."),
        ValueError("[quantize] The requested group size 16 is not supported. The supported group sizes "
                   "are 32, 64, and 128."),
        # raised by MLX itself, here on the CPU
        _raised_by_mlx(lambda: mx.eval(mx.ones((4, 4)) @ mx.ones((3, 3)))),
        _raised_by_mlx(lambda: mx.quantize(mx.ones((4, 4)), group_size=16)),
        _raised_by_mlx(lambda: mx.quantize(mx.ones((2, 64)), group_size=64, bits=7)),
        _raised_by_mlx(lambda: mx.reshape(mx.ones((3,)), (2, 2))),
    ]
    for exc in genuine:
        assert missing_op(exc) is None, (type(exc).__name__, str(exc))
        assert unsupported_text(exc, "request 0") is None


def test_a_refusal_raised_from_a_missing_op_is_looked_through() -> None:
    from traces.reference import ReferenceRefused

    cause = RuntimeError("QRF has no CUDA implementation.")
    try:
        try:
            raise cause
        except RuntimeError as exc:
            raise ReferenceRefused("mlx_lm", "c", str(exc)) from exc
    except ReferenceRefused as refused:
        m = missing_op(refused)
    assert m is not None and m.op == "QRF"
    assert missing_op(ReferenceRefused("mlx_lm", "c", "QRF has no CUDA implementation.")) is None  # no cause


def test_session_text_carries_the_verdict_and_the_line() -> None:
    text = unsupported_text(RuntimeError("QRF has no CUDA implementation."), "request 2 (follow-up)")
    assert text == ("unsupported on Device(cpu, 0): QRF — request 2 (follow-up): QRF has no CUDA "
                    "implementation."), text
    assert unsupported_verdict(text) == "unsupported on Device(cpu, 0): QRF"
    assert unsupported_verdict("request 0 (fresh): PromptCacheError: stale") is None


def _qkv(head_dim: int, n_heads: int = 2, n_kv: int = 1, keys: int = 28, window: int = 1) -> tuple[Any, ...]:
    """mlx-lm's quantized attention operands (``quantized_scaled_dot_product_attention``)."""
    k = mx.quantize(mx.ones((1, n_kv, keys, head_dim)), group_size=32, bits=4)
    q = mx.ones((1, n_kv, n_heads // n_kv, window, head_dim))
    return (q, *(mx.expand_dims(a, -3) for a in k))


def test_the_double_raises_mlx_cudas_exact_error_where_cuda_has_no_kernel() -> None:
    """Issue 31's H200 error, to the character (MLX 0.32.4 adds the mode), for the zoo's head-dim-32
    pair; the head-dim-64 pair and a 2-D quantized weight get no error."""
    err = cuda_qmm_error(*_qkv(32), transpose=True, group_size=32, bits=4)
    assert str(err) == ('[quantized_matmul] No implementation for problem shape: 1x28x32x2, transpose: true, '
                        'activation: float32, bits: 4, group size: 32, mode: "affine".'), err
    assert cuda_qmm_error(*_qkv(32, window=4, keys=32), transpose=True, group_size=32, bits=4) is not None
    assert cuda_qmm_error(*_qkv(64, window=4), transpose=True, group_size=32, bits=4) is None
    w = mx.quantize(mx.ones((16, 32)), group_size=32, bits=4)
    assert cuda_qmm_error(mx.ones((1, 32)), *w, transpose=True, group_size=32, bits=4) is None


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SPECPARITY_EMULATE_MISSING_OP=quantized_matmul`` for this test; ``mx.quantized_matmul``
    restored afterwards (the double patches it in this process)."""
    monkeypatch.setattr(mx, "quantized_matmul", mx.quantized_matmul)
    monkeypatch.setenv(EMULATE_ENV, "quantized_matmul")


KV_FLAGS = ["--drafters", "twin", "--prompts", "1", "--gammas", "3", "--max-tokens", "8",
            "--runners", "mlx_lm", "--quiet"]


def test_run_goes_on_and_names_the_unsupported_cases(
        tmp_path: Path, emulated: None, capsys: pytest.CaptureFixture[str]) -> None:
    """The zoo's two quantized-KV pairs on the emulated CUDA backend, through the process pool
    (the verdict travels as a value; the worker inherits the double): the head-dim-32 cases
    are unsupported, the head-dim-64 ones conform, exit 0, never a bare CONFORMS."""
    from specparity.cli import main

    out = tmp_path / "run"
    rc = main(["run", "--targets", "llama-kv,llama-kv64", *KV_FLAGS, "--workers", "1", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    verdict = "unsupported on Device(cpu, 0): quantized_matmul"
    assert "**CONFORMS (2 cases unsupported on Device(cpu, 0))**" in text, text
    assert "**CONFORMS**" not in text
    section = text.split("## Unsupported on this backend", 1)[1].split("\n## ", 1)[0]
    for case_id in ("llama-kv/twin/nat-00/g3/n8/kv4g32s0", "llama-kv/plain/nat-00/n8/kv4g32s0"):
        for runner in ("engine", "mlx\\_lm"):
            assert f"- `{case_id}` ({runner}): `{verdict}` — `[quantized_matmul] No implementation for problem " \
                   "shape: 1x28x32x2" in section, section
    comps = json.loads((out / "comparisons.json").read_text())
    by = {(c["kind"], c["case_id"]): c for c in comps}
    for kind in ("engine-vs-mlx_lm", "spec-vs-plain"):
        c = by[(kind, "llama-kv/twin/nat-00/g3/n8/kv4g32s0")]
        assert c["verdict"] == verdict and not c["fails"] and c["divergence"] is None, c
        assert c["unsupported"]["op"] == "quantized_matmul" and c["unsupported"]["runners"][0] == "engine", c
        assert "No implementation for problem shape" in c["message"], c
        # the head-dim-64 pair still exercises quantized KV, compared, identical
        assert by[(kind, "llama-kv64/twin/nat-00/g3/n8/kv4g32s0")]["verdict"] == "identical"
    assert by[("engine-vs-mlx_lm", "llama-kv/plain/nat-00/n8/kv4g32s0")]["verdict"] == verdict
    assert not (out / "traces" / "engine" / "llama-kv__twin__nat-00__g3__n8__kv4g32s0.jsonl").exists()
    # the s36 case converts after 36 positions: never reached in 8 tokens, so it runs
    assert not any(c["case_id"].endswith("kv4g32s36") and "unsupported" in c for c in comps)
    report = (out / "report.md").read_text()
    assert "**CONFORMS (2 cases unsupported on Device(cpu, 0))**" in report, report[:400]
    assert "## Unsupported on this backend" in report


def test_every_case_unsupported_is_nothing_compared(
        tmp_path: Path, emulated: None, capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cli import main

    out = tmp_path / "run"
    rc = main(["run", "--targets", "llama-kv", *KV_FLAGS, "--kv-bits", "4", "--kv-group-size", "32",
               "--quantized-kv-start", "0", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 1, text
    assert "**NOTHING COMPARED (every comparison unsupported on this backend: 2 cases unsupported on " \
           "Device(cpu, 0))**" in text, text
    assert "CONFORMS" not in text
    report = (out / "report.md").read_text()
    assert report.count("NOTHING COMPARED") == 1 and "— no traces; 3 comparisons." in report, report[:300]


def test_a_genuine_error_of_ours_still_stops_the_run(
        tmp_path: Path, emulated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a ValueError from our cache code on the quantized-KV cases. Not ``unsupported``:
    the run stops and says INCOMPLETE, as any crash does."""
    from engine import caches
    from specparity.jobs.run import run, zoo_cases

    def broken(*_a: Any, **_k: Any) -> bool:
        raise ValueError("quantize_kv: cache offset 28 != committed 27 (planted)")

    monkeypatch.setattr(caches, "quantize_kv", broken)
    cases = [c for c in zoo_cases(targets=["llama-kv64"], drafters=["twin"], gammas=(3,), n_prompts=1,
                                  max_tokens=8) if c.quantized_kv_start == 0]
    with pytest.raises(ValueError, match="planted"):
        run(tmp_path / "run", cases=cases, runners=[], progress=False)
    assert "**INCOMPLETE**" in (tmp_path / "run" / "summary.md").read_text()


def test_a_session_on_a_missing_op_reads_unsupported(
        tmp_path: Path, emulated: None, capsys: pytest.CaptureFixture[str]) -> None:
    """``run --sessions``: the head-dim-32 pair's session is ``unsupported on Device(cpu, 0):
    quantized_matmul`` (not DIVERGENT), the head-dim-64 pair's is warm ≡ cold, exit 0."""
    from specparity.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "token_ids": ids}) + "\n" for i, ids in (
        ("a", [3, 17, 40, 41, 99, 12, 7, 8, 200, 201, 33, 34]), ("b", [5, 6, 9, 120, 121, 122, 130]))))
    suite = tmp_path / "s.toml"
    suite.write_text(f'sessions = ["continue"]\ngammas = [3]\nmax_tokens = 5\nprompts_file = "{prompts.name}"\n'
                     "kv_bits = 4\nkv_group_size = 32\nquantized_kv_start = 0\n"
                     '[[pair]]\ntarget = "llama-kv"\ndrafter = "twin"\n'
                     '[[pair]]\ntarget = "llama-kv64"\ndrafter = "twin"\n')
    rc = main(["run", "--suite", str(suite), "--out", str(tmp_path / "o"), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0, text
    table = text.split("## Reference")[0]
    row32 = next(line for line in table.splitlines() if line.startswith("| llama-kv/"))
    row64 = next(line for line in table.splitlines() if line.startswith("| llama-kv64/"))
    assert "| unsupported on Device(cpu, 0): quantized_matmul |" in row32, row32
    assert "No implementation for problem shape" in row32 and "DIVERGENT" not in table, table
    assert "| warm ≡ cold |" in row64, row64


def test_the_double_is_undone_and_idempotent() -> None:
    real = mx.quantized_matmul
    undo = emulate_cuda_quantized_matmul()
    try:
        assert mx.quantized_matmul is not real
        emulate_cuda_quantized_matmul()()  # a second install is a no-op whose undo does nothing
        assert getattr(mx.quantized_matmul, "_specparity_emulated", False)
        with pytest.raises(RuntimeError, match=r"^\[quantized_matmul\] No implementation"):
            mx.quantized_matmul(*_qkv(32), transpose=True, group_size=32, bits=4)
    finally:
        undo()
    assert mx.quantized_matmul is real


def test_grade_reads_an_unsupported_rerun_as_unsupported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Traces recorded where the op exists, graded on a backend without it: the re-runs (plain
    decode, mlx-lm) are ``unsupported``, never a crash; with nothing compared, not CONFORMS."""
    from specparity.grading.trace_folders import grade
    from specparity.jobs.run import run_cases, zoo_cases

    cases = [c for c in zoo_cases(targets=["llama-kv"], drafters=["twin"], gammas=(3,), n_prompts=1,
                                  max_tokens=8) if c.quantized_kv_start == 0]
    run_cases(tmp_path / "rec", cases=cases, runners=[], progress=False)
    monkeypatch.setattr(mx, "quantized_matmul", mx.quantized_matmul)
    emulate_cuda_quantized_matmul()
    g = grade(tmp_path / "rec" / "traces" / "engine", tmp_path / "g", runners=["mlx_lm"], progress=False)
    verdict = "unsupported on Device(cpu, 0): quantized_matmul"
    assert {c.verdict for c in g.comparisons} == {verdict}, [c.verdict for c in g.comparisons]
    assert {c.kind for c in g.comparisons} == {"engine-vs-mlx_lm", "spec-vs-plain"}
    assert not g.ok and "**NOTHING COMPARED" in (tmp_path / "g" / "summary.md").read_text()


def test_a_run_no_comparison_needs_is_still_listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled case's plain baseline is compared with nothing; its missing op still reads as an
    ``engine run`` entry, listed in the summary (never dropped)."""
    import specparity.jobs.run as run_mod
    from specparity.cases.case import Case

    real = run_mod.run_case

    def fake(runner: str, case: Any) -> Any:
        if case.drafter is None:
            raise RuntimeError("Eigh has no GPU implementation.")
        return real(runner, case)

    monkeypatch.setattr(run_mod, "run_case", fake)
    spec = Case("llama", "twin", "nat-00", 3, 4, temperature=0.8, seed=1)
    res = run_mod.run_cases(tmp_path / "r", cases=[spec], runners=[], progress=False)
    got = {(c.kind, c.case_id, c.verdict) for c in res.comparisons}
    assert ("engine run", spec.plain().case_id, "unsupported on Device(cpu, 0): Eigh") in got, got
    assert ("reference", spec.case_id, "not compared") in got, got
    text = (tmp_path / "r" / "summary.md").read_text()
    assert f"- `{spec.plain().case_id}` (engine): `unsupported on Device(cpu, 0): Eigh`" in text, text
    assert res.nothing_compared and not res.ok and "**NOTHING COMPARED" in text


def test_a_fill_case_on_a_missing_op_reads_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    import zoo.fill as zf
    from specparity.jobs.run import fill_comparisons

    case = zf.FillCase("xml", "strict", "fill-05")

    def missing(_case: Any) -> Any:
        raise RuntimeError("[QRF::eval_gpu] Metal QR factorization NYI.")

    monkeypatch.setattr(zf, "run_case", missing)
    rows, out = fill_comparisons([case])
    assert rows == [] and [(c.kind, c.verdict, c.fails) for c in out] == [
        ("fill-vs-plain", "unsupported on Device(cpu, 0): QRF", False)]

    def bug(_case: Any) -> Any:
        raise ValueError("fill: span of 1 id at output 3 (planted)")

    monkeypatch.setattr(zf, "run_case", bug)
    with pytest.raises(ValueError, match="planted"):
        fill_comparisons([case])
