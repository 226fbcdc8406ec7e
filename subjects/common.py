"""Helpers shared by the subject adapters (no engine imports)."""

from __future__ import annotations

from functools import cache
from importlib import metadata
from typing import Any

import zoo
from subjects.base import SubjectUnavailable, SubjectUnsupported


def require_module(module: str, name: str) -> None:
    import importlib

    from subjects import SUBJECTS

    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise SubjectUnavailable(f"{name} is not installed ({exc}); run it with: "
                                 f"{SUBJECTS[name].install_hint}") from exc


def dist_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def eos_for(case_eos: tuple[int, ...] | None) -> set[int]:
    return {zoo.eos_id()} if case_eos is None else set(case_eos)


class EosTokenizer:
    """The subject's tokenizer with the case's EOS set, through the attributes engines read.

    ``eos_token_ids`` (mlx-lm's ``TokenizerWrapper``) and ``eos_token_id`` (the
    Hugging Face tokenizer) are overridden; everything else is delegated.
    """

    def __init__(self, inner: Any, eos: set[int]) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "eos_token_ids", set(eos))
        object.__setattr__(self, "eos_token_id", min(eos) if len(eos) == 1 else None)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("eos_token_ids", "eos_token_id"):
            object.__setattr__(self, name, value)
        else:
            setattr(object.__getattribute__(self, "_inner"), name, value)

    def convert_tokens_to_ids(self, token: Any) -> Any:
        # engines that add named turn-end markers: the zoo vocabulary has none of them
        inner = object.__getattribute__(self, "_inner")
        return inner.convert_tokens_to_ids(token)


@cache
def prompt_ids(prompt_id: str) -> tuple[int, ...]:
    return tuple(zoo.prompt(prompt_id).token_ids)


def case_mode(case: Any, modes: dict[str, Any], adapter: str, *, stop: str,
              greedy: str | None = None, single_eos: bool = False) -> Any:
    """The adapter's mode for ``case``, or :class:`SubjectUnsupported` naming why: an
    unknown mode/target, stop ids (``stop``: why the engine takes none), temperature > 0
    (``greedy``: why, for a greedy-only engine), several EOS ids (``single_eos``)."""
    mode = modes.get(case.mode)
    if mode is None or case.target not in mode.targets:
        raise SubjectUnsupported(f"{adapter} adapter: no mode {case.mode!r} on target {case.target!r}")
    if case.stop_ids:
        raise SubjectUnsupported(stop)
    if greedy is not None and case.temperature > 0:
        raise SubjectUnsupported(greedy)
    if single_eos and len(eos_for(case.eos_ids)) > 1:
        raise SubjectUnsupported("eos_id takes a single id")
    return mode
