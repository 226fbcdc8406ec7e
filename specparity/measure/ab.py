"""Paired drafter A/B (reference §4.5 phase 1c): same target, same prompts, temp 0.

Drafter A (the baseline) and drafter B (the candidate) draft for the same
target through the engine's ``two-model`` source. Per prompt both arms run
back to back in AB/BA order (A first on even prompts, B first on odd) so that
load drift lands on both arms (§4.7). After one untimed warm-up per arm:

- per arm: acceptance (accepted / drafted), acceptance by draft position,
  τ (generated tokens per target forward), tok/s;
- **paired acceptance outcomes for McNemar**: one unit per (prompt, position of
  the emitted token stream); the outcome is 1 when that token was a draft the
  target accepted, 0 when it came from the target (correction or bonus). At
  temperature 0 both arms emit the same greedy stream, so the units pair
  one-to-one; where a knife-edge flip makes the streams differ, units are
  paired up to the first differing token and the count is reported;
- **paired wall clock**: per prompt, time-per-token ratio B / A; its median
  with a 95 % percentile bootstrap interval (``reports.stats.median_ratio``).
  The seconds come from a timing source (``timing(arm, prompt_index,
  result)``, default :func:`measured_wall`: the run's own ``wall_s``), so the
  verdict logic is tested on injected timings, never on the test machine's
  clock;
- verdict (``reports.stats.ab_verdict``): acceptance does not drop by more than
  ``max_drop`` points AND the whole wall-time interval lies below 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traces.diff import common_prefix

MIN_PROMPTS = 32

Timing = Callable[[str, int, Any], float]
"""``timing(arm, prompt_index, result) -> seconds`` of one timed run (never the warm-up)."""


def measured_wall(arm: str, index: int, result: Any) -> float:
    """The default timing source: the run's own wall clock (``GenerationResult.wall_s``)."""
    return float(result.wall_s)


def timed(per: dict[str, list[Any]], timing: Timing) -> dict[str, list[float]]:
    """Seconds of every timed run, per arm, from ``timing``; each finite and > 0."""
    out: dict[str, list[float]] = {}
    for arm, results in per.items():
        secs = []
        for i, r in enumerate(results):
            s = timing(arm, i, r)
            if isinstance(s, bool) or not (isinstance(s, int | float) and math.isfinite(s) and s > 0):
                raise ValueError(f"timing of arm {arm} prompt {i}: {s!r} is not a finite number "
                                 "of seconds > 0")
            secs.append(float(s))
        out[arm] = secs
    return out


def time_ratios(res_a: Sequence[Any], secs_a: Sequence[float], res_b: Sequence[Any],
                secs_b: Sequence[float]) -> list[float]:
    """Per prompt: B's time per generated token over A's (< 1: B faster)."""
    return [(sb / max(1, rb.usage.generation_tokens)) / (sa / max(1, ra.usage.generation_tokens))
            for ra, sa, rb, sb in zip(res_a, secs_a, res_b, secs_b, strict=True)]


@dataclass
class Arm:
    label: str
    spec: str
    path: Path
    model: Any


def resolve_target(target: str) -> tuple[str, Path]:
    """A zoo target name, a trained-pair name, or a local model directory."""
    import zoo

    if target in (*zoo.TARGETS, *zoo.KV_TARGETS):  # llama-kv(64): the quantized-KV pairs
        return target, zoo.model_dir(target)
    trained = _trained(target)
    if trained is not None:
        return target, trained
    p = Path(target).expanduser()
    if p.is_dir():
        return target, p
    raise ValueError(f"target {target!r} is neither a zoo target ({', '.join(zoo.TARGETS)}), "
                     "a trained zoo model, nor a local model directory")


def resolve_drafter(target: str, drafter: str) -> Path:
    """A zoo drafter name (``self``/``twin``/``small``) for a zoo target, a trained name, or a path."""
    import zoo

    if drafter in zoo.DRAFTERS:
        if target not in (*zoo.TARGETS, *zoo.KV_TARGETS):
            if drafter == "self":
                return resolve_target(target)[1]
            raise ValueError(f"zoo drafter {drafter!r} needs a zoo target "
                             f"({', '.join(zoo.TARGETS)}); pass a model directory instead")
        return zoo.pair(target, drafter)[1]
    trained = _trained(drafter)
    if trained is not None:
        return trained
    p = Path(drafter).expanduser()
    if p.is_dir():
        return p
    raise ValueError(f"drafter {drafter!r} is neither a zoo drafter ({', '.join(zoo.DRAFTERS)}), "
                     "a trained zoo model, nor a local model directory")


