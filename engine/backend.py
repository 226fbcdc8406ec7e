"""A backend's missing op: the error MLX raises when a backend lacks a kernel or a primitive.

Reference: MLX 0.32.x (``ml-explore/mlx``), the throw sites where a backend has no
implementation for an op or a problem shape (the wording below is MLX's, and
``tests/test_unsupported_backend.py`` checks each form on a string taken from these files):

- ``mlx/backend/cuda/quantized/quantized.cpp`` ``QuantizedMatmul::eval_gpu`` /
  ``GatherQMM::eval_gpu``: ``[quantized_matmul] No implementation for problem shape:
  1x28x32x2, transpose: true, activation: float32, bits: 4, group size: 32, mode: "affine".``
  (no qmm/qmv kernel takes the shape: ``qmm/qmm.cu`` ``supports_qmm_*``/``supports_qmv``);
- ``mlx/backend/cuda/primitives.cpp``, ``no_gpu/primitives.cpp``, ``no_cpu/primitives.cpp``
  (``NO_GPU``/``NO_CPU``): ``QRF has no CUDA implementation.``, ``... has no GPU
  implementation.``, ``... has no CPU implementation.``; ``metal/distributed.cpp``:
  ``[AllReduce::eval_gpu] has no GPU implementation.``;
- ``mlx/backend/metal/primitives.cpp``: ``[QRF::eval_gpu] Metal QR factorization NYI.``,
  ``[Load::eval_gpu] Not implemented.``; ``cuda/random.cu``: ``[RandomBits::eval_gpu] Large
  size unsupported``; ``cuda/quantized/no_qqmm_impl.cpp``: ``[QQMatmul::eval_gpu] QQMM is only
  supported with CUDA 12.8 or higher.``; ``cpu/quantized.cpp``: ``[QQMatmul] NYI for the general
  case``, ``[GatherQQMM] NYI``;
- the CUDA quantized kernels' dispatch (``cuda/quantized/qmm/qmv.cu``, ``qmm_utils.h``,
  ``qmm_sm90.cu``): ``[quantized_matmul] Group size 16 is not supported.``, ``[quantized_matmul]
  3-bit quantization is not supported.``, ``[quantized_matmul] Unsupported dtype: float64.``
  (some thrown as ``std::invalid_argument``, i.e. ``ValueError``);
- ``mlx/linalg.cpp`` ``check_cpu_stream``: ``[linalg::qr] This op is not yet supported on the
  GPU. Explicitly pass a CPU stream to run it.`` (``ValueError``);
- ``mlx/backend/metal/fft.cpp`` / ``cuda/fft.cu``: ``[FFT] GPU FFT is not supported for size
  ...``, ``[FFT] Unsupported cuFFT input transform type.``

Precision over recall: only MLX's own exception types (exactly ``RuntimeError``, or
``ValueError`` for the two ``invalid_argument`` forms above) and only these message forms
are a missing op. Any other error -- a shape error from our code, a ``ValueError`` of ours,
MLX's op-level argument checks (``[quantize] The requested group size 16 is not supported.
The supported group sizes are ...``, the same on every backend), a subclass of
``RuntimeError`` we raise -- is not, and stays a crash or a failure. An error raised with
``raise X from exc`` is looked through to its cause (a reference runner that re-raises
MLX's error as a refusal).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

# Each form: (exception types MLX raises it as, pattern on the error's first line). ``op`` names it.
_TAG = r"\[(?P<op>[A-Za-z_][\w]*(?:::[A-Za-z_]\w*)*?)(?:::eval_(?:gpu|cpu))?\]"
_BACKEND = r"(?:CUDA|GPU|CPU|Metal)"
_FORMS: tuple[tuple[tuple[type[BaseException], ...], re.Pattern[str]], ...] = (
    # cuda/quantized/quantized.cpp: no kernel for the problem shape
    ((RuntimeError,), re.compile(_TAG + r" No implementation for\b")),
    # NO_GPU / NO_CPU macros: "QRF has no CUDA implementation."
    ((RuntimeError,), re.compile(r"(?P<op>[A-Za-z_]\w*) has no " + _BACKEND + r" implementation\b")),
    # metal/distributed.cpp: "[AllReduce::eval_gpu] has no GPU implementation."
    ((RuntimeError,), re.compile(_TAG + r" has no " + _BACKEND + r" implementation\b")),
    # a backend's eval: "[Load::eval_gpu] Not implemented.", "[QRF::eval_gpu] Metal ... NYI."
    ((RuntimeError,), re.compile(
        r"\[(?P<op>[A-Za-z_]\w*)::eval_(?:gpu|cpu)\] .*?"
        r"(?:\bNYI\b|\b[Nn]ot implemented\b|\b[Uu]nsupported\b|\bnot supported\b|\bonly supported\b)")),
    # cpu/quantized.cpp: "[QQMatmul] NYI for the general case", "[GatherQQMM] NYI"
    ((RuntimeError,), re.compile(_TAG + r" NYI\b")),
    # the CUDA quantized kernels' dispatch (runtime_error in qmv.cu/qmm_sm90.cu, invalid_argument in qmm_utils.h)
    ((RuntimeError, ValueError), re.compile(
        _TAG + r" (?:Unsupported dtype: \w+|\d+-bit quantization is not supported|"
               r"Group size \d+ is not supported)\.$")),
    # linalg.cpp check_cpu_stream (invalid_argument)
    ((RuntimeError, ValueError), re.compile(_TAG + r" This op is not yet supported on the GPU\b")),
    # fft: "[FFT] GPU FFT is not supported for size ...", "[FFT] Unsupported cuFFT input transform type."
    ((RuntimeError,), re.compile(
        _TAG + r" (?=.*\b(?:GPU|CUDA|Metal|cuFFT|cuDNN|cuBLAS\w*)\b)"
               r".*?(?:\b[Uu]nsupported\b|\bnot supported\b|\bnot yet supported\b|\bonly supported\b)")),
)


@dataclass(frozen=True)
class MissingOp:
    """A backend lacks ``op`` (MLX's name for it); ``line``: the error's first line, as MLX said it."""

    op: str
    line: str

    def verdict(self, device: str) -> str:
        """``unsupported on <device>: <op>`` (``device``: e.g. ``Device(gpu, 0)``)."""
        return f"unsupported on {device}: {self.op}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else ""


def _match(exc: BaseException) -> MissingOp | None:
    line = _first_line(exc)
    for types, pattern in _FORMS:
        if type(exc) in types:  # exactly MLX's types: a subclass is one of ours
            m = pattern.match(line)
            if m is not None:
                return MissingOp(m.group("op"), line)
    return None


def missing_op(exc: BaseException) -> MissingOp | None:
    """The op a backend lacks when ``exc`` is MLX saying so, else None (any other error).

    Looks through ``raise ... from`` (``__cause__``), at most a few links deep.
    """
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 8:
        seen.add(id(cur))
        found = _match(cur)
        if found is not None:
            return found
        cur = cur.__cause__
    return None


def current_device() -> str:
    """The MLX default device as MLX prints it (``Device(gpu, 0)``), for a verdict."""
    import mlx.core as mx

    return str(mx.default_device())


def unsupported_payload(exc: BaseException) -> dict[str, Any] | None:
    """``{"device", "op", "line", "verdict"}`` of a missing op (a plain value: it travels from a
    process-pool or Ray worker like a refusal does), else None."""
    m = missing_op(exc)
    if m is None:
        return None
    device = current_device()
    return {"device": device, "op": m.op, "line": m.line, "verdict": m.verdict(device)}


def unsupported_text(exc: BaseException, where: str) -> str | None:
    """``unsupported on <device>: <op> — <where>: <MLX's line>`` for a missing op, else None (a
    one-line verdict where a run keeps one error string, e.g. a prompt-cache session's)."""
    info = unsupported_payload(exc)
    return None if info is None else f"{info['verdict']} — {where}: {info['line']}"


def unsupported_verdict(text: str | None) -> str | None:
    """The ``unsupported on <device>: <op>`` head of an :func:`unsupported_text` string, else None."""
    if not text or not text.startswith("unsupported on "):
        return None
    return text.split(" — ", 1)[0]


# --------------------------------------------------------------------------- the one wrapper

T = TypeVar("T")


@dataclass(frozen=True)
class Unsupported:
    """What :func:`run_supported` returns when the work hit an op the backend lacks: ``where``
    (the case, session or row it was), ``info`` (:func:`unsupported_payload`)."""

    where: str
    info: dict[str, Any]

    @property
    def verdict(self) -> str:
        """``unsupported on <device>: <op>``."""
        return str(self.info["verdict"])

    @property
    def text(self) -> str:
        """``unsupported on <device>: <op> — <where>: <MLX's line>`` (:func:`unsupported_text`'s form)."""
        return f"{self.verdict} — {self.where}: {self.info['line']}"


def run_supported(fn: Callable[[], T], where: str) -> T | Unsupported:
    """``fn()``, or :class:`Unsupported` when it raised MLX's missing-op error (:func:`missing_op`):
    the one wrapper every job runs a case, a session or an audit through, so a missing op is that
    unit's verdict and the job goes on. Any other error propagates unchanged."""
    try:
        return fn()
    except (RuntimeError, ValueError) as exc:
        info = unsupported_payload(exc)
        if info is None:
            raise
        return Unsupported(where, info)


# --------------------------------------------------------------------------- the CPU test double

EMULATE_ENV = "SPECPARITY_EMULATE_MISSING_OP"
"""``quantized_matmul``: this process's MLX behaves like MLX 0.32.4's CUDA backend for mlx-lm's
quantized-KV attention (:func:`emulate_cuda_quantized_matmul`); read by ``specparity run``'s task
function, so process-pool and Ray workers (which inherit the environment) emulate it too."""


def _qmm_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, int, int]:
    # mx.quantized_matmul(x, w, scales, biases=None, transpose=True, group_size=None, bits=None, ...)
    def arg(i: int, name: str, default: Any) -> Any:
        v = kwargs.get(name, args[i] if len(args) > i else None)
        return default if v is None else v

    return bool(arg(2, "transpose", True)), int(arg(3, "group_size", 64)), int(arg(4, "bits", 4))


