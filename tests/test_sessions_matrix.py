"""Prompt-cache sessions over γ 0 and 1 too, every request kind, and a pairwise nightly matrix.

The zoo session matrix (``specparity.jobs.sessions.zoo_session_cases``) runs γ 3 only. Which
positions of a saved segment came from a one-token forward depends on γ: at γ 0 every round
is a one-token verify window, at γ 1 windows of two. On a target whose one-token forward is
not its prefill's arithmetic (deepseek-mtp's MLA, ``split_profile`` "multi") a segment written
by decode must never be reused as if a prefill had written it. Default run: the MLA target
and a KV target at γ 0 and 1 over every session kind (control + one-axis variants), and the
plant issue 36 names -- a decode-written segment treated as prefill-written -- caught by
warm ≡ cold there (it passed the γ 3 matrix). Nightly (``-m slow``, marked heavy): every zoo session row
(cache family × source kind) × every session kind × γ 0/1/3, as a pairwise cover.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product

import pytest

import zoo
from specparity.cases.case import Case
from specparity.jobs.sessions import SESSIONS, sessions_from_cases, zoo_session_cases


def _cases(target: str, drafter: str, source: str, gamma: int) -> list[Case]:
    pids = [p.id for p in zoo.prompts() if p.kind == "natural"][:2]
    return [Case(target, drafter, pid, gamma, 12, source=source, eos_ids=(zoo.eos_id(),)) for pid in pids]


ROWS = [("deepseek-mtp", "native", "native-mtp"), ("llama", "twin", "two-model")]


@pytest.mark.parametrize("gamma", [0, 1])
@pytest.mark.parametrize("row", ROWS, ids=lambda r: r[0])
def test_every_session_kind_at_small_gamma(row: tuple[str, str, str], gamma: int) -> None:
    verdicts = sessions_from_cases(_cases(*row, gamma))
    assert {v.session for v in verdicts} == set(SESSIONS)
    bad = [f"{v.label}: {v.first_divergence}" for v in verdicts if not v.identical]
    assert not bad, bad


def test_decode_written_segment_reused_as_prefill_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: the session never marks a saved segment as written by one-token forwards, so on
    the MLA target a decode-written prefix is reused where only a prefill boundary may be."""
    from engine import prompt_cache as pc

    real = pc.Segment.__init__

    def init(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        kw["one_token_forwards"] = False
        real(self, *a, **kw)

    monkeypatch.setattr(pc.Segment, "__init__", init)
    verdicts = sessions_from_cases(_cases(*ROWS[0], 0), names=["multi-turn", "continue"])
    bad = [v for v in verdicts if not v.identical]
    assert bad, "a decode-written segment reused as prefill-written went unnoticed at γ 0"
    assert "request" in (bad[0].first_divergence or ""), bad[0].first_divergence


def _pairwise_rows() -> list[tuple[Case, str, int]]:
    """Each (zoo session row, session kind) and each (row, γ) and (kind, γ) pair at least once."""
    rows = {(c.target, c.drafter, c.source, c.kv_bits, c.quantized_kv_start): c
            for c in zoo_session_cases(sampling=((0.0, 0),))}
    kinds, gammas = list(SESSIONS), [0, 1, 3]
    out = []
    for i, (case, kind) in enumerate(product(rows.values(), kinds)):
        out.append((case, kind, gammas[(i + kinds.index(kind)) % len(gammas)]))
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("case,kind,gamma", _pairwise_rows(),
                         ids=lambda x: x.case_id if isinstance(x, Case) else str(x))
def test_pairwise_session_matrix(case: Case, kind: str, gamma: int) -> None:
    verdicts = sessions_from_cases([replace(case, gamma=gamma, prompt_id=p) for p in ("nat-00", "nat-01")],
                                   names=[kind])
    bad = [f"{v.label}: {v.first_divergence}" for v in verdicts if not v.identical]
    assert not bad, bad


def test_the_pairwise_cover_is_pairwise() -> None:
    rows = _pairwise_rows()
    keys = {(c.target, c.drafter, c.source, c.kv_bits, c.quantized_kv_start) for c, _, _ in rows}
    assert {(k, g) for k in SESSIONS for g in (0, 1, 3)} <= {(kind, g) for _, kind, g in rows}
    assert len({((c.target, c.drafter, c.source, c.kv_bits, c.quantized_kv_start), g) for c, _, g in rows}) == \
        len(keys) * 3
