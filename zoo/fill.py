"""The fill fixture: a tool-calling tokenizer, chat templates and two tiny trained models.

What §7 of ``speculative-decoding.md`` (token fast-forwarding) needs to be
testable on the zoo:

- a seeded byte-level BPE tokenizer (HuggingFace ``tokenizers`` 0.2x, trained
  here from seeded text, nothing downloaded) with Qwen2's pre-tokenizer regex
  (``[^\\r\\n\\p{L}\\p{N}]?\\p{L}+``: one non-letter joins the letters after it),
  so tool names split differently in context than in isolation, as real ones
  do: ``<function=get_weather>`` encodes ``=get`` as ONE token, ``get_weather``
  alone encodes ``get``; JSON ``"get_weather"`` encodes ``"get``;
- two tool-calling chat templates (jinja, rendered by ``transformers``'
  ``apply_chat_template``): ``json`` (Qwen2.5/3 style
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``) and ``xml``
  (Qwen3.5 style ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nV\\n</parameter>
  \\n</function>\\n</tool_call>``); end of turn ``<|im_end|>`` is the EOS;
- one tiny mlx-lm 0.32.2 ``llama`` per syntax (``fill-json``, ``fill-xml``)
  trained with MLX on CPU (fixed seeds, Adam, next-token cross-entropy) on
  seeded conversations rendered through its template (tool calls, tool
  results, prose answers, multi-turn), so that greedy decoding writes the
  template's scaffold itself: the strict tier's identity gate at temperature 0
  is then about real model choices, not a vacuous pass.

The weights are committed under ``zoo/fill_models/<name>/`` and pinned (sha256)
in ``zoo/fill_manifest.json`` with the training settings and losses;
:func:`model_dir` verifies the pins. ``python -m zoo.fill`` regenerates
everything (about a minute per model on 2 cores); tests never train.

References mirrored: mlx-lm 0.32.2 ``mlx_lm/models/llama.py`` ``Model``;
``transformers`` 5.x ``PreTrainedTokenizerBase.apply_chat_template`` and
``utils/chat_template_utils.py`` ``_compile_jinja_template`` (the renderer);
``tokenizers`` ``trainers.BpeTrainer``; Qwen2's ``tokenizer.json``
pre-tokenizer (``Split`` regex + ``ByteLevel(use_regex=False)``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FILL_ROOT = HERE / "fill_models"
MANIFEST_FILE = HERE / "fill_manifest.json"
TOKENIZER_FILE = FILL_ROOT / "tokenizer.json"

SYNTAXES = ("json", "xml")
BOS_TOKEN, EOS_TOKEN = "<|bos|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, "<|im_start|>", "<tool_call>", "</tool_call>"]
BOS_ID, EOS_ID = 0, 1
VOCAB_SIZE = 448
TOKENIZER_SEED = 26_001
# Qwen2 / Qwen2.5 / Qwen3 tokenizer.json pre-tokenizer pattern.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _tool(name: str, desc: str, props: dict[str, str], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in props.items()},
                       "required": required}}}


# The tool catalog (OpenAI/HF ``tools`` format). get_weather and get_time share the merged
# ``=get``/``"get`` token, so the scaffold of a request holding both ends where the names
# diverge; search_web takes TWO required arguments (no close row may exist beside it).
TOOLS: dict[str, dict[str, Any]] = {t["function"]["name"]: t for t in (
    _tool("get_weather", "Current weather in a city.", {"city": "string"}, ["city"]),
    _tool("get_time", "Current time in a time zone.", {"zone": "string"}, ["zone"]),
    _tool("search_web", "Search the web.", {"query": "string", "limit": "integer"}, ["query", "limit"]),
    _tool("read_file", "Read a file.", {"path": "string"}, ["path"]),
)}
VALUES = {
    "city": ("Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Cairo", "Lima", "Seoul"),
    "zone": ("UTC", "CET", "EST", "PST", "JST"),
    "query": ("cheap flights", "python docs", "cake recipe", "bike shops", "news today"),
    "limit": (3, 5, 10),
    "path": ("notes.txt", "main.py", "data.csv", "todo.md"),
}
ASK = {
    "get_weather": ("What is the weather in {city}?", "Is it raining in {city}?", "Weather for {city}, please."),
    "get_time": ("What time is it in {zone}?", "Tell me the time in {zone}.", "Current time {zone}?"),
    "search_web": ("Search the web for {query}, top {limit}.", "Find {query} ({limit} results)."),
    "read_file": ("Show me {path}.", "Read the file {path}.", "What is in {path}?"),
}
RESULT = {
    "get_weather": ("{city}: 18C and sunny.", "{city}: 7C, light rain."),
    "get_time": ("It is 14:05 in {zone}.", "It is 09:30 in {zone}."),
    "search_web": ("Found {limit} pages about {query}.",),
    "read_file": ("{path} holds 12 lines.", "{path} is empty."),
}
ANSWER = {
    "get_weather": ("The weather in {city}: {result}", "Here it is: {result}"),
    "get_time": ("The time: {result}", "Here it is: {result}"),
    "search_web": ("Search done: {result}", "Here it is: {result}"),
    "read_file": ("The file: {result}", "Here it is: {result}"),
}
CHAT = (
    ("Hello!", "Hello! How can I help you today?"),
    ("Thanks, that is all.", "You are welcome. Have a nice day!"),
    ("Who are you?", "I am a small assistant that can call tools."),
    ("Tell me a joke.", "Why did the function return early? It had no arguments."),
)

# transformers compiles templates with trim_blocks/lstrip_blocks: a newline right after a
# block tag is eaten, so every newline that must follow one is written as {{ "\n" }}.
_SYSTEM = (
    "{%- if tools %}<|im_start|>system\nYou can call these tools:"
    "{%- for tool in tools %}{{ \"\\n- \" }}{{ tool.function.name }}("
    "{%- for key in tool.function.parameters.properties %}{{ key }}{% if not loop.last %}, {% endif %}"
    "{%- endfor %})"
    "{%- endfor %}{{ \"\\n\" }}{CALL_HINT}<|im_end|>{{ \"\\n\" }}{% endif %}"
)
_TURNS = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant{{ \"\\n\" }}"
    "{%- if message.content %}{{ message.content }}{% endif %}"
    "{%- for tc in message.tool_calls or [] %}"
    "{%- if message.content or not loop.first %}{{ \"\\n\" }}{% endif %}"
    "{CALL}"
    "{%- endfor %}<|im_end|>{{ \"\\n\" }}"
    "{%- elif message.role == 'tool' %}<|im_start|>tool\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>{{ \"\\n\" }}"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>{{ \"\\n\" }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ \"\\n\" }}{% endif %}"
)
_CALL = {
    "json": ('<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": '
             "{{ tc.function.arguments | tojson }}}\n</tool_call>"),
    "xml": ("<tool_call>\n<function={{ tc.function.name }}>"
            "{%- for key, value in tc.function.arguments.items() %}{{ \"\\n\" }}<parameter={{ key }}>\n{{ value }}"
            "\n</parameter>{% endfor %}{{ \"\\n\" }}</function>\n</tool_call>"),
}
_HINT = {
    "json": "Reply with a JSON tool call inside tool_call tags.\n",
    "xml": "Reply with a function tool call inside tool_call tags.\n",
}
CHAT_TEMPLATES = {s: (_SYSTEM.replace("{CALL_HINT}", _HINT[s]) + _TURNS.replace("{CALL}", _CALL[s]))
                  for s in SYNTAXES}


@dataclass(frozen=True)
class FillSpec:
    """Shape and training settings of one fill model (recorded in the manifest)."""

    name: str
    syntax: str
    seed: int
    hidden_size: int = 64
    num_hidden_layers: int = 2
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    steps: int = 700
    batch_size: int = 8
    window: int = 128  # the last ``window`` ids of each conversation (MLX on CPU is slow)
    lr: float = 3e-3
    warmup: int = 50
    conversations: int = 1500


SPECS = {f"fill-{s}": FillSpec(f"fill-{s}", s, seed) for s, seed in (("json", 26_011), ("xml", 26_012))}
NAMES = tuple(SPECS)


def model_name(syntax: str) -> str:
    if syntax not in SYNTAXES:
        raise ValueError(f"unknown fill syntax {syntax!r}; valid: {', '.join(SYNTAXES)}")
    return f"fill-{syntax}"


# ----------------------------------------------------------------------- conversations


@dataclass(frozen=True)
class Conversation:
    """One request: the messages so far, the request's ``tools``, and (for training) the reply."""

    id: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...]
    reply: dict[str, Any] | None = None