def cuda_qmm_error(x: Any, w: Any, *args: Any, **kwargs: Any) -> RuntimeError | None:
    """MLX 0.32.4 CUDA's error for ``mx.quantized_matmul(x, w, ...)`` over a batched (KV-cache)
    operand, else None.

    The rule, for the zoo's quantized-KV pairs (1 KV head, 2 heads, KV in groups of 32),
    from ``mlx/backend/cuda/quantized/qmm/qmm.cu`` (``supports_qmm_naive``: ``K % max(64,
    group_size) == 0`` with ``transpose``) and measured on an H200 (docs/backends.md): no kernel
    when ``transpose`` and the head dim ``K`` is not a multiple of ``max(64, group_size)``.
    A 2-D weight (a quantized linear layer) is left alone. The message is MLX's, to the
    character (``cuda/quantized/quantized.cpp``).
    """
    transpose, group_size, bits = _qmm_args(args, kwargs)
    k = int(x.shape[-1])
    if not transpose or w.ndim <= 2 or k % max(64, group_size) == 0:
        return None
    import math

    import mlx.core as mx

    m = int(x.shape[-2]) if x.ndim > 1 else 1
    n = int(w.shape[-2])
    batch = mx.broadcast_shapes(tuple(x.shape[:-2]), tuple(w.shape[:-2]))
    dtype = str(x.dtype).rsplit(".", 1)[-1]
    return RuntimeError(f"[quantized_matmul] No implementation for problem shape: {m}x{n}x{k}x"
                        f"{math.prod(batch)}, transpose: true, activation: {dtype}, bits: {bits}, "
                        f'group size: {group_size}, mode: "affine".')


