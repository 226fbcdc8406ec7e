"""Hostile command lines: bad flag values, unknown names, flags that cannot apply or are
silently ignored, over-long paths, ``~user`` paths, absurd sizes.

What each test checks, and the catalogue of inputs: ``tests/test_hostile_catalogue.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import zoo
from specparity.cli import main
from tests.helpers import RUN_TINY, cli, one_error, refused

pytestmark = pytest.mark.usefixtures("in_tmp")


FLAG_CASES: list[tuple[list[str], str]] = [
    (["run", "--seed"], "--seed"),
    (["run", "--runners", "nosuch"], "nosuch"),
    (["run", "--gammas", "0"], "--gammas"),
    (["run", "--gammas", "1,,2"], "--gammas"),
    (["run", "--gammas", "x"], "--gammas"),
    (["run", "--max-tokens", "0"], "--max-tokens"),
    (["run", "--max-tokens", "1e9"], "--max-tokens"),
    (["run", "--prompts", "-3"], "--prompts"),
    (["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--max-drop", "nan"],
     "--max-drop"),
    (["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--max-drop", "inf"],
     "--max-drop"),
    (["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--max-drop", "-1"],
     "--max-drop"),
    (["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--gamma", "0"],
     "--gamma"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["nosuch-command"], "nosuch-command"),
    (["regen", "--workers", "0"], "--workers"),
    (["run", "--suite", "/dev/zero"], "regular file"),
    (["run", "--prompts-file", "/dev/zero", "--target", "llama"], "regular file"),
    (["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--prompts-file",
      "/dev/zero"], "regular file"),
    (["bench", "--prompts-file", "."], "regular file"),
    (["zoo", "list", "--prompts-file", "/dev/zero"], "regular file"),
    (["audit", "--prompts-file", "/nonexistent-prompts"], "no such file"),
    (["run", "--gammas", "99999999999999999999"], "too large"),
    (["ab", "--target", "llama", "--drafter-a", "twin", "--drafter-b", "small", "--prompts",
      "99999999999999999999"], "too large"),
    (["bench", "--target", "zoo/a\x00b"], "NUL"),
    (["regen", "--golden-dir", "a\x00b"], "NUL"),
    (["generate", "--target", str(zoo.pair("llama", "twin")[0]), "--prompt-ids", "5", "--seed", "-1"],
     "--seed"),
    (["audit", "--gamma", "-2"], "--gamma"),
    (["run", "--temps", "5,,6"], "empty item"),
    (["diff", "a", "b", "--eps", "nan"], "--eps"),
    (["record", "--runner", "engine", "--target", str(zoo.pair("llama", "twin")[0]), "--prompt-ids", "5",
      "--trace", "t.jsonl", "--out", "d"], "--trace FILE and --out DIR"),
]


@pytest.mark.parametrize("argv,names", FLAG_CASES, ids=[" ".join(a) for a, _ in FLAG_CASES])
def test_bad_flag_is_one_line(argv: list[str], names: str, capsys: pytest.CaptureFixture[str],
                              no_jobs: None) -> None:
    rc, out, err = cli(argv, capsys)
    assert rc == 2, err
    one_error(err, names)


GEN_FLAGS = [
    (["--prompt-ids", "5,x"], "--prompt-ids"),
    (["--prompt-ids", ""], "--prompt-ids"),
    (["--prompt-ids", "5,6", "--max-tokens", "-1"], "--max-tokens"),
    (["--prompt-ids", "5,6", "--max-tokens", "1000000000"], ""),
    (["--prompt-ids", "5,6", "--temp", "nan"], ""),
    (["--prompt-ids", "5,6", "--top-p", "nan"], ""),
    (["--prompt-ids", "5,6", "--min-p", "1"], "--min-p"),
    (["--prompt-ids", "5,5000"], "5000"),
    # issue 35: repeated conventions ("last wins") and non-finite processor values
    (["--prompt-ids", "5,6", "--mtp-conventions", "hidden=pre-norm,hidden=post-norm"],
     "hidden given more than once"),
    (["--prompt-ids", "5,6", "--mtp-conventions", "depth=chain,,trim=rebuild"], "--mtp-conventions"),
    (["--prompt-ids", "5,6", "--mtp-conventions", "warp=9"], "unknown convention"),
    (["--prompt-ids", "5,6", "--repetition-penalty", "nan"], "--repetition-penalty"),
    (["--prompt-ids", "5,6", "--presence-penalty", "inf"], "--presence-penalty"),
    (["--prompt-ids", "5,6", "--logit-bias", "5=nan"], "--logit-bias"),
]


@pytest.mark.parametrize("extra,names", GEN_FLAGS, ids=[" ".join(a) for a, _ in GEN_FLAGS])
def test_generate_bad_values(zoo_pair: tuple[Path, Path], tmp_path: Path, extra: list[str], names: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    rc, out, err = cli(["generate", "--target", zoo_pair[0], "--draft", zoo_pair[1], "-n", "4",
                        "--trace", trace, *extra], capsys)
    assert rc == 2, err
    one_error(err, names)
    assert not trace.exists(), "nothing written for a refused input"
    assert out.strip() == "", "no tokens streamed for a refused input"


def test_non_utf8_argv_is_one_line(zoo_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    bad = b"ab\xff\xfe".decode("utf-8", "surrogateescape")
    rc, _, err = cli(["generate", "--target", zoo_pair[0], "-n", "4", "--prompt", bad], capsys)
    assert rc == 2
    one_error(err, "UTF-8")


def test_missing_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, name in ((["report", tmp_path / "nope"], "nope"), (["report", afile], "afile"),
                       (["known", "--run", tmp_path], "comparisons.json")):
        rc, _, err = cli(argv, capsys)
        assert rc in (1, 2), (argv, err)
        one_error(err, name)
    # diff: one line naming the missing file and why
    rc, _, err = cli(["diff", tmp_path / "a.jsonl", tmp_path / "b.jsonl"], capsys)
    assert rc == 2 and "Traceback" not in err and "internal error" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert "a.jsonl" in err and "No such file" in err


def test_absurd_max_tokens(capsys: pytest.CaptureFixture[str], no_jobs: None) -> None:
    from specparity.cli import args

    rc, _, err = cli(["run", "--max-tokens", "2000000"], capsys)
    assert rc == 2
    one_error(err, "absurd")
    assert args.max_tokens("40000") == 40000
    assert "warning" in capsys.readouterr().err


SWEEP_VALUES = ["nan", "-1", "99999999999999999999", "/dev/zero", "a\x00b"]


def test_flag_sweep_every_flag_of_every_command(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option of every command (found by introspection, so new flags are covered) x bad
    values: no traceback, no internal error; a refusal is one line. Accepted values start no
    work here (the job functions are stubbed)."""
    import argparse
    import contextlib
    import io

    import engine.executor
    import specparity.goldens.regen
    import specparity.jobs.run
    import specparity.measure.ab
    import specparity.measure.bench
    from specparity.cli.entry import build_parser

    class Started(Exception):
        pass

    def started(*_a: object, **_k: object) -> None:
        raise Started()

    for mod, name in ((specparity.jobs.run, "run_cases"), (specparity.jobs.run, "run_task"),
                      (specparity.jobs.run, "execute"), (specparity.measure.ab, "run_ab"),
                      (specparity.measure.bench, "run_bench"), (specparity.goldens.regen, "regen"),
                      (engine.executor, "spec_generate"), (engine.executor, "plain_generate")):
        monkeypatch.setattr(mod, name, started)
    base = {"generate": ["--target", str(zoo_pair[0]), "--prompt-ids", "5,6", "-n", "4"],
            "record": ["--runner", "mlx_lm", "--target", str(zoo_pair[0]), "--prompt-ids", "5,6", "-n", "4"],
            "ab": ["--target", "llama", "--drafter-a", "twin", "--drafter-b", "small"]}
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    tried, bad = 0, []
    for cmd, p in sub.choices.items():
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        for words, sp in ([([cmd], p)] if not nested else
                          [([cmd, n], q) for n, q in nested[0].choices.items()]):
            for act in sp._actions:
                if not act.option_strings or act.nargs == 0 or act.dest == "help":
                    continue
                flag = act.option_strings[-1]
                for value in SWEEP_VALUES:
                    argv = [*words, *base.get(cmd, [])]
                    if flag in argv:
                        i = argv.index(flag)
                        del argv[i:i + 2]
                    argv += [flag, value]
                    err = io.StringIO()
                    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                        rc = main(argv)
                    tried += 1
                    text = err.getvalue()
                    if "Started" in text:
                        continue  # accepted: a valid value for this flag
                    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(
                        ("running cases", "specparity: warning", "bench:", "ab:"))]
                    if "Traceback" in text or "internal error" in text or (rc != 0 and len(lines) != 1):
                        bad.append((argv, rc, text[-300:]))
    print(f"flag sweep: {tried} inputs")
    assert tried > 500
    assert not bad, bad[:5]


