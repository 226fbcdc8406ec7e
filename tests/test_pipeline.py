"""The sampling pipeline (``engine/pipeline.py``): one declared object every lane and the witness call.

- **the declaration**: every ``SamplerParams`` field round-trips through the trace header
  (``header_params`` / ``params_from_header``), so the witness's replay of a run cannot lose a
  stage; a header that drops one is caught;
- **sampler side state after a rejection** (spec ≡ plain, CPU exact): min_tokens counted per
  output position (a verify row is its own position), logits processors on the emitted history,
  and seeded sampling with a key per (seed, output position) — the draws of a rejected round are
  rewound to the emitted boundary; a plant of each (min_tokens counted per step, a draw keyed by
  the round instead of the position) is caught naming the round;
- **the witness through the pipeline, on the CPU non-exact double** (``engine/nonexact.py``): a
  grammar knife-edge flip (the H200's ``qwen35/twin/json-00/gN/n32/gr-regex-sentence`` class) is
  ``numerics`` with its margin between the candidates the grammar allowed, where the unmasked
  replay called it ``logic``; a planted constrained-walk bug (the mask of the previous position)
  still reads ``logic`` there; quantized-KV and position-keyed sampled flips are ``numerics``
  with evidence.

Reference: mlx-lm 0.32.2 ``mlx_lm/generate.py`` (``generate_step._step``,
``speculative_generate_step._process_and_sample``), vLLM 0.11 ``SamplingParams.min_tokens``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from engine.nonexact import emulate_nonexact, exact
from engine.params import header_params, params_from_header, sampler_from_header
from engine.pipeline import SamplingPipeline
from engine.sampler import ProcessorParams, SamplerParams
from specparity.cases.case import Case
from specparity.runners import case_paths, load_model, numerics_witness, run_case
from traces.diff import diff_traces
from traces.io import Trace


def _trace(case: Case) -> Trace:
    return Trace.from_records(run_case("engine", case))


@pytest.fixture(scope="module")
def witness() -> Any:
    return numerics_witness()


# ------------------------------------------------------------------ the declaration

# A non-default value of every SamplerParams field (a new field fails the coverage check
# below until it is added here, to header_params and to sampler_from_header).
_PLANTED = {
    "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
    "repetition_penalty": None,  # the shorthand: recorded as the processors it stands for
    "processors": ProcessorParams(logit_bias=((5, 1.5),), repetition_penalty=1.3, repetition_context_size=8,
                                  presence_penalty=0.5, frequency_penalty=0.2, history_prompt="last"),
    "min_tokens": 6, "rng": "position",
}


def _round_trip(sp: SamplerParams, seed: int | None = 7) -> SamplerParams:
    core, extra = header_params(sp, seed)
    return sampler_from_header({**core, **extra})


def test_every_sampler_field_is_declared_in_the_header() -> None:
    names = {f.name for f in dataclasses.fields(SamplerParams)}
    assert names == set(_PLANTED), f"SamplerParams fields without a header round trip: {names ^ set(_PLANTED)}"
    full = SamplerParams(**{k: v for k, v in _PLANTED.items() if v is not None})
    assert _round_trip(full) == full
    for name, value in _PLANTED.items():  # each stage alone
        if value is None:
            continue
        one = SamplerParams(**{name: value})
        assert _round_trip(one) == one, name
    short = SamplerParams(repetition_penalty=1.2)  # the shorthand is recorded as what it applies
    assert _round_trip(short).effective_processors == short.effective_processors


@pytest.mark.parametrize("dropped", ["min_tokens", "rng", "logits_processors", "top_k"])
def test_a_header_that_drops_a_stage_is_caught(dropped: str) -> None:
    full = SamplerParams(**{k: v for k, v in _PLANTED.items() if v is not None})
    core, extra = header_params(full, 7)
    header = {k: v for k, v in {**core, **extra}.items() if k != dropped}
    assert sampler_from_header(header) != full, dropped


def test_params_from_header_rebuilds_the_run_pipeline() -> None:
    sp = SamplerParams(temperature=0.5, min_tokens=3, rng="position",
                       processors=ProcessorParams(frequency_penalty=0.4))
    core, extra = header_params(sp, 11)
    header = {"params": {"max_tokens": 9, **core, **extra}, "eos_ids": [2, 7], "prompt": {"token_ids": [4, 5]}}
    p = params_from_header(header)
    assert (p.sampler, p.seed, p.eos_ids, p.max_tokens) == (sp, 11, (2, 7), 9)
    pipe = SamplingPipeline(p, [4, 5], seed_stream=False)
    assert pipe.positional and pipe.min_tokens == 3 and pipe.history is not None


def test_defaults_add_no_header_keys() -> None:
    """Existing traces keep their bytes: a default pipeline writes exactly the old keys."""
    core, extra = header_params(SamplerParams(), 0)
    assert list(core) == ["temperature", "top_p", "top_k", "min_p", "seed"] and extra == {}


def test_bad_sampler_settings_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="min_tokens must be >= 0"):
        SamplerParams(min_tokens=-1)
    with pytest.raises(ValueError, match="rng must be 'stream' or 'position'"):
        SamplerParams(rng="global")


# ------------------------------------------------------------------ side state after a rejection

def _eos_case(gamma: int, min_tokens: int) -> Case:
    """llama/twin nat-00 with its 14th plain token made an EOS id: the turn would end at 13;
    with min_tokens 15 the EOS is suppressed there and drawn again at 17."""
    early = _trace(Case("llama", None, "nat-00", 0, 40)).footer["output_ids"][13]
    return Case("llama", "twin", "nat-00", gamma, 40, eos_ids=(early,), min_tokens=min_tokens)


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_min_tokens_spec_equals_plain(gamma: int) -> None:
    case = _eos_case(gamma, 15)
    spec, plain = _trace(case), _trace(case.plain())
    assert diff_traces(spec, plain, level="tokens") is None
    out = plain.footer["output_ids"]
    free = _trace(_eos_case(gamma, 0).plain()).footer["output_ids"]
    assert len(free) == 13 and len(out) > 15, (free, out)  # the suppression acted, then EOS came
    assert plain.footer["usage"]["finish_reason"] == "stop"
    assert spec.rounds and any(len(r["emitted"]) > 1 for r in spec.rounds)  # windows emit several


def test_min_tokens_counted_per_step_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: the generated count moves by one per step (a verify round emitting several
    tokens counts once), so EOS stays suppressed past min_tokens under speculation."""
    real = SamplingPipeline.advance

    def per_step(self: SamplingPipeline, tokens: Any, **kw: Any) -> None:
        before = self.generated
        real(self, tokens, **kw)
        if tokens:
            self.generated = before + 1

    case = _eos_case(3, 15)
    plain = _trace(case.plain())
    monkeypatch.setattr(SamplingPipeline, "advance", per_step)
    bad = _trace(case)
    monkeypatch.undo()
    div = diff_traces(bad, plain, level="tokens")
    assert div is not None, "min_tokens counted per step went unnoticed"
    assert "round" in div.message, div.message


