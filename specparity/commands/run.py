"""``specparity run``: the main job (``specparity/jobs/run.py``).

Three ways to say what runs:

- the zoo matrix (the built-in default suite): ``--targets``, ``--drafters``,
  ``--prompts N`` (zoo prompts);
- one pair of your own: ``--target PATH [--draft PATH] [--source KIND]
  --prompts-file FILE`` (a zoo target name works too);
- a TOML suite: ``--suite FILE`` (``specparity/cases/suite.py`` documents the keys).

``--gammas``, ``--max-tokens``, ``--temps``/``--top-p``/``--top-k``/``--min-p``/``--seed``,
``--eos-ids`` and ``--truncate`` apply to the first two; a suite sets its own
(giving them with ``--suite`` is refused, as are ``--top-p``/``--top-k``/``--min-p``/``--seed``
without a temperature > 0: a flag is honoured or refused, never ignored).
Names (``--targets``, ``--drafters``, ``--runners``, ``--source``) must be known.
More than ``--max-cases`` cases (default 10,000) are refused before anything runs. Cases run in this process, on a process pool
(``--workers N``) or on Ray (``--ray [ADDRESS]``), with identical traces.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specparity.cases.prompts import CHAT_TEMPLATE_HELP
from specparity.cli import args as a
from specparity.cli.devices import add_device_argument
from specparity.cli.kv_args import add_kv_arguments, cache_fields, check_kv_models
from specparity.commands import positive

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
    # Settings default to None so that a flag given where it cannot apply is refused
    # (cases_from_args), never silently ignored.
    p.add_argument("--out", type=a.writable_dir, default=Path("runs/latest"), help="output dir (default runs/latest)")
    z = p.add_argument_group("the zoo matrix (default)")
    z.add_argument("--targets", type=a.choice_list(a.zoo_targets, "zoo target"), default=None,
                   help="comma-separated zoo targets")
    z.add_argument("--drafters", type=a.choice_list(a.zoo_drafters, "zoo drafter"), default=None,
                   help="comma-separated zoo drafters")
    z.add_argument("--prompts", type=positive, default=None, help="zoo prompts per cell (default 8)")
    u = p.add_argument_group("your own pair")
    u.add_argument("--target", default=None, type=a.model_ref, help="target: a local mlx-lm model dir (or a zoo target)")
    u.add_argument("--draft", default=None, type=a.model_ref, help="drafter model dir (omit for plain decode or --source ngram)")
    from engine.sources import names as source_kinds

    u.add_argument("--source", default=None, type=a.source,
                   help=f"draft source kind (default: detected from --draft, §3): {', '.join(source_kinds())}")
    u.add_argument("--prompts-file", type=a.readable_file, default=None,
                   help="prompts: JSONL {\"id\",\"text\"} / {\"id\",\"token_ids\"}, a JSON array of "
                        "those, or one prompt per line")
    s = p.add_argument_group("settings of the zoo matrix and of your pair (a suite sets its own)")
    s.add_argument("--temps", type=_floats, default=None, help="temperatures (default 0)")
    s.add_argument("--top-p", type=a.probability, default=None)
    s.add_argument("--top-k", type=a.nonneg_int, default=None)
    s.add_argument("--min-p", type=a.min_p, default=None,
                   help="drop tokens below this fraction of the top token's probability (default 0: off)")
    s.add_argument("--seed", type=a.seed, default=None)
    s.add_argument("--min-tokens", type=a.nonneg_int, default=None,
                   help="EOS ids are not drawn before this many tokens were generated (counted per "
                        "output position; default 0)")
    s.add_argument("--rng", type=a.rng_mode, default=None,
                   help="stream (default: one RNG stream per request, as mlx-lm) or position (a key per "
                        "(seed, output position): sampled speculative output is compared with plain "
                        "decode token for token)")
    s.add_argument("--eos-ids", type=a.token_id_list, default=None, help="EOS ids (default: the tokenizer's)")
    s.add_argument("--truncate", action="store_true", default=None,
                   help="keep the tail of prompts longer than the context (default: refuse them)")
    # --chat-template (issue 22): text prompts through the tokenizer's chat template
    s.add_argument("--chat-template", action="store_true", default=None, help=CHAT_TEMPLATE_HELP)
    s.add_argument("--gammas", type=a.gamma_list, default=None, help="default 1,2,3,5")
    s.add_argument("--max-tokens", type=a.max_tokens, default=None, help="default 32")
    s.add_argument("--grammar", type=a.grammar_ref, default=None, metavar="FILE",
                   help="constrain every case (your pair) or the zoo matrix's grammar cases: a JSON "
                        "schema (.json), regex (.regex), Lark grammar (.lark) or zoo grammar name "
                        "(docs/grammar.md)")
    s.add_argument("--reasoning-end", type=a.reasoning_end, default=None, metavar="TEXT",
                   help="with --grammar: each grammar case is free until the emitted tokens end with "
                        "TEXT, then constrained (docs/grammar.md)")
    add_kv_arguments(s)
    p.add_argument("--suite", type=a.readable_file, default=None, help="a TOML suite file (see specparity/cases/suite.py)")
    p.add_argument("--max-cases", type=positive, default=a.MAX_CASES,
                   help=f"refuse a selection of more cases than this (default {a.MAX_CASES})")
    from specparity.runners import registry

    p.add_argument("--runners", type=a.runner_list, default=None,
                   help=f"references to run, comma-separated: {', '.join(registry.names('reference', per_case=True))} "
                        "(default: all available; \"\": the engine alone)")
    p.add_argument("--workers", type=a.nonneg_int, default=0,
                   help="process-pool size (default 0: in this process)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run cases on Ray (a local cluster when no ADDRESS)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--sessions", action="store_true",
                   help="prompt-cache sessions instead: each request warm (saved target+drafter caches "
                        "reused) vs cold, token- and cache-identical (docs/prompt-cache.md)")
    add_device_argument(p)


_SETTINGS = ("temps", "top_p", "top_k", "min_p", "seed", "min_tokens", "rng", "eos_ids", "truncate", "gammas",
             "max_tokens", "prompts", "chat_template", "grammar", "reasoning_end")


def _given(args: argparse.Namespace, *names: str) -> list[str]:
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n, None) is not None]


def _sampling(args: argparse.Namespace) -> tuple:
    """``--temps`` x (``--top-p``, ``--top-k``, ``--min-p``, ``--seed``); those four need a temperature > 0."""
    from specparity.cases.suite import Sampling

    temps = args.temps or (0.0,)
    knobs = _given(args, "top_p", "top_k", "min_p", "seed")
    if knobs and not any(temps):
        raise ValueError(f"{', '.join(knobs)}: only sampled cases use it: add --temps with a "
                         "temperature > 0 (e.g. --temps 0,0.8)")
    return tuple(Sampling(t, args.top_p or 0.0, args.top_k or 0, args.seed or 0,
                          min_tokens=args.min_tokens or 0, rng=args.rng or "stream", min_p=args.min_p or 0.0)
                 for t in temps)


def cases_from_args(args: argparse.Namespace) -> list:
    """The cases the flags select: a suite, your pair, or the zoo matrix.

    Every flag is honoured or refused in one line, never ignored.
    """
    from specparity.cases.suite import PairSpec, load_suite, suite_cases
    from specparity.jobs.run import zoo_cases

    fields = cache_fields(args)  # --kv-bits/--kv-group-size/--quantized-kv-start, --rotating
    if args.suite is not None:
        clash = _given(args, "target", "draft", "source", "prompts_file", "targets", "drafters",
                       *_SETTINGS) + ["--" + k.replace("_", "-") for k, v in fields.items() if v is not None]
        if clash:
            raise ValueError(f"--suite names its own pairs, prompts and settings; drop "
                             f"{', '.join(clash)} (or put them in the suite)")
        return suite_cases(load_suite(args.suite), max_cases=args.max_cases)
    sampling = _sampling(args)
    gammas = tuple(args.gammas or (1, 2, 3, 5))
    max_tokens = args.max_tokens or 32
    if args.reasoning_end and not args.grammar:
        raise ValueError("--reasoning-end needs --grammar (the marker ends the free part of a "
                         "grammar-constrained output)")
    if args.target is None:
        if args.draft or args.source or args.prompts_file:
            raise ValueError("--draft/--source/--prompts-file need --target")
        if args.chat_template:
            raise ValueError("--chat-template renders text prompts: give --target and --prompts-file "
                             "(the zoo's prompts are token ids)")
        # the whole matrix with no sampling flag (the default run): the matrix's own sampling
        # (None), so it keeps the cases zoo_cases adds only then, the sampler side-state and the
        # pairwise sampling cases (before, the explicit default left them out of `specparity run`)
        default = args.targets is None and args.drafters is None and not _given(
            args, "temps", "top_p", "top_k", "min_p", "seed", "min_tokens", "rng")
        return zoo_cases(targets=args.targets, drafters=args.drafters, gammas=gammas,
                         n_prompts=args.prompts or 8, max_tokens=max_tokens,
                         sampling=None if default else sampling,
                         eos_ids=args.eos_ids, truncate=bool(args.truncate), max_cases=args.max_cases,
                         cache=fields, grammar=args.grammar, reasoning_end=args.reasoning_end or "")
    if args.targets or args.drafters:
        raise ValueError("--target (one pair) and --targets/--drafters (the zoo matrix) exclude each other")
    if args.prompts is not None and args.prompts_file is not None:
        raise ValueError("--prompts N picks zoo prompts; with --prompts-file every prompt of the "
                         "file runs: drop one of them")
    from specparity.cases.suite import resolve_model_ref

    spec = PairSpec(
        target=resolve_model_ref(args.target, Path.cwd()),
        drafter=resolve_model_ref(args.draft, Path.cwd()) if args.draft else None,
        sources=(args.source,) if args.source else (),
        gammas=gammas, max_tokens=max_tokens,
        prompts_file=args.prompts_file, zoo_prompts=args.prompts or 8,
        sampling=sampling, eos_ids=args.eos_ids, truncate=bool(args.truncate), where="--target",
        chat_template=bool(args.chat_template), grammar=args.grammar or "",
        reasoning_end=args.reasoning_end or "",
        **fields,
    )
    return suite_cases([spec], max_cases=args.max_cases)


def main(args: argparse.Namespace) -> int:
    from specparity.cli.devices import on_gpu, use_device
    from specparity.jobs.run import run

    if args.device is not None and (args.workers or args.ray is not None):
        raise ValueError("--device sets this process's MLX device: run it without --workers/--ray")
    device = use_device(args.device)
    from engine.backend import emulate_from_env

    emulate_from_env()  # SPECPARITY_EMULATE_MISSING_OP: a missing kernel emulated here (sessions too)
    if args.device is not None or on_gpu():
        print(f"device {device}", file=sys.stderr)
    if args.sessions or (args.suite is not None and _suite_sessions(args.suite) is not None):
        return _sessions(args)
    cases = cases_from_args(args)
    check_kv_models(cases)
    from specparity.cli.case_args import check_grammars

    check_grammars(cases)
    fill = None  # the whole zoo matrix also runs the fill cases (§7; zoo/fill.py)
    if args.suite is None and args.target is None and not args.targets and not args.drafters:
        from dataclasses import replace

        from specparity.jobs.run import fill_cases

        # the fill cases' requests take the run's sampling flags: --temps, --max-tokens, --seed
        fill = [replace(c, seed=args.seed or 0)
                for c in fill_cases(tuple(s.temperature for s in _sampling(args)), args.max_tokens or 48)]
    result = run(
        args.out, runners=args.runners, cases=cases, max_cases=args.max_cases,
        workers=args.workers, ray_address=args.ray, progress=not args.quiet, fill_cases=fill,
    )
    print((args.out / "summary.md").read_text())
    print(f"traces and report written to {args.out}/", file=sys.stderr)
    return 0 if result.ok else 1


def _sessions(args: argparse.Namespace) -> int:
    """``run --sessions`` (docs/prompt-cache.md): the zoo's session matrix, or the sessions of the
    cases a pair or a suite selects (grouped by everything but the prompt)."""
    from specparity.jobs.sessions import main_sessions, zoo_session_cases

    if args.workers or args.ray is not None:
        raise ValueError("--sessions runs in this process: drop --workers/--ray")
    if args.runners is not None:
        raise ValueError("--sessions runs the engine's prompt-cache sessions: drop --runners")
    names = _suite_sessions(args.suite) if args.suite is not None else None
    if args.target is None and args.suite is None:
        extra = _given(args, "drafters", "draft", "source", "prompts_file", *_SETTINGS) + [
            "--" + k.replace("_", "-") for k, v in cache_fields(args).items() if v is not None]
        extra = [f for f in extra if f != "--max-tokens"]
        if extra:
            raise ValueError(f"--sessions on the zoo runs its session matrix (docs/prompt-cache.md): "
                             f"--targets and --max-tokens select from it; {', '.join(extra)} need "
                             "--target or --suite")
        cases = zoo_session_cases(targets=args.targets, max_tokens=args.max_tokens or 16)
        from specparity.cases.suite import check_case_count

        check_case_count(len(cases), args.max_cases)  # --max-cases bounds the session matrix too
    else:
        cases = cases_from_args(args)
    check_kv_models(cases)
    from specparity.jobs.sessions import check_sessions

    check_sessions(cases, names)  # a grammar, follow-ups past the context: refused before any work
    from specparity.cli.outdir import claim_output_dir

    # a run: --out owned as `run` owns it (locked, a folder of someone else's files refused, an
    # earlier run set aside until this one completes, every file listed before it is written)
    with claim_output_dir(args.out, "specparity run --sessions"):
        return main_sessions(cases, args.out, quiet=args.quiet, names=names)


def _suite_sessions(path: Path) -> list[str] | None:
    from specparity.jobs.sessions import suite_sessions

    return suite_sessions(path)