NAME_CASES: list[tuple[list[str], str]] = [
    (["run", "--targets", "llama,nosuch"], "'nosuch'; known: llama"),
    (["run", "--drafters", "twim"], "'twim'; known: self, twin"),
    (["run", "--runners", "mlx_lm,nosuch"], "'nosuch'; known: engine, mlx_lm"),
    (["run", "--targets", "llama,,qwen3"], "llama,,qwen3"),
    (["run", "--source", "warp", "--target", "llama"], "'warp'; known: two-model"),
    (["audit", "--targets", "nosuch"], "'nosuch'; known: llama"),
    (["grade", ".", "--runners", "nosuch"], "'nosuch'; known: engine"),
]


@pytest.mark.parametrize("argv,names", NAME_CASES, ids=[" ".join(a) for a, _ in NAME_CASES])
def test_unknown_names_are_refused_with_the_known_ones(argv: list[str], names: str,
                                                      capsys: pytest.CaptureFixture[str],
                                                      captured: list[dict[str, Any]]) -> None:
    """Before: unknown names were dropped and the run conformed on fewer pairs/references."""
    rc, _, err = cli(argv, capsys)
    refused(rc, err, names)
    assert not captured


def test_zoo_cases_api_refuses_unknown_names() -> None:
    from specparity.jobs.run import zoo_cases

    with pytest.raises(ValueError, match="unknown zoo target.*'nosuch'.*known: llama"):
        zoo_cases(targets=["llama", "nosuch"], gammas=(1,), n_prompts=1)
    with pytest.raises(ValueError, match="unknown zoo drafter.*'twim'"):
        zoo_cases(targets=["llama"], drafters=["twim"], gammas=(1,), n_prompts=1)