def _trained(name: str) -> Path | None:
    from zoo import train

    try:
        if name in train.trained_manifest()["models"]:
            return train.trained_dir(name)
    except FileNotFoundError:
        return None
    return None


def accepted_flags(records: list[dict[str, Any]]) -> list[bool]:
    """Per emitted token: was it a draft the target accepted?"""
    flags: list[bool] = []
    for r in records:
        if r["type"] == "round":
            emitted, k = r["emitted"], r["k_accept"]
            flags += [i < k for i in range(len(emitted))]
        elif r["type"] == "plain":
            flags += [False] * len(r["emitted"])
    return flags


def choose_prompts(n: int, model_dir: Path | None = None, prompts_file: Path | None = None,
                   max_tokens: int = 0, chat_template: bool = False) -> list[Any]:
    """``n`` zoo prompts, or every prompt of ``prompts_file``; checked against ``model_dir``."""
    import zoo
    from specparity.cases.case import pick_prompts

    if prompts_file is not None:
        from specparity.cases.prompts import prompts_for_model

        assert model_dir is not None
        return prompts_for_model(model_dir, prompts_file=prompts_file, max_tokens=max_tokens,
                                 chat_template=chat_template)
    if chat_template:
        raise ValueError("--chat-template renders text prompts: give --prompts-file FILE (the zoo's "
                         "prompts are token ids)")
    all_ids = [p.id for p in zoo.prompts()]
    if n > len(all_ids):
        raise ValueError(f"--prompts {n}: the zoo has {len(all_ids)} prompts")
    if model_dir is not None:
        from specparity.cases.prompts import prompts_for_model

        return prompts_for_model(model_dir, zoo_ids=pick_prompts(all_ids, n), max_tokens=max_tokens)
    return [zoo.prompt(i) for i in pick_prompts(all_ids, n)]


def engine_cache(cache: dict[str, Any] | None) -> dict[str, Any]:
    """``GenerationParams`` keywords of the cache flags (None values: the engine's defaults)."""
    return {k: v for k, v in (cache or {}).items() if v is not None}


