"""The catalogue of hostile inputs: every input the ``tests/test_hostile_*.py`` modules plant,
by class, and counts that keep the catalogue honest (printed with ``-s``).

Each hostile-input test plants a bad input of its class and checks, through
``specparity.cli.main`` in process (fast: tiny zoo models, ``--max-tokens 4``), the exit
status (2 usage, 1 failed run), exactly one ``specparity ...: error:`` line on stderr (no
traceback, no ``internal error``), and that nothing corrupt or partial sits under a final
name. The shared fixtures and checks are ``tests/helpers.py``.

Where each class is planted: command lines ``test_hostile_cli_args.py``; prompts files and
suites ``test_hostile_prompts_and_suites.py``; model directories ``test_hostile_model_dirs.py``;
traces and run folders ``test_hostile_traces.py``; output destinations
``test_hostile_outdir.py``; a full disk and signals ``test_hostile_interrupts.py``; the
environment ``test_hostile_env.py``; the harness's own outputs as input
``test_hostile_own_outputs.py``. The runtime sweeps (every flag of every command, every
``run`` flag, every suite key) count their inputs as they run.
"""

from __future__ import annotations

# Crashes, false verdicts, lost data: one entry per input planted (class -> inputs).
BAD_INPUT: dict[str, list[str]] = {
    "usage: flags": [
        "run --seed", "run --runners nosuch", "run --gammas 0", "run --gammas 1,,2",
        "run --gammas x", "run --max-tokens 0", "run --max-tokens 1e9", "run --prompts -3",
        "ab --max-drop nan", "ab --max-drop inf", "ab --max-drop -1", "ab --gamma 0",
        "generate --prompt-ids 5,x", "generate --prompt-ids ''", "generate --max-tokens -1",
        "generate --max-tokens 1000000000", "bench --repeats 0", "nosuch-command",
        "regen --workers 0", "audit --gamma -2", "run --gammas 1e20 (int)", "ab --prompts 1e20 (int)",
        "bench --target with NUL", "regen --golden-dir with NUL", "generate --seed -1",
        "run --suite /dev/zero", "run --prompts-file /dev/zero", "ab --prompts-file /dev/zero",
        "bench --prompts-file a dir", "zoo list --prompts-file /dev/zero", "audit --prompts-file missing", "report (no such dir)", "report (a file)",
        "diff (missing files)", "known --run (not a run dir)", "non-UTF-8 argv",
    ],
    "crashes: bad files": [
        "truncated safetensors", "config.json not JSON", "no config.json",
        "(each of the three via generate --target/--draft, ab, audit, run --target)", "trace FIFO",
        "deeply nested JSON line", "non-UTF-8 trace", "malformed comparisons.json",
        "comparisons.json not a list", "ab.json malformed", "trace validate a directory",
    ],
    "false verdicts": [
        "report: schema_version 99", "report: duplicated round index",
        "report: negative token id", "report: killed run (no comparisons)",
        "report: fewer comparisons than cases", "report: marker says failed",
        "generate --temp nan", "generate --top-p nan", "target with NaN logits",
    ],
    "unbounded work": [
        "trace validate /dev/zero", "trace validate 5 MB line", "validate 100k bad lines",
        "--max-tokens 2e6 refused", "--max-tokens 40000 warned",
    ],
    "lost or mixed data": [
        "second run into a locked --out", "second regen on a locked golden dir",
        "run over an earlier run dir (stale rows)", "disk full writing report.md",
        "disk full writing comparisons.json (run)",
    ],
    "finished work thrown away": [
        "ab --out an existing file", "bench --out under a file", "run --out under a file",
        "regen --report under a file", "regen --golden-dir a file",
        "ab: results printed before a failing write",
    ],
    "environment-dependent dispatch": ["every available runner dispatchable (all installed)"],
    "misleading figures": ["no tok/s or speedup column in report/summary"],
    "no progress in CI logs": ["plain progress lines when stderr is not a TTY"],
    "orphans and modes": ["published files are 0644 under umask 022",
                          "--trace /dev/null (device kept)", "--trace a symlink (link kept)"],
    "goldens depend on location": ["golden headers record zoo/<dir>, never an absolute path"],
    "markdown injection": ["<script>/|/backticks in case id, prompt id and path"],
    "any trace folder": ["mixed engine/reference/plain traces, colliding case ids"],
    "flag sweep (every option of every command x 5 values, counted at run time)": ["sweep"],
}


