"""Golden traces: committed traces per (runner, zoo case), their manifest and regeneration.

- ``manifest.py``: which goldens exist (from the runner registry's declarations), the
  manifest of their inputs, staleness, normalisation and the comparison with a live trace;
- ``regen.py``: ``specparity regen`` and the execution backends the jobs share;
- ``draft_goldens.py``: the draft-level golden producers.
"""
