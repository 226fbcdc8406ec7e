"""What a draft-source kind is: one :class:`SourceKind` descriptor per ``engine/sources/<kind>.py``.

Each source module exports ``SOURCE = SourceKind(...)`` carrying every fact the
rest of the project needs about the kind (§3 roster,
``../shared/reference/speculative-decoding.md``): its name, its provider
factory, its prefill convention (§2.1), whether γ is pinned to the checkpoint's
block, its prompt-cache reuse family (``engine.prompt_cache``), how it opens
from a drafter directory, its place in the §3 detection order, and where the
zoo keeps its drafters. ``engine.sources`` finds the modules by listing the
package (as mlx-lm finds ``mlx_lm/models/<model_type>.py``): adding a kind
edits no table; every roster, detection chain, reuse table, ``--source``
choice list and header convention is derived from the descriptors.

:func:`registered` adds a descriptor in-process (tests prove the derivation
with a toy kind).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engine.seam import PrefillMode

if TYPE_CHECKING:
    from engine.seam import DraftProvider

Reuse = Literal["segment", "reread", "tapped"]
"""Prompt-cache reuse family (``engine.prompt_cache``): ``segment`` the session saves and
restores the source's own caches (two-model); ``reread`` model-free, re-derived from the
whole prompt (ngram); ``tapped`` a function of the target's tapped hidden rows, which the
session saves with the target's caches (mtp, assistant, native-mtp, dspark, deepspec)."""
REUSE_FAMILIES: tuple[Reuse, ...] = ("segment", "reread", "tapped")

OPTIONS = ("confidence_threshold", "conventions", "ngram")
"""Per-request opening options a kind may read (``SourceKind.options``)."""


@dataclass(frozen=True)
class OpenOptions:
    """What a drafter directory is opened with (``SourceKind.open``).

    ``confidence_threshold`` None: the kind's own default (``SourceKind.threshold_default``);
    ``conventions``: native-mtp's ``--mtp-conventions``; ``load``: how a drafter model
    directory is loaded (default ``engine.models.load``; the harness passes its cached,
    non-exact-aware loader).
    """

    gamma: int = 3
    confidence_threshold: float | None = None
    conventions: str | None = None
    ngram_max: int = 3
    ngram_min: int = 1
    load: Callable[[str], Any] | None = None

    def loader(self) -> Callable[[str], Any]:
        if self.load is not None:
            return self.load
        from engine.models import load

        return lambda p: load(p)


Opener = Callable[["Path | None", OpenOptions], "DraftProvider"]
Detector = Callable[[Path, Callable[[], dict[str, Any]]], bool]
"""``detect(dir, config)``: whether ``dir`` is this kind's artifact; ``config()`` reads
``config.json`` (raising ``DraftKindError`` when it is missing or not JSON)."""


