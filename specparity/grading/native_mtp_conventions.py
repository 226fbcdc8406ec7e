"""Grade an engine's native-MTP conventions against our ``native-mtp`` source (issue 28).

``python -m specparity.grading.native_mtp_conventions flyto-mlx|mtplx|vllm-mlx --out docs/scoreboard`` (in the
engine's environment: ``tox exec -e subject-flyto-mlx-mtp -- ...``, ``subject-mtplx``, vllm-mlx's
server virtualenv) captures the
engine's MTP head calls on each zoo native-MTP checkpoint
(``subjects/mtp_conventions.py``) and, input for input, recomputes them with
``engine.sources.native_mtp``'s head (the checkpoint's ``MTPBlock``, mlx-lm's
decoder layer) under each named convention (``Conventions``: ``hidden``,
``concat``, ``mask_pos0``, the row position; the rows the engine's head cache held
before each call are replayed, cut back to the head-cache offset it had), then writes
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
    from engine.sources.native_mtp import load_head, target_parts
    from zoo.native_mtp import target_paths

    tpath, cpath = target_paths(target)
    # the trunk without MTP tensors: mlx-lm's qwen3_5 sanitize shifts every norm by +1 when it
    # sees mtp.* keys (it assumes a Hugging Face checkpoint), so the native dir is not read as is
    model = load_model(zoo.model_dir(PLAIN[target]) if target in PLAIN else Path(tpath))[0]
    embed, lm_head, norm = target_parts(model)
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


def _replay(block: Any, parts: tuple[Any, Any, Any], calls: list[Any], starts: list[int], concat: str,
            mask_pos0: bool) -> list[np.ndarray | None]:
    """Our head over the engine's calls, in order, on one cache holding the engine's own rows (cut back
    to each call's head-cache offset first): call ``i``'s rows at RoPE positions ``starts[i]..``; the
    last row's logits of each call (``concat`` / ``mask_pos0`` applied), None where the engine's cache
    held rows no recorded call built."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    t_embed, t_head, _ = parts
    embed = getattr(block, "embed", None) or t_embed
    lm_head = getattr(block, "head", None) or t_head
    cache = KVCache()
    out: list[np.ndarray | None] = []
    for c, pos in zip(calls, starts, strict=True):
        # the engine's head cache held c.offset rows: a fresh cache or a rollback keeps the first ones
        if cache.offset > c.offset:
            cache.trim(cache.offset - c.offset)
        if cache.offset < c.offset:  # rows the engine built outside the recorded calls
            out.append(None)
            continue
        e = embed(mx.array([c.tokens], dtype=mx.uint32))
        if mask_pos0 and pos == 0:
            e = e * (mx.arange(e.shape[1]) > 0).astype(e.dtype)[None, :, None]
        _, post = block(e, mx.array(c.hidden)[None], pos, concat, cache)
        out.append(np.array(lm_head(post)[0, -1].astype(mx.float32)))
    return out


def _diffs(got: list[np.ndarray | None], calls: list[Any]) -> list[float]:
    return [float("inf") if g is None else float(np.max(np.abs(g - c.logits)))
            for g, c in zip(got, calls, strict=True) if c.logits is not None]


def _plain(target: str, prompt: list[int], n: int) -> list[int]:
    import zoo
    from engine.executor import GenerationParams, plain_generate
    from specparity.runners import load_model as load_plain
    from zoo.native_mtp import target_paths

    path = str(zoo.model_dir(PLAIN[target])) if target in PLAIN else str(target_paths(target)[0])
    return list(plain_generate(load_plain(path).model, prompt, GenerationParams(
        max_tokens=n, gamma=0, eos_ids=(), cache_digests=False)).output_ids)


def measure(cap: Capture, target: str) -> dict[str, Any]:
    """The conventions ``cap``'s head calls match, measured with our native-mtp head."""
    model, parts, head, _ = _our_parts(target)
    block = head.blocks[0]
    calls = cap.calls
    seq = cap.prompt_ids + cap.stream
    pre, post = _hidden_rows(model, seq, parts[2])
    row: dict[str, Any] = {"checkpoint": target, "calls": len(calls),
                           "calls_with_logits": sum(c.logits is not None for c in calls),
                           "rows": sum(len(c.tokens) for c in calls), "depth_layers": len(head.blocks)}
    # hidden: which target row the engine fed with each token
    hits = [(match_hidden(h, pre, post), tok) for c in calls for h, tok in zip(c.hidden, c.tokens, strict=True)]
    kinds = sorted({m[0] for m, _ in hits if m[2] <= 1e-3})
    pairs = sorted({next((k for k in (1, 0, 2) if m[1] + k < len(seq) and seq[m[1] + k] == tok), -1)
                    for m, tok in hits})
    row["hidden"] = {"match": kinds, "max_diff": max((m[2] for m, _ in hits), default=None),
                     "token_offset_from_hidden_row": pairs,
                     "note": "the token embedded with hidden row q is sequence token q + offset"}
    seqpos, i = [], 0
    for c in calls:
        seqpos.append(hits[i][0][1])
        i += len(c.tokens)
    offsets = [c.offset if c.position_offset is None else c.position_offset for c in calls]
    # concat / mask: the calls up to the first with logits, replayed at the engine's own offsets
    f = next(k for k, c in enumerate(calls) if c.logits is not None)
    cands: dict[str, np.ndarray] = {}
    for cc in ("e;h", "h;e"):
        for m in (False, True):
            got = _replay(block, parts, calls[: f + 1], offsets[: f + 1], cc, m)[f]
            if got is not None:
                cands[f"concat={cc},mask_pos0={str(m).lower()}"] = got
    assert calls[f].logits is not None
    first = best_preset(calls[f].logits, cands)
    row["first_call"] = {"index": f, "offset": calls[f].offset, "rows_before": sum(len(c.tokens) for c in calls[:f]),
                         **first}
    conv = first["closest"] or "concat=e;h,mask_pos0=false"
    cc = conv.split(",")[0].split("=")[1]
    mk = conv.endswith("true")
    replays = {"engine rows at head-cache positions": offsets,
               "engine rows at their sequence positions": seqpos}
    rep = {}
    for name, starts in replays.items():
        d = _diffs(_replay(block, parts, calls, starts, cc, mk), calls)
        rep[name] = {"max_diff": max(d), "calls_within": sum(x <= SAME for x in d), "calls": len(d)}
    row["replay"] = rep
    row["offsets"] = offsets
    row["fresh_head_cache_calls"] = sum(1 for c in calls if c.offset == 0)
    ref = _plain(target, cap.prompt_ids, len(cap.stream))
    i = first_divergence(cap.stream, ref)
    row["identity"] = {"status": "pass" if i is None else "fail", "tokens": len(cap.stream),
                       "first_divergence": i}
    return row


def _flyto() -> tuple[str, str, Any, Any]:
    from subjects import flyto_mlx
    from subjects.mtp_conventions import capture_flyto, flyto_family_support

    return "flyto-mlx-mtp", flyto_mlx.version(), capture_flyto, flyto_family_support


def _mtplx() -> tuple[str, str, Any, Any]:
    from subjects import mtplx
    from subjects.mtp_conventions import capture_mtplx

    def support(target: str) -> tuple[bool, str]:  # mtplx's own loader decides, at capture
        return True, "mtplx.runtime.load(checkpoint, mtp=True) attached an MTP head"

    return "mtplx", mtplx.version(), capture_mtplx, support


def _vllm_mlx() -> tuple[str, str, Any, Any]:
    from subjects.common import dist_version
    from subjects.mtp_conventions import vllm_mlx_support

    def capture(*a: Any, **kw: Any) -> Any:  # pragma: no cover - reached only if its loop could run
        raise NotImplementedError("vllm-mlx's MTP loop ran here: add its head-call capture")

    return "vllm-mlx", dist_version("vllm-mlx"), capture, vllm_mlx_support


ENGINES = {"flyto-mlx": _flyto, "mtplx": _mtplx, "vllm-mlx": _vllm_mlx}


def grade(engine: str, prompts: tuple[str, ...] = ("nat-00", "rnd-00")) -> dict[str, Any]:
    """Every zoo native-MTP checkpoint through ``engine``'s MTP path, measured (or why not)."""
    subject, version, capture, support = ENGINES[engine]()
    doc: dict[str, Any] = {"engine": engine, "subject": subject, "version": version,
                           "kind": "mtp-conventions", "rows": []}
    import zoo

    for target in TARGETS:
        ok, why = support(target)
        why = why.replace(str(zoo.cache_root()), "<zoo cache>")
        if not ok:
            doc["rows"].append({"checkpoint": target, "loads": False, "evidence": why})
            continue
        for p in prompts:
            cap = capture(p, target=target)
            if not cap.calls:
                doc["rows"].append({"checkpoint": target, "prompt": p, "loads": False,
                                    "evidence": "; ".join(cap.notes).replace(str(zoo.cache_root()),
                                                                             "<zoo cache>")})
                break  # the engine refuses the checkpoint: one row says so
            row = {"prompt": p, "loads": True, "evidence": why, "hooks": cap.notes, **measure(cap, target)}
            row["conventions"] = verdict(row)
            doc["rows"].append(row)
    return doc


def markdown(doc: dict[str, Any]) -> str:
    """One table row per (checkpoint, prompt): the conventions measured, or why none could be."""
    cols = ("hidden", "concat", "mask_pos0", "rows/position", "depth", "identity")
    lines = [f"# Native-MTP conventions: {doc['engine']} {doc['version']} (subject {doc['subject']})", "",
             "Measured by `python -m specparity.grading.native_mtp_conventions " + doc["engine"] + "`: every MTP head call of "
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


def out_paths(engine: str, out: Path) -> tuple[Path, Path]:
    """``OUT/mtp-conventions-<engine>.json`` and its ``.md``."""
    p = out / f"mtp-conventions-{engine}.json"
    return p, p.with_suffix(".md")


def write(doc: dict[str, Any], out: Path, track: Any = None) -> Path:
    """Write the document and its table (atomically; ``track`` registers each file with its
    output directory before it is written: ``specparity.cli.outdir.Claim.track``)."""
    from traces.io import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    p, md = out_paths(doc["engine"], out)
    for path, text in ((p, json.dumps(doc, indent=2, sort_keys=True) + "\n"), (md, markdown(doc))):
        if track is not None:
            track(path)
        atomic_write_text(path, text)
    return p


def is_conventions_output(p: Path) -> bool:
    """A ``mtp-conventions-*.json``/``.md`` this module wrote (before output markers existed)."""
    from specparity.cli.args import read_small_json

    if p.suffix == ".json":
        doc = read_small_json(p)
        return isinstance(doc, dict) and doc.get("kind") == "mtp-conventions"
    try:
        with open(p, encoding="utf-8") as fh:
            return fh.read(40).startswith("# Native-MTP conventions: ")
    except (OSError, UnicodeDecodeError):
        return False


PROG = "python -m specparity.grading.native_mtp_conventions"


def main(argv: list[str] | None = None) -> int:
    from specparity.cli.args import UsageError, writable_dir
    from specparity.cli.outdir import add_outputs, refusal

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=sorted(ENGINES))
    ap.add_argument("--out", type=writable_dir, default=Path("runs/scoreboard"))
    a = ap.parse_args(argv)
    try:
        with add_outputs(a.out, PROG, recognise=is_conventions_output) as claim:
            for path in out_paths(a.engine, a.out):
                claim.check(path)  # refused before any engine runs if not ours
            doc = grade(a.engine)
            print(write(doc, a.out, claim.track))
    except UsageError as exc:
        return refusal(PROG, exc)
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
