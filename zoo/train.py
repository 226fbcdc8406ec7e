"""A realistic trained pair for the zoo: a tiny llama target and a 1-layer drafter.

Both are mlx-lm 0.32.2 ``mlx_lm/models/llama.py`` ``Model``s trained with MLX on
CPU (next-token cross-entropy, Adam, fixed seeds) on text that exists offline:
the docstrings of a fixed list of CPython 3.11 standard-library modules
(``inspect.getdoc`` of each module and its public classes and functions),
tokenized with the zoo tokenizer (``zoo/tokenizer.json``), one
``<|eos|>`` after each docstring.

The weights are committed under ``zoo/trained/<name>/`` (config.json +
model.safetensors + tokenizer files, loadable with ``mlx_lm.load``), pinned in
``zoo/trained/manifest.json`` (``zoo.weights_digest`` /
``config_digest``) with the training settings, the final losses and the greedy
acceptance measured with the engine (γ=3, 32 tokens, the zoo prompts).
:func:`trained_dir` verifies the pins and returns the committed directory.

``python -m zoo.train`` regenerates everything (a few minutes on 2
cores); tests and CI never train.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

from zoo.build import json_bytes

HERE = Path(__file__).resolve().parent
TRAINED_ROOT = HERE / "trained"
TRAINED_MANIFEST = TRAINED_ROOT / "manifest.json"
TOKENIZER_FILE = HERE / "tokenizer.json"
VOCAB_SIZE = 512
BOS_ID, EOS_ID = 0, 1
BOS_TOKEN, EOS_TOKEN = "<|bos|>", "<|eos|>"

TARGET_NAME = "llama-trained"
DRAFTER_NAME = "llama-trained-draft"
PAIR = (TARGET_NAME, DRAFTER_NAME)

# A fixed list of CPython 3.11 stdlib modules; order matters (the corpus is their
# docstrings, concatenated in this order).
MODULES: tuple[str, ...] = (
    "abc", "argparse", "base64", "bisect", "calendar", "collections", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum",
    "fnmatch", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "hmac",
    "html", "http.client", "inspect", "io", "ipaddress", "itertools", "json", "logging",
    "operator", "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched",
    "secrets", "shlex", "shutil", "socket", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "tokenize", "typing", "unittest",
    "urllib.parse", "uuid", "warnings", "weakref", "zipfile",
)  # fmt: skip


@dataclass(frozen=True)
class Spec:
    """Model shape and training settings of one trained model (recorded in the manifest)."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    steps: int
    seed: int
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    warmup: int = 50


SPECS: dict[str, Spec] = {
    TARGET_NAME: Spec(TARGET_NAME, 96, 2, 256, 4, 2, 24, steps=400, seed=11),
    DRAFTER_NAME: Spec(DRAFTER_NAME, 48, 1, 128, 2, 1, 24, steps=300, seed=12),
}


# ------------------------------------------------------------------------- loading


def _zoo_drift(msg: str) -> Exception:
    from zoo import ZooDriftError

    return ZooDriftError(f"zoo drift: {msg}")


def trained_manifest() -> dict[str, Any]:
    return json.loads(TRAINED_MANIFEST.read_text())


def trained_dir(name: str) -> Path:
    """The committed directory of trained model ``name``, verified against the manifest.

    Raises ``ValueError`` for an unknown name and ``zoo.ZooDriftError``
    ("zoo drift: ...") when a committed file no longer matches its pinned sha256.
    """
    from zoo import config_digest, pinned, weights_digest

    models = trained_manifest()["models"]
    if name not in models:
        raise ValueError(f"unknown trained model {name!r}; valid: {', '.join(sorted(models))}")
    entry, d = models[name], TRAINED_ROOT / name
    checks = (
        ("model.safetensors", "weights_sha256", lambda: weights_digest(d)),
        ("config.json", "config_sha256", lambda: config_digest(d)),
        ("tokenizer.json", "tokenizer_sha256",
         lambda: hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()),
    )  # fmt: skip
    pinned.check_digests(d, entry, checks, lambda m: _zoo_drift(f"{name}: {m}"),
                         "regenerate with `python -m zoo.train`")
    return d


def trained_pair() -> tuple[Path, Path]:
    """``(target_dir, drafter_dir)`` of the trained pair, both verified."""
    return trained_dir(TARGET_NAME), trained_dir(DRAFTER_NAME)


# ------------------------------------------------------------------------ training