SAMPLED = [Case("llama", "twin", p, g, 32, temperature=0.8, seed=s, rng="position")
           for p, g, s in (("nat-00", 3, 0), ("nat-07", 3, 3), ("rnd-00", 1, 1), ("nat-02", 5, 2))]
SAMPLED += [Case("llama", "small", "nat-01", 3, 32, temperature=0.9, top_p=0.9, seed=4, rng="position"),
            Case("llama", "ngram", "nat-02", 3, 32, source="ngram", temperature=0.8, seed=5, rng="position"),
            Case("llama", "twin", "nat-03", 3, 32, temperature=0.8, seed=6, rng="position",
                 processors="rp1.3c16+pp0.4c16+fp0.2c16+lb5=1.5", min_tokens=4)]


@pytest.mark.parametrize("case", SAMPLED, ids=lambda c: c.case_id)
def test_seeded_sampling_with_position_keys_spec_equals_plain(case: Case) -> None:
    """The draw at output position p is keyed by (seed, p): a rejected round's draws are
    rewound to the emitted boundary, so sampled speculative output IS plain decode's."""
    spec, plain = _trace(case), _trace(case.plain())
    assert spec.rounds and any(r["k_accept"] < len(r["drafts"]) for r in spec.rounds), "no rejection"
    div = diff_traces(spec, plain, level="tokens")
    assert div is None, div.message


