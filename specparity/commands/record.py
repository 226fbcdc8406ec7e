"""``specparity record --runner NAME``: a reference trace for any case.

Takes ``generate``'s flags (target, drafter, source, prompt, γ, sampling, EOS
ids, logits processors) and runs the case with a reference runner instead of
the engine: ``mlx_lm`` here; ``optiq``, ``hf_prompt_lookup``, ``mlx_vlm``,
``deepspec`` in the environments that install them (``--runner all``: every
per-case runner whose package is importable here; ``engine`` is accepted too). The trace
is written as ``specparity run`` writes it (``specparity.runners.run_case``),
to ``--trace FILE`` (one runner) or ``--out DIR/<runner>/<case>.jsonl``.
A reference that refuses the case (e.g. mlx-lm on a non-trimmable cache) is
reported with its reason and exit status 1.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Any

NAME = "record"
HELP = "record a reference trace (mlx_lm, optiq, ...) for any case, with generate's flags"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specparity.commands import generate

    generate.add_arguments(p)
    p.add_argument("--runner", required=True,
                   help="reference runner: mlx_lm, optiq, hf_prompt_lookup, mlx_vlm, deepspec, engine, "
                        "or 'all' (every runner importable here)")
    p.add_argument("--out", type=Path, default=None,
                   help="write DIR/<runner>/<case>.jsonl (default: --trace FILE, or runs/record)")


def prompt_id_for(ids: list[int], given: str | None) -> str:
    """``--prompt-id`` or ``cli-<8 hex>`` of the token ids (distinct prompts, distinct ids)."""
    if given:
        return given
    return "cli-" + hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:8]


def case_from_args(args: argparse.Namespace) -> Any:
    """The :class:`specparity.cases.Case` that ``generate``/``record`` flags describe."""
    from engine.sources.detect import resolve_kind
    from specparity.cases import Case, model_label
    from specparity.prompts import check_ids_for_model
    from specparity.runners import load_model

    target = load_model(str(Path(args.target).expanduser().resolve()))
    if args.prompt is not None:
        ids = list(target.tokenizer.encode(args.prompt))
        if not ids:
            raise ValueError("the prompt encodes to zero tokens")
    else:
        ids = list(args.prompt_ids)
    pid = prompt_id_for(ids, getattr(args, "prompt_id", None))
    ids = check_ids_for_model(ids, target.path, max_tokens=args.max_tokens, prompt_id=pid)
    speculative = args.draft is not None or args.source not in ("auto", None)
    kind = resolve_kind(args.source, args.draft) if speculative else None
    drafter = dpath = None
    if kind == "ngram":
        drafter = "ngram"
    elif kind is not None:
        dpath = str(Path(args.draft).expanduser().resolve())
        label = model_label(dpath)
        if kind in ("deepspec", "dspark"):
            drafter = f"{kind}-{label}-t{args.confidence_threshold or 0:g}"
        else:
            drafter = label if kind == "two-model" else f"{kind}-{label}"
    processors = ""
    try:
        from specparity.processor_args import processors_from_args

        proc = processors_from_args(args)
        processors = proc.tag() if proc.active else ""
    except (ImportError, AttributeError):
        pass
    eos = tuple(args.eos_ids) if getattr(args, "eos_ids", None) else None
    from specparity.kv_args import cache_fields

    kw: dict[str, Any] = {"processors": processors} if processors else {}
    kw.update(cache_fields(args))
    return Case(
        target=model_label(target.path), drafter=drafter, prompt_id=pid,
        gamma=args.gamma if kind else 0, max_tokens=args.max_tokens, temperature=args.temp,
        seed=args.seed, eos_ids=eos, source=kind or "two-model", top_p=args.top_p, top_k=args.top_k,
        target_path=str(target.path), draft_path=dpath, prompt_tokens=tuple(ids), **kw,
    )


def main(args: argparse.Namespace) -> int:
    from oracles import RUNNERS, run_availability
    from specparity.devices import use_device
    from specparity.run import run_task
    from traces.io import write_trace

    use_device(args.device)  # --device comes with generate's flags
    case = case_from_args(args)
    if args.runner == "all":
        runners = ["engine", *[r for r in RUNNERS if run_availability(r)[0]]]
    else:
        runners = [r.strip() for r in args.runner.split(",") if r.strip()]
        for r in runners:
            if r == "engine":
                continue
            if r not in RUNNERS:
                raise ValueError(f"--runner: unknown runner {r!r}; known: engine, {', '.join(RUNNERS)}")
            ok, why = run_availability(r)
            if not ok:
                raise ValueError(f"--runner {r}: not importable here: {why}")
    if args.trace is not None and len(runners) > 1:
        raise ValueError("--trace names one file; with several runners use --out DIR")
    out = args.out if args.out is not None else Path("runs/record")
    failed = 0
    for r in runners:
        kind, payload = run_task(r, case)
        if kind == "refused":
            print(f"{r} refused {case.case_id}: {payload}", file=sys.stderr)
            failed += 1
            continue
        path = args.trace if args.trace is not None else out / r / f"{case.file_stem}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_trace(path, payload)
        footer = payload[-1]
        print(f"{r}: {case.case_id}: {footer['usage']['generation_tokens']} tokens, "
              f"finish={footer['usage']['finish_reason']} -> {path}", file=sys.stderr)
    return 1 if failed else 0
