"""The runner registry (``specparity/runners/``): declarations, refusals, and that a runner
runs what it declares.

A declaration says which draft sources and case options a runner implements; every place
that picks a runner trusts it. So: each declaration is consistent; a runner asked for a
source or an option it lacks refuses in one line (record: exit 2) instead of decoding plainly
under a speculative label; and a case of each declared source, run by each runner available
here, is a speculative trace with rounds (a planted runner that declares a source it does not
run is caught).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from specparity.cases.case import Case
from specparity.runners import registry, run_case
from specparity.runners.registry import CaseRun, GoldenSet, Runner, RunnerUnsupported
from tests.helpers import cli, one_error
from traces.io import Trace
from traces.reference import ReferenceRefused, refusal_verdict

# One cheap zoo case per draft source (the engine implements them all).
SOURCE_CASES: dict[str, Case] = {
    "plain": Case("llama", None, "nat-00", 0, 6),
    "two-model": Case("llama", "twin", "nat-00", 3, 8),
    "ngram": Case("llama", "ngram", "rnd-00", 2, 12, source="ngram"),
    "mtp": Case("qwen35", "qwen35-mtp", "nat-00", 2, 8, source="mtp"),
    "assistant": Case("gemma4", "gemma4-assistant", "nat-03", 3, 8, source="assistant"),
    "deepspec": Case("gemma4", "deepspec-t0", "nat-03", 4, 8, source="deepspec"),
    "dspark": Case("gemma4", "dspark-t0", "nat-03", 4, 8, source="dspark"),
    "native-mtp": Case("glm-mtp", "native", "nat-00", 2, 8, source="native-mtp"),
}


def declared_source_problems(runner: str | Runner, sources: list[str]) -> list[str]:
    """For each source: a case of it run by ``runner`` must be a trace of that mode and source,
    and a speculative one must hold verify rounds (not a plain decode under the label)."""
    problems = []
    r = registry.get(runner) if isinstance(runner, str) else runner
    for src in sources:
        case = SOURCE_CASES[src]
        if "grammar" in r.requires:  # a grammar-only reference (specparity/runners/mlx_lm_grammar.py)
            case = replace(case, grammar="lark-list")
        try:
            recs = run_case(runner, case)
        except ReferenceRefused as exc:  # a reference behaviour the known manifest explains
            assert refusal_verdict(Trace.from_records(run_case("engine", case)), exc).status == "refused", exc
            continue
        header = recs[0]
        kinds = {r["type"] for r in recs[1:]}
        name = runner if isinstance(runner, str) else runner.name
        if src == "plain":
            if header["mode"] != "plain" or "round" in kinds:
                problems.append(f"{name}: plain case {case.case_id}: mode {header['mode']}, {kinds}")
        elif header["mode"] != "spec" or header["source"] != src or "round" not in kinds:
            problems.append(f"{name}: declares {src} but its trace of {case.case_id} has mode "
                            f"{header['mode']}, source {header['source']}, records {sorted(kinds)}")
    return problems


# ---------------------------------------------------------------- declarations


def GS(name: str, **kw: Any) -> GoldenSet:  # noqa: N802 - a declaration, read like one
    return GoldenSet(name, "p", ("x",), cases=list, **kw)


def test_every_runner_is_declared_consistently() -> None:
    from oracles import availability as oracle_availability
    from subjects import SUBJECTS

    runners = registry.all_runners()
    engine = runners["engine"]
    assert list(runners)[0] == "engine" and engine.kind == "engine"
    for name, r in runners.items():
        registry.check_declaration(r)
        assert name == r.name
        if r.kind != "engine":
            assert r.install_hint, name
        if r.per_case:
            # a per-case runner implements plain decode or a source, each known to the harness
            assert set(r.sources) <= set(engine.sources), (name, set(r.sources) - set(engine.sources))
            for src, opts in r.sources.items():
                assert set(opts) <= set(registry.OPTIONS), (name, src)
            ok, why = r.available()
            assert ok or why, name
        if r.kind == "reference":
            oracle_availability(name)  # its driver module oracles/<name>.py exists (ValueError if not)
    assert set(SUBJECTS) == set(registry.names("subject"))
    for gname in registry.golden_sets():  # a golden set's runner: availability, run_case
        owner = registry.golden_owner(gname)
        assert gname == owner.name or gname.startswith(f"{owner.name}_"), gname
    # the engine implements every source and option the harness knows
    assert set(engine.sources) == set(SOURCE_CASES)
    assert all(set(o) == set(registry.OPTIONS) for o in engine.sources.values())


# Case fields and how the registry sees them: the case's identity and models, or an option.
CASE_FIELDS = {
    "target", "drafter", "prompt_id", "gamma", "max_tokens", "seed", "source", "target_path",
    "draft_path", "prompt_tokens",  # what every runner takes (seed: with sampling)
    # the engine's rollback of rotating caches: every reference's own loop is the reference for
    # either mode (the output must equal plain decode in both), so no runner refuses it
    "rotating",
    "temperature", "top_p", "top_k", "min_p", "eos_ids", "stop_sequences", "processors",  # OPTIONS
    "kv_bits", "kv_group_size", "quantized_kv_start",  # OPTIONS["kv_cache"]
    "grammar",  # OPTIONS["grammar"]
    "reasoning_end",  # OPTIONS["reasoning_end"]
    "min_tokens",  # OPTIONS["min_tokens"]
    "rng",  # OPTIONS["rng_position"]
}


def test_a_new_case_field_is_an_option_runners_declare() -> None:
    """A case field a reference might silently ignore must be an option in registry.OPTIONS,
    declared by the runners that honour it (refused by the others)."""
    from dataclasses import fields

    new = {f.name for f in fields(Case)} - CASE_FIELDS
    assert not new, (f"new Case field(s) {sorted(new)}: add an option to registry.OPTIONS, name it "
                     "under the sources of the runners that honour it, then list the field here")


@pytest.mark.parametrize("bad, msg", [
    (Runner("x", "engine", "p", sources={"plain": frozenset({"warp"})}, run=lambda x: []), "unknown option"),
    (Runner("x", "engine", "p", run=lambda x: []), "must declare the sources"),
    (Runner("x", "reference", "p"), "say where it is exercised"),
    (Runner(" ", "reference", "p", elsewhere="y"), "non-blank"),
    (Runner("all", "reference", "p", elsewhere="y"), "non-blank"),
    (Runner("x", "gizmo", "p", elsewhere="y"), "kind"),
    # one spelling per graded thing, said by its kind
    (Runner("mlx-lm", "reference", "p", elsewhere="y"), "a reference's name is snake_case"),
    (Runner("MlxLm", "reference", "p", elsewhere="y"), "a reference's name is snake_case"),
    (Runner("my_server", "server", "p", elsewhere="y"), "a server's name is its distribution's"),
    (Runner("server:mlx-lm", "server", "p", elsewhere="y"), "a server's name is its distribution's"),
    (Runner("my--engine", "subject", "p", elsewhere="y"), "a subject's name is its distribution's"),
    # golden sets: named <runner> or <runner>_<what>; run_case records only the runner's own
    (Runner("ref", "reference", "p", elsewhere="y", goldens=(GS("other_mtp", produce=lambda c: []),)),
     "must be named 'ref' or ref_<what>"),
    (Runner("ref", "reference", "p", elsewhere="y", goldens=(GS("ref-mtp", produce=lambda c: []),)),
     "must be named 'ref' or ref_<what>"),
    (Runner("ref", "reference", "p", sources={"plain": frozenset()}, run=lambda x: [],
            goldens=(GS("ref_mtp"),)), "has no produce"),
    (Runner("ref", "reference", "p", elsewhere="y", goldens=(GS("ref"),)), "has no produce"),
])
def test_inconsistent_declaration_is_refused(bad: Runner, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        registry.check_declaration(bad)


def test_golden_set_names_are_unique_and_never_another_runners() -> None:
    a = Runner("aa", "reference", "p", elsewhere="y", goldens=(GS("aa_x", produce=lambda c: []),))
    b = Runner("aa_x", "reference", "p", elsewhere="y")
    with pytest.raises(ValueError, match="golden set 'aa_x' is the name of another runner"):
        registry.check_golden_names([a, b])
    c = Runner("bb", "reference", "p", elsewhere="y", goldens=(GS("bb_y", produce=lambda c: []),))
    with pytest.raises(ValueError, match="golden set 'bb_y' is declared by bb and bb"):
        registry.check_golden_names([c, c])
    registry.check_golden_names(registry.all_runners().values())


def test_the_install_hint_is_written_once_and_ends_every_unavailable_reason() -> None:
    hint = "pip install thing==1"
    bare = Runner("r", "reference", "p", elsewhere="y", available=lambda: (False, "thing is not installed"),
                  install_hint=hint)
    assert bare.availability() == (False, f"thing is not installed; install: {hint}")
    said = replace(bare, available=lambda: (False, f"thing is missing; run it with: {hint}"))
    assert said.availability() == (False, f"thing is missing; run it with: {hint}")  # not twice
    assert replace(bare, available=lambda: (True, "ok")).availability() == (True, "ok")
    for name, r in registry.all_runners().items():
        ok, why = registry.availability(name)
        assert ok or (r.install_hint and why.endswith(r.install_hint)), (name, why)
        assert ok or why.count(r.install_hint) == 1, (name, why)


def known_runner_problems(entries: list[dict[str, Any]], names: set[str]) -> list[str]:
    """Entries of traces/known_divergences.toml whose ``runner`` is not a declared runner's name."""
    return [f"{e['id']}: runner {e['runner']!r} is not a declared runner" for e in entries
            if e.get("runner") not in names]


