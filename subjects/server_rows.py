"""The served engines: one row per OpenAI-compatible server ``grade --serve`` can start.

A row says everything about one server: the pip requirement of its tox environment, the module
or console script that starts it, its argv (plain arm, and the speculative arm's drafter or
model-free flags), the flags that turn its prompt cache off, and the lossy or surprising
defaults turned off for every grading (named in its row of the scoreboard). Rows beside
:data:`subjects.SUBJECTS` (the engines graded in process), in the layer that knows no job:
the runner registry (``specparity/runners/servers.py``) makes each row a runner of kind
``server``; the job that starts and grades them is ``specparity/grading/http_servers.py``;
the checks are ``subjects/served/``.
"""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from traces import env


@dataclass(frozen=True)
class ChatWrap:
    """How a server wraps a ``/v1/completions`` prompt before it completes it: the prompt text as
    the one user message of a chat, after the system message ``system`` (None: none), rendered by
    the model's own chat template (``add_generation_prompt``) and the rendered text encoded by the
    tokenizer (its special tokens, a BOS, as its ``encode`` adds them); ``chat_system``: the server
    also injects ``system`` into chat requests that carry no system message. Declared on a row
    (``ServedEngine.completions_wrap``), the grader's reference for each request is plain decode of
    the wrapped prompt, credited only where the server's ``usage.prompt_tokens`` is its length."""

    system: str | None = None
    add_generation_prompt: bool = True
    chat_system: bool = True

    def describe(self) -> str:
        sys_part = f" after the system message {self.system!r}" if self.system else ""
        chat = (f"; chat requests without a system message get {self.system!r} too"
                if self.system and self.chat_system else "")
        return (f"every /v1/completions prompt is sent as the one user message of a chat{sys_part}, rendered by "
                f"the model's chat template (add_generation_prompt={self.add_generation_prompt}) and the text "
                f"encoded{chat}: the reference is plain decode of that wrapped prompt")


@dataclass(frozen=True)
class ServedEngine:
    """A server ``--serve`` can start: its package, how to start it, where it runs."""

    name: str
    package: str  # the pip requirement of its tox environment
    module: str  # importable when installed here
    tox_env: str
    argv: Callable[[str, str | None, int], list[str]]
    note: str = ""
    exe: str | None = None  # a console script (in $SPECPARITY_SERVER_BIN when set), else ``module`` is imported
    spec_without_draft: bool = False  # a model-free speculative mode: the spec arm runs without --draft
    cache_off: tuple[str, ...] | None = None  # the flags that turn its prompt cache off (None: it has none)
    defaults_off: tuple[str, ...] = ()  # flags always passed: its lossy or surprising defaults turned off
    test_double: bool = False  # a double for the harness's own tests (a checkout only), not a server to grade
    spec_method: str | None = None  # the spec arm's method as its /metrics label it (method="..."): others not counted
    # files written into its isolated home before it starts ((path under HOME, text)): defaults it takes from a
    # settings file only (no flag), turned off there and named in its row, as ``defaults_off``
    home_files: tuple[tuple[str, str], ...] = ()
    # how it wraps a completions prompt where no flag turns that off (None: it completes the prompt as sent); named
    # in its row, as ``defaults_off``; without it, a server whose usage.prompt_tokens shows another prompt is one
    # identity finding and every check judged against plain decode of the prompt as sent cannot grade
    completions_wrap: ChatWrap | None = None
    # what its log shows when a default asked off is on after all ((setting, regex of such a line)): quoted in the
    # row's observed set-up and in the cells that ran with it (subjects/setup_evidence.py)
    observe: tuple[tuple[str, str], ...] = ()
    # its requests name the model by the path it was started with (a server that loads whatever model a request
    # names, and drops the one it serves for it: mlx-vlm); else "default_model", or the name a refusal teaches
    request_model_is_path: bool = False
    # its spec arm is started with a two-model draft model (the draft path in its argv); None: a module server
    # (``exe`` None: mlx_lm.server, the fake) does, a console script does not unless its row says so (vmlx)
    two_model_draft: bool | None = None

    def takes_draft(self) -> bool:
        """Whether ``--draft`` starts its spec arm with that draft model (else the spec arm is dropped,
        or, for ``spec_without_draft``, switched on model-free)."""
        if self.spec_without_draft:
            return False
        return self.exe is None if self.two_model_draft is None else self.two_model_draft

    def available(self) -> bool:
        if self.exe is not None:
            return shutil.which(server_bin(self.exe)) is not None
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False

    def command(self, model: str, draft: str | None, port: int, *, cache_off: bool = False,
                extra: Sequence[str] = ()) -> list[str]:
        off = list(self.cache_off) if cache_off and self.cache_off else []
        return [*self.argv(model, draft, port), *self.defaults_off, *off, *extra]


