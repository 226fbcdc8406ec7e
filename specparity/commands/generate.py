"""``specparity generate``: the engine on any local mlx-lm model directory.

The draft source is the §3 kind of ``--draft`` (``engine.sources.detect``:
``dspark.json`` → dspark, ``Gemma4DSparkModel`` → deepspec, ``*assistant*``
→ assistant, ``*_mtp`` → mtp, else two-model) unless ``--source`` names one;
``--source ngram`` is model-free; no ``--draft`` and no ``--source`` is plain
decode. Tokens stream to stdout, statistics to stderr; ``--trace`` writes the
run's trace.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from specparity.commands import int_list, positive
from specparity.devices import add_device_argument

NAME = "generate"
HELP = "generate with the engine on local mlx-lm model dirs"


def add_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--target", required=True, help="target model directory")
    g.add_argument("--draft", default=None, help="drafter directory (omit for plain decode or --source ngram)")
    g.add_argument("--source", default="auto",
                   help="draft source kind: auto (detect from --draft, §3), two-model, ngram, mtp "
                        "(qwen3_5_mtp head dir), assistant (gemma4_assistant dir), deepspec "
                        "(Gemma4DSparkModel dir), dspark (dspark.json dir)")
    g.add_argument("--confidence-threshold", type=float, default=None,
                   help="deepspec/dspark: prune the block at the first position whose confidence is "
                        "below this (deepspec default 0 = whole block; dspark default: the checkpoint's "
                        "calibrated thresholds)")
    g.add_argument("-n", "--max-tokens", type=positive, default=64)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=int_list, help="comma-separated prompt token ids")
    g.add_argument("--gamma", type=positive, default=3, help="draft length (block drafters pin their own)")
    g.add_argument("--temp", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prefill", choices=("tail-split", "full"), default=None,
                   help="default: the source's own convention (tail-split for two-model/ngram)")
    g.add_argument("--trace", type=Path, default=None, help="write the trace (JSONL) here")
    add_device_argument(g)


def _identity(path: Path | None) -> dict[str, Any] | None:
    from engine.models import file_digest

    if path is None:
        return None
    weights = sorted(path.glob("*.safetensors"))
    config = path / "config.json"
    return {
        "path": str(path),
        "weights_sha256": file_digest(weights) if weights else None,
        "config_sha256": file_digest([config]) if config.is_file() else None,
    }


def main(args: argparse.Namespace) -> int:
    from specparity.devices import use_device

    use_device(args.device)
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.models import load
    from engine.sampler import SamplerParams
    from engine.sources import open_drafter
    from engine.sources.detect import resolve_kind
    from traces.io import write_trace
    from traces.records import make_header

    target = load(args.target)
    ids = list(target.tokenizer.encode(args.prompt)) if args.prompt is not None else list(args.prompt_ids)
    if not ids:
        raise ValueError("the prompt encodes to zero tokens")
    params = GenerationParams(
        max_tokens=args.max_tokens, gamma=args.gamma,
        sampler=SamplerParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k),
        seed=args.seed, prefill=args.prefill, eos_ids=target.eos_ids,
    )
    speculative = args.draft is not None or args.source not in ("auto", None)
    kind = resolve_kind(args.source, args.draft) if speculative else None

    detok = target.tokenizer.detokenizer
    detok.reset()

    def on_token(tok: int) -> None:
        detok.add_token(tok)
        sys.stdout.write(detok.last_segment)
        sys.stdout.flush()

    if kind is None:
        result = plain_generate(target.model, ids, params, on_token=on_token)
    else:
        provider, gamma = open_drafter(kind, args.draft, gamma=args.gamma,
                                       confidence_threshold=args.confidence_threshold)
        check = getattr(provider, "check_target", None)
        if check is not None:
            check(target.model, target.tokenizer)
        params = replace(params, gamma=gamma)
        result = spec_generate(target.model, provider, ids, params, on_token=on_token)
    detok.finalize()
    sys.stdout.write(detok.last_segment + "\n")

    u = result.usage
    msg = f"[{u.generation_tokens} tokens, finish={u.finish_reason}, {result.wall_s:.2f} s"
    if kind is not None and result.speculation:
        s = result.speculation
        msg += (f", source {kind}, gamma {params.gamma}, accepted {s.accepted}/{s.drafted} "
                f"({s.acceptance_rate:.1%}), target calls {s.target_calls}, "
                f"tau {u.generation_tokens / max(s.target_calls, 1):.2f}")
    print(msg + "]", file=sys.stderr)
    fallback = next((r for r in result.records if r["type"] == "plain" and "detail" in r), None)
    if fallback is not None:
        before = sum(len(r["emitted"]) for r in result.records[: result.records.index(fallback)]
                     if r["type"] in ("round", "plain"))
        print(f"[speculation stopped after {before} tokens ({fallback['reason']}): {fallback['detail']}]",
              file=sys.stderr)

    if args.trace:
        first_plain = next((r for r in result.records if r["type"] == "plain"), None)
        header = make_header(
            runner={"name": "engine", "package": "specparity", "version": "0.1.0"},
            mode="spec" if kind else "plain", source=kind,
            case_id=f"generate/{Path(args.target).name}", target=_identity(target.path),
            drafter=_identity(Path(args.draft)) if args.draft else None, tokenizer_sha256=None,
            params={"gamma": params.gamma if kind else None, "max_tokens": args.max_tokens,
                    "temperature": args.temp, "top_p": args.top_p, "top_k": args.top_k, "min_p": 0.0,
                    "seed": args.seed,
                    "prefill": "full" if (first_plain and first_plain["reason"] == "initial") else "tail-split",
                    "prefill_step_size": 512 if kind else 2048,
                    "confidence_threshold": args.confidence_threshold},
            prompt_id="cli", prompt_ids=ids, eos_ids=target.eos_ids,
        )
        write_trace(args.trace, [header, *result.records, result.footer()])
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0
