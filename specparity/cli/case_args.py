"""The case that ``generate``/``record``'s flags describe (shared by both commands).

``--target``/``--draft``/``--source`` and the prompt flags name the models and
the draft source (``engine.sources.detect.resolve_kind``, §3); the ids are
checked against the target's vocabulary and context; the case id is unique to
the models, prompt and settings (``specparity.cases.case.Case``).
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def prompt_id_for(ids: list[int], given: str | None) -> str:
    """``--prompt-id`` or ``cli-<8 hex>`` of the token ids (distinct prompts, distinct ids)."""
    if given:
        return given
    return "cli-" + hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:8]


def _conventions_kinds() -> str:
    from engine.sources.kind import all_kinds

    return "/".join(k.name for k in all_kinds() if "conventions" in k.options)


def case_from_args(args: argparse.Namespace) -> Any:
    """The :class:`specparity.cases.case.Case` that ``generate``/``record`` flags describe."""
    from engine.sources.detect import resolve_kind
    from specparity.cases.case import Case, model_label
    from specparity.cases.prompts import check_ids_for_model, encode_text
    from specparity.runners import load_model

    target = load_model(str(Path(args.target).expanduser().resolve()))
    chat = getattr(args, "chat_template", False)
    if args.prompt is not None:
        ids = encode_text(target.tokenizer, args.prompt, chat_template=chat, where="--prompt",
                          model_dir=target.path)
    else:
        if chat:
            raise ValueError("--chat-template renders a text prompt (--prompt), not --prompt-ids")
        ids = list(args.prompt_ids)
    pid = prompt_id_for(ids, getattr(args, "prompt_id", None))
    ids = check_ids_for_model(ids, target.path, max_tokens=args.max_tokens, prompt_id=pid)
    speculative = args.draft is not None or args.source not in ("auto", None)
    kind = resolve_kind(args.source, args.draft) if speculative else None
    conv = getattr(args, "mtp_conventions", None)
    drafter = dpath = None
    gamma = args.gamma if kind else 0
    if kind is not None:
        from engine.sources.kind import get
        from specparity.cases.case import drafter_label

        desc = get(kind)
        if conv and "conventions" not in desc.options:
            raise ValueError(f"--mtp-conventions applies to the {_conventions_kinds()} source, not {kind}")
        if conv:
            from engine.sources.native_mtp import Conventions

            Conventions.parse(conv)  # a bad name or value: one line, exit 2
        if desc.takes_dir:
            dpath = str(Path(args.draft).expanduser().resolve())
            if desc.pinned_gamma is not None:  # a block drafter runs its checkpoint's block (§3)
                try:
                    gamma = desc.pinned_gamma(Path(dpath))
                except (OSError, ValueError, KeyError, TypeError):
                    pass  # not this kind's artifact: opening it says why, in one line
        drafter = drafter_label(kind, dpath, confidence_threshold=getattr(args, "confidence_threshold", None),
                                conventions=conv)
    elif conv:
        raise ValueError(f"--mtp-conventions applies to the {_conventions_kinds()} source, not plain decode")
    processors = ""
    try:
        from specparity.cli.processor_args import processors_from_args

        proc = processors_from_args(args)
        processors = proc.tag() if proc.active else ""
    except (ImportError, AttributeError):
        pass
    eos = tuple(args.eos_ids) if getattr(args, "eos_ids", None) else None
    from specparity.cli.kv_args import cache_fields

    kw: dict[str, Any] = {"processors": processors} if processors else {}
    kw.update(cache_fields(args))  # --kv-bits/--kv-group-size/--quantized-kv-start, --rotating
    if getattr(args, "grammar", None):
        kw["grammar"] = args.grammar  # --grammar FILE (resolved) or a zoo grammar name
    if getattr(args, "min_tokens", 0):
        kw["min_tokens"] = int(args.min_tokens)
    if getattr(args, "rng", "stream") != "stream":
        kw["rng"] = str(args.rng)
    if getattr(args, "min_p", 0.0):
        kw["min_p"] = float(args.min_p)
    if getattr(args, "reasoning_end", None):
        if not getattr(args, "grammar", None):
            raise ValueError("--reasoning-end needs --grammar (the marker ends the free part of a "
                             "grammar-constrained output)")
        kw["reasoning_end"] = args.reasoning_end
    return Case(
        target=model_label(target.path), drafter=drafter, prompt_id=pid,
        gamma=gamma, max_tokens=args.max_tokens, temperature=args.temp,
        seed=args.seed, eos_ids=eos, source=kind or "two-model", top_p=args.top_p, top_k=args.top_k,
        target_path=str(target.path), draft_path=dpath, prompt_tokens=tuple(ids), **kw,
    )


def check_grammars(cases: Sequence[Any]) -> None:
    """Each (grammar, target) of ``cases`` compiled once before anything runs
    (``specparity.runners.engine.compile_grammar``): a grammar the target's tokenizer cannot
    compile, or one that admits no output, is one line (exit 2) here, not an error (or an empty
    "success") in the middle of the run."""
    from specparity.runners import case_paths, load_model
    from specparity.runners.engine import compile_grammar

    seen: set[tuple[str, str, str]] = set()
    for c in cases:
        if not c.grammar:
            continue
        tpath, _ = case_paths(c)
        key = (c.grammar, getattr(c, "reasoning_end", ""), str(tpath))
        if key in seen:
            continue
        seen.add(key)
        target = load_model(str(tpath))
        compile_grammar(c.grammar, target, tuple(c.eos_ids or target.eos_ids), key[1])