def run_ab(
    target: str,
    drafter_a: str,
    drafter_b: str,
    *,
    gamma: int = 3,
    n_prompts: int = MIN_PROMPTS,
    max_tokens: int = 32,
    max_drop: float = 3.0,
    allow_small: bool = False,
    progress: Any = None,
    prompts_file: Path | None = None,
    cache: dict[str, Any] | None = None,
    timing: Timing = measured_wall,
    chat_template: bool = False,
) -> dict[str, Any]:
    """Run the A/B and return its result (the ``ab.json`` content).

    ``cache``: :func:`specparity.cli.kv_args.cache_fields` (``kv_bits``, ``kv_group_size``,
    ``quantized_kv_start``, ``rotating``), applied to both arms and recorded.

    ``timing`` gives each timed run's seconds (default: its measured wall
    clock); tests inject timings so the verdict never rests on their machine.
    """
    if not (isinstance(max_drop, int | float) and math.isfinite(max_drop) and max_drop >= 0):
        raise ValueError(f"--max-drop must be a finite number >= 0 (points), got {max_drop!r}")
    from engine.backend import emulate_from_env
    from engine.executor import GenerationParams, spec_generate
    from engine.sources.two_model import TwoModelProvider
    from reports.stats import ab_verdict, median_ratio, paired_drop
    from specparity.runners import load_model

    emulate_from_env()  # SPECPARITY_EMULATE_MISSING_OP: the missing-op double here too
    _tname, tpath = resolve_target(target)
    prompts = choose_prompts(n_prompts, tpath, prompts_file, max_tokens, chat_template)
    n_prompts = len(prompts)
    if n_prompts < MIN_PROMPTS and not allow_small:
        raise ValueError(f"--prompts {n_prompts} < {MIN_PROMPTS}: §4.5 asks for >= {MIN_PROMPTS} "
                         "prompts (pass --allow-small to run anyway)")
    if gamma < 1:
        raise ValueError(f"--gamma must be >= 1, got {gamma}")
    tgt = load_model(str(tpath))
    arms = {}
    for label, spec in (("A", drafter_a), ("B", drafter_b)):
        path = resolve_drafter(target, spec)
        loaded = load_model(str(path))
        provider = TwoModelProvider(loaded.model, draft_tokenizer=loaded.tokenizer)
        provider.check_target(tgt.model, tgt.tokenizer)
        arms[label] = (Arm(label, spec, path, loaded.model), provider)
    params = GenerationParams(max_tokens=max_tokens, gamma=gamma, eos_ids=tgt.eos_ids,
                              cache_digests=False, **engine_cache(cache))

    def go(label: str, ids: list[int]) -> Any:
        return spec_generate(tgt.model, arms[label][1], ids, params)

    from engine.backend import Unsupported, run_supported

    for label in ("A", "B"):  # untimed warm-up (a missing op shows again on the prompt's own run)
        run_supported(lambda: go(label, list(prompts[0].token_ids)), "warm-up")  # noqa: B023

    # A missing op (engine.backend.run_supported) is that prompt's verdict: the prompt is left out of
    # the pairing (both arms), listed, and the A/B goes on over the others.
    per: dict[str, list[Any]] = {"A": [], "B": []}
    unsupported: list[dict[str, Any]] = []
    kept = []
    for i, p in enumerate(prompts):
        order = ("A", "B") if i % 2 == 0 else ("B", "A")
        got: dict[str, Any] = {}
        for label in order:
            got[label] = run_supported(lambda: go(label, list(p.token_ids)), f"arm {label} prompt {p.id}")  # noqa: B023
        gone = [(label, g) for label, g in got.items() if isinstance(g, Unsupported)]
        if gone:
            unsupported.append({"prompt_id": p.id, "arms": [label for label, _ in gone],
                                "verdict": gone[0][1].verdict, "text": gone[0][1].text})
        else:
            kept.append(p)
            for label in ("A", "B"):
                per[label].append(got[label])
        if progress is not None:
            progress(i + 1, len(prompts))
    if not kept:
        return _all_unsupported(target, tpath, drafter_a, drafter_b, gamma, max_tokens, prompts, unsupported, cache)
    prompts = kept

    secs = timed(per, timing)
    flags_a: list[bool] = []
    flags_b: list[bool] = []
    differing = 0
    for ra, rb in zip(per["A"], per["B"], strict=True):
        fa, fb = accepted_flags(ra.records), accepted_flags(rb.records)
        n = common_prefix(ra.output_ids, rb.output_ids)
        if n != len(ra.output_ids) or n != len(rb.output_ids):
            differing += 1
        flags_a += fa[:n]
        flags_b += fb[:n]
    ratios = time_ratios(per["A"], secs["A"], per["B"], secs["B"])
    acceptance = paired_drop(flags_a, flags_b, max_drop_pts=max_drop)
    wall = median_ratio(ratios)
    verdict = ab_verdict(acceptance, wall)

    arm_rows, by_pos = [], []
    for label in ("A", "B"):
        arm, _ = arms[label]
        res = per[label]
        drafted = sum(r.speculation.drafted for r in res)
        accepted = sum(r.speculation.accepted for r in res)
        tokens = sum(r.usage.generation_tokens for r in res)
        calls = sum(r.speculation.target_calls for r in res)
        wall_s = sum(secs[label])
        arm_rows.append({
            "arm": label, "drafter": arm.spec, "path": str(arm.path), "drafted": drafted,
            "accepted": accepted, "acceptance": round(accepted / drafted, 4) if drafted else None,
            "accepted_token_share": round(sum(flags_a if label == "A" else flags_b)
                                          / max(1, len(flags_a)), 4),
            "tau": round(tokens / calls, 4), "tokens": tokens, "wall_s": round(wall_s, 4),
            "tok_per_s": round(tokens / wall_s, 1),
        })
        width = max((len(r.speculation.drafted_by_pos) for r in res), default=0)
        for j in range(width):
            d = sum(r.speculation.drafted_by_pos[j] for r in res
                    if j < len(r.speculation.drafted_by_pos))
            a = sum(r.speculation.accepted_by_pos[j] for r in res
                    if j < len(r.speculation.accepted_by_pos))
            by_pos.append({"arm": label, "position": j + 1, "drafted": d, "accepted": a,
                           "acceptance": round(a / d, 4) if d else None})
    return {
        **({"cache": dict(cache)} if cache else {}),
        "kind": "ab", "target": target, "target_path": str(tpath), "drafter_a": drafter_a,
        "drafter_b": drafter_b, "gamma": gamma, "max_tokens": max_tokens,
        "n_prompts": len(prompts), "prompt_ids": [p.id for p in prompts],
        "order": "AB on even prompts, BA on odd; one untimed warm-up per arm",
        "pairing": ("McNemar units: (prompt, emitted-token position); outcome = token was an "
                    "accepted draft; paired up to the first token where the arms' streams differ"),
        "prompts_with_differing_streams": differing, "units": len(flags_a),
        "arms": arm_rows, "by_position": by_pos,
        "ratios": {"wall_time_b_over_a": wall.to_dict()},
        "per_prompt_time_ratio_b_over_a": [round(r, 5) for r in ratios],
        "verdict": _with_unsupported(verdict.to_dict(), unsupported, len(prompts)),
        "unsupported": unsupported,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _with_unsupported(verdict: dict[str, Any], unsupported: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The verdict over the prompts measured, with a reason naming the prompts the backend could not run."""
    if unsupported:
        verdict = {**verdict, "reasons": [*verdict.get("reasons", []),
                                          f"{len(unsupported)} prompts left out, {unsupported[0]['verdict']} "
                                          f"(the verdict is over the other {n})"]}
    return verdict


def _all_unsupported(target: str, tpath: Path, drafter_a: str, drafter_b: str, gamma: int, max_tokens: int,
                     prompts: list[Any], unsupported: list[dict[str, Any]],
                     cache: dict[str, Any] | None) -> dict[str, Any]:
    """The result of an A/B whose every prompt hit a missing op: verdict UNSUPPORTED (never a pass)."""
    v = unsupported[0]
    return {
        **({"cache": dict(cache)} if cache else {}),
        "kind": "ab", "target": target, "target_path": str(tpath), "drafter_a": drafter_a,
        "drafter_b": drafter_b, "gamma": gamma, "max_tokens": max_tokens,
        "n_prompts": len(prompts), "prompt_ids": [p.id for p in prompts], "unsupported": unsupported,
        "verdict": {"verdict": "UNSUPPORTED", "passes": False,
                    "reasons": [f"every prompt unsupported: {v['verdict']} — {v['text']}"]},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def ab_markdown(res: dict[str, Any]) -> str:
    import pandas as pd

    v = res["verdict"]
    if v["verdict"] == "UNSUPPORTED":
        return "\n".join([f"# A/B: drafter `{res['drafter_a']}` (A) vs `{res['drafter_b']}` (B) on `{res['target']}`",
                          "", "**UNSUPPORTED** (nothing measured: every prompt hit an op the backend lacks)", "",
                          *[f"- {r}" for r in v["reasons"]]]) + "\n"
    acc = v["acceptance"]
    w = v["wall_ratio_b_over_a"]
    t = acc["table"]
    lines = [
        f"# A/B: drafter `{res['drafter_a']}` (A) vs `{res['drafter_b']}` (B) on `{res['target']}`",
        "",
        f"**{v['verdict']}** (§4.5: acceptance drop <= {acc['max_drop_pts']:g} pts AND wall clock "
        "strictly improves)", "",
        *[f"- {r}" for r in v["reasons"]], "",
        f"γ={res['gamma']}, max_tokens={res['max_tokens']}, {res['n_prompts']} prompts, "
        f"temperature 0, engine two-model; {res['order']}.", "",
        "## Per arm", "", pd.DataFrame(res["arms"]).to_markdown(index=False), "",
        "## Acceptance by draft position", "",
        pd.DataFrame(res["by_position"]).to_markdown(index=False), "",
        "## Statistics", "",
        f"- Pairing: {res['pairing']}; {res['units']} units; "
        f"{res['prompts_with_differing_streams']} prompts with differing streams.",
        f"- McNemar ({acc['test']}, statsmodels): a={t['a']} b={t['b']} c={t['c']} d={t['d']}; "
        f"two-sided p={acc['p_two_sided']:.4g}, one-sided (drop) p={acc['p_one_sided']:.4g}.",
        f"- Drop A−B {acc['drop_pts']:.2f} pts; one-sided {100 * (1 - acc['alpha']):.0f}% "
        f"bounds [{acc['lower_pts']:.2f}, {acc['upper_pts']:.2f}] ({acc['method']}). "
        f"{acc['note']}.",
        f"- Wall-time ratio B/A per prompt (time per token): median {w['median']:.3f}, "
        f"{100 * w['confidence']:.0f}% CI [{w['low']:.3f}, {w['high']:.3f}] ({w['method']}).",
    ]
    if res.get("unsupported"):
        lines += ["", "## Unsupported on this backend (left out of the pairing)", "",
                  *[f"- prompt `{u['prompt_id']}` (arm {', '.join(u['arms'])}): `{u['text']}`" for u in res["unsupported"]]]
    return "\n".join(lines) + "\n"


def write_ab(res: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``ab.json`` and ``ab.md`` atomically (never a partial file under either name)."""
    from traces.io import atomic_write_json, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / "ab.json", out / "ab.md"
    atomic_write_json(jp, res, nan_as_null=True)
    atomic_write_text(mp, ab_markdown(res))
    return jp, mp
