"""Suites: which cases ``specparity run`` runs, from flags or a TOML file.

A suite is a list of pairs, each expanded over prompts x gammas x sampling
settings into :class:`specparity.cases.case.Case` s. The zoo matrix is the built-in
default suite (:func:`specparity.jobs.run.zoo_cases`); ``run --target/--draft`` is a
one-pair suite; ``run --suite FILE`` reads TOML (``tomllib``)::

    # top-level keys are defaults for every [[pair]]; a pair may override any
    gammas = [1, 3]
    max_tokens = 32
    prompts_file = "prompts.jsonl"     # relative to the suite file; or zoo_prompts = 8 (zoo pairs)
    sampling = [{temperature = 0.0}, {temperature = 0.8, top_p = 0.9, seed = 1}]
    # min_p = 0.1 in a sampling table: tokens below 0.1 x the top token's probability dropped
    # logits processors per sampling table (engine.sampler.ProcessorParams tag form), e.g.
    # {temperature = 0.0, processors = "rp1.3c64+lb5=1.5+hlast"}; min_tokens = 8 (EOS suppressed
    # before 8 generated tokens), rng = "position" (a key per (seed, output position):
    # sampled speculative output == plain decode; default "stream", mlx-lm's)
    eos_ids = [1]                      # default: the tokenizer's own EOS set
    stop_ids = [[5, 6]]                # stop sequences as token ids
    stop_strings = ["la me"]           # stop sequences as text (target's tokenizer)
    truncate = false                   # true: over-long prompts keep their tail (warning)
    chat_template = false              # true: text prompts through the target tokenizer's template
    kv_bits = 4                        # quantized KV (mlx-lm kv_bits); with kv_group_size = 32,
    quantized_kv_start = 0             #   ... (defaults 64 / 5000); head dim must be a multiple
    rotating = "exact"                 # rotating caches past the ring wrap (default "guard")
    sessions = true                    # top level only: run prompt-cache sessions instead
                                       #   (or a list, ["multi-turn", "regenerate"]; docs/prompt-cache.md)

    [[pair]]
    target = "llama"                   # a zoo target, or a path to an mlx-lm model dir
    drafter = "twin"                   # a zoo drafter, or a path; omit for plain / ngram
    sources = ["two-model"]            # default: detected from the drafter (§3 order)

Every value goes through the validator of the flag that sets the same thing
(``specparity.cli.args.check_value``: ``gammas`` as ``--gammas``, ``seed`` as
``--seed``, ``prompts_file`` as ``--prompts-file``, ...), so a suite accepts
exactly what the flags accept. ``suite_cases(..., max_cases=N)`` refuses a suite
of more than N cases before any prompt is encoded.

Case ids: a zoo pair keeps its zoo ids; a model path is named by
:func:`specparity.cases.case.model_label` (directory name + short digest), a
non-two-model drafter path is prefixed by its source kind.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specparity.cases.case import DEFAULT_GAMMAS, Case, model_label, pick_prompts

__all__ = ["PairSpec", "Sampling", "SuiteError", "load_suite", "pair_cases", "suite_cases"]

_SUITE_KEYS = {"gammas", "max_tokens", "prompts_file", "zoo_prompts", "sampling", "eos_ids",
               "stop_ids", "stop_strings", "truncate", "chat_template", "kv_bits", "kv_group_size",
               "quantized_kv_start", "rotating", "grammar", "reasoning_end"}
_PAIR_KEYS = _SUITE_KEYS | {"target", "drafter", "source", "sources"}
_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "seed", "processors", "min_tokens", "rng"}


class SuiteError(ValueError):
    """A suite (file or flags) is malformed: one line naming the key."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int = 0
    processors: str = ""  # engine.sampler.ProcessorParams.tag() form; '' = none
    min_tokens: int = 0  # engine.pipeline stage 2
    rng: str = "stream"  # "stream" (mlx-lm) | "position" (engine.pipeline)
    min_p: float = 0.0  # mlx-lm make_sampler's min-p; 0 = off