def test_zoo_matrix_applies_sampling_and_eos_flags(capsys: pytest.CaptureFixture[str],
                                                  captured: list[dict[str, Any]]) -> None:
    """Before: --temps/--top-k/--seed/--eos-ids were ignored on the zoo matrix (greedy only)."""
    rc, _, err = cli(["run", "--targets", "llama", "--drafters", "twin", "--gammas", "2",
                      "--prompts", "1", "--temps", "0,0.7", "--top-k", "5", "--seed", "9",
                      "--eos-ids", "1"], capsys)
    assert rc == 1 and "JobStarted" in err, err
    cases = [c for c in captured[0]["cases"] if not c.grammar]  # the grammar cases: tests/test_grammar_walk.py
    assert sorted(c.temperature for c in cases) == [0.0, 0.7]
    sampled = next(c for c in cases if c.temperature)
    assert (sampled.top_k, sampled.seed, sampled.eos_ids) == (5, 9, (1,))
    assert sampled.case_id == "llama/twin/nat-00/g2/n32/t0.7s9k5/eos1"


@pytest.mark.parametrize("argv,names", [
    (["run", "--top-k", "5"], "--top-k"),
    (["run", "--targets", "llama", "--seed", "3", "--temps", "0"], "--seed"),
    (["run", "--suite", "SUITE", "--temps", "0.5"], "--temps"),
    (["run", "--suite", "SUITE", "--gammas", "2", "--max-tokens", "8"], "--gammas, --max-tokens"),
    (["run", "--target", "llama", "--prompts-file", "P", "--prompts", "2"], "--prompts"),
], ids=["top-k greedy", "seed greedy", "suite+temps", "suite+gammas", "prompts+file"])
def test_flags_that_cannot_apply_are_refused(argv: list[str], names: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            captured: list[dict[str, Any]]) -> None:
    suite = tmp_path / "s.toml"
    suite.write_text('[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "token_ids": [5, 6]}\n')
    argv = [str(suite) if a == "SUITE" else str(prompts) if a == "P" else a for a in argv]
    rc, _, err = cli(argv, capsys)
    refused(rc, err, names)
    assert not captured


