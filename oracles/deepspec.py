"""Oracle runner for DeepSpec: DeepSeek's torch DSpark propose/verify loop.

Reference: DeepSpec (deepseek-ai/DeepSpec, MIT; not on the package index —
a local checkout named by ``DEEPSPEC_PATH``; the goldens were made at commit
afdfa7c with torch 2.13.0 CPU and transformers 5.10.2, DeepSpec's pin):
``deepspec/eval/base_evaluator.py`` ``generate_decoding_sample`` /
``verify_draft_tokens`` driven through ``deepspec/eval/dspark/evaluator.py``
``Gemma4DSparkEvaluator`` (its ``_init_context`` / ``_propose`` / ``_update``),
with ``deepspec/modeling/dspark/gemma4/modeling.py`` ``Gemma4DSparkModel``.
The reference runs UNMODIFIED on CPU in float32 at temperature 0, where its
leaky rejection sampling is exact argmax token match (§4.3). Instrumentation
is from outside only:

- the evaluator object is made with ``object.__new__`` (its ``__init__``
  starts torch.distributed) and given the models and ``args``;
- rounds are recorded through the loop's ``post_verify`` hook (the proposal
  and the verification: window, drafts, target probabilities and logits,
  accepted count, next token, committed tokens, stop);
- the full block's confidence logits are read by wrapping
  ``draft_ops._confident_prefix_length`` (it receives them before truncating);
- a forward hook on the target records the prefill logits (the first token).

Trace normalisation (to the engine's round format, ``traces/INTERPRETING.md``):
DeepSpec drafts the whole block even when fewer tokens are left and trims the
output to ``max_new_tokens`` afterwards; the engine asks for
``n = min(γ, tokens left)``. Each round is rebuilt with the engine's accept
walk over DeepSpec's own per-position target argmax, drafts clipped to ``n``;
where nothing was clipped the rebuilt ``k_accept`` and next token must equal
DeepSpec's ``accepted_draft_tokens`` / ``next_token`` (else the runner raises).
The documented reference behaviour is ``deepspec-block-past-budget`` in
``traces/known_divergences.toml``.

DeepSpec's own accounting is recorded too (``deepspec_log_of``: per round the
drafts, accepted count, next token, committed tokens, stop flag and
effective proposal length; ``verify_count``, ``acceptance_lengths`` etc.
from the returned sample) and mapped by the four named DeepSpec
normalizations of ``traces/normalize.py`` (``deepspec-extra-verify-round``,
``deepspec-counters-count-discarded``, ``deepspec-eos-unused-next-token``,
``deepspec-eos-proposal-cut``); each refuses any other shape, and the mapped
counters must equal the rebuilt trace's (``check_counters``), so a DeepSpec
behaviour outside those four fails the run instead of being dropped.

The target is the zoo target in Hugging Face format (``zoo.dspark``
``<target>-hf``: the same weights); the drafter is the DeepSpec-format zoo
artifact, loaded with ``Gemma4DSparkModel.from_pretrained``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from oracles import OracleUnavailable
from oracles.recording import accept_walk
from traces.records import counters_from_rounds

NAME = "deepspec"


def _path() -> Path:
    p = os.environ.get("DEEPSPEC_PATH")
    if not p:
        raise OracleUnavailable("DEEPSPEC_PATH is not set")
    path = Path(p).expanduser()
    if not (path / "deepspec" / "eval" / "dspark" / "evaluator.py").exists():
        raise OracleUnavailable(f"DEEPSPEC_PATH={p} is not a DeepSpec checkout")
    return path


def require() -> None:
    path = _path()
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise OracleUnavailable(f"torch/transformers missing ({exc})") from exc
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    try:
        import deepspec.eval.dspark.evaluator  # noqa: F401
    except Exception as exc:  # an incompatible transformers fails at import
        raise OracleUnavailable(f"DeepSpec does not import here ({type(exc).__name__}: {exc})") from exc


def checkout_commit() -> str | None:
    """The commit of the checkout ``DEEPSPEC_PATH`` names: its ``.deepspec-commit`` file (a tree
    that is not a clone), else ``git rev-parse HEAD``; None when unset, not a checkout, or unknown.
    Needs neither torch nor DeepSpec's imports (the golden staleness check calls it)."""
    try:
        path = _path()
    except OracleUnavailable:
        return None
    marker = path / ".deepspec-commit"
    if marker.exists():
        return marker.read_text().strip() or None
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
    except Exception:
        return None
    return out or None


def version() -> str:
    """``<git commit>`` of the checkout (or ``unknown``), plus the torch/transformers versions."""
    import torch
    import transformers

    commit = checkout_commit() or "unknown"
    return f"{commit} (torch {torch.__version__}, transformers {transformers.__version__})"


