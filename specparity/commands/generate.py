"""``specparity generate``: the engine on any local mlx-lm model directory.

The draft source is the §3 kind of ``--draft`` (``engine.sources.detect``:
``dspark.json`` → dspark, ``Gemma4DSparkModel`` → deepspec, ``*assistant*``
→ assistant, ``*_mtp`` → mtp, a checkpoint carrying MTP layers → native-mtp,
else two-model) unless ``--source`` names one; ``--source ngram`` is model-free;
no ``--draft`` and no ``--source`` is plain decode. Tokens stream to stdout,
statistics to stderr; ``--trace`` writes the run's trace.

The flags describe a case (``specparity.cli.case_args``); the case opens its drafter
through ``specparity.runners.open_for_case`` and ``--trace``'s header is
``specparity.runners.case_header``'s, exactly as ``record``/``run_case`` write them.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from specparity.cases.prompts import CHAT_TEMPLATE_HELP
from specparity.cli import args as a
from specparity.cli.args import token_id_list
from specparity.cli.devices import add_device_argument
from specparity.cli.kv_args import add_kv_arguments
from specparity.cli.processor_args import add_processor_arguments

NAME = "generate"
HELP = "generate with the engine on local mlx-lm model dirs"


def add_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--target", required=True, type=a.model_dir, help="target model directory")
    g.add_argument("--draft", default=None, type=a.model_dir, help="drafter directory (omit for plain decode or --source ngram)")
    from engine.sources import roster_help

    g.add_argument("--source", default="auto",
                   help=f"draft source kind: auto (detect from --draft, §3), {roster_help()}")
    g.add_argument("--confidence-threshold", type=a.finite_float, default=None,
                   help="deepspec/dspark: prune the block at the first position whose confidence is "
                        "below this (deepspec default 0 = whole block; dspark default: the checkpoint's "
                        "calibrated thresholds)")
    g.add_argument("--mtp-conventions", type=a.mtp_conventions, default=None, metavar="NAME=VALUE,...",
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
    g.add_argument("--min-p", type=a.min_p, default=0.0,
                   help="drop tokens below this fraction of the top token's probability (default 0: off)")
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


def main(args: argparse.Namespace) -> int:
    import contextlib

    from specparity.cli.outdir import claim_output_file

    with contextlib.ExitStack() as stack:
        if args.trace is not None:  # locked and checked ours before any model loads
            stack.enter_context(claim_output_file(args.trace, "specparity generate", flag="--trace",
                                                  what="trace", ours=a.is_trace))
        return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    from specparity.cli.devices import use_device

    use_device(args.device)
    from engine.executor import plain_generate, spec_generate
    from specparity.cli.case_args import case_from_args
    from specparity.runners import (
        case_header,
        case_paths,
        generation_params,
        load_model,
        open_for_case,
    )
    from specparity.runners.registry import get
    from traces.io import write_trace

    # The case (ids checked against the vocabulary and context, unique case id, γ pinned for
    # a block drafter); its drafter opens as every runner's does (open_for_case).
    case = case_from_args(args)
    from specparity.cli.kv_args import check_kv_models

    # a KV group size the head dim rejects: refused before any token (as run); a grammar that
    # admits no output is refused by compile_grammar below, also before any token
    check_kv_models([case])
    target = load_model(str(case.target_path))  # loaded once (case_from_args)
    ids = list(case.prompt_tokens or ())
    eos_ids = tuple(args.eos_ids) if args.eos_ids else target.eos_ids
    src = open_for_case(case, target, prefill=args.prefill)
    kind = src.kind.name if src.kind is not None else None
    # the case's params, as every runner runs it; digests hash every cache each round
    # (quadratic in length): only for a trace
    params = replace(generation_params(case, eos_ids), gamma=src.gamma, prefill=src.prefill,
                     cache_digests=args.trace is not None)
    if case.grammar:
        from specparity.runners.engine import compile_grammar

        params = replace(params, grammar=compile_grammar(case.grammar, target, eos_ids, case.reasoning_end))

    detok = target.tokenizer.detokenizer
    detok.reset()

    def on_token(tok: int) -> None:
        detok.add_token(tok)
        sys.stdout.write(detok.last_segment)
        sys.stdout.flush()

    if kind is None:
        result = plain_generate(target.model, ids, params, on_token=on_token)
    else:
        result = spec_generate(target.model, src.make(), ids, params, on_token=on_token)
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
        tpath, dpath = case_paths(case)
        draft = load_model(str(dpath)) if dpath is not None and src.kind is not None and src.kind.loads_model else None
        header = case_header(get("engine").runner_info(), case, ids, tpath=tpath, dpath=dpath, target=target,
                             draft=draft, prefill=src.prefill)
        write_trace(args.trace, [header, *result.records, result.footer()])
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0
