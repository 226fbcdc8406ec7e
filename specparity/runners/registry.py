"""The runner registry: every runner declared once, in its own module of this package.

A runner is anything that produces a trace or is graded: our ``engine``, each
reference of ``oracles/`` (``kind="reference"``), each third-party engine of
``subjects/`` (``kind="subject"``) and each HTTP server row of ``subjects/server_rows.py``
(``kind="server"``). One :class:`Runner` declares its name (one spelling:
:data:`NAME_RULES`), kind, package (the trace header's ``runner`` block),
availability and install hint (written once: :meth:`Runner.availability` adds it
to every "not available" reason), the draft sources it implements and, per
source, the case options it implements (:data:`OPTIONS`), how it runs one case
(``run``) — or, for a runner that is not run per case, where it is exercised
instead — and its golden sets (:class:`GoldenSet`, ``traces/golden/<name>/``).

Every place that chooses or checks a runner asks this registry:
``specparity run`` and ``grade DIR`` (which references run a case, which are
skipped and why), ``record --runner``, ``grade --engine``, ``regen`` and the
golden manifest (:func:`golden_sets`), the ``--help`` lists of names. A
runner asked for a source or an option it does not declare refuses in one
line (:func:`unsupported`), never decodes plainly under a speculative label.

Adding a runner touches ONE file: a module ``specparity/runners/<name>.py``
that defines ``RUNNER = Runner(...)`` (or ``RUNNERS = (...)``); :func:`all_runners`
finds it. Its implementation stays in its own layer (``oracles/<name>.py``,
``subjects/<name>.py``, a server client) and never imports ``specparity``.
The recipe, with a server example: docs/runners.md.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

KINDS = ("engine", "reference", "subject", "server")

# One spelling per graded thing, said by its kind: ours and the references are Python identifiers
# (snake_case, the module they drive: ``oracles/<name>.py``); third-party engines and servers are
# their distribution's lowercase name, dash-separated (as pip and tox spell it: ``tox -e
# subject-<name>``, ``server-<name>``). So ``mlx_lm`` (mlx-lm's decode loops, in process) and
# ``mlx-lm`` (its HTTP server) are two graded things, and the spelling says which. A golden set
# is its runner's name or ``<runner>_<what>``. ``traces/known_divergences.toml`` keys its entries
# by exactly these names (tests/test_registry.py).
SNAKE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")
DASHED = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
NAME_RULES: dict[str, tuple[re.Pattern[str], str]] = {
    "engine": (SNAKE, "snake_case (lowercase letters, digits, single underscores)"),
    "reference": (SNAKE, "snake_case (lowercase letters, digits, single underscores)"),
    "subject": (DASHED, "its distribution's lowercase name, dash-separated (no underscores)"),
    "server": (DASHED, "its distribution's lowercase name, dash-separated (no underscores)"),
}

# option name -> whether a case uses it. A runner implements an option by naming it under the
# source in ``Runner.sources``; a case that uses an option its runner lacks is refused, never run
# with the option silently dropped. A new case field adds one line here (and its name where
# the runners that honour it are declared).
OPTIONS: dict[str, Callable[[Any], bool]] = {
    "sampling": lambda c: c.temperature > 0,
    "top_p": lambda c: c.top_p > 0,
    "top_k": lambda c: c.top_k > 0,
    "min_p": lambda c: getattr(c, "min_p", 0.0) > 0,
    "eos_ids": lambda c: c.eos_ids is not None,
    "stop_sequences": lambda c: bool(c.stop_sequences),
    "logits_processors": lambda c: bool(c.processors),
    "kv_cache": lambda c: c.kv_bits is not None,  # kv_bits / kv_group_size / quantized_kv_start
    "grammar": lambda c: bool(getattr(c, "grammar", "")),  # engine/grammar.py (docs/grammar.md)
    "reasoning_end": lambda c: bool(getattr(c, "reasoning_end", "")),  # the grammar after a marker
    "min_tokens": lambda c: bool(getattr(c, "min_tokens", 0)),  # EOS suppressed per output position
    "rng_position": lambda c: getattr(c, "rng", "stream") != "stream",  # a key per (seed, position)
}

PLAIN = "plain"  # the "source" of a case without a drafter (plain decode)


class RunnerUnsupported(ValueError):
    """A runner was asked for a source or an option it does not implement (usage: exit 2)."""


@dataclass(frozen=True)
class CaseRun:
    """What a runner's ``run`` gets: the case, its loaded models and its prompt ids.

    ``target``/``draft`` are ``engine.models.load`` results (``.model``, ``.tokenizer``,
    ``.eos_ids``); ``draft`` is None for model-free sources and for head/block drafters,
    whose directory is ``dpath``.
    """

    case: Any
    target: Any
    draft: Any
    ids: list[int]
    tpath: Path
    dpath: Path | None

    @property
    def eos_ids(self) -> list[int]:
        """The case's EOS ids, else the target tokenizer's."""
        return list(self.case.eos_ids) if self.case.eos_ids is not None else list(self.target.eos_ids)


@dataclass(frozen=True)
class GoldenSet:
    """A set of committed golden traces a runner declares: ``traces/golden/<name>/<case>.jsonl``
    (``specparity/goldens/manifest.py`` keeps their manifest and staleness).

    Attributes:
        name: The golden directory: the runner's own name (goldens ``run_case`` records with the
            runner) or ``<runner>_<what>`` (goldens ``produce`` records, e.g. a reference's
            drafter inside its own loop).
        package: The distribution whose version (and VCS commit) is an input.
        code_modules: Modules or packages whose source is the runner's code (a package means
            all its ``.py`` files, recursively; ``pkg.__init__`` means the package's
            ``__init__.py`` alone).
        cases: The cases that have goldens (``specparity/cases/golden_cases.py``).
        code_exclude: Sub-packages left out of ``code_modules``.
        supports: Filter on ``cases`` (a reference that cannot run a case has no golden for
            it, rather than a golden of an error).
        oracle: True for a reference's goldens (what the live engine is compared against).
        identity: For a reference that is not an installed distribution (DeepSpec: a checkout
            named by ``DEEPSPEC_PATH``): its ``{"version", "commit"}`` (None where unknown here)
            instead of the package metadata.
        produce: Makes the golden's records of a case (header to footer) instead of
            ``specparity.runners.run_case`` (``specparity/runners/draft_goldens.py``).
    """

    name: str
    package: str
    code_modules: tuple[str, ...]
    cases: Callable[[], list[Any]]
    code_exclude: tuple[str, ...] = ()
    supports: Callable[[Any], bool] = lambda case: True
    oracle: bool = True
    identity: Callable[[], dict[str, str | None]] | None = None
    produce: Callable[[Any], list[dict[str, Any]]] | None = None


@dataclass(frozen=True)
class Runner:
    """One runner's declaration.

    Attributes:
        name: The name ``--runner``/``--runners``/``--engine`` take (unique).
        kind: ``engine``, ``reference``, ``subject`` or ``server``.
        package: The distribution named in the trace header (and whose version it records).
        sources: Draft source (``plain`` for plain decode, ``two-model``, ``ngram``, ...) ->
            the :data:`OPTIONS` it implements on that source.
        run: Runs one case, returns its records after the header (rounds/plain records and
            footer); None for a runner that is not run per case.
        available: ``() -> (ok, reason)``: what is missing (:meth:`availability` adds the
            install hint).
        install_hint: How to get it: the one place it is written; every "not available"
            message the registry gives ends with it.
        elsewhere: For a runner not run per case: where it is exercised instead.
        header: ``() -> the header's runner block``; default ``{name, package, version}``.
        rank: Position in listings and in the run order (then by name).
        requires: Options a case must use for this runner to run it (a grammar-only reference).
        goldens: The golden sets it declares (:class:`GoldenSet`).
    """

    name: str
    kind: str
    package: str
    sources: Mapping[str, frozenset[str]] = field(default_factory=dict)
    run: Callable[[CaseRun], list[dict[str, Any]]] | None = None
    available: Callable[[], tuple[bool, str]] = lambda: (True, "ok")
    install_hint: str = ""
    elsewhere: str | None = None
    header: Callable[[], dict[str, Any]] | None = None
    rank: int = 100
    requires: frozenset[str] = frozenset()
    goldens: tuple[GoldenSet, ...] = ()

    @property
    def per_case(self) -> bool:
        return self.run is not None

    def availability(self) -> tuple[bool, str]:
        """(available here, reason): ``available()``'s reason ending with the install hint."""
        ok, why = self.available()
        if ok or not self.install_hint or self.install_hint in why:
            return ok, why
        return False, f"{why}; install: {self.install_hint}"

    def runner_info(self) -> dict[str, Any]:
        """The trace header's ``runner`` block."""
        if self.header is not None:
            return self.header()
        return {"name": self.name, "package": self.package, "version": metadata.version(self.package)}

    def describe(self) -> str:
        """``two-model (sampling, top_p, ...); plain (...)``: what it implements, for messages."""
        return "; ".join(f"{s} ({', '.join(sorted(o)) or 'no options'})" for s, o in self.sources.items())