def _rng(seed: int, name: str) -> Any:
    from zoo.build import seeded_rng

    return seeded_rng(seed, name)


def _pick(rng: Any, xs: Any) -> Any:
    return xs[int(rng.integers(len(xs)))]


def _call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _args(rng: Any, name: str) -> dict[str, Any]:
    props = TOOLS[name]["function"]["parameters"]["properties"]
    return {k: _pick(rng, VALUES[k]) for k in props}


def _tools_for(rng: Any, needed: list[str]) -> tuple[dict[str, Any], ...]:
    others = [n for n in TOOLS if n not in needed]
    extra = [others[i] for i in rng.permutation(len(others))[: int(rng.integers(0, 3))]]
    names = sorted(set(needed) | set(extra), key=list(TOOLS).index)
    return tuple(TOOLS[n] for n in names)


def conversation(seed: int, i: int) -> Conversation:
    """Conversation ``i`` of stream ``seed``: a fresh call, a call after an earlier call and its
    result (the earlier call is echo-tier material), a prose answer to a tool result, or chat."""
    rng = _rng(seed, f"conversation:{i}")
    kind = _pick(rng, ("call", "call", "again", "answer", "chat"))
    name = _pick(rng, list(TOOLS))
    args = _args(rng, name)
    user = {"role": "user", "content": _pick(rng, ASK[name]).format(**args)}
    msgs: list[dict[str, Any]] = []
    needed = [name]
    if kind == "again":
        first = _pick(rng, list(TOOLS))
        a0 = _args(rng, first)
        needed.append(first)
        msgs += [{"role": "user", "content": _pick(rng, ASK[first]).format(**a0)},
                 {"role": "assistant", "content": "", "tool_calls": [_call(first, a0)]},
                 {"role": "tool", "content": _pick(rng, RESULT[first]).format(**a0)}]
    if kind == "chat":
        q, a = _pick(rng, CHAT)
        return Conversation(f"chat-{seed}-{i}", ({"role": "user", "content": q},),
                            _tools_for(rng, needed), {"role": "assistant", "content": a})
    msgs.append(user)
    if kind == "answer":
        result = _pick(rng, RESULT[name]).format(**args)
        msgs += [{"role": "assistant", "content": "", "tool_calls": [_call(name, args)]},
                 {"role": "tool", "content": result}]
        reply = {"role": "assistant", "content": _pick(rng, ANSWER[name]).format(result=result, **args)}
        return Conversation(f"answer-{seed}-{i}", tuple(msgs), _tools_for(rng, needed), reply)
    reply = {"role": "assistant", "content": "", "tool_calls": [_call(name, args)]}
    return Conversation(f"{kind}-{seed}-{i}", tuple(msgs), _tools_for(rng, needed), reply)


