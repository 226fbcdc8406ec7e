"""The ``mtp`` source (§3 roster row ``mtp``) on the zoo ``qwen35`` target, no oracle needed.

Losslessness (§2.1): greedy MTP speculation is token-identical to plain greedy
decode with the same (full) prefill on tie-free prompts, with real partial
accepts, real all-accept rounds and real gated-DeltaNet rollbacks visible in
the counters. Planted bugs (monkeypatched) must be caught: the missing
all-accept row in ``commit()``, a draft row built from the wrong hidden, and a
``[1, 1, V]`` sampler input.
"""

from __future__ import annotations

import pytest

from engine.executor import GenerationParams, plain_generate, spec_generate
from engine.sampler import SamplerParams
from tests.helpers import load_zoo

PROMPTS = ("nat-00", "nat-01", "rnd-00", "nat-02")
TIE_EPS = 1e-3


@pytest.fixture(scope="module")
def target():
    return load_zoo("qwen35").model


@pytest.fixture(scope="module")
def provider():
    from engine.sources import make_provider
    from zoo.heads import head_dir

    return make_provider("mtp", path=head_dir("qwen35-mtp-self"))


def _ids(pid: str) -> list[int]:
    import zoo

    return list(zoo.prompt(pid).token_ids)


def _run(target, provider, pid: str, gamma: int, n: int = 32, **kw):
    return spec_generate(target, provider, _ids(pid), GenerationParams(max_tokens=n, gamma=gamma, **kw))


def _plain(target, pid: str, n: int = 32):
    return plain_generate(target, _ids(pid), GenerationParams(max_tokens=n, prefill="full"))


def _tie_free(res) -> bool:
    margins = [m for r in res.records if r["type"] == "plain" for m in [r["margin"]]]
    return min(margins) > TIE_EPS


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("pid", PROMPTS)
def test_mtp_token_identical_to_plain_greedy(target, provider, pid: str, gamma: int) -> None:
    plain = _plain(target, pid)
    assert _tie_free(plain), f"{pid}: prompt not tie-free (margin <= {TIE_EPS})"
    spec = _run(target, provider, pid, gamma)
    assert spec.output_ids == plain.output_ids, (
        f"qwen35/mtp/{pid}/g{gamma}: spec {spec.output_ids} != plain {plain.output_ids}"
    )
    assert spec.usage.to_dict() == plain.usage.to_dict()


def test_mtp_exercises_accept_paths_and_deltanet_rollbacks(target, provider) -> None:
    ks: set[str] = set()
    rollbacks = 0
    for pid in PROMPTS:
        for gamma in (1, 2, 3):
            res = _run(target, provider, pid, gamma)
            for r in (r for r in res.records if r["type"] == "round"):
                d, k = len(r["drafts"]), r["k_accept"]
                ks.add("all" if k == d else ("zero" if k == 0 else "partial"))
                rollbacks += k < d  # the recurrent layer is restored + replayed
    assert ks == {"all", "zero", "partial"}, ks
    assert rollbacks > 0


def test_mtp_top_k_sampler_runs(target, provider) -> None:
    """Temperature + top-k drafts: the ``[1, V]`` sampler contract (top-k slices 2-D rows)."""
    res = _run(target, provider, "nat-00", 3, sampler=SamplerParams(temperature=0.8, top_k=20), seed=3)
    assert res.usage.generation_tokens == 32


def test_planted_missing_all_accept_row_is_caught(target, provider, monkeypatch) -> None:
    from engine.sources import mtp

    real = mtp.MTPSource.commit

    def forgetful(self, d, k, ctx=None, verified_hidden=None, accepted_tokens=None):
        real(self, d, k, ctx, verified_hidden, accepted_tokens)
        if d and k == d:
            self._owed_tokens, self._owed_hidden = [], []

    good = [_run(target, provider, p, 1).records for p in PROMPTS]
    monkeypatch.setattr(mtp.MTPSource, "commit", forgetful)
    bad = [_run(target, provider, p, 1).records for p in PROMPTS]
    assert _drafts(good) != _drafts(bad), "a forgotten all-accept row went unnoticed"


def test_planted_wrong_hidden_is_caught(target, provider, monkeypatch) -> None:
    """The all-accept row built from the verify hidden one position late (the bonus's)."""
    from engine.sources import mtp

    real = mtp.MTPSource.commit

    def off_by_one(self, d, k, ctx=None, verified_hidden=None, accepted_tokens=None):
        real(self, d, k, ctx, verified_hidden, accepted_tokens)
        if d and k == d:
            self._owed_hidden = [ctx.hidden[self.n_layers - 1][d : d + 1]]

    good = [_run(target, provider, p, 1).records for p in PROMPTS]
    monkeypatch.setattr(mtp.MTPSource, "commit", off_by_one)
    bad = [_run(target, provider, p, 1).records for p in PROMPTS]
    assert _drafts(good) != _drafts(bad), "a draft row from the wrong hidden went unnoticed"


def _two_d_top_k(top_k: int = 20, temp: float = 0.8):
    """A sampler that slices 2-D rows, as the serve lane's top-k did (§3): ``[rows, V]`` only."""
    import mlx.core as mx

    def sample(logprobs):
        if logprobs.ndim != 2:
            raise ValueError(f"sampler contract: expected [rows, V], got {tuple(logprobs.shape)}")
        drop = mx.argpartition(-logprobs, kth=top_k - 1, axis=1)[:, top_k:]
        kept = mx.put_along_axis(logprobs, drop, mx.array(-float("inf"), logprobs.dtype), axis=1)
        return mx.random.categorical(kept * (1 / temp))

    return sample


@pytest.fixture
def two_d_sampler(monkeypatch):
    from engine import executor
    from engine.sampler import StepSampler

    params = SamplerParams(temperature=0.8, top_k=20)
    monkeypatch.setattr(executor.StepSampler, "from_params", classmethod(
        lambda cls, p: StepSampler(_two_d_top_k(), (), params)))
    return params


def test_mtp_two_d_sampler_contract(target, provider, two_d_sampler) -> None:
    res = _run(target, provider, "nat-00", 3, sampler=two_d_sampler, seed=3)
    assert res.usage.generation_tokens == 32


def test_planted_3d_sampler_input_is_caught(target, provider, two_d_sampler, monkeypatch) -> None:
    from engine.sources import mtp

    monkeypatch.setattr(mtp, "_as_row", lambda logits: logits)
    with pytest.raises(ValueError, match="sampler contract"):
        _run(target, provider, "nat-00", 3, sampler=two_d_sampler, seed=3)


def _drafts(runs) -> list[list[tuple]]:
    """Per round: the drafts and the drafter's cache digest after the commit."""
    return [
        [(r["drafts"], r["drafter_cache_digest"]["combined"]) for r in recs if r["type"] == "round"]
        for recs in runs
    ]
