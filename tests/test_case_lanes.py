"""Every case field reaches every lane (issue 41): the fields of ``specparity.cases.case.Case``,
enumerated from the dataclass (a field added later is held here too), each planted with a
non-default value, must reach the serial lane (the engine runner's request and trace header),
the batched lane (each row of ``specparity.jobs.batched.batch_cases``), the sessions lane (the
session's requests, ``specparity.jobs.sessions``) and the fill lane -- or be declared not
applicable there, with the reason, by the lane's module. Before, batched rows were built from
zoo names alone: ``--eos-ids 5`` reached the serial run and not its batched rows (they got the
tokenizer's EOS set).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from specparity.cases.case import Case

BASE = Case("llama", "twin", "nat-00", 3, 16)
# a non-default value per field (a new field must be planted here, or this test fails)
PLANTS: dict[str, Any] = {
    "target": "gemma3", "drafter": "small", "prompt_id": "nat-05", "gamma": 2, "max_tokens": 9,
    "temperature": 0.7, "seed": 5, "eos_ids": (5,), "stop_sequences": ((7, 8),), "source": "ngram",
    "top_p": 0.9, "top_k": 5, "target_path": "/models/t", "draft_path": "/models/d", "prompt_tokens": (3, 4, 5),
    "processors": "rp1.3c64", "kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0, "rotating": "exact",
    "grammar": "json-small", "reasoning_end": "</think>", "min_tokens": 3, "rng": "position",
    "min_p": 0.1,
}
# fields naming what runs (models, source, prompt): a lane reaches them by running that
IDENTITY = ("target", "drafter", "source", "target_path", "draft_path", "prompt_id", "prompt_tokens")
FIELDS = [f.name for f in dataclasses.fields(Case)]
# a field that only means something beside another: planted on a base that has it
NEEDS: dict[str, dict[str, Any]] = {"kv_group_size": {"kv_bits": 4}, "quantized_kv_start": {"kv_bits": 4},
                                    "reasoning_end": {"grammar": "json-small"}}


def pair(name: str) -> tuple[Case, Case]:
    """``(base, planted)`` for field ``name``."""
    base = dataclasses.replace(BASE, **NEEDS.get(name, {}))
    return base, dataclasses.replace(base, **{name: PLANTS[name]})
FILL_NOT_APPLICABLE = ("the fill lane runs the fill matrix's own cases (zoo.fill.FillCase: the tool-calling "
                       "fill models, templates and forced spans), not the run's Case")


def test_every_field_is_planted() -> None:
    assert set(PLANTS) == set(FIELDS), set(FIELDS) ^ set(PLANTS)
    for name, value in PLANTS.items():
        assert getattr(BASE, name) != value, name


def _run_view(case: Case) -> tuple[Any, ...]:
    """What a run of ``case`` is made of: its request's params and its trace header's params."""
    from specparity.runners import _base_params, generation_params

    return repr(generation_params(case, (1,))), repr(_base_params(case, "tail-split"))


@pytest.mark.parametrize("name", FIELDS)
def test_field_reaches_the_serial_lane(name: str) -> None:
    base, planted = pair(name)
    if name in IDENTITY:
        pytest.skip("identity field: the runner runs the case's own models and prompt (case_paths, prompt ids)")
    assert _run_view(planted) != _run_view(base), f"{name} does not reach the serial run's params or header"


@pytest.mark.parametrize("name", FIELDS)
def test_field_reaches_the_batched_rows(name: str) -> None:
    from specparity.jobs.batched import CASE_FIELDS_NOT_APPLICABLE, ROW_SET_BY_DESIGN, batch_cases

    if name in ROW_SET_BY_DESIGN or name in CASE_FIELDS_NOT_APPLICABLE:
        reason = ROW_SET_BY_DESIGN.get(name) or CASE_FIELDS_NOT_APPLICABLE[name]
        assert len(reason) > 20, name
        return
    base, planted = pair(name)
    bcs = batch_cases([planted])
    assert bcs, f"{name}={PLANTS[name]!r}: no batched cases at all"
    rows = [r for bc in bcs for r in bc.rows]
    assert all(getattr(r, name) == PLANTS[name] for r in rows), (name, [getattr(r, name) for r in rows])
    assert all(_run_view(r) != _run_view(dataclasses.replace(r, **{name: getattr(base, name)}))
               or name in IDENTITY or name in ("grammar", "reasoning_end") for r in rows), name


@pytest.mark.parametrize("name", FIELDS)
def test_field_reaches_the_sessions(name: str) -> None:
    from specparity.jobs.sessions import (
        CASE_FIELDS_NOT_APPLICABLE,
        _group_key,
        _params,
        _prompt_ids,
    )

    if name in CASE_FIELDS_NOT_APPLICABLE:
        assert len(CASE_FIELDS_NOT_APPLICABLE[name]) > 20
        return
    base, planted = pair(name)
    if name in ("prompt_id", "prompt_tokens"):
        assert _prompt_ids(planted) != _prompt_ids(base)
        return
    assert _group_key(planted) != _group_key(base), name  # a session runs on its group's case
    if name not in IDENTITY:
        assert repr(_params(planted, (1,))) != repr(_params(base, (1,))), f"{name} does not reach a session request"


def test_fill_lane_declares_the_case_fields_not_applicable() -> None:
    from zoo.fill import matrix

    assert all(not isinstance(c, Case) for c in matrix(8)), FILL_NOT_APPLICABLE


def test_eos_ids_reach_batched_rows_params() -> None:
    """``--eos-ids 5``: the batched rows' requests carry EOS 5 (before: the tokenizer's [1])."""
    from specparity.jobs.batched import batch_cases, row_requests

    bc = batch_cases([dataclasses.replace(BASE, eos_ids=(5,))])[0]
    _, reqs, headers = row_requests(bc)
    assert all(tuple(r.params.eos_ids) == (5,) for r in reqs), [r.params.eos_ids for r in reqs]
