"""Golden traces: committed traces per (golden set, zoo case), their manifest and regeneration.

Which golden sets exist is the runner registry's (``Runner.goldens``, declared in each
runner's module of ``specparity/runners/``; their cases: ``specparity/cases/golden_cases.py``).

- ``manifest.py``: the goldens the registry expects, the manifest of their inputs, staleness,
  normalisation and the comparison with a live trace;
- ``regen.py``: ``specparity regen`` and the execution backends the jobs share.
"""