def test_known_divergences_are_keyed_by_registry_names() -> None:
    """Every entry names its runner exactly as the registry declares it (one spelling)."""
    import tomllib

    from traces.reference import KNOWN_FILE

    entries = tomllib.loads(KNOWN_FILE.read_text())["entry"]
    names = set(registry.names())
    assert not known_runner_problems(entries, names), known_runner_problems(entries, names)
    assert {e["runner"] for e in entries} & set(registry.names("server")), "no server entry checked"
    planted = [{"id": "x", "runner": "server:mlx-lm"}, {"id": "y", "runner": "mlx-lm"}]
    assert known_runner_problems(planted, names) == ["x: runner 'server:mlx-lm' is not a declared runner"]


# ---------------------------------------------------------------- name lists tested against the registry


def listed(text: str, universe: Iterable[str]) -> set[str]:
    """The names of ``universe`` that ``text`` lists (whole tokens: ``mlx-lm`` is not in
    ``mlx-lm-broomva``)."""
    tokens = {t.strip(".") for t in re.split(r"[\s,;:()|`'\"/\[\]{}]+", text)}
    return tokens & set(universe)


def list_problems(what: str, text: str, expected: Iterable[str], universe: Iterable[str]) -> list[str]:
    """Where ``text`` (a help text, a doc line) disagrees with the registry's list ``expected``."""
    got, want = listed(text, universe), set(expected)
    out = [f"{what} misses {sorted(want - got)}"] if want - got else []
    return out + ([f"{what} names {sorted(got - want)}, not in the registry's list"] if got - want else [])