def corpus_text() -> str:
    """Docstrings of :data:`MODULES` (module, then public members by name), EOS-separated later."""
    docs = []
    for modname in MODULES:
        mod = import_module(modname)
        if mod.__doc__:
            docs.append(inspect.getdoc(mod) or "")
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                doc = inspect.getdoc(obj)
                if doc:
                    docs.append(doc)
    return "\x00".join(d for d in docs if d.strip())


def corpus_ids() -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER_FILE))
    ids: list[int] = []
    for doc in corpus_text().split("\x00"):
        ids += tok.encode(doc, add_special_tokens=False).ids + [EOS_ID]
    return ids


def model_config(s: Spec) -> dict[str, Any]:
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": s.hidden_size, "num_hidden_layers": s.num_hidden_layers,
        "intermediate_size": s.intermediate_size, "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads, "head_dim": s.head_dim,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID, "torch_dtype": "float32", "attention_bias": False,
        "mlp_bias": False, "rope_traditional": False,
    }  # fmt: skip


def _tokenizer_files() -> dict[str, bytes]:
    """Same tokenizer files as the seed-built zoo (``zoo/build.py``)."""
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 2048,
    }  # fmt: skip
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    return {"tokenizer.json": TOKENIZER_FILE.read_bytes(),
            "tokenizer_config.json": json_bytes(tok_cfg),
            "special_tokens_map.json": json_bytes(special)}


