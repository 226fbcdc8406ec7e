"""The ``specparity`` command line.

Subcommands: ``run`` (the main job), ``generate`` (speculative or plain decode
on any local mlx-lm model directory), ``zoo list``, ``trace validate``,
``diff``. Exit status: 0 success / conformance, 1 divergence or invalid trace,
2 usage error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _str_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specparity", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run engine + every available oracle on the zoo and report")
    r.add_argument("--out", type=Path, default=Path("runs/latest"), help="output dir (default runs/latest)")
    r.add_argument("--targets", type=_str_list, default=None, help="comma-separated zoo targets")
    r.add_argument("--drafters", type=_str_list, default=None, help="comma-separated drafters")
    r.add_argument("--gammas", type=_int_list, default=(1, 2, 3, 5), help="default 1,2,3,5")
    r.add_argument("--prompts", type=_positive, default=8, help="prompts per cell (default 8)")
    r.add_argument("--max-tokens", type=_positive, default=32)
    r.add_argument("--runners", type=_str_list, default=None, help="oracles to run (default: all available)")

    g = sub.add_parser("generate", help="generate with the engine on local mlx-lm model dirs")
    g.add_argument("--target", required=True, help="target model directory")
    g.add_argument("--draft", default=None, help="drafter model directory (omit for plain decode)")
    g.add_argument("--source", default="two-model", help="draft source kind (default two-model)")
    g.add_argument("-n", "--max-tokens", type=_positive, default=64)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_int_list, help="comma-separated prompt token ids")
    g.add_argument("--gamma", type=int, default=3)
    g.add_argument("--temp", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prefill", choices=("tail-split", "full"), default=None)
    g.add_argument("--trace", type=Path, default=None, help="write the trace (JSONL) here")

    z = sub.add_parser("zoo", help="the tiny zoo")
    zsub = z.add_subparsers(dest="zoo_command", required=True)
    zl = zsub.add_parser("list", help="each target/drafter pair with measured greedy acceptance")
    zl.add_argument("--gamma", type=_positive, default=3)
    zl.add_argument("--max-tokens", type=_positive, default=32)

    t = sub.add_parser("trace", help="trace files")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    tv = tsub.add_parser("validate", help="validate trace files against the schema")
    tv.add_argument("files", nargs="+")

    d = sub.add_parser("diff", help="first divergence between two traces")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--level", choices=("round", "tokens", "acceptance"), default="round")
    d.add_argument("--eps", type=float, default=None)
    return p


def cmd_run(args: argparse.Namespace) -> int:
    from specparity.run import run

    result = run(
        args.out, targets=args.targets, drafters=args.drafters, gammas=args.gammas,
        n_prompts=args.prompts, max_tokens=args.max_tokens, runners=args.runners,
    )
    print((args.out / "summary.md").read_text())
    print(f"traces and report written to {args.out}/", file=sys.stderr)
    return 0 if result.ok else 1


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from engine.models import load
    from engine.sampler import SamplerParams
    from engine.sources import make_provider
    from traces.io import write_trace
    from traces.records import make_header

    target = load(args.target)
    draft = load(args.draft) if args.draft else None
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

    if draft is None:
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
            mode="spec" if draft else "plain", source=args.source if draft else None,
            case_id=f"generate/{Path(args.target).name}", target=ident(target),
            drafter=ident(draft) if draft else None, tokenizer_sha256=None,
            params={"gamma": args.gamma if draft else None, "max_tokens": args.max_tokens,
                    "temperature": args.temp, "top_p": args.top_p, "top_k": args.top_k, "min_p": 0.0,
                    "seed": args.seed, "prefill": args.prefill or "tail-split",
                    "prefill_step_size": 512 if draft else 2048, "confidence_threshold": None},
            prompt_id="cli", prompt_ids=ids, eos_ids=target.eos_ids,
        )
        write_trace(args.trace, [header, *result.records, result.footer()])
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0


def cmd_zoo_list(args: argparse.Namespace) -> int:
    from engine import zoo
    from specparity.runners import load_model

    print(f"{'target':8} {'drafter':8} {'acceptance':>10} {'tau':>6}   (greedy, gamma={args.gamma}, "
          f"{args.max_tokens} tokens x {len(zoo.prompts())} prompts, engine two-model)")
    from engine.executor import GenerationParams, spec_generate
    from engine.sources.two_model import TwoModelProvider

    for target, drafter in zoo.pairs():
        tdir, ddir = zoo.pair(target, drafter)
        t, d = load_model(str(tdir)), load_model(str(ddir))
        params = GenerationParams(max_tokens=args.max_tokens, gamma=args.gamma, eos_ids=t.eos_ids)
        drafted = accepted = tokens = calls = 0
        for p in zoo.prompts():
            r = spec_generate(t.model, TwoModelProvider(d.model), list(p.token_ids), params)
            assert r.speculation is not None
            drafted += r.speculation.drafted
            accepted += r.speculation.accepted
            calls += r.speculation.target_calls
            tokens += r.usage.generation_tokens
        print(f"{target:8} {drafter:8} {accepted / max(drafted, 1):>10.1%} {tokens / max(calls, 1):>6.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "zoo":
            return cmd_zoo_list(args)
        if args.command == "trace":
            from traces.validate import validate_main

            return validate_main(args.files)
        if args.command == "diff":
            from traces.diff import diff_main

            argv2 = [args.a, args.b, "--level", args.level]
            if args.eps is not None:
                argv2 += ["--eps", str(args.eps)]
            return diff_main(argv2)
    except (ValueError, FileNotFoundError) as exc:
        print(f"specparity: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
