"""Grading what others wrote or ship, against the engine and the references.

- ``trace_folders.py``: ``specparity grade DIR``: a folder of traces any engine wrote;
- ``engines.py``: ``grade --engine NAME``: a third-party engine of ``subjects/`` on its checks,
  and the scoreboard;
- ``native_mtp_conventions.py``: an engine's native-MTP head calls (captured by
  ``subjects/mtp_conventions.py``) recomputed under each named convention.

(The served engines' job, ``grade --serve``, is ``specparity/grading/http_servers.py`` for now.)
"""