def test_a_draw_keyed_by_the_round_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant: every row of a verify window drawn with the round's first key (the RNG offset
    not advanced per position inside a window)."""
    real = SamplingPipeline.draw
    monkeypatch.setattr(SamplingPipeline, "draw", lambda self, lp, position: real(self, lp, self.generated))
    case = SAMPLED[0]
    bad = _trace(case)
    monkeypatch.undo()
    div = diff_traces(bad, _trace(case.plain()), level="tokens")
    assert div is not None and "round" in div.message, "a draw keyed per round went unnoticed"


# ------------------------------------------------------------------ the witness through the pipeline


@pytest.fixture
def double() -> Iterator[Any]:
    """The non-exact CPU double on the models a case loads (undone after the test)."""
    wrapped: list[Any] = []

    def wrap(case: Case, scale: float) -> None:
        for p in case_paths(case):
            if p is not None:
                m = load_model(str(p)).model
                emulate_nonexact(m, scale)
                wrapped.append(m)

    yield wrap
    for m in wrapped:
        exact(m)



def _grammar_flip_case() -> Case:
    from specparity.jobs.run import grammar_cases

    return next(c for c in grammar_cases(gammas=(3,), max_tokens=32)
                if c.case_id == "qwen35/twin/json-00/g3/n32/gr-regex-sentence")


def test_grammar_knife_edge_flip_is_numerics_between_allowed_candidates(double: Any, witness: Any) -> None:
    """The H200's class: the run's recorded (unmasked) margin is ~1.8, the two tokens the grammar
    allowed differ by ~0.03. Replayed without the mask (before the pipeline) this read
    ``logic``: 'sampled 73 but its path gives 115' (115 is not allowed there)."""
    case = _grammar_flip_case()
    double(case, 5e-2)
    spec, plain = _trace(case), _trace(case.plain())
    div = diff_traces(spec, plain, level="tokens", witness=witness)
    assert div is not None, "the double flipped nothing"
    assert (div.klass, div.basis) == ("numerics", "witness"), div.message
    paths = div.witness.data["paths"]  # type: ignore[union-attr]
    assert all(p["reproduced"] for p in paths[:2]) and "grammar mask" in paths[0]["path"], div.message
    assert all(p["margin"] < 0.1 < (p["recorded_margin"] or 0) for p in paths[:2]), paths


def test_planted_stale_mask_stays_logic_under_the_double(double: Any, witness: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A constrained-walk bug (each row masked with the previous position's state) is not
    excused as arithmetic on a non-exact backend."""
    from engine import grammar as eg
    from tests.test_grammar_walk import PLANTS, _planted

    case = PLANTS["stale-mask"]
    double(case, 1e-2)
    plain = _trace(case.plain())
    monkeypatch.setattr(eg, "constrained_walk", _planted("stale-mask"))
    bad = _trace(case)
    div = diff_traces(bad, plain, level="tokens", witness=witness)
    assert div is not None, "the planted walk bug went unnoticed"
    assert div.klass == "logic", div.message
    assert div.basis in ("witness", "structural"), div.message


