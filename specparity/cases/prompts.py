"""Prompts files and prompt-id validation against a model.

A prompts file is one of:

- JSONL, one object per line: ``{"id": "...", "text": "..."}`` (encoded with
  the target's tokenizer, as mlx-lm ``stream_generate`` encodes a string
  prompt: ``tokenizer.encode(text)``) or ``{"id": "...", "token_ids": [...]}``;
  blank lines are skipped;
- a JSON array of those objects (``[{"id": ..., "text": ...}, ...]``);
- plain text: one prompt per line (blank lines skipped), ids ``line-N`` with N
  the 1-based line number.

A file is a JSON array when it starts with ``[`` followed by ``{`` (or is
``[]``), JSONL when its first non-blank line starts with ``{``, plain text
otherwise (``[INST] hi`` is a text prompt); a UTF-8 byte-order mark is
dropped. A file that starts like JSON and does not parse is refused, never
read as text. Ids are unique
within a file. Token ids are checked against the model before anything runs
(:func:`check_prompt`): every id must lie in ``[0, vocab_size)`` (id 0 is
valid) — an id outside it indexes past the embedding table, which on MLX is
nondeterministic garbage or a segfault — and the prompt plus the tokens to
generate must fit the model's context (``max_position_embeddings``); a longer
prompt is refused, or, with ``truncate=True``, its head dropped with a warning.

Text prompts may be rendered by the target tokenizer's chat template first
(``--chat-template``, :func:`encode_text`, as mlx-lm's ``generate`` does).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Prompt",
    "PromptError",
    "check_prompt",
    "encode_prompts",
    "encode_text",
    "model_limits",
    "read_prompts_file",
]

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")


class PromptError(ValueError):
    """A prompts file or a prompt's token ids are unusable (one-line message)."""


@dataclass(frozen=True)
class Prompt:
    """A prompt from a file: ``text`` (encoded later) or ``token_ids``."""

    id: str
    text: str | None = None
    token_ids: tuple[int, ...] | None = None


def read_prompts_file(path: str | Path) -> list[Prompt]:
    """Parse a prompts file (JSONL, a JSON array or plain text, see the module doc)."""
    from traces.io import InputFileError, regular_file

    p = Path(path)
    try:
        regular_file(p, what="prompts file")  # FIFOs, devices, > 256 MiB: refused before open()
    except InputFileError as exc:
        raise PromptError(str(exc)) from None
    try:
        # utf-8-sig: a byte-order mark (Windows editors) is dropped, never read as text.
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise PromptError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), None)
    if first is None:
        raise PromptError(f"{p}: no prompts (the file is empty)")
    out: list[Prompt] = []
    head = text.lstrip()
    if head.startswith("[") and head[1:].lstrip()[:1] in ("{", "]", ""):
        out = _json_array_prompts(p, text)
    elif first.lstrip().startswith("{"):
        for n, line in enumerate(lines, 1):
            if line.strip():
                out.append(_jsonl_prompt(f"{p}:{n}", line))
    else:
        out = [Prompt(f"line-{n}", text=_no_nul(f"{p}:{n}", line)) for n, line in enumerate(lines, 1)
               if line.strip()]
    seen: dict[str, int] = {}
    for i, pr in enumerate(out):
        if pr.id in seen:
            raise PromptError(f"{p}: prompt id {pr.id!r} appears twice (prompts {seen[pr.id] + 1} "
                              f"and {i + 1}); ids must be unique")
        seen[pr.id] = i
    return out


def _json_array_prompts(p: Path, text: str) -> list[Prompt]:
    """A file holding one JSON array of prompt objects (the JSONL objects, as a list)."""
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise PromptError(f"{p}: starts like a JSON array of prompts but is not valid JSON "
                          f"({exc})") from None
    except RecursionError:
        raise PromptError(f"{p}: JSON nested too deeply; refused") from None
    if not items:
        raise PromptError(f"{p}: no prompts (an empty JSON array)")
    return [_prompt_object(f"{p}: item {i + 1}", obj) for i, obj in enumerate(items)]


def _jsonl_prompt(where: str, line: str) -> Prompt:
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise PromptError(f"{where}: not a JSON object ({exc})") from None
    except RecursionError:
        raise PromptError(f"{where}: JSON nested too deeply; refused") from None
    return _prompt_object(where, obj)


def _no_nul(where: str, text: str) -> str:
    """``text``, refused in one line naming the place if it holds a NUL (a binary file read as
    text, or a NUL a tokenizer would encode as a control token)."""
    i = text.find("\x00")
    if i >= 0:
        raise PromptError(f"{where}: a NUL byte (\\x00) at character {i + 1}; prompts are text: remove "
                          "it (or give the prompt as token_ids)")
    return text


