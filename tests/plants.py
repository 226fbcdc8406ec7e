"""A pytest plugin that plants an engine bug for a whole pytest run (``-p tests.plants``).

Used by ``tests/test_user_suite_option.py`` to show the user-pair conformance tests
(``conformance/test_user_suite.py``) fail on a user's pair when the engine is wrong:
``SPECPARITY_PLANT=eos-as-content`` makes ``engine.stream.TokenStream.offer`` emit a
stopping EOS as content (§2 step 3). Never imported by shipped code.
"""

from __future__ import annotations

import os
from typing import Any


def pytest_configure(config: Any) -> None:
    if os.environ.get("SPECPARITY_PLANT") != "eos-as-content":
        return
    import engine.stream as ex

    real = ex.TokenStream.offer

    def offer(self: Any, token: int) -> str | None:
        stop = real(self, token)
        if stop == "eos":
            self.output.append(token)
        return stop

    ex.TokenStream.offer = offer  # type: ignore[method-assign]
