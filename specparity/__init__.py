"""specparity: the command line and the main job that tie the parts together.

``engine`` (the engine under our contract), ``oracles`` (the references),
``traces`` (the interchange format) and ``reports`` (tables and verdicts) are
independent packages; this one only orchestrates them.
"""

__version__ = "0.1.0"