def test_quantized_kv_flip_is_numerics_under_the_double(double: Any, witness: Any) -> None:
    import zoo

    case = Case(zoo.KV_TARGET, "twin", "nat-08", 3, 32, kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    double(case, 1e-2)
    div = diff_traces(_trace(case), _trace(case.plain()), level="tokens", witness=witness)
    assert div is not None, "the double flipped nothing"
    assert (div.klass, div.basis) == ("numerics", "witness"), div.message


def test_position_keyed_sampled_flip_is_numerics_under_the_double(double: Any, witness: Any) -> None:
    """Both paths draw with the same key at the contested position; each reproduces its own
    token from its own row: arithmetic, with the evidence."""
    case = Case("llama", "twin", "nat-08", 1, 32, temperature=0.8, seed=3, rng="position")
    double(case, 1e-2)
    spec, plain = _trace(case), _trace(case.plain())
    div = diff_traces(spec, plain, level="tokens", witness=witness)
    assert div is not None, "the double flipped nothing"
    assert (div.klass, div.basis) == ("numerics", "witness"), div.message
    assert "keyed by (seed 3, position)" in div.message
    # a planted token no path draws is logic
    recs = spec.records()
    i = next(j for j, r in enumerate(recs) if r["type"] == "round" and r["emitted"])
    t = recs[i]["emitted"][0]
    bad_rec = dict(recs[i], emitted=[(t + 1) % 512, *recs[i]["emitted"][1:]],
                   samples=[(t + 1) % 512, *recs[i]["samples"][1:]])
    out = list(spec.footer["output_ids"])
    pos = sum(len(r.get("emitted") or []) for r in recs[1:i])
    out[pos] = (t + 1) % 512
    footer = dict(recs[-1], output_ids=out)
    bad = Trace.from_records([*recs[:i], bad_rec, *recs[i + 1:-1], footer])
    div = diff_traces(bad, plain, level="tokens", witness=witness)
    assert div is not None and div.klass == "logic", div


def test_grade_reruns_a_trace_under_its_recorded_pipeline(tmp_path: Any) -> None:
    """``grade`` rebuilds the case from the header (``case_from_header``): min_tokens, the RNG
    mode and min-p come back, so a re-run draws what the run drew (min-p was dropped before)."""
    from pathlib import Path

    from specparity.grading.trace_folders import case_from_header

    case = Case("llama", "twin", "nat-00", 3, 16, temperature=0.8, seed=2, rng="position", min_tokens=5,
                processors="fp0.3c8", min_p=0.2)
    records = run_case("engine", case)
    back = case_from_header(records[0], Path(tmp_path) / "t.jsonl", Path(tmp_path))
    assert (back.min_tokens, back.rng, back.processors, back.temperature, back.seed, back.min_p) == (
        5, "position", "fp0.3c8", 0.8, 2, 0.2)
    def body(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in ("time_s", "wall_s")} for r in recs[1:]]

    assert body(run_case("engine", back)) == body(records)


def test_the_cli_takes_min_tokens_and_rng(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from specparity.cli import main

    rc = main(["run", "--targets", "llama", "--drafters", "twin", "--prompts", "1", "--gammas", "3",
               "--max-tokens", "8", "--temps", "0.8", "--rng", "position", "--min-tokens", "2", "--runners", "",
               "--quiet", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "rng-position" in (tmp_path / "out" / "comparisons.json").read_text()
    assert main(["run", "--rng", "global", "--out", str(tmp_path / "o2")]) == 2
    assert "--rng" in capsys.readouterr().err


def test_the_zoo_matrix_compares_sampler_side_state_with_plain(tmp_path: Any) -> None:
    """The default matrix carries the side-state cases (processors, min_tokens, position-keyed
    sampling on a KV, a rotating and a recurrent target) and compares each with plain decode,
    the sampled ones too (their draws are keyed per position)."""
    from specparity.jobs.run import run_cases, side_state_cases, zoo_cases

    side = side_state_cases()
    assert set(side) <= set(zoo_cases())
    assert {c.target for c in side} == {"llama", "gemma3", "qwen35"} and any(c.temperature for c in side)
    picked = [c for c in side if c.target == "qwen35" and c.prompt_id == "nat-00"]
    res = run_cases(tmp_path / "out", cases=picked, runners=["engine"], progress=False)
    kinds = {(c.kind, c.case_id) for c in res.comparisons}
    assert {("spec-vs-plain", c.case_id) for c in picked} <= kinds, kinds
    assert res.ok, [c.message for c in res.comparisons if c.fails]


def test_min_tokens_blocks_exactly_the_positions_before_it() -> None:
    """Stage 2 on its own: with min_tokens 3, rows at output positions 1 and 2 have EOS at -inf,
    rows at 3, 4, 5 do not; other ids are untouched."""
    import math

    import mlx.core as mx

    from engine.executor import GenerationParams

    pipe = SamplingPipeline(GenerationParams(eos_ids=(1,), sampler=SamplerParams(min_tokens=3)), [4, 5],
                            seed_stream=False)
    rows = mx.zeros((5, 8))
    out = pipe.min_tokens_block(rows, 1).tolist()
    assert [math.isinf(r[1]) for r in out] == [True, True, False, False, False], out
    assert all(v == 0 for r in out for i, v in enumerate(r) if i != 1)
