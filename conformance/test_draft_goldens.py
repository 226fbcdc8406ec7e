"""The engine's drafters against the references' drafters, draft by draft, in the default run.

A draft row built from the wrong hidden position stays lossless after
verification (plain-greedy identity cannot see it) and often keeps the argmax
draft too, so the round-level goldens cannot see it either. The draft goldens
(``specparity/runners/draft_goldens.py``: mlx-vlm 0.7.10's ``qwen3_5_mtp`` drafter in
its MTP loop, mlx-vlm's gemma4 assistant drafter at §3's positions, mlx-optiq
0.7.7's ``GemmaAssistantDrafter`` in ``spec_generate``)
carry the digest of every draft's logits (``oracles/drafts.py``); here the
live engine's ``mtp`` / ``assistant`` sources run every golden case with their
drafter logits recorded (the source's ``lm_head`` / drafter call wrapped for
the duration of ``draft()``), and each round's drafts and each draft's
logits must match (MTP: top tokens' log-probs and a probability sketch
within 1e-4, the engine's head and mlx-vlm's own decoder layer differing by
<= 3.3e-5; assistant vs optiq: bit-identical float32 logits, as the engine
mirrors optiq op for op; vs mlx-vlm's assistant layers: within 1e-5), the
first difference named by round and draft. No mlx-vlm or optiq is needed: the goldens are read.
Stale goldens (``conformance/test_goldens.py`` names why) are skipped.

Planted bugs, each caught with the round named: the MTP all-accept row built
from the bonus position's hidden (one late), the MTP prefill rows built one
position late, and the assistant drafter querying every step at
``offset - 1`` (mlx-vlm's fixed-position rule).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from oracles.drafts import logits_digest
from specparity.goldens.manifest import (
    GOLDEN_DIR,
    check_goldens,
    golden_key,
    golden_path,
)
from specparity.runners.registry import golden_sets
from traces.io import Trace, read_trace

DRAFT_RUNNERS = ("mlx_vlm_mtp", "mlx_vlm_native_mtp", "mlx_vlm_assistant", "optiq_assistant")
CASES = [(r, c) for r in DRAFT_RUNNERS for c in golden_sets()[r].cases()]

# Draft-logit comparison bounds (|Δ log-prob| of the top tokens, and of the probability
# sketch). MTP: the engine's head (mlx-lm's qwen3_5 DecoderLayer) vs mlx-vlm's own layer
# differ by <= 3.3e-5 over the 376 golden draft steps: 1e-4. Assistant: the engine mirrors
# optiq op for op, bit-identical on all 184 golden draft steps: 0 (sha256 equality); mlx-vlm's
# own assistant layers at the same positions differ by <= 1e-6: 1e-5.
# native-mtp vs mlx-vlm on qwen35-native: worst 6e-6 on round-0 rows (test_native_mtp_vlm.py): 1e-4.
BOUNDS = {"mlx_vlm_mtp": 1e-4, "mlx_vlm_native_mtp": 1e-4, "mlx_vlm_assistant": 1e-5,
          "optiq_assistant": 0.0}


def digest_mismatch(live: dict[str, Any], ref: dict[str, Any], atol: float) -> str | None:
    """Why two digests differ beyond ``atol`` (top ids, their log-probs, the sketch), or None.

    ``atol == 0`` asks for bit-identical logits (equal ``sha256``)."""
    if live["sha256"] == ref["sha256"]:
        return None
    if atol <= 0:
        lp_r = dict((t, v) for t, v in ref["top"])
        d = max((abs(v - lp_r[t]) for t, v in live["top"] if t in lp_r), default=float("nan"))
        return (f"float32 logits not bit-identical (sha256 {live['sha256'][:12]}… vs {ref['sha256'][:12]}…; "
                f"top {[t for t, _ in live['top'][:3]]} vs {[t for t, _ in ref['top'][:3]]}, "
                f"max |Δ log-prob| of shared top tokens {d:.3g})")
    ids_l = [t for t, _ in live["top"]]
    ids_r = [t for t, _ in ref["top"]]
    # the head of the ranking must agree; the tail may swap near-ties
    lp_r = dict((t, v) for t, v in ref["top"])
    for j, (t, v) in enumerate(live["top"]):
        if j == 0 and t != ids_r[0]:
            return f"top token {t} vs {ids_r[0]}"
        if t in lp_r and abs(v - lp_r[t]) > atol:
            return f"log-prob of token {t}: {v:.6f} vs {lp_r[t]:.6f} (> {atol:g})"
    common = set(ids_l) & set(ids_r)
    if len(common) < len(ids_r) - 2:
        return f"top-{len(ids_r)} tokens {ids_l} vs {ids_r}"
    worst = max(abs(a - b) for a, b in zip(live["sketch"], ref["sketch"], strict=True))
    if worst > atol:
        return f"probability sketch differs by {worst:.3g} (> {atol:g})"
    return None


@pytest.fixture(scope="module")
def fresh() -> set[str]:
    bad = {p.key for p in check_goldens(runners=DRAFT_RUNNERS)}
    return {golden_key(r, c) for r, c in CASES} - bad


@contextmanager
def recording_drafts() -> Iterator[list[list[dict[str, Any]]]]:
    """Record, per ``draft()`` call of the ``mtp`` / ``assistant`` sources (one per round), the
    digest of every draft's logits."""
    from engine.sources.assistant import AssistantSource
    from engine.sources.mtp import MTPSource
    from engine.sources.native_mtp import NativeMTPSource

    rounds: list[list[dict[str, Any]]] = []
    mtp_draft, asst_draft = MTPSource.draft, AssistantSource.draft
    native_draft = NativeMTPSource.draft

    def head_wrapped(real: Any) -> Any:
        def draft(self: Any, feed: list[int], n: int, step_base: int, anchor: Any) -> list[int]:
            head, rows = self.lm_head, []

            def recorded(h: Any) -> Any:
                out = head(h)
                rows.append(logits_digest(out))
                return out

            self.lm_head = recorded
            try:
                return real(self, feed, n, step_base, anchor)
            finally:
                self.lm_head = head
                rounds.append(rows)
        return draft

    mtp = head_wrapped(mtp_draft)

    def assistant(self: Any, feed: list[int], n: int, step_base: int, anchor: Any) -> list[int]:
        drafter, rows = self.drafter, []

        def recorded(*a: Any) -> Any:
            logits, h = drafter(*a)
            rows.append(logits_digest(logits))
            return logits, h

        self.drafter = recorded
        try:
            return asst_draft(self, feed, n, step_base, anchor)
        finally:
            self.drafter = drafter
            rounds.append(rows)

    MTPSource.draft, AssistantSource.draft = mtp, assistant  # type: ignore[method-assign]
    NativeMTPSource.draft = head_wrapped(native_draft)  # type: ignore[method-assign]
    try:
        yield rounds
    finally:
        MTPSource.draft, AssistantSource.draft = mtp_draft, asst_draft  # type: ignore[method-assign]
        NativeMTPSource.draft = native_draft  # type: ignore[method-assign]


