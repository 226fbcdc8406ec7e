"""Draft-level golden producers: the references' drafters, recorded inside their own round loops.

A wrong MTP draft row (built from the wrong hidden position) or a drifted
assistant drafter stays LOSSLESS after verification: plain-greedy identity
cannot see it, and the round-level goldens only see it where it flips a
draft token. These goldens record, per round, the drafted tokens (the trace's
rounds) and a digest of the logits of every draft (header ``draft_logits``,
``oracles/drafts.py``) from:

- ``mlx_vlm_mtp``: mlx-vlm 0.7.10's ``qwen3_5_mtp`` drafter in its own MTP
  round loop (``oracles.mlx_vlm.run_mtp``, the §3-aligned ``pre-norm`` target
  adapter: round for round identical to the engine's ``mtp`` source), on the
  zoo ``qwen35`` target with both zoo heads;
- ``mlx_vlm_assistant``: mlx-vlm 0.7.10's gemma4 ``Gemma4AssistantDraftModel``
  (its own layers, masks and heads, ``oracles.mlx_vlm.assistant_step_logits``)
  queried at §3's positions (step ``k`` at ``kv_offset + k``; mlx-vlm's own
  loop holds ``kv_offset - 1``, the documented
  ``mlx-vlm-assistant-fixed-draft-position``, so its loop cannot be the
  golden), inside a greedy §2 round loop whose target state is mlx-vlm's own
  gemma4 model (``load_target``: the zoo weights) recomputed from scratch
  each round (``return_shared_kv`` K/V, ``hidden_states[-1]`` through
  ``speculative_draft_hidden``, as ``_mtp_rounds`` hands them over), verify
  by a full forward over the context + window (greedy walk, as the DeepSpec
  and mlx-vlm rebuilds);
- ``optiq_assistant``: mlx-optiq 0.7.7's ``GemmaAssistantDrafter`` in its
  ``spec_generate`` loop (``oracles.optiq.run_assistant``; §3's L2 oracle for
  the ``assistant`` row), on the zoo ``gemma4`` target with the three zoo
  assistant heads, mapped by its two named normalizations
  (``optiq-spec-budget-drafts``, ``optiq-stopping-eos``, named in the header's
  ``normalizations``) at record time.

- ``mlx_vlm_native_mtp``: the same mlx-vlm loop and drafter class loaded from the
  zoo's native Qwen checkpoint ``qwen35-native`` (``mtp.*`` inside the target;
  mlx-vlm's own splitter, ``oracles/mlx_vlm_native_mtp.py``), pre-norm adapter:
  the engine's ``native-mtp`` source under the qwen conventions with ``hidden=pre-norm``.

Each is a golden set its runner declares (``GoldenSet.produce``: ``specparity/runners/mlx_vlm.py``,
``mlx_vlm_native_mtp.py``, ``optiq.py``; the cases: ``specparity/cases/golden_cases.py``), kept
like any golden (``specparity/goldens/manifest.py``: staleness by package version, runner code
and every other input), written by ``specparity regen --runner mlx_vlm_mtp`` (``tox -e vlm``'s
environment) / ``--runner optiq_assistant`` (``tox -e optiq``'s) and compared
with the live engine in the default run: rounds by ``conformance/test_goldens.py``,
draft logits step by step by ``conformance/test_draft_goldens.py``.
"""

from __future__ import annotations

from functools import cache
from typing import Any

OPTIQ_NORMALIZATIONS = ("optiq-spec-budget-drafts", "optiq-stopping-eos")


def _header(runner: dict[str, Any], case: Any) -> tuple[dict[str, Any], Any]:
    """The header ``specparity.runners.run_case`` writes for a head-source case, with ``runner``."""
    import zoo
    from specparity.runners import case_params, case_paths, load_model, model_identity
    from traces.records import make_header

    tpath, dpath = case_paths(case)
    target = load_model(str(tpath))
    ids = list(zoo.prompt(case.prompt_id).token_ids)
    header = make_header(
        runner=runner, mode=case.mode, source=case.source, case_id=case.case_id,
        target=model_identity(tpath), drafter=model_identity(dpath) if dpath is not None else None,
        tokenizer_sha256=zoo.tokenizer_digest(), params=case_params(case, "full"),
        prompt_id=case.prompt_id, prompt_ids=ids,
        eos_ids=case.eos_ids if case.eos_ids is not None else target.eos_ids,
    )
    return header, target


