"""flyto-mlx 0.7.0 (PyPI ``flyto-mlx``, module ``omlx``): its native-MTP patch of mlx-lm, driven in process.

Reference: ``omlx/utils/model_loading.py`` ``maybe_apply_pre_load_patches(model_dir,
model_settings)`` (with ``model_settings.mtp_enabled`` it applies
``omlx/patches/mlx_lm_mtp`` ``apply_mlx_lm_mtp_patch``, a port of mlx-lm PR #990:
``qwen35_model.py`` attaches ``MTPModule`` to ``mlx_lm.models.qwen3_5.TextModel``
and keeps the ``mtp.*`` weights; ``batch_generator.py`` folds the draft/verify
cycle into ``mlx_lm.generate.GenerationBatch.next`` for a batch of ONE sequence:
one MTP draft per cycle, a 2-token verify ``[next_main, draft]``, greedy
token-match acceptance or, sampled, the ``p_target/p_draft`` ratio with a
residual sample), then ``mlx_lm.load`` and
``omlx.patches.mlx_lm_mtp.stamp_model_mtp_active(model, True)``, as its
engines do. Generation is mlx-lm 0.31.3's ``BatchGenerator`` (the mlx-lm
flyto-mlx pins) with one prompt: ``insert([prompt], max_tokens=[n])``,
``stop_tokens`` = the EOS ids and stop ids, ``sampler`` =
``mlx_lm.sample_utils.make_sampler(temp, top_k=)``; the stream is each
response's ``token`` until one carries a ``finish_reason``.

Counters: the engine's own per-sequence summary, the INFO line
``MTP[uid] finish=… tokens=N cycles=C accept=A/C … emits[init=i,draft=d,bonus=b,verify=v]``
of logger ``omlx.patches.mlx_lm_mtp.batch_generator``, read with a logging
handler; the line ``MTP path activated`` proves the MTP cycle ran (a run without
it raises: it would be plain decode under a speculative label).

Model: the zoo native-MTP checkpoint ``qwen35-native`` (``zoo/native_mtp.py``:
the zoo ``qwen35`` trunk carrying the ``qwen35-mtp-self`` head as ``mtp.*``,
mlx-format); plain decode, the reference, runs the zoo ``qwen35`` (the same
trunk tensors without ``mtp.*``).

The patches replace classes of ``mlx_lm`` process-wide; the references of the
grading job run in this process on stock mlx-lm, so every call snapshots the
dictionaries of the modules and classes flyto patches and restores them after
(:func:`_flyto_patched`); flyto's patches are self-healing (each call re-applies
them when its markers are gone), which is how its own engines switch models.
Trace level: token, with the engine's counters.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from functools import cache
from typing import Any

from subjects import Mode
from subjects.base import SubjectCase, SubjectRun, timed
from subjects.common import case_mode, dist_version, eos_for, prompt_ids, require_module

NAME = "flyto-mlx-mtp"
MODES = {
    "mtp": Mode(targets=("qwen35",), drafter="qwen35-native", samples=True, top_k=5, stop_ids=True,
                note="maybe_apply_pre_load_patches(mtp_enabled=True) + mlx_lm.load + BatchGenerator "
                     "(mlx-lm 0.31.3, one sequence: flyto's MTP cycle), zoo qwen35-native checkpoint"),
}
_PATCHED_MODULES = ("mlx_lm.generate", "mlx_lm.utils", "mlx_lm.models.cache", "mlx_lm.models.qwen3_5",
                    "mlx_lm.models.qwen3_5_moe", "mlx_lm.models.qwen3_next", "mlx_lm.models.gated_delta",
                    "mlx_lm.sample_utils")
_LOGGER = "omlx.patches.mlx_lm_mtp.batch_generator"
_SUMMARY = re.compile(r"MTP\[(?P<uid>[^\]]*)\] finish=(?P<finish>\S+) tokens=(?P<tokens>\d+) "
                      r"cycles=(?P<cycles>\d+) accept=(?P<accepts>\d+)/\d+ .*?"
                      r"emits\[init=(?P<init>\d+),draft=(?P<draft>\d+),bonus=(?P<bonus>\d+),"
                      r"verify=(?P<verify>\d+)\]")


def require() -> None:
    require_module("omlx.patches.mlx_lm_mtp", NAME)


def version() -> str:
    return dist_version("flyto-mlx")


def checkpoint() -> str:
    from zoo.native_mtp import target_paths

    return str(target_paths("qwen35-native")[1])


def drafter_path(case: SubjectCase) -> str | None:
    return checkpoint()


def _snapshot(modules: tuple[str, ...]) -> list[tuple[Any, dict[str, Any]]]:
    import importlib
    import sys

    out: list[tuple[Any, dict[str, Any]]] = []
    for name in modules:
        try:
            mod = sys.modules.get(name) or importlib.import_module(name)
        except ImportError:
            continue
        out.append((mod, dict(vars(mod))))
        for v in list(vars(mod).values()):
            if isinstance(v, type) and v.__module__ == name:
                out.append((v, dict(vars(v))))
    return out


def _restore(saved: list[tuple[Any, dict[str, Any]]]) -> None:
    for obj, before in saved:
        now = dict(vars(obj))
        for k in now.keys() - before.keys():
            if k not in ("__dict__", "__weakref__", "__doc__", "__module__", "__qualname__"):
                delattr(obj, k)
        for k, v in before.items():
            if k in ("__dict__", "__weakref__", "__doc__") or now.get(k, object()) is v:
                continue
            try:
                setattr(obj, k, v)
            except (AttributeError, TypeError):
                pass


@contextlib.contextmanager
def _flyto_patched(path: str | None = None) -> Iterator[None]:
    """flyto's patches for checkpoint ``path`` applied for the duration; stock mlx-lm restored after."""
    import types

    saved = _snapshot(_PATCHED_MODULES)
    try:
        from omlx.utils.model_loading import maybe_apply_pre_load_patches

        maybe_apply_pre_load_patches(path or checkpoint(), types.SimpleNamespace(mtp_enabled=True))
        yield
    finally:
        _restore(saved)


