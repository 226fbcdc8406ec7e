"""Each planted session bug caught by warm ≡ cold itself, not only by an engine consistency check.

``tests/test_prompt_cache.py`` catches a saved cache one token short and a drafter cache never
restored through ``engine.prompt_cache.check_segment`` (the session's own invariant: "a hole").
That proves the invariant, not the comparison the sessions exist for: with the invariant
switched off, the warm request must still differ from its cold run, named by request, record
and field (issue 36: "each check caught by its own comparison"). The one-token-short REUSE
(offsets papered over) is the comparison's alone: ``tests/test_sessions_nonexact.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine import prompt_cache as pc
from engine.sources.two_model import TwoModelProvider
from specparity.jobs.sessions import run_session
from tests.test_prompt_cache import GREEDY, DrafterNotRestored, ShortSave, _pair, _prompts


@pytest.fixture
def no_invariant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The session's segment invariant switched off: only warm ≡ cold is left to notice."""
    monkeypatch.setattr(pc, "check_segment", lambda seg, n, what: None)


def _session(factory: Any, kind: str = "multi-turn") -> Any:
    tm, dm = _pair("llama")
    a, b = _prompts()
    return run_session(tm, lambda: TwoModelProvider(dm), kind, a, [b], GREEDY, session_factory=factory)


def test_saved_cache_one_token_short_is_warm_not_cold(no_invariant: None) -> None:
    v = _session(ShortSave)
    msg = v.first_divergence
    assert msg is not None and "PromptCacheError" not in msg and "a hole" not in msg, msg
    # request 0 saved it; request 1 reuses it: its prefill's cache is not the cold run's
    assert msg.startswith("request 1 (follow-up): prefill (before round 0): target_cache_digest layer 0"), msg


def test_drafter_never_restored_is_warm_not_cold(no_invariant: None) -> None:
    v = _session(DrafterNotRestored)
    msg = v.first_divergence
    assert msg is not None and "PromptCacheError" not in msg, msg
    assert msg.startswith("request 1 (follow-up): prefill (before round 0): drafter_cache_digest layer 0"), msg


def test_the_invariant_is_what_caught_them_before(no_invariant: None) -> None:
    """Sanity of the switch: the invariant's message is gone, the session still runs."""
    v = _session(None)
    assert v.identical, v.first_divergence