def engine_drafts(case: Any) -> tuple[Trace, list[list[dict[str, Any]]]]:
    from specparity.runners import run_case

    with recording_drafts() as rounds:
        trace = Trace.from_records(run_case("engine", case))
    return trace, rounds


def first_draft_divergence(live: Trace, logits: list[list[dict[str, Any]]], golden: Trace,
                           atol: float) -> str | None:
    """The first round whose drafts, or whose draft logits, differ (None: all agree)."""
    want = golden.header.get("draft_logits")
    if want is None:
        return "the golden has no header draft_logits"
    lr = [r for r in live.events if r["type"] == "round"]
    gr = [r for r in golden.events if r["type"] == "round"]
    if len(want) != len(gr) or len(logits) != len(lr):
        return f"draft logits of {len(want)}/{len(logits)} rounds for {len(gr)}/{len(lr)} round records"
    for i, (a, b) in enumerate(zip(lr, gr, strict=False)):
        if a["drafts"] != b["drafts"]:
            return f"round {i}: drafts {a['drafts']} (engine) vs {b['drafts']} (reference)"
        for j, (x, y) in enumerate(zip(logits[i], want[i], strict=True)):
            why = digest_mismatch(x, y, atol)
            if why is not None:
                return f"round {i}, draft {j} (token {a['drafts'][j]}): draft logits differ: {why}"
    if len(lr) != len(gr):
        return f"{len(lr)} rounds (engine) vs {len(gr)} (reference) after round {min(len(lr), len(gr)) - 1}"
    return None


@pytest.mark.golden
@pytest.mark.parametrize(("runner", "case"), CASES, ids=[f"{r}:{c.case_id}" for r, c in CASES])
def test_engine_drafts_match_draft_golden(runner: str, case: Any, fresh: set[str]) -> None:
    key = golden_key(runner, case)
    if key not in fresh:
        pytest.skip(f"{key} is stale/corrupt/missing (test_goldens_are_fresh names why)")
    golden = read_trace(golden_path(GOLDEN_DIR, key))
    if case not in _LIVE:  # the two assistant references share their cases: one engine run each
        _LIVE[case] = engine_drafts(case)
    live, logits = _LIVE[case]
    why = first_draft_divergence(live, logits, golden, BOUNDS[runner])
    assert why is None, f"{case.case_id}: engine vs {runner} draft golden: {why}"


_LIVE: dict[Any, tuple[Trace, list[list[dict[str, Any]]]]] = {}


def test_draft_goldens_are_not_vacuous(fresh: set[str]) -> None:
    """Every draft golden runner has fresh goldens with drafted rounds and partial/zero accepts."""
    for runner in DRAFT_RUNNERS:
        keys = [golden_key(runner, c) for r, c in CASES if r == runner and golden_key(r, c) in fresh]
        if not keys:
            pytest.skip(f"no fresh {runner} draft goldens (test_goldens_are_fresh names why)")
        steps = rejects = 0
        for key in keys:
            g = read_trace(golden_path(GOLDEN_DIR, key))
            steps += sum(len(x) for x in g.header["draft_logits"])
            rejects += sum(1 for r in g.rounds if r["k_accept"] < len(r["drafts"]))
        assert steps > 0 and rejects > 0, (runner, steps, rejects)


