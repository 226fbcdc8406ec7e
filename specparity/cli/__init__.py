"""The command line's boundary: the entry point and what every command shares.

- ``entry.py``: ``main`` (the ``specparity`` console script, ``python -m specparity.cli``),
  the parser built from ``specparity.commands`` and the error boundary (one line, exit 2
  for usage errors);
- ``args.py``: validated flag types and the error classes the boundary maps to exit statuses;
- ``case_args.py``, ``kv_args.py``, ``processor_args.py``: the flags that describe a case;
- ``outdir.py``: output folders (locks, one run per directory);
- ``progress.py``: progress lines; ``devices.py``: ``--device``.
"""

from specparity.cli.entry import main

__all__ = ["main"]
