"""A source kind is one module (issue 34): every kind table is derived from the descriptors.

- Each ``engine/sources/<kind>.py`` exports ``SOURCE`` (``engine.sources.kind.SourceKind``)
  and its source's ``prefill_mode`` is the descriptor's.
- A toy kind declared in-process (``engine.sources.kind.registered``) appears in every
  derived table and choice list (the roster, block drafters, detection, the prompt-cache
  reuse tables, the engine runner's declared sources, ``--source``'s choices and help,
  drafter labels) and runs through ``run_case`` end to end: adding a kind touches its
  module, a zoo builder (here: none, it is model-free) and one test table.
- A trace header's ``params.prefill`` is the convention the run used: for every kind the
  prefill record's ``target_tokens`` holds the whole prompt under ``full`` and all but its
  last token under ``tail-split`` (the dspark header said ``tail-split`` for a full
  prefill before); a planted header lie is caught with the first mismatch named.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine.seam import PrefillMode
from engine.sources import kind as kinds
from engine.sources.kind import OpenOptions, SourceKind
from engine.sources.ngram import NgramProvider, NgramSource
from specparity.cases.case import Case
from tests.test_registry import SOURCE_CASES


def header_prefill_problem(records: list[dict[str, Any]]) -> str | None:
    """Why a trace's header ``params.prefill`` misstates its prefill record (None: it does not).

    ``full``: the target prefilled every prompt token; ``tail-split``: all but the last
    (which heads the first verify window)."""
    header = records[0]
    pre = next((r for r in records if r["type"] == "prefill"), None)
    if pre is None:
        return f"{header['case_id']}: no prefill record"
    n = len(header["prompt"]["token_ids"])
    mode = header["params"]["prefill"]
    want = {"full": n, "tail-split": n - 1}.get(mode)
    got = len(pre["target_tokens"])
    if want != got:
        return (f"{header['case_id']}: header params.prefill {mode!r} means {want} target prefill "
                f"tokens of the {n}-token prompt, the prefill record has {got}")
    return None


# ---------------------------------------------------------------- the declared kinds


def test_every_kind_is_one_module_with_a_consistent_descriptor() -> None:
    import importlib

    from engine.sources import KINDS

    assert KINDS == kinds.names() and len(set(KINDS)) == len(KINDS)
    for desc in kinds.all_kinds():
        mod = importlib.import_module(f"engine.sources.{desc.name.replace('-', '_')}")
        assert mod.SOURCE is desc, desc.name  # the module IS the kind
        assert getattr(mod, "PREFILL", None) == desc.prefill, desc.name
        assert getattr(desc.provider, "kind", None) == desc.name, desc.name
    # §3 detection order as written in the reference (engine/sources/detect.py docstring)
    ranked = [k.name for k in sorted((k for k in kinds.all_kinds() if k.detect), key=lambda k: k.detect_rank)]
    assert ranked == ["dspark", "deepspec", "assistant", "mtp", "native-mtp"]
    assert [k.name for k in kinds.all_kinds() if k.detect_fallback] == ["two-model"]


@pytest.mark.parametrize("source", [s for s in SOURCE_CASES if s != "plain"])
def test_opened_source_prefill_is_the_descriptor(source: str) -> None:
    """The source the kind opens has the descriptor's ``prefill_mode`` (what the executor reads)."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.sampler import SamplerParams, StepSampler
    from engine.seam import TargetView
    from specparity.runners import case_paths, load_model, open_for_case

    case = SOURCE_CASES[source]
    target = load_model(str(case_paths(case)[0]))
    src = open_for_case(case, target)
    opened = src.make().open(StepSampler(SamplerParams()), TargetView(target.model, make_prompt_cache(target.model)))
    assert opened.prefill_mode == src.kind.prefill == src.prefill, (source, opened.prefill_mode, src.prefill)


@pytest.mark.parametrize("source", list(SOURCE_CASES))
def test_header_prefill_matches_the_prefill_record(source: str) -> None:
    """For every kind (and plain decode) the header says how the target really prefilled."""
    from specparity.runners import run_case

    recs = run_case("engine", SOURCE_CASES[source])
    assert header_prefill_problem(recs) is None, header_prefill_problem(recs)
    if source != "plain":
        assert recs[0]["params"]["prefill"] == kinds.get(source).prefill


def test_dspark_header_says_full() -> None:
    """The issue's example: an engine dspark trace's header said tail-split over a full prefill."""
    from specparity.runners import run_case

    recs = run_case("engine", SOURCE_CASES["dspark"])
    pre = next(r for r in recs if r["type"] == "prefill")
    assert recs[0]["params"]["prefill"] == "full"
    assert len(pre["target_tokens"]) == len(recs[0]["prompt"]["token_ids"])


