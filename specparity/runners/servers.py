"""Runner declarations of the HTTP-served engines: one per ``subjects.server_rows.SERVERS`` row.

A server is graded black-box over its OpenAI-compatible API by ``specparity grade
--serve NAME --model PATH [--draft PATH]`` (started on 127.0.0.1, stopped after) or
``--server URL``, with and without speculation, on the checks of ``subjects/served/``
(each declared once, ``subjects/served/declare.py``); it exposes no rounds, so it is not run
per case. How each server is started (its argv, its tox environment) is its ``ServedEngine``
row in ``subjects/server_rows.py`` (started and graded by ``specparity/grading/http_servers.py``);
this module turns every row into a runner of kind ``server``.
"""

from __future__ import annotations

from collections.abc import Callable

from specparity.runners.registry import Runner


def _available(name: str) -> Callable[[], tuple[bool, str]]:
    def check() -> tuple[bool, str]:
        from subjects.server_rows import availability

        return availability(name)

    return check


def _runners() -> tuple[Runner, ...]:
    from subjects.server_rows import SERVERS

    return tuple(
        Runner(
            name=eng.name,
            kind="server",
            package=eng.package.split("==")[0],
            available=_available(eng.name),
            install_hint=f"tox -e {eng.tox_env}",
            elsewhere=f"an OpenAI-compatible server graded over HTTP by `specparity grade --serve "
                      f"{eng.name} --model PATH` ({eng.note})",
            rank=300 + i,
        )
        for i, eng in enumerate(SERVERS.values())
    )


RUNNERS = _runners()
