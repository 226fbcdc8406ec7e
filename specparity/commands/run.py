"""``specparity run``: the main job (``specparity/run.py``).

Three ways to say what runs:

- the zoo matrix (the built-in default suite): ``--targets``, ``--drafters``,
  ``--prompts N`` (zoo prompts);
- one pair of your own: ``--target PATH [--draft PATH] [--source KIND]
  --prompts-file FILE`` (a zoo target name works too);
- a TOML suite: ``--suite FILE`` (``specparity/suite.py`` documents the keys).

``--gammas``, ``--max-tokens``, ``--temps``/``--top-p``/``--top-k``/``--seed``
apply to the first two. Cases run in this process, on a process pool
(``--workers N``) or on Ray (``--ray [ADDRESS]``), with identical traces.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from specparity import args as a
from specparity.commands import int_list, positive, str_list
from specparity.devices import add_device_argument
from specparity.kv_args import add_kv_arguments, cache_fields, check_kv_models

NAME = "run"
HELP = "run engine + every available oracle on the zoo, a pair of yours or a suite, and report"


def _floats(text: str) -> tuple[float, ...]:
    parts = [v.strip() for v in text.split(",")]
    if any(not v for v in parts):  # "5,,6": a dropped value would run a matrix nobody asked for
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 0,0.8, got {text!r} (an empty item)")
    try:
        vals = tuple(float(v) for v in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not (v >= 0) or v == float("inf") for v in vals):
        raise argparse.ArgumentTypeError(f"expected finite numbers >= 0, got {text!r}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=a.writable_dir, default=Path("runs/latest"), help="output dir (default runs/latest)")
    z = p.add_argument_group("the zoo matrix (default)")
    z.add_argument("--targets", type=str_list, default=None, help="comma-separated zoo targets")
    z.add_argument("--drafters", type=str_list, default=None, help="comma-separated drafters")
    z.add_argument("--prompts", type=positive, default=8, help="zoo prompts per cell (default 8)")
    u = p.add_argument_group("your own pair")
    u.add_argument("--target", default=None, type=a.model_ref, help="target: a local mlx-lm model dir (or a zoo target)")
    u.add_argument("--draft", default=None, type=a.model_ref, help="drafter model dir (omit for plain decode or --source ngram)")
    u.add_argument("--source", default=None,
                   help="draft source kind (default: detected from --draft, §3): two-model, ngram, mtp, "
                        "assistant, deepspec, dspark")
    u.add_argument("--prompts-file", type=a.readable_file, default=None,
                   help="prompts: JSONL {\"id\",\"text\"} / {\"id\",\"token_ids\"} or one prompt per line")
    u.add_argument("--temps", type=_floats, default=(0.0,), help="temperatures (default 0)")
    u.add_argument("--top-p", type=a.probability, default=0.0)
    u.add_argument("--top-k", type=a.nonneg_int, default=0)
    u.add_argument("--seed", type=a.seed, default=0)
    u.add_argument("--eos-ids", type=str_list, default=None, help="EOS ids (default: the tokenizer's)")
    u.add_argument("--truncate", action="store_true",
                   help="keep the tail of prompts longer than the context (default: refuse them)")
    p.add_argument("--suite", type=a.readable_file, default=None, help="a TOML suite file (see specparity/suite.py)")
    p.add_argument("--gammas", type=int_list, default=(1, 2, 3, 5), help="default 1,2,3,5")
    p.add_argument("--max-tokens", type=a.max_tokens, default=32)
    add_kv_arguments(p)
    p.add_argument("--runners", type=str_list, default=None, help="oracles to run (default: all available)")
    p.add_argument("--workers", type=a.nonneg_int, default=0,
                   help="process-pool size (default 0: in this process)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run cases on Ray (a local cluster when no ADDRESS)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_device_argument(p)


def cases_from_args(args: argparse.Namespace) -> list | None:
    """The cases the flags select (None: the zoo matrix)."""
    from specparity.suite import PairSpec, Sampling, load_suite, suite_cases

    fields = cache_fields(args)
    if args.suite is not None:
        if args.target or args.draft or args.prompts_file:
            raise ValueError("--suite names its own pairs and prompts; drop --target/--draft/--prompts-file")
        if fields:
            raise ValueError("--suite: set kv_bits/kv_group_size/quantized_kv_start/rotating in the suite file")
        return suite_cases(load_suite(args.suite))
    if args.target is None:
        if args.draft or args.source or args.prompts_file:
            raise ValueError("--draft/--source/--prompts-file need --target")
        if fields:  # the zoo matrix with these cache settings
            from specparity.run import zoo_cases

            # the flags' settings replace the matrix's own (its two quantized-KV cases may merge)
            return list(dict.fromkeys(replace(c, **fields) for c in zoo_cases(
                targets=args.targets, drafters=args.drafters, gammas=tuple(args.gammas),
                n_prompts=args.prompts, max_tokens=args.max_tokens)))
        return None
    if args.targets or args.drafters:
        raise ValueError("--target (one pair) and --targets/--drafters (the zoo matrix) exclude each other")
    from specparity.suite import _model_ref

    try:
        eos = tuple(int(v) for v in args.eos_ids) if args.eos_ids else None
    except ValueError:
        raise ValueError(f"--eos-ids: expected integers, got {','.join(args.eos_ids)}") from None
    spec = PairSpec(
        target=_model_ref(args.target, Path.cwd()),
        drafter=_model_ref(args.draft, Path.cwd()) if args.draft else None,
        sources=(args.source,) if args.source else (),
        gammas=tuple(args.gammas), max_tokens=args.max_tokens,
        prompts_file=args.prompts_file, zoo_prompts=args.prompts,
        sampling=tuple(Sampling(t, args.top_p, args.top_k, args.seed) for t in args.temps),
        eos_ids=eos, truncate=args.truncate, where="--target",
        **fields,
    )
    return suite_cases([spec])


def main(args: argparse.Namespace) -> int:
    from specparity.devices import on_gpu, use_device
    from specparity.run import run

    if args.device is not None and (args.workers or args.ray is not None):
        raise ValueError("--device sets this process's MLX device: run it without --workers/--ray")
    device = use_device(args.device)
    if args.device is not None or on_gpu():
        print(f"device {device}", file=sys.stderr)
    cases = cases_from_args(args)
    if cases is not None:
        check_kv_models(cases)
    result = run(
        args.out, targets=args.targets, drafters=args.drafters, gammas=args.gammas,
        n_prompts=args.prompts, max_tokens=args.max_tokens, runners=args.runners,
        cases=cases, workers=args.workers, ray_address=args.ray, progress=not args.quiet,
    )
    print((args.out / "summary.md").read_text())
    print(f"traces and report written to {args.out}/", file=sys.stderr)
    return 0 if result.ok else 1