@dataclass(frozen=True)
class SourceKind:
    """One draft-source kind (module docstring).

    Attributes:
        name: the kind (``--source``, trace headers, ``Case.source``).
        provider: the provider factory, ``make_provider(name, **kwargs)`` calls it.
        open: builds the provider from a drafter directory (None for a model-free kind).
        prefill: the §2.1 prefill convention; the source's ``prefill_mode`` is this value,
            and a trace header's ``params.prefill`` is this value unless a run asks for another.
        reuse: the prompt-cache reuse family (:data:`Reuse`).
        roster: place in the §3 roster (listing order of ``KINDS``, help texts).
        detect: the §3 detection test of a drafter directory (None: never detected).
        detect_rank: place in the detection order, lowest first; the kind with
            ``detect_fallback`` answers when no other matches.
        detect_fallback: the kind a directory is when no detector matches (two-model).
        takes_dir: False for a model-free kind, which refuses a drafter directory (ngram).
        loads_model: its drafter directory is an mlx-lm model the harness loads (two-model).
        pinned_gamma: reads the checkpoint's block size; γ is pinned to it (§3 "default γ").
        threshold_default: the provider's confidence threshold when none is given
            (only for kinds with ``"confidence_threshold"`` in ``options``; None: the checkpoint's).
        options: which :data:`OPTIONS` it reads.
        header: extra trace-header params of a run (``params.mtp_conventions``, ...).
        zoo: ``"module:function"`` locating a zoo case's ``(target dir, drafter dir)`` from
            ``(target, drafter)`` names (None: the drafter is not a zoo artifact).
        label_prefix: a drafter path's case label is ``<kind>-<dir label>`` (False: the bare label).
        hint: what its drafter artifact is, for help texts (``--source``).
    """

    name: str
    provider: Callable[..., DraftProvider]
    open: Opener
    prefill: PrefillMode
    reuse: Reuse
    roster: int
    detect: Detector | None = None
    detect_rank: int | None = None
    detect_fallback: bool = False
    takes_dir: bool = True
    loads_model: bool = False
    pinned_gamma: Callable[[Path], int] | None = None
    threshold_default: float | None = None
    options: frozenset[str] = field(default_factory=frozenset)
    header: Callable[[Path | None, OpenOptions], dict[str, Any]] | None = None
    zoo: str | None = None
    label_prefix: bool = True
    hint: str = ""

    def __post_init__(self) -> None:
        from engine.seam import PREFILL_MODES

        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"source kind {self.name}: prefill {self.prefill!r} not in {PREFILL_MODES}")
        if self.reuse not in REUSE_FAMILIES:
            raise ValueError(f"source kind {self.name}: reuse {self.reuse!r} not in {REUSE_FAMILIES}")
        if not set(self.options) <= set(OPTIONS):
            raise ValueError(f"source kind {self.name}: options {sorted(self.options)} not among {OPTIONS}")
        if (self.detect is None) != (self.detect_rank is None):
            raise ValueError(f"source kind {self.name}: detect and detect_rank go together")

    def open_options(self, opts: OpenOptions) -> OpenOptions:
        """``opts`` with the kind's own default threshold filled in."""
        if "confidence_threshold" in self.options and opts.confidence_threshold is None:
            from dataclasses import replace

            return replace(opts, confidence_threshold=self.threshold_default)
        return opts


# ------------------------------------------------------------------ the registry

_KINDS: dict[str, SourceKind] = {}
_DISCOVERED: list[bool] = []


def _discover() -> None:
    """Import every module of ``engine.sources`` once and collect its ``SOURCE``."""
    if _DISCOVERED:
        return
    import importlib
    import pkgutil

    import engine.sources as pkg

    _DISCOVERED.append(True)
    for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        desc = getattr(importlib.import_module(f"{pkg.__name__}.{m.name}"), "SOURCE", None)
        if isinstance(desc, SourceKind):
            _add(desc)


def _add(desc: SourceKind) -> None:
    if desc.name in _KINDS and _KINDS[desc.name] is not desc:
        raise ValueError(f"source kind {desc.name!r} is declared twice")
    _KINDS[desc.name] = desc


def all_kinds() -> tuple[SourceKind, ...]:
    """Every declared kind, in §3 roster order."""
    _discover()
    return tuple(sorted(_KINDS.values(), key=lambda k: (k.roster, k.name)))


def names() -> tuple[str, ...]:
    return tuple(k.name for k in all_kinds())


def roster_help() -> str:
    """The roster for ``--source`` help texts: ``two-model (a drafter model dir), ngram (...)``."""
    return ", ".join(f"{k.name} ({k.hint})" if k.hint else k.name for k in all_kinds())


def get(name: str) -> SourceKind:
    """The descriptor of ``name``; unknown kinds are refused with the roster."""
    _discover()
    if name not in _KINDS:
        raise ValueError(f"unknown draft source {name!r}; known: {', '.join(names())}")
    return _KINDS[name]


def find(name: str | None) -> SourceKind | None:
    """The descriptor of ``name``, None when it is not a declared kind."""
    _discover()
    return _KINDS.get(name) if name is not None else None


@contextmanager
def registered(desc: SourceKind) -> Iterator[SourceKind]:
    """``desc`` declared for the duration of the block (tests: a toy kind)."""
    _discover()
    _add(desc)
    try:
        yield desc
    finally:
        _KINDS.pop(desc.name, None)


def prefill_for(kind: str | None, requested: PrefillMode | None = None) -> PrefillMode:
    """The prefill convention a run uses: ``requested`` when given, else the kind's own
    (plain decode, ``kind`` None: tail-split, as ``engine.executor.plain_generate``).

    The harness passes this one value both to ``GenerationParams.prefill`` and to the
    trace header's ``params.prefill``, so a header cannot misstate how the run prefilled.
    """
    if requested is not None:
        return requested
    return get(kind).prefill if kind is not None else "tail-split"


# ------------------------------------------------------------------ shared readers


def read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}