@dataclass
class PairSpec:
    """One pair of a suite, its settings resolved."""

    target: str
    drafter: str | None = None
    sources: tuple[str, ...] = ()
    gammas: tuple[int, ...] = DEFAULT_GAMMAS
    max_tokens: int = 32
    prompts_file: Path | None = None
    zoo_prompts: int = 8
    sampling: tuple[Sampling, ...] = (Sampling(),)
    eos_ids: tuple[int, ...] | None = None
    stop_ids: tuple[tuple[int, ...], ...] = ()
    stop_strings: tuple[str, ...] = ()
    truncate: bool = False
    confidence_threshold: float = 0.0
    # quantized KV and rotating rollback (specparity.cli.kv_args); None / "guard": off
    kv_bits: int | None = None
    kv_group_size: int | None = None
    quantized_kv_start: int | None = None
    rotating: str = "guard"
    where: str = "pair"
    extra: dict[str, Any] = field(default_factory=dict)
    chat_template: bool = False  # text prompts through the target tokenizer's chat template
    grammar: str = ""  # a grammar file (.json schema, .regex, .lark) or a zoo grammar name; '' = none
    reasoning_end: str = ""  # with grammar: the marker text the output is free until (engine.grammar)


def _is_zoo_target(name: str) -> bool:
    import zoo

    return name in (*zoo.TARGETS, zoo.TRAINED_TARGET, *zoo.KV_TARGETS) and not Path(name).is_dir()


def _check(parse: Any, v: Any, where: str) -> Any:
    """A suite value through the flag's own validator (``specparity.cli.args``): one set of bounds."""
    from specparity.cli import args

    try:
        return args.check_value(parse, v, where)
    except args.UsageError as exc:
        raise SuiteError(str(exc)) from None


def _processors(v: Any, where: str) -> str:
    from engine.sampler import ProcessorParams

    if not isinstance(v, str):
        raise SuiteError(f"{where}.processors: expected a string like \"rp1.3c64+lb5=1.5\", got {v!r}")
    try:
        proc = ProcessorParams.parse(v)
    except ValueError as exc:
        raise SuiteError(f"{where}.processors: {exc}") from None
    return proc.tag() if proc.active else ""


def _sampling(v: Any, where: str) -> tuple[Sampling, ...]:
    from specparity.cli import args

    if isinstance(v, dict):
        v = [v]
    if not isinstance(v, list) or not v:
        raise SuiteError(f"{where}: expected a list of tables like {{temperature = 0.0}}")
    out = []
    for i, s in enumerate(v):
        w = f"{where}[{i}]"
        if not isinstance(s, dict) or set(s) - _SAMPLING_KEYS:
            raise SuiteError(f"{w}: expected a table with keys among {sorted(_SAMPLING_KEYS)}, got {s!r}")
        # the bounds of --temps, --top-p, --top-k, --min-p and --seed
        t = _check(args.nonneg_float, s.get("temperature", 0.0), f"{w}.temperature")
        p = _check(args.probability, s.get("top_p", 0.0), f"{w}.top_p")
        k = _check(args.nonneg_int, s.get("top_k", 0), f"{w}.top_k")
        mp = _check(args.min_p, s.get("min_p", 0.0), f"{w}.min_p")
        seed = _check(args.seed, s.get("seed", 0), f"{w}.seed")
        mt = _check(args.nonneg_int, s.get("min_tokens", 0), f"{w}.min_tokens")
        rng = _check(args.rng_mode, s.get("rng", "stream"), f"{w}.rng")
        out.append(Sampling(float(t), float(p), int(k), int(seed), _processors(s.get("processors", ""), w),
                            int(mt), str(rng), float(mp)))
    return tuple(out)


def _path(v: Any, where: str, root: Path) -> Path:
    if not isinstance(v, str) or not v or "\x00" in v:
        raise SuiteError(f"{where}: expected a path string, got {v!r}")
    try:
        return root / Path(v).expanduser()
    except RuntimeError as exc:  # ~nosuchuser
        raise SuiteError(f"{where}: {v!r}: {exc}") from None