def sources(options: Iterable[str], *names: str) -> dict[str, frozenset[str]]:
    """``{source: options}`` for several sources that implement the same options."""
    opts = frozenset(options)
    unknown = opts - set(OPTIONS)
    if unknown:
        raise ValueError(f"unknown case option(s) {sorted(unknown)}; known: {', '.join(OPTIONS)}")
    return {n: opts for n in names}


@cache
def all_runners() -> dict[str, Runner]:
    """Every declared runner by name: ``RUNNER``/``RUNNERS`` of each module of this package."""
    import specparity.runners as pkg

    found: list[Runner] = []
    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name.startswith("_") or mod.name == "registry":
            continue
        m = importlib.import_module(f"{pkg.__name__}.{mod.name}")
        found += [*getattr(m, "RUNNERS", ()), *([m.RUNNER] if hasattr(m, "RUNNER") else [])]
    out: dict[str, Runner] = {}
    for r in sorted(found, key=lambda r: (r.rank, r.name)):
        check_declaration(r)
        if r.name in out:
            raise ValueError(f"runner {r.name!r} is declared twice")
        out[r.name] = r
    check_golden_names(out.values())
    return out


def check_declaration(r: Runner) -> None:
    """A declaration's own consistency (ValueError naming the runner and the field)."""
    if not r.name or r.name != r.name.strip() or "," in r.name or r.name == "all":
        raise ValueError(f"runner name {r.name!r}: must be non-blank, without commas, not 'all'")
    if r.kind not in KINDS:
        raise ValueError(f"runner {r.name}: kind {r.kind!r} is not one of {', '.join(KINDS)}")
    rule, said = NAME_RULES[r.kind]
    if not rule.fullmatch(r.name):
        raise ValueError(f"runner name {r.name!r}: a {r.kind}'s name is {said}")
    for g in r.goldens:
        if g.name != r.name and not (g.name.startswith(f"{r.name}_") and SNAKE.fullmatch(g.name)):
            raise ValueError(f"runner {r.name}: golden set {g.name!r} must be named {r.name!r} "
                             f"or {r.name}_<what> (snake_case)")
        if g.produce is None and (g.name != r.name or r.run is None):
            raise ValueError(f"runner {r.name}: golden set {g.name!r} has no produce, so run_case "
                             f"records it: it must be named {r.name!r} and the runner run per case")
    for src, opts in r.sources.items():
        bad = set(opts) - set(OPTIONS)
        if bad:
            raise ValueError(f"runner {r.name}: source {src}: unknown option(s) {sorted(bad)}")
    if r.run is not None and not r.sources:
        raise ValueError(f"runner {r.name}: a per-case runner must declare the sources it runs")
    if r.run is None and not r.elsewhere:
        raise ValueError(f"runner {r.name}: not run per case: say where it is exercised (elsewhere)")


