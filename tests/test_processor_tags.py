"""The logits-processor tag (``engine.sampler.ProcessorParams.tag``/``parse``): every finite
number round-trips, and a processor given twice is refused like any duplicate flag.

The tag is the case-id and suite form of the processors; it joins its parts with ``+``, so a
number printed as ``1e+20`` split into two bad parts (``--presence-penalty 1e20`` was refused
as ``bad logits-processor part 'pp1e'``), and ``:g`` cut ``12345678901234567890`` to six digits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.sampler import ProcessorParams, tag_number
from tests.helpers import cli, read_records, refused

FINITE = st.floats(allow_nan=False, allow_infinity=False)


@given(FINITE)
def test_tag_number_round_trips_every_finite_float(v: float) -> None:
    text = tag_number(v)
    assert float(text) == v and "+" not in text and "c" not in text and "," not in text


@given(rp=st.none() | FINITE.filter(lambda v: v >= 0), pp=st.none() | FINITE, fp=st.none() | FINITE,
       ctx=st.integers(1, 4096),
       bias=st.dictionaries(st.integers(0, 1 << 20), FINITE, max_size=4),
       history=st.sampled_from(["full", "last"]))
def test_tag_round_trips_every_finite_setting(rp: float | None, pp: float | None, fp: float | None,
                                              ctx: int, bias: dict[int, float], history: str) -> None:
    p = ProcessorParams(logit_bias=tuple(bias.items()), repetition_penalty=rp, repetition_context_size=ctx,
                        presence_penalty=pp, presence_context_size=ctx, frequency_penalty=fp,
                        frequency_context_size=ctx, history_prompt=history)
    if not p.active:
        assert p.tag() == ""
        return
    back = ProcessorParams.parse(p.tag())
    assert back.tag() == p.tag()
    assert _built(back) == _built(p)


def _built(p: ProcessorParams) -> dict[str, object]:
    """What ``make_logits_processors`` builds from these settings (a 0 or None penalty: none)."""
    kw = p.kwargs()
    out: dict[str, object] = {"logit_bias": kw["logit_bias"], "history": p.history_prompt}
    for name in ("repetition", "presence", "frequency"):
        if kw[f"{name}_penalty"]:
            out[name] = (kw[f"{name}_penalty"], kw[f"{name}_context_size"])
    return out


def test_goldens_tags_keep_their_text() -> None:
    """Values that ``:g`` prints exactly keep that text (the goldens' case ids do not move)."""
    for tag in ("rp1.3c64+hlast", "pp0.5c20+fp1c64+lb5=1.5,7=-2+hlast", "fp-1c8", "rp1.5c20"):
        assert ProcessorParams.parse(tag).tag() == tag
    assert ProcessorParams(presence_penalty=1e20).tag() == "pp1e20c20"
    assert ProcessorParams(repetition_penalty=12345678901234567890.0).tag() == "rp1.2345678901234567e19c20"


@pytest.mark.parametrize("tag", ["rp1.2+rp1.3", "lb5=1+lb6=2", "pp1c4+fp1+pp2", "rp1+hlast+hfull"])
def test_a_processor_given_twice_is_refused(tag: str) -> None:
    with pytest.raises(ValueError, match="given twice") as exc:
        ProcessorParams.parse(tag)
    assert tag in str(exc.value) and "\n" not in str(exc.value)


def test_a_suite_with_a_processor_twice_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "s.toml"
    f.write_text('gammas = [1]\nmax_tokens = 4\nzoo_prompts = 1\n'
                 'sampling = [{temperature = 0.0, processors = "rp1.2+rp1.3"}]\n'
                 '[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    out = tmp_path / "run"
    rc, _, err = cli(["run", "--suite", f, "--out", out], capsys)
    refused(rc, err, "processors", "given twice", "rp1.2+rp1.3")
    assert not out.exists()


@pytest.mark.parametrize("flags, key, want", [
    (["--presence-penalty", "1e20"], "presence_penalty", 1e20),
    (["--logit-bias", "5=1e300"], "logit_bias", {"5": 1e300}),
    (["--repetition-penalty", "12345678901234567890"], "repetition_penalty", 12345678901234567890.0),
])
def test_huge_finite_processor_values_run_and_grade(flags: list[str], key: str, want: object,
                                                    zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A finite value is never refused for its case id; the trace it writes is graded again
    (its header's value parsed back exactly, the re-run the same case)."""
    trace = tmp_path / "t" / "one.jsonl"
    rc, _, err = cli(["generate", "--target", zoo_pair[0], "--prompt-ids", "5,6,7", "-n", "3", *flags,
                      "--trace", trace], capsys)
    assert rc == 0, err
    assert "bad logits-processor" not in err
    header = read_records(trace)[0]
    got = json.dumps(header["params"])
    assert key in got or "logits_processors" in got, got
    from specparity.grading.trace_folders import case_from_header

    case = case_from_header(header, trace, trace.parent)
    kw = ProcessorParams.parse(case.processors).kwargs()
    have = kw[key] if key != "logit_bias" else {str(k): v for k, v in kw[key].items()}
    assert have == want and all(math.isfinite(v) for v in (kw["logit_bias"] or {}).values())
    rc, _, err = cli(["grade", trace.parent, "--runners", "", "--out", tmp_path / "graded"], capsys)
    assert rc in (0, 1) and "bad logits-processor" not in err and "Traceback" not in err, err


def test_huge_finite_logit_bias_in_a_suite_is_accepted(tmp_path: Path) -> None:
    from specparity.cases.suite import load_suite, suite_cases

    f = tmp_path / "s.toml"
    f.write_text('gammas = [1]\nmax_tokens = 4\nzoo_prompts = 1\n'
                 'sampling = [{temperature = 0.0, processors = "lb5=1e300+pp1e20"}]\n'
                 '[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    (case, *_), = [suite_cases(load_suite(f))]
    assert ProcessorParams.parse(case.processors).kwargs()["logit_bias"] == {5: 1e300}