@cache
def _model() -> tuple[Any, Any]:
    import mlx_lm
    from omlx.patches.mlx_lm_mtp import stamp_model_mtp_active

    model, tok = mlx_lm.load(checkpoint())
    stamp_model_mtp_active(model, True)
    return model, tok


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def parse_summary(lines: list[str]) -> tuple[bool, dict[str, int] | None]:
    """(MTP path activated, counters from the summary line) of the engine's log lines."""
    active = any(line.startswith("MTP path activated") for line in lines)
    for line in lines:
        m = _SUMMARY.search(line)
        if m:
            g = {k: int(v) for k, v in m.groupdict().items() if k not in ("uid", "finish")}
            emitted = g["init"] + g["draft"] + g["bonus"] + g["verify"]
            return active, {"generation_tokens": g["tokens"], "emitted": emitted, "drafted": g["cycles"],
                            "accepted": g["accepts"], "rejected": g["cycles"] - g["accepts"]}
    return active, None


def generate(case: SubjectCase) -> SubjectRun:
    import mlx.core as mx

    case_mode(case.with_(stop_ids=()), MODES, "flyto-mlx", stop="")  # stop ids: more stop_tokens
    stops = sorted(eos_for(case.eos_ids) | set(case.stop_ids))
    handler = _Lines()
    log = logging.getLogger(_LOGGER)
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        with _flyto_patched():
            from mlx_lm.generate import BatchGenerator
            from mlx_lm.sample_utils import make_sampler

            model, _ = _model()
            sampler = make_sampler(temp=case.temperature, top_k=case.top_k)
            mx.random.seed(case.seed)
            import random

            random.seed(case.seed)  # the sampled acceptance draws from Python's random
            gen = BatchGenerator(model, stop_tokens=[[s] for s in stops] or None, sampler=sampler)
            stream: list[int] = []
            finish: str | None = None

            def run() -> None:
                nonlocal finish
                gen.insert([list(prompt_ids(case.prompt_id))], max_tokens=[case.max_tokens])
                while finish is None:
                    responses = gen.next_generated()
                    if not responses:
                        break
                    for r in responses:
                        stream.append(int(r.token))
                        if r.finish_reason is not None:
                            finish = str(r.finish_reason)

            _, wall = timed(run)
            gen.close()
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    active, counters = parse_summary(handler.lines)
    if not active:
        raise RuntimeError("flyto-mlx's MTP path did not activate (log: "
                           + " | ".join(handler.lines[-3:]) + ")")
    hooks = ["omlx.utils.model_loading.maybe_apply_pre_load_patches(mtp_enabled=True)",
             "omlx.patches.mlx_lm_mtp.stamp_model_mtp_active", "mlx_lm.generate.BatchGenerator (flyto-patched)",
             f"logging handler on {_LOGGER} (MTP summary line)"]
    return SubjectRun(stream=stream, finish_reason=finish, hooks=hooks, counters=counters or {}, wall_s=wall)
