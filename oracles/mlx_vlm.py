"""Oracle runner for mlx-vlm: the ``qwen3_5_mtp`` drafter, driven unmodified.

Reference: mlx-vlm 0.7.10 ``mlx_vlm/speculative/drafters/__init__.py``
``load_drafter`` and ``drafters/qwen3_5_mtp/qwen3_5_mtp.py``
``Qwen3_5MTPDraftModel`` (``bind``, ``reset``, ``_forward_tokens``,
``_lm_head_fn``). The drafter is bound to a minimal target that carries the zoo
target's own ``embed_tokens`` and ``lm_head`` tensors (``bind`` looks up
exactly those two), so the reference computes its rows with its own decoder
layer, norms and ``fc``.

Entry points (gemma4 assistant ones at the end of the file):

- ``draft_logits``: per-position draft logits on inputs the caller supplies
  (token ids, target hidden rows), for the draft-logit parity check;
- ``run_mtp``: mlx-vlm's own MTP round loop, UNMODIFIED (target from
  ``load_target``: mlx-vlm's native model, or the §3-aligned ``pre-norm``
  adapter, see there): ``generate/ar.py``
  ``generate_step(..., draft_kind="mtp", draft_block_size=γ+1,
  temperature=0.0)`` → ``speculative/utils.py`` ``run_speculative_rounds`` →
  ``speculative/mtp.py`` ``_mtp_rounds`` (greedy path:
  ``_mtp_verify_target`` → ``speculative_argmax_from_hidden`` →
  ``common._speculative_walk`` → ``verify.commit``, the gated-DeltaNet
  rollback). The block size is pinned: ``_mtp_next_block_size`` only adapts
  when the requested block exceeds the head's configured ``block_size``;
  ``run_mtp`` refuses such a request (γ+1 must be <= the head's block size).
  The TARGET is mlx-vlm's own ``models.qwen3_5.Model`` (a 1-layer, 16-wide
  vision tower that text-only prompts never touch) whose ``language_model``
  receives the zoo target's runtime weights as loaded by mlx-lm (same module
  tree, key prefix ``language_model.`` dropped, ``strict=True``; no
  re-sanitizing) and ``mrope_section = [rotary_dim/2, 0, 0]`` (text-only
  positions are identical on all three mRoPE axes, so this is plain RoPE).
  Instrumentation from outside: the module globals ``mtp._mtp_verify_target``
  (window = verify input, margins from ``speculative_logits_from_hidden``)
  and ``mtp._mtp_acceptance_walk`` (accepted count, new tokens; it
  dispatches to ``common._speculative_walk`` or the deferred greedy walk) are wrapped for the duration of one run and
  restored. EOS is the consumer's business in mlx-vlm (``stream_generate``
  stops on it); the runner stops where the engine does (first EOS emitted).

The same ``run_mtp`` drives mlx-vlm's gemma4 ``-assistant`` drafter (kind
``mtp`` in mlx-vlm) on the zoo gemma4 target (``load_target`` maps it into
mlx-vlm's ``gemma4.Model``; see ``_load_gemma4_target``).

Test-only runner: ``specparity run`` / ``specparity.runners.run_case`` does
not dispatch it (mlx-vlm lives in its own tox env, ``tox -e vlm``).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

from oracles import OracleUnavailable

NAME = "mlx_vlm"


def require() -> None:
    try:
        import mlx_vlm.speculative.drafters  # noqa: F401
    except ImportError as exc:
        raise OracleUnavailable("mlx-vlm is not installed") from exc


def version() -> str:
    return metadata.version("mlx-vlm")


def _bound_drafter(head_path: str | Path, embed_weight: Any, lm_head_weight: Any) -> Any:
    import mlx.nn as nn
    from mlx_vlm.speculative.drafters import load_drafter

    draft, kind = load_drafter(str(head_path))
    if kind != "mtp":
        raise RuntimeError(f"mlx-vlm resolved draft kind {kind!r} for {head_path}, expected 'mtp'")

    class _Target(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(*embed_weight.shape)
            self.embed_tokens.weight = embed_weight
            self.lm_head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False)
            self.lm_head.weight = lm_head_weight

    draft.reset(_Target())
    return draft


def draft_logits(
    head_path: str | Path,
    embed_weight: Any,
    lm_head_weight: Any,
    row_tokens: list[int],
    row_hidden: Any,
    chain: int,
) -> tuple[Any, Any]:
    """Reference drafter logits: one forward over the rows ``(row_tokens[i], row_hidden[i])``
    (``[T, H]``), then ``chain`` greedy steps chained on its own output hidden.

    Returns ``(row_logits [T, V], chain_logits [chain, V])``.
    """
    require()
    import mlx.core as mx

    draft = _bound_drafter(head_path, embed_weight, lm_head_weight)
    toks = mx.array([row_tokens], dtype=mx.int32)
    h = draft._forward_tokens(toks, row_hidden[None], mx.int32)
    rows = draft._lm_head_fn(h)[0]
    out = []
    h_prev = h[:, -1:, :]
    for _ in range(chain):
        logits = draft._lm_head_fn(h_prev)
        tok = mx.argmax(logits, axis=-1)
        h_prev = draft._forward_token(tok.astype(mx.int32), h_prev, mx.int32)
        out.append(draft._lm_head_fn(h_prev)[0, 0])
    return rows, (mx.stack(out) if out else mx.zeros((0, rows.shape[-1])))


# ----------------------------------------------------------------- MTP round loop


def load_target(target_dir: str | Path, hidden: str = "native") -> Any:
    """mlx-vlm ``qwen3_5.Model`` carrying the zoo target's weights (see module doc).

    ``hidden="native"``: mlx-vlm's model as is; its ``hidden_states[-1]`` (what the
    MTP loop hands the drafter) is the POST-final-norm output
    (``mlx-vlm-mtp-post-norm-hidden``). ``hidden="pre-norm"``: the §3-aligned
    target adapter: the final norm moves from the trunk into the target's head
    (``language_model.model.norm`` -> identity, ``language_model.lm_head`` ->
    norm then linear), so target logits are unchanged and ``hidden_states[-1]``
    is the PRE-final-norm last-layer output. The drafter still borrows the plain
    linear head (``Model.lm_head``, which ``bind`` looks up first), and
    ``speculative_argmax_from_hidden`` is hidden (``None``) so that neither the
    drafter nor the loop reads a head through it: the loop then verifies through
    ``speculative_verify_logits`` (the same DeltaNet transaction + commit). The
    loop and the drafter code run unmodified.
    """
    require()
    if hidden not in ("native", "pre-norm"):
        raise ValueError(f"hidden must be 'native' or 'pre-norm', not {hidden!r}")
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model
    from mlx_vlm.models.qwen3_5 import Model, ModelConfig

    target_dir = Path(target_dir)
    cfg = json.loads((target_dir / "config.json").read_text())
    if cfg.get("model_type") == "gemma4_text":
        if hidden != "native":
            raise ValueError("the pre-norm adapter is for qwen3_5 targets only")
        return _load_gemma4_target(target_dir, cfg)
    if cfg.get("model_type") != "qwen3_5":
        raise ValueError(f"mlx_vlm MTP runner: target model_type {cfg.get('model_type')!r}, expected 'qwen3_5'")
    rope = dict(cfg.get("rope_parameters") or {})
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    rotary = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
    rope["mrope_section"] = [rotary // 2, 0, 0]
    text = {**cfg, "rope_parameters": rope}
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=cfg["hidden_size"],
                  patch_size=2, spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=4,
                  deepstack_visual_indexes=[])  # fmt: skip
    model = Model(ModelConfig.from_dict(
        dict(model_type="qwen3_5", text_config=text, vision_config=vision,
             vocab_size=cfg["vocab_size"], eos_token_id=cfg.get("eos_token_id"))
    ))  # fmt: skip
    src, _ = load_model(target_dir)
    weights = [(k.removeprefix("language_model."), v) for k, v in tree_flatten(src.parameters())]
    model.language_model.load_weights(weights, strict=True)
    if hidden == "pre-norm":
        import mlx.nn as nn

        class _NormThenHead(nn.Module):
            def __init__(self, norm: Any, head: Any) -> None:
                super().__init__()
                self.norm, self.head = norm, head

            def __call__(self, x: Any) -> Any:
                return self.head(self.norm(x))

        lm = model.language_model
        norm, head = lm.model.norm, lm.lm_head
        lm.model.norm = nn.Identity()
        lm.lm_head = _NormThenHead(norm, head)
        model.lm_head = head
        lm.speculative_argmax_from_hidden = None
        lm.speculative_logits_from_hidden = lambda h: lm.lm_head(h)
    mx.eval(model.parameters())
    model.eval()
    return model


def _load_gemma4_target(target_dir: Path, cfg: dict) -> Any:
    """mlx-vlm ``gemma4.Model`` carrying the zoo gemma4_text target's weights.

    Same module tree as mlx-lm's ``gemma4_text`` (``strict=True``), with two
    mappings: the RoPE parameters are the ones mlx-lm resolved for the target
    (mlx-vlm's defaults for a config without ``rope_parameters`` differ: full
    attention ``partial_rotary_factor`` 1.0 vs mlx-lm's 0.25), and the zoo
    target's UNTIED ``lm_head`` (mlx-vlm's gemma4 ``LanguageModel`` always ties)
    is installed as the instance's ``logits_from_hidden`` (softcap kept), which
    ``__call__`` and ``speculative_logits_from_hidden`` go through. A 1-layer,
    16-wide vision tower that text-only prompts never touch.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model
    from mlx_vlm.models import gemma4
    from mlx_vlm.models.gemma4.language import logit_softcap
    from mlx_vlm.utils import update_module_configs

    src, _ = load_model(target_dir)
    args = getattr(src, "args", None) or src.model.args
    text = {**cfg, "rope_parameters": args.rope_parameters}
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, global_head_dim=8, patch_size=2,
                  position_embedding_size=4, pooling_kernel_size=1, layer_types=["full_attention"])  # fmt: skip
    conf = dict(model_type="gemma4", text_config=text, vision_config=vision, audio_config=None,
                vocab_size=cfg["vocab_size"])  # fmt: skip
    model = gemma4.Model(update_module_configs(gemma4.ModelConfig.from_dict(conf), gemma4, conf, ["text", "vision", "audio"]))
    params = dict(tree_flatten(src.parameters()))
    head = src.lm_head if "lm_head.weight" in params else None
    model.language_model.load_weights([(k, v) for k, v in params.items() if k != "lm_head.weight"], strict=True)
    lm = model.language_model
    if head is not None:
        cap = lm.final_logit_softcapping

        def logits_from_hidden(h: Any) -> Any:
            out = head(h)
            return logit_softcap(cap, out) if cap is not None else out

        lm.logits_from_hidden = logits_from_hidden
    mx.eval(model.parameters())
    model.eval()
    return model