def check_golden_names(runners: Iterable[Runner]) -> None:
    """Golden set names are unique, and none is the name of another runner (ValueError)."""
    owner: dict[str, str] = {}
    runner_names = {r.name for r in runners}
    for r in runners:
        for g in r.goldens:
            if g.name in owner:
                raise ValueError(f"golden set {g.name!r} is declared by {owner[g.name]} and {r.name}")
            if g.name != r.name and g.name in runner_names:
                raise ValueError(f"runner {r.name}: golden set {g.name!r} is the name of another runner")
            owner[g.name] = r.name


def golden_sets() -> dict[str, GoldenSet]:
    """Every declared golden set by name (the registry's order): ``specparity regen``, the
    manifest and the golden tests ask this."""
    return {g.name: g for r in all_runners().values() for g in r.goldens}


def golden_owner(name: str) -> Runner:
    """The runner that declares golden set ``name`` (its availability is the set's)."""
    for r in all_runners().values():
        if any(g.name == name for g in r.goldens):
            return r
    raise RunnerUnsupported(f"no golden set {name!r}; known: {', '.join(golden_sets())}")


def names(kind: str | None = None, *, per_case: bool = False) -> list[str]:
    """Declared runner names (of ``kind``; only those run per case): every list of runner names
    (``--help`` texts, docs checked by tests/test_registry.py) is this."""
    return [n for n, r in all_runners().items()
            if (kind is None or r.kind == kind) and (r.per_case or not per_case)]