def _prompt_object(where: str, obj: Any) -> Prompt:
    if not isinstance(obj, dict):
        raise PromptError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    extra = set(obj) - {"id", "text", "token_ids"}
    if extra:
        raise PromptError(f"{where}: unknown key(s) {sorted(extra)}; expected id and text or token_ids")
    pid = obj.get("id")
    if not isinstance(pid, str) or not pid or any(c in pid for c in "/\\\n\x00") or pid in (".", ".."):
        raise PromptError(f"{where}: 'id' must be a non-empty string without '/' or NUL, got {pid!r}")
    has_text, has_ids = "text" in obj, "token_ids" in obj
    if has_text == has_ids:
        raise PromptError(f"{where}: give exactly one of 'text' or 'token_ids'")
    if has_text:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise PromptError(f"{where}: 'text' must be a non-empty string")
        return Prompt(pid, text=_no_nul(f"{where}: prompt {pid!r}", obj["text"]))
    ids = obj["token_ids"]
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise PromptError(f"{where}: 'token_ids' must be a non-empty list of integers")
    return Prompt(pid, token_ids=tuple(ids))


def model_limits(config: dict[str, Any]) -> tuple[int | None, int | None]:
    """``(vocab_size, context length)`` from a model's ``config.json`` (None: not stated)."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab = cfg.get("vocab_size", config.get("vocab_size"))
    ctx = next((cfg[k] for k in _CONTEXT_KEYS if isinstance(cfg.get(k), int)), None)
    return (int(vocab) if isinstance(vocab, int) else None), ctx


def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    from traces.io import regular_file

    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(regular_file(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise PromptError(f"{path}: cannot read the model config ({exc})") from None
    if not isinstance(data, dict):
        raise PromptError(f"{path}: the model config is not a JSON object")
    return data


def check_prompt(
    ids: Sequence[int],
    *,
    vocab_size: int | None,
    context: int | None = None,
    max_tokens: int = 0,
    prompt_id: str = "prompt",
    truncate: bool = False,
) -> list[int]:
    """The prompt's ids, checked against the model; raises :class:`PromptError`.

    ``truncate``: a prompt that does not leave room for ``max_tokens`` in the
    context keeps its last tokens (a warning on stderr) instead of being refused.
    """
    ids = [int(t) for t in ids]
    if not ids:
        raise PromptError(f"prompt {prompt_id!r}: no tokens")
    if vocab_size is not None:
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size]
        if bad:
            shown = ", ".join(f"{t} (position {i})" for i, t in bad[:3])
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise PromptError(f"prompt {prompt_id!r}: token id(s) {shown}{more} outside the "
                              f"model's vocabulary [0, {vocab_size})")
    if context is not None and len(ids) + max_tokens > context:
        room = context - max_tokens
        if not truncate or room < 1:
            raise PromptError(f"prompt {prompt_id!r}: {len(ids)} tokens + {max_tokens} to generate "
                              f"exceed the model's context of {context} tokens")
        print(f"specparity: warning: prompt {prompt_id!r}: {len(ids)} tokens + {max_tokens} to "
              f"generate exceed the context of {context}; keeping its last {room} tokens",
              file=sys.stderr)
        ids = ids[-room:]
    return ids


def check_ids_for_model(ids: Sequence[int], model_dir: str | Path, *, max_tokens: int = 0,
                        prompt_id: str = "prompt", truncate: bool = False) -> list[int]:
    """:func:`check_prompt` with the limits read from ``model_dir/config.json``."""
    vocab, ctx = model_limits(read_model_config(model_dir))
    return check_prompt(ids, vocab_size=vocab, context=ctx, max_tokens=max_tokens,
                        prompt_id=prompt_id, truncate=truncate)


def encode_prompts(prompts: Sequence[Prompt], model_dir: str | Path, *, max_tokens: int = 0,
                   truncate: bool = False, tokenizer: Any = None,
                   chat_template: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """``[(id, token ids)]``: text prompts encoded with the model's tokenizer, all checked.

    ``tokenizer``: an already loaded tokenizer (otherwise loaded from ``model_dir``
    only when a prompt has text). ``chat_template``: text prompts are rendered as
    one user turn by the tokenizer's chat template (:func:`encode_text`) and their
    ids get the suffix :data:`CHAT_SUFFIX`; token-id prompts are used as they are.
    """
    if chat_template and all(pr.text is None for pr in prompts):
        raise PromptError("--chat-template renders text prompts, and these are all token ids "
                          "(used as they are): drop --chat-template or give text prompts")
    vocab, ctx = model_limits(read_model_config(model_dir))
    out = []
    for pr in prompts:
        pid = pr.id
        if pr.token_ids is not None:
            ids: Sequence[int] = pr.token_ids
        else:
            if tokenizer is None:
                from mlx_lm.tokenizer_utils import load as load_tokenizer

                tokenizer = load_tokenizer(Path(model_dir))
            assert pr.text is not None
            ids = encode_text(tokenizer, pr.text, chat_template=chat_template,
                              where=f"prompt {pr.id!r}", model_dir=model_dir)
            pid += CHAT_SUFFIX if chat_template else ""
        checked = check_prompt(ids, vocab_size=vocab, context=ctx, max_tokens=max_tokens,
                               prompt_id=pid, truncate=truncate)
        out.append((pid, tuple(checked)))
    return out


CHAT_SUFFIX = "@chat"
CHAT_TEMPLATE_HELP = ("render each text prompt as one user turn with the target tokenizer's own chat "
                      "template (apply_chat_template, add_generation_prompt; as mlx_lm.generate); "
                      "token-id prompts are used as they are")


def encode_text(tokenizer: Any, text: str, *, chat_template: bool = False, where: str = "prompt",
                model_dir: str | Path | None = None) -> list[int]:
    """A text prompt's ids: ``tokenizer.encode(text)``, or through the chat template.

    With ``chat_template`` the text is one user message rendered as mlx-lm 0.32.2
    ``mlx_lm/generate.py`` ``main`` renders it: ``apply_chat_template(messages,
    tokenize=False, add_generation_prompt=True)`` on the tokenizer (mlx-lm's
    ``TokenizerWrapper``, or a Hugging Face tokenizer), then ``encode(rendered,
    add_special_tokens=False)`` (the template writes its own special tokens).
    A tokenizer without a template, or a template that fails, is one
    :class:`PromptError` line.
    """
    if not chat_template:
        ids = list(tokenizer.encode(text))
    else:
        at = f" ({model_dir})" if model_dir is not None else ""
        has = getattr(tokenizer, "has_chat_template", None)
        if has is None:
            has = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "chat_template", None) is not None
        if not has:
            raise PromptError(f"{where}: --chat-template: the target's tokenizer{at} has no chat "
                              "template (no 'chat_template' in tokenizer_config.json, no "
                              "chat_template.jinja)")
        try:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja2 errors: the template is the user's
            raise PromptError(f"{where}: the chat template of the target's tokenizer{at} failed: "
                              f"{type(exc).__name__}: {exc}") from None
        ids = list(tokenizer.encode(rendered, add_special_tokens=False))
    if not ids:
        raise PromptError(f"{where}: the text encodes to zero tokens")
    return [int(t) for t in ids]


@dataclass(frozen=True)
class ModelPrompt:
    """A prompt ready for one model: ``id`` and checked ``token_ids`` (zoo.Prompt-like)."""

    id: str
    token_ids: tuple[int, ...]


def prompts_for_model(model_dir: str | Path, *, prompts_file: str | Path | None = None,
                      zoo_ids: Sequence[str] | None = None, max_tokens: int = 0,
                      truncate: bool = False, chat_template: bool = False) -> list[ModelPrompt]:
    """The prompts a job runs on ``model_dir``: a prompts file's, else the zoo's ``zoo_ids``.

    Every prompt is checked against the model (:func:`check_prompt`); a zoo prompt
    whose ids fall outside the model's vocabulary is refused with a hint to give
    a prompts file (the zoo's prompts are in the zoo tokenizer's ids).
    """
    if prompts_file is not None:
        return [ModelPrompt(pid, ids) for pid, ids in
                encode_prompts(read_prompts_file(prompts_file), model_dir, max_tokens=max_tokens,
                               truncate=truncate, chat_template=chat_template)]
    if chat_template:
        raise PromptError("--chat-template renders text prompts: give --prompts-file FILE (the zoo's "
                          "prompts are token ids)")
    import zoo

    out = []
    for pid in zoo_ids if zoo_ids is not None else [p.id for p in zoo.prompts()]:
        try:
            ids = check_ids_for_model(zoo.prompt(pid).token_ids, model_dir, max_tokens=max_tokens,
                                      prompt_id=pid, truncate=truncate)
        except PromptError as exc:
            raise PromptError(f"zoo {exc}; the zoo's prompts are zoo-tokenizer ids: give "
                              f"--prompts-file FILE for {model_dir}") from None
        out.append(ModelPrompt(pid, tuple(ids)))
    return out