def test_bad_input_catalogue_counts() -> None:
    n = sum(len(v) for v in BAD_INPUT.values())
    assert n >= 60, n
    print({k: len(v) for k, v in BAD_INPUT.items()}, "total", n)


# Input silently misread or ignored, grading lies, unbounded work.
MISREAD_INPUT: dict[str, list[str]] = {
    "silently misread or ignored input": [
        "run --targets llama,nosuch", "run --drafters twim", "run --runners mlx_lm,nosuch",
        "run --targets llama,,qwen3", "run --source warp --target llama", "audit --targets nosuch",
        "grade --runners nosuch", "zoo_cases(targets=[nosuch]) (API)",
        "JSONL prompts with a BOM", "JSON array of prompts", "JSON array cut short",
        "'[INST] hi' plain text", "JSONL prompt nested 100k deep",
        "zoo matrix --temps/--top-k/--seed/--eos-ids applied", "--top-k without a temperature",
        "--suite with --temps", "--prompts with --prompts-file",
        "every run flag honoured or refused (zoo path and user path, counted at run time)",
        "run --max-tokens 5000 on the zoo (context 2048)",
        "suite key x sweep value agrees with its flag (counted at run time)",
    ],
    "grading lies": [
        "header source 'warp-drive'", "plain header with source 'ngram'", "header γ 10^9",
        "header seed 2^70", "header max_tokens 0", "header top_k 2^40",
        "grade DIR with an earlier grade --out inside", "grade a run output itself",
        "writer prompt id 187.7", "writer prompt id '496'", "writer prompt id True",
        "writer round sample True", "writer plain sample '5'", "writer margin 'nan'",
        "make_header eos id 1.0",
    ],
    "unbounded work": [
        "report axis ticks for a γ of 10^9", "10^6-line prompts file", "zoo matrix past --max-cases",
        "suite past --max-cases", "case count announced before the run", "grade / (walk limit)",
        "grade: folders nested past the depth limit", "grade: a FIFO named x.jsonl",
        "grade: a symlink loop", "FIFO model.safetensors (load, --target)",
        "FIFO config.json", "FIFO tokenizer.json", "FIFO prompts file (suite)",
        "/dev/zero as a suite's prompts_file", "FIFO run marker (report)",
    ],
}


def test_misread_input_catalogue_counts() -> None:
    n = sum(len(v) for v in MISREAD_INPUT.values())
    assert n >= 45, n
    print({k: len(v) for k, v in MISREAD_INPUT.items()}, "total", n)


# Output safety: what is not ours is never destroyed, no verdict before the work is done,
# rough edges are one line.
OUTPUT_SAFETY: dict[str, list[str]] = {
    "destroying what is not ours": [
        "run --out . in a checkout (traces/ package, summary.md, report.md)",
        "run --out DIR holding a user's notes.txt", "run --out DIR holding a user's report_files/x.png",
        "run --out DIR whose .previous-run/ is not ours", "grade --out DIR holding user files",
        "run --out a 1500-file folder (a home folder): refused after 1000, not walked further",
        "run dir of an older specparity (no file list): recognised outputs set aside",
        "older run dir + a user's notes.txt", "older run dir + a user's summary.md",
        "a listed output replaced by a symlink to a user's file",
        "report DIR with a user's report.md", "report DIR with a user's report.html",
        "bench --out DIR with a user's bench.json", "ab --out DIR with a user's ab.md",
        "grade --engine --out DIR with a user's NAME.json", "grade --engine with a user's scoreboard.md",
        "grade --serve --out DIR with a user's scoreboard.html",
        "regen --golden-dir with a user's manifest.json", "regen --golden-dir with a user's .x.tmp",
        "regen --report DIR with a user's drift.md", "record --out DIR with a user's file at the trace path",
        "audit --json a user's file", "generate --trace a user's file",
        "generate --trace a symlink to a user's file",
        "invariant: every dir-writing command on a dir of user files (run, grade, report, bench, ab, "
        "regen --report, regen --golden-dir, record --out, grade --engine) leaves every byte",
        "two unfinished runs after a finished one: the finished one is kept",
        "a finished run replaced only once the new run completes",
        "bench.json: a failed write leaves the old file", "audit --json: a failed write leaves no file",
        "bench files listed, not foreign, for a later run into the same dir",
    ],
    "a verdict before the work is done": [
        "planted failure in the report step", "SIGTERM in the report step", "Ctrl-C in the summary step",
        "full disk writing summary.md", "full disk writing comparisons.json (summary absent)",
        "full disk from comparisons.json on (no summary at all)",
        "SIGTERM to a real `specparity run` process (test_crash_safety)",
    ],
    "rough edges": [
        "SIGTERM: run", "SIGTERM: ab", "SIGTERM: bench", "SIGTERM: regen", "SIGTERM: generate",
        "SIGTERM: audit", "SIGTERM: grade",
        "--out with a 300-byte component", "--out past PATH_MAX", "--trace with a 300-byte name",
        "--json past PATH_MAX", "--report with a 300-byte component", "record --out 300-byte component",
        "long model dir name -> case ids past 255 bytes as file names",
        "--seed 2^70 (generate, run, bench)", "--out ~nosuchuser/x", "--target ~nosuchuser/m",
        "--prompts-file ~nosuchuser/p", "--trace ~nosuchuser/t", "report ~nosuchuser",
        "config.json without model_type", "config.json with a string vocab_size",
        "config.json with vocab_size true", "config.json with a string eos_token_id",
        "config.json with text_config.hidden_size 0", "case id starting with '.' (run)",
        "case id starting with '.' (grade)",
    ],
}


