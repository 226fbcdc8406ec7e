"""mtplx 2.12.2 (PyPI ``mtplx``): native MTP heads (Qwen3.5/3-Next style), driven unmodified.

Reference: ``mtplx/runtime.py`` ``load(model_path, mtp=True)`` (``mtp_patch.py``
``inject_mtp_support`` for a dense ``qwen3_5`` trunk: an ``mtp.*`` head read
from ``mtp.safetensors``, ``num_nextn_predict_layers`` in the config) and
``mtplx/generation.py`` ``generate_mtp1`` (one MTP draft per cycle) /
``generate_mtpk`` (``speculative_depth`` drafts), returning a
``GenerationOutput(tokens, finish_reason, stats)`` whose ``stats`` carry
``generated_tokens``, ``drafted_tokens``, ``accepted_drafts``,
``rejected_drafts``; EOS through ``stop_token_ids``; sampling through
``SamplerConfig(temperature, top_p, top_k)`` and ``seed``.

Linux: ``mtplx.route_tape`` (imported by ``generation``) opens
``/usr/lib/libSystem.B.dylib`` with ``ctypes.CDLL`` at import for
``mach_timebase_info`` / ``mach_continuous_time`` (timing only). While the
module is imported, :func:`_macos_clock_stub` answers that one path with a
stand-in (timebase 1/1, ``time.monotonic_ns``); every other ``CDLL`` call
goes to ctypes unchanged. mtplx's code is not touched.

Model: the zoo ``qwen35`` target (dense ``qwen3_5``, gated DeltaNet + full
attention) with the zoo MTP head ``head-qwen35-mtp-self`` (the Qwen3.5 MTP
layout: pre_fc_norm_embedding/hidden, fc, one full-attention layer, norm)
written as ``mtp.safetensors`` under the ``mtp.`` namespace, in a directory
built under the zoo cache. Trace level: token, with the engine's counters.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from functools import cache
from typing import Any

import zoo
from subjects import Mode
from subjects.base import SubjectCase, SubjectRun, SubjectUnavailable, timed
from subjects.common import case_mode, dist_version, eos_for, prompt_ids

NAME = "mtplx"
_NO_STOP = "stop_token_ids is the EOS set itself: no separate stop-id parameter"
_LIB = "/usr/lib/libSystem.B.dylib"
MODES = {
    "mtp1": Mode(targets=("qwen35",), drafter="head-qwen35-mtp-self", samples=True, top_k=5,
                 note="generate_mtp1 (one MTP draft per cycle), zoo qwen35 + its MTP head as mtp.safetensors",
                 unsupported={"stop": _NO_STOP}),
    "mtpk": Mode(targets=("qwen35",), drafter="head-qwen35-mtp-self",
                 note="generate_mtpk(speculative_depth=gamma), same model and head",
                 unsupported={"stop": _NO_STOP, "distribution": "graded on mtp1 only (same sampler)"}),
}


class _StubFn:
    def __init__(self, fn: Any) -> None:
        self.fn, self.restype, self.argtypes = fn, None, None

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


class _MacClock:
    """Stand-in for the two libSystem timing calls route_tape makes."""

    def __init__(self) -> None:
        def timebase(ref: Any) -> int:
            info = getattr(ref, "_obj", ref)
            info.numer, info.denom = 1, 1
            return 0

        self.mach_timebase_info = _StubFn(timebase)
        self.mach_continuous_time = _StubFn(time.monotonic_ns)


@contextlib.contextmanager
def _macos_clock_stub() -> Iterator[None]:
    import ctypes

    real = ctypes.CDLL

    def cdll(name: Any, *a: Any, **kw: Any) -> Any:
        if name == _LIB:
            return _MacClock()
        return real(name, *a, **kw)

    ctypes.CDLL = cdll  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        ctypes.CDLL = real  # type: ignore[misc]


def _import_generation() -> Any:
    import importlib
    import sys

    if "mtplx.generation" in sys.modules:
        return sys.modules["mtplx.generation"]
    with _macos_clock_stub():
        return importlib.import_module("mtplx.generation")


def require() -> None:
    from subjects import SUBJECTS

    try:
        import mtplx  # noqa: F401
    except ImportError as exc:
        raise SubjectUnavailable(f"mtplx is not installed ({exc}); run it with: "
                                 f"{SUBJECTS[NAME].install_hint}") from exc
    _import_generation()


def version() -> str:
    return dist_version("mtplx")


@cache
def model_dir(target: str = "qwen35") -> str:
    import mlx.core as mx

    from subjects.drafters import subjects_dir
    from zoo.heads import head_dir

    d = subjects_dir() / f"mtplx-{target}-mtp-self"
    if (d / ".complete").exists():
        return str(d)
    d.mkdir(parents=True, exist_ok=True)
    src = zoo.model_dir(target)
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copyfile(f, d / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    head = mx.load(str(head_dir(f"{target}-mtp-self") / "model.safetensors"))
    mx.save_safetensors(str(d / "mtp.safetensors"), {f"mtp.{k}": v for k, v in head.items()})
    (d / ".complete").write_text("")
    return str(d)


def drafter_path(case: SubjectCase) -> str | None:
    return model_dir(case.target) + "/mtp.safetensors"


@cache
def _runtime(target: str) -> Any:
    _import_generation()
    from mtplx.runtime import load

    rt = load(model_dir(target), mtp=True)
    if not rt.mtp_enabled:
        raise RuntimeError("mtplx.runtime.load(mtp=True) returned a runtime without MTP")
    return rt


def generate(case: SubjectCase) -> SubjectRun:
    gen = _import_generation()
    from mtplx.sampling import SamplerConfig

    case_mode(case, MODES, "mtplx", stop=_NO_STOP)
    rt = _runtime(case.target)
    sampler = SamplerConfig(temperature=case.temperature, top_p=1.0, top_k=case.top_k)
    kw: dict[str, Any] = dict(max_tokens=case.max_tokens, sampler=sampler, seed=case.seed,
                              stop_token_ids=set(eos_for(case.eos_ids)))
    ids = list(prompt_ids(case.prompt_id))
    if case.mode == "mtp1":
        out, wall = timed(gen.generate_mtp1, rt, ids, **kw)
        hooks = ["mtplx.generation.generate_mtp1", "mtplx.runtime.load(mtp=True)"]
    else:
        out, wall = timed(gen.generate_mtpk, rt, ids, speculative_depth=case.gamma, **kw)
        hooks = ["mtplx.generation.generate_mtpk(speculative_depth=)", "mtplx.runtime.load(mtp=True)"]
    st = out.stats
    counters = {"generation_tokens": int(st.generated_tokens), "drafted": int(st.drafted_tokens),
                "accepted": int(st.accepted_drafts), "rejected": int(st.rejected_drafts)}
    return SubjectRun(stream=[int(t) for t in out.tokens], finish_reason=out.finish_reason, hooks=hooks,
                      counters=counters, wall_s=wall)
