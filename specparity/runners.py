"""Run one case with one runner (the engine or an oracle) and return its trace.

Models are loaded once per process and shared (importing mlx-lm and loading
costs seconds; the zoo models are tiny).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from specparity.cases import Case
from traces.records import make_header

RUNNER_NAMES = ("engine", "mlx_lm", "optiq", "mlx_vlm", "deepspec")
HEAD_SOURCES = ("mtp", "assistant")  # drafters that are heads over the target (zoo/heads.py)
DSPARK_SOURCES = ("deepspec", "dspark")  # block drafters (zoo/dspark.py artifacts)


def runner_supports(runner: str, case: Case) -> bool:
    """Whether ``runner`` implements ``case``'s draft source (every case runner decodes plainly).

    mlx-lm 0.32.2 speculates with a draft model only (``speculative_generate_step``);
    mlx-optiq with its n-gram lookup or a gemma4 assistant drafter; DeepSpec with its own
    block drafter. A reference never runs a source it lacks (it would decode plainly and be
    compared with the engine's speculative trace as if it were one).
    """
    if case.kv_bits is not None and runner not in ("engine", "mlx_lm"):
        return False  # quantized KV: mlx-lm's kv_bits only
    if runner == "engine" or case.drafter is None:
        return True
    return case.source in {"mlx_lm": ("two-model",), "optiq": ("ngram", "assistant"),
                           "deepspec": ("deepspec",)}.get(runner, ())


def dspark_drafter(case: Case) -> tuple[str, float]:
    """``(zoo artifact name, confidence threshold)`` of a ``deepspec``/``dspark`` case.

    The case's ``drafter`` names the artifact variant and the threshold:
    ``deepspec-t0``, ``deepspec-q8-t0.5``, ``dspark-t0``, ...
    """
    assert case.drafter is not None
    variant, sep, thr = case.drafter.rpartition("-t")
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


def _zoo_dir(name: str) -> Path:
    import zoo

    return zoo.model_dir(name)


def model_identity(path: Path) -> dict[str, Any]:
    """``{"path", "weights_sha256", "config_sha256"}``: one weights digest for every layout and dtype."""
    from traces.digest import weights_digest
    from zoo.dspark import _config_sha

    return {"path": str(path), "weights_sha256": weights_digest(path), "config_sha256": _config_sha(path)}


def tokenizer_digest(model_dir: Path) -> str | None:
    """sha256 of a model dir's tokenizer files (``tokenizer.json`` alone when present)."""
    from engine.models import file_digest

    tj = model_dir / "tokenizer.json"
    files = [tj] if tj.is_file() else sorted(
        p for p in model_dir.iterdir()
        if p.is_file() and (p.name.startswith("tokenizer") or p.suffix in (".model", ".tiktoken")))
    return file_digest(files) if files else None


@cache
def _identity(path: str) -> dict[str, Any]:
    return model_identity(Path(path))


def case_paths(case: Case) -> tuple[Path, Path | None]:
    import zoo

    if not case.on_zoo:
        assert case.target_path is not None
        dpath = Path(case.draft_path) if case.drafter is not None and case.draft_path else None
        return Path(case.target_path), dpath
    if case.drafter is not None and case.source in HEAD_SOURCES:
        from zoo.heads import head_dir

        return _zoo_dir(case.target), head_dir(case.drafter)
    if case.drafter is not None and case.source in DSPARK_SOURCES:
        from zoo.dspark import artifact_dir

        return _zoo_dir(case.target), artifact_dir(dspark_drafter(case)[0])
    if case.drafter is None or case.source != "two-model":
        return _zoo_dir(case.target), None
    return zoo.pair(case.target, case.drafter)


def case_params(case: Case, prefill: str = "tail-split") -> dict[str, Any]:
    if case.drafter is not None and case.source in DSPARK_SOURCES:
        from zoo.dspark import _manifest

        name, threshold = dspark_drafter(case)
        entry = _manifest().get("artifacts", {}).get(name, {})
        return {
            **_base_params(case, "full" if case.source == "deepspec" else prefill),
            "confidence_threshold": threshold,
            # header objects may carry extra keys: the drafter artifact is a golden input
            "drafter_artifact": {"name": name, "weights_sha256": entry.get("weights_sha256")},
        }
    return _base_params(case, prefill)


def processor_params(case: Case) -> Any:
    """The case's logits processors (``engine.sampler.ProcessorParams``)."""
    from engine.sampler import ProcessorParams

    return ProcessorParams.parse(case.processors)


def processors_block(proc: Any) -> dict[str, Any]:
    """The header's ``params.logits_processors`` block of a ``ProcessorParams``."""
    kw = proc.kwargs()
    kw["logit_bias"] = [[t, v] for t, v in (kw["logit_bias"] or {}).items()]
    return {**kw, "history_prompt": proc.history_prompt}


def _base_params(case: Case, prefill: str) -> dict[str, Any]:
    extra = {"logits_processors": processors_block(processor_params(case))} if case.processors else {}
    if case.stop_sequences:  # absent when none: existing traces keep their bytes
        extra["stop_sequences"] = [list(q) for q in case.stop_sequences]
    extra.update(kv_params(case))
    if case.rotating != "guard" and case.drafter is not None:
        extra["rotating"] = case.rotating
    return {
        "gamma": case.gamma if case.drafter is not None else None,
        "max_tokens": case.max_tokens,
        "temperature": case.temperature,
        "top_p": case.top_p,
        "top_k": case.top_k,
        "min_p": 0.0,
        "seed": case.seed,
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


def _runner_info(name: str) -> dict[str, Any]:
    if name == "engine":
        return {"name": "engine", "package": "specparity", "version": metadata.version("specparity")}
    if name == "deepspec":
        from oracles import deepspec

        return {"name": name, "package": "deepspec", "version": deepspec.version(), "commit": deepspec.commit()}
    if name == "optiq":
        return {"name": name, "package": "mlx-optiq", "version": metadata.version("mlx-optiq")}
    return {"name": name, "package": "mlx-lm", "version": metadata.version("mlx-lm")}


def run_case(runner: str, case: Case) -> list[dict[str, Any]]:
    """All records (header to footer) of ``case`` run by ``runner``."""
    import zoo

    tpath, dpath = case_paths(case)
    target = load_model(str(tpath))
    draft = load_model(str(dpath)) if dpath is not None and case.source not in (*HEAD_SOURCES, *DSPARK_SOURCES) else None
    if case.prompt_tokens is None:
        if not case.on_zoo:
            raise ValueError(f"case {case.case_id}: a case on a model path needs its prompt's token ids")
        ids = list(zoo.prompt(case.prompt_id).token_ids)
    else:
        from specparity.prompts import check_ids_for_model

        # Never feed the model ids past its vocabulary (garbage or a segfault on MLX).
        ids = check_ids_for_model(case.prompt_tokens, tpath, max_tokens=case.max_tokens,
                                  prompt_id=case.prompt_id)
        if draft is not None and dpath is not None:  # the drafter reads the same ids
            check_ids_for_model(ids, dpath, max_tokens=case.max_tokens, prompt_id=case.prompt_id)
    tokenizer_sha256 = zoo.tokenizer_digest() if case.on_zoo else tokenizer_digest(tpath)
    params = case_params(case, "full" if case.source in HEAD_SOURCES and case.drafter else "tail-split")
    if params.get("rotating") == "exact":  # where mlx-lm's rollback stops (traces.reference)
        from engine.rollback import ring_window

        params["sliding_window"] = ring_window(target.model, draft.model if draft is not None else None)
    header = make_header(
        runner=_runner_info(runner),
        mode=case.mode,
        source=case.source if case.drafter is not None else None,
        case_id=case.case_id,
        target=_identity(str(tpath)),
        drafter=_identity(str(dpath)) if dpath is not None else None,
        tokenizer_sha256=tokenizer_sha256,
        params=params,
        prompt_id=case.prompt_id,
        prompt_ids=ids,
        eos_ids=case.eos_ids if case.eos_ids is not None else target.eos_ids,
    )
    if case.processors and runner not in ("engine", "mlx_lm"):
        raise ValueError(f"runner {runner!r} has no logits processors; {case.case_id} needs them")
    if runner == "engine":
        body = _run_engine(case, target, draft, ids, dpath)
    elif runner == "mlx_lm":
        from oracles import mlx_lm as oracle
        from traces.reference import ReferenceRefused

        try:
            body = oracle.run(
                target.model,
                target.tokenizer,
                ids,
                draft=draft.model if draft is not None else None,
                gamma=case.gamma,
                max_tokens=case.max_tokens,
                temperature=case.temperature,
                top_p=case.top_p,
                top_k=case.top_k,
                seed=case.seed,
                eos_ids=list(case.eos_ids) if case.eos_ids is not None else None,
                stop_sequences=[list(s) for s in case.stop_sequences],
                logits_processors=processor_params(case).kwargs() if case.processors else None,
                processor_history=processor_params(case).history_prompt if case.processors else None,
                kv_bits=case.kv_bits, kv_group_size=case.kv_group_size,
                quantized_kv_start=case.quantized_kv_start,
            )
        except ReferenceRefused as exc:
            raise ReferenceRefused(runner, case.case_id, exc.message) from None
    elif runner == "optiq" and case.source == "assistant":
        from oracles import optiq

        body = optiq.run_assistant(
            target.model, str(dpath), ids, gamma=case.gamma, max_tokens=case.max_tokens,
            eos_id=(case.eos_ids or target.eos_ids)[0],
        )
    elif runner == "deepspec":
        from oracles import deepspec
        from zoo.dspark import artifact_dir

        if case.source != "deepspec" or dpath is None:
            raise ValueError(f"the deepspec runner runs deepspec cases only, not {case.case_id}")
        body = deepspec.run(
            artifact_dir(f"{case.target}-hf"),
            dpath,
            ids,
            max_tokens=case.max_tokens,
            confidence_threshold=dspark_drafter(case)[1],
            eos_ids=list(case.eos_ids) if case.eos_ids is not None else list(target.eos_ids),
            seed=case.seed,
        )
    elif runner == "optiq":
        from oracles import optiq

        body = optiq.run(
            target.model,
            target.tokenizer,
            ids,
            ngram=case.source == "ngram" and case.drafter is not None,
            gamma=case.gamma,
            ngram_min=1,
            ngram_max=3,
            max_tokens=case.max_tokens,
            temperature=case.temperature,
            top_p=case.top_p,
            top_k=case.top_k,
            seed=case.seed,
            eos_ids=list(case.eos_ids) if case.eos_ids is not None else None,
        )
    else:
        raise ValueError(f"unknown runner {runner!r}; known: {', '.join(RUNNER_NAMES)}")
    return [header, *body]


def _run_engine(case: Case, target: Any, draft: Any, ids: list[int], dpath: Path | None = None) -> list[dict[str, Any]]:
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.sampler import SamplerParams
    from engine.sources.two_model import TwoModelProvider

    params = GenerationParams(
        max_tokens=case.max_tokens,
        gamma=case.gamma,
        sampler=SamplerParams(temperature=case.temperature, top_p=case.top_p, top_k=case.top_k,
                              processors=processor_params(case)),
        seed=case.seed,
        eos_ids=case.eos_ids if case.eos_ids is not None else target.eos_ids,
        stop_sequences=case.stop_sequences,
        rotating=case.rotating,
        **kv_params(case),
    )
    if case.drafter is None:
        result = plain_generate(target.model, ids, params)
    elif case.source in DSPARK_SOURCES:
        from engine.sources import make_provider

        assert dpath is not None
        provider = make_provider(case.source, model=dpath, confidence_threshold=dspark_drafter(case)[1])
        params = replace(params, prefill="full" if case.source == "deepspec" else params.prefill)
        result = spec_generate(target.model, provider, ids, params)
    elif case.source == "two-model":
        provider = TwoModelProvider(draft.model, draft_tokenizer=draft.tokenizer)
        provider.check_target(target.model, target.tokenizer)
        result = spec_generate(target.model, provider, ids, params)
    elif case.source == "ngram":
        from engine.sources import make_provider

        result = spec_generate(target.model, make_provider("ngram", gamma=case.gamma), ids, params)
    elif case.source in HEAD_SOURCES:
        from engine.sources import make_provider

        provider = make_provider(case.source, path=dpath)
        result = spec_generate(target.model, provider, ids, params)
    else:
        raise ValueError(f"the engine runner has no source {case.source!r} yet")
    return [*result.records, result.footer()]
