"""``specparity generate``: the engine on any local mlx-lm model directory."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from specparity.commands import int_list, positive

NAME = "generate"
HELP = "generate with the engine on local mlx-lm model dirs"


def add_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--target", required=True, help="target model directory")
    g.add_argument("--draft", default=None, help="drafter model directory (omit for plain decode)")
    g.add_argument("--source", default="two-model",
                   help="draft source kind: two-model (default), mtp (qwen3_5_mtp head dir), "
                        "assistant (gemma4_assistant drafter dir), deepspec (Gemma4DSparkModel "
                        "drafter dir), dspark (dspark.json drafter dir)")
    g.add_argument("--confidence-threshold", type=float, default=None,
                   help="deepspec/dspark: prune the block at the first position whose confidence is "
                        "below this (deepspec default 0 = whole block; dspark default: the checkpoint's "
                        "calibrated thresholds)")
    g.add_argument("-n", "--max-tokens", type=positive, default=64)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=int_list, help="comma-separated prompt token ids")
    g.add_argument("--gamma", type=int, default=3)
    g.add_argument("--temp", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prefill", choices=("tail-split", "full"), default=None)
    g.add_argument("--trace", type=Path, default=None, help="write the trace (JSONL) here")


def main(args: argparse.Namespace) -> int:
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.models import load
    from engine.sampler import SamplerParams
    from engine.sources import make_provider
    from traces.io import write_trace
    from traces.records import make_header

    target = load(args.target)
    head_source = args.source in ("mtp", "assistant", "deepspec", "dspark")
    draft = load(args.draft) if args.draft and not head_source else None
    if args.prompt is not None:
        ids = list(target.tokenizer.encode(args.prompt))
    else:
        ids = list(args.prompt_ids)
    if not ids:
        raise ValueError("the prompt encodes to zero tokens")
    params = GenerationParams(
        max_tokens=args.max_tokens, gamma=args.gamma,
        sampler=SamplerParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k),
        seed=args.seed, prefill=args.prefill, eos_ids=target.eos_ids,
    )
    detok = target.tokenizer.detokenizer
    detok.reset()

    def on_token(tok: int) -> None:
        detok.add_token(tok)
        sys.stdout.write(detok.last_segment)
        sys.stdout.flush()

    if head_source and args.source in ("deepspec", "dspark"):
        if not args.draft:
            raise ValueError(f"--source {args.source} needs --draft DIR (the drafter checkpoint)")
        kw = {} if args.confidence_threshold is None else {"confidence_threshold": args.confidence_threshold}
        provider = make_provider(args.source, model=args.draft, **kw)
        # γ is pinned to the checkpoint's block (§3); both sources prefill the full prompt
        params = replace(params, gamma=provider.gamma, prefill=args.prefill or "full")  # type: ignore[attr-defined]
        result = spec_generate(target.model, provider, ids, params, on_token=on_token)
    elif head_source:
        if not args.draft:
            raise ValueError(f"--source {args.source} needs --draft DIR (the head directory)")
        provider = make_provider(args.source, path=args.draft)
        provider.check_target(target.model, target.tokenizer)  # type: ignore[attr-defined]
        result = spec_generate(target.model, provider, ids, params, on_token=on_token)
    elif draft is None:
        result = plain_generate(target.model, ids, params, on_token=on_token)
    else:
        provider = make_provider(args.source, draft_model=draft.model, draft_tokenizer=draft.tokenizer)
        provider.check_target(target.model, target.tokenizer)  # type: ignore[attr-defined]
        result = spec_generate(target.model, provider, ids, params, on_token=on_token)
    detok.finalize()
    sys.stdout.write(detok.last_segment + "\n")
    u = result.usage
    msg = f"[{u.generation_tokens} tokens, finish={u.finish_reason}, {result.wall_s:.2f} s"
    if result.speculation:
        s = result.speculation
        msg += (f", accepted {s.accepted}/{s.drafted} ({s.acceptance_rate:.1%}), "
                f"target calls {s.target_calls}, tau {u.generation_tokens / max(s.target_calls, 1):.2f}")
    print(msg + "]", file=sys.stderr)
    if args.trace:
        from engine.models import file_digest

        def ident(m):  # noqa: ANN001, ANN202
            return {"path": str(m.path), "weights_sha256": file_digest(list(m.path.glob("model*.safetensors"))),
                    "config_sha256": file_digest([m.path / "config.json"])}

        header = make_header(
            runner={"name": "engine", "package": "specparity", "version": "0.1.0"},
            mode="spec" if draft or head_source else "plain",
            source=args.source if draft or head_source else None,
            case_id=f"generate/{Path(args.target).name}", target=ident(target),
            drafter=(ident(draft) if draft else ({"path": args.draft, "weights_sha256": file_digest(
                list(Path(args.draft).glob("*.safetensors"))), "config_sha256": file_digest(
                [Path(args.draft) / "config.json"])} if head_source else None)), tokenizer_sha256=None,
            params={"gamma": params.gamma if draft or head_source else None, "max_tokens": args.max_tokens,
                    "temperature": args.temp, "top_p": args.top_p, "top_k": args.top_k, "min_p": 0.0,
                    "seed": args.seed, "prefill": params.prefill or ("full" if head_source else "tail-split"),
                    "prefill_step_size": 512 if draft or head_source else 2048,
                    "confidence_threshold": args.confidence_threshold},
            prompt_id="cli", prompt_ids=ids, eos_ids=target.eos_ids,
        )
        write_trace(args.trace, [header, *result.records, result.footer()])
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0
