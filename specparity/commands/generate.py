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

from specparity import args as a
from specparity.args import token_id_list
from specparity.devices import add_device_argument
from specparity.kv_args import add_kv_arguments
from specparity.processor_args import add_processor_arguments, processors_from_args
from specparity.prompts import CHAT_TEMPLATE_HELP

NAME = "generate"
HELP = "generate with the engine on local mlx-lm model dirs"


def add_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--target", required=True, type=a.model_dir, help="target model directory")
    g.add_argument("--draft", default=None, type=a.model_dir, help="drafter directory (omit for plain decode or --source ngram)")
    g.add_argument("--source", default="auto",
                   help="draft source kind: auto (detect from --draft, §3), two-model, ngram, mtp "
                        "(qwen3_5_mtp head dir), assistant (gemma4_assistant dir), deepspec "
                        "(Gemma4DSparkModel dir), dspark (dspark.json dir), native-mtp (a checkpoint carrying its "
                        "own MTP layers: model.layers.{N}.* or mtp.*)")
    g.add_argument("--confidence-threshold", type=a.finite_float, default=None,
                   help="deepspec/dspark: prune the block at the first position whose confidence is "
                        "below this (deepspec default 0 = whole block; dspark default: the checkpoint's "
                        "calibrated thresholds)")
    g.add_argument("--mtp-conventions", default=None, metavar="NAME=VALUE,...",
                   help="native-mtp: conventions over the checkpoint family's defaults, e.g. "
                        "hidden=pre-norm,concat=h;e,position_base=1,mask_pos0=false,depth=chain,"
                        "chain_hidden=pre-norm,trim=rebuild (recorded in the trace header)")
    g.add_argument("-n", "--max-tokens", type=a.max_tokens, default=64)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=token_id_list,
                     help="comma-separated prompt token ids (each in [0, vocab size))")
    g.add_argument("--prompt-id", default=None,
                   help="the prompt's id in the case id (default cli-<digest of its token ids>)")
    g.add_argument("--eos-ids", type=token_id_list, default=None,
                   help="comma-separated EOS ids (default: the tokenizer's EOS set)")
    g.add_argument("--gamma", type=a.gamma, default=3, help="draft length (block drafters pin their own)")
    g.add_argument("--temp", type=a.nonneg_float, default=0.0)
    g.add_argument("--top-p", type=a.probability, default=0.0)
    g.add_argument("--top-k", type=a.nonneg_int, default=0)
    g.add_argument("--seed", type=a.seed, default=0)
    g.add_argument("--prefill", choices=("tail-split", "full"), default=None,
                   help="default: the source's own convention (tail-split for two-model/ngram)")
    add_kv_arguments(g)
    g.add_argument("--trace", type=a.output_file(a.is_trace, "trace"), default=None,
                   help="write the trace (JSONL) here (an existing file only if it is a trace)")
    # --chat-template (issue 22): text prompts through the tokenizer's chat template
    g.add_argument("--chat-template", action="store_true", help=CHAT_TEMPLATE_HELP)
    add_processor_arguments(g)
    g.add_argument("--grammar", type=a.grammar_ref, default=None, metavar="FILE",
                   help="constrain the output: a JSON schema (.json), a regex (.regex) or a Lark "
                        "grammar (.lark), or a zoo grammar name (json-small, json-item, regex-sentence, "
                        "lark-list); the mask rides the accept walk, the drafter runs free (docs/grammar.md)")
    g.add_argument("--reasoning-end", type=a.reasoning_end, default=None, metavar="TEXT",
                   help="with --grammar: the output is free until the emitted tokens end with TEXT "
                        "(encoded with the target tokenizer, e.g. '</think>'); the grammar masks from the "
                        "next position on (docs/grammar.md)")
    add_device_argument(g)


def _processors_param(proc: Any) -> dict[str, Any]:
    from specparity.runners import processors_block

    return {"logits_processors": processors_block(proc)} if proc.active else {}


