"""Measurement: paired comparisons and timings, with the statistics stated.

- ``ab.py``: ``specparity ab`` (two drafters on the same prompts, McNemar and bootstrap);
- ``drafter_ab.py``: the quantized-drafter A/B;
- ``bench.py``: ``specparity bench`` (paired, interleaved timings);
- ``bench_batched.py``: batched throughput.
"""
