"""Quantized KV (``kv_bits``, ``kv_group_size``, ``quantized_kv_start``): case fields, flags,
the engine's exact speculation over a quantized cache, its §6 fallback, and the known entry.

Reference: mlx-lm 0.32.2 ``generate.py`` ``maybe_quantize_kv_cache``, ``generate_step`` and
``speculative_generate_step``; ``models/cache.py`` ``QuantizedKVCache``. Models: the
head_dim-32 llama pair of ``tests/kv_models.py`` (no zoo model's KV can be quantized).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine.executor import GenerationParams, plain_generate, spec_generate
from specparity.cases.case import Case
from traces.diff import diff_traces
from traces.io import Trace

PROMPT = (0, 5, 9, 14, 22, 5, 9, 30, 31, 32, 33, 40)  # 12 tokens: 11 drained


@pytest.fixture(scope="session")
def kv_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests import kv_models

    return kv_models.build(tmp_path_factory.mktemp("kvmodels"))


@pytest.fixture(scope="session")
def loaded(kv_pair: tuple[Path, Path]) -> tuple[Any, Any]:
    from specparity.runners import load_model

    return load_model(str(kv_pair[0])), load_model(str(kv_pair[1]))


def kv_case(kv_pair: tuple[Path, Path], **kw: Any) -> Case:
    base: dict[str, Any] = dict(
        target="kvllama", drafter="kvllama-twin", prompt_id="p", gamma=3, max_tokens=40,
        target_path=str(kv_pair[0]), draft_path=str(kv_pair[1]), prompt_tokens=PROMPT, eos_ids=(),
        kv_bits=2, kv_group_size=32, quantized_kv_start=16)
    base.update(kw)
    return Case(**base)


def params(**kw: Any) -> GenerationParams:
    base: dict[str, Any] = dict(max_tokens=40, gamma=3, eos_ids=(), kv_bits=2, kv_group_size=32,
                                quantized_kv_start=16)
    base.update(kw)
    return GenerationParams(**base)


def spec(loaded: tuple[Any, Any], p: GenerationParams, source: Any = None) -> Any:
    from engine.sources.two_model import TwoModelProvider

    t, d = loaded
    return spec_generate(t.model, source or TwoModelProvider(d.model), list(PROMPT), p)


# -- case ids, headers, flags ---------------------------------------------------------------------


def test_case_ids_and_header_params_unchanged_when_unset() -> None:
    from specparity.runners import case_params

    c = Case("llama", "twin", "nat-00", 3, 32)
    assert c.case_id == "llama/twin/nat-00/g3/n32"
    assert not {"kv_bits", "kv_group_size", "quantized_kv_start", "rotating"} & set(case_params(c))
    q = replace(c, kv_bits=4, kv_group_size=32, quantized_kv_start=0, rotating="exact")
    assert q.case_id == "llama/twin/nat-00/g3/n32/kv4g32s0/rot-exact"
    assert replace(c, kv_bits=8).case_id == "llama/twin/nat-00/g3/n32/kv8"
    assert q.plain().case_id == "llama/plain/nat-00/n32/kv4g32s0"  # rotating is a spec setting
    got = case_params(q)
    assert (got["kv_bits"], got["kv_group_size"], got["quantized_kv_start"], got["rotating"]) == (4, 32, 0, "exact")
    assert case_params(replace(c, kv_bits=8))["kv_group_size"] == 64  # mlx-lm's default, stated


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--kv-bits", "7", "must be one of 2, 3, 4, 5, 6, 8, got 7"),
    ("--kv-group-size", "16", "must be one of 32, 64, 128, got 16"),
    ("--quantized-kv-start", "-1", "must be >= 0"),
])
def test_bad_cache_flags_are_one_line_usage_errors(flag: str, value: str, message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cli import main

    for cmd in (["run"], ["bench"], ["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small"],
                ["generate", "--target", ".", "--prompt", "x"]):
        assert main([cmd[0], flag, value, *cmd[1:]]) == 2  # the flag parses first
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and flag in err[0], (cmd, err)


def test_group_or_start_without_bits_refused() -> None:
    from specparity.cli.kv_args import cache_fields

    ns = argparse.Namespace(kv_bits=None, kv_group_size=32, quantized_kv_start=None, rotating="guard")
    with pytest.raises(ValueError, match="need --kv-bits"):
        cache_fields(ns)
    ns = argparse.Namespace(kv_bits=4, kv_group_size=None, quantized_kv_start=0, rotating="exact")
    assert cache_fields(ns) == {"kv_bits": 4, "kv_group_size": None, "quantized_kv_start": 0, "rotating": "exact"}


def test_suite_keys(tmp_path: Path) -> None:
    from specparity.cases.suite import SuiteError, load_suite

    f = tmp_path / "s.toml"
    f.write_text('kv_bits = 4\nkv_group_size = 32\nquantized_kv_start = 0\nrotating = "exact"\n'
                 '[[pair]]\ntarget = "gemma3"\ndrafter = "twin"\n')
    (s,) = load_suite(f)
    assert (s.kv_bits, s.kv_group_size, s.quantized_kv_start, s.rotating) == (4, 32, 0, "exact")
    for bad, msg in (("kv_bits = 7", "pair 1.kv_bits: must be one of"),
                     ("kv_group_size = 48", "kv_group_size: must be one of"),
                     ('rotating = "wrap"', 'rotating: expected "guard" or "exact"'),
                     ("kv_group_size = 32", "need kv_bits")):
        f.write_text(f'[[pair]]\ntarget = "llama"\ndrafter = "twin"\n{bad}\n')
        with pytest.raises(SuiteError, match=msg):
            load_suite(f)


def test_zoo_head_dim_refused_before_running() -> None:
    from specparity.cli.kv_args import check_kv_models

    with pytest.raises(ValueError, match="head dim 16 is not a multiple"):
        check_kv_models([Case("llama", "twin", "nat-00", 3, 8, kv_bits=4, kv_group_size=32)])


# -- the engine ------------------------------------------------------------------------------------


@pytest.mark.parametrize("start", [0, 14, 16, 20])
def test_spec_equals_plain_under_quantized_kv(loaded: tuple[Any, Any], start: int) -> None:
    p = params(quantized_kv_start=start)
    s = spec(loaded, p)
    plain = plain_generate(loaded[0].model, list(PROMPT), p)
    assert s.output_ids == plain.output_ids, f"start {start}: spec {s.output_ids} vs plain {plain.output_ids}"
    offset, emitted, capped = len(PROMPT) - 1, 0, 0
    for r in (x for x in s.records if x["type"] == "round"):
        # no window straddles the threshold: all positions below it or all at/after it
        last = offset + len(r["drafts"])
        assert offset >= start or last < start, (r["index"], offset, last)
        if len(r["drafts"]) < min(p.gamma, p.max_tokens - emitted):  # cut: only to end below it
            assert last == start - 1, (r["index"], offset, last)
            capped += 1
        offset += r["k_accept"] + 1
        emitted += len(r["emitted"])
    assert (capped > 0) == (start > len(PROMPT) - 1), capped
    assert any(type(c).__name__ == "QuantizedKVCache" for c in _target_caches(loaded, p))


def _target_caches(loaded: tuple[Any, Any], p: GenerationParams) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(loaded[0].model)
    spec_generate(loaded[0].model, _provider(loaded), list(PROMPT), p, target_caches=caches)
    return caches


def _provider(loaded: tuple[Any, Any]) -> Any:
    from engine.sources.two_model import TwoModelProvider

    return TwoModelProvider(loaded[1].model)


def test_mlx_lm_order_of_conversion_is_caught(loaded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant mlx-lm's order (convert after the verify forward, before the trim; no window cap):
    spec differs from plain, and the token diff names the first differing output token."""
    import engine.executor as ex
    from engine.rollback import CacheRollback

    real = CacheRollback.rollback
    monkeypatch.setattr(ex.Request, "kv_cap", lambda self, n: n)

    def convert_first(self: CacheRollback, d: int, k: int) -> None:
        from engine import caches as cache_ops

        if cache_ops.quantize_kv(self.caches, cache_ops.KVQuantization(2, 32, 16)):
            self.__init__(self.model, self.caches, self.rotating)  # type: ignore[misc]
        real(self, d, k)

    monkeypatch.setattr(CacheRollback, "rollback", convert_first)
    p = params()
    s = spec(loaded, p)
    plain = plain_generate(loaded[0].model, list(PROMPT), p)
    assert s.output_ids != plain.output_ids, "the plant changed nothing"
    div = diff_traces(_trace(s, p), _trace(plain, p), level="tokens")
    assert div is not None and "output token" in div.where, div