def run_mtp(
    target_dir: str | Path,
    head_path: str | Path,
    prompt_ids: list[int],
    *,
    gamma: int,
    max_tokens: int,
    eos_ids: list[int],
    model: Any = None,
    prefill_step_size: int | None = None,
    draft_logits: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """mlx-vlm's MTP loop (greedy) on one case: (records after the header, info).

    ``draft_logits=True`` also records the drafter's logits of every drafted
    token (``info["draft_logits"]``: per round record, one
    ``oracles.drafts.logits_digest`` per draft), read by wrapping, on the
    drafter instance, the ``_lm_head_fn`` that ``bind`` installs (each greedy
    draft is ``argmax(_lm_head_fn(h))`` when the target has no
    ``speculative_argmax_from_hidden``: the ``pre-norm`` adapter) and
    ``draft_block`` (which groups them: a round's first draft is the seed
    computed after the previous verify, or after the prefill).

    ``prefill_step_size=None`` (the default here) is ``generate_step``'s unchunked
    prefill: the drafter receives every prompt row (``prefill_from_target_hidden``
    over the full prompt), §3's ``prefill_mode = "full"``. mlx-vlm's own default
    (chunked, 2048) hands the drafter only the last prompt row at drafter
    position 0 (documented behaviour ``mlx-vlm-mtp-chunked-prefill-drafter-rows``).
    """
    require()
    import json
    import time

    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative import mtp as vmtp
    from mlx_vlm.speculative.drafters import load_drafter

    configured = int(json.loads((Path(head_path) / "config.json").read_text()).get("block_size", 1))
    if gamma + 1 > configured:
        raise ValueError(
            f"mlx_vlm MTP: gamma+1={gamma + 1} exceeds the head's block_size {configured}; "
            "mlx-vlm would adapt the block size (_effective_mtp_block_size), so the round shape is not pinned"
        )
    model = model if model is not None else load_target(target_dir)
    draft, kind = load_drafter(str(head_path))
    if kind != "mtp":
        raise RuntimeError(f"mlx-vlm resolved draft kind {kind!r} for {head_path}, expected 'mtp'")
    prefill_rows = hasattr(draft, "prefill_from_target_hidden")  # qwen3_5_mtp: own KV rows; assistant: none
    rounds_logits: list[list[Any]] = []
    if draft_logits:
        _record_draft_logits(draft, rounds_logits)

    log: list[tuple] = []
    orig_verify, orig_walk = vmtp._mtp_verify_target, vmtp._mtp_acceptance_walk

    def verify(lm: Any, verify_input: Any, *a: Any, **k: Any) -> Any:
        res = orig_verify(lm, verify_input, *a, **k)
        top = mx.topk(lm.speculative_logits_from_hidden(res.hidden)[0].astype(mx.float32), 2, axis=-1)
        margins = [float(m) for m in mx.abs(top[:, 0] - top[:, 1]).tolist()]
        log.append(("verify", [int(t) for t in verify_input[0].tolist()], margins))
        return res

    def walk(*a: Any, **k: Any) -> Any:
        accepted, new = orig_walk(*a, **k)
        log.append(("walk", int(accepted), [int(t) for t in new], None))
        return accepted, new

    eos = set(int(e) for e in eos_ids)
    produced: list[int] = []
    first_margin = None
    t0 = time.perf_counter()
    vmtp._mtp_verify_target, vmtp._mtp_acceptance_walk = verify, walk
    try:
        gen = generate_step(
            mx.array([prompt_ids], dtype=mx.int32), model, None, None, max_tokens=max_tokens,
            temperature=0.0, draft_model=draft, draft_kind="mtp", draft_block_size=gamma + 1,
            prefill_step_size=prefill_step_size,
        )  # fmt: skip
        for tok, logprobs in gen:
            tok = int(tok)
            if first_margin is None:
                top = mx.topk(logprobs.reshape(-1).astype(mx.float32), 2)
                first_margin = float(mx.abs(top[0] - top[1]))
            produced.append(tok)
            if tok in eos or len(produced) >= max_tokens:
                break
        gen.close()
    finally:
        vmtp._mtp_verify_target, vmtp._mtp_acceptance_walk = orig_verify, orig_walk
    wall = time.perf_counter() - t0
    records = _rebuild_mtp(log, prompt_ids, produced, first_margin, eos, wall, prefill_step_size is None, prefill_rows)
    info: dict[str, Any] = {"accept_lens": list(getattr(draft, "accept_lens", []) or []), "block_size": gamma + 1}
    if draft_logits:
        from oracles.drafts import logits_digest

        rounds = [r for r in records if r["type"] == "round"]
        per_round = []
        for r, rows in zip(rounds, rounds_logits, strict=False):
            if len(rows) != len(r["drafts"]):
                raise RuntimeError(f"mlx_vlm MTP round {r['index']}: {len(rows)} draft logits recorded "
                                   f"for {len(r['drafts'])} drafts")
            per_round.append([logits_digest(x) for x in rows])
        if len(per_round) != len(rounds):
            raise RuntimeError(f"mlx_vlm MTP: {len(rounds_logits)} draft blocks for {len(rounds)} rounds")
        info["draft_logits"] = per_round
    return records, info


def _record_draft_logits(draft: Any, rounds: list[list[Any]]) -> None:
    """Wrap (on the instance) ``bind`` — to wrap the ``_lm_head_fn`` it installs — and
    ``draft_block``; every block appends the logits of its drafts to ``rounds``."""
    import mlx.core as mx

    state: dict[str, Any] = {"seed": None, "block": None}
    bind, block = draft.bind, draft.draft_block

    def head_fn_of(fn: Any) -> Any:
        def recorded(h: Any) -> Any:
            out = fn(h)
            row = mx.array(out.reshape(-1, out.shape[-1])[-1])
            if state["block"] is None:
                state["seed"] = row  # prefill / accept: the next block's first draft
            else:
                state["block"].append(row)
            return out

        return recorded

    def recording_bind(target: Any) -> Any:
        out = bind(target)
        draft._lm_head_fn = head_fn_of(draft._lm_head_fn)
        if getattr(draft, "_greedy_argmax_fn", None) is not None:
            raise RuntimeError("mlx_vlm MTP draft logits: the target has speculative_argmax_from_hidden "
                               "(greedy drafts skip the logits); record with the pre-norm adapter")
        return out

    def recording_block(*a: Any, **k: Any) -> Any:
        seeded = getattr(draft, "_seed_token", None) is not None
        state["block"] = [state["seed"]] if seeded else []
        try:
            out = block(*a, **k)
        finally:
            rows, state["block"] = state["block"], None
        rounds.append(rows)
        return out

    draft.bind = recording_bind
    draft.draft_block = recording_block


def _rebuild_mtp(
    log: list[tuple], prompt_ids: list[int], produced: list[int], first_margin: float | None, eos: set[int],
    wall: float, full_prefill: bool = True, drafter_rows: bool = True,
) -> list[dict[str, Any]]:
    from traces.records import counters_from_rounds

    stop = "eos" if produced and produced[-1] in eos else "budget"
    # the drafter rows the prefill leaves in its cache: (token_{p+1}, hidden_p) for p < L-1
    # (the last prompt row needs the first sampled token; it is written with the first draft)
    drafter_tokens: list[int] | None = (list(prompt_ids[1:]) if full_prefill else []) if drafter_rows else []
    records: list[dict[str, Any]] = [
        {"type": "prefill", "target_tokens": list(prompt_ids), "drafter_tokens": drafter_tokens,
         "target_cache_digest": None, "drafter_cache_digest": None},
        {"type": "plain", "index": 0, "input": [prompt_ids[-1]], "sample": produced[0], "margin": first_margin,
         "emitted": [produced[0]], "end": stop if len(produced) == 1 else None, "reason": "initial",
         "target_cache_digest": None, "time_s": None},
    ]  # fmt: skip
    pairs = []
    pending = None
    for e in log:
        if e[0] == "verify":
            pending = e
        else:
            if pending is None:
                raise RuntimeError("mlx_vlm MTP: walk without a verify")
            pairs.append((pending, e))
            pending = None
    rounds: list[dict[str, Any]] = []
    pos = 1
    for i, ((_, window, margins), (_, k, new, _targets)) in enumerate(pairs):
        if pos >= len(produced):
            break  # a round whose tokens the consumer never took
        if window[0] != produced[pos - 1]:
            raise RuntimeError(f"mlx_vlm MTP round {i}: window head {window[0]} != last token {produced[pos - 1]}")
        drafts = window[1:]
        emitted = list(new)
        cut = [j for j, t in enumerate(emitted) if t in eos]
        if cut:
            emitted = emitted[: cut[0] + 1]
        emitted = emitted[: len(produced) - pos]
        if produced[pos : pos + len(emitted)] != emitted:
            raise RuntimeError(f"mlx_vlm MTP round {i}: walk tokens {emitted} != yielded {produced[pos:pos + len(emitted)]}")
        pos += len(emitted)
        k_eff = min(k, len(emitted))
        if pos >= len(produced):
            end = stop
        else:
            end = "correction" if k < len(drafts) else "bonus"
        if rounds and rounds[-1]["drafts"] and rounds[-1]["k_accept"] == len(rounds[-1]["drafts"]):
            feed = [rounds[-1]["drafts"][-1], window[0]]
        else:
            feed = [window[0]]
        rounds.append({
            "type": "round", "index": len(rounds), "feed": feed, "drafts": drafts, "window": window,
            "samples": list(emitted), "k_accept": k_eff, "emitted": emitted, "end": end,
            "margins": margins, "confidence": None, "target_cache_digest": None,
            "drafter_cache_digest": None, "time_s": None,
        })  # fmt: skip
    if pos != len(produced):
        raise RuntimeError(f"mlx_vlm MTP: rebuilt {pos} tokens of {len(produced)} yielded")
    records.extend(rounds)
    usage = {"prompt_tokens": len(prompt_ids), "generation_tokens": len(produced),
             "finish_reason": "stop" if stop == "eos" else "length"}
    records.append({"type": "footer", "usage": usage, "speculation": counters_from_rounds(rounds, n_plain=1),
                    "output_ids": list(produced), "wall_s": wall})  # fmt: skip
    return records


# ----------------------------------------------------------------- gemma4 assistant drafter
# mlx-vlm 0.7.10 ``speculative/drafters/gemma4_assistant/gemma4_assistant.py``
# ``Gemma4AssistantDraftModel`` (its own gemma4 ``DecoderLayer``s with
# ``kv_shared_only=True``, ``make_drafter_masks``, ``pre_/post_projection``,
# masked-embedding centroid head). mlx-vlm drives it from the same
# ``_mtp_rounds`` loop, which calls ``set_shared_kv(kv, kv_offset,
# position=_mtp_draft_position(kv_offset) = kv_offset - 1)``; ``draft_block``
# then holds that position for EVERY draft step (HF
# ``SinglePositionMultiTokenCandidateGenerator``), where optiq (§3's L2 oracle
# for this row) and the engine query step k at ``kv_offset + k``
# (documented behaviour ``mlx-vlm-assistant-fixed-draft-position``). The
# drafter borrows only the target's ``embed_tokens`` / ``embed_scale`` (``bind``)
# and the K/V the caller passes; any target object with those works.


def assistant_draft_block(
    head_path: str | Path, target: Any, kv: dict, kv_offset: int, hidden: Any, token: int, block_size: int
) -> tuple[list[int], list[int]]:
    """mlx-vlm's unmodified ``draft_block`` (greedy) with the loop's own position rule.

    Returns ``(drafts, positions)``: the ``block_size - 1`` greedy drafts and the
    query position of every drafter forward (recorded by wrapping the instance's
    ``_forward_hidden`` from outside).
    """
    require()
    import mlx.core as mx
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.speculative.mtp import _mtp_draft_position

    draft, kind = load_drafter(str(head_path))
    if kind != "mtp" or not hasattr(draft, "masked_embedding"):
        raise RuntimeError(f"mlx-vlm resolved {type(draft).__name__}/{kind} for {head_path}, expected a gemma4 assistant")
    draft.reset(target)
    positions: list[int] = []
    inner = draft._forward_hidden

    def forward_hidden(inputs_embeds: Any, shared_kv: Any, position_ids: Any, cache: Any = None) -> Any:
        positions.append(int(position_ids.reshape(-1)[0]))
        return inner(inputs_embeds, shared_kv, position_ids, cache=cache)

    draft._forward_hidden = forward_hidden
    draft.set_shared_kv(kv, kv_offset, position=_mtp_draft_position(kv_offset), kv_valid_len=kv_offset)
    toks = draft.draft_block(token, hidden, None, block_size, lambda lg: mx.argmax(lg, axis=-1), greedy=True)
    return [int(t) for t in toks.reshape(-1).tolist()], positions


def assistant_step_logits(
    head_path: str | Path, target: Any, kv: dict, kv_offset: int, hidden: Any, token: int, positions: list[int]
) -> list[Any]:
    """mlx-vlm's drafter forward (``__call__``: its own layers, masks and head) chained greedily,
    step ``i`` querying at ``positions[i]``; the ``[V]`` logits of every step."""
    require()
    import mlx.core as mx
    from mlx_vlm.speculative.drafters import load_drafter

    draft, _ = load_drafter(str(head_path))
    draft.reset(target)
    draft.set_shared_kv(kv, kv_offset, position=kv_offset - 1, kv_valid_len=kv_offset)
    out = []
    h, tok = hidden, token
    for pos in positions:
        emb = draft._input_embed(mx.array([[tok]])) * draft._input_embed_scale
        h, logits = draft(mx.concatenate([emb, h], axis=-1), kv, mx.array([[pos]]))
        logits = logits.reshape(-1)
        out.append(logits)
        tok = int(mx.argmax(logits))
    return out