def test_output_safety_catalogue_counts() -> None:
    counts = {k: len(v) for k, v in OUTPUT_SAFETY.items()}
    print("output safety:", counts, "total", sum(counts.values()))
    assert sum(counts.values()) >= 50, counts


# Round three (issue 35): the new surfaces (sessions, grammar, checkpoint headers, the
# environment) and the harness's own outputs as input.
ROUND_THREE: dict[str, list[str]] = {
    "every writer owns its destination (test_hostile_outdir.py, the sweep from the CLI parser)": [
        "a writing flag without an output type fails the sweep", "run --sessions --out DIR with a user's file",
        "run --sessions into a finished run's folder: set aside, every file listed, the next run takes it",
        "x each writer (run, run --sessions x2, grade, bench, ab, record --out, regen --report, "
        "regen --golden-dir, report, generate --trace, record --trace, audit --json): a foreign file, "
        "a held lock, its files listed after, a plain run into the folder after",
    ],
    "header params through the flags' validators (test_hostile_traces.py)": [
        "mtp_conventions bad value", "mtp_conventions unknown name", "mtp_conventions a string",
        "grammar.reasoning_end empty", "grammar.reasoning_end 300 chars", "grammar.kind unknown",
        "grammar a list", "min_tokens -1", "min_tokens a string", "rng unknown", "min_p 2",
        "confidence_threshold a string", "logits_processors negative", "logits_processors bias inf",
        "stop_sequences negative id", "target.path ~nosuchuser", "grade FILE (exit 2)",
        "grade a missing folder", "grade ~nosuchuser",
    ],
    "checkpoints that lie (test_hostile_model_dirs.py)": [
        "offsets disagree with the shape", "negative offset", "negative shape", "unknown dtype",
        "offsets not a pair", "overlapping tensors", "quantization a string", "quantization a list",
        "quantization.bits 0", "quantization without group_size", "quantization_config a number",
        "vocab_size 10^9", "hidden_size 10^6", "num_hidden_layers 10^6 (refused at once)",
        "a shard the index names but the folder lacks", "an index shard outside the folder",
        "config.json a symlink loop", "config.json a dangling symlink", "config.json nested 100000 deep",
        "a DeepSeek-style native-MTP checkpoint as the user's own target (loads as its trunk)",
    ],
    "the environment (test_hostile_env.py)": [
        "every declared SPECPARITY_* variable malformed (counted at run time)",
        "SPECPARITY_ZOO_DIR ~nosuchuser", "SPECPARITY_ZOO_DIR a file / under a file",
        "SPECPARITY_PROGRESS_INTERVAL inf / -1", "SPECPARITY_MAX_LINE_BYTES 0 / 1e9",
        "SPECPARITY_EMULATE_NONEXACT nan / -0.1", "no SPECPARITY_* read outside traces/env.py",
    ],
    "flags honoured in every mode or refused (test_hostile_cli_args.py)": [
        "every run flag on the zoo --sessions and user --sessions paths",
        "run --sessions --grammar", "a sessions suite with a grammar",
        "run --sessions follow-ups past the context (zoo, and a 1500-token prompt)",
        "run --sessions --max-cases on the zoo", "--seed, --temps, --max-tokens reach the fill cases",
        "--mtp-conventions a name twice", "--mtp-conventions an empty item", "--mtp-conventions unknown name",
        "--repetition-penalty nan", "--presence-penalty inf", "--logit-bias 5=nan", "diff --eps nan",
        "generate/record --kv-group-size the head dim rejects (before any token)",
    ],
    "input files (test_hostile_prompts_and_suites.py)": [
        "NUL in a text line", "NUL in a JSONL text", "NUL in a JSON array text", "NUL in a prompt id",
        "suite processors rpnanc20 / ppinf / fp-infc4 / lb5=nan / lb5=inf,6=1",
        "a 5 MB grammar (generate, suite)", "a trace line past the validator's limit (writer)",
        "a grammar admitting only the empty output (generate, run, record)",
    ],
    "the harness's own outputs (test_hostile_own_outputs.py)": [
        "run engine spec / plain", "generate two-model / plain / ngram / sampled / processors / "
        "min-tokens+rng / grammar / kv / native-mtp (own target) / conventions / dspark / mtp head",
        "record --runner mlx_lm", "run --sessions warm and cold traces", "a warm trace's prefill digest tampered",
        "a warm trace's round tampered", "no fill traces written",
    ],
}