def _settings(raw: dict[str, Any], base: PairSpec, where: str, root: Path) -> PairSpec:
    """Apply ``raw`` over ``base``; every value goes through its flag's validator."""
    from specparity.cli import args

    s = PairSpec(**{**base.__dict__, "where": where})
    for key, v in raw.items():
        w = f"{where}.{key}"
        if key == "gammas":
            s.gammas = _check(args.gamma_list, v, w)
        elif key == "max_tokens":
            s.max_tokens = _check(args.max_tokens, v, w)
        elif key == "zoo_prompts":
            s.zoo_prompts = _check(args.positive_int, v, w)
        elif key == "prompts_file":
            s.prompts_file = _check(args.readable_file, str(_path(v, w, root)), w)
        elif key == "sampling":
            s.sampling = _sampling(v, w)
        elif key == "eos_ids":
            s.eos_ids = _check(args.token_id_list, v, w)
        elif key == "stop_ids":
            if not isinstance(v, list):
                raise SuiteError(f"{w}: expected a list of token-id lists, got {v!r}")
            s.stop_ids = tuple(_check(args.token_id_list, x, f"{w}[{i}]") for i, x in enumerate(v))
        elif key == "stop_strings":
            if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
                raise SuiteError(f"{w}: expected a list of non-empty strings, got {v!r}")
            s.stop_strings = tuple(v)
        elif key in ("truncate", "chat_template"):
            if not isinstance(v, bool):
                raise SuiteError(f"{w}: expected true or false, got {v!r}")
            setattr(s, key, v)
        elif key in ("kv_bits", "kv_group_size", "quantized_kv_start"):
            from specparity.cli import args as a

            parse = {"kv_bits": a.kv_bits, "kv_group_size": a.kv_group_size,
                     "quantized_kv_start": a.nonneg_int}[key]
            setattr(s, key, _check(parse, v, w))
        elif key == "rotating":
            if v not in ("guard", "exact"):
                raise SuiteError(f"{w}: expected \"guard\" or \"exact\", got {v!r}")
            s.rotating = v
        elif key == "grammar":  # docs/grammar.md
            from zoo.grammars import GRAMMARS

            if not isinstance(v, str) or not v:
                raise SuiteError(f"{w}: expected a grammar file or a zoo grammar name, got {v!r}")
            s.grammar = v if v in GRAMMARS else _check(args.grammar_ref, str(_path(v, w, root)), w)
        elif key == "reasoning_end":  # docs/grammar.md
            if not isinstance(v, str):
                raise SuiteError(f"{w}: expected the marker text, got {v!r}")
            s.reasoning_end = _check(args.reasoning_end, v, w)
    if s.kv_bits is None and (s.kv_group_size is not None or s.quantized_kv_start is not None):
        raise SuiteError(f"{where}: kv_group_size/quantized_kv_start need kv_bits")
    return s