def get(name: str, kind: str | Iterable[str] | None = None, what: str = "runner") -> Runner:
    """The runner ``name`` (RunnerUnsupported, one line, for a blank or unknown name)."""
    kinds = (kind,) if isinstance(kind, str) else tuple(kind) if kind is not None else None
    choices = [n for n, r in all_runners().items() if kinds is None or r.kind in kinds]
    if not name or not name.strip():
        raise RunnerUnsupported(f"empty {what} name; known: {', '.join(choices)}")
    r = all_runners().get(name)
    if r is None or (kinds is not None and r.kind not in kinds):
        extra = f" ({r.name} is a runner of kind {r.kind})" if r is not None else ""
        raise RunnerUnsupported(f"unknown {what} {name!r}{extra}; known: {', '.join(choices)}")
    return r


def case_source(case: Any) -> str:
    return PLAIN if case.drafter is None else str(case.source)


def case_options(case: Any) -> list[str]:
    """The :data:`OPTIONS` a case uses."""
    return [o for o, uses in OPTIONS.items() if uses(case)]


def unsupported(runner: str | Runner, case: Any) -> str | None:
    """Why ``runner`` cannot run ``case`` (a one-line reason naming the runner, the case and
    what is missing), or None when it implements the case's source and every option it uses."""
    r = runner if isinstance(runner, Runner) else get(runner)
    if r.run is None:
        return f"{r.name} is not run per case: {r.elsewhere}"
    src = case_source(case)
    if src not in r.sources:
        return (f"{r.name} does not implement the {src} source (it implements: "
                f"{', '.join(r.sources)}); case {case.case_id}")
    needed = [o for o in sorted(r.requires) if not OPTIONS[o](case)]
    if needed:
        return f"{r.name} runs only cases with {', '.join(needed)}; case {case.case_id}"
    missing = [o for o in case_options(case) if o not in r.sources[src]]
    if missing:
        return (f"{r.name} does not implement {', '.join(missing)} on the {src} source "
                f"(it implements: {', '.join(sorted(r.sources[src])) or 'no options'}); "
                f"case {case.case_id}")
    return None


def supports(runner: str | Runner, case: Any) -> bool:
    return unsupported(runner, case) is None


def availability(name: str) -> tuple[bool, str]:
    """(available here, reason ending with the install hint) of a declared runner."""
    return get(name).availability()


def run_availability(name: str) -> tuple[bool, str]:
    """(usable per case by ``specparity run``/``record``/``grade``, reason): available AND per case."""
    r = get(name)
    if r.run is None:
        return False, f"skipped by `specparity run`: {r.elsewhere}"
    return r.availability()


def package_version(dist: str) -> str | None:
    """Installed version of distribution ``dist``, or None when absent."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def oracle_availability(module: str) -> Callable[[], tuple[bool, str]]:
    """A reference's availability: ``oracles.availability(module)`` (looked up at call time;
    its reason says what is missing, the declaration's ``install_hint`` how to get it)."""

    def check() -> tuple[bool, str]:
        import oracles

        return oracles.availability(module)

    return check
