"""Subjects: third-party MLX speculative engines under test, driven unmodified.

Kept apart from ``oracles/`` (references we trust as witnesses) and from
``engine/`` (ours): a subject is graded, never trusted. Adapters import
``traces`` and ``zoo`` (to build cases and drafters), never ``engine``; the
grading job (``specparity/grading/engines.py``) computes the references. Each package
pins things the others conflict with (mlx-vlm, transformers, a replaced
``mlx_lm``), so each runs in its own tox environment (``tox -e subject-<name>``).

An adapter module exposes ``require()`` (raises :class:`SubjectUnavailable`
with the install hint), ``version()``, ``MODES`` (mode name -> :class:`Mode`)
and ``generate(case) -> SubjectRun``. Adding a subject is its adapter plus its
row in :data:`SUBJECTS`; the runner registry of the ``specparity`` layer
(``specparity/runners/subjects.py``, docs/runners.md) makes each row a runner
of kind ``subject`` (``grade --engine NAME``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType

from subjects.base import SubjectUnavailable, SubjectUnsupported


@dataclass(frozen=True)
class Mode:
    """One drafting mode of a subject and what it can be checked on."""

    targets: tuple[str, ...]
    drafter: str | None = None  # the drafter it runs with (zoo name, "oracle", a built checkpoint)
    two_model: bool = False  # a draft model of the target's vocabulary: compared with mlx-lm too
    samples: bool = False  # temperature > 0 supported (distribution check)
    top_k: int = 0  # the top-k used for the distribution check (0: the subject has none)
    stop_ids: bool = False  # the API takes stop token ids
    note: str = ""
    unsupported: dict[str, str] = field(default_factory=dict)  # check -> why not


@dataclass(frozen=True)
class SubjectInfo:
    name: str
    module: str
    package: str
    tox_env: str
    extra_deps: tuple[str, ...] = ()

    @property
    def install_hint(self) -> str:
        pins = " ".join((self.package, *self.extra_deps))
        return f"tox -e {self.tox_env}  (pip install {pins} in its own environment)"


SUBJECTS: dict[str, SubjectInfo] = {
    s.name: s
    for s in (
        SubjectInfo("mlx-dspark", "subjects.mlx_dspark", "mlx-dspark==0.20.3", "subject-mlx-dspark"),
        SubjectInfo("dspark-mlx", "subjects.dspark_mlx", "dspark-mlx==0.1.0", "subject-dspark-mlx"),
        SubjectInfo("dflash-mlx", "subjects.dflash_mlx", "dflash-mlx==0.1.8", "subject-dflash-mlx"),
        SubjectInfo("dfly-mlx", "subjects.dfly_mlx", "dfly-mlx==0.1.0", "subject-dfly-mlx"),
        SubjectInfo("mtplx", "subjects.mtplx", "mtplx==2.12.2", "subject-mtplx"),
        SubjectInfo("mlx-lm-broomva", "subjects.mlx_lm_broomva", "mlx-lm-broomva==0.31.3", "subject-mlx-lm-broomva"),
        SubjectInfo("nunspark", "subjects.nunspark", "nunspark==0.13.0", "subject-nunspark"),
        # the same package on the mlx-lm it was written against (0.32's KVCache.state is a 3-tuple)
        SubjectInfo("nunspark-mlxlm031", "subjects.nunspark", "nunspark==0.13.0", "subject-nunspark-mlxlm031",
                    extra_deps=("mlx-lm==0.31.3",)),
        SubjectInfo("mlx-flash", "subjects.mlx_flash", "mlx-flash==0.9.2", "subject-mlx-flash"),
        # flyto-mlx's MTP patch of mlx-lm, in process (the runner "flyto-mlx" is its omlx server,
        # graded over HTTP); on mlx-lm 0.31.3 / mlx 0.32.3, the pins flyto-mlx resolves
        SubjectInfo("flyto-mlx-mtp", "subjects.flyto_mlx", "flyto-mlx==0.7.0", "subject-flyto-mlx-mtp"),
    )
}


def load(name: str) -> ModuleType:
    """The adapter module of subject ``name`` (ValueError for an unknown name)."""
    if name not in SUBJECTS:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(SUBJECTS)}")
    return importlib.import_module(SUBJECTS[name].module)


def _pins_hold(info: SubjectInfo) -> str | None:
    from importlib import metadata

    for pin in info.extra_deps:
        dist, _, want = pin.partition("==")
        try:
            have = metadata.version(dist)
        except metadata.PackageNotFoundError:
            have = None
        if have != want:
            return f"{info.name} needs {pin} here (found {have}); run it with: {info.install_hint}"
    return None


def availability(name: str) -> tuple[bool, str]:
    """(available, reason) for subject ``name``: its package imports in this environment."""
    mod = load(name)
    bad_pin = _pins_hold(SUBJECTS[name])
    if bad_pin is not None:
        return False, bad_pin
    try:
        mod.require()
    except SubjectUnavailable as exc:
        return False, str(exc)
    except Exception as exc:  # noqa: BLE001 - an import that crashes is reported, not raised
        return False, f"import failed: {type(exc).__name__}: {exc}"
    return True, "ok"


def available_subjects() -> list[str]:
    return [n for n in SUBJECTS if availability(n)[0]]


__all__ = ["SUBJECTS", "Mode", "SubjectInfo", "SubjectUnavailable", "SubjectUnsupported", "availability",
           "available_subjects", "load"]