# A valid value other than the default for every option of `run` (a new flag fails the test
# until it is listed here): given alone, it must change what runs or be refused.
RUN_FLAG_VALUES: dict[str, list[str]] = {
    "--out": ["OUT2"], "--targets": ["qwen3"], "--drafters": ["small"], "--prompts": ["2"],
    "--target": ["TARGET"], "--draft": ["DRAFT"], "--source": ["ngram"],
    "--prompts-file": ["PROMPTS"], "--temps": ["0,0.5"], "--top-p": ["0.9"], "--top-k": ["3"],
    "--min-p": ["0.1"],
    "--seed": ["4"], "--min-tokens": ["3"], "--rng": ["position"], "--eos-ids": ["1"], "--truncate": [],
    "--gammas": ["2"],
    "--max-tokens": ["6"], "--suite": ["SUITE"], "--max-cases": ["1"], "--runners": [""],
    "--workers": ["1"], "--ray": ["127.0.0.1:1"], "--quiet": [], "--chat-template": [],
    "--kv-bits": ["4"], "--kv-group-size": ["32"], "--quantized-kv-start": ["0"], "--rotating": ["exact"],
    "--grammar": ["lark-list"], "--reasoning-end": ["ll"], "--sessions": [],
}


# Flags that act only in a situation the baseline lacks: given with these, the baseline is refused
# and the flag must make it run.
CONDITIONAL = {"--truncate": ["--max-tokens", "2046"]}


PROCESS_FLAGS = {"--device": "sets this process's MLX device (tests/test_bench_devices.py)",
                 "--help": "prints help"}


