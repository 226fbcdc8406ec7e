"""Command-line flags for logits processors, shared by the commands that run the engine.

The flags are mlx-lm 0.32.2's ``sample_utils.make_logits_processors`` arguments
(``mlx_lm.generate``'s own CLI names them the same way) plus
``--processor-history``, where the processor history starts
(``engine.sampler.ProcessorParams.history_prompt``). :func:`processors_from_args`
turns them into a ``ProcessorParams``; its ``tag()`` is the case-id form
(``specparity.cases.case.Case.processors``).
"""

from __future__ import annotations

import argparse
from typing import Any

from specparity.cli.args import finite_float, nonneg_int, positive_int, rng_mode


def _bias(text: str) -> tuple[tuple[int, float], ...]:
    try:
        pairs = [p.split("=") for p in text.split(",") if p.strip()]
        out = tuple((int(t), finite_float(v)) for t, v in pairs)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected ID=BIAS[,ID=BIAS...] with finite biases, got "
                                         f"{text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS[,ID=BIAS...], got {text!r}")
    return out


def add_processor_arguments(g: argparse.ArgumentParser) -> None:
    """Add the processor flags to a command's parser."""
    p = g.add_argument_group("logits processors (mlx-lm make_logits_processors)")
    p.add_argument("--repetition-penalty", type=finite_float, default=None,
                   help="sign-aware multiplicative penalty on tokens in the last --repetition-context-size")
    p.add_argument("--repetition-context-size", type=positive_int, default=20)
    p.add_argument("--presence-penalty", type=finite_float, default=None,
                   help="subtracted once from tokens present in the last --presence-context-size")
    p.add_argument("--presence-context-size", type=positive_int, default=20)
    p.add_argument("--frequency-penalty", type=finite_float, default=None,
                   help="subtracted per occurrence in the last --frequency-context-size")
    p.add_argument("--frequency-context-size", type=positive_int, default=20)
    p.add_argument("--logit-bias", type=_bias, default=(), metavar="ID=BIAS[,ID=BIAS...]",
                   help="additive logit bias per token id")
    p.add_argument("--min-tokens", type=nonneg_int, default=0,
                   help="EOS ids are not drawn before this many tokens were generated (counted per "
                        "output position, a verify window's rows each their own)")
    p.add_argument("--rng", type=rng_mode, default="stream",
                   help="stream (default: one RNG stream per request, as mlx-lm) or position (a key per "
                        "(seed, output position): a sampled speculative run draws what plain decode draws)")
    p.add_argument("--processor-history", choices=("full", "last"), default="full",
                   help="where the processor history starts: the whole prompt (default; mlx-lm "
                        "generate_step, spec == plain) or its last token (mlx-lm "
                        "speculative_generate_step, for comparing with it)")


def processors_from_args(args: argparse.Namespace) -> Any:
    """The ``engine.sampler.ProcessorParams`` of parsed flags (ValueError on bad values)."""
    from engine.sampler import ProcessorParams

    return ProcessorParams(
        logit_bias=tuple(args.logit_bias),
        repetition_penalty=args.repetition_penalty,
        repetition_context_size=args.repetition_context_size,
        presence_penalty=args.presence_penalty,
        presence_context_size=args.presence_context_size,
        frequency_penalty=args.frequency_penalty,
        frequency_context_size=args.frequency_context_size,
        history_prompt=args.processor_history,
    )

