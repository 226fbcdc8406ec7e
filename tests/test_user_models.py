"""The harness on models the zoo lacks (tests/foreign.py: phi3, granite, starcoder2, olmo2 with a
word-level tokenizer): prompts files, run on a local pair, record, grade, audit, ab, report,
the pool backend, bad prompt ids, case ids and the writer API."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specparity.cases.case import Case, model_label
from specparity.cases.prompts import PromptError, check_prompt, read_prompts_file
from tests import foreign
from tests.helpers import cli_rc

ARCHS = ("phi3", "granite", "starcoder2", "olmo2")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[Path, Path]]]:
    root = tmp_path_factory.mktemp("foreign")
    return root, foreign.build(root, ARCHS)


# ---------------------------------------------------------------- prompts files / ids


def test_prompts_file_forms_and_errors(tmp_path: Path) -> None:
    j = tmp_path / "p.jsonl"
    j.write_text('{"id": "a", "text": "ba de"}\n\n{"id": "b", "token_ids": [0, 3]}\n')
    assert [(p.id, p.text, p.token_ids) for p in read_prompts_file(j)] == [
        ("a", "ba de", None), ("b", None, (0, 3))]
    t = tmp_path / "p.txt"
    t.write_text("ba de\n\nfi go\n")
    assert [p.id for p in read_prompts_file(t)] == ["line-1", "line-3"]
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n')
    with pytest.raises(PromptError, match="'a' appears twice"):
        read_prompts_file(dup)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "x"}\n{"id": "b", "token_ids": [1, "2"]}\n')
    with pytest.raises(PromptError, match=r"bad.jsonl:2: 'token_ids'"):
        read_prompts_file(bad)


def test_prompt_ids_checked_against_vocab_and_context(capsys: pytest.CaptureFixture[str]) -> None:
    assert check_prompt([0, 5, 111], vocab_size=112) == [0, 5, 111]  # id 0 is valid
    for ids in ([5, 112], [5, -1], [5, 5000]):
        with pytest.raises(PromptError, match=r"outside the model's vocabulary \[0, 112\)"):
            check_prompt(ids, vocab_size=112, prompt_id="p")
    with pytest.raises(PromptError, match="exceed the model's context of 10"):
        check_prompt(list(range(8)), vocab_size=112, context=10, max_tokens=4)
    assert check_prompt(list(range(8)), vocab_size=112, context=10, max_tokens=4, truncate=True) \
        == [2, 3, 4, 5, 6, 7]
    assert "keeping its last 6 tokens" in capsys.readouterr().err


def test_generate_refuses_ids_past_vocab_and_accepts_zero(models, tmp_path, capsys) -> None:
    _, pairs = models
    t, _ = pairs["olmo2"]
    assert cli_rc("generate", "--target", str(t), "--prompt-ids", "5,600", "-n", "4") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "600 (position 1) outside the model's vocabulary [0, 112)" in err[0]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert cli_rc("generate", "--target", str(t), "--prompt-ids", "0,5,9", "-n", "6",
                  "--eos-ids", "1,7", "--trace", str(a)) == 0
    assert cli_rc("generate", "--target", str(t), "--prompt-ids", "0,5,10", "-n", "6", "--trace", str(b)) == 0
    ha, hb = (json.loads(p.read_text().splitlines()[0]) for p in (a, b))
    assert ha["eos_ids"] == [1, 7] and hb["eos_ids"] == [1]
    assert ha["case_id"] != hb["case_id"] and ha["case_id"].startswith(model_label(t))
    assert ha["prompt"]["token_ids"] == [0, 5, 9]


def test_zoo_prompts_refused_on_a_foreign_model(models, capsys) -> None:
    _, pairs = models
    t, d = pairs["phi3"]
    assert cli_rc("audit", "--target", str(t), "--draft", str(d), "--max-tokens", "4") == 2
    assert "give --prompts-file" in capsys.readouterr().err


# ---------------------------------------------------------------- case ids


def test_case_ids_stable_unique_and_zoo_unchanged(models, tmp_path) -> None:
    import shutil

    _, pairs = models
    assert Case("llama", "twin", "nat-00", 3, 32).case_id == "llama/twin/nat-00/g3/n32"
    t, _ = pairs["phi3"]
    moved = tmp_path / t.name
    shutil.copytree(t, moved)
    assert model_label(moved) == model_label(t)  # same model, other folder: same name
    cfg = json.loads((moved / "config.json").read_text())
    cfg["rope_theta"] = 500.0
    (moved / "config.json").write_text(json.dumps(cfg))
    assert model_label(moved) != model_label(t)
    labels = {model_label(p) for tt, dd in pairs.values() for p in (tt, dd)}
    assert len(labels) == 2 * len(pairs)


# ---------------------------------------------------------------- the whole flow


@pytest.mark.parametrize("arch", ["phi3", "starcoder2", "granite"])
def test_flow_run_record_grade_report(models, tmp_path, arch) -> None:
    from specparity.cases.suite import PairSpec, suite_cases
    from specparity.grading.trace_folders import grade
    from specparity.jobs.run import run

    root, pairs = models
    t, d = pairs[arch]
    spec = PairSpec(target=str(t), drafter=str(d), gammas=(2,), max_tokens=10,
                    prompts_file=root / "prompts.jsonl")
    cases = suite_cases([spec])
    assert len(cases) == 4 and len({c.case_id for c in cases}) == 4
    res = run(tmp_path / "run", cases=cases, runners=["mlx_lm"], progress=False)
    verdicts = {(c.kind, c.verdict) for c in res.comparisons}
    assert res.ok, [c.message for c in res.comparisons if c.fails]
    assert ("engine-vs-mlx_lm", "identical") in verdicts
    assert (tmp_path / "run" / "report.md").is_file()  # run writes the report
    # record a reference with the CLI, then grade the engine traces
    rec = tmp_path / "rec.jsonl"
    assert cli_rc("record", "--runner", "mlx_lm", "--target", str(t), "--draft", str(d),
                  "--prompt", "ba de fi go", "-n", "8", "--gamma", "2", "--trace", str(rec)) == 0
    assert json.loads(rec.read_text().splitlines()[0])["runner"]["name"] == "mlx_lm"
    g = grade(tmp_path / "run" / "traces" / "engine", tmp_path / "graded", progress=False)
    assert g.ok and len(g.comparisons) == len(res.comparisons)
    assert {c.verdict for c in g.comparisons} == {"identical"}


def test_grade_catches_a_planted_engine_bug_and_a_model_mismatch(models, tmp_path) -> None:
    from specparity.cases.suite import PairSpec, suite_cases
    from specparity.grading.trace_folders import GradeError, grade
    from specparity.jobs.run import run

    root, pairs = models
    t, d = pairs["olmo2"]
    cases = suite_cases([PairSpec(target=str(t), drafter=str(d), gammas=(3,), max_tokens=12,
                                  prompts_file=root / "prompts.jsonl")])[:1]
    run(tmp_path / "run", cases=cases, runners=["mlx_lm"], progress=False)
    src = next((tmp_path / "run" / "traces" / "engine").glob("*__g3__*.jsonl"))
    recs = [json.loads(x) for x in src.read_text().splitlines()]
    # planted: the engine "accepts" one draft fewer in round 0 (a wrong accept walk)
    r0 = next(r for r in recs if r["type"] == "round" and r["k_accept"] >= 0)
    bad = tmp_path / "bad"
    bad.mkdir()
    r0["drafts"] = [(r0["drafts"][0] + 1) % 112, *r0["drafts"][1:]] if r0["drafts"] else r0["drafts"]
    r0["window"] = [r0["window"][0], *r0["drafts"]]
    r0["feed"] = [*r0["feed"], 0]
    (bad / src.name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = grade(bad, tmp_path / "g1", progress=False)
    failing = [c for c in res.comparisons if c.fails]
    assert failing, [(c.kind, c.verdict) for c in res.comparisons]
    div = failing[0].divergence
    assert div is not None and (div.where, div.klass) == ("round 0", "logic"), failing[0].message
    assert div.field in ("feed", "drafts") and failing[0].verdict == "logic", div.message
    assert "round 0" in (failing[0].message or "")
    # a header whose weights digest names another model is refused in one line
    recs = [json.loads(x) for x in src.read_text().splitlines()]
    recs[0]["target"]["weights_sha256"] = "0" * 64
    other = tmp_path / "other"
    other.mkdir()
    (other / src.name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(GradeError, match="weights_sha256 .* differs from the header"):
        grade(other, tmp_path / "g2", progress=False)


def test_pool_backend_gives_identical_traces_and_verdicts(models, tmp_path) -> None:
    from specparity.cases.suite import PairSpec, suite_cases
    from specparity.jobs.run import run

    root, pairs = models
    t, d = pairs["starcoder2"]
    cases = suite_cases([PairSpec(target=str(t), drafter=str(d), gammas=(1, 3), max_tokens=8,
                                  prompts_file=root / "prompts.jsonl")])[:3]
    a = run(tmp_path / "serial", cases=cases, runners=["mlx_lm"], progress=False)
    b = run(tmp_path / "pool", cases=cases, runners=["mlx_lm"], workers=2, progress=False)

    def norm(p: Path) -> list[dict]:
        out = []
        for line in p.read_text().splitlines():
            r = json.loads(line)
            for k in ("time_s", "wall_s"):
                r.pop(k, None)
            out.append(r)
        return out

    assert list(a.traces) == list(b.traces)
    for key in a.traces:
        assert norm(a.traces[key]) == norm(b.traces[key]), key
    assert [(c.kind, c.case_id, c.verdict) for c in a.comparisons] == \
        [(c.kind, c.case_id, c.verdict) for c in b.comparisons]


def test_ab_and_audit_with_a_prompts_file(models, tmp_path) -> None:
    from specparity.measure.ab import run_ab

    root, pairs = models
    t, d = pairs["granite"]
    res = run_ab(str(t), str(d), str(t), max_tokens=8, allow_small=True,
                 prompts_file=root / "prompts.jsonl")
    assert res["n_prompts"] == 4 and res["prompt_ids"][0] == "p-zero"
    assert cli_rc("audit", "--target", str(t), "--draft", str(d), "--prompts-file",
                  str(root / "prompts.jsonl"), "--max-tokens", "6") == 0


# ---------------------------------------------------------------- suites


def test_suite_file(models, tmp_path) -> None:
    from specparity.cases.suite import SuiteError, load_suite, suite_cases

    root, pairs = models
    t, d = pairs["phi3"]
    s = tmp_path / "suite.toml"
    s.write_text(f'gammas = [1, 2]\nmax_tokens = 6\nprompts_file = "{root / "prompts.jsonl"}"\n'
                 'sampling = [{temperature = 0.0}, {temperature = 0.7, seed = 3}]\n'
                 'stop_ids = [[5, 6]]\nstop_strings = ["la me"]\n'
                 f'[[pair]]\ntarget = "{t}"\ndrafter = "{d}"\n'
                 f'[[pair]]\ntarget = "{t}"\nsource = "ngram"\ngammas = [2]\n'
                 '[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')  # the file's prompts fit the zoo vocab
    cases = suite_cases(load_suite(s))
    ids = [c.case_id for c in cases]
    assert len(ids) == len(set(ids)) == 2 * 2 * 4 + 2 * 4 + 2 * 2 * 4
    la_me = "-".join(str(foreign.VOCAB.index(w)) for w in ("la", "me"))
    assert any(i.endswith(f"/t0.7s3/stop5-6+{la_me}") for i in ids)
    assert any("/ngram/" in i for i in ids)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[pair]]\ntarget = "llama"\ngamas = [1]\n')
    with pytest.raises(SuiteError, match=r"unknown key\(s\) \['gamas'\]"):
        load_suite(bad)


# ---------------------------------------------------------------- writer API


def test_writer_rebuilds_an_engine_trace(models, tmp_path) -> None:
    from specparity.cases.suite import PairSpec, suite_cases
    from specparity.jobs.run import run_task
    from traces.validate import validate_file
    from traces.writer import EngineTrace, model_identity

    root, pairs = models
    t, d = pairs["phi3"]
    case = suite_cases([PairSpec(target=str(t), drafter=str(d), gammas=(3,), max_tokens=12,
                                 prompts_file=root / "prompts.jsonl")])[0]
    kind, recs = run_task("engine", case)
    h = recs[0]
    tr = EngineTrace(runner={"name": "myengine", "package": "myengine", "version": "0"},
                     case_id=h["case_id"], prompt_id=h["prompt"]["id"],
                     prompt_ids=h["prompt"]["token_ids"], target=model_identity(t),
                     drafter=model_identity(d), params=h["params"], eos_ids=h["eos_ids"])
    assert tr.header["target"]["weights_sha256"] == h["target"]["weights_sha256"]
    for r in recs[1:-1]:
        if r["type"] == "prefill":
            tr.prefill(target_tokens=r["target_tokens"], drafter_tokens=r["drafter_tokens"])
        elif r["type"] == "round":
            tr.round(feed=r["feed"], pending=r["window"][0], drafts=r["drafts"], samples=r["samples"],
                     k_accept=r["k_accept"], emitted=r["emitted"], end=r["end"], margins=r["margins"])
        else:
            tr.plain(input=r["input"], sample=r["sample"], margin=r["margin"], emitted=r["emitted"],
                     end=r["end"], reason=r["reason"])
    out = tr.write(tmp_path / "mine" / "a.jsonl")
    assert validate_file(out) == []
    mine = json.loads(out.read_text().splitlines()[-1])
    for k in ("usage", "speculation", "output_ids"):
        assert mine[k] == recs[-1][k], k
    # planted: a wrong k_accept is caught by validation
    tr.records[1]["k_accept"] += 5
    bad = tr.write(tmp_path / "mine" / "b.jsonl")
    assert validate_file(bad)


def test_zoo_target_with_a_prompts_file_and_grade_of_stop_cases(models, tmp_path) -> None:
    from specparity.cases.suite import PairSpec, suite_cases
    from specparity.grading.trace_folders import grade
    from specparity.jobs.run import run

    root, pairs = models
    zoo_case = suite_cases([PairSpec(target="llama", drafter="twin", gammas=(2,), max_tokens=6,
                                     prompts_file=root / "prompts.jsonl")])[0]
    assert zoo_case.case_id == "llama/twin/p-zero/g2/n6"
    t, d = pairs["olmo2"]
    stop = suite_cases([PairSpec(target=str(t), drafter=str(d), gammas=(2,), max_tokens=16,
                                 prompts_file=root / "prompts.jsonl", stop_ids=((5,), (9, 14)))])[:2]
    res = run(tmp_path / "run", cases=[zoo_case, *stop], runners=["mlx_lm"], progress=False)
    assert res.ok, [c.message for c in res.comparisons if c.fails]
    head = json.loads(res.traces[("engine", stop[0].case_id)].read_text().splitlines()[0])
    assert head["params"]["stop_sequences"] == [[5], [9, 14]]
    g = grade(tmp_path / "run" / "traces" / "engine", tmp_path / "graded", progress=False)
    assert g.ok and {c.verdict for c in g.comparisons} == {"identical"}


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPECPARITY_RAY_TESTS") != "1"
                    and os.environ.get("HYPOTHESIS_PROFILE") != "nightly",
                    reason="~40 s on 2 cores (a Ray cluster start): SPECPARITY_RAY_TESTS=1 or nightly")
def test_ray_backend_gives_identical_traces(models, tmp_path) -> None:
    pytest.importorskip("ray")
    from specparity.cases.suite import PairSpec, suite_cases
    from specparity.jobs.run import run

    root, pairs = models
    t, d = pairs["phi3"]
    cases = suite_cases([PairSpec(target=str(t), drafter=str(d), gammas=(2,), max_tokens=8,
                                  prompts_file=root / "prompts.jsonl")])[:2]
    a = run(tmp_path / "serial", cases=cases, runners=["mlx_lm"], progress=False)
    b = run(tmp_path / "ray", cases=cases, runners=["mlx_lm"], ray_address="", progress=False)

    def norm(p: Path) -> list[dict]:
        return [{k: v for k, v in json.loads(x).items() if k not in ("time_s", "wall_s")}
                for x in p.read_text().splitlines()]

    assert list(a.traces) == list(b.traces)
    assert all(norm(a.traces[k]) == norm(b.traces[k]) for k in a.traces)
    assert [c.verdict for c in a.comparisons] == [c.verdict for c in b.comparisons]


def test_references_run_only_the_sources_they_implement() -> None:
    from specparity.runners import runner_supports

    two = Case("t", "d", "p", 3, target_path="/x", draft_path="/y")
    ngram = Case("t", "ngram", "p", 3, source="ngram", target_path="/x")
    plain = two.plain()
    assert runner_supports("mlx_lm", two) and runner_supports("mlx_lm", plain)
    # mlx-lm has no n-gram source: run on it, it would decode plainly and be compared as spec
    assert not runner_supports("mlx_lm", ngram)
    assert runner_supports("optiq", ngram) and not runner_supports("optiq", two)
    assert runner_supports("engine", ngram)


def test_sampled_case_without_a_reference_is_said_not_compared(models, tmp_path) -> None:
    from specparity.cases.suite import PairSpec, Sampling, suite_cases
    from specparity.jobs.run import run

    root, pairs = models
    t, _ = pairs["olmo2"]
    cases = suite_cases([PairSpec(target=str(t), sources=("ngram",), gammas=(3,), max_tokens=6,
                                  prompts_file=root / "prompts.jsonl",
                                  sampling=(Sampling(0.8, 0.9, 0, 7),))])[:1]
    res = run(tmp_path / "run", cases=cases, runners=["mlx_lm"], progress=False)
    spec_verdicts = [c.verdict for c in res.comparisons if c.case_id == cases[0].case_id]
    assert spec_verdicts == ["not compared"] and res.ok
    assert "INCOMPLETE" not in (tmp_path / "run" / "report.md").read_text().splitlines()[2]


def test_run_cli_on_a_local_pair(models, tmp_path, capsys) -> None:
    root, pairs = models
    t, d = pairs["granite"]
    txt = tmp_path / "prompts.txt"
    txt.write_text("ba de fi go\nku la me\n")
    out = tmp_path / "out"
    assert cli_rc("run", "--target", str(t), "--draft", str(d), "--prompts-file", str(txt),
                  "--gammas", "2", "--max-tokens", "6", "--runners", "mlx_lm", "--out", str(out),
                  "--quiet") == 0
    cmp = json.loads((out / "comparisons.json").read_text())
    assert {c["case_id"].split("/")[2] for c in cmp} == {"line-1", "line-2"}
    capsys.readouterr()
    # a model outside the zoo's vocabulary needs a prompts file: one line, exit 2
    assert cli_rc("run", "--target", str(t), "--draft", str(d), "--out", str(tmp_path / "o2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a prompts file" in err[0]


def test_grade_keeps_traces_that_share_a_case_id_apart(models, tmp_path) -> None:
    from specparity.cases.suite import PairSpec, suite_cases
    from specparity.grading.trace_folders import grade
    from specparity.jobs.run import run_task

    root, pairs = models
    t, d = pairs["starcoder2"]
    cases = suite_cases([PairSpec(target=str(t), drafter=str(d), gammas=(2,), max_tokens=6,
                                  prompts_file=root / "prompts.jsonl")])[:2]
    folder = tmp_path / "gen"
    folder.mkdir()
    for i, case in enumerate(cases):  # an engine that names every request alike
        recs = run_task("engine", case)[1]
        recs[0]["case_id"] = "generate/starcoder2-tiny"
        (folder / f"t{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = grade(folder, tmp_path / "graded", runners=["mlx_lm"], progress=False)
    ids = {c.case_id for c in res.comparisons}
    assert ids == {"generate/starcoder2-tiny [t0.jsonl]", "generate/starcoder2-tiny [t1.jsonl]"}
    assert res.ok and len(res.comparisons) == 4


def test_grade_reruns_references_with_the_headers_logits_processors(models, tmp_path) -> None:
    from specparity.grading.trace_folders import grade

    _, pairs = models
    t, d = pairs["olmo2"]
    folder = tmp_path / "lp"
    assert cli_rc("generate", "--target", str(t), "--draft", str(d), "--prompt", "ba de fi go ku",
                  "-n", "16", "--repetition-penalty", "1.5", "--processor-history", "last",
                  "--trace", str(folder / "a.jsonl")) == 0
    res = grade(folder, tmp_path / "g1", runners=["mlx_lm"], progress=False)
    assert res.ok and {c.verdict for c in res.comparisons} == {"identical"}
    # planted: a header that forgets its processors makes the references run without them
    recs = [json.loads(x) for x in (folder / "a.jsonl").read_text().splitlines()]
    del recs[0]["params"]["logits_processors"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert not grade(bad, tmp_path / "g2", runners=["mlx_lm"], progress=False).ok
