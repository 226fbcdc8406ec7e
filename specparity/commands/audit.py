"""``specparity audit``: spec vs serial replay audit of every verify window.

For each zoo target (or ``--target PATH`` with ``--draft PATH``), runs the
engine two-model speculative decode with ``engine.audit.SerialReplayAudit``
and prints one row per verify window: the logits rows and live cache arrays
after the batched verify vs a serial replay of the same tokens, and the
caches after the rollback vs a serial replay of only the kept tokens. Byte
differences are batched-vs-serial arithmetic and are reported as such (with
the largest ulp/absolute difference and where); exit status 1 only for a
rollback difference whose size is not explained by arithmetic, i.e. a shape
or offset mismatch (a cache that kept or lost positions).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from specparity.commands import positive, str_list

NAME = "audit"
HELP = "spec vs serial replay audit of every verify window (logits + cache bytes)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", type=str_list, default=None, help="zoo targets (default: all)")
    p.add_argument("--drafter", default="twin", help="zoo drafter (default twin)")
    p.add_argument("--target", default=None, help="a local target model dir instead of the zoo")
    p.add_argument("--draft", default=None, help="a local drafter model dir (with --target)")
    p.add_argument("--gamma", type=positive, default=3)
    p.add_argument("--prompts", type=positive, default=2, help="zoo prompts per target (default 2)")
    p.add_argument("--max-tokens", type=positive, default=32)
    p.add_argument("--all-windows", action="store_true", help="print equal windows too")


def _runs(args: argparse.Namespace) -> list[tuple[str, Any, Any, str, list[int]]]:
    import zoo
    from engine.models import load

    if args.target:
        t = load(args.target)
        d = load(args.draft) if args.draft else t
        return [(args.target, t, d, p.id, list(p.token_ids)) for p in zoo.prompts()[: args.prompts]]
    from specparity.runners import load_model

    out = []
    for target in args.targets or list(zoo.TARGETS):
        tdir, ddir = zoo.pair(target, args.drafter)
        t, d = load_model(str(tdir)), load_model(str(ddir))
        out += [(target, t, d, p.id, list(p.token_ids)) for p in zoo.prompts()[: args.prompts]]
    return out


def main(args: argparse.Namespace) -> int:
    from engine.audit import SerialReplayAudit
    from engine.executor import GenerationParams, spec_generate
    from engine.sources.two_model import TwoModelProvider

    summary: dict[str, list[int]] = {}
    structural = []
    print(f"{'target':8} {'prompt':7} {'round':>5} {'win':>3} {'k':>2}  {'logits (batched vs serial)':34} "
          f"{'caches after verify':40} rollback (vs kept-only replay)")
    for name, t, d, pid, ids in _runs(args):
        audit = SerialReplayAudit(t.model)
        params = GenerationParams(max_tokens=args.max_tokens, gamma=args.gamma, eos_ids=t.eos_ids, cache_digests=False)
        spec_generate(t.model, TwoModelProvider(d.model), ids, params, observer=audit)
        counts = summary.setdefault(name, [0, 0, 0, 0])
        for w in audit.windows:
            counts[0] += 1
            counts[1] += w.logits_equal
            counts[2] += w.caches_equal
            counts[3] += w.rollback_equal
            if args.all_windows or not w.equal:
                print(f"{name:8} {pid:7} {w.round:>5} {len(w.window):>3} {w.k_accept!s:>2}  "
                      f"{w.worst_logits():34} {w.worst_cache():40} {w.first_bad_rollback()}")
            for layer, arr, diff in w.rollback:
                if diff.shape_mismatch:
                    structural.append(f"{name} {pid} round {w.round} layer {layer} {arr}: {diff.describe()}")
    print()
    print(f"{'target':8} {'windows':>7} {'logits byte-equal':>18} {'caches byte-equal':>18} {'rollback byte-equal':>20}")
    for name, (n, lo, ca, rb) in summary.items():
        print(f"{name:8} {n:>7} {lo:>18} {ca:>18} {rb:>20}")
    if structural:
        print("\nrollback kept or lost positions (a logic bug, not arithmetic):", file=sys.stderr)
        for line in structural:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0
