"""Run one case with one runner and return its trace; the case helpers every runner shares.

Which runners exist and what each implements is the registry
(:mod:`specparity.runners.registry`; one declaration module per runner in this
package, docs/runners.md); :func:`run_case` loads the case's models, writes the
header and hands the rest to the runner's ``run``. Models are loaded once per
process and shared (importing mlx-lm and loading costs seconds; the zoo models
are tiny).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from specparity.cases import Case
from specparity.runners import registry
from specparity.runners.registry import CaseRun, Runner, RunnerUnsupported
from traces.records import make_header

HEAD_SOURCES = ("mtp", "assistant")  # drafters that are heads over the target (zoo/heads.py)
DSPARK_SOURCES = ("deepspec", "dspark")  # block drafters (zoo/dspark.py artifacts)
NATIVE_SOURCE = "native-mtp"  # MTP layers inside the target checkpoint (zoo/native_mtp.py)


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


def _identity(path: str) -> dict[str, Any]:
    """:func:`model_identity` with the weights digest cached per content stamp
    (``specparity.cases.cached_weights_digest``): a checkpoint rewritten in place is
    re-hashed, an unchanged one is not."""
    from specparity.cases import cached_weights_digest
    from zoo.dspark import _config_sha

    return {"path": path, "weights_sha256": cached_weights_digest(path),
            "config_sha256": _config_sha(Path(path))}


def case_paths(case: Case) -> tuple[Path, Path | None]:
    import zoo
    from zoo.native_mtp import TARGETS as NATIVE_TARGETS

    if case.on_zoo and case.target in NATIVE_TARGETS:
        from zoo.native_mtp import target_paths

        tdir, ckpt = target_paths(case.target)
        return tdir, (ckpt if case.drafter is not None else None)
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
    if case.drafter is not None and case.source == NATIVE_SOURCE:
        from engine.sources.native_mtp import describe

        # header objects may carry extra keys: every MTP convention is recorded
        return {**_base_params(case, "full"),
                "mtp_conventions": describe(case_paths(case)[1], native_conventions(case))}
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
    if case.grammar:  # absent when unconstrained; the text lets grade re-run the case
        from zoo.grammars import spec

        extra["grammar"] = spec(case.grammar).to_dict()
        if getattr(case, "reasoning_end", ""):  # absent without a marker: older traces unchanged
            extra["grammar"]["reasoning_end"] = case.reasoning_end
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
    draft = load_model(str(dpath)) if dpath is not None and case.source not in (
        *HEAD_SOURCES, *DSPARK_SOURCES, NATIVE_SOURCE) else None
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
            from specparity.prompts import PromptError

            try:
                check_ids_for_model(ids, dpath, max_tokens=case.max_tokens, prompt_id=case.prompt_id)
            except PromptError as exc:  # a padded target's row past the drafter's, say so
                raise PromptError(f"drafter {dpath}: {exc}") from None
    tokenizer_sha256 = zoo.tokenizer_digest() if case.on_zoo else tokenizer_digest(tpath)
    params = case_params(case, "full" if case.source in HEAD_SOURCES and case.drafter else "tail-split")
    if params.get("rotating") == "exact":  # where mlx-lm's rollback stops (traces.reference)
        from engine.rollback import ring_window

        params["sliding_window"] = ring_window(target.model, draft.model if draft is not None else None)
    header = make_header(
        runner=r.runner_info(),
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
    body = r.run(CaseRun(case=case, target=target, draft=draft, ids=ids, tpath=tpath, dpath=dpath))
    return [header, *body]


def runner_supports(runner: str, case: Case) -> bool:
    """Whether ``runner`` implements ``case``'s draft source and every option it uses."""
    return registry.supports(runner, case)