def test_a_planted_header_lie_is_caught() -> None:
    from specparity.runners import run_case

    recs = run_case("engine", SOURCE_CASES["dspark"])
    lie = [json.loads(json.dumps(r)) for r in recs]
    lie[0]["params"]["prefill"] = "tail-split"
    why = header_prefill_problem(lie)
    n = len(recs[0]["prompt"]["token_ids"])
    assert why is not None and "'tail-split'" in why and f"the prefill record has {n}" in why, why
    assert SOURCE_CASES["dspark"].case_id in why


# ---------------------------------------------------------------- a toy kind, declared in-process


class ToySource(NgramSource):
    """The ngram source under full prefill: a different kind as far as the harness can tell."""

    prefill_mode: PrefillMode = "full"


class ToyProvider(NgramProvider):
    kind = "toy"

    def open(self, sampler: Any, target: Any) -> ToySource:
        return ToySource(self.ngram_max, self.ngram_min)


def _toy_open(draft_dir: Path | None, opts: OpenOptions) -> ToyProvider:
    return ToyProvider(gamma=opts.gamma, ngram_max=opts.ngram_max, ngram_min=opts.ngram_min)


TOY = SourceKind(name="toy", provider=ToyProvider, open=_toy_open, prefill="full", reuse="reread", roster=99,
                 takes_dir=False, options=frozenset({"ngram"}), hint="a toy model-free kind")


def _toy_dir_kind(tmp: Path) -> SourceKind:
    """A toy kind with an artifact: ``toy.json`` detected first, γ pinned to its ``block``."""
    (tmp / "toy.json").write_text(json.dumps({"block": 5}))
    return SourceKind(
        name="toy-dir", provider=ToyProvider, open=_toy_open, prefill="full", reuse="tapped", roster=98,
        detect=lambda d, cfg: (d / "toy.json").is_file(), detect_rank=-1,
        pinned_gamma=lambda d: int(kinds.read_json(d / "toy.json")["block"]),
        options=frozenset({"confidence_threshold"}), threshold_default=0.25)


def test_a_toy_kind_appears_in_every_derived_table(tmp_path: Path) -> None:
    import engine.prompt_cache as pc
    import engine.sources as es
    from engine.sources.detect import DraftKindError, detect_kind, resolve_kind
    from specparity.cases.case import drafter_label
    from specparity.cli import args as a
    from specparity.cli.entry import build_parser
    from specparity.runners import registry

    art = tmp_path / "art"
    art.mkdir()
    before = es.KINDS
    with kinds.registered(TOY), kinds.registered(_toy_dir_kind(art)):
        assert es.KINDS == (*before, "toy-dir", "toy")  # roster order
        assert "toy-dir" in es.PINNED_GAMMA and "toy" not in es.PINNED_GAMMA
        assert isinstance(es.make_provider("toy", gamma=2), ToyProvider)
        assert pc.REREAD_SOURCES[-1] == "toy" and "toy-dir" in pc.TAPPED_SOURCES
        assert {"toy", "toy-dir"} <= set(pc.FULL_PREFILL)
        assert pc.reuse_family("toy") == "reread"
        assert detect_kind(art) == "toy-dir"  # detected first (rank -1), before dspark.json
        assert resolve_kind("toy", None) == "toy"
        with pytest.raises(DraftKindError, match="toy source is model-free"):
            resolve_kind("toy", art)
        with pytest.raises(DraftKindError, match="--source ngram or --source toy"):
            resolve_kind(None, None)
        assert {"toy", "toy-dir"} <= set(registry.get("engine").sources)
        assert a.source("toy") == "toy" and "toy" in a.source_names()
        gen = build_parser()._subparsers._group_actions[0].choices["generate"]  # type: ignore[union-attr]
        assert "toy (a toy model-free kind)" in " ".join(gen.format_help().split())
        assert drafter_label("toy", None) == "toy"
        assert drafter_label("toy-dir", art).startswith("toy-dir-art-") and drafter_label("toy-dir", art).endswith("-t0.25")
        provider, gamma = es.open_drafter("toy-dir", art, gamma=3)
        assert isinstance(provider, ToyProvider) and gamma == 3  # provider has gamma 3: pinned reads it
    assert es.KINDS == before and "toy" not in registry.get("engine").sources


