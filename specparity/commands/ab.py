"""``specparity ab``: paired drafter A/B on one target (``specparity/measure/ab.py``, §4.5 phase 1c).

Prints the verdict and writes ``ab.json`` + ``ab.md`` into ``--out``. ``--out``
is checked writable and locked before anything is measured, and the verdict is
printed before the files are written, so a late write error never throws the
measurement away. Exit 0 whatever the verdict (it is a measurement);
``--strict`` exits 1 on FAIL. A missing op (``engine.backend.run_supported``) is that prompt's
verdict, ``unsupported on <device>: <op>``: the prompt is left out of the pairing and listed (a
reason of the verdict, a section of ``ab.md``, ``unsupported`` in ``ab.json``); when every prompt
is unsupported the verdict is UNSUPPORTED, exit 1 (nothing measured is never a pass).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specparity.cases.prompts import CHAT_TEMPLATE_HELP
from specparity.cli import args as a
from specparity.cli.kv_args import add_kv_arguments, cache_fields

NAME = "ab"
HELP = "paired drafter A/B: McNemar acceptance gate + paired wall-clock verdict"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, type=a.model_ref,
                   help="zoo target (llama, qwen3), trained name or model dir")
    p.add_argument("--drafter-a", required=True, type=a.model_ref,
                   help="baseline drafter: self|twin|small, trained name or dir")
    p.add_argument("--drafter-b", required=True, type=a.model_ref, help="candidate drafter (same forms)")
    p.add_argument("--gamma", type=a.gamma, default=3)
    p.add_argument("--prompts", type=a.positive_int, default=32, help="prompts (default 32; < 32 refused)")
    p.add_argument("--prompts-file", type=a.readable_file, default=None,
                   help="prompts file (JSONL {\"id\",\"text\"|\"token_ids\"} or one per line) instead "
                        "of the zoo's; required for a target outside the zoo's vocabulary")
    # --chat-template (issue 22): text prompts through the tokenizer's chat template
    p.add_argument("--chat-template", action="store_true", help=CHAT_TEMPLATE_HELP)
    p.add_argument("--allow-small", action="store_true", help="allow fewer than 32 prompts")
    p.add_argument("--max-drop", type=a.nonneg_float, default=3.0,
                   help="allowed acceptance drop, points (finite, >= 0)")
    p.add_argument("--max-tokens", type=a.max_tokens, default=32)
    p.add_argument("--out", type=a.writable_dir, default=Path("runs/ab"))
    p.add_argument("--strict", action="store_true", help="exit 1 when the verdict is FAIL")
    add_kv_arguments(p)


def main(args: argparse.Namespace) -> int:
    from specparity.cli.outdir import add_outputs
    from specparity.measure.ab import run_ab, write_ab

    with add_outputs(args.out, "specparity ab", flag="--out", own_folder=True) as claim:
        for name in ("ab.json", "ab.md"):  # refused before measuring if not ours
            claim.check(args.out / name)
        def progress(i: int, n: int) -> None:
            if i == n or i % 8 == 0:
                print(f"ab: {i}/{n} prompts", file=sys.stderr, flush=True)

        res = run_ab(args.target, args.drafter_a, args.drafter_b, gamma=args.gamma,
                     n_prompts=args.prompts, max_tokens=args.max_tokens, max_drop=args.max_drop,
                     allow_small=args.allow_small, progress=progress,
                     prompts_file=args.prompts_file, chat_template=args.chat_template, cache=cache_fields(args))
        v = res["verdict"]
        print(f"A/B {res['target']}: A={res['drafter_a']} vs B={res['drafter_b']} "
              f"(γ={res['gamma']}, {res['n_prompts']} prompts): {v['verdict']}", flush=True)
        for r in v["reasons"]:
            print(f"  {r}", flush=True)
        try:
            for name in ("ab.json", "ab.md"):
                claim.track(args.out / name)
            jp, mp = write_ab(res, args.out)
        except OSError as exc:
            raise OSError(exc.errno, f"{exc.strerror} (the verdict above is complete; only the "
                          "files were not written)", exc.filename) from None
    print(f"written {jp} and {mp}", file=sys.stderr)
    if v["verdict"] == "UNSUPPORTED":
        return 1
    return 1 if args.strict and not v["passes"] else 0