def load_suite(path: str | Path) -> list[PairSpec]:
    """The pairs of a TOML suite file, defaults applied and every value checked."""
    from traces.io import InputFileError, regular_file

    p = Path(path)
    try:
        data = tomllib.loads(regular_file(p, what="suite").read_text(encoding="utf-8"))
    except InputFileError as exc:
        raise SuiteError(str(exc)) from None
    except OSError as exc:
        raise SuiteError(f"suite {str(p)!r}: cannot read ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SuiteError(f"suite {p}: not valid TOML ({exc})") from None
    unknown = set(data) - _SUITE_KEYS - {"pair", "sessions"}
    if unknown:
        raise SuiteError(f"suite {p}: unknown key(s) {sorted(unknown)}; known: "
                         f"{sorted(_SUITE_KEYS | {'pair', 'sessions'})}")
    root = p.resolve().parent
    base = _settings({k: v for k, v in data.items() if k not in ("pair", "sessions")}, PairSpec(target=""),
                     str(p), root)
    pairs = data.get("pair")
    if not isinstance(pairs, list) or not pairs:
        raise SuiteError(f"suite {p}: no [[pair]] tables")
    out = []
    for i, raw in enumerate(pairs):
        where = f"{p}: pair {i + 1}"
        bad = set(raw) - _PAIR_KEYS
        if bad:
            raise SuiteError(f"{where}: unknown key(s) {sorted(bad)}; known: {sorted(_PAIR_KEYS)}")
        target = raw.get("target")
        if not isinstance(target, str) or not target:
            raise SuiteError(f"{where}: 'target' (a zoo target or a model path) is required")
        spec = _settings({k: v for k, v in raw.items() if k in _SUITE_KEYS}, base, where, root)
        spec.target = resolve_model_ref(target, root)
        drafter = raw.get("drafter")
        if drafter is not None and (not isinstance(drafter, str) or not drafter):
            raise SuiteError(f"{where}: 'drafter' must be a zoo drafter name or a path")
        spec.drafter = resolve_model_ref(drafter, root) if drafter else None
        src = raw.get("sources", raw.get("source"))
        if src is not None:
            from specparity.cli.args import source_names

            src = [src] if isinstance(src, str) else src
            known = source_names()
            if not isinstance(src, list) or not src or not all(x in known for x in src):
                raise SuiteError(f"{where}: sources must be among {', '.join(known)}, got {src!r}")
            spec.sources = tuple(src)
        out.append(spec)
    return out


def resolve_model_ref(ref: str, root: Path) -> str:
    """A zoo name as it is; a path made absolute (relative to the suite file)."""
    import zoo

    if "\x00" in ref:
        raise SuiteError(f"model {ref!r}: a path cannot contain a NUL byte")
    if ref in (*zoo.TARGETS, *zoo.DRAFTERS, zoo.TRAINED_TARGET, zoo.TRAINED_DRAFTER, *zoo.KV_TARGETS) \
            and not (root / ref).is_dir():
        return ref
    try:
        p = (root / Path(ref).expanduser()).resolve()
    except RuntimeError as exc:  # ~nosuchuser
        raise SuiteError(f"model {ref!r}: {exc}") from None
    if not p.is_dir():
        raise SuiteError(f"model {ref!r} is neither a zoo name nor a directory (looked at {p})")
    return str(p)


def _sources(spec: PairSpec) -> tuple[str, ...]:
    if spec.sources:
        return spec.sources
    if spec.drafter is None:
        return ()
    if _is_zoo_target(spec.target):
        return ("two-model",)
    from engine.sources.detect import resolve_kind

    return (resolve_kind(None, spec.drafter),)


def pair_cases(spec: PairSpec) -> list[Case]:
    """Every case of one pair: sources x gammas x prompts x sampling (plus plain if no drafter)."""
    from engine.models import check_model_dir

    on_zoo = _is_zoo_target(spec.target)
    if not on_zoo:
        check_model_dir(spec.target)
    if on_zoo and spec.drafter is not None and Path(spec.drafter).is_absolute():
        raise SuiteError(f"{spec.where}: a zoo target pairs with a zoo drafter name, not a path "
                         f"(give the target's path to pair it with {spec.drafter})")
    if not on_zoo and spec.drafter is not None and not Path(spec.drafter).is_absolute():
        raise SuiteError(f"{spec.where}: drafter {spec.drafter!r}: a target path needs a drafter path")
    prompts = _prompts(spec, on_zoo)
    stops = spec.stop_ids + tuple(_encode_stops(spec) if spec.stop_strings else ())
    tlabel = spec.target if on_zoo else model_label(spec.target)
    if spec.reasoning_end and not spec.grammar:
        raise SuiteError(f"{spec.where}: reasoning_end needs grammar (the marker ends the free part of a "
                         "grammar-constrained output)")
    common: dict[str, Any] = {
        "max_tokens": spec.max_tokens, "eos_ids": spec.eos_ids, "stop_sequences": stops,
        "target_path": None if on_zoo else spec.target,
        "kv_bits": spec.kv_bits, "kv_group_size": spec.kv_group_size,
        "quantized_kv_start": spec.quantized_kv_start,
        **({"grammar": spec.grammar} if spec.grammar else {}),
        **({"reasoning_end": spec.reasoning_end} if spec.reasoning_end else {}),
    }
    cases: list[Case] = []
    sources = _sources(spec)
    for s in spec.sampling:
        smp = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed,
               "processors": s.processors, "min_tokens": s.min_tokens, "rng": s.rng, "min_p": s.min_p}
        if not sources:
            for pid, ids in prompts:
                cases.append(Case(tlabel, None, pid, 0, **common, **smp, prompt_tokens=ids))
        for source in sources:
            dlabel, dpath = _drafter(spec, source, on_zoo)
            gammas = spec.gammas
            for g in gammas:
                for pid, ids in prompts:
                    cases.append(Case(tlabel, dlabel, pid, g, **common, **smp, source=source,
                                      draft_path=dpath, prompt_tokens=ids, rotating=spec.rotating))
    return cases