def test_a_toy_kind_runs_end_to_end() -> None:
    """Through run_case: the engine runner opens it by its descriptor and the header says full."""
    from specparity.runners import run_case

    case = Case("llama", "toy", "rnd-00", 2, 12, source="toy")
    with kinds.registered(TOY):
        recs = run_case("engine", case)
    header = recs[0]
    assert header["source"] == "toy" and header["params"]["prefill"] == "full"
    assert any(r["type"] == "round" for r in recs)
    assert header_prefill_problem(recs) is None, header_prefill_problem(recs)
    ngram = run_case("engine", replace(SOURCE_CASES["ngram"]))
    assert ngram[0]["params"]["prefill"] == "tail-split" and header_prefill_problem(ngram) is None


def _zoo_pair(kind: str) -> tuple[Path, Path]:
    import zoo

    if kind == "dspark":
        from zoo.dspark import artifact_dir

        return zoo.model_dir("qwen3"), artifact_dir("qwen3-dspark")
    return zoo.pair("qwen3", "twin")


@pytest.mark.parametrize("kind", ["two-model", "dspark"])
def test_generate_trace_header_is_record_s(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``generate --trace`` and ``record --runner engine`` write one header (one builder:
    runner version from the package, prefill from the run's decision) and the same run."""
    from specparity.cli import main
    from specparity.runners import registry
    from traces.io import read_trace

    tdir, ddir = _zoo_pair(kind)
    common = ["--target", str(tdir), "--draft", str(ddir), "--source", kind, "--prompt-ids", "5,6,7,8,9,10",
              "-n", "6", "--gamma", "2"]
    assert main(["generate", *common, "--trace", str(tmp_path / "g.jsonl")]) == 0
    assert main(["record", *common, "--runner", "engine", "--trace", str(tmp_path / "r.jsonl")]) == 0
    capsys.readouterr()
    g, r = read_trace(tmp_path / "g.jsonl"), read_trace(tmp_path / "r.jsonl")
    g.header.pop("platform", None), r.header.pop("platform", None)
    assert g.header == r.header, {k: (g.header[k], r.header.get(k)) for k in g.header if g.header[k] != r.header.get(k)}
    assert g.header["runner"] == {**registry.get("engine").runner_info(), "commit": None}  # no literal
    assert g.header["params"]["prefill"] == kinds.get(kind).prefill
    assert g.prefill is not None and header_prefill_problem([g.header, g.prefill]) is None
    assert [x["emitted"] for x in g.events] == [x["emitted"] for x in r.events]
    if kind == "dspark":  # γ pinned to the checkpoint's block in the case, as generate runs it
        assert g.header["params"]["gamma"] == 4 and "/g4/" in g.header["case_id"]
        assert g.header["params"]["confidence_threshold"] is None  # the checkpoint's thresholds


def test_drafter_labels_round_trip_the_threshold(tmp_path: Path) -> None:
    """A path case's drafter label carries exactly the threshold the run uses (None: the
    checkpoint's own, dspark) and dspark_drafter reads it back; deepspec's default is 0."""
    from specparity.cases.case import drafter_label
    from specparity.runners import dspark_drafter

    tdir, ddir = _zoo_pair("dspark")

    def back(kind: str, label: str) -> float | None:
        return dspark_drafter(Case("t", label, "p", 4, 4, source=kind, target_path=str(tdir),
                                   draft_path=str(ddir)))[1]

    none = drafter_label("dspark", ddir)
    assert "-t" not in none.removeprefix("dspark-") and back("dspark", none) is None
    assert back("dspark", drafter_label("dspark", ddir, confidence_threshold=0.5)) == 0.5
    assert drafter_label("deepspec", ddir).endswith("-t0") and back("deepspec", drafter_label("deepspec", ddir)) == 0.0
    assert drafter_label("native-mtp", ddir, conventions="depth=chain").endswith("+depth=chain")
    assert drafter_label("ngram", None) == "ngram"


def test_grade_reruns_a_dspark_trace_under_its_own_threshold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dspark trace run with the checkpoint's thresholds (header confidence_threshold null)
    re-runs with them, not with 0 (grade's case_from_header used to label it -t0)."""
    from specparity.cli import main
    from specparity.grading.trace_folders import case_from_header
    from specparity.runners import dspark_drafter
    from traces.io import read_trace

    tdir, ddir = _zoo_pair("dspark")
    assert main(["record", "--target", str(tdir), "--draft", str(ddir), "--prompt-ids", "5,6,7,8", "-n", "4",
                 "--runner", "engine", "--trace", str(tmp_path / "r.jsonl")]) == 0
    capsys.readouterr()
    tr = read_trace(tmp_path / "r.jsonl")
    assert tr.header["source"] == "dspark" and tr.header["params"]["confidence_threshold"] is None
    case = case_from_header(tr.header, tmp_path / "r.jsonl", tmp_path)
    assert dspark_drafter(case)[1] is None, case.drafter
    assert case.case_id == tr.header["case_id"]