def training_conversations(spec: FillSpec) -> list[Conversation]:
    return [conversation(spec.seed, i) for i in range(spec.conversations)]


EVAL_SEED = 26_099


@cache
def prompts(n: int = 12) -> tuple[Conversation, ...]:
    """Held-out requests (a seed no model was trained on), without their replies: the fill
    tests' and ``specparity run``'s prompts. Ids ``fill-00`` ... are stable."""
    out = []
    for i in range(n):
        c = conversation(EVAL_SEED, i)
        out.append(Conversation(f"fill-{i:02d}", c.messages, c.tools))
    return tuple(out)


# ----------------------------------------------------------------------- tokenizer


def render(syntax: str, messages: Any, tools: Any = None, *, add_generation_prompt: bool = False) -> str:
    """The chat template rendered with transformers' own jinja compiler (as
    ``apply_chat_template`` does), without a tokenizer (the tokenizer's corpus needs it)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    tmpl = _compile_jinja_template(CHAT_TEMPLATES[syntax])
    return tmpl.render(messages=list(messages), tools=list(tools) if tools else None,
                       add_generation_prompt=add_generation_prompt, bos_token=BOS_TOKEN,
                       eos_token=EOS_TOKEN)


def _corpus() -> list[str]:
    texts = []
    for s in SYNTAXES:
        for i in range(600):
            c = conversation(TOKENIZER_SEED, i)
            assert c.reply is not None
            texts.append(render(s, [*c.messages, c.reply], c.tools))
    texts += [a for _, a in CHAT] + ["get the file", "run the command", "search the web", "read a file"]
    return texts


def build_tokenizer() -> Any:
    """The seeded BPE tokenizer (``tokenizers.Tokenizer``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def tokenizer_files(syntax: str, tokenizer_json: bytes) -> dict[str, bytes]:
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 2048, "chat_template": CHAT_TEMPLATES[syntax],
    }  # fmt: skip
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": _json_bytes(cfg),
            "special_tokens_map.json": _json_bytes(special)}