def test_round_three_catalogue_counts() -> None:
    counts = {k: len(v) for k, v in ROUND_THREE.items()}
    print("round three:", counts, "total", sum(counts.values()))
    assert sum(counts.values()) >= 75, counts


def test_robustness_doc_names_tests_that_exist() -> None:
    """docs/robustness.md's promise table names its tests as ``module::test``: each exists."""
    import re

    from tests.helpers import ROOT

    doc = (ROOT / "docs" / "robustness.md").read_text(encoding="utf-8")
    table = doc[doc.index("## Promises per command"):]
    named = set(re.findall(r"`(\w+)::(test_\w+)`", table))
    assert len(named) >= 30, named
    missing = []
    for module, test in sorted(named):
        text = (ROOT / "tests" / f"test_hostile_{module}.py").read_text(encoding="utf-8")
        if f"def {test}(" not in text:
            missing.append(f"{module}::{test}")
    assert not missing, missing
    assert "outdir::sweep" in table


# Round four (issue 41), the hostile helper's part: writers outside their folder, finite numbers
# refused for their case id, and the older items still open.
ROUND_FOUR_WRITERS_AND_NUMBERS: dict[str, list[str]] = {
    "every python -m module and tool owns its destination (test_hostile_module_writers.py, from the "
    "modules' own parsers)": [
        "a writing flag of any module without an output type fails the enumeration",
        "x each module writer (grading.engines, grading.http_servers, grading.native_mtp_conventions, "
        "grading.vlm_batched, tools/mutation.py, zoo.build, zoo.train, reports.scoreboard DIR; "
        "measure.bench_batched --json pending): a user's file refused before the work, a file where "
        "a folder goes refused at parse time",
    ],
    "the mutation tool (test_hostile_mutation_tool.py)": [
        "catalogue TOML syntax", "catalogue not UTF-8", "tests a string", "id a number", "a table field",
        "tests empty", "tests an option", "a missing field", "mutation not tables", "a stray top-level key",
        "duplicate ids", "file absolute", "file ../", "file with an inner ..", "file ~/", "file untracked",
        "a test path outside the tree", "a link leading outside the tree", "--timeout nan / inf / -1 / 0 / ten",
        "--out holding a user's mutation.md / notes.txt", "kill -9 while a plant is in place",
    ],
    "finite numbers and duplicate processors (test_processor_tags.py)": [
        "every finite float through the tag (property)", "every finite processor setting (property)",
        "rp1.2+rp1.3 / lb twice / pp twice / h twice", "a suite with a processor twice",
        "--presence-penalty 1e20 / --logit-bias 5=1e300 / --repetition-penalty 12345678901234567890 "
        "(generate, then grade its trace)", "lb5=1e300+pp1e20 in a suite",
    ],
    "older items (test_hostile_round4.py)": [
        "a header logit_bias id outside the vocabulary (before the model loads)",
        "grade RUN/batched (batch.jsonl)", "a 5,000-character header case_id",
        "a 400-character header grammar name", "tokenizer.json {}",
        "a 4-bit checkpoint without its quantization block",
    ],
}


def test_round_four_writers_and_numbers_catalogue_counts() -> None:
    counts = {k: len(v) for k, v in ROUND_FOUR_WRITERS_AND_NUMBERS.items()}
    print("round four (writers, numbers):", counts, "total", sum(counts.values()))
    assert sum(counts.values()) >= 30, counts