def _trace(res: Any, p: GenerationParams, case_id: str = "kvllama/kvllama-twin/p/g3/n40") -> Trace:
    from traces.records import make_header

    header = make_header(
        runner={"name": "engine", "package": "specparity", "version": "0"}, mode="spec", source="two-model",
        case_id=case_id, target={"path": "t", "weights_sha256": "0" * 64, "config_sha256": "0" * 64},
        drafter=None, tokenizer_sha256=None,
        params={"gamma": p.gamma, "max_tokens": p.max_tokens, "temperature": 0.0, "top_p": 0.0, "top_k": 0,
                "min_p": 0.0, "seed": 0, "prefill": "tail-split", "prefill_step_size": 512,
                "confidence_threshold": None, "kv_bits": p.kv_bits, "kv_group_size": p.kv_group_size,
                "quantized_kv_start": p.quantized_kv_start},
        prompt_id="p", prompt_ids=list(PROMPT), eos_ids=[])
    return Trace.from_records([header, *res.records, res.footer()])


class _StateReadingSource:
    """A provider whose source has no ``set_kv_quantization`` (like the heads reading the target)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def open(self, sampler: Any, target: Any) -> Any:
        src = self.inner.open(sampler, target)
        return type("NoKV", (), {k: getattr(src, k) for k in (
            "prefill_mode", "tap_layers", "wants_anchor_hidden", "prefill", "draft", "commit",
            "cache_digest")})()


def test_source_without_hook_falls_back_recorded(loaded: tuple[Any, Any]) -> None:
    p = params(quantized_kv_start=0)
    s = spec(loaded, p, _StateReadingSource(_provider(loaded)))
    plain = plain_generate(loaded[0].model, list(PROMPT), p)
    steps = [r for r in s.records if r["type"] != "prefill"]
    assert steps and all(r["type"] == "plain" and r["reason"] == "quantized-kv" for r in steps)
    assert "quantized KV wins over speculation" in steps[0]["detail"]
    assert s.output_ids == plain.output_ids


def test_unrecorded_fallback_is_caught(loaded: tuple[Any, Any]) -> None:
    """The reference comparison reads the fallback from the trace: a fallback whose plain
    records do not say so is compared round for round and fails."""
    from specparity.runners import run_case
    from traces.reference import compare_with_reference

    p = params(quantized_kv_start=0)
    eng = _trace(spec(loaded, p, _StateReadingSource(_provider(loaded))), p)
    ref = Trace.from_records(run_case("mlx_lm", kv_case_for(loaded, p)))
    assert compare_with_reference(eng, ref, "mlx_lm").status == "identical"
    hidden = [dict(r, reason="baseline") if r["type"] == "plain" else r for r in eng.records()]
    for r in hidden:
        r.pop("detail", None)
    v = compare_with_reference(Trace.from_records(hidden), ref, "mlx_lm")
    assert v.status == "divergent", v.format()


def kv_case_for(loaded: tuple[Any, Any], p: GenerationParams) -> Case:
    return Case(target="kvllama", drafter="kvllama-twin", prompt_id="p", gamma=p.gamma,
                max_tokens=p.max_tokens, target_path=str(loaded[0].path), draft_path=str(loaded[1].path),
                prompt_tokens=PROMPT, eos_ids=(), kv_bits=p.kv_bits, kv_group_size=p.kv_group_size,
                quantized_kv_start=p.quantized_kv_start)


def test_quantized_target_rolled_back_short_is_caught(loaded: tuple[Any, Any], short_target_trim: None) -> None:
    """Plant: the (quantized) target trimmed one position too few; the diff against mlx-lm names
    the round."""
    from specparity.runners import run_case

    p = params(quantized_kv_start=0)
    eng = _trace(spec(loaded, p), p)
    ref = Trace.from_records(run_case("mlx_lm", kv_case_for(loaded, p)))
    div = diff_traces(eng, ref, level="round")
    assert div is not None and div.where.startswith("round "), div


# -- the known entry's signature -------------------------------------------------------------------


def test_kv_point_and_known_entry_signature(loaded: tuple[Any, Any]) -> None:
    from specparity.runners import run_case
    from traces.reference import compare_with_reference, kv_quantization_point

    p = params(quantized_kv_start=14)  # 11 drained: round 0's window (11..14) reaches 14
    eng = Trace.from_records(run_case("engine", kv_case_for(loaded, p)))
    ref = Trace.from_records(run_case("mlx_lm", kv_case_for(loaded, p)))
    assert kv_quantization_point(eng) == (0, 0)
    v = compare_with_reference(eng, ref, "mlx_lm")
    assert v.status == "known" and v.known is not None
    assert v.known.id == "mlx-lm-kv-quantized-on-unverified-offset"
    # converted after the prefill in both (start <= drained length): nothing to excuse
    assert kv_quantization_point(Trace.from_records(run_case("engine", kv_case_for(loaded, params(quantized_kv_start=5))))) is None
    # without kv_bits the signature never matches
    hdr = dict(eng.header, params={k: v for k, v in eng.header["params"].items() if not k.startswith(("kv_", "quantized"))})
    assert kv_quantization_point(Trace.from_records([hdr, *eng.records()[1:]])) is None


def test_planted_divergence_before_kv_point_still_fails(loaded: tuple[Any, Any]) -> None:
    from specparity.runners import run_case
    from traces.reference import compare_with_reference, kv_quantization_point

    p = params(quantized_kv_start=20)
    eng = Trace.from_records(run_case("engine", kv_case_for(loaded, p)))
    ref = Trace.from_records(run_case("mlx_lm", kv_case_for(loaded, p)))
    point = kv_quantization_point(eng)
    assert point is not None and point[0] >= 1
    recs = eng.records()
    first_round = next(i for i, r in enumerate(recs) if r["type"] == "round")
    recs[first_round] = dict(recs[first_round], feed=[*recs[first_round]["feed"], 7])  # round 0 < point
    v = compare_with_reference(Trace.from_records(recs), ref, "mlx_lm")
    assert v.status == "divergent" and v.divergence is not None and v.divergence.where == "round 0", v.format()


# -- the serial-replay audit over quantized caches -------------------------------------------------


def _audit(loaded: tuple[Any, Any], start: int) -> Any:
    from engine.audit import SerialReplayAudit

    audit = SerialReplayAudit(loaded[0].model)
    audit.prompt = "p"
    spec_generate(loaded[0].model, _provider(loaded), list(PROMPT),
                  params(quantized_kv_start=start, kv_bits=4, max_tokens=32, cache_digests=False),
                  observer=audit)
    return audit


@pytest.mark.parametrize("start", [0, 16])
def test_audit_rollback_exact_over_quantized_caches(loaded: tuple[Any, Any], start: int) -> None:
    audit = _audit(loaded, start)
    assert audit.windows and not audit.rollback_errors(), audit.rollback_errors()
    assert all(w.rollback_check is None or w.rollback_check.verdict == "exact" for w in audit.windows)


def test_audit_catches_quantized_short_trim(loaded: tuple[Any, Any], short_target_trim: None) -> None:
    errors = _audit(loaded, 0).rollback_errors()
    assert errors and "round" in errors[0], errors


def test_witness_replays_quantized_kv(loaded: tuple[Any, Any]) -> None:
    """The numerics witness replays a quantized-KV run with the conversion where the executor
    converts (after each prefill chunk, each round's rollback, each one-token forward): the run's
    own path reproduces its tokens, so a planted sample reads ``logic`` by the witness, naming
    the run whose token its path does not give."""
    from engine.witness import NumericsWitness

    p = params(quantized_kv_start=0)
    a = _trace(spec(loaded, p), p)
    recs = a.records()
    i = next(j for j, r in enumerate(recs) if r["type"] == "round" and r["k_accept"] < len(r["drafts"]))
    bad = dict(recs[i], samples=[*recs[i]["samples"][:-1], (recs[i]["samples"][-1] + 1) % 112])
    b = Trace.from_records([*recs[:i], bad, *recs[i + 1:]])
    div = diff_traces(a, b, level="round", witness=NumericsWitness.for_model(loaded[0].model))
    assert div is not None and div.basis == "witness" and div.klass == "logic", div
    assert "b round" in div.message and "its path gives" in div.message, div.message


def test_zoo_matrix_has_two_quantized_kv_cases_per_kv_pair() -> None:
    """Head dim 32 (``llama-kv``) and 64 (``llama-kv64``, the pair MLX's CUDA kernels take:
    docs/backends.md "Unsupported on this backend"), two cases each."""
    from specparity.jobs.run import zoo_cases

    kv = [c for c in zoo_cases(n_prompts=1) if c.kv_bits is not None]
    assert [c.case_id for c in kv] == ["llama-kv/twin/nat-00/g3/n32/kv4g32s0",
                                       "llama-kv/twin/nat-00/g3/n32/kv4g32s36",
                                       "llama-kv64/twin/nat-00/g3/n32/kv4g32s0",
                                       "llama-kv64/twin/nat-00/g3/n32/kv4g32s36"]
    assert not [c for c in zoo_cases(targets=["llama"], n_prompts=1) if c.kv_bits is not None]
    assert {c.target for c in zoo_cases(targets=["llama-kv"], n_prompts=1)} == {"llama-kv"}
    assert {c.target for c in zoo_cases(targets=["llama-kv64"], n_prompts=1)} == {"llama-kv64"}


def test_bench_and_ab_take_the_cache_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both arms of bench/ab run with the cache settings (quantize_kv converts something) and
    record them."""
    from engine import caches as cache_ops
    from specparity.measure.ab import run_ab
    from specparity.measure.bench import run_bench

    real, converted = cache_ops.quantize_kv, []

    def counting(caches: list[Any], q: Any, who: str = "target") -> bool:
        done = real(caches, q, who)
        converted.append(done)
        return done

    monkeypatch.setattr(cache_ops, "quantize_kv", counting)
    cache = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0, "rotating": "exact"}
    b = run_bench("llama-kv", "twin", gamma=3, n_prompts=1, max_tokens=8, repeats=1, cache=cache)
    assert b["cache"] == cache and b["engine_vs_mlx_lm_identical_outputs"] == "1/1" and any(converted)
    converted.clear()
    a = run_ab("llama-kv", "twin", "twin", gamma=3, n_prompts=2, max_tokens=8, allow_small=True, cache=cache)
    assert a["cache"] == cache and any(converted)