def test_every_run_flag_is_honoured_or_refused(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              captured: list[dict[str, Any]]) -> None:
    """On the zoo path and on the user-model path, each flag given alone (over a baseline)
    either changes the cases/job the run receives or is refused in one line."""
    import argparse
    import contextlib
    import io

    from specparity.cli.entry import build_parser

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "token_ids": [5, 6, 7]}\n{"id": "b", "token_ids": [9, 8]}\n')
    prompts2 = tmp_path / "p2.jsonl"
    prompts2.write_text('{"id": "c", "token_ids": [5, 6, 7]}\n')
    suite = tmp_path / "s.toml"
    suite.write_text('gammas = [1]\n[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    subst = {"OUT2": str(tmp_path / "out2"), "TARGET": str(zoo.model_dir("qwen3")),
             "DRAFT": str(zoo.model_dir("llama-small")), "PROMPTS": str(prompts2), "SUITE": str(suite)}
    user = ["--target", str(zoo_pair[0]), "--draft", str(zoo_pair[1]), "--prompts-file", str(prompts),
            "--gammas", "1"]
    paths = {
        "zoo": ["--targets", "llama", "--drafters", "twin", "--prompts", "1", "--gammas", "1"],
        "user": user,
        # the prompt-cache sessions (issue 35: --grammar was dropped there, --max-tokens ran past the context)
        "zoo --sessions": ["--sessions", "--targets", "llama"],
        "user --sessions": [*user, "--sessions"],
    }
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = [a for a in sub.choices["run"]._actions if a.option_strings]
    missing = [a.option_strings[-1] for a in flags
               if a.option_strings[-1] not in RUN_FLAG_VALUES and a.option_strings[-1] not in PROCESS_FLAGS]
    assert not missing, f"list a non-default value for {missing} in RUN_FLAG_VALUES"

    def call(argv: list[str]) -> tuple[int, str, dict[str, Any] | None]:
        captured.clear()
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["run", "--out", str(tmp_path / "out"), *argv])
        return rc, err.getvalue(), (captured[0] if captured else None)

    def view(job: dict[str, Any] | None) -> Any:
        if job is None:
            return None
        return {k: ([(c.case_id, c.prompt_tokens) for c in v] if k == "cases" else v)
                for k, v in job.items()}

    tried, ignored = 0, []
    for name, base in paths.items():
        rc, err, plain_job0 = call(base)
        assert plain_job0 is not None, (name, err)
        for flag, values in RUN_FLAG_VALUES.items():
            job0 = call([*base, *CONDITIONAL[flag]])[2] if flag in CONDITIONAL else plain_job0
            for value in values or [None]:
                if value is None and flag in base:
                    continue  # the path's own mode switch (--sessions)
                argv = [*base, *CONDITIONAL.get(flag, [])]
                if flag in argv:  # replace the baseline's value
                    i = argv.index(flag)
                    del argv[i:i + 2]
                argv += [flag] if value is None else [flag, subst.get(value, value)]
                rc, err, job = call(argv)
                tried += 1
                if job is None:  # refused: one line, no traceback
                    assert rc == 2 and "Traceback" not in err, (name, argv, err)
                    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1, (name, argv, err)
                elif view(job) == view(job0):
                    ignored.append((name, flag, value))
    print(f"run flags: {tried} inputs")
    assert not ignored, f"flags accepted and ignored: {ignored}"


def test_max_tokens_past_the_zoo_context(capsys: pytest.CaptureFixture[str],
                                        captured: list[dict[str, Any]]) -> None:
    """Before: only the user path checked the context; the zoo path ran past it."""
    rc, _, err = cli(["run", "--targets", "llama", "--drafters", "self", "--max-tokens", "5000"],
                     capsys)
    refused(rc, err, "nat-00", "5000", "context of 2048")
    assert not captured


