"""``specparity audit``: spec vs serial replay audit of every verify window.

For each zoo target (or ``--target PATH`` with ``--draft PATH``), runs the
engine two-model speculative decode with ``engine.audit.SerialReplayAudit`` and
reports, per target and dtype, the distribution of batched-vs-serial |Δ|
(max and p99, absolute and relative to the row's / array's largest magnitude)
of the verify logit rows and of the live cache arrays after the verify, how
many logit rows changed their top-1, and the rollback verdicts: ``exact``
(byte-equal to a kept-only serial replay), ``within arithmetic`` (equal up to
the batched-vs-serial |Δ| measured in the same run) or ``error`` (an offset /
shape / kept-position mistake, named with round, layer and evidence). On a
bit-exact backend (MLX's CPU) every |Δ| is 0 and every rollback is exact.
Exit status 1 only for a rollback error; arithmetic is reported, never failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from specparity.cases.prompts import CHAT_TEMPLATE_HELP
from specparity.cli import args as a
from specparity.cli.devices import add_device_argument
from specparity.cli.kv_args import add_kv_arguments, cache_fields
from specparity.commands import positive

NAME = "audit"
HELP = "batched verify vs serial replay per window: |Δ| distributions and the rollback check"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", type=a.choice_list(a.zoo_targets, "zoo target"), default=None,
                   help="zoo targets (default: all)")
    p.add_argument("--drafter", default="twin", help="zoo drafter (default twin)")
    p.add_argument("--target", default=None, type=a.model_dir, help="a local target model dir instead of the zoo")
    p.add_argument("--draft", default=None, type=a.model_dir, help="a local drafter model dir (with --target)")
    p.add_argument("--gamma", type=a.gamma, default=3)
    p.add_argument("--prompts", type=positive, default=2, help="zoo prompts per target (default 2)")
    p.add_argument("--prompts-file", type=a.readable_file, default=None,
                   help="prompts file (JSONL {\"id\",\"text\"|\"token_ids\"} or one per line) instead "
                        "of the zoo's; required for a target outside the zoo's vocabulary")
    # --chat-template (issue 22): text prompts through the tokenizer's chat template
    p.add_argument("--chat-template", action="store_true", help=CHAT_TEMPLATE_HELP)
    p.add_argument("--max-tokens", type=positive, default=32)
    p.add_argument("--all-windows", action="store_true", help="print one line per window")
    p.add_argument("--rotating", choices=("guard", "exact"), default="guard",
                   help="rotating caches: guard (§2: stop at the ring wrap) or exact (audit windows past it)")
    p.add_argument("--json", type=a.output_file(_is_audit_json, "audit JSON"), default=None,
                   help="write the figures and verdicts here (atomically; an existing file is "
                        "replaced only if it is an earlier audit's)")
    add_kv_arguments(p, rotating=False)
    add_device_argument(p)


def _is_audit_json(p: Path) -> bool:
    data = a.read_small_json(p)
    return isinstance(data, dict) and (data.get("kind") == "audit"
                                       or {"targets", "factor", "gamma"} <= set(data))


def _runs(args: argparse.Namespace) -> list[tuple[str, Any, Any, list[tuple[str, list[int]]]]]:
    import zoo
    from engine.models import load
    from specparity.cases.prompts import prompts_for_model

    if args.chat_template and args.prompts_file is None:
        raise ValueError("--chat-template renders text prompts: give --prompts-file FILE (the zoo's "
                         "prompts are token ids)")
    zoo_ids = [p.id for p in zoo.prompts()[: args.prompts]]
    prompts = [(p.id, list(p.token_ids)) for p in zoo.prompts()[: args.prompts]]
    if args.prompts_file is not None and not args.target:
        prompts = [(p.id, list(p.token_ids)) for p in prompts_for_model(
            zoo.model_dir(zoo.TARGETS[0]), prompts_file=args.prompts_file, max_tokens=args.max_tokens,
            chat_template=args.chat_template)]
    if args.target:
        t = load(args.target)
        d = load(args.draft) if args.draft else t
        # ids checked against the model: zoo ids past its vocabulary are refused, not fed
        prompts = [(p.id, list(p.token_ids)) for p in prompts_for_model(
            t.path, prompts_file=args.prompts_file, zoo_ids=zoo_ids, max_tokens=args.max_tokens,
            chat_template=args.chat_template)]
        return [(Path(args.target).name, t, d, prompts)]
    if args.draft:
        raise ValueError("--draft needs --target")
    from specparity.runners import load_model

    out = []
    for target in args.targets or list(zoo.TARGETS):
        if target not in zoo.TARGETS:
            raise ValueError(f"unknown zoo target {target!r} (known: {', '.join(zoo.TARGETS)})")
        tdir, ddir = zoo.pair(target, args.drafter)
        out.append((target, load_model(str(tdir)), load_model(str(ddir)), prompts))
    return out


def _g(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def target_figures(name: str, audit: Any) -> dict[str, Any]:
    """One target's |Δ| distributions and rollback verdict counts (the JSON/table rows)."""
    windows = audit.windows
    verdicts = [w.rollback_check.verdict if w.rollback_check else "unchecked" for w in windows]
    rows = sum(len(w.logits) for w in windows)
    return {
        "target": name,
        "windows": len(windows),
        "logit_rows": rows,
        "top1_flipped_rows": sum(len(w.argmax_flips) for w in windows),
        "windows_logits_byte_equal": sum(w.logits_equal for w in windows),
        "windows_caches_byte_equal": sum(w.caches_equal for w in windows),
        "delta": {f"{kind}/{dtype}": s.to_dict() for (kind, dtype), s in sorted(audit.stats.items())},
        "rollback": {v: verdicts.count(v) for v in ("exact", "arithmetic", "error")},
        "rollback_bound_max": max((w.rollback_check.bound for w in windows if w.rollback_check), default=0.0),
        "rollback_errors": audit.rollback_errors(),
    }