# ----------------------------------------------------------------- planted bugs


def _caught(runner: str, fresh: set[str], heads: tuple[str, ...] | None = None) -> list[str]:
    """``first_draft_divergence`` messages on the fresh goldens of ``runner`` (optionally some heads)."""
    found = []
    for r, case in CASES:
        if r != runner or (heads is not None and case.drafter not in heads):
            continue
        key = golden_key(r, case)
        if key not in fresh:
            continue
        live, logits = engine_drafts(case)
        why = first_draft_divergence(live, logits, read_trace(golden_path(GOLDEN_DIR, key)), BOUNDS[r])
        if why is not None:
            found.append(f"{case.case_id}: {why}")
    return found


def _require_fresh(runner: str, fresh: set[str]) -> None:
    if not any(golden_key(r, c) in fresh for r, c in CASES if r == runner):
        pytest.skip(f"no fresh {runner} draft goldens")


def test_planted_mtp_all_accept_row_from_wrong_hidden_is_caught(fresh: set[str], monkeypatch) -> None:  # noqa: ANN001
    """The all-accept row ``(embed(last draft), hidden)`` built from the bonus position's verify hidden
    (``d``) instead of the last draft's (``d - 1``): lossless, so only the draft logits see it."""
    _require_fresh("mlx_vlm_mtp", fresh)
    from engine.sources import mtp

    real = mtp.MTPSource.commit

    def off_by_one(self, d, k, ctx=None, verified_hidden=None, accepted_tokens=None):  # noqa: ANN001, ANN202
        real(self, d, k, ctx, verified_hidden, accepted_tokens)
        if d and k == d:
            self._owed_hidden = [ctx.hidden[self.n_layers - 1][d : d + 1]]

    monkeypatch.setattr(mtp.MTPSource, "commit", off_by_one)
    found = _caught("mlx_vlm_mtp", fresh, ("qwen35-mtp-self",))
    assert found, "an MTP draft row from the wrong hidden position passed every draft golden"
    assert all("round " in f for f in found), found
    print("\n" + "\n".join(found))


def test_planted_mtp_prefill_rows_one_late_are_caught(fresh: set[str], monkeypatch) -> None:  # noqa: ANN001
    """Prefill rows paired with ``hidden_{p+1}`` instead of ``hidden_p`` (predict-2-ahead broken)."""
    _require_fresh("mlx_vlm_mtp", fresh)
    from engine.sources import mtp

    real = mtp.MTPSource.prefill

    def late(self, prompt_ids, ctx):  # noqa: ANN001, ANN202
        out = real(self, prompt_ids, ctx)
        if ctx is not None and prompt_ids:
            self._owed_hidden = [ctx.hidden[self.n_layers - 1][1 : len(prompt_ids)]]
        return out

    monkeypatch.setattr(mtp.MTPSource, "prefill", late)
    found = _caught("mlx_vlm_mtp", fresh, ("qwen35-mtp",))
    assert found and all("round " in f for f in found), found


@pytest.mark.parametrize("runner", ["optiq_assistant", "mlx_vlm_assistant"])
def test_planted_assistant_fixed_draft_position_is_caught(runner: str, fresh: set[str], monkeypatch) -> None:  # noqa: ANN001
    """Every draft step queried at ``offset - 1`` (mlx-vlm's loop rule) instead of ``offset + k``."""
    _require_fresh(runner, fresh)
    from engine.sources import assistant

    real = assistant.AssistantDrafter.__call__

    def fixed(self, token_emb, hidden, kv, position):  # noqa: ANN001, ANN202
        base = int(kv["full_attention"][0].shape[-2])
        return real(self, token_emb, hidden, kv, base - 1)

    monkeypatch.setattr(assistant.AssistantDrafter, "__call__", fixed)
    found = _caught(runner, fresh, ("gemma4-assistant-self",))
    assert found and all("round " in f for f in found), found


def test_head_weights_are_a_draft_golden_input(monkeypatch) -> None:  # noqa: ANN001
    """A rebuilt zoo head (other weights) marks its draft goldens stale, naming the drafter."""
    from specparity.goldens import manifest as goldens

    runner, case = CASES[0]
    key = golden_key(runner, case)
    real = goldens._head_identity(case.drafter)
    assert real["weights_sha256"], real
    monkeypatch.setattr(goldens, "_head_identity", lambda name: {**real, "weights_sha256": "0" * 64})
    stale = {p.key: p for p in check_goldens(runners=[runner], keys=[key])}
    assert key in stale and any(f"drafter {case.drafter} weights changed" in r for r in stale[key].reasons), stale