@cache
def _vlm_target(target: str) -> Any:
    import zoo
    from oracles.mlx_vlm import load_target

    return load_target(zoo.model_dir(target), hidden="pre-norm")


def produce_mlx_vlm_mtp(case: Any) -> list[dict[str, Any]]:
    """All records of ``case`` from mlx-vlm's MTP loop, header ``draft_logits`` included."""
    import zoo
    from oracles.mlx_vlm import run_mtp, version
    from zoo.heads import head_dir

    header, _ = _header({"name": "mlx_vlm_mtp", "package": "mlx-vlm", "version": version()}, case)
    body, info = run_mtp(
        zoo.model_dir(case.target), head_dir(case.drafter), list(header["prompt"]["token_ids"]),
        gamma=case.gamma, max_tokens=case.max_tokens, eos_ids=list(header["eos_ids"]),
        model=_vlm_target(case.target), draft_logits=True,
    )
    header["draft_logits"] = info["draft_logits"]
    return [header, *body]


@cache
def _vlm_split(checkpoint: str) -> Any:
    """mlx-vlm's own splitter on a native checkpoint (a drafter dir ``run_mtp`` reads)."""
    import tempfile

    from oracles.mlx_vlm_native_mtp import split

    return split(checkpoint, tempfile.mkdtemp(prefix="specparity-vlm-split-"))


def produce_mlx_vlm_native_mtp(case: Any) -> list[dict[str, Any]]:
    """All records of a ``native-mtp`` case from mlx-vlm's MTP loop (the §3-aligned pre-norm target
    adapter, as ``produce_mlx_vlm_mtp``) with the drafter its splitter makes of the native
    checkpoint; header ``draft_logits`` included."""
    import zoo
    from oracles.mlx_vlm import run_mtp, version
    from specparity.runners import case_paths

    header, _ = _header({"name": "mlx_vlm_native_mtp", "package": "mlx-vlm", "version": version()}, case)
    split_dir = _vlm_split(str(case_paths(case)[1]))
    body, info = run_mtp(
        zoo.model_dir("qwen35"), split_dir, list(header["prompt"]["token_ids"]),
        gamma=case.gamma, max_tokens=case.max_tokens, eos_ids=list(header["eos_ids"]),
        model=_vlm_target("qwen35"), draft_logits=True,
    )
    header["draft_logits"] = info["draft_logits"]
    return [header, *body]


@cache
def _vlm_native(target: str) -> Any:
    import zoo
    from oracles.mlx_vlm import load_target

    return load_target(zoo.model_dir(target))


def _margins(rows: Any) -> list[float]:
    import mlx.core as mx

    top = mx.topk(rows.astype(mx.float32), 2, axis=-1)
    return [float(m) for m in mx.abs(top[:, 0] - top[:, 1]).tolist()]


