"""The ``assistant`` source (§3 roster row ``assistant``) on the zoo ``gemma4`` target.

No oracle needed: greedy assistant speculation is token-identical to plain
greedy decode with the same (full) prefill on tie-free prompts, for both head
variants (tied embedding and centroid), with real partial and all-accept
rounds; the head is chosen by TENSOR PRESENCE, not by the config flags; the
drafter never writes the target's caches. Short prompts keep the rounds
before the §2 ring-wrap guard (window 32) stops speculating.
"""

from __future__ import annotations

import json
import shutil

import pytest

from engine.executor import GenerationParams, plain_generate, spec_generate
from tests.helpers import load_zoo

PROMPTS = ("nat-03", "nat-09", "nat-22", "rnd-15", "rnd-14")
HEADS = ("gemma4-assistant-self", "gemma4-assistant-centroid-self")
TIE_EPS = 1e-3


@pytest.fixture(scope="module")
def target():
    return load_zoo("gemma4").model


def _provider(name: str):
    from engine.sources import make_provider
    from zoo.heads import head_dir

    return make_provider("assistant", path=head_dir(name))


def _ids(pid: str) -> list[int]:
    import zoo

    return list(zoo.prompt(pid).token_ids)


@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("pid", PROMPTS)
def test_assistant_token_identical_to_plain_greedy(target, head: str, pid: str, gamma: int) -> None:
    plain = plain_generate(target, _ids(pid), GenerationParams(max_tokens=40, prefill="full"))
    assert min(r["margin"] for r in plain.records if r["type"] == "plain") > TIE_EPS, pid
    spec = spec_generate(target, _provider(head), _ids(pid), GenerationParams(max_tokens=40, gamma=gamma))
    assert spec.output_ids == plain.output_ids, f"gemma4/{head}/{pid}/g{gamma}"
    assert spec.usage.to_dict() == plain.usage.to_dict()


@pytest.mark.parametrize("head", HEADS)
def test_assistant_exercises_accept_paths(target, head: str) -> None:
    ks: set[str] = set()
    for pid in PROMPTS:
        res = spec_generate(target, _provider(head), _ids(pid), GenerationParams(max_tokens=40, gamma=3))
        for r in (r for r in res.records if r["type"] == "round"):
            d, k = len(r["drafts"]), r["k_accept"]
            ks.add("all" if k == d else ("zero" if k == 0 else "partial"))
    assert ks == {"all", "zero", "partial"}, (head, ks)


def test_head_is_picked_by_tensor_presence(tmp_path) -> None:
    """A centroid checkpoint whose config says ``use_ordered_embeddings: false`` keeps its centroid
    head; a tied checkpoint whose config claims centroids stays tied (optiq reads the flags)."""
    from engine.sources.assistant import load_drafter
    from zoo.heads import head_dir

    for name, flag, want in (("gemma4-assistant-centroid-self", False, "centroid"),
                             ("gemma4-assistant-self", True, "tied")):
        d = tmp_path / name
        shutil.copytree(head_dir(name), d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(use_ordered_embeddings=flag, num_centroids=8, centroid_intermediate_top_k=4)
        (d / "config.json").write_text(json.dumps(cfg))
        assert load_drafter(d).cfg.head == want, name


def test_drafter_leaves_target_caches_alone(target) -> None:
    """Drafting reads the donor K/V; the target cache digests before/after a draft are equal."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine import caches as cache_ops
    from engine.sampler import SamplerParams, StepSampler
    from engine.seam import TargetView
    from engine.taps import capture_layers

    ids = _ids("nat-03")
    caches = make_prompt_cache(target)
    with capture_layers(target, [len(target.layers) - 1]) as cap:
        target(mx.array(ids)[None], cache=caches)
        mx.eval(cap)
    src = _provider(HEADS[0]).open(StepSampler.from_params(SamplerParams()), TargetView(target, caches))
    before = cache_ops.cache_digest(caches)
    drafts = src.draft([5], 3, 0, cap[len(target.layers) - 1][0, -1:])
    assert len(drafts) == 3 and cache_ops.cache_digest(caches) == before


def test_planted_unnormed_anchor_is_caught(target, monkeypatch) -> None:
    """The anchor fed without the target's final norm (optiq reads ``norm(h)``) changes the drafts."""
    from engine.sources import assistant

    def good_runs():
        return [[r["drafts"] for r in spec_generate(target, _provider("gemma4-assistant"), _ids(p),
                 GenerationParams(max_tokens=40, gamma=3)).records if r["type"] == "round"] for p in PROMPTS]

    good = good_runs()
    monkeypatch.setattr(assistant.AssistantSource, "__init__", _unnormed(assistant.AssistantSource.__init__))
    assert good_runs() != good


def _unnormed(init):
    def patched(self, drafter, target):
        init(self, drafter, target)

        class _NoNorm:
            def __init__(self, inner):
                self._inner = inner

            def __getattr__(self, k):
                return getattr(self._inner, k)

            def norm(self, x):
                return x * 1.0

        self.inner = _NoNorm(self.inner)

    return patched