def commit() -> str | None:
    v = version().split(" ")[0]
    return None if v == "unknown" else v


def _margins(logits: Any) -> list[float]:
    import torch

    top = torch.topk(logits.float(), 2, dim=-1).values
    return [float(x) for x in (top[..., 0] - top[..., 1]).tolist()]


def run(
    target_dir: Path | str,
    drafter_dir: Path | str,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    confidence_threshold: float = 0.0,
    eos_ids: list[int] | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Run DeepSpec's loop on one prompt; return the trace records after the header."""
    require()
    import torch
    from deepspec.eval.dspark import draft_ops
    from deepspec.eval.dspark import evaluator as ev
    from deepspec.modeling.dspark.gemma4 import Gemma4DSparkModel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    draft = Gemma4DSparkModel.from_pretrained(str(drafter_dir), dtype=torch.float32,
                                              attn_implementation="sdpa").eval()
    block = int(draft.block_size)

    evaluator = object.__new__(ev.Gemma4DSparkEvaluator)
    evaluator.target_model = target
    evaluator.draft_model = draft
    evaluator.confidence_head_recorder = None
    evaluator.args = SimpleNamespace(max_new_tokens=max_tokens, temperature=0.0,
                                     confidence_threshold=float(confidence_threshold))

    forwards: list[Any] = []
    handle = target.register_forward_hook(lambda mod, args, kwargs_out: forwards.append(kwargs_out.logits.detach()))
    full_conf: list[list[float]] = []
    original_cut = draft_ops._confident_prefix_length

    def recording_cut(confidence_logits: Any, *, block_size: int, threshold: float) -> int:
        full_conf.append([float(x) for x in confidence_logits[0].sigmoid().tolist()])
        return original_cut(confidence_logits, block_size=block_size, threshold=threshold)

    raw_rounds: list[dict[str, Any]] = []

    def post_verify(proposal: Any, verification: Any) -> None:
        d = int(proposal.draft_token_count)
        window = [int(t) for t in proposal.verify_input_ids[0].tolist()]
        raw_rounds.append({
            "window": window,
            "drafts": window[1:],
            "argmax": [int(t) for t in verification.target_probs[0].argmax(-1).tolist()],
            "margins": _margins(verification.target_output.logits[0]),
            "accepted": int(verification.accepted_draft_tokens),
            "next": int(verification.next_token.reshape(-1)[0].item()),
            "committed": [int(t) for t in verification.committed_tokens[0].tolist()],
            "stop": bool(verification.terminated_by_stop_token),
            "proposal_length": int(verification.effective_proposal_length),
            "confidence": full_conf[-1] if full_conf and len(full_conf) == len(raw_rounds) + 1 else None,
            "d": d,
        })

    evaluator._post_verify = post_verify
    draft_ops._confident_prefix_length = recording_cut
    try:
        with torch.inference_mode():
            sample = evaluator.generate_one_sample(
                input_ids=torch.tensor([list(prompt_ids)], dtype=torch.long),
                stop_token_ids=list(eos_ids) if eos_ids else None,
            )
    finally:
        draft_ops._confident_prefix_length = original_cut
        handle.remove()
    first_logits = forwards[0][0, -1]
    reference_out = [int(t) for t in sample.output_ids[0, len(prompt_ids):].tolist()]
    log = deepspec_log_of(raw_rounds, sample, max_tokens, list(eos_ids or []), reference_out)
    body = _rebuild(prompt_ids, first_logits, raw_rounds, block, max_tokens, float(confidence_threshold),
                    set(eos_ids or []))
    rounds = [r for r in body if r["type"] == "round"]
    out = [t for r in body if r["type"] in ("round", "plain") for t in r["emitted"]]
    gen = len(out) + (1 if body and body[-1].get("end") == "eos" else 0)
    finish = "stop" if body and body[-1].get("end") in ("eos", "stop") else "length"
    if [t for t in reference_out if t not in (eos_ids or [])] != out:
        raise RuntimeError(f"deepspec: rebuilt output {out} differs from DeepSpec's own {reference_out}")
    check_counters(log, rounds, gen)
    LAST_APPLIED[:] = log["applied"]
    body.append({
        "type": "footer",
        "usage": {"prompt_tokens": len(prompt_ids), "generation_tokens": gen, "finish_reason": finish},
        "speculation": counters_from_rounds(rounds, n_plain=1),
        "output_ids": out,
        "wall_s": time.perf_counter() - t0,
    })
    return body


LAST_APPLIED: list[str] = []
"""The DeepSpec normalizations (``traces/normalize.py``) the last :func:`run` applied."""


def deepspec_log_of(raw_rounds: list[dict[str, Any]], sample: Any, max_tokens: int, eos_ids: list[int],
                    output_ids: list[int]) -> dict[str, Any]:
    """DeepSpec's own record of one run (the log ``traces.normalize`` defines), normalized.

    Raises ``traces.normalize.NotApplicable`` when DeepSpec did anything the
    four named DeepSpec normalizations do not describe exactly.
    """
    from traces.normalize import deepspec_log

    acc = [int(x) for x in sample.acceptance_lengths]
    log = {
        "max_tokens": int(max_tokens),
        "eos_ids": list(eos_ids),
        "rounds": [{"drafts": list(r["drafts"]), "accepted": r["accepted"], "next": r["next"],
                    "committed": list(r["committed"]), "stop": r["stop"],
                    "proposal_length": r["proposal_length"]} for r in raw_rounds],
        "counters": {
            "verify_count": int(sample.verify_count),
            "committed_total": sum(acc),
            "acceptance_lengths": acc,
            "proposal_lengths": [int(x) for x in sample.proposal_lengths],
            "accepted_draft_lengths": [int(x) for x in sample.accepted_draft_lengths],
        },
        "output_ids": list(output_ids),
    }
    return deepspec_log(log)


def check_counters(log: dict[str, Any], rounds: list[dict[str, Any]], generation_tokens: int) -> None:
    """The normalized DeepSpec counters must be the rebuilt trace's: one verify per round, and
    the rounds' committed tokens = ``generation_tokens - 1`` (the first token is the prefill's)."""
    c = log["counters"]
    if c["verify_count"] != len(rounds) or len(log["rounds"]) != len(rounds):
        raise RuntimeError(f"deepspec: normalized verify_count {c['verify_count']} / {len(log['rounds'])} "
                           f"kept rounds, but {len(rounds)} rebuilt rounds")
    if c["committed_total"] != generation_tokens - 1:
        raise RuntimeError(f"deepspec: normalized committed_total {c['committed_total']} != "
                           f"generation_tokens - 1 = {generation_tokens - 1}")


def _rebuild(
    prompt_ids: list[int],
    first_logits: Any,
    raw: list[dict[str, Any]],
    block: int,
    max_tokens: int,
    threshold: float,
    eos: set[int],
) -> list[dict[str, Any]]:
    """DeepSpec's rounds in the engine's record format (see the module docstring)."""
    out: list[dict[str, Any]] = [{
        "type": "prefill", "target_tokens": list(prompt_ids), "drafter_tokens": [],
        "target_cache_digest": None, "drafter_cache_digest": None,
    }]
    first = int(first_logits.argmax().item())
    emitted_total = 0
    end0 = "eos" if first in eos else ("budget" if max_tokens == 1 else None)
    out.append({
        "type": "plain", "index": 0, "input": [prompt_ids[-1]], "sample": first,
        "margin": _margins(first_logits[None])[0], "emitted": [] if first in eos else [first],
        "end": end0, "reason": "initial", "target_cache_digest": None, "time_s": None,
    })
    if end0 is not None:
        return out
    emitted_total = 1
    feed = [first]
    for i, r in enumerate(raw):
        left = max_tokens - emitted_total
        n = min(block, left)
        ell = r["d"]
        d = min(ell, n)
        drafts = r["drafts"][:d]
        samples, emitted, k, end = accept_walk(drafts, r["argmax"], eos, emitted_total, max_tokens)
        emitted_total += len(emitted)
        if d == ell:  # nothing clipped: the rebuilt walk must be DeepSpec's own decision
            ref_k, ref_next = r["accepted"], r["next"]
            if end == "eos" and r["stop"]:
                ok = k == ref_k
            else:
                ok = k == ref_k and (end in ("eos", "budget") or samples[-1] == ref_next)
            if not ok:
                raise RuntimeError(f"deepspec round {i}: rebuilt k={k} samples={samples} but DeepSpec accepted "
                                   f"{ref_k} next {ref_next} committed {r['committed']}")
        conf = r["confidence"]
        if conf is not None:
            conf = conf[: d + 1] if (threshold > 0 and ell < n) else conf[:d]
        out.append({
            "type": "round", "index": i, "feed": list(feed), "drafts": drafts,
            "window": [r["window"][0], *drafts], "samples": samples, "k_accept": k,
            "emitted": emitted, "end": end, "margins": r["margins"][: d + 1], "confidence": conf,
            "target_cache_digest": None, "drafter_cache_digest": None, "time_s": None,
        })
        if end in ("eos", "budget", "stop"):
            break
        feed = [drafts[-1], samples[-1]] if d and k == d else [samples[-1]]
    return out
