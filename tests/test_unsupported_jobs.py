"""Every job routes a missing op to ``unsupported`` (issue 39): enumerated, so a job added next time
cannot skip it.

The jobs are read from the code, not listed by hand: every ``specparity`` subcommand
(``specparity.commands.discover``) and every ``python -m specparity.measure.<module>`` (a module of
``specparity.measure`` with a ``main``). Each must be declared below, in :data:`PER_UNIT` (a job of
many units: a missing op is that unit's verdict, the job goes on) with the test proving it, in
:data:`WHOLE_COMMAND` (one unit: the command's verdict line ``unsupported on <device>: <op> — ...``,
exit 1, at the CLI boundary ``specparity.cli.entry._classify``) or in :data:`NO_FORWARD` (runs no
model). The missing op is planted as MLX raises it (``engine.backend``'s first form, MLX 0.32.4
``cuda/quantized/quantized.cpp``): a zoo model's forward raises the same ``RuntimeError``.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

QMM = ('[quantized_matmul] No implementation for problem shape: 1x28x32x2, transpose: true, activation: '
       'float32, bits: 4, group size: 32, mode: "affine".')
VERDICT = "unsupported on Device(cpu, 0): quantized_matmul"


def plant(monkeypatch: pytest.MonkeyPatch, when: Callable[[Any], bool] = lambda _x: True,
          module: str = "llama") -> None:
    """``mlx_lm.models.<module>.Model``'s forward raises MLX's missing-op error when ``when(inputs)``."""
    mod = importlib.import_module(f"mlx_lm.models.{module}")
    real = mod.Model.__call__

    def forward(self: Any, inputs: Any, *a: Any, **k: Any) -> Any:
        if when(inputs):
            raise RuntimeError(QMM)
        return real(self, inputs, *a, **k)

    monkeypatch.setattr(mod.Model, "__call__", forward)


def commands() -> set[str]:
    import specparity.cli  # noqa: F401 - the CLI first (specparity.commands is imported through it)
    from specparity.commands import discover

    return {m.NAME for m in discover()}


def measure_modules() -> set[str]:
    import specparity.measure as pkg

    out = set()
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        if callable(getattr(mod, "main", None)):
            out.add(f"python -m specparity.measure.{info.name}")
    return out


# ------------------------------------------------------------------ the proofs, one per job of many units


def prove_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``specparity run`` (and a suite, which runs through it): the planted case's verdict, the run goes on."""
    from specparity.cli import main

    plant(monkeypatch, module="qwen3")  # llama's cases conform, qwen3's are unsupported
    suite = tmp_path / "s.toml"
    suite.write_text('gammas = [3]\nmax_tokens = 4\nzoo_prompts = 1\n[[pair]]\ntarget = "llama"\ndrafter = "twin"\n'
                     '[[pair]]\ntarget = "qwen3"\ndrafter = "twin"\n')
    rc = main(["run", "--suite", str(suite), "--runners", "mlx_lm", "--out", str(tmp_path / "o"), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "unsupported on Device(cpu, 0)" in out and "CONFORMS (" in out, out
    comps = json.loads((tmp_path / "o" / "comparisons.json").read_text())
    assert any(c["verdict"] == VERDICT and c["case_id"].startswith("qwen3/") for c in comps), comps
    assert all(c["verdict"] == "identical" for c in comps if c["case_id"].startswith("llama/")), comps


def prove_sessions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cli import main

    plant(monkeypatch, module="qwen3")
    suite = tmp_path / "s.toml"
    suite.write_text('sessions = ["continue"]\ngammas = [3]\nmax_tokens = 4\nzoo_prompts = 2\n'
                     '[[pair]]\ntarget = "llama"\ndrafter = "twin"\n[[pair]]\ntarget = "qwen3"\ndrafter = "twin"\n')
    rc = main(["run", "--suite", str(suite), "--out", str(tmp_path / "o"), "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "CONFORMS — 2 sessions: 1 warm ≡ cold, 0 numerics, 0 logic, 1 unsupported" in out, out
    rows = [line for line in out.split("## Reference")[0].splitlines() if line.startswith("| qwen3/")
            and "/continue |" in line]
    assert rows and all(VERDICT in line for line in rows), out
    assert any(line.startswith("| llama/") and "warm ≡ cold" in line for line in out.splitlines()), out


def prove_audit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cli import main

    plant(monkeypatch, module="qwen3")
    rc = main(["audit", "--targets", "llama,qwen3", "--prompts", "1", "--max-tokens", "4"])
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    assert f"{VERDICT} — audit qwen3 prompt" in cap.err, cap.err


def prove_grade(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``grade DIR``: traces of ours, graded; the re-runs grade needs hit the missing op."""
    from specparity.grading.trace_folders import grade
    from specparity.jobs.run import run_cases, zoo_cases

    cases = zoo_cases(targets=["llama", "qwen3"], drafters=["twin"], gammas=(3,), n_prompts=1, max_tokens=4)
    run_cases(tmp_path / "t", cases=cases, runners=[], progress=False)
    plant(monkeypatch, module="qwen3")
    res = grade(tmp_path / "t" / "traces" / "engine", tmp_path / "g", runners=["mlx_lm"], progress=False)
    comps = [c for c in res.comparisons]
    assert comps and any(c.verdict == VERDICT for c in comps), [c.verdict for c in comps]
    assert not any(c.fails for c in comps) and any(c.verdict == "identical" for c in comps)


def prove_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``specparity bench``: mlx-lm's arms hit the missing op (its forward runs ``mx.array`` inputs under
    its own generator; planted there), the engine's arms are measured; exit 0 with the arms named."""
    from specparity.cli import main

    mg = importlib.import_module("mlx_lm.generate")

    def step(*a: Any, **k: Any) -> Any:
        raise RuntimeError(QMM)
        yield  # a generator, as mlx-lm's

    monkeypatch.setattr(mg, "generate_step", step)
    monkeypatch.setattr(mg, "speculative_generate_step", step)
    out = tmp_path / "b"
    rc = main(["bench", "--prompts", "1", "--repeats", "1", "--max-tokens", "4", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert f"mlx_lm-spec: {VERDICT}" in text and "## unsupported on this backend" in text, text
    res = json.loads((out / "bench.json").read_text())
    assert set(res["unsupported_arms"]) == {"mlx_lm-spec", "mlx_lm-plain"}, res["unsupported_arms"]
    assert "spec_speedup_engine" in res["ratios"] and "engine_over_mlx_lm_spec" not in res["ratios"], res["ratios"]


def prove_bench_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Every arm unsupported: NOTHING MEASURED, exit 1, no traceback."""
    from specparity.cli import main

    plant(monkeypatch)
    rc = main(["bench", "--prompts", "1", "--repeats", "1", "--max-tokens", "4", "--out", str(tmp_path / "b")])
    cap = capsys.readouterr()
    assert rc == 1, cap.out + cap.err
    assert "NOTHING MEASURED" in cap.out and "5 of 5 arms unsupported" in cap.out, cap.out
    assert f"specparity bench: nothing measured: {VERDICT}" in cap.err and "Traceback" not in cap.err, cap.err


def prove_ab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``specparity ab``: the prompts whose forward hits the missing op are left out and listed."""
    import zoo
    from specparity.cli import main

    bad = list(zoo.prompts()[1].token_ids)
    plant(monkeypatch, when=lambda x: x.shape[-1] == len(bad) - 1 and x[0, 0].item() == bad[0])
    out = tmp_path / "ab"
    rc = main(["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--prompts", "3",
               "--allow-small", "--max-tokens", "4", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert f"1 prompts left out, {VERDICT}" in text, text
    res = json.loads((out / "ab.json").read_text())
    assert res["n_prompts"] == 2 and [u["prompt_id"] for u in res["unsupported"]] == [zoo.prompts()[1].id], res
    assert "## Unsupported on this backend" in (out / "ab.md").read_text()


def prove_ab_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cli import main

    plant(monkeypatch)
    rc = main(["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--prompts", "2",
               "--allow-small", "--max-tokens", "4", "--out", str(tmp_path / "ab")])
    cap = capsys.readouterr()
    assert rc == 1, cap.out + cap.err
    assert ": UNSUPPORTED" in cap.out and VERDICT in cap.out and "Traceback" not in cap.err, cap.out + cap.err


def prove_bench_batched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A forward with no kernel for a batch of more than 2 rows: B = 4 reads unsupported, B = 1 and 2
    are measured, exit 0; the JSON carries the verdict."""
    from specparity.measure import bench_batched as bb

    plant(monkeypatch, when=lambda x: x.shape[0] > 2)
    dest = tmp_path / "bb.json"
    rc = bb.main(["--drafter", "ngram", "--rows", "1,2,4", "--repeats", "1", "--max-tokens", "4", "--json", str(dest)])
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    assert f"| 4 | {VERDICT} |" in cap.out and "- B = 4: `" in cap.out, cap.out
    assert "| 1 |" in cap.out and "| 2 |" in cap.out and "Traceback" not in cap.err, cap.out
    table = json.loads(dest.read_text())["table"]
    assert [r.get("verdict") for r in table] == [None, None, VERDICT], table


def prove_bench_batched_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.measure import bench_batched as bb

    plant(monkeypatch)
    rc = bb.main(["--drafter", "ngram", "--rows", "1,2", "--repeats", "1", "--max-tokens", "4"])
    cap = capsys.readouterr()
    assert rc == 1, cap.out + cap.err
    assert f"bench_batched: no figure: every batch size unsupported ({VERDICT})" in cap.err, cap.err


def prove_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``specparity record``: each runner is a unit; its verdict line; nothing recorded is exit 1."""
    from specparity.cli import main
    from specparity.measure.ab import resolve_target

    plant(monkeypatch)
    rc = main(["record", "--runner", "mlx_lm", "--target", str(resolve_target("llama")[1]), "--prompt", "hello",
               "--max-tokens", "4", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert f"/n4: {VERDICT} — [quantized_matmul] No implementation" in err and "internal error" not in err, err


def prove_whole_command(name: str, argv: list[str]) -> Callable[..., None]:
    def prove(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
        from specparity.cli import main
        from specparity.measure.ab import resolve_drafter, resolve_target

        where = {"TMP": str(tmp_path), "LLAMA": str(resolve_target("llama")[1]),
                 "TWIN": str(resolve_drafter("llama", "twin"))}
        plant(monkeypatch)
        rc = main([name, *(where.get(a.split("/")[0], a.split("/")[0]) + a[len(a.split("/")[0]):] for a in argv)])
        err = capsys.readouterr().err
        assert rc == 1, err
        assert f"specparity: {VERDICT} — nothing made: [quantized_matmul] No implementation" in err, err
        assert "internal error" not in err and "Traceback" not in err, err

    return prove


# job -> the proofs that a missing op is one unit's verdict and the job goes on
PER_UNIT: dict[str, tuple[Callable[..., None], ...]] = {
    "run": (prove_run, prove_sessions),  # the zoo matrix, a pair, a suite (--suite), --sessions
    "audit": (prove_audit,),
    "grade": (prove_grade,),
    "bench": (prove_bench, prove_bench_all),
    "ab": (prove_ab, prove_ab_all),
    "record": (prove_record,),
    "python -m specparity.measure.bench_batched": (prove_bench_batched, prove_bench_batched_all),
}
# one unit: the command's own verdict line at the CLI boundary, exit 1
WHOLE_COMMAND: dict[str, list[str]] = {
    "generate": ["--target", "LLAMA", "--draft", "TWIN", "--prompt", "hello", "--max-tokens", "4"],
    "zoo": ["list", "--max-tokens", "4"],
}
# regenerates the committed goldens, which are CPU traces by definition (no --device); a task's error
# is an ``error`` outcome of its report (specparity/goldens/regen.py), not routed here
CPU_GOLDENS = {"regen": "the committed CPU goldens"}
NO_FORWARD = {"diff": "compares two trace files", "known": "lists known divergences",
              "report": "renders a run's files", "trace": "validates trace files"}

PROOFS = [pytest.param(job, fn, id=f"{job}:{fn.__name__}") for job, fns in PER_UNIT.items() for fn in fns] + [
    pytest.param(name, prove_whole_command(name, argv), id=f"{name}:whole") for name, argv in WHOLE_COMMAND.items()]


def test_every_job_is_declared() -> None:
    """A new subcommand or ``python -m`` measure module fails here until it is declared (and proved)."""
    jobs = commands() | measure_modules()
    declared = set(PER_UNIT) | set(WHOLE_COMMAND) | set(CPU_GOLDENS) | set(NO_FORWARD)
    assert jobs == declared, (f"undeclared jobs {sorted(jobs - declared)}; declared but gone "
                              f"{sorted(declared - jobs)}: declare each in tests/test_unsupported_jobs.py "
                              "with a proof that a missing op is its unit's `unsupported` verdict")


@pytest.mark.parametrize(("job", "prove"), PROOFS)
def test_a_missing_op_is_the_units_verdict(job: str, prove: Callable[..., None], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    prove(tmp_path, monkeypatch, capsys)


def test_a_genuine_error_is_not_unsupported(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Planted: an error of ours in a bench arm is not a missing op; it stops the bench (internal error)."""
    from specparity.cli import main

    def broken(self: Any, *a: Any, **k: Any) -> Any:
        raise RuntimeError("cache offset 7 != committed 6 (planted)")

    import mlx_lm.models.llama as m

    monkeypatch.setattr(m.Model, "__call__", broken)
    rc = main(["bench", "--prompts", "1", "--repeats", "1", "--max-tokens", "4", "--out", "/tmp/_unused_bench"])
    err = capsys.readouterr().err
    assert rc == 1 and "internal error: RuntimeError: cache offset 7" in err and "unsupported" not in err, err