def _flag_help(command: str, flag: str) -> str:
    import argparse

    from specparity.cli.entry import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices[command]._actions if flag in a.option_strings)
    return str(action.help)


def _servers_graded() -> list[str]:
    from subjects.server_rows import SERVERS

    return [n for n in registry.names("server") if not SERVERS[n].test_double]


def _kinds() -> list[str]:
    from engine.sources import names as source_kinds

    return list(source_kinds())


def test_help_texts_list_the_registry() -> None:
    """Each flag's list is the registry's, among the names of the kind that flag takes (prose
    words such as "engine" or "mlx-lm" in a help text are not names of that kind)."""
    refs, golden = registry.names("reference"), list(registry.golden_sets())
    checks = [  # (flag, the registry's list, the names it is read among)
        ("record --runner", registry.names(per_case=True), ["engine", *refs]),
        ("run --runners", registry.names("reference", per_case=True), refs),
        ("grade --runners", registry.names("reference", per_case=True), refs),
        ("grade --engine", registry.names("subject"), registry.names("subject")),
        ("grade --serve", _servers_graded(), registry.names("server")),
        ("regen --runner", golden, [*golden, *registry.names()]),
        ("generate --source", _kinds(), _kinds()),
        ("run --source", _kinds(), _kinds()),
    ]
    problems = []
    for where, want, among in checks:
        command, flag = where.split()
        problems += list_problems(where, _flag_help(command, flag), want, among)
    assert not problems, problems


def test_the_readme_and_docs_list_the_registry() -> None:
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text().splitlines()
    runners_md = (root / "docs" / "runners.md").read_text().replace("\n", " ")
    from subjects import SUBJECTS

    serve = next(ln for ln in readme if ln.startswith("specparity grade --serve"))
    generate = next(ln for ln in readme if ln.startswith("specparity generate"))
    layer4 = next(ln for ln in readme if ln.startswith("| 4 |"))
    oracle_part, _, subject_part = layer4.partition("`subjects/`:")
    served = runners_md[runners_md.index("The served engines of today"):][:300]
    servers, kinds = registry.names("server"), _kinds()
    refs = [f"{n}.py" for n in registry.names("reference")]
    adapters = sorted({f"{info.module.rpartition('.')[2]}.py" for info in SUBJECTS.values()})
    problems = [
        *list_problems("README `grade --serve` line", serve, _servers_graded(), servers),
        *list_problems("README `generate --source` line", generate.split("--source", 1)[1].split("]")[0],
                       ["auto", *kinds], ["auto", *kinds]),
        *list_problems("README layer 4: oracles/", oracle_part, refs, refs),
        *list_problems("README layer 4: subjects/", subject_part, adapters, adapters),
        *list_problems("docs/runners.md served engines", served.split(")")[0], servers, servers),
    ]
    assert not problems, problems


