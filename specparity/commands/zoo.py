"""``specparity zoo list``: each zoo pair with its measured greedy acceptance."""

from __future__ import annotations

import argparse

from specparity.cases.prompts import CHAT_TEMPLATE_HELP
from specparity.cli import args as a
from specparity.commands import positive

NAME = "zoo"
HELP = "the tiny zoo"


def add_arguments(z: argparse.ArgumentParser) -> None:
    zsub = z.add_subparsers(dest="zoo_command", required=True)
    zl = zsub.add_parser("list", help="each target/drafter pair with measured greedy acceptance")
    zl.add_argument("--gamma", type=a.gamma, default=3)
    zl.add_argument("--max-tokens", type=positive, default=32)
    zl.add_argument("--prompts-file", type=a.readable_file, default=None,
                    help="measure on these prompts (JSONL or one per line) instead of the zoo's")
    # --chat-template (issue 22): text prompts through the tokenizer's chat template
    zl.add_argument("--chat-template", action="store_true", help=CHAT_TEMPLATE_HELP)


def main(args: argparse.Namespace) -> int:
    import zoo
    from specparity.runners import load_model

    which = "the file's" if args.prompts_file else f"{len(zoo.prompts())} zoo"
    print(f"{'target':8} {'drafter':8} {'acceptance':>10} {'tau':>6}   (greedy, gamma={args.gamma}, "
          f"{args.max_tokens} tokens x {which} prompts, engine two-model)")
    from engine.executor import GenerationParams, spec_generate
    from engine.sources.two_model import TwoModelProvider
    from specparity.cases.prompts import prompts_for_model

    for target, drafter in zoo.pairs():
        tdir, ddir = zoo.pair(target, drafter)
        t, d = load_model(str(tdir)), load_model(str(ddir))
        params = GenerationParams(max_tokens=args.max_tokens, gamma=args.gamma, eos_ids=t.eos_ids)
        drafted = accepted = tokens = calls = 0
        for p in prompts_for_model(tdir, prompts_file=args.prompts_file, max_tokens=args.max_tokens,
                                   chat_template=args.chat_template):
            r = spec_generate(t.model, TwoModelProvider(d.model), list(p.token_ids), params)
            assert r.speculation is not None
            drafted += r.speculation.drafted
            accepted += r.speculation.accepted
            calls += r.speculation.target_calls
            tokens += r.usage.generation_tokens
        print(f"{target:8} {drafter:8} {accepted / max(drafted, 1):>10.1%} {tokens / max(calls, 1):>6.2f}")
    return 0