def produce_mlx_vlm_assistant(case: Any) -> list[dict[str, Any]]:
    """All records of ``case``: mlx-vlm's assistant drafter at §3 positions in a greedy round loop
    over mlx-vlm's target (module doc), header ``draft_logits`` included."""
    import time

    import mlx.core as mx
    from mlx_vlm.speculative.mtp import _mtp_draft_hidden

    from oracles.drafts import logits_digest
    from oracles.mlx_vlm import assistant_step_logits, version
    from oracles.recording import accept_walk
    from traces.records import counters_from_rounds
    from zoo.heads import head_dir

    header, _ = _header({"name": "mlx_vlm_assistant", "package": "mlx-vlm", "version": version()}, case)
    t0 = time.perf_counter()
    model = _vlm_native(case.target)
    lm = model.language_model
    prompt = list(header["prompt"]["token_ids"])
    eos = set(header["eos_ids"])
    budget = case.max_tokens

    def forward(ids: list[int]) -> Any:
        return lm(mx.array([ids]), cache=lm.make_cache(), return_hidden=True, return_shared_kv=True)

    first_out = forward(prompt)
    first_row = first_out.logits[0, -1:]
    first = int(mx.argmax(first_row[0]))
    end0 = "eos" if first in eos else ("budget" if budget == 1 else None)
    records: list[dict[str, Any]] = [
        {"type": "prefill", "target_tokens": prompt, "drafter_tokens": [],
         "target_cache_digest": None, "drafter_cache_digest": None},
        {"type": "plain", "index": 0, "input": [prompt[-1]], "sample": first, "margin": _margins(first_row)[0],
         "emitted": [] if first in eos else [first], "end": end0, "reason": "initial",
         "target_cache_digest": None, "time_s": None},
    ]
    out = [] if first in eos else [first]
    rounds: list[dict[str, Any]] = []
    logits: list[list[dict[str, Any]]] = []
    feed = [first]
    end = end0
    while end is None:
        ctx = prompt + out[:-1]
        state = forward(ctx)
        hidden = _mtp_draft_hidden(lm, state.hidden_states[-1][:, -1:, :])
        pending = out[-1]
        n = min(case.gamma, budget - len(out))
        steps = assistant_step_logits(head_dir(case.drafter), model, state.shared_kv_states, len(ctx), hidden,
                                      pending, [len(ctx) + k for k in range(n)])
        drafts = [int(mx.argmax(x)) for x in steps]
        window = [pending, *drafts]
        rows = forward(ctx + window).logits[0, -len(window):]
        argmax = [int(t) for t in mx.argmax(rows, axis=-1).tolist()]
        samples, emitted, k, end = accept_walk(drafts, argmax, eos, len(out), budget)
        rounds.append({
            "type": "round", "index": len(rounds), "feed": list(feed), "drafts": drafts, "window": window,
            "samples": samples, "k_accept": k, "emitted": emitted, "end": end, "margins": _margins(rows),
            "confidence": None, "target_cache_digest": None, "drafter_cache_digest": None, "time_s": None,
        })
        logits.append([logits_digest(x) for x in steps])
        out += emitted
        feed = [drafts[-1], samples[-1]] if drafts and k == len(drafts) else [samples[-1]]
        if end in ("bonus", "correction"):
            end = None
    last = records[-1] if not rounds else rounds[-1]
    stopped = last["end"] == "eos"
    records += rounds
    records.append({
        "type": "footer",
        "usage": {"prompt_tokens": len(prompt), "generation_tokens": len(out) + stopped,
                  "finish_reason": "stop" if stopped else "length"},
        "speculation": counters_from_rounds(rounds, n_plain=1), "output_ids": out,
        "wall_s": time.perf_counter() - t0,
    })
    header["draft_logits"] = logits
    return [header, *records]


def produce_optiq_assistant(case: Any) -> list[dict[str, Any]]:
    """All records of ``case`` from optiq's assistant loop, normalized, header ``draft_logits`` included."""
    from oracles.optiq import run_assistant, version
    from traces.normalize import optiq_spec_budget_drafts, optiq_stopping_eos
    from zoo.heads import head_dir

    header, target = _header({"name": "optiq_assistant", "package": "mlx-optiq", "version": version()}, case)
    logits: list[list[dict[str, Any]]] = []
    body = run_assistant(
        target.model, str(head_dir(case.drafter)), list(header["prompt"]["token_ids"]),
        gamma=case.gamma, max_tokens=case.max_tokens, eos_id=header["eos_ids"][0], draft_logits=logits,
    )
    records = optiq_stopping_eos(optiq_spec_budget_drafts([header, *body], case.max_tokens))
    rounds = [r for r in records if r["type"] == "round"]
    if len(rounds) != len(logits):
        raise RuntimeError(f"optiq assistant: {len(logits)} draft blocks for {len(rounds)} rounds")
    # optiq drafts gamma past the budget; the normalization cut the drafts, cut their logits alike
    records[0]["draft_logits"] = [rows[: len(r["drafts"])] for r, rows in zip(rounds, logits, strict=True)]
    records[0]["normalizations"] = list(OPTIQ_NORMALIZATIONS)
    return records