def test_a_list_that_disagrees_with_the_registry_is_named() -> None:
    universe = ["mlx-lm", "mlx-lm-broomva", "vllm-mlx", "yunshu"]
    assert list_problems("x", "(mlx-lm, vllm-mlx)", ["mlx-lm", "vllm-mlx", "yunshu"], universe) == \
        ["x misses ['yunshu']"]
    assert list_problems("x", "mlx-lm-broomva, mlx-lm", ["mlx-lm"], universe) == \
        ["x names ['mlx-lm-broomva'], not in the registry's list"]
    assert list_problems("x", "start server NAME (mlx-lm, vllm-mlx, yunshu) on", ["mlx-lm", "vllm-mlx", "yunshu"],
                         universe) == []


def test_unsupported_names_the_runner_and_what_is_missing() -> None:
    two = SOURCE_CASES["two-model"]
    ngram = SOURCE_CASES["ngram"]
    assert registry.unsupported("mlx_lm", two) is None
    why = registry.unsupported("mlx_lm", ngram)
    assert why is not None and "mlx_lm" in why and "ngram source" in why and ngram.case_id in why
    stop = replace(ngram, stop_sequences=((5, 6),))
    why = registry.unsupported("optiq", stop)
    assert why is not None and "optiq" in why and "stop_sequences" in why, why
    assert registry.unsupported("optiq", ngram) is None
    assert "sampling" in (registry.unsupported("deepspec", replace(SOURCE_CASES["deepspec"], temperature=0.5))
                          or "")
    assert "not run per case" in (registry.unsupported("mlx_vlm", two) or "")
    for bad in ("", " ", "nosuch"):
        with pytest.raises(RunnerUnsupported):
            registry.get(bad)


def test_run_case_refuses_an_undeclared_source_before_running() -> None:
    with pytest.raises(RunnerUnsupported, match="mlx_lm does not implement the ngram source"):
        run_case("mlx_lm", SOURCE_CASES["ngram"])


def test_run_skips_cases_a_reference_lacks_with_the_reason() -> None:
    from specparity.jobs.run import skip_reasons

    cases = [SOURCE_CASES["two-model"], SOURCE_CASES["ngram"], replace(SOURCE_CASES["ngram"], gamma=3)]
    got = skip_reasons(["mlx_lm", "engine"], cases)
    assert set(got) == {"mlx_lm"}
    assert got["mlx_lm"].startswith("2 case(s) skipped: mlx_lm does not implement the ngram source"), got


# ---------------------------------------------------------------- runners run what they declare


def _available_per_case() -> list[str]:
    return [n for n, r in registry.all_runners().items() if r.per_case and r.available()[0]]


@pytest.mark.parametrize("name", _available_per_case())
def test_each_declared_source_yields_speculative_rounds(name: str) -> None:
    r = registry.all_runners()[name]
    cheap = ["plain", "two-model", "ngram"] if name == "engine" else list(r.sources)
    # the engine's head/block sources are run round for round by their conformance tests
    # (test_mtp, test_assistant, test_dspark_references); here the ones on the small zoo
    assert not declared_source_problems(name, [s for s in cheap if s in r.sources])


def test_a_runner_that_declares_a_source_it_does_not_run_is_caught() -> None:
    from specparity.runners import engine

    def plain_only(x: CaseRun) -> list[dict[str, Any]]:  # ignores the drafter: plain decode
        return engine.run(replace(x, case=replace(x.case, drafter=None)))

    liar = Runner("liar", "reference", "specparity", sources=registry.sources((), "plain", "ngram"),
                  run=plain_only, header=lambda: {"name": "liar", "package": "specparity", "version": "0"})
    problems = declared_source_problems(liar, ["plain", "ngram"])
    assert len(problems) == 1 and "liar: declares ngram" in problems[0], problems
    assert "records ['footer', 'plain', 'prefill']" in problems[0], problems  # no verify round


# ---------------------------------------------------------------- CLI refusals


