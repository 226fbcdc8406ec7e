"""Each served check declared ONCE: its name, function, scoreboard title, the prompts it needs, whether it
is judged against plain decode of the prompt, and on which server it runs; everything else is derived
(the ``--check`` choices, the plan, the gate, the grader's server groups, the scoreboard's columns).

Declare a check with the :func:`check` decorator on its function (``subjects/served/checks_*.py``)::

    @check("budget", title="budget", needs=(len(BUDGETS), 0), gated=True)
    def check_budget(ctx: Ctx) -> str: ...

Order is declaration order (the plan hands out prompts in it: ``--check X`` alone sends the same
requests as a full run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SERVERS_OF_A_CHECK = ("main", "cache-on", "rejecting", "arm")


@dataclass(frozen=True)
class Check:
    """One served check.

    ``fn``: the check (it records one case per request with ``ctx.case``; None: judged by the grader over
    a whole arm, e.g. ``speculation``); ``title``: its scoreboard column; ``needs``: (prompts without EOS,
    prompts ending on EOS) it takes from the plan; ``gated``: judged against plain decode of the prompt
    (cannot grade where the server builds another prompt); ``server``: ``main`` (the arm's fresh server,
    prompt cache off), ``cache-on`` (a fresh server of its own, cache on), ``rejecting`` (the spec arm's
    drafter zeroed), ``arm`` (over the whole arm); ``before``: run before any other check on its server
    (the leak check's probes on the fresh server)."""

    name: str
    fn: Callable[[Any], str] | None
    title: str
    needs: tuple[int, int] = (0, 0)
    gated: bool = False
    server: str = "main"
    before: Callable[[Any], None] | None = None


CHECKS: dict[str, Check] = {}


def declare(c: Check) -> Check:
    """Add ``c`` (its name must be new; its server one of ``SERVERS_OF_A_CHECK``)."""
    if c.name in CHECKS:
        raise ValueError(f"served check {c.name!r} declared twice")
    if c.server not in SERVERS_OF_A_CHECK:
        raise ValueError(f"served check {c.name!r}: server {c.server!r} not one of {SERVERS_OF_A_CHECK}")
    CHECKS[c.name] = c
    return c


def check(name: str, *, title: str, needs: tuple[int, int] = (0, 0), gated: bool = False, server: str = "main",
          before: Callable[[Any], None] | None = None) -> Callable[[Callable[[Any], str]], Callable[[Any], str]]:
    """Declare the decorated function as the served check ``name``."""
    def deco(fn: Callable[[Any], str]) -> Callable[[Any], str]:
        declare(Check(name, fn, title, needs, gated, server, before))
        return fn

    return deco


def check_names() -> tuple[str, ...]:
    """Every declared check, in order."""
    return tuple(CHECKS)


def gated() -> tuple[str, ...]:
    """The checks judged against plain decode of the prompt the server builds."""
    return tuple(n for n, c in CHECKS.items() if c.gated)


def titles() -> dict[str, str]:
    """Each check's scoreboard column title, in order."""
    return {n: c.title for n, c in CHECKS.items()}
