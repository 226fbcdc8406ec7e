"""Grade an engine's native-MTP conventions against our ``native-mtp`` source (issue 28).

``python -m specparity.mtp_conventions flyto-mlx --out docs/scoreboard`` (in the
engine's environment: ``tox exec -e subject-flyto-mlx-mtp -- ...``) captures the
engine's MTP head calls on each zoo native-MTP checkpoint
(``subjects/mtp_conventions.py``) and, input for input, recomputes them with
``engine.sources.native_mtp``'s head (the checkpoint's ``MTPBlock``, mlx-lm's
decoder layer) under each named convention (``Conventions``: ``hidden``,
``concat``, ``mask_pos0``, the row position), then writes
``OUT/mtp-conventions-<engine>.json`` and ``.md``: per checkpoint the conventions
the engine's calls match (max |logit diff| per candidate), the head-cache rows it
keeps, and token identity of its greedy stream with our plain decode. A
checkpoint the engine cannot drive is a row saying so with its own evidence.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from subjects.mtp_conventions import (
    SAME,
    Capture,
    best_preset,
    first_divergence,
    match_hidden,
    verdict,
)

TARGETS = ("qwen35-native", "glm-mtp", "deepseek-mtp")
# zoo native target -> the zoo model plain decode of its trunk runs on (the trunk without MTP tensors)
PLAIN = {"qwen35-native": "qwen35"}


def _our_parts(target: str) -> tuple[Any, tuple[Any, Any, Any], Any, Any]:
    """(our plain target model, (embed, lm-head, final norm), our head, checkpoint dir)."""
    from mlx_lm.utils import load_model

    import zoo
    from engine.sources.native_mtp import _target_parts, load_head
    from zoo.native_mtp import target_paths

    tpath, cpath = target_paths(target)
    # the trunk without MTP tensors: mlx-lm's qwen3_5 sanitize shifts every norm by +1 when it
    # sees mtp.* keys (it assumes a Hugging Face checkpoint), so the native dir is not read as is
    model = load_model(zoo.model_dir(PLAIN[target]) if target in PLAIN else Path(tpath))[0]
    embed, lm_head, norm = _target_parts(model)
    head, _ = load_head(cpath)
    return model, (embed, lm_head, norm), head, cpath


def _hidden_rows(model: Any, seq: list[int], norm: Any) -> tuple[np.ndarray, np.ndarray]:
    import mlx.core as mx

    from engine.taps import capture_layers

    lm = getattr(model, "language_model", model)
    with capture_layers(lm.model, [-1]) as cap:
        model(mx.array(seq)[None])
        pre = cap[len(lm.model.layers) - 1]
    post = norm(pre)
    return np.array(pre[0].astype(mx.float32)), np.array(post[0].astype(mx.float32))


def _block_logits(block: Any, parts: tuple[Any, Any, Any], rows: list[tuple[np.ndarray, int, int]],
                  concat: str, mask_pos0: bool) -> list[np.ndarray]:
    """Our head over ``rows`` = (hidden fed, token, RoPE position), one row per call on one fresh
    cache (the engine's own row set), with ``concat`` / ``mask_pos0``."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    embed, lm_head, _ = parts
    cache = KVCache()
    out = []
    for hidden, token, pos in rows:
        e = embed(mx.array([[token]], dtype=mx.uint32))
        if mask_pos0 and pos == 0:
            e = e * 0
        _, post = block(e, mx.array(hidden)[None, None, :], pos, concat, cache)
        out.append(np.array(lm_head(post)[0, -1].astype(mx.float32)))
    return out


def measure(cap: Capture, target: str) -> dict[str, Any]:
    """The conventions ``cap``'s head calls match, measured with our native-mtp head."""
    import zoo

    model, parts, head, _ = _our_parts(target)
    block = head.blocks[0]
    seq = cap.prompt_ids + cap.stream
    pre, post = _hidden_rows(model, seq, parts[2])
    row: dict[str, Any] = {"checkpoint": target, "calls": len(cap.calls), "depth_layers": len(head.blocks)}
    # hidden: which target row the engine fed
    hid = [match_hidden(c.hidden, pre, post) for c in cap.calls]
    kinds = sorted({h[0] for h in hid if h[2] <= 1e-3})
    pairs = sorted({next((k for k in (1, 0, 2) if h[1] + k < len(seq) and seq[h[1] + k] == c.token), -1)
                    for c, h in zip(cap.calls, hid, strict=True)})
    row["hidden"] = {"match": kinds, "max_diff": max((h[2] for h in hid), default=None),
                     "token_offset_from_hidden_row": pairs,
                     "note": "the token embedded with hidden row q is sequence token q + offset"}
    # concat / mask on the first call (empty head cache, one row: positions are invisible)
    c0 = cap.calls[0]
    cands = {f"concat={cc},mask_pos0={str(m).lower()}": _block_logits(block, parts, [(c0.hidden, c0.token, 0)],
                                                                       cc, m)[0]
             for cc in ("e;h", "h;e") for m in (False, True)}
    first = best_preset(c0.logits, cands)
    row["first_call"] = {"offset": c0.offset, **first}
    # rows / positions: replay every call on one fresh cache with the engine's own rows
    conv = first["closest"] or "concat=e;h,mask_pos0=false"
    cc = conv.split(",")[0].split("=")[1]
    mk = conv.endswith("true")
    seqpos = [h[1] for h in hid]
    replays = {
        "engine rows at the head-cache offset (consecutive)": [(c.hidden, c.token, c.offset) for c in cap.calls],
        "engine rows at their sequence positions": [(c.hidden, c.token, p) for c, p in zip(cap.calls, seqpos,
                                                                                           strict=True)],
    }
    rep = {}
    for name, rows in replays.items():
        got = _block_logits(block, parts, rows, cc, mk)
        diffs = [float(np.max(np.abs(g - c.logits))) for g, c in zip(got, cap.calls, strict=True)]
        rep[name] = {"max_diff": max(diffs), "calls_within": sum(d <= SAME for d in diffs)}
    row["replay"] = rep
    row["offsets"] = [c.offset for c in cap.calls]
    plain_target = PLAIN.get(target)
    if plain_target is not None:
        from engine.executor import GenerationParams, plain_generate
        from specparity.runners import load_model as load_plain

        ref = plain_generate(load_plain(str(zoo.model_dir(plain_target))).model, cap.prompt_ids,
                             GenerationParams(max_tokens=len(cap.stream), gamma=0, eos_ids=(),
                                              cache_digests=False)).output_ids
        i = first_divergence(cap.stream, list(ref))
        row["identity"] = {"status": "pass" if i is None else "fail", "tokens": len(cap.stream),
                           "first_divergence": i}
    return row


def grade_flyto(out: Path, prompts: tuple[str, ...] = ("nat-00", "rnd-00")) -> dict[str, Any]:
    from subjects import flyto_mlx
    from subjects.mtp_conventions import capture_flyto, flyto_family_support

    doc: dict[str, Any] = {"engine": "flyto-mlx", "subject": "flyto-mlx-mtp", "version": flyto_mlx.version(),
                           "kind": "mtp-conventions", "rows": []}
    for target in TARGETS:
        ok, why = flyto_family_support(target)
        if not ok:
            doc["rows"].append({"checkpoint": target, "loads": False, "evidence": why})
            continue
        for p in prompts:
            cap = capture_flyto(p, target=target)
            if not cap.calls:
                doc["rows"].append({"checkpoint": target, "prompt": p, "loads": False,
                                    "evidence": "; ".join(cap.notes)})
                continue
            row = {"prompt": p, "loads": True, "evidence": why, **measure(cap, target)}
            row["conventions"] = verdict(row)
            doc["rows"].append(row)
    return doc


def markdown(doc: dict[str, Any]) -> str:
    """One table row per (checkpoint, prompt): the conventions measured, or why none could be."""
    cols = ("hidden", "concat", "mask_pos0", "rows/position", "depth", "identity")
    lines = [f"# Native-MTP conventions: {doc['engine']} {doc['version']} (subject {doc['subject']})", "",
             "Measured by `python -m specparity.mtp_conventions " + doc["engine"] + "`: every MTP head call of "
             "the engine recomputed with our `native-mtp` head under each named convention.", "",
             "| checkpoint | prompt | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for r in doc["rows"]:
        if not r.get("loads"):
            lines.append(f"| {r['checkpoint']} | {r.get('prompt', 'all')} | cannot drive it: {r['evidence']} |"
                         + " |" * (len(cols) - 1))
            continue
        c = r["conventions"]
        lines.append(f"| {r['checkpoint']} | {r['prompt']} | " + " | ".join(c.get(k, "") for k in cols) + " |")
    return "\n".join(lines) + "\n"


def write(doc: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    p = out / f"mtp-conventions-{doc['engine']}.json"
    p.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    p.with_suffix(".md").write_text(markdown(doc))
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specparity.mtp_conventions", description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=["flyto-mlx"])
    ap.add_argument("--out", type=Path, default=Path("runs/scoreboard"))
    a = ap.parse_args(argv)
    doc = grade_flyto(a.out)
    print(write(doc, a.out))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