def test_record_refuses_a_source_the_runner_lacks(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    rc, _, err = cli(["record", "--runner", "mlx_lm", "--target", zoo_pair[0], "--source", "ngram",
                      "--prompt-ids", "5,6,7", "-n", "4", "--trace", out], capsys)
    assert rc == 2
    one_error(err, "mlx_lm", "ngram source")
    assert not out.exists()


@pytest.mark.parametrize("given, msg", [(" ", "empty runner name"), ("mlx_lm,", "empty runner name"),
                                        ("nosuch", "unknown runner 'nosuch'"),
                                        ("mlx_vlm", "not run per case")])
def test_record_refuses_blank_unknown_and_non_case_runners(
        given: str, msg: str, zoo_pair: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(["record", "--runner", given, "--target", zoo_pair[0], "--prompt-ids", "5,6",
                      "-n", "2", "--out", tmp_path], capsys)
    assert rc == 2
    one_error(err, msg)
    assert not any(tmp_path.iterdir())


def test_record_refuses_an_option_the_runner_lacks(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from specparity.runners import engine

    greedy = Runner("greedyonly", "reference", "specparity", sources=registry.sources((), "plain"),
                    run=engine.run, header=lambda: {"name": "greedyonly", "package": "specparity",
                                                    "version": "0"})
    runners = {**registry.all_runners(), "greedyonly": greedy}
    monkeypatch.setattr(registry, "all_runners", lambda: runners)
    base = ["record", "--target", zoo_pair[0], "--prompt-ids", "5,6,7", "-n", "4", "--out", tmp_path]
    rc, _, err = cli([*base, "--runner", "greedyonly", "--temp", "0.7"], capsys)
    assert rc == 2
    one_error(err, "greedyonly", "sampling", "plain source")
    assert not any(tmp_path.iterdir())
    # --runner all records with every runner that implements the case and names the others
    rc, _, err = cli([*base, "--runner", "all", "--temp", "0.7"], capsys)
    assert rc == 0, err
    assert "record: skipped greedyonly does not implement sampling" in err, err
    assert {p.name for p in tmp_path.iterdir()} - {".specparity-run.json"} == {"engine", "mlx_lm"}


def test_grade_engine_not_installed_is_not_a_success(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    missing = [n for n in registry.names("subject") if not registry.availability(n)[0]]
    if not missing:
        pytest.skip("every subject is installed here")
    rc, _, err = cli(["grade", "--engine", missing[0], "--out", tmp_path], capsys)
    assert rc == 2, err
    line = [ln for ln in err.splitlines() if ln.startswith("specparity grade:")]
    assert len(line) == 1 and missing[0] in line[0] and "tox -e" in line[0], err
    for bad, msg in ((" ", "empty engine name"), ("mlx_lm", "kind reference"), ("nosuch", "unknown engine")):
        rc, _, err = cli(["grade", "--engine", bad, "--out", tmp_path], capsys)
        assert rc == 2 and msg in err, (bad, err)


def test_grade_refuses_a_header_source_no_runner_implements(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from traces.io import write_trace

    case = Case("llama", "ngram", "x", 2, 4, source="ngram", target_path=str(zoo_pair[0]),
                prompt_tokens=(5, 6, 7, 5, 6))
    recs = run_case("engine", case)
    recs[0] = {**recs[0], "source": "warp-drive"}
    (tmp_path / "traces").mkdir()
    write_trace(tmp_path / "traces" / "t.jsonl", recs)
    rc, _, err = cli(["grade", tmp_path / "traces", "--out", tmp_path / "g", "--quiet"], capsys)
    assert rc == 1, err
    # grade's header validation (before any model loads) names the file, the field and the source
    assert "header.source: unknown draft source 'warp-drive'" in err and "t.jsonl" in err, err


def test_grade_skips_a_reference_lacking_the_header_source_with_the_reason(
        zoo_pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from traces.io import write_trace

    case = Case("llama", "ngram", "x", 2, 6, source="ngram", target_path=str(zoo_pair[0]),
                prompt_tokens=(5, 6, 7, 5, 6, 7, 5))
    (tmp_path / "traces").mkdir()
    write_trace(tmp_path / "traces" / "t.jsonl", run_case("engine", case))
    rc, out, err = cli(["grade", tmp_path / "traces", "--out", tmp_path / "g", "--runners", "mlx_lm",
                        "--quiet"], capsys)
    assert rc == 0, err
    assert "oracle `mlx_lm`: 1 case(s) skipped: mlx\\_lm does not implement the ngram source" in out, out
    assert not (tmp_path / "g" / "traces" / "mlx_lm").exists()  # never a plain decode labelled ngram
