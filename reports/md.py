"""Markdown escaping for values that come from traces, file names and users.

Case ids, prompt ids, runner names and paths are data, not Markdown: a case id
``<script>…`` or ``a|b`` must render as text in ``report.md``/``summary.md``,
never as HTML or a broken table. Rules follow CommonMark 0.31 (backslash
escapes §2.4, code spans §6.1, entity references §2.5) and GFM tables (``|``
inside a cell must be escaped).
"""

from __future__ import annotations

import html
import re
from typing import Any

_SPECIAL = re.compile(r"([\\`*_\[\]|~])")
_TICKS = re.compile(r"`+")


def text(value: Any) -> str:
    """``value`` as inline Markdown text: HTML entities for ``<>&``, backslash escapes, one line."""
    s = html.escape(str(value), quote=False).replace("\r", " ").replace("\n", " ")
    return _SPECIAL.sub(r"\\\1", s)


def code(value: Any) -> str:
    """``value`` as an inline code span whose fence no backtick inside can close (one line)."""
    s = str(value).replace("\r", " ").replace("\n", " ")
    longest = max((len(m) for m in _TICKS.findall(s)), default=0)
    fence = "`" * (longest + 1)
    if s.startswith("`") or s.endswith("`"):
        s = f" {s} "
    return f"{fence}{s}{fence}"


def fenced(body: str) -> str:
    """A fenced code block around ``body`` whose fence no line of ``body`` can close."""
    longest = max((len(m) for m in _TICKS.findall(body)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{body}\n{fence}"


def frame(df: Any) -> Any:
    """A copy of DataFrame ``df`` whose string cells are :func:`text`-escaped (for ``to_markdown``)."""
    out = df.copy()
    for col in out.columns:
        if any(isinstance(v, str) for v in out[col]):  # object or pandas string dtype
            out[col] = out[col].astype(object).map(lambda v: text(v) if isinstance(v, str) else v)
    return out