def main(args: argparse.Namespace) -> int:
    import contextlib

    from specparity.cli.outdir import claim_output_file

    with contextlib.ExitStack() as stack:
        if args.json is not None:  # locked and checked ours before anything is measured
            stack.enter_context(claim_output_file(args.json, "specparity audit", flag="--json",
                                                  what="audit JSON", ours=_is_audit_json))
        return _audit(args)


def _audit(args: argparse.Namespace) -> int:
    from engine.audit import ARITHMETIC_FACTOR, SerialReplayAudit
    from engine.backend import Unsupported, run_supported
    from engine.executor import GenerationParams, spec_generate
    from engine.sources.two_model import TwoModelProvider
    from specparity.cli.devices import use_device

    device = use_device(args.device)
    from engine.backend import emulate_from_env

    emulate_from_env()  # SPECPARITY_EMULATE_MISSING_OP: a missing kernel emulated here too
    kv = {k: v for k, v in cache_fields(args).items() if v is not None and k != "rotating"}
    runs = _runs(args)
    print(f"device {device}; γ={args.gamma}, {args.prompts} prompt(s) × {args.max_tokens} tokens per target",
          file=sys.stderr)
    figures = []
    unsupported: list[str] = []  # (target, prompt) runs the backend lacks an op for: their verdict
    if args.all_windows:
        print(f"{'target':10} {'prompt':7} {'round':>5} {'win':>3} {'k':>2}  {'logits (batched vs serial)':44} "
              f"{'caches after verify':44} rollback vs kept-only replay")
    for name, t, d, prompts in runs:
        audit = SerialReplayAudit(t.model)
        provider = TwoModelProvider(d.model, draft_tokenizer=getattr(d, "tokenizer", None))
        provider.check_target(t.model, getattr(t, "tokenizer", None))  # padded vocabularies
        for pid, ids in prompts:
            audit.prompt = pid
            params = GenerationParams(max_tokens=args.max_tokens, gamma=args.gamma, eos_ids=t.eos_ids,
                                      cache_digests=False, rotating=args.rotating, **kv)
            n0 = len(audit.windows)
            got = run_supported(lambda: spec_generate(t.model, provider, ids, params, observer=audit),  # noqa: B023
                                f"audit {name} prompt {pid}")
            if isinstance(got, Unsupported):
                unsupported.append(got.text)
                print(got.text, file=sys.stderr)
                continue
            if args.all_windows:
                for w in audit.windows[n0:]:
                    print(f"{name:10} {pid:7} {w.round:>5} {len(w.window):>3} {w.k_accept!s:>2}  "
                          f"{w.worst_logits():44} {w.worst_cache():44} {w.rollback_summary()}")
        if not audit.windows:  # every prompt unsupported (or no window): nothing measured on this target
            continue
        fig = target_figures(name, audit)
        figures.append(fig)
        rb = fig["rollback"]
        print(f"audit {name}: {fig['windows']} windows, rollback exact {rb['exact']}, within arithmetic "
              f"{rb['arithmetic']}, errors {rb['error']}", file=sys.stderr)

    print("\nbatched verify vs serial replay, |Δ| per target and dtype (rel: |Δ| / max |value| of the "
          "row or array; p99 from a log-histogram, ≤ 7.5 % high)\n")
    print(f"{'target':10} {'what':18} {'arrays':>7} {'byte-eq':>7} {'max |Δ|':>9} {'p99 |Δ|':>9} "
          f"{'max rel':>9} {'p99 rel':>9}")
    for fig in figures:
        for key, s in fig["delta"].items():
            print(f"{fig['target']:10} {key:18} {s['arrays']:>7} {s['byte_equal_arrays']:>7} "
                  f"{_g(s['max_abs']):>9} {_g(s['p99_abs']):>9} {_g(s['max_rel']):>9} {_g(s['p99_rel']):>9}")
    print(f"\nrollback vs a kept-only serial replay (bound: {ARITHMETIC_FACTOR:g} × the largest "
          "batched-vs-serial cache |Δ| measured so far)\n")
    print(f"{'target':10} {'windows':>7} {'top-1 flips':>11} {'exact':>6} {'arithmetic':>10} {'errors':>6} "
          f"{'bound':>9}")
    for fig in figures:
        rb = fig["rollback"]
        print(f"{fig['target']:10} {fig['windows']:>7} {fig['top1_flipped_rows']:>11} {rb['exact']:>6} "
              f"{rb['arithmetic']:>10} {rb['error']:>6} {_g(fig['rollback_bound_max']):>9}")
    if args.json:
        from traces.io import atomic_write_json

        atomic_write_json(args.json, {"kind": "audit", "device": device, "gamma": args.gamma,
                                      "prompts": args.prompts, "max_tokens": args.max_tokens,
                                      "factor": ARITHMETIC_FACTOR, "targets": figures,
                                      "unsupported": unsupported},
                          nan_as_null=True)
        print(f"written {args.json}", file=sys.stderr)
    if unsupported:
        print(f"\n{len(unsupported)} run(s) unsupported on this backend (their verdict, not a finding):",
              file=sys.stderr)
        for line in unsupported:
            print(f"  {line}", file=sys.stderr)
    errors = [f"{fig['target']} {e}" for fig in figures for e in fig["rollback_errors"]]
    if errors:
        print("\nrollback errors (positions kept or lost, or values beyond the measured arithmetic):",
              file=sys.stderr)
        for line in errors[:12]:
            print(f"  {line}", file=sys.stderr)
        if len(errors) > 12:
            print(f"  ... {len(errors) - 12} more (--json lists them all)", file=sys.stderr)
        return 1
    return 0
