"""Conformance cases: (pair, prompt, params), on the tiny zoo or on any local model pair.

A zoo case names its models and prompt by zoo name (``llama``/``twin``/``nat-00``);
a case on the user's own models also carries the model paths and the prompt's
token ids (:func:`model_label` names a path by directory name + short digest,
so case ids stay stable when the folder moves and differ when the model does).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from traces.digest import weight_files
from traces.io import regular_file

DEFAULT_GAMMAS = (1, 2, 3, 5)


@dataclass(frozen=True)
class Case:
    """One generation: a zoo target, an optional drafter, a prompt and params.

    ``drafter=None`` is a plain (non-speculative) decode. ``source`` is the
    draft-source kind (§3 roster); for ``two-model`` the drafter is a zoo
    drafter name (``self``/``twin``/``small``), for model-free sources it
    names the source's configuration (e.g. ``ngram``).
    """

    target: str
    drafter: str | None
    prompt_id: str
    gamma: int = 3
    max_tokens: int = 32
    temperature: float = 0.0
    seed: int = 0
    eos_ids: tuple[int, ...] | None = None  # None: the tokenizer's own EOS set
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    source: str = "two-model"
    top_p: float = 0.0
    top_k: int = 0
    # Cases on the user's own models (None on zoo cases): model dirs and prompt tokens.
    target_path: str | None = None
    draft_path: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    # Logits processors in engine.sampler.ProcessorParams.tag() form ('' = none).
    processors: str = ""
    # Quantized KV (mlx-lm kv_bits / kv_group_size / quantized_kv_start); None: off / mlx-lm's default.
    kv_bits: int | None = None
    kv_group_size: int | None = None
    quantized_kv_start: int | None = None
    # Rotating caches past the ring wrap: "guard" (§2) or "exact" (engine.rollback.RingRound).
    rotating: str = "guard"
    # Grammar-constrained decoding: a zoo grammar name (zoo/grammars.py) or a grammar file
    # (.json schema, .regex, .lark); '' = unconstrained.
    grammar: str = ""
    # A reasoning-end marker (text, encoded with the target tokenizer): the grammar applies only
    # after the emitted tokens end with it (engine.grammar); '' = from the first token.
    reasoning_end: str = ""
    # EOS ids are not drawn before this many tokens were generated (engine.pipeline stage 2).
    min_tokens: int = 0
    # "stream": one RNG stream per request (mlx-lm); "position": a key per (seed, output position).
    rng: str = "stream"
    # min-p (mlx-lm make_sampler): tokens below min_p x the top token's probability are dropped; 0 = off.
    min_p: float = 0.0

    @property
    def on_zoo(self) -> bool:
        return self.target_path is None

    @property
    def mode(self) -> str:
        return "plain" if self.drafter is None else "spec"

    @property
    def case_id(self) -> str:
        if self.drafter is None:
            base = f"{self.target}/plain/{self.prompt_id}/n{self.max_tokens}"
        else:
            base = f"{self.target}/{self.drafter}/{self.prompt_id}/g{self.gamma}/n{self.max_tokens}"
        if self.temperature:
            base += f"/t{self.temperature:g}s{self.seed}"
            if self.top_p:
                base += f"p{self.top_p:g}"
            if self.top_k:
                base += f"k{self.top_k}"
            if self.min_p:
                base += f"m{self.min_p:g}"
        if self.eos_ids is not None:
            base += "/eos" + "-".join(str(t) for t in self.eos_ids)
        if self.stop_sequences:
            base += "/stop" + "+".join("-".join(str(t) for t in s) for s in self.stop_sequences)
        if self.processors:
            base += "/lp-" + self.processors
        if self.min_tokens:
            base += f"/min{self.min_tokens}"
        if self.rng != "stream":
            base += f"/rng-{self.rng}"
        if self.kv_bits is not None:
            base += f"/kv{self.kv_bits}"
            if self.kv_group_size is not None:
                base += f"g{self.kv_group_size}"
            if self.quantized_kv_start is not None:
                base += f"s{self.quantized_kv_start}"
        if self.rotating != "guard" and self.drafter is not None:
            base += f"/rot-{self.rotating}"
        if self.grammar:
            from zoo.grammars import label

            base += f"/gr-{label(self.grammar)}"
            if self.reasoning_end:
                import hashlib

                base += f"/re-{hashlib.sha256(self.reasoning_end.encode()).hexdigest()[:8]}"
        return base

    @property
    def file_stem(self) -> str:
        """The case id as a file name: ``/`` -> ``__``; see :func:`file_stem`."""
        return file_stem(self.case_id)

    def plain(self) -> Case:
        """The plain-decode baseline of this case."""
        return replace(self, drafter=None, gamma=0, source="two-model", draft_path=None, rotating="guard")


STEM_MAX_BYTES = 200
"""Longest file stem (bytes) a case id becomes; the OS limit is 255 per name."""


def file_stem(case_id: str) -> str:
    """A file name for a case id: ``/`` -> ``__``; never hidden, never too long.

    An id starting with ``.`` (a hidden file every reader skips) gets a ``_``
    in front; an id longer than :data:`STEM_MAX_BYTES` bytes (ENAMETOOLONG at
    255) is cut and made unique again by 8 hex of its SHA-256. Every other id
    keeps its exact stem (the goldens' file names are unchanged).
    """
    raw = case_id.replace("/", "__")
    stem = f"_{raw}" if raw.startswith(".") else raw
    if len(stem.encode()) <= STEM_MAX_BYTES:
        return stem
    cut = stem.encode()[:STEM_MAX_BYTES - 9].decode("utf-8", "ignore")
    return f"{cut}-{hashlib.sha256(case_id.encode()).hexdigest()[:8]}"


def model_label(path: str | Path) -> str:
    """A short stable name for a model directory: ``<dir name>-<8 hex>``.

    The digest covers ``config.json`` and the weights' content
    (:func:`traces.digest.weights_digest`, cached by :func:`cached_weights_digest`),
    so two fine-tunes in same-named folders get different names and a moved
    folder keeps its name.
    """
    p = Path(path).expanduser()
    h = hashlib.sha256()
    cfg = p / "config.json"
    h.update(regular_file(cfg).read_bytes() if cfg.exists() else b"")  # a FIFO: refused, not read
    h.update(b"\0" + cached_weights_digest(p).encode())  # weight_files: regular files only
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in p.resolve().name) or "model"
    return f"{name}-{h.hexdigest()[:8]}"


def drafter_label(kind: str, draft_dir: str | Path | None, *, confidence_threshold: float | None = None,
                  conventions: str | None = None) -> str:
    """A case's ``drafter`` for a drafter PATH run by ``kind`` (``generate``/``record`` flags, a
    suite's pair), derived from the kind's descriptor: a model-free kind is its name; else the
    directory's :func:`model_label`, prefixed ``<kind>-`` (``label_prefix``),
    then ``-t<threshold>`` for a kind taking a confidence threshold (none given: the kind's
    default; a default of None, the checkpoint's own: no suffix), then ``+<conventions>``."""
    from engine.sources.kind import get

    desc = get(kind)
    if not desc.takes_dir:
        return desc.name
    assert draft_dir is not None
    label = model_label(draft_dir)
    out = f"{kind}-{label}" if desc.label_prefix else label
    if "confidence_threshold" in desc.options:
        thr = confidence_threshold if confidence_threshold is not None else desc.threshold_default
        out += f"-t{thr:g}" if thr is not None else ""
    if conventions:
        out += f"+{conventions}"
    return out


_DIGESTS: dict[str, str] = {}
# Smaller checkpoints hash faster than a cache file is worth (and tests' tmp models would
# litter the user's cache): only these go to disk.
DISK_CACHE_MIN_BYTES = 64 << 20


def digest_cache_dir() -> Path:
    """``$SPECPARITY_CACHE_DIR/digests`` (default ``~/.cache/specparity/digests``)."""
    from traces import env

    return Path(env.get("SPECPARITY_CACHE_DIR", Path.home() / ".cache" / "specparity")) / "digests"


def cached_weights_digest(path: str | Path) -> str:
    """:func:`traces.digest.weights_digest` of ``path``, hashed once per content stamp.

    The stamp is the resolved path and each weight file's name, size and
    ``mtime_ns``: a rewrite (even of equal size) changes it. Digests are kept in
    process and, for weights of :data:`DISK_CACHE_MIN_BYTES` or more, on disk (one
    small JSON per stamp under :func:`digest_cache_dir`, written atomically; an
    unwritable or corrupt cache is ignored), so a large model is not re-hashed by
    every command.
    """
    from traces.digest import weights_digest
    from traces.io import atomic_write_json

    p = Path(path).expanduser().resolve()
    files = weight_files(p) if p.exists() else []
    stamp = json.dumps([str(p), [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]])
    key = hashlib.sha256(stamp.encode()).hexdigest()
    if key in _DIGESTS:
        return _DIGESTS[key]
    disk = digest_cache_dir() / f"{key}.json"
    if sum(f.stat().st_size for f in files) < DISK_CACHE_MIN_BYTES:
        _DIGESTS[key] = weights_digest(p) if files else hashlib.sha256(b"").hexdigest()
        return _DIGESTS[key]
    try:
        entry = json.loads(disk.read_text())
        if entry.get("stamp") == stamp and isinstance(entry.get("weights_sha256"), str):
            _DIGESTS[key] = entry["weights_sha256"]
            return _DIGESTS[key]
    except (OSError, ValueError, AttributeError):
        pass
    digest = weights_digest(p) if files else hashlib.sha256(b"").hexdigest()
    _DIGESTS[key] = digest
    try:
        disk.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(disk, {"stamp": stamp, "weights_sha256": digest})
    except OSError:
        pass
    return digest


def spec_matrix(
    pairs: Iterable[tuple[str, str]],
    prompt_ids: Iterable[str],
    gammas: Iterable[int] = DEFAULT_GAMMAS,
    max_tokens: int = 32,
) -> list[Case]:
    prompt_ids = list(prompt_ids)
    gammas = list(gammas)
    return [
        Case(t, d, p, g, max_tokens)
        for (t, d) in pairs
        for g in gammas
        for p in prompt_ids
    ]


def pick_prompts(all_ids: list[str], n: int) -> list[str]:
    """``n`` prompt ids, alternating natural and random kinds for coverage."""
    nat = [p for p in all_ids if p.startswith("nat")]
    rnd = [p for p in all_ids if not p.startswith("nat")]
    out: list[str] = []
    while len(out) < min(n, len(all_ids)):
        for group in (nat, rnd):
            if group and len(out) < n:
                out.append(group.pop(0))
    return out
