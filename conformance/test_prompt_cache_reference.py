"""mlx-lm's own prompt cache with a draft model (oracles/mlx_lm_prompt_cache.py), graded warm vs
cold by the sessions' checks: the known entries reproduce, and the control (plain decode through
the same prompt cache) stays warm ≡ cold where the entries say it does."""

from __future__ import annotations

import pytest

from traces.reference import known_entries

# one worker builds the module-scoped fixture (seconds) once: `--dist loadgroup`
pytestmark = [pytest.mark.oracle, pytest.mark.xdist_group("prompt-cache-reference")]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    from specparity.jobs.sessions import REFERENCE, reference_sessions, zoo_session_cases
    from specparity.runners.registry import availability

    ok, why = availability(REFERENCE)
    if not ok:
        pytest.skip(why)
    return reference_sessions(zoo_session_cases(targets=["llama"]))


def _entry(eid: str):
    e = next((e for e in known_entries() if e.id == eid), None)
    assert e is not None, f"{eid} missing from traces/known_divergences.toml"
    assert e.runner == "mlx_lm_prompt_cache"
    return e


def test_spec_lane_warm_not_cold(rows: list[dict]) -> None:
    """mlx-lm-prompt-cache-spec-warm-not-cold: speculative sessions diverge without any error."""
    _entry("mlx-lm-prompt-cache-spec-warm-not-cold")
    spec = [r for r in rows if r["lane"] == "spec" and not r["label"].endswith("/continue")]
    bad = [r for r in spec if not r["identical"]]
    assert bad, "mlx-lm's prompt cache was warm ≡ cold on every speculative session: the entry is stale"
    assert all("error" not in (r["first_divergence"] or "") for r in bad), [r["first_divergence"] for r in bad]


def test_plain_lane_control_is_warm_equal_cold(rows: list[dict]) -> None:
    """The same prompt cache without the drafter: warm ≡ cold on llama (KVCache), but the exact hit."""
    plain = [r for r in rows if r["lane"] == "plain" and not r["label"].endswith("/continue")]
    assert plain and all(r["identical"] for r in plain), [r["first_divergence"] for r in plain if not r["identical"]]


def test_exact_hit_empty_prompt(rows: list[dict]) -> None:
    e = _entry("mlx-lm-prompt-cache-exact-hit-empty-prompt")
    cont = [r for r in rows if r["label"].endswith("/continue")]
    assert cont
    for r in cont:
        req = next(q for q in r["requests"] if q["index"] == 1)
        assert req["cached"] == req["prompt_tokens"], req  # the exact hit: the whole prompt "cached"
        assert "error: warm" in (req["divergence"] or ""), req
        if r["lane"] == "plain":
            assert e.message in req["divergence"], req
