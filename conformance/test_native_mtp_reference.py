"""Draft-logit agreement of the ``native-mtp`` source with an independent formulation.

mlx-vlm 0.7.10 implements no drafter for the zoo's GLM (mlx-lm ``glm4_moe``) and
DeepSeek (``deepseek_v3``) trunks (its GLM drafters run GLM-5's DSA attention, its
DeepSeek drafter DeepSeek-V4's hyper-connections; ``oracles/native_mtp_ref.py``),
so the reference is the second, straightforward formulation there: every draft row
recomputed from scratch, one row at a time, from the raw checkpoint tensors and the
conventions recorded in the trace header. Bound: |Δ log-prob| <= ``BOUND`` (float32
on both sides; measured worst 0 on glm-mtp, 7.6e-6 on deepseek-mtp). Every round is compared under
``trim = rebuild``; under ``keep-chain`` round 0 only (the reference does not model
which drafter-built rows an earlier round kept).

Planted convention bugs (the engine source reading another value than the one it
declares and records) are each caught with the first differing draft row named
by round and position: pre/post-norm swapped, concat order swapped, position off
by one (every row: RoPE attention sees relative positions only, so a uniform shift
shows through the position-0 mask alone) and chain rows one position late,
position-0 mask missing, one head reused where the checkpoint chains two.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.executor import GenerationParams, spec_generate

BOUND = 1e-4
CONVS = {
    "family": None,
    "rebuild": "trim=rebuild",
    "rebuild-flipped": "trim=rebuild,hidden=pre-norm,concat=h;e,position_base=1,mask_pos0=false,"
                       "chain_hidden=post-norm",
}


# Every convention varied with every other: an L8 orthogonal array over the seven two-valued
# conventions (each pair of conventions takes all four value pairs in some row), so a bug in
# one convention that only shows together with another (the position-0 mask must read
# position_base) cannot hide behind one-at-a-time variation.
_L8 = ("0000000", "0001111", "0110011", "0111100", "1010101", "1011010", "1100110", "1101001")


def _pairwise() -> dict[str, str]:
    from engine.sources.native_mtp import _CHOICES

    names = list(_CHOICES)
    assert len(names) == 7, names  # a new convention: extend the array (an L8 covers 7 factors)
    out = {}
    for row in _L8:
        conv = {n: _CHOICES[n][int(b)] for n, b in zip(names, row, strict=True)}
        out["pw-" + row] = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in conv.items())
    return out


PAIRWISE = _pairwise()


def test_the_convention_matrix_is_pairwise() -> None:
    from itertools import combinations

    from engine.sources.native_mtp import Conventions

    rows = [Conventions.parse(c) for c in PAIRWISE.values()]
    names = list(Conventions().to_json())
    for a, b in combinations(names, 2):
        seen = {(getattr(r, a), getattr(r, b)) for r in rows}
        assert len(seen) == 4, (a, b, seen)


@pytest.fixture(scope="module")
def setups():
    from oracles.native_mtp_ref import Reference
    from specparity.runners import load_model
    from zoo.native_mtp import target_paths

    out = {}
    for t in ("glm-mtp", "deepseek-mtp"):
        tpath, cpath = target_paths(t)
        out[t] = (load_model(str(tpath)).model, cpath, Reference(tpath, cpath))
    return out


def _engine_rows(model, cpath, conv, pid: str = "nat-00", gamma: int = 3, n: int = 20):
    """(trace records with header, {(round, position): engine draft logits})."""
    import zoo
    from engine.sources import make_provider

    p = make_provider("native-mtp", path=cpath, conventions=conv)
    p.logit_log = []
    ids = list(zoo.prompt(pid).token_ids)
    res = spec_generate(model, p, ids, GenerationParams(max_tokens=n, gamma=gamma))
    header = {"type": "header", "prompt": {"token_ids": ids},
              "params": {"mtp_conventions": p.header_params()}}
    rounds: dict[int, int] = {}
    emitted = 0
    for r in res.records:
        if r["type"] == "round" and r["drafts"]:
            rounds[len(ids) + emitted - 2] = r["index"]  # the pending row's position
        if r["type"] in ("round", "plain"):
            emitted += len(r["emitted"])
    return [header, *res.records], {(rounds[s], i): v for s, i, v in p.logit_log}


def _problems(setup, conv, **kw) -> tuple[int, list[str]]:
    from oracles.native_mtp_ref import compare, draft_logits

    model, cpath, ref = setup
    recs, eng = _engine_rows(model, cpath, conv, **kw)
    want = draft_logits(ref, recs)
    return len(want), compare(eng, want, BOUND)


@pytest.mark.parametrize("conv", list(CONVS))
@pytest.mark.parametrize("target", ["glm-mtp", "deepseek-mtp"])
def test_draft_logits_agree_with_the_reference(setups, target: str, conv: str) -> None:
    rows, bad = _problems(setups[target], CONVS[conv])
    assert rows >= (3 if conv == "family" else 20), rows
    assert not bad, f"{target}/native-mtp/{conv}: {bad[:3]}"


@pytest.mark.parametrize("conv", list(PAIRWISE))
@pytest.mark.parametrize("target", ["glm-mtp", "deepseek-mtp"])
def test_draft_logits_agree_on_every_pair_of_conventions(setups, target: str, conv: str) -> None:
    rows, bad = _problems(setups[target], PAIRWISE[conv], n=12)
    assert rows >= 3, rows
    assert not bad, f"{target}/native-mtp/{PAIRWISE[conv]}: {bad[:3]}"


def _plant(monkeypatch, bug: str) -> None:
    from engine.sources import native_mtp as nm

    real_open, real_run = nm.NativeMTPProvider.open, nm.NativeMTPSource._run

    def swapped(**kw):  # the source reads another value than the one it declares
        def open_(self, sampler, target):
            src = real_open(self, sampler, target)
            src.conv = replace(src.conv, **kw)
            return src
        monkeypatch.setattr(nm.NativeMTPProvider, "open", open_)

    if bug == "pre/post-norm swapped":
        monkeypatch.setattr(nm.NativeMTPSource, "_target_hidden", lambda self, h: h)
    elif bug == "concat order":
        swapped(concat="h;e")
    elif bug == "position off by one":  # every row: visible only through the position-0 mask
        monkeypatch.setattr(nm.NativeMTPSource, "_run",
                            lambda self, j, t, h, pos: real_run(self, j, t, h, pos + 1))
    elif bug == "chain rows one position late":
        monkeypatch.setattr(nm.NativeMTPSource, "_run", lambda self, j, t, h, pos: real_run(
            self, j, t, h, pos + (1 if pos > self._round_start else 0)))
    elif bug == "position-0 mask missing":
        monkeypatch.setattr(nm.NativeMTPSource, "_embed",
                            lambda self, t, pos: self.embed(t.reshape(1, -1).astype(nm.mx.uint32)))
    elif bug == "depth reuse":
        swapped(depth="reuse")
    elif bug == "position-0 mask ignores position_base":
        def embed(self, t, pos):
            e = self.embed(t.reshape(1, -1).astype(nm.mx.uint32))
            if self.conv.mask_pos0 and pos == 0:  # the bug: position_base not added
                e = e * (nm.mx.arange(e.shape[1]) > 0).astype(e.dtype)[None, :, None]
            return e
        monkeypatch.setattr(nm.NativeMTPSource, "_embed", embed)


@pytest.mark.parametrize("target,bug,first", [
    ("glm-mtp", "pre/post-norm swapped", "round 0, position 0"),
    ("glm-mtp", "concat order", "round 0, position 0"),
    ("glm-mtp", "position off by one", "round 0, position 0"),
    ("glm-mtp", "position-0 mask missing", "round 0, position 0"),
    ("glm-mtp", "chain rows one position late", "round 0, position 1"),
    ("deepseek-mtp", "depth reuse", "round 0, position 1"),
    ("deepseek-mtp", "pre/post-norm swapped", "round 0, position 0"),
])
def test_planted_convention_bug_is_caught_naming_the_row(setups, monkeypatch, target, bug, first) -> None:
    _plant(monkeypatch, bug)
    _, bad = _problems(setups[target], "trim=rebuild")
    assert bad, f"{target}: planted '{bug}' went unnoticed"
    assert bad[0].startswith(first + ":"), f"{target}: planted '{bug}': first named row {bad[0]!r}"


def test_planted_mask_ignoring_position_base_is_caught_by_the_matrix(setups, monkeypatch) -> None:
    """Issue 36's blind spot: the reference test set position_base only with the mask off, so a
    mask reading the row position without position_base passed. The pairwise rows with
    position_base 1 and the mask on catch it."""
    _plant(monkeypatch, "position-0 mask ignores position_base")
    caught = [c for c in PAIRWISE if "position_base=1" in PAIRWISE[c] and "mask_pos0=true" in PAIRWISE[c]
              and _problems(setups["glm-mtp"], PAIRWISE[c], n=12)[1]]
    assert caught, "the position-0 mask ignoring position_base went unnoticed by every pairwise row"