def emulate_cuda_quantized_matmul() -> Callable[[], None]:
    """Make ``mx.quantized_matmul`` raise MLX 0.32.4 CUDA's error where that backend has no
    kernel (:func:`cuda_qmm_error`); returns the undo. Idempotent. A test double: the CPU
    proves a missing op is one case's verdict (tests/test_unsupported_backend.py)."""
    import mlx.core as mx

    real = mx.quantized_matmul
    if getattr(real, "_specparity_emulated", False):
        return lambda: None

    def quantized_matmul(x: Any, w: Any, *args: Any, **kwargs: Any) -> Any:
        err = cuda_qmm_error(x, w, *args, **kwargs)
        if err is not None:
            raise err
        return real(x, w, *args, **kwargs)

    quantized_matmul._specparity_emulated = True  # type: ignore[attr-defined]
    mx.quantized_matmul = quantized_matmul

    def undo() -> None:
        mx.quantized_matmul = real

    return undo


def emulate_from_env() -> None:
    """Install the test double named by ``SPECPARITY_EMULATE_MISSING_OP`` (unset: nothing; parsed
    by ``traces.env``: anything but ``quantized_matmul`` is one line naming the variable)."""
    from traces import env

    if env.get(EMULATE_ENV) is None:
        return
    emulate_cuda_quantized_matmul()


__all__ = ["EMULATE_ENV", "Arithmetic", "MissingOp", "Unsupported", "arithmetic", "cuda_qmm_error", "current_device", "emulate_cuda_quantized_matmul",
           "emulate_from_env", "missing_op", "run_supported", "unsupported_payload", "unsupported_text", "unsupported_verdict"]


# ---------------------------------------------------------------------- bit-exact or not


@dataclass(frozen=True)
class Arithmetic:
    """Whether this run's arithmetic is bit-exact, and why."""

    exact: bool
    why: str


def arithmetic(*models: Any) -> Arithmetic:
    """``exact`` on MLX's CPU unless a model is wrapped by the non-exact double; otherwise not."""
    import mlx.core as mx

    from engine.nonexact import emulated_kv_scale, is_emulated

    device = mx.default_device()
    for m in models:
        em = is_emulated(m) if m is not None else None
        if em is not None:
            return Arithmetic(False, f"non-exact double on {device} (logit scale {em[0]:g}, seed {em[1]}, "
                                     f"cache scale {emulated_kv_scale(m):g})")
    if device.type == mx.cpu:
        return Arithmetic(True, f"bit-exact ({device})")
    return Arithmetic(False, f"{device}: not bit-exact between prefill splits and one-token decode")