def _drafter(spec: PairSpec, source: str, on_zoo: bool) -> tuple[str, str | None]:
    from engine.sources.kind import get
    from specparity.cases.case import drafter_label

    if not get(source).takes_dir:
        if spec.drafter is not None:
            raise SuiteError(f"{spec.where}: the {source} source is model-free; drop 'drafter'")
        return drafter_label(source, None), None
    if spec.drafter is None:
        raise SuiteError(f"{spec.where}: source {source!r} needs a 'drafter'")
    if on_zoo:
        return spec.drafter, None
    return drafter_label(source, spec.drafter, confidence_threshold=spec.confidence_threshold), spec.drafter


def _prompts(spec: PairSpec, on_zoo: bool) -> list[tuple[str, tuple[int, ...] | None]]:
    """``[(prompt id, token ids)]``, every prompt checked against the target's vocabulary and
    context with this pair's ``max_tokens`` (zoo prompts too: ``None`` keeps the zoo's ids)."""
    import zoo
    from specparity.cases.prompts import (
        PromptError,
        check_ids_for_model,
        encode_prompts,
        read_prompts_file,
    )

    try:
        if spec.prompts_file is None:
            if spec.chat_template:
                raise SuiteError(f"{spec.where}: chat_template renders text prompts: give a "
                                 "prompts_file (the zoo's prompts are token ids)")
            if not on_zoo:
                raise SuiteError(f"{spec.where}: a model path needs a prompts file (prompts_file / "
                                 "--prompts-file); the zoo's prompts are in the zoo's vocabulary")
            model = zoo.model_dir(spec.target)
            out: list[tuple[str, tuple[int, ...] | None]] = []
            for pid in pick_prompts([p.id for p in zoo.prompts()], spec.zoo_prompts):
                ids = tuple(zoo.prompt(pid).token_ids)
                kept = tuple(check_ids_for_model(ids, model, max_tokens=spec.max_tokens, prompt_id=pid,
                                                 truncate=spec.truncate))
                out.append((pid, None if kept == ids else kept))
            return out
        model = zoo.model_dir(spec.target) if on_zoo else Path(spec.target)
        return list(encode_prompts(read_prompts_file(spec.prompts_file), model,
                                   max_tokens=spec.max_tokens, truncate=spec.truncate,
                                   chat_template=spec.chat_template))
    except PromptError as exc:
        raise SuiteError(f"{spec.where}: {exc}") from None


def count_cases(spec: PairSpec) -> int:
    """How many cases :func:`pair_cases` makes of ``spec``, from the prompt count alone
    (the prompts file is parsed, nothing is encoded or loaded)."""
    import zoo
    from specparity.cases.prompts import PromptError, read_prompts_file

    if spec.prompts_file is None:
        n = len(pick_prompts([p.id for p in zoo.prompts()], spec.zoo_prompts))
    else:
        try:
            n = len(read_prompts_file(spec.prompts_file))
        except PromptError as exc:
            raise SuiteError(f"{spec.where}: {exc}") from None
    per_prompt = len(spec.gammas) * len(spec.sources or ("?",)) if spec.drafter or spec.sources else 1
    return n * per_prompt * len(spec.sampling)


def _encode_stops(spec: PairSpec) -> list[tuple[int, ...]]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    import zoo

    model = zoo.model_dir(spec.target) if _is_zoo_target(spec.target) else Path(spec.target)
    tok = load_tokenizer(Path(model))
    out = []
    for text in spec.stop_strings:
        ids = tuple(tok.encode(text, add_special_tokens=False))
        if not ids:
            raise SuiteError(f"{spec.where}: stop string {text!r} encodes to zero tokens")
        out.append(ids)
    return out


def suite_cases(specs: Sequence[PairSpec], max_cases: int | None = None) -> list[Case]:
    """All cases of a suite, in pair order.

    ``max_cases``: a suite (or prompts file) that would make more cases is
    refused before any prompt is encoded or model loaded (``run --max-cases``).
    """
    if max_cases is not None:
        check_case_count(sum(count_cases(s) for s in specs), max_cases)
    return [c for s in specs for c in pair_cases(s)]


def check_case_count(n: int, max_cases: int) -> None:
    """Refuse ``n`` cases above ``max_cases`` in one line saying how to raise the limit."""
    if n > max_cases:
        raise SuiteError(f"{n} cases exceed the limit of {max_cases} (--max-cases); select fewer "
                         f"prompts, pairs, gammas or sampling settings, or raise --max-cases")