def train_one(s: Spec, data: Any, val: Any, out_dir: Path, log: Any = print) -> dict[str, Any]:
    """Train model ``s`` on token array ``data``; write it to ``out_dir``; return its record."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx_lm.models.llama import Model, ModelArgs

    from engine.models import parameters

    mx.random.seed(s.seed)
    model = Model(ModelArgs.from_dict(model_config(s)))
    mx.eval(model.parameters())
    rng = np.random.default_rng(s.seed)

    def batch(src: Any, n: int) -> tuple[Any, Any]:
        starts = rng.integers(0, len(src) - s.seq_len - 1, n)
        x = np.stack([src[i : i + s.seq_len + 1] for i in starts])
        return mx.array(x[:, :-1]), mx.array(x[:, 1:])

    def loss_fn(m: Any, x: Any, y: Any) -> Any:
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    def lr_at(step: int) -> float:
        if step < s.warmup:
            return s.lr * (step + 1) / s.warmup
        t = (step - s.warmup) / max(1, s.steps - s.warmup)
        return s.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))

    opt = optim.Adam(learning_rate=s.lr)
    step_fn = nn.value_and_grad(model, loss_fn)
    t0 = time.perf_counter()
    recent: list[float] = []
    for step in range(s.steps):
        opt.learning_rate = lr_at(step)
        x, y = batch(data, s.batch_size)
        loss, grads = step_fn(model, x, y)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        recent = (recent + [loss.item()])[-50:]
        if step % 200 == 0 or step == s.steps - 1:
            log(f"{s.name}: step {step} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")
    vx, vy = batch(val, 256)
    val_loss = float(loss_fn(model, vx, vy).item())
    out_dir.mkdir(parents=True, exist_ok=True)
    params = parameters(model)
    mx.save_safetensors(str(out_dir / "model.safetensors"),
                        {k: params[k] for k in sorted(params)}, metadata={"format": "mlx"})
    (out_dir / "config.json").write_bytes(json_bytes(model_config(s)))
    for fname, blob in _tokenizer_files().items():
        (out_dir / fname).write_bytes(blob)
    return {"train_loss_last50": round(float(np.mean(recent)), 4), "val_loss": round(val_loss, 4),
            "train_seconds": round(time.perf_counter() - t0, 1),
            "params": int(sum(v.size for v in params.values()))}


def measure_engine_acceptance(target_dir: Path, drafter_dir: Path, gamma: int = 3,
                              max_tokens: int = 32) -> dict[str, Any]:
    """Greedy acceptance (accepted / drafted) of the pair with the engine over the zoo prompts."""
    import zoo
    from engine.executor import GenerationParams, spec_generate
    from engine.models import load
    from engine.sources.two_model import TwoModelProvider

    t, d = load(target_dir), load(drafter_dir)
    params = GenerationParams(max_tokens=max_tokens, gamma=gamma, eos_ids=t.eos_ids,
                              cache_digests=False)
    totals = {"natural": [0, 0], "random": [0, 0]}
    for p in zoo.prompts():
        res = spec_generate(t.model, TwoModelProvider(d.model), list(p.token_ids), params)
        assert res.speculation is not None
        totals[p.kind][0] += res.speculation.accepted
        totals[p.kind][1] += res.speculation.drafted
    acc = sum(v[0] for v in totals.values())
    drafted = sum(v[1] for v in totals.values())
    return {"gamma": gamma, "max_tokens": max_tokens, "prompts": len(zoo.prompts()),
            "drafted": drafted, "accepted": acc, "acceptance": round(acc / drafted, 4),
            **{f"acceptance_{k}": round(v[0] / v[1], 4) if v[1] else None
               for k, v in totals.items()}}


def main(argv: list[str] | None = None) -> int:
    from traces.outdir import UsageError, add_outputs, output_dir_arg

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=output_dir_arg, default=TRAINED_ROOT,
                    help="the trained pair's folder (default zoo/trained; a new folder, or one this command wrote)")
    ap.add_argument("--only", choices=sorted(SPECS), action="append",
                    help="retrain only this model (repeatable); the others are kept as they are")
    args = ap.parse_args(argv)
    try:  # the ownership mechanism: refused before any training if a file it replaces is not ours
        with add_outputs(args.out, PROG, flag="--out", recognise=lambda p: _trained_output(args.out, p)) as claim:
            claim.check(args.out / "manifest.json")
            for name in set(args.only or SPECS):
                for f in sorted((args.out / name).rglob("*")) if (args.out / name).is_dir() else ():
                    claim.check(f)
            return _train(args, claim)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


PROG = "python -m zoo.train"
TRAINED_FILES = frozenset({"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                           "special_tokens_map.json"})


def _trained_output(out: Path, p: Path) -> bool:
    """A file of the layout this command writes (before output markers existed: zoo/trained)."""
    try:
        rel = p.relative_to(out).parts
    except ValueError:
        return False
    if rel == ("manifest.json",):
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            return False
        return isinstance(doc, dict) and {"pair", "models"} <= set(doc)
    return len(rel) == 2 and rel[0] in SPECS and rel[1] in TRAINED_FILES


def _train(args: argparse.Namespace, claim: Any) -> int:
    import tempfile

    import mlx.core as mx
    import numpy as np

    from traces.outdir import publish_tree
    from zoo import config_digest, weights_digest
    only = set(args.only or SPECS)
    old = json.loads((args.out / "manifest.json").read_text()) if only != set(SPECS) else None
    if sys.version_info[:2] != (3, 11):
        print(f"warning: the corpus is pinned to CPython 3.11 docstrings; this is "
              f"{sys.version.split()[0]}", file=sys.stderr)
    ids = np.array(corpus_ids(), dtype=np.int32)
    split = int(len(ids) * 0.95)
    train, val = ids[:split], ids[split:]
    print(f"corpus: {len(MODULES)} modules, {len(ids)} tokens", file=sys.stderr)
    mx.set_default_device(mx.cpu)
    records = {}
    for name, s in SPECS.items():
        if name not in only:
            assert old is not None
            records[name] = {k: old["models"][name][k]
                             for k in ("train_loss_last50", "val_loss", "train_seconds", "params")}
            continue
        with tempfile.TemporaryDirectory(prefix=f"specparity-train-{name}-") as tmp:
            records[name] = train_one(s, train, val, Path(tmp) / name, log=lambda m: print(m, file=sys.stderr))
            publish_tree(claim, Path(tmp) / name, args.out / name)
    acc = measure_engine_acceptance(args.out / TARGET_NAME, args.out / DRAFTER_NAME)
    print(f"engine greedy acceptance: {acc}", file=sys.stderr)
    tok_sha = hashlib.sha256(TOKENIZER_FILE.read_bytes()).hexdigest()
    manifest = {
        "about": "Trained pair (zoo/train.py); regenerate with `python -m zoo.train`.",
        "corpus": {"source": "inspect.getdoc of CPython stdlib modules and their public "
                             "classes/functions", "python": sys.version.split()[0],
                   "modules": list(MODULES), "tokens": int(len(ids)), "val_fraction": 0.05,
                   "text_sha256": hashlib.sha256(corpus_text().encode()).hexdigest()},
        "mlx": getattr(mx, "__version__", "unknown"),
        "pair": {"target": TARGET_NAME, "drafter": DRAFTER_NAME, "acceptance": acc},
        "models": {
            name: {"weights_sha256": weights_digest(args.out / name),
                   "config_sha256": config_digest(args.out / name), "tokenizer_sha256": tok_sha,
                   "training": asdict(SPECS[name]) | {"optimizer": "Adam", "dtype": "float32",
                                                      "schedule": "linear warmup, cosine to 0.1"},
                   **records[name]}
            for name in SPECS
        },
    }
    from traces.io import atomic_write_text

    atomic_write_text(claim.track(args.out / "manifest.json"), json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest["pair"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
