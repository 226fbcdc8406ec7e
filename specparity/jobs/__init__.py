"""The jobs that run cases and compare their traces.

- ``run.py``: ``specparity run``, the main job (engine and references on the cases, the
  comparisons, the summary and report) and its execution backends' task;
- ``sessions.py``: prompt-cache sessions, warm ≡ cold (``run --sessions``);
- ``batched.py``: the run's batched cases (every row ≡ its serial run).
"""