# ----------------------------------------------------------------------- models


def model_config(s: FillSpec) -> dict[str, Any]:
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


def _training_rows(s: FillSpec, tok: Any) -> list[list[int]]:
    rows = []
    for c in training_conversations(s):
        assert c.reply is not None
        rows.append(tok.encode(render(s.syntax, [*c.messages, c.reply], c.tools),
                               add_special_tokens=False).ids)
    return rows


def train_one(s: FillSpec, tok: Any, out_dir: Path, log: Any = print) -> dict[str, Any]:
    """Train fill model ``s``: whole conversations, padded, loss on every real position."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx_lm.models.llama import Model, ModelArgs

    from engine.models import parameters

    rows = [r[-s.window :] for r in _training_rows(s, tok)]
    width = s.window + 1
    data = np.full((len(rows), width), EOS_ID, np.int32)
    mask = np.zeros((len(rows), width - 1), np.float32)
    for i, r in enumerate(rows):
        data[i, : len(r)] = r
        mask[i, : len(r) - 1] = 1.0
    mx.random.seed(s.seed)
    model = Model(ModelArgs.from_dict(model_config(s)))
    mx.eval(model.parameters())
    rng = np.random.default_rng(s.seed)

    def loss_fn(m: Any, x: Any, y: Any, w: Any) -> Any:
        ce = nn.losses.cross_entropy(m(x), y, reduction="none")
        return (ce * w).sum() / w.sum()

    def lr_at(step: int) -> float:
        if step < s.warmup:
            return s.lr * (step + 1) / s.warmup
        t = (step - s.warmup) / max(1, s.steps - s.warmup)
        return s.lr * (0.05 + 0.475 * (1 + math.cos(math.pi * t)))

    opt = optim.Adam(learning_rate=s.lr)
    step_fn = nn.value_and_grad(model, loss_fn)
    t0 = time.perf_counter()
    recent: list[float] = []
    for step in range(s.steps):
        opt.learning_rate = lr_at(step)
        idx = rng.integers(0, len(rows), s.batch_size)
        x, y, w = mx.array(data[idx, :-1]), mx.array(data[idx, 1:]), mx.array(mask[idx])
        loss, grads = step_fn(model, x, y, w)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        recent = (recent + [loss.item()])[-50:]
        if step % 50 == 0 or step == s.steps - 1:
            log(f"{s.name}: step {step} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)")
    out_dir.mkdir(parents=True, exist_ok=True)
    params = parameters(model)
    mx.save_safetensors(str(out_dir / "model.safetensors"), {k: params[k] for k in sorted(params)},
                        metadata={"format": "mlx"})
    (out_dir / "config.json").write_bytes(_json_bytes(model_config(s)))
    for fname, blob in tokenizer_files(s.syntax, TOKENIZER_FILE.read_bytes()).items():
        (out_dir / fname).write_bytes(blob)
    return {"train_loss_last50": round(float(np.mean(recent)), 4),
            "train_seconds": round(time.perf_counter() - t0, 1),
            "params": int(sum(v.size for v in params.values())), "max_len": width}


# ----------------------------------------------------------------------- loading


class FillDriftError(RuntimeError):
    """A committed fill model no longer matches ``fill_manifest.json``."""


@cache
def manifest() -> dict[str, Any]:
    return json.loads(MANIFEST_FILE.read_text())


@cache
def _verified(name: str) -> Path:
    from zoo import config_digest, weights_digest

    entry = manifest()["models"].get(name)
    if entry is None:
        raise FillDriftError(f"zoo drift: fill model {name}: no entry in {MANIFEST_FILE}")
    if entry["spec"] != asdict(SPECS[name]):
        raise FillDriftError(f"zoo drift: fill model {name}: its spec differs from the manifest; "
                             "run `python -m zoo.fill` if intended")
    d = FILL_ROOT / name
    for fname, key, fn in (("model.safetensors", "weights_sha256", weights_digest),
                           ("config.json", "config_sha256", config_digest)):
        got = fn(d)
        if got != entry[key]:
            raise FillDriftError(f"zoo drift: fill model {name}: {fname} in {d} has sha256 {got}, "
                                 f"the manifest expects {entry[key]}")
    tok = json.loads((d / "tokenizer_config.json").read_text())
    if tok.get("chat_template") != CHAT_TEMPLATES[SPECS[name].syntax]:
        raise FillDriftError(f"zoo drift: fill model {name}: the chat template in {d} is not "
                             f"zoo.fill.CHAT_TEMPLATES[{SPECS[name].syntax!r}]")
    return d


def model_dir(syntax: str) -> Path:
    """The committed, verified directory of the fill model for ``syntax`` (``mlx_lm.load``-able)."""
    return _verified(model_name(syntax))


@cache
def tokenizer(syntax: str) -> Any:
    """The model's HF tokenizer (``transformers.AutoTokenizer``, as mlx-lm loads it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir(syntax)))


