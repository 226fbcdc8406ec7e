"""Cases and their inputs: what a run runs, before any runner touches it.

- ``case.py``: :class:`~specparity.cases.case.Case` (pair, source, prompt, params), the zoo
  matrix builders, model labels and the cached weights digest;
- ``prompts.py``: prompts files and prompt-id checks against a model;
- ``suite.py``: TOML suites (``run --suite``) expanded into cases.
"""
