"""Run one case with one runner and return its trace; the case helpers every runner shares.

Which runners exist and what each implements is the registry
(:mod:`specparity.runners.registry`; one declaration module per runner in this
package, with its golden sets, docs/runners.md; ``draft_goldens.py`` holds the
draft-level golden producers they name); :func:`run_case` loads the case's
models, writes the header and hands the rest to the runner's ``run``. Models are loaded once per
process and shared (importing mlx-lm and loading costs seconds; the zoo models
are tiny).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specparity.cases.case import Case
from specparity.runners import registry
from specparity.runners.registry import CaseRun, Runner, RunnerUnsupported
from traces.records import make_header

if TYPE_CHECKING:
    from engine.sources.kind import OpenOptions, SourceKind


def case_kind(case: Case) -> SourceKind | None:
    """The descriptor of ``case``'s draft source (``engine/sources/<kind>.py`` ``SOURCE``);
    None for plain decode. Every per-kind fact the harness uses is read from it."""
    if case.drafter is None:
        return None
    from engine.sources.kind import get

    return get(case.source)


def native_conventions(case: Case) -> str | None:
    """The conventions a ``native-mtp`` case names in its drafter: ``native`` (the checkpoint
    family's defaults) or ``native-<family>`` (``glm``, ``deepseek``, ``qwen`` defaults), then
    optionally ``+name=value,...`` over them (what ``--mtp-conventions`` and ``grade`` add)."""
    from engine.sources.native_mtp import FAMILY_DEFAULTS

    name, _, extra = (case.drafter or "").partition("+")
    fam = name[len("native-"):] if name.startswith("native-") else ""
    parts = [f"{k}={v}" for k, v in FAMILY_DEFAULTS[fam].to_json().items()] if fam in FAMILY_DEFAULTS else []
    parts += [extra] if extra else []
    return ",".join(parts) or None


def dspark_drafter(case: Case) -> tuple[str, float | None]:
    """``(zoo artifact name, confidence threshold)`` of a case whose kind takes a confidence
    threshold (the block drafters, ``deepspec`` and ``dspark``).

    The case's ``drafter`` names the artifact variant and the threshold:
    ``deepspec-t0``, ``deepspec-q8-t0.5``, ``dspark-t0``, ... A drafter PATH's label
    without ``-t<threshold>`` (``specparity.cases.case.drafter_label`` given none) runs with the kind's own
    default (``SourceKind.threshold_default``; dspark: the checkpoint's calibrated thresholds).
    """
    assert case.drafter is not None
    desc = case_kind(case)
    variant, sep, thr = case.drafter.rpartition("-t")
    if not case.on_zoo:
        try:
            if sep:
                return f"{case.target}-{variant}", float(thr)
        except ValueError:  # no threshold suffix ('dspark-my-tuned-1a2b3c4d'): the default
            pass
        return f"{case.target}-{case.drafter}", desc.threshold_default if desc is not None else None
    if not sep or not variant.startswith(case.source):
        raise ValueError(f"{case.source} case drafter {case.drafter!r} must be '<variant>-t<threshold>'")
    return f"{case.target}-{variant}", float(thr)


@cache
def load_model(path: str) -> Any:
    from engine.models import load
    from engine.nonexact import from_env

    loaded = load(path)
    from_env(loaded.model)  # SPECPARITY_EMULATE_NONEXACT: a non-bit-exact backend on CPU
    return loaded


def numerics_witness() -> Any:
    """The numerics witness (``engine/witness.py``) on the models and tokenizers the runs loaded
    (:func:`load_model`: shared, non-exact aware), found by the traces' header paths."""
    from engine.witness import path_witness

    return path_witness(lambda path: load_model(path).model, lambda path: load_model(path).tokenizer)


def _zoo_dir(name: str) -> Path:
    import zoo

    return zoo.model_dir(name)


def tokenizer_digest(model_dir: Path) -> str | None:
    """sha256 of a model dir's tokenizer files (``tokenizer.json`` alone when present)."""
    from engine.models import file_digest

    tj = model_dir / "tokenizer.json"
    files = [tj] if tj.is_file() else sorted(
        p for p in model_dir.iterdir()
        if p.is_file() and (p.name.startswith("tokenizer") or p.suffix in (".model", ".tiktoken")))
    return file_digest(files) if files else None


def model_identity(path: str | Path) -> dict[str, Any]:
    """``{"path", "weights_sha256", "config_sha256"}``: the one model identity of a trace header
    (``traces.digest.weights_digest`` over every layout and dtype, cached per content stamp by
    ``specparity.cases.case.cached_weights_digest``: a checkpoint rewritten in place is re-hashed;
    ``traces.digest.config_digest``); ``grade`` checks a header against the same function."""
    from specparity.cases.case import cached_weights_digest
    from traces.digest import config_digest

    return {"path": str(path), "weights_sha256": cached_weights_digest(str(path)),
            "config_sha256": config_digest(path)}


def case_paths(case: Case) -> tuple[Path, Path | None]:
    """``(target dir, drafter dir | None)`` of ``case``: its own paths, or on the zoo where its
    kind's descriptor says the drafters live (``SourceKind.zoo``, ``"module:function"``)."""
    from zoo.native_mtp import TARGETS as NATIVE_TARGETS

    if case.on_zoo and case.target in NATIVE_TARGETS:  # MTP layers inside the target checkpoint
        from zoo.native_mtp import target_paths

        tdir, ckpt = target_paths(case.target)
        return tdir, (ckpt if case.drafter is not None else None)
    if not case.on_zoo:
        assert case.target_path is not None
        dpath = Path(case.draft_path) if case.drafter is not None and case.draft_path else None
        return Path(case.target_path), dpath
    desc = case_kind(case)
    if desc is None or desc.zoo is None:
        return _zoo_dir(case.target), None
    assert case.drafter is not None
    if "confidence_threshold" in desc.options:
        dspark_drafter(case)  # '<variant>-t<threshold>', or refused in one line
    module, _, fn = desc.zoo.partition(":")
    locate: Callable[[str, str], tuple[Path, Path | None]] = getattr(importlib.import_module(module), fn)
    return locate(case.target, case.drafter)


def case_open_options(case: Case) -> OpenOptions:
    """What ``case``'s drafter opens with (``engine.sources.kind.OpenOptions``): its γ, the
    confidence threshold / MTP conventions its drafter names where its kind takes them, and
    :func:`load_model` (shared, non-exact aware) for drafter models."""
    from engine.sources.kind import OpenOptions

    desc = case_kind(case)
    if desc is None:
        return OpenOptions(gamma=case.gamma, load=load_model)
    return desc.open_options(OpenOptions(
        gamma=case.gamma,
        confidence_threshold=dspark_drafter(case)[1] if "confidence_threshold" in desc.options else None,
        conventions=native_conventions(case) if "conventions" in desc.options else None,
        load=load_model))


@dataclass(frozen=True)
class CaseSource:
    """How a case's draft source runs (:func:`open_for_case`).

    ``make()`` builds a fresh provider (a session makes one per cold run); ``gamma`` and
    ``prefill`` are what the run passes to ``GenerationParams`` AND what its trace header
    records (:func:`case_header`): one decision for both.
    """

    kind: SourceKind | None
    make: Callable[[], Any]
    gamma: int
    prefill: str
    draft_dir: Path | None


def open_for_case(case: Case, target: Any = None, *, prefill: str | None = None) -> CaseSource:
    """The one case → provider path (the engine runner, sessions, ``generate``).

    ``target`` (a loaded target): each provider made is checked against it
    (``check_target``, where the provider has one). ``prefill``: a convention asked for
    explicitly (``generate --prefill``), else the kind's own (``SourceKind.prefill``;
    plain decode: tail-split).
    """
    from engine.sources.kind import prefill_for

    desc = case_kind(case)
    mode = prefill_for(desc.name if desc is not None else None, prefill)  # type: ignore[arg-type]
    if desc is None:
        def plain() -> Any:
            raise ValueError(f"case {case.case_id} is plain decode: it has no draft source")

        return CaseSource(None, plain, case.gamma, mode, None)
    _, dpath = case_paths(case)
    if desc.takes_dir and dpath is None:
        raise ValueError(f"the {desc.name} source needs a drafter directory (case {case.case_id})")
    opts = case_open_options(case)

    def make() -> Any:
        provider = desc.open(dpath, opts)
        check = getattr(provider, "check_target", None)
        if target is not None and check is not None:
            check(target.model, target.tokenizer)
        return provider

    return CaseSource(desc, make, case.gamma, mode, dpath)


def case_params(case: Case, prefill: str | None = None) -> dict[str, Any]:
    """The trace header's ``params`` of ``case``: ``prefill`` is the convention the run used
    (``CaseSource.prefill``; None: the kind's own, as :func:`open_for_case` decides), plus the
    kind's own header params (``SourceKind.header``) and, for a kind taking a confidence
    threshold, the drafter artifact (a golden input)."""
    from engine.sources.kind import prefill_for

    desc = case_kind(case)
    params = _base_params(case, prefill_for(desc.name if desc is not None else None, prefill))  # type: ignore[arg-type]
    if desc is None:
        return params
    if desc.header is not None:  # header objects may carry extra keys (mtp_conventions, ...)
        params.update(desc.header(case_paths(case)[1], case_open_options(case)))
    if "confidence_threshold" in desc.options:
        from zoo.dspark import manifest

        name = dspark_drafter(case)[0]
        entry = manifest().get("artifacts", {}).get(name, {})
        params["drafter_artifact"] = {"name": name, "weights_sha256": entry.get("weights_sha256")}
    return params


def processor_params(case: Case) -> Any:
    """The case's logits processors (``engine.sampler.ProcessorParams``)."""
    from engine.sampler import ProcessorParams

    return ProcessorParams.parse(case.processors)


def sampler_params(case: Case) -> Any:
    """The case's ``engine.sampler.SamplerParams``: what its sampling pipeline applies
    (``engine.pipeline``). The one Case → pipeline path: the engine runner's request and
    every header's sampling keys (:func:`_base_params` via ``engine.pipeline.header_params``)."""
    from engine.sampler import SamplerParams

    return SamplerParams(temperature=case.temperature, top_p=case.top_p, top_k=case.top_k, min_p=case.min_p,
                         processors=processor_params(case), min_tokens=case.min_tokens, rng=case.rng)


def generation_params(case: Case, default_eos: tuple[int, ...]) -> Any:
    """The case's ``engine.executor.GenerationParams`` (its EOS ids, or ``default_eos``, the
    tokenizer's): what the engine runner and the prompt-cache sessions run the case with. The
    grammar (compiled against the tokenizer) and the source's γ/prefill are added by the caller."""
    from engine.executor import GenerationParams

    return GenerationParams(
        max_tokens=case.max_tokens, gamma=case.gamma, sampler=sampler_params(case), seed=case.seed,
        eos_ids=case.eos_ids if case.eos_ids is not None else tuple(default_eos),
        stop_sequences=case.stop_sequences, rotating=case.rotating, **kv_params(case))


def _base_params(case: Case, prefill: str) -> dict[str, Any]:
    from engine.pipeline import header_params

    core, sampling = header_params(sampler_params(case), case.seed)
    extra = {k: sampling[k] for k in ("logits_processors",) if k in sampling}
    if case.stop_sequences:  # absent when none: existing traces keep their bytes
        extra["stop_sequences"] = [list(q) for q in case.stop_sequences]
    extra.update(kv_params(case))
    if case.rotating != "guard" and case.drafter is not None:
        extra["rotating"] = case.rotating
    if case.grammar:  # absent when unconstrained; the text lets grade re-run the case
        from zoo.grammars import spec

        extra["grammar"] = spec(case.grammar).to_dict()
        if getattr(case, "reasoning_end", ""):  # absent without a marker: older traces unchanged
            extra["grammar"]["reasoning_end"] = case.reasoning_end
    extra.update({k: v for k, v in sampling.items() if k != "logits_processors"})  # min_tokens, rng
    return {
        "gamma": case.gamma if case.drafter is not None else None,
        "max_tokens": case.max_tokens,
        **core,
        "prefill": prefill,
        "prefill_step_size": 512 if case.drafter is not None else 2048,
        "confidence_threshold": None,
        **extra,
    }


def kv_params(case: Case) -> dict[str, Any]:
    """The header's quantized-KV params (absent without ``kv_bits``), mlx-lm's defaults filled in."""
    if case.kv_bits is None:
        return {}
    return {"kv_bits": case.kv_bits,
            "kv_group_size": case.kv_group_size if case.kv_group_size is not None else 64,
            "quantized_kv_start": case.quantized_kv_start if case.quantized_kv_start is not None else 5000}


def run_case(runner: str | Runner, case: Case) -> list[dict[str, Any]]:
    """All records (header to footer) of ``case`` run by ``runner`` (a registry name or declaration).

    A runner that does not implement the case's source or one of its options
    (:func:`registry.unsupported`) is refused with :class:`RunnerUnsupported` before
    anything loads: never a plain decode under a speculative label.
    """
    import zoo

    r = runner if isinstance(runner, Runner) else registry.get(runner)
    why = registry.unsupported(r, case)
    if why is not None:
        raise RunnerUnsupported(why)
    assert r.run is not None
    tpath, dpath = case_paths(case)
    target = load_model(str(tpath))
    desc = case_kind(case)
    draft = load_model(str(dpath)) if dpath is not None and desc is not None and desc.loads_model else None
    if case.prompt_tokens is None:
        if not case.on_zoo:
            raise ValueError(f"case {case.case_id}: a case on a model path needs its prompt's token ids")
        ids = list(zoo.prompt(case.prompt_id).token_ids)
    else:
        from specparity.cases.prompts import check_ids_for_model

        # Never feed the model ids past its vocabulary (garbage or a segfault on MLX).
        ids = check_ids_for_model(case.prompt_tokens, tpath, max_tokens=case.max_tokens,
                                  prompt_id=case.prompt_id)
        if draft is not None and dpath is not None:  # the drafter reads the same ids
            from specparity.cases.prompts import PromptError

            try:
                check_ids_for_model(ids, dpath, max_tokens=case.max_tokens, prompt_id=case.prompt_id)
            except PromptError as exc:  # a padded target's row past the drafter's, say so
                raise PromptError(f"drafter {dpath}: {exc}") from None
    header = case_header(r.runner_info(), case, ids, tpath=tpath, dpath=dpath, target=target, draft=draft)
    body = r.run(CaseRun(case=case, target=target, draft=draft, ids=ids, tpath=tpath, dpath=dpath))
    return [header, *body]


def case_header(runner: dict[str, Any], case: Case, ids: list[int], *, tpath: Path, dpath: Path | None,
                target: Any, draft: Any = None, prefill: str | None = None) -> dict[str, Any]:
    """The trace header of ``case`` run by ``runner`` (its ``runner_info()``) on ``ids``: the one
    builder of :func:`run_case` and ``generate --trace``. ``prefill``: the run's
    ``CaseSource.prefill`` (None: the kind's own, the same decision)."""
    import zoo

    params = case_params(case, prefill)
    if params.get("rotating") == "exact":  # where mlx-lm's rollback stops (traces.reference)
        from engine.rollback import ring_window

        params["sliding_window"] = ring_window(target.model, draft.model if draft is not None else None)
    return make_header(
        runner=runner,
        mode=case.mode,
        source=case.source if case.drafter is not None else None,
        case_id=case.case_id,
        target=model_identity(str(tpath)),
        drafter=model_identity(str(dpath)) if dpath is not None else None,
        tokenizer_sha256=zoo.tokenizer_digest() if case.on_zoo else tokenizer_digest(tpath),
        params=params,
        prompt_id=case.prompt_id,
        prompt_ids=ids,
        eos_ids=case.eos_ids if case.eos_ids is not None else target.eos_ids,
    )


def runner_supports(runner: str, case: Case) -> bool:
    """Whether ``runner`` implements ``case``'s draft source and every option it uses."""
    return registry.supports(runner, case)