@cache
def load(syntax: str) -> Any:
    """The fill model for ``syntax`` (an mlx-lm ``Model``)."""
    from mlx_lm.utils import load_model

    return load_model(model_dir(syntax))[0]


def prompt_ids(syntax: str, conv: Conversation) -> list[int]:
    text = tokenizer(syntax).apply_chat_template(list(conv.messages), tools=list(conv.tools),
                                                 add_generation_prompt=True, tokenize=False)
    return list(tokenizer(syntax).encode(text, add_special_tokens=False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=NAMES, help="retrain one model (keeps the tokenizer)")
    args = ap.parse_args(argv)
    from zoo import config_digest, weights_digest

    FILL_ROOT.mkdir(exist_ok=True)
    if args.only is None:
        tok = build_tokenizer()
        TOKENIZER_FILE.write_text(tok.to_str(pretty=True) + "\n")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER_FILE))
    old = json.loads(MANIFEST_FILE.read_text()) if MANIFEST_FILE.is_file() else {"models": {}}
    models = dict(old.get("models", {}))
    for name in ([args.only] if args.only else NAMES):
        d = FILL_ROOT / name
        if d.exists():
            shutil.rmtree(d)
        rec = train_one(SPECS[name], tok, d)
        models[name] = {"spec": asdict(SPECS[name]), **rec, "weights_sha256": weights_digest(d),
                        "config_sha256": config_digest(d)}
    MANIFEST_FILE.write_bytes(_json_bytes({"format": 1, "models": models}))
    print(f"wrote {MANIFEST_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# ----------------------------------------------------------------------- fill cases

TIERS = ("strict", "echo")


@dataclass(frozen=True)
class FillCase:
    """One fill comparison: ``tier`` on the ``syntax`` model, one held-out prompt, paired with
    plain decode of the same request."""

    syntax: str
    tier: str
    prompt_id: str
    max_tokens: int = 48
    temperature: float = 0.0
    seed: int = 0

    @property
    def case_id(self) -> str:
        t = "" if self.temperature == 0 else f"/temp{self.temperature:g}"
        return f"fill-{self.syntax}/{self.tier}/{self.prompt_id}/t{self.max_tokens}{t}"


def conversation_by_id(prompt_id: str) -> Conversation:
    for c in prompts():
        if c.id == prompt_id:
            return c
    raise ValueError(f"unknown fill prompt {prompt_id!r}; known: {', '.join(c.id for c in prompts())}")


def plan_for(syntax: str, conv: Conversation) -> Any:
    """The strict tier's compiled rows for ``conv`` (``engine.fill.strict.compile_rows``)."""
    from engine.fill.strict import compile_rows

    return compile_rows(tokenizer(syntax), conv.messages, conv.tools, eos_ids=[EOS_ID])


def sources_for(tier: str, syntax: str, conv: Conversation, plan: Any = None) -> list[Any]:
    from engine.fill.echo import EchoSource
    from engine.fill.strict import StrictSource

    plan = plan if plan is not None else plan_for(syntax, conv)
    if tier == "strict":
        return [StrictSource(plan)]
    if tier == "echo":
        return [EchoSource(delimiters=plan.delimiters)]
    raise ValueError(f"unknown fill tier {tier!r}; valid: {', '.join(TIERS)}")


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing output id (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_case(case: FillCase, sources: list[Any] | None = None, **fill_kwargs: Any) -> dict[str, Any]:
    """Plain decode and fill decode of one case, with the verdict: ``identical`` or
    ``divergent`` (first output position named, with the append covering it) at temperature 0;
    the §7 behaviour-policy ``deviation`` (never an identity comparison) when an assert fill
    fired at temperature > 0, else ``not-compared``."""
    from engine.executor import GenerationParams, plain_generate
    from engine.fill.proposal import behaviour_deviation, fill_generate
    from engine.sampler import SamplerParams

    conv = conversation_by_id(case.prompt_id)
    model = load(case.syntax)
    ids = prompt_ids(case.syntax, conv)
    params = GenerationParams(max_tokens=case.max_tokens, sampler=SamplerParams(temperature=case.temperature),
                              seed=case.seed, eos_ids=(EOS_ID,), cache_digests=False)
    plain = plain_generate(model, ids, params)
    srcs = sources if sources is not None else sources_for(case.tier, case.syntax, conv)
    filled = fill_generate(model, ids, params, srcs, **fill_kwargs)
    out: dict[str, Any] = {
        "case_id": case.case_id, "syntax": case.syntax, "tier": case.tier, "prompt": case.prompt_id,
        "temperature": case.temperature, "plain_ids": plain.output_ids, "fill_ids": filled.output_ids,
        "plain_forwards": plain.usage.generation_tokens, "fill_forwards": filled.stats.forwards,
        "fill_tokens": filled.usage.generation_tokens,
        "stats": filled.stats.to_dict(), "events": filled.events,
        "finish": [plain.usage.finish_reason, filled.usage.finish_reason],
    }
    deviation = behaviour_deviation(params, filled.stats)
    if case.temperature > 0:
        out["verdict"] = "deviation" if deviation else "not-compared"
        out["message"] = deviation or "sampled decode: fill and plain draw differently, not compared"
        return out
    pos = first_divergence(plain.output_ids, filled.output_ids)
    if pos is None and plain.usage.finish_reason == filled.usage.finish_reason:
        out["verdict"], out["message"] = "identical", ""
        return out
    out["verdict"] = "divergent"
    ev = next((e for e in filled.events if e["position"] <= (pos or 0) < e["position"] + e["kept"]), None)
    tok = tokenizer(case.syntax)

    def show(xs: list[int]) -> str:
        return repr(tok.decode(xs[pos : (pos or 0) + 1])) if pos is not None and pos < len(xs) else "(end)"

    out["class"], witness = "logic", ""
    if pos is not None:  # does arithmetic alone explain it? (engine.fill.witness)
        from engine.fill.witness import witness_fill_flip

        v = witness_fill_flip(model, ids, params, filled.output_ids, filled.events, plain.output_ids, pos)
        out["class"] = v.klass
        out["witness"] = {"reason": v.reason, "evidence": list(v.evidence), "data": v.data}
        witness = f"\n  class: {v.klass} (witness: {v.reason})\n    " + "\n    ".join(v.evidence)
    out["message"] = (f"{case.case_id}: fill diverges from plain decode at output token {pos}: plain "
                      f"{plain.output_ids[pos] if pos is not None and pos < len(plain.output_ids) else None} "
                      f"{show(plain.output_ids)}, fill "
                      f"{filled.output_ids[pos] if pos is not None and pos < len(filled.output_ids) else None} "
                      f"{show(filled.output_ids)}"
                      + (f"; inside append {ev['event']} ({ev['origin']}, {ev['policy']}, positions "
                         f"{ev['position']}..{ev['position'] + ev['kept'] - 1})" if ev else
                         "; after the appends (the injected context changed the model's next choice)")
                      + f"; finish {plain.usage.finish_reason} vs {filled.usage.finish_reason}" + witness)
    out["position"] = pos
    return out


MATRIX_PROMPTS = 12


def matrix(max_tokens: int = 48, n_prompts: int = MATRIX_PROMPTS) -> list[FillCase]:
    """The zoo matrix's fill cases: strict and echo on both syntaxes over the held-out prompts
    (tool calls, calls after an earlier call, prose answers to tool results, chat)."""
    ids = [c.id for c in prompts()][:n_prompts]
    return [FillCase(s, t, p, max_tokens) for s in SYNTAXES for t in TIERS for p in ids]