def _mlx_lm(model: str, draft: str | None, port: int) -> list[str]:
    extra = ["--draft-model", draft, "--num-draft-tokens", "3"] if draft else []
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "WARNING", *extra]


def _fake(model: str, draft: str | None, port: int) -> list[str]:
    extra = ["--draft-model", draft] if draft else []
    return [sys.executable, "-m", "tests.fake_server", "--model", model, "--port", str(port), *extra]


def _mlx_vlm(model: str, draft: str | None, port: int) -> list[str]:
    """mlx-vlm 0.7.10's server (mlx_vlm/server/cli.py ``main``: ``--model``, ``--host``, ``--port``,
    ``--draft-model``; the drafter's family, dflash / eagle3 / mtp, auto-detected from its model_type)."""
    extra = ["--draft-model", draft] if draft else []
    return [server_bin("mlx_vlm.server"), "--model", model, "--host", "127.0.0.1", "--port", str(port), *extra]


def server_bin(exe: str) -> str:
    """``exe`` from ``$SPECPARITY_SERVER_BIN`` (the server's own virtualenv: its pins conflict with ours)."""
    d = env.get("SPECPARITY_SERVER_BIN")
    return str(Path(d) / exe) if d else exe


def _model_dir(model: str) -> str:
    """A fresh folder whose one subdirectory ``default_model`` links to ``model`` (servers that
    serve every subdirectory of ``--model-dir`` by its name)."""
    d = Path(tempfile.mkdtemp(prefix="specparity-models-"))
    (d / "default_model").symlink_to(Path(model).resolve(), target_is_directory=True)
    atexit.register(shutil.rmtree, d, ignore_errors=True)  # the link only, never the model
    return str(d)


def _cli(exe: str, *serve: str, plain: Sequence[str] = (), spec: Sequence[str] = (),
         model_dir: bool = False) -> Callable[[str, str | None, int], list[str]]:
    """``EXE SERVE... MODEL --host 127.0.0.1 --port P`` + the plain arm's or the speculative arm's flags
    (``spec``: ``{draft}`` is replaced by the draft path); ``model_dir``: ``--model-dir DIR`` instead
    of ``MODEL``, the model linked as ``DIR/default_model``."""
    def argv(model: str, draft: str | None, port: int) -> list[str]:
        extra = [a.replace("{draft}", draft) for a in spec] if draft else list(plain)
        m = ["--model-dir", _model_dir(model)] if model_dir else [model]
        return [server_bin(exe), *serve, *m, "--host", "127.0.0.1", "--port", str(port), *extra]

    return argv


KEY = ["--api-key", "specparity-local"]  # the bearer token subjects.http_client sends by default
SUFFIX = '{"method":"suffix","num_speculative_tokens":4}'
# fusion-mlx 0.10.24's per-model settings (model_settings/__init__.py ModelSettingsManager: {"version": 1,
# "models": {id: ModelSettings}}), the model served as default_model: TurboQuant KV off
FUSION_SETTINGS = '{"version": 1, "models": {"default_model": {"turboquant_kv_enabled": false}}}'

