"""DSpark block drafters (§4 of the contract).

- :mod:`engine.dspark.deepspec_module` — an MLX port of DeepSeek's released
  ``Gemma4DSparkModel`` (DeepSpec, MIT) with its checkpoint loader and the
  mlx affine 4/8-bit quantized sibling (§4.3).
- :mod:`engine.dspark.module` — our DSpark block drafter (§4.1: KV injection,
  Markov head, confidence head, confidence-scheduled pruning).
- :mod:`engine.dspark.calibration` — per-position threshold calibration (§4.1).
- :mod:`engine.dspark.loader` — artifact-kind detection and the v1 refusal.
"""