def _grammar_param(case: Any) -> dict[str, Any]:
    if not case.grammar:
        return {}
    from zoo.grammars import spec

    block = spec(case.grammar).to_dict()
    if case.reasoning_end:  # absent without a marker: older traces unchanged
        block["reasoning_end"] = case.reasoning_end
    return {"grammar": block}


def _rotating_params(mode: str, kind: str | None, target: Any, provider: Any) -> dict[str, Any]:
    """``rotating`` (+ ``sliding_window``, where mlx-lm's rollback stops) when not the default."""
    if mode == "guard" or kind is None:
        return {}
    from engine.rollback import ring_window

    return {"rotating": mode, "sliding_window": ring_window(target.model, getattr(provider, "model", None))}


def main(args: argparse.Namespace) -> int:
    from specparity.devices import use_device

    use_device(args.device)
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.sampler import SamplerParams
    from engine.sources import open_drafter
    from engine.sources.detect import resolve_kind
    from specparity.case_args import case_from_args
    from specparity.runners import kv_params, load_model, model_identity, tokenizer_digest
    from traces.io import write_trace
    from traces.records import make_header

    # The case (ids checked against the vocabulary and context, unique case id)
    case = case_from_args(args)
    target = load_model(str(case.target_path))  # loaded once (case_from_args)
    ids = list(case.prompt_tokens or ())
    eos_ids = tuple(args.eos_ids) if args.eos_ids else target.eos_ids
    params = GenerationParams(
        max_tokens=args.max_tokens, gamma=args.gamma,
        sampler=SamplerParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                              processors=processors_from_args(args)),
        seed=args.seed, prefill=args.prefill, eos_ids=eos_ids,
        # Digests hash every cache each round (quadratic in length): only for a trace.
        cache_digests=args.trace is not None,
        rotating=args.rotating,
        **kv_params(case),
    )
    if case.grammar:
        from specparity.runners.engine import compile_grammar

        params = replace(params, grammar=compile_grammar(case.grammar, target, eos_ids, case.reasoning_end))
    speculative = args.draft is not None or args.source not in ("auto", None)
    kind = resolve_kind(args.source, args.draft) if speculative else None

    detok = target.tokenizer.detokenizer
    detok.reset()

    def on_token(tok: int) -> None:
        detok.add_token(tok)
        sys.stdout.write(detok.last_segment)
        sys.stdout.flush()

    provider = None
    if kind is None:
        result = plain_generate(target.model, ids, params, on_token=on_token)
    else:
        if kind == "native-mtp":
            from engine.sources import make_provider

            provider, gamma = make_provider(kind, path=args.draft, conventions=args.mtp_conventions), args.gamma
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
            case_id=case.case_id, target=model_identity(target.path),
            drafter=model_identity(Path(case.draft_path)) if case.draft_path else None,
            tokenizer_sha256=tokenizer_digest(target.path),
            params={"gamma": params.gamma if kind else None, "max_tokens": args.max_tokens,
                    "temperature": args.temp, "top_p": args.top_p, "top_k": args.top_k, "min_p": 0.0,
                    "seed": args.seed,
                    "prefill": "full" if (first_plain and first_plain["reason"] == "initial") else "tail-split",
                    "prefill_step_size": 512 if kind else 2048,
                    "confidence_threshold": args.confidence_threshold,
                    **_processors_param(params.sampler.processors),
                    **kv_params(case),
                    **({"mtp_conventions": provider.header_params()} if kind == "native-mtp" else {}),
                    **_rotating_params(args.rotating, kind, target, provider),
                    **_grammar_param(case)},
            prompt_id=case.prompt_id, prompt_ids=ids, eos_ids=eos_ids,
        )
        args.trace.parent.mkdir(parents=True, exist_ok=True)
        write_trace(args.trace, [header, *result.records, result.footer()])
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0