SERVERS: dict[str, ServedEngine] = {
    s.name: s for s in (
        ServedEngine("mlx-lm", "mlx-lm==0.32.2", "mlx_lm.server", "server-mlx-lm", _mlx_lm,
                     note="mlx_lm.server (BatchGenerator without a drafter; stream_generate with --draft-model)",
                     cache_off=("--prompt-cache-size", "0")),
        ServedEngine("vllm-mlx", "vllm-mlx==0.6.0", "vllm_mlx", "server-vllm-mlx",
                     _cli("vllm-mlx", "serve", plain=["--served-model-name", "default_model"]), exe="vllm-mlx",
                     note="vllm-mlx serve (no two-model drafter: plain arm only)"),
        ServedEngine("fusion-mlx", "fusion-mlx==0.10.24", "fusion_mlx", "server-fusion-mlx",
                     _cli("fusion-mlx", "serve", model_dir=True, plain=[*KEY, "--no-spec-decode"]),
                     exe="fusion-mlx", cache_off=("--no-prefix-cache",),
                     # its defaults: an int4 KV cache (lossy), the 'standard' profile (mounts mlx-vlm engines),
                     # `--spec-decode` auto-selection: turned off and named in its row
                     defaults_off=("--kv-cache-dtype", "bf16", "--profile", "lite", "--spec-decode", "none"),
                     # and its TurboQuant 4-bit KV cache, auto-enabled for a model without per-model settings
                     # (engines/batched.py; head dim 64 is eligible): off only in ~/.fusion-mlx/model_settings.json
                     home_files=((".fusion-mlx/model_settings.json", FUSION_SETTINGS),),
                     # its /v1/completions (api/openai/completions.py) runs the prompt as one user message through
                     # the chat path, whose _apply_chat_template (engines/batched.py) inserts this system message
                     # into every chat without one (completions included; no flag) and encodes the rendered text
                     completions_wrap=ChatWrap(system="You are a helpful assistant."),
                     note="fusion-mlx serve --model-dir (speculation needs MTP/DFlash/DSpark drafters: plain arm only)"),
        ServedEngine("qmlx-serve", "qmlx-serve==0.16.0", "vllm_mlx", "server-qmlx-serve",
                     _cli("qmlx", "serve", plain=["--served-model-name", "default_model", "--no-spec-decode"],
                          spec=["--served-model-name", "default_model", "--speculative-config", SUFFIX]),
                     exe="qmlx", spec_without_draft=True, cache_off=("--disable-prefix-cache",),
                     # its default: an int4 KV cache (lossy; `--kv-cache-dtype` default int4): turned off and
                     # named in its row
                     defaults_off=("--kv-cache-dtype", "bf16"),
                     spec_method="suffix",  # its /metrics counters are MTP's and DFlash's (method="mtp"/"dflash")
                     note="qmlx serve; spec arm: model-free SuffixDecoding (--speculative-config suffix, 4 tokens)"),
        ServedEngine("flyto-mlx", "flyto-mlx==0.7.0", "omlx", "server-flyto-mlx",
                     _cli("omlx", "serve", model_dir=True), exe="omlx",
                     note="omlx serve --model-dir (flyto-mlx's oMLX server; no two-model drafter: plain arm only)"),
        ServedEngine("rapid-mlx", "rapid-mlx==0.16.10", "rapid_mlx", "server-rapid-mlx",
                     _cli("rapid-mlx", "serve", plain=["--served-model-name", "default_model", "--no-spec-decode"],
                          spec=["--served-model-name", "default_model", "--speculative-config", SUFFIX]),
                     exe="rapid-mlx", spec_without_draft=True, cache_off=("--disable-prefix-cache",),
                     # its defaults: caches written to / read from disk, model downloads, a pre-download check
                     defaults_off=("--kv-cache-dtype", "bf16", "--disable-disk-caches", "--disable-model-downloads",
                                   "--no-preflight"),
                     # its rapid_mlx_spec_decode_* counters are MTP's (method="mtp"); SuffixDecoding's are
                     # rapid_mlx_suffix_decode_*{method="suffix"} (rapid_mlx/routes/metrics.py)
                     spec_method="suffix",
                     note="rapid-mlx serve; spec arm: model-free SuffixDecoding (--speculative-config suffix, 4 tokens)"),
        ServedEngine("yunshu", "yunshu==0.1.5", "yunshu_engine", "server-yunshu",
                     _cli("yunshu", "serve", plain=["--no-console"],
                          spec=["--no-console", "--set", "YUNSHU_NGRAM_DEFAULT=true"]),
                     exe="yunshu", spec_without_draft=True,
                     # its defaults: KV quantization chosen per request (a tiny model's dims read as 0: int8 KV,
                     # which fails on head_dim 12) and a prefix cache persisted to disk: turned off
                     defaults_off=("--set", "YUNSHU_KV_QUANT_BITS=off", "--set", "YUNSHU_SSD_CACHE=false"),
                     note="yunshu serve (Python >= 3.13); spec arm: its lossless n-gram speculation on greedy "
                          "requests (YUNSHU_NGRAM_DEFAULT=true); counters from its /metrics"),
        # vmlx 1.6.81 (vmlx_engine/cli.py ``main``, its ``serve`` subparser; ``serve_command``): continuous
        # batching is on by default, and under it ``_speculative_incompatibility_reason`` returns
        # "--continuous-batching": the draft model is not loaded ("Draft model loading is disabled for this
        # launch"), so both arms run the single-request engine (--no-continuous-batching: the plain arm is the
        # spec arm's baseline); ``_apply_paged_block_disk_default`` turns an SSD block cache on with a prefix
        # cache under continuous batching: asked off explicitly (--disable-block-disk-cache) and watched for in
        # its log. Speculation counts: /health ``speculative_decoding.runtime`` (speculative.py get_spec_stats;
        # the LAST request's: models/llm.py resets them per request), read by counters.health_doc_counters.
        ServedEngine("vmlx", "vmlx==1.6.81", "vmlx_engine", "server-vmlx",
                     _cli("vmlx", "serve", plain=["--served-model-name", "default_model"],
                          spec=["--served-model-name", "default_model", "--speculative-model", "{draft}",
                                "--num-draft-tokens", "3"]),
                     exe="vmlx", cache_off=("--disable-prefix-cache",), two_model_draft=True,
                     defaults_off=("--no-continuous-batching", "--disable-block-disk-cache"),
                     observe=(("block disk cache", r"(?i)enabling block disk cache"),),
                     note="vmlx serve --no-continuous-batching (its draft model loads only without continuous "
                          "batching); spec arm: --speculative-model, 3 draft tokens; counters from /health"),
        # mlx-vlm 0.7.10's server (mlx_vlm/server/openai.py: /chat/completions only, no /v1/completions: graded
        # through chat, the dialect learnt from its 404); its prefix cache (APC) is off by default
        # (server/runtime_config.py ``apc_enabled`` False) and has no flag; its drafters are DFlash / EAGLE-3 /
        # MTP (server/cli.py ``--draft-kind``), not a two-model twin; counts in each answer's ``timings``
        # (server/schemas.py GenerationTimings ``draft_n`` / ``draft_n_accepted``)
        # a request's "model" is loaded when it is not the one loaded (mlx_vlm/server/, the model of each
        # request: app.py get_cached_model, generation.py load_model_resources; "default_model" unloads the served
        # model and fails offline: HTTP 400 "Failed to load model")
        ServedEngine("mlx-vlm", "mlx-vlm==0.7.10", "mlx_vlm", "server-mlx-vlm", _mlx_vlm, exe="mlx_vlm.server",
                     request_model_is_path=True,
                     # its default: per-token top_logprobs disabled (server/cli.py ``--top-logprobs-k``: "default 0
                     # = disabled", a server-side cap 0-20): the cap raised to its maximum and named in its row
                     defaults_off=("--top-logprobs-k", "20"),
                     note="mlx_vlm.server (chat only; spec arm: --draft-model, a DFlash / EAGLE-3 / MTP drafter)"),
        ServedEngine("fake", "specparity", "tests.fake_server", "py311", _fake,
                     note="tests/fake_server.py: the harness's test double (a checkout only; "
                          "SPECPARITY_FAKE_SERVER_BUG plants a bug)",
                     cache_off=("--prompt-cache-size", "0"), test_double=True),
    )
}


def availability(name: str) -> tuple[bool, str]:
    """(available, reason) for ``--serve name``: what a runner registry needs to list it."""
    eng = SERVERS.get(name)
    if eng is None:
        return False, f"unknown server {name!r}; known: {', '.join(SERVERS)}"
    if not eng.available():
        if eng.test_double:
            return False, "the test double lives in the repository's tests/ (run from a checkout)"
        return False, f"{eng.package} is not installed here; run: tox -e {eng.tox_env}"
    return True, "ok"