def test_run_flags_set_the_zoo_matrix_cases() -> None:
    from specparity.cli.entry import build_parser
    from specparity.commands.run import cases_from_args

    args = build_parser().parse_args(["run", "--targets", "gemma3", "--drafters", "twin", "--gammas", "3",
                                      "--prompts", "1", "--rotating", "exact"])
    cases = [c for c in cases_from_args(args) if not c.grammar]  # grammar cases: tests/test_grammar_walk.py
    assert [c.case_id for c in cases] == ["gemma3/twin/nat-00/g3/n32/rot-exact"]
    args = build_parser().parse_args(["run", "--targets", "llama-kv", "--prompts", "1", "--kv-bits", "8",
                                      "--kv-group-size", "32"])
    assert [c.case_id for c in cases_from_args(args)] == ["llama-kv/twin/nat-00/g3/n32/kv8g32"]


def test_grade_checks_cache_params_in_headers() -> None:
    from specparity.grading.trace_folders import header_problems

    base = {"mode": "spec", "source": "two-model", "eos_ids": [1], "prompt": {"token_ids": [1, 2]},
            "params": {"gamma": 3, "max_tokens": 8, "temperature": 0.0, "top_p": 0.0, "top_k": 0, "seed": 0}}
    assert not header_problems(base)
    ok = dict(base, params={**base["params"], "kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0,
                            "rotating": "exact", "sliding_window": 32})
    assert not header_problems(ok)
    for key, bad in (("kv_bits", 7), ("kv_group_size", 16), ("quantized_kv_start", -1), ("rotating", "wrap")):
        got = header_problems(dict(ok, params={**ok["params"], key: bad}))
        assert [f for f, _ in got] == [f"header.params.{key}"], got
