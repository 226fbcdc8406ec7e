"""Build the shared zoo tokenizer (``tokenizer.json``) and the prompt set (``prompts.json``).

Developer-only: run ``python -m zoo.build_tokenizer``.  Both outputs are
committed; nothing here runs at test time.

References mirrored:
  * HuggingFace ``tokenizers`` 0.2x byte-level BPE recipe (GPT-2 style):
    ``pre_tokenizers.ByteLevel`` + ``decoders.ByteLevel`` + ``trainers.BpeTrainer``
    with ``initial_alphabet=ByteLevel.alphabet()``.
  * mlx-lm 0.32.2 ``mlx_lm/tokenizer_utils.py`` ``load`` (loads the file through
    ``transformers.AutoTokenizer`` -> ``PreTrainedTokenizerFast``).

The training corpus is text available offline on every CPython 3.11 install: the
decoded Zen of Python (``this.s``) plus the docstrings of a fixed list of stdlib
modules and their public members.
"""

from __future__ import annotations

import codecs
import importlib
import inspect
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TOKENIZER_FILE = HERE / "tokenizer.json"
PROMPTS_FILE = HERE / "prompts.json"

VOCAB_SIZE = 512
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN]

CORPUS_MODULES = (
    "abc", "argparse", "bisect", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "difflib", "enum", "fractions", "functools",
    "heapq", "inspect", "itertools", "json", "logging", "os", "pathlib",
    "pickle", "pprint", "random", "re", "shutil", "statistics", "string",
    "subprocess", "tempfile", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "uuid", "zipfile",
)  # fmt: skip

PROMPT_SEED = 20240611
N_RANDOM_PROMPTS = 16

NATURAL_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Beautiful is better than ugly.",
    "Once upon a time, in a small village by the sea,",
    "The function returns a new list containing",
    "Speculative decoding lets a small model propose tokens that",
    "In the beginning the universe was created.",
    "Return the number of items in the container.",
    "She opened the door and saw",
    "To be, or not to be, that is the question:",
    "The weather today is",
    "Errors should never pass silently.",
    "A dictionary maps keys to values, and",
    "If the implementation is hard to explain, it's a bad idea.",
    "The train left the station at exactly",
    "Call this method to close the file and release",
    "My favourite recipe starts with two eggs,",
    "The mountain was covered in snow, and the climbers",
    "Parse the arguments from the command line and",
    "He said that the results were",
    "Namespaces are one honking great idea",
    "When the sun goes down over the hills,",
    "This module provides a simple way to",
    "The cat sat on the mat while",
    "Write the data to a temporary directory before",
    "Simple is better than complex, and complex is better than complicated.",
)


def corpus_text() -> str:
    """The deterministic training corpus (for a given CPython minor version)."""
    import this  # noqa: F401  (prints the Zen once; its text is ROT13 in this.s)

    parts = [codecs.decode(this.s, "rot13")]
    for name in CORPUS_MODULES:
        mod = importlib.import_module(name)
        if mod.__doc__:
            parts.append(mod.__doc__)
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            doc = inspect.getdoc(obj) if obj is not None else None
            if doc and not isinstance(obj, (str, int, float, bytes)):
                parts.append(doc)
    parts.extend(NATURAL_PROMPTS)
    return "\n\n".join(parts)


def build_tokenizer():  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus_text()
    chunks = [c for c in text.split("\n\n") if c.strip()]
    tok.train_from_iterator(chunks, trainer=trainer)
    return tok


def build_prompts(tok) -> list[dict]:
    out: list[dict] = []
    for i, text in enumerate(NATURAL_PROMPTS):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert 5 <= len(ids) <= 40, (text, len(ids))
        out.append({"id": f"nat-{i:02d}", "kind": "natural", "text": text, "token_ids": ids})
    rng = np.random.default_rng(PROMPT_SEED)
    n_special = len(SPECIAL_TOKENS)
    vocab = tok.get_vocab_size()
    for i in range(N_RANDOM_PROMPTS):
        length = int(rng.integers(5, 41))
        ids = [int(x) for x in rng.integers(n_special, vocab, size=length)]
        out.append({"id": f"rnd-{i:02d}", "kind": "random", "token_ids": ids})
    return out


def main() -> None:
    tok = build_tokenizer()
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i, special
    tok.save(str(TOKENIZER_FILE), pretty=True)
    prompts = build_prompts(tok)
    PROMPTS_FILE.write_text(json.dumps(prompts, indent=1) + "\n")
    print(f"wrote {TOKENIZER_FILE} (vocab {tok.get_vocab_size()}) and {len(prompts)} prompts")


if __name__ == "__main__":
    main()
