"""DSpark drafters against mlx-vlm 0.7.10, the second reference (``tox -e vlm-dspark``).

- our ``dspark`` source vs mlx-vlm's generic ``DSparkDraftModel`` in its own
  round loop (``generate_step`` → ``_dflash_rounds``), round for round at
  threshold 0 (mlx-vlm applies no confidence pruning);
- our ``deepspec`` port vs mlx-vlm's ``Gemma4DSparkDraftModel`` (its port of
  DeepSpec's module) on a non-K≡V DeepSpec checkpoint: rounds identical, and
  the draft logits show the one arithmetic difference — mlx-vlm omits
  DeepSpec's ``v_norm`` (the port with ``apply_v_norm=False`` matches it to the
  last bit; the DeepSpec-faithful port does not);
- mlx-vlm's ``gemma4_dspark`` cannot run a K≡V checkpoint (the released
  configuration): it raises on the missing ``v_proj``;
- a planted bug (a context row committed for a rejected draft) is caught.

Skipped with the install hint where mlx-vlm is absent (the default venv).
"""

from __future__ import annotations

from typing import Any

import pytest

import zoo
from conformance.conftest import require_oracle, run_trace
from specparity.cases.case import Case
from tests.helpers import load_zoo
from traces.diff import diff_traces
from traces.io import Trace

PROMPTS = ("nat-03", "nat-09", "nat-22", "rnd-14", "rnd-15")
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def vlm() -> Any:
    from oracles import mlx_vlm_dspark

    require_oracle("mlx_vlm_dspark")
    return mlx_vlm_dspark


@pytest.fixture(scope="module")
def target() -> Any:
    return load_zoo("gemma4")


def _reference(vlm: Any, target: Any, header: dict, art: str, pid: str) -> Trace:
    from zoo.dspark import artifact_dir

    recs = vlm.run(target.model, artifact_dir(art), list(zoo.prompt(pid).token_ids), max_tokens=MAX_TOKENS,
                   eos_ids=list(target.eos_ids))
    return Trace.from_records([header, *recs])


pytestmark = pytest.mark.oracle


@pytest.mark.parametrize("pid", PROMPTS)
def test_dspark_source_matches_mlx_vlm_rounds(vlm: Any, target: Any, pid: str) -> None:
    live = run_trace("engine", Case("gemma4", "dspark-t0", pid, 4, MAX_TOKENS, source="dspark"))
    ref = _reference(vlm, target, live.header, "gemma4-dspark", pid)
    div = diff_traces(live, ref)
    assert div is None, f"gemma4/dspark-t0/{pid}: engine vs mlx-vlm\n{div.message}"
    assert ref.footer["speculation"]["accepted"] > 0


@pytest.mark.parametrize("pid", PROMPTS)
def test_deepspec_port_matches_mlx_vlm_rounds(vlm: Any, target: Any, pid: str) -> None:
    live = run_trace("engine", Case("gemma4", "deepspec-kv-t0", pid, 4, MAX_TOKENS, source="deepspec"))
    ref = _reference(vlm, target, live.header, "gemma4-deepspec-kv", pid)
    div = diff_traces(live, ref)
    assert div is None, f"gemma4/deepspec-kv-t0/{pid}: engine vs mlx-vlm\n{div.message}"


def test_mlx_vlm_gemma4_dspark_omits_deepspecs_v_norm(vlm: Any, target: Any) -> None:
    import mlx.core as mx

    from engine.dspark import deepspec_module as dsm
    from engine.taps import capture_layers
    from zoo.dspark import artifact_dir

    art = artifact_dir("gemma4-deepspec-kv")
    worst = {}
    for pid in PROMPTS:
        ids = list(zoo.prompt(pid).token_ids)
        with capture_layers(target.model, [0]) as cap:
            target.model(mx.array(ids)[None])
            feats = cap[0][0]
        ref = vlm.draft_logits(target.model, art, feats, ids[-1])
        for v_norm in (True, False):
            m = dsm.load(art)
            m.apply_v_norm = v_norm
            hid, _ = m.backbone(dsm.ContextCache(m.cfg.num_hidden_layers), m.project_context(feats),
                                [ids[-1]] + [m.cfg.mask_token_id] * (m.cfg.block_size - 1))
            err = float(mx.abs(m.logits(hid) - ref).max())
            worst[v_norm] = max(worst.get(v_norm, 0.0), err)
    assert worst[False] <= 1e-5, f"mlx-vlm vs the port without v_norm: {worst}"
    assert worst[True] > 1e-2, f"the DeepSpec-faithful port (v_norm) should differ from mlx-vlm: {worst}"


def test_mlx_vlm_gemma4_dspark_cannot_run_k_eq_v_checkpoints(vlm: Any, target: Any) -> None:
    """Known reference refusal ``mlx-vlm-gemma4-dspark-k-eq-v`` (traces/known_divergences.toml)."""
    from traces.reference import known_entries

    entry = next(e for e in known_entries() if e.id == "mlx-vlm-gemma4-dspark-k-eq-v")
    with pytest.raises(AttributeError, match=entry.message or "v_proj"):
        _reference(vlm, target, {"type": "header"}, "gemma4-deepspec-l0", "nat-03")


def test_planted_context_row_for_a_rejected_draft_is_caught(vlm: Any, target: Any) -> None:
    from engine.executor import GenerationParams, spec_generate
    from engine.sources.dspark import DSparkProvider, DSparkSource
    from zoo.dspark import artifact_dir

    class Leaky(DSparkSource):
        def commit(self, d, k_accept, ctx=None, verified_hidden=None, accepted_tokens=None):  # noqa: ANN001
            super().commit(d, min(k_accept + 1, d), ctx)

    class LeakyProvider(DSparkProvider):
        def open(self, sampler, target_view):  # noqa: ANN001
            return Leaky(self.model, target_view, self.confidence_threshold)

    caught = 0
    for pid in PROMPTS:
        ids = list(zoo.prompt(pid).token_ids)
        live = run_trace("engine", Case("gemma4", "dspark-t0", pid, 4, MAX_TOKENS, source="dspark"))
        res = spec_generate(target.model, LeakyProvider(artifact_dir("gemma4-dspark"), confidence_threshold=0.0),
                            ids, GenerationParams(max_tokens=MAX_TOKENS, gamma=4, prefill="full",
                                                  eos_ids=tuple(target.eos_ids)))
        bad = Trace.from_records([live.header, *res.records, res.footer()])
        ref = _reference(vlm, target, live.header, "gemma4-dspark", pid)
        caught += diff_traces(bad, ref) is not None
    assert caught, "a context row committed for a rejected draft went unnoticed against mlx-vlm"
