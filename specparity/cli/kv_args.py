"""The cache flags shared by ``run``, ``generate``/``record``, ``bench`` and ``ab``.

``--kv-bits``, ``--kv-group-size``, ``--quantized-kv-start``: mlx-lm 0.32.2
``generate_step`` / ``speculative_generate_step``'s ``kv_bits``,
``kv_group_size`` (default 64) and ``quantized_kv_start`` (default 5000).
``--rotating guard|exact``: how rotating (sliding-window) caches roll back past
the ring wrap (``engine.rollback``). All become :class:`specparity.cases.case.Case`
fields; unset, case ids and traces are unchanged.
"""

from __future__ import annotations

import argparse
from typing import Any

from specparity.cli import args as a


def add_kv_arguments(p: argparse.ArgumentParser | Any, *, rotating: bool = True) -> None:
    p.add_argument("--kv-bits", type=a.kv_bits, default=None,
                   help="quantize the KV cache to this many bits (mlx-lm kv_bits: 2,3,4,5,6,8; default off)")
    p.add_argument("--kv-group-size", type=a.kv_group_size, default=None,
                   help="KV quantization group size: 32, 64 or 128, dividing the head dim (default 64)")
    p.add_argument("--quantized-kv-start", type=a.nonneg_int, default=None,
                   help="quantize once the cache holds this many positions (default 5000, as mlx-lm)")
    if rotating:
        p.add_argument("--rotating", choices=("guard", "exact"), default="guard",
                       help="rotating (sliding-window) caches: guard = stop speculating at the ring wrap "
                            "(§2, default); exact = exact rollback past the wrap (guard only where it cannot)")


def cache_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`Case` fields the flags set (empty when none is given)."""
    bits = getattr(args, "kv_bits", None)
    group = getattr(args, "kv_group_size", None)
    start = getattr(args, "quantized_kv_start", None)
    if bits is None and (group is not None or start is not None):
        raise ValueError("--kv-group-size/--quantized-kv-start need --kv-bits")
    out: dict[str, Any] = {}
    if bits is not None:
        out.update(kv_bits=bits, kv_group_size=group, quantized_kv_start=start)
    if getattr(args, "rotating", "guard") != "guard":
        out["rotating"] = args.rotating
    return out


def check_kv_models(cases: list[Any]) -> None:
    """Refuse, in one line before anything runs, a KV group size a model's head dim rejects
    (``mx.quantize`` groups along the head dim; every zoo model's is 16)."""
    import json
    from pathlib import Path

    from specparity.runners import case_paths

    seen: set[tuple[str, int]] = set()
    for c in cases:
        if c.kv_bits is None:
            continue
        group = c.kv_group_size if c.kv_group_size is not None else 64
        tpath, dpath = case_paths(c)
        for path in (tpath, dpath):
            if path is None or (str(path), group) in seen:
                continue
            seen.add((str(path), group))
            cfg_file = Path(path) / "config.json"
            if not cfg_file.is_file():
                continue
            cfg = json.loads(cfg_file.read_text())
            cfg = cfg.get("text_config", cfg)
            heads = cfg.get("num_attention_heads") or 1
            dims = {int(d) for d in (cfg.get("head_dim") or cfg.get("hidden_size", 0) // heads,
                                     cfg.get("global_head_dim")) if d}
            bad = sorted(d for d in dims if d % group)
            if bad:
                raise ValueError(
                    f"--kv-group-size {group}: {Path(path).name}'s head dim {bad[0]} is not a multiple "
                    f"of it (mx.quantize groups along the head dim; the zoo's pair matrix has head dim 16: "
                    f"use --targets llama-kv or llama-kv64, head dim 32 or 64, or your own model)")