def test_case_limit_and_count(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              captured: list[dict[str, Any]]) -> None:
    """Before: a 10^6-line prompts file (or suite) started a million cases without a word."""
    big = tmp_path / "big.txt"
    big.write_text("ba de\n" * 100_000)  # (10^5 lines: the same refusal, a tenth of the reading)
    rc, _, err = cli(["run", "--target", "llama", "--draft", "twin", "--prompts-file", big], capsys)
    refused(rc, err, "400000 cases exceed the limit of 10000 (--max-cases)")
    rc, _, err = cli(["run", "--max-cases", "100"], capsys)  # the whole zoo matrix
    refused(rc, err, "exceed the limit of 100")
    suite = tmp_path / "s.toml"
    suite.write_text(f'prompts_file = "{big}"\n[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    rc, _, err = cli(["run", "--suite", suite], capsys)
    refused(rc, err, "(--max-cases)")
    assert not captured
    small = tmp_path / "small.txt"
    small.write_text("ba de\n" * 3)
    rc, _, err = cli(["run", "--target", "llama", "--draft", "twin", "--prompts-file", small,
                      "--max-cases", "12"], capsys)
    assert rc == 1 and "JobStarted" in err and len(captured[0]["cases"]) == 12, err


def test_case_count_announced_before_the_run(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(["run", "--targets", "llama", "--drafters", "self", "--gammas", "1",
                      "--prompts", "1", "--max-tokens", "4", "--runners", "", "--out",
                      tmp_path / "o"], capsys)
    assert rc == 0, err
    line = "specparity run: 2 cases (1 speculative, 1 plain), 2 runs on engine"
    assert line in err and err.index(line) < err.index("running cases"), err


LONG = "x" * 300


@pytest.mark.parametrize("argv,flag", [
    ([*RUN_TINY, "--out", f"{LONG}/run"], "--out"),
    ([*RUN_TINY, "--out", "/".join(["y" * 200] * 21)], "--out"),
    (["generate", "--target", "{t}", "--prompt-ids", "5", "-n", "2", "--trace", f"{LONG}.jsonl"],
     "--trace"),
    (["audit", "--targets", "llama", "--json", "/".join(["z" * 200] * 21) + ".json"], "--json"),
    (["regen", "--case", "x", "--report", f"r/{LONG}"], "--report"),
    (["record", "--runner", "engine", "--target", "{t}", "--prompt-ids", "5", "-n", "2", "--out",
      f"{LONG}"], "--out"),
    (["bench", "--out", f"{LONG}"], "--out"),
    (["grade", ".", "--out", f"{LONG}"], "--out"),
], ids=["run --out component", "run --out PATH_MAX", "generate --trace", "audit --json",
        "regen --report", "record --out", "bench --out", "grade --out"])
def test_over_long_paths_are_one_line(zoo_pair: tuple[Path, Path], argv: list[str], flag: str,
                                      capsys: pytest.CaptureFixture[str], no_jobs: None) -> None:
    rc, _, err = cli([a.replace("{t}", str(zoo_pair[0])) for a in argv], capsys)
    assert rc == 2, err
    one_error(err, flag, "long")


@pytest.mark.parametrize("argv,flag", [
    (["generate", "--target", "{t}", "--prompt-ids", "5", "-n", "2", "--seed", str(2**70)], "--seed"),
    ([*RUN_TINY, "--seed", str(2**70)], "--seed"),
    (["bench", "--size", "tiny", "--seed", str(2**70)], "--seed"),
    ([*RUN_TINY, "--out", "~nosuchuser-23/x"], "no such user"),
    (["generate", "--target", "~nosuchuser-23/m", "--prompt-ids", "5"], "no such user"),
    (["run", "--target", "{t}", "--prompts-file", "~nosuchuser-23/p"], "no such user"),
    (["generate", "--target", "{t}", "--prompt-ids", "5", "--trace", "~nosuchuser-23/t"],
     "no such user"),
    (["report", "~nosuchuser-23"], "no such user"),
], ids=["generate --seed 2^70", "run --seed 2^70", "bench --seed 2^70", "--out ~nosuchuser",
        "--target ~nosuchuser", "--prompts-file ~nosuchuser", "--trace ~nosuchuser",
        "report ~nosuchuser"])
def test_seed_and_home_paths_are_one_line(zoo_pair: tuple[Path, Path], argv: list[str], flag: str,
                                          capsys: pytest.CaptureFixture[str], no_jobs: None) -> None:
    rc, out, err = cli([a.replace("{t}", str(zoo_pair[0])) for a in argv], capsys)
    assert rc == 2, err
    one_error(err, flag)
    assert not Path("~nosuchuser-23").exists(), "no literal '~user' directory created"


def test_sessions_refuse_what_they_cannot_honour(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 captured: list[dict[str, Any]]) -> None:
    """Before: ``run --sessions`` dropped ``--grammar`` without a word and ran follow-ups past the
    target's context (each follow-up's prompt holds the earlier outputs)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "token_ids": [5, 6, 7]}\n')
    long = tmp_path / "long.jsonl"
    long.write_text('{"id": "long", "token_ids": [' + ",".join(["5"] * 1500) + "]}\n")
    suite = tmp_path / "s.toml"
    suite.write_text('sessions = true\ngrammar = "lark-list"\n[[pair]]\ntarget = "llama"\ndrafter = "twin"\n')
    user = ["--target", zoo_pair[0], "--draft", zoo_pair[1], "--gammas", "1"]
    for argv, must in (
            ([*user, "--prompts-file", prompts, "--grammar", "lark-list"], ["--sessions", "--grammar"]),
            (["--suite", suite], ["--sessions", "grammar"]),
            (["--targets", "llama", "--max-tokens", "1000"], ["multi-turn", "context of 2048", "--max-tokens"]),
            ([*user, "--prompts-file", long, "--max-tokens", "200"], ["1500-token", "context of 2048"])):
        rc, _, err = cli(["run", "--sessions", *argv, "--out", tmp_path / "o"], capsys)
        refused(rc, err, *must)
    assert not captured and not (tmp_path / "o").exists()


def test_sessions_context_bound_is_the_worst_case() -> None:
    """The bound is what the requests can take: the prompt plus every earlier output and turn."""
    from specparity.jobs.sessions import SESSIONS, TURN_TOKENS, request_reach

    reach = request_reach(SESSIONS["multi-turn"], 10, 4)
    assert reach == [10 + 4, 10 + 4 + TURN_TOKENS + 5, 10 + 4 + TURN_TOKENS + 5 + TURN_TOKENS + 6]
    assert request_reach(SESSIONS["prefix"], 30, 4)[1] == 20 + 5


# What the zoo matrix's fill cases (zoo/fill.py, §7) take of the run's flags, and why the others
# do not apply to them: the fill cases are their own requests, on the fill zoo's own models and
# prompts, greedy (an identity comparison with plain decode) or sampled at --temps (the §7
# behaviour-policy report, never compared token for token).
FILL_FLAGS = {"--temps": "0,0.5", "--seed": "4", "--max-tokens": "6"}


def test_fill_cases_take_the_run_sampling_flags(capsys: pytest.CaptureFixture[str],
                                               captured: list[dict[str, Any]]) -> None:
    """Before: ``--seed`` was not applied to the fill cases."""
    args = [a for kv in FILL_FLAGS.items() for a in kv]
    rc, _, err = cli(["run", *args], capsys)
    assert rc == 1 and "JobStarted" in err, err
    fill = captured[0]["fill_cases"]
    assert fill and {c.temperature for c in fill} == {0.0, 0.5}
    assert {c.seed for c in fill} == {4} and {c.max_tokens for c in fill} == {6}
    def fill(argv: list[str]) -> list[Any]:
        captured.clear()
        cli(["run", *argv], capsys)
        return list(captured[0]["fill_cases"])

    for flag, (without, given) in {  # each flag alone, over a baseline it can apply to
            "--temps": ([], ["--temps", "0,0.5"]),
            "--seed": (["--temps", "0,0.5"], ["--temps", "0,0.5", "--seed", "4"]),
            "--max-tokens": ([], ["--max-tokens", "6"])}.items():
        assert fill(without) != fill(given), f"{flag} does not reach the fill cases"


def test_generate_refuses_a_kv_group_size_before_generating(zoo_pair: tuple[Path, Path], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``generate`` streamed tokens up to --quantized-kv-start, then failed (``run``
    refused the same case up front)."""
    trace = tmp_path / "t.jsonl"
    for cmd in (["generate"], ["record", "--runner", "mlx_lm"]):
        rc, out, err = cli([*cmd, "--target", zoo_pair[0], "--prompt-ids", "5,6", "-n", "8", "--kv-bits", "4",
                            "--kv-group-size", "64", "--quantized-kv-start", "3", "--trace", trace], capsys)
        refused(rc, err, "--kv-group-size 64", "head dim 16")
        assert out == "" and not trace.exists()
