"""Docs that cannot drift.

- Every repository path named in ``README.md``, ``docs/*.md``, and the docstrings, comments and
  (outside the test suites) string constants of the code exists: a path whose first part is a
  top-level entry of the checkout (``engine/…``, ``tests/…``, ``docs/…``) and that ends in a file
  suffix or ``/``; a Markdown link's target relative to its page. A path that names something
  else (a run folder's layout, another project's file) is allowlisted below with the reason.
- Every dotted name of a project module in the same texts (``engine.backend.arithmetic``) names a
  module, or a module and a name defined at its top level (read with ``ast``, nothing imported).
- Every ``specparity …`` command in the README's and the docs' shell blocks parses with the real
  parser (``specparity.cli.entry.build_parser``): a concrete command is parsed whole (value
  checks that read the filesystem left out, choices and required flags kept); a synopsis line
  (``[--out DIR]``, ``a|b``, ``...``) names only subcommands and flags that exist.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("traces", "engine", "zoo", "oracles", "subjects", "reports", "specparity", "tools",
             "tests", "conformance")
TEST_DIRS = ("tests", "conformance")  # their string constants are test data (paths inside run folders)
SUFFIX = r"(?:py|md|toml|json|jsonl|yml|yaml|ini|txt|lark|regex|html|cfg|sh)"
PATH = re.compile(r"(?<![\w./~$<>-])((?:\.github|\.ci|[A-Za-z_][\w-]*)/[\w./-]*[\w/])")

# (file naming it, path): why it is not a file of this checkout.
PATHS_ALLOWED: dict[tuple[str, str], str] = {
    ("traces/writer.py", "traces/myengine/p1.jsonl"): "a run folder's layout (OUT/traces/<runner>/), not the repo's traces/",
    ("engine/batched_check.py", "tests/v1/e2e/spec_decode/test_stochastic_batch_invariance.py"): "vLLM's file",
    ("subjects/dflash_mlx.py", "engine/events.py"): "dflash-mlx's own module (dflash_mlx/engine/events.py)",
    ("docs/goldens.md", "traces/golden/.regen-journal.json"): "written by a regen while it runs, never committed",
    # docs/runners.md "Adding a runner" is being rewritten by the 'served' helper (its example file).
    ("docs/runners.md", "specparity/runners/my_server.py"): "the example file a reader creates",
}


def _top_level() -> set[str]:
    return {p.name for p in ROOT.iterdir() if p.name not in (".git", "runs", ".tox")}


def named_paths(text: str, top: set[str]) -> Iterator[tuple[str, int]]:
    """``(path, line within text)`` of every repository-looking path in ``text``."""
    for m in PATH.finditer(text):
        raw = m.group(1)
        p = raw.rstrip(".")
        if p.split("/")[0] not in top:
            continue
        if not (re.search(r"\." + SUFFIX + r"$", p) or raw.endswith("/")):
            continue
        yield p, text.count("\n", 0, m.start()) + 1


def _docstrings(tree: ast.AST) -> Iterator[tuple[str, int]]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                yield body[0].value.value, body[0].lineno


def code_texts(path: Path, root: Path = ROOT) -> Iterator[tuple[str, int]]:
    """The docstrings and comments of a module; outside the test suites every string constant."""
    src = path.read_text(encoding="utf-8")
    tests = path.relative_to(root).parts[0] in TEST_DIRS
    if tests:
        yield from _docstrings(ast.parse(src))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT or (not tests and tok.type == tokenize.STRING):
            yield tok.string, tok.start[0]
        elif not tests and tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            yield tok.string, tok.start[0]


def doc_pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def missing_paths(root: Path = ROOT) -> list[str]:
    """``FILE:LINE: PATH`` for every named path that does not exist."""
    top = {p.name for p in root.iterdir() if p.name not in (".git", "runs", ".tox")}
    out: list[str] = []

    def check(where: Path, text: str, line0: int, base: Path | None) -> None:
        rel = where.relative_to(root).as_posix()
        for p, ln in named_paths(text, top):
            if (root / p).exists() or (base is not None and (base / p).exists()):
                continue
            if (rel, p) not in PATHS_ALLOWED:
                out.append(f"{rel}:{line0 + ln - 1}: names {p}, which does not exist")

    for page in doc_pages(root):
        text = page.read_text(encoding="utf-8")
        check(page, text, 1, page.parent)
        for m in re.finditer(r"\]\(([^)#\s]+)", text):  # Markdown links, relative to the page
            target = m.group(1)
            if not re.match(r"^[a-z]+:", target) and not (page.parent / target).exists():
                out.append(f"{page.relative_to(root).as_posix()}:{text.count(chr(10), 0, m.start()) + 1}: "
                           f"links {target}, which does not exist")
    for d in CODE_DIRS:
        for f in sorted((root / d).rglob("*.py")):
            for text, line in code_texts(f, root):
                check(f, text, line, None)
    return sorted(set(out))


# ------------------------------------------------------------------ dotted names
DOTTED = re.compile(r"(?<![\w./{-])((?:traces|engine|zoo|oracles|subjects|reports|specparity)(?:\.[A-Za-z_]\w*)+)(?![\w*/-])")


def _defined(path: Path) -> set[str]:
    """Names bound at a module's top level (functions, classes, assignments, imports), at any
    depth of its top-level ``if``/``try`` blocks."""
    out: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        stack: list[ast.AST] = [node]
        while stack:
            n = stack.pop()
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
                continue
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                out.update((a.asname or a.name).split(".")[0] for a in n.names)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            stack.extend(ast.iter_child_nodes(n))
    return out


def dotted_problem(ref: str, mods: dict[str, Path], cache: dict[str, set[str]]) -> str | None:
    """Why ``ref`` (``pkg.mod.name...``) names nothing, or None."""
    parts = ref.split(".")
    for k in range(len(parts), 0, -1):
        mod = ".".join(parts[:k])
        if mod in mods:
            rest = parts[k:]
            if not rest or rest[0] == "__init__":
                return None
            if mod not in cache:
                cache[mod] = _defined(mods[mod])
            return None if rest[0] in cache[mod] else f"{mod} defines no {rest[0]}"
    return None


def missing_names(root: Path = ROOT) -> list[str]:
    """``FILE:LINE: REF`` for every dotted project name that names nothing."""
    from tests.import_graph import modules

    mods = modules(root, [d for d in ("traces", "engine", "zoo", "oracles", "subjects", "reports", "specparity")
                          if (root / d).is_dir()])
    cache: dict[str, set[str]] = {}
    out = []

    def check(where: Path, text: str, line0: int) -> None:
        for m in DOTTED.finditer(text):
            why = dotted_problem(m.group(1), mods, cache)
            if why:
                out.append(f"{where.relative_to(root).as_posix()}:{line0 + text.count(chr(10), 0, m.start())}: "
                           f"{m.group(1)}: {why}")

    for page in doc_pages(root):
        check(page, page.read_text(encoding="utf-8"), 1)
    for d in CODE_DIRS:
        for f in sorted((root / d).rglob("*.py")):
            for text, line in code_texts(f, root):
                check(f, text, line)
    return sorted(set(out))


# ------------------------------------------------------------------ commands


def shown_commands(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """``(page, line, command)`` of every ``specparity …`` line in a shell block (continuations
    joined, a leading ``$ `` or ``… && `` and a trailing ``# comment`` dropped)."""
    out = []
    for page in doc_pages(root):
        text = page.read_text(encoding="utf-8")
        for block in re.finditer(r"^```(?:sh|bash|shell|console)?\n(.*?)^```", text, re.S | re.M):
            first = text.count("\n", 0, block.start(1)) + 1
            lines = block.group(1).split("\n")
            i = 0
            while i < len(lines):
                start, cmd = i, lines[i]
                while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
                cmd = re.sub(r"^\s*\$\s+", "", cmd)
                m = re.search(r"(?:^|&&\s*)(specparity\s+[a-z].*)$", cmd.strip())
                if not m or re.match(r"specparity\s+[\w-]+:", m.group(1)):  # output such as "specparity ab: error"
                    continue
                body = re.sub(r"\s+#\s.*$", "", m.group(1)).strip()
                out.append((page.relative_to(root).as_posix(), first + start, body))
    return out


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _flags(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def _lenient(p: argparse.ArgumentParser) -> None:
    """Value checks that read the filesystem or the zoo left out (``type`` None), builtins kept."""
    for a in p._actions:
        if a.type not in (None, int, float, str):
            a.type = None
        for sub in _subparsers(p).values():
            _lenient(sub)


SYNOPSIS = re.compile(r"[\[\]|]|\.\.\.|…|<[^>]*>")


def command_problem(cmd: str, parser: argparse.ArgumentParser) -> str | None:
    """Why ``cmd`` (``specparity …``) does not parse, or names a subcommand or flag that does not
    exist; None when it is fine."""
    rest = cmd.split(None, 1)[1] if " " in cmd else ""
    if SYNOPSIS.search(cmd):
        words = re.sub(r"<[^>]*>", "X", rest).split()
        subs = _subparsers(parser)
        if re.match(r"^[\w-]+(\s*\|\s*[\w-]+)+", rest):  # "run|generate|record ..." or "regen | report"
            alts = re.match(r"^[\w-]+(\s*\|\s*[\w-]+)+", rest).group(0)
            names = [n.strip() for n in alts.split("|")]
            words = rest[len(alts):].split()
        else:
            names = [words[0]] if words else []
            words = words[1:]
        targets = []
        for n in names:
            if n not in subs:
                return f"no subcommand {n!r}"
            sp = subs[n]
            nested = _subparsers(sp)
            if nested and words and words[0] in nested:
                sp = nested[words[0]]
            targets.append((n, sp))
        for n, sp in targets:
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", " ".join(words)):
                if flag not in _flags(sp) | {"--help"}:
                    return f"`specparity {n}` has no flag {flag}"
        return None
    try:
        argv = shlex.split(rest)
    except ValueError as exc:
        return f"not a shell command ({exc})"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    return None


def real_parser() -> argparse.ArgumentParser:
    from specparity.cli.entry import build_parser

    p = build_parser()
    _lenient(p)
    return p


def command_problems(root: Path = ROOT) -> list[str]:
    parser = real_parser()
    out = []
    for page, line, cmd in shown_commands(root):
        why = command_problem(cmd, parser)
        if why:
            out.append(f"{page}:{line}: `{cmd}`: {why}")
    return out


# ------------------------------------------------------------------ the checks


def test_every_named_path_exists() -> None:
    assert missing_paths() == []


def test_every_named_module_and_name_exists() -> None:
    assert missing_names() == []


def test_every_allowlisted_path_is_still_named_and_still_missing() -> None:
    """The allowlist only shrinks: an entry whose text changed or whose file now exists is named."""
    stale = []
    for (where, p), _why in PATHS_ALLOWED.items():
        text = (ROOT / where).read_text(encoding="utf-8")
        if p not in text or (ROOT / p).exists():
            stale.append(f"{where}: {p}")
    assert stale == []


def test_every_shown_command_parses() -> None:
    cmds = shown_commands()
    assert len(cmds) >= 40, f"only {len(cmds)} commands found: the extraction broke"
    assert command_problems() == []


# ------------------------------------------------------------------ plants


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_a_drifted_path_in_a_doc_a_docstring_a_comment_or_a_link_is_named(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "README.md": "See `engine/executor.py` and [fill](docs/fill.md), `runs/latest/summary.md` (output).\n",
        "docs/a.md": "# A\n\nThe tests are `conformance/test_vlm_batched.py`; [up](../README.md).\n",
        "engine/executor.py": '"""Faithful to mlx-lm ``mlx_lm/generate.py`` (its file, not ours)."""\n',
        "engine/x.py": 'def f():\n    """Its rows: ``subjects/server_rows.py``."""\n    # see engine/gone.py\n'
                       '    return "tests/missing_case.py"\n',
        "tests/t.py": 'X = "engine/data_in_a_run.jsonl"  # a test\'s data: not checked\n',
        "conformance/test_batched_references.py": "",
        "subjects/served.py": "",
    })
    got = missing_paths(root)
    assert got == [
        "README.md:1: links docs/fill.md, which does not exist",
        "README.md:1: names docs/fill.md, which does not exist",
        "docs/a.md:3: names conformance/test_vlm_batched.py, which does not exist",
        "engine/x.py:2: names subjects/server_rows.py, which does not exist",
        "engine/x.py:3: names engine/gone.py, which does not exist",
        "engine/x.py:4: names tests/missing_case.py, which does not exist",
    ], got


def test_a_dotted_name_that_moved_is_named(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "engine/__init__.py": "", "engine/backend.py": "def arithmetic(): ...\nBOUND = 1\n",
        "engine/cache_compare.py": "from engine.backend import arithmetic as reexported\n",
        "docs/a.md": "See `engine.cache_compare.arithmetic` and `engine.backend.arithmetic`, `engine.backend`.\n",
        "engine/x.py": '"""Uses ``engine.cache_compare.reexported``, ``engine.backend.BOUND``, {engine.name}."""\n'
                       "# engine.backend.gone() was moved\n",
        "README.md": "",
    })
    assert missing_names(root) == [
        "docs/a.md:1: engine.cache_compare.arithmetic: engine.cache_compare defines no arithmetic",
        "engine/x.py:2: engine.backend.gone: engine.backend defines no gone",
    ]


def test_a_drifted_command_is_named_with_the_parsers_words() -> None:
    parser = real_parser()
    assert command_problem("specparity run --targets llama --gammas 1,2 --out /tmp/x", parser) is None
    assert command_problem("specparity run [--out DIR] [--targets ...] [--device cpu|gpu]", parser) is None
    assert command_problem("specparity run|generate|record ... --grammar FILE", parser) is None
    assert command_problem("specparity zoo list [--prompts-file FILE]", parser) is None
    why = command_problem("specparity run --no-such-flag 3", parser)
    assert why is not None and "unrecognized arguments: --no-such-flag" in why, why
    assert command_problem("specparity run [--no-such-flag N]", parser) == "`specparity run` has no flag --no-such-flag"
    assert command_problem("specparity regen | nosuch", parser) == "no subcommand 'nosuch'"
    why = command_problem("specparity diff A B --level nosuch", parser)
    assert why is not None and "invalid choice: 'nosuch'" in why, why


@pytest.mark.parametrize("page", ["README.md", "docs/references.md"])
def test_commands_are_found_in_the_pages(page: str) -> None:
    assert any(p == page for p, _, _ in shown_commands())
