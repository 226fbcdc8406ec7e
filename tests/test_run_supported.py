"""``unsupported`` is one wrapper (``engine.backend.run_supported``) every job goes through, and the
sessions' headline says what was found (issue 39).

On the GPU ``run --sessions`` died at the first ``llama-kv`` session (``RuntimeError:
[quantized_matmul] No implementation for problem shape ...``): off a bit-exact backend the
session's calibration and witness run quantized forwards outside the per-request guard.
Reproduced here with both CPU doubles (``SPECPARITY_EMULATE_MISSING_OP=quantized_matmul``, and
``SPECPARITY_EMULATE_NONEXACT``: not bit-exact): the session reads ``unsupported on Device(cpu,
0): quantized_matmul``, listed and counted, and the run goes on and exits 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from engine.backend import EMULATE_ENV, Unsupported, run_supported


def _missing() -> None:
    raise RuntimeError('[quantized_matmul] No implementation for problem shape: 1x28x32x2, transpose: true, '
                       'activation: float32, bits: 4, group size: 32, mode: "affine".')


def test_run_supported_returns_the_verdict_or_the_value_and_lets_other_errors_through() -> None:
    assert run_supported(lambda: 7, "case x") == 7
    got = run_supported(_missing, "case x")
    assert isinstance(got, Unsupported) and got.verdict.endswith(": quantized_matmul"), got
    assert got.text.startswith("unsupported on ") and " — case x: [quantized_matmul] No implementation" in got.text
    with pytest.raises(RuntimeError, match="shape mismatch"):  # not a missing op: still an error
        run_supported(lambda: (_ for _ in ()).throw(RuntimeError("shape mismatch")), "case x")


def test_headline_counts_every_verdict_and_zero_logic_reads_conforms() -> None:
    from specparity.jobs.sessions import headline

    s = {"sessions": 80, "identical": 20, "numerics": 59, "logic": 0, "unsupported": 1}
    assert headline(s) == "CONFORMS — 80 sessions: 20 warm ≡ cold, 59 numerics, 0 logic, 1 unsupported"
    assert headline({**s, "logic": 1, "numerics": 58}).startswith("DIVERGES — 80 sessions")
    assert headline({"sessions": 2, "identical": 0, "numerics": 0, "logic": 0,
                     "unsupported": 2}).startswith("NOTHING COMPARED")


def test_sessions_off_a_bit_exact_backend_read_a_missing_op_as_unsupported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cli import main
    from specparity.runners import load_model

    monkeypatch.setattr(mx, "quantized_matmul", mx.quantized_matmul)  # restored after the double
    monkeypatch.setenv(EMULATE_ENV, "quantized_matmul")
    monkeypatch.setenv("SPECPARITY_EMULATE_NONEXACT", "0.01:0:0.001")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "token_ids": ids}) + "\n" for i, ids in (
        ("a", [3, 17, 40, 41, 99, 12, 7, 8, 200, 201, 33, 34]), ("b", [5, 6, 9, 120, 121, 122, 130]))))
    suite = tmp_path / "s.toml"
    suite.write_text(f'sessions = ["continue"]\ngammas = [3]\nmax_tokens = 5\nprompts_file = "{prompts.name}"\n'
                     "kv_bits = 4\nkv_group_size = 32\nquantized_kv_start = 0\n"
                     '[[pair]]\ntarget = "llama-kv"\ndrafter = "twin"\n'
                     '[[pair]]\ntarget = "llama-kv64"\ndrafter = "twin"\n')
    load_model.cache_clear()  # models loaded from here on wear the double
    try:
        rc = main(["run", "--suite", str(suite), "--out", str(tmp_path / "o"), "--quiet"])
    finally:
        load_model.cache_clear()  # later tests load exact models
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "CONFORMS — 2 sessions:" in text and "0 logic, 1 unsupported" in text, text
    table = text.split("## Reference")[0]
    row32 = next(line for line in table.splitlines() if line.startswith("| llama-kv/"))
    assert "| unsupported on Device(cpu, 0): quantized_matmul |" in row32, row32
    assert "DIVERGENT" not in table, table


def test_audit_reads_a_missing_op_as_that_runs_verdict(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``specparity audit``: a (target, prompt) whose run hits a missing op is listed as unsupported
    and the audit goes on (exit 0), never an internal error."""
    import engine.executor as ex
    from specparity.cli import main

    def missing(*_a: object, **_k: object) -> None:
        _missing()

    monkeypatch.setattr(ex, "spec_generate", missing)
    rc = main(["audit", "--targets", "llama", "--prompts", "1", "--max-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "1 run(s) unsupported on this backend" in err and "— audit llama prompt" in err, err
    assert ": quantized_matmul" in err


def test_a_comparison_whose_replay_hits_a_missing_op_reads_unsupported() -> None:
    """``run`` and ``grade DIR`` build every witness-replaying comparison through
    ``compare_supported``: a missing op in the replay is that comparison's ``unsupported`` entry."""
    from specparity.jobs.comparison import Comparison, compare_supported

    def replay() -> Comparison:
        _missing()
        raise AssertionError("unreachable")

    c = compare_supported("spec-vs-plain", "llama-kv/twin/nat-00/g3/n8", ["engine"], replay)
    assert c.verdict.endswith(": quantized_matmul") and not c.fails and c.status == "unsupported", c
    ok = compare_supported("spec-vs-plain", "x", ["engine"], lambda: Comparison("spec-vs-plain", "x", "tokens", None))
    assert ok.verdict == "identical"
    with pytest.raises(RuntimeError, match="boom"):
        compare_supported("spec-vs-plain", "x", ["engine"], lambda: (_ for _ in ()).throw(RuntimeError("boom")))
