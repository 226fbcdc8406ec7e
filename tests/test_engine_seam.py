"""Seam-level refusals: vocab mismatch, non-trimmable caches, short trims, tap
hygiene, the source registry and the runtime-checkable protocols."""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import pytest
from fakes import FakeProvider, FakeSource
from test_engine_executor import zero_policy

from engine import caches as cache_ops
from engine.caches import CacheRollbackError
from engine.executor import GenerationParams, spec_generate
from engine.sampler import SamplerParams, StepSampler
from engine.seam import DraftProvider, DraftSource, TargetView
from engine.sources import KINDS, make_provider
from engine.sources.two_model import TwoModelProvider, VocabMismatchError, check_compatible
from engine.taps import capture_layers
from tests.helpers import load_zoo

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def target() -> Any:
    return load_zoo("llama")


@pytest.fixture(scope="module")
def tiny300() -> Any:
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=300,
    )
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


def _sampler() -> StepSampler:
    return StepSampler.from_params(SamplerParams())


# ---------------------------------------------------------------- vocab


def test_two_model_refuses_vocab_mismatch(target: Any, tiny300: Any) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    provider = TwoModelProvider(tiny300)
    view = TargetView(model=target.model, caches=make_prompt_cache(target.model))
    with pytest.raises(VocabMismatchError, match=r"drafter vocab_size 300 != target vocab_size 512"):
        provider.open(_sampler(), view)
    with pytest.raises(VocabMismatchError, match="tokenizer"):
        provider.check_target(target.model)
    with pytest.raises(VocabMismatchError):
        spec_generate(target.model, provider, [5, 6, 7], GenerationParams(max_tokens=4))
    assert issubclass(VocabMismatchError, ValueError)


def test_two_model_accepts_same_vocab(target: Any) -> None:
    provider = TwoModelProvider(target.model, draft_tokenizer=target.tokenizer)
    provider.check_target(target.model, target.tokenizer)  # same tokenizer: no error
    assert isinstance(provider, DraftProvider)


class _Tok:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


class _Wrapped:
    """mlx-lm ``TokenizerWrapper``-like: the HF tokenizer sits in ``_tokenizer``."""

    def __init__(self, inner: Any) -> None:
        self._tokenizer = inner


def test_check_compatible_names_differing_tokens() -> None:
    a = _Tok({"a": 0, "b": 1, "same": 2, "tgt_only": 3})
    b = _Tok({"a": 0, "b": 5, "same": 2, "drf_only": 3})
    with pytest.raises(VocabMismatchError) as ei:
        check_compatible(object(), object(), a, b)
    # the first id whose tokens differ, with both (padded vocabularies: tests/test_padded_vocab.py)
    assert "id 1 is 'b' for the target but no token for the drafter" in str(ei.value)
    # wrapped tokenizers are unwrapped the same way
    with pytest.raises(VocabMismatchError, match="id 1 is 'b'"):
        check_compatible(object(), object(), _Wrapped(a), _Wrapped(b))


def test_check_compatible_equal_or_unknown_vocab_passes() -> None:
    v = {"x": 0, "y": 1}
    check_compatible(object(), object(), _Tok(v), _Tok(dict(v)))
    check_compatible(object(), object(), None, _Tok(v))
    check_compatible(object(), object(), object(), _Tok(v))  # no get_vocab: nothing to compare


# ---------------------------------------------------------------- caches


class _FakeCache:
    def __init__(self, trimmable: bool = True, short: int = 0) -> None:
        self.trimmable = trimmable
        self.short = short
        self.trimmed: list[int] = []
        self.offset = 10

    def is_trimmable(self) -> bool:
        return self.trimmable

    def trim(self, n: int) -> int:
        self.trimmed.append(n)
        return n - self.short


def test_non_trimmable_target_caches_refused(target: Any) -> None:
    from mlx_lm.models.cache import ArraysCache

    n = len(target.model.layers)
    src = FakeSource(zero_policy)
    provider = FakeProvider(src)
    strict = GenerationParams(max_tokens=4, on_no_rollback="error")
    with pytest.raises(CacheRollbackError, match="ArraysCache"):
        spec_generate(target.model, provider, [5, 6, 7], strict,
                      target_caches=[ArraysCache(2) for _ in range(n)])
    with pytest.raises(CacheRollbackError, match="_FakeCache"):
        spec_generate(target.model, provider, [5, 6, 7], strict,
                      target_caches=[_FakeCache(trimmable=False) for _ in range(n)])
    assert provider.opened == 0 and src.prefills == []  # refused before the source is opened


def test_non_rollbackable_target_falls_back_to_plain_with_reason(target: Any) -> None:
    """§2: a cache that can neither trim nor replay ends speculation, reason recorded."""
    from mlx_lm.models.cache import KVCache

    from engine.executor import plain_generate

    class NoTrimKV(KVCache):
        def is_trimmable(self) -> bool:
            return False

    n = len(target.model.layers)
    src = FakeSource(zero_policy)
    provider = FakeProvider(src)
    params = GenerationParams(max_tokens=6)
    r = spec_generate(target.model, provider, [5, 6, 7], params,
                      target_caches=[NoTrimKV() for _ in range(n)])
    plain = plain_generate(target.model, [5, 6, 7], params)
    assert r.output_ids == plain.output_ids
    assert provider.opened == 0
    plains = [rec for rec in r.records if rec["type"] == "plain"]
    assert plains and all(p["reason"] == "no-rollback" for p in plains)
    assert "NoTrimKV" in plains[0]["detail"]
    assert r.speculation is not None and r.speculation.rounds == 0


def test_trim_raises_on_short_trim() -> None:
    good, short = _FakeCache(), _FakeCache(short=1)
    with pytest.raises(CacheRollbackError, match=r"layer 1 \(_FakeCache\) trimmed 2 of 3"):
        cache_ops.trim([good, short], 3, "target")
    with pytest.raises(CacheRollbackError, match="cannot trim 2"):
        cache_ops.trim([_FakeCache(trimmable=False)], 2)


def test_trim_zero_or_negative_is_noop() -> None:
    c = _FakeCache(trimmable=False)
    cache_ops.trim([c], 0)
    cache_ops.trim([c], -3)
    assert c.trimmed == []


def test_trim_real_kv_cache(target: Any) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(target.model)
    target.model(mx.array([5, 6, 7, 8], mx.uint32)[None], cache=caches)
    cache_ops.trim(caches, 2, "target")
    assert TargetView(model=target.model, caches=caches).offset == 2
    with pytest.raises(CacheRollbackError, match="trimmed 2 of 3"):
        cache_ops.trim(caches, 3, "target")


# ---------------------------------------------------------------- taps


def test_capture_layers_restores_classes(target: Any) -> None:
    model = target.model
    before = [type(layer) for layer in model.layers]
    x = mx.array([5, 6, 7], mx.uint32)[None]
    ref = model(x)
    with capture_layers(model, [0, -1]) as captured:
        assert all(type(layer) is not cls for layer, cls in zip(model.layers, before, strict=True))
        out = model(x)
        mx.eval(out)
    assert [type(layer) for layer in model.layers] == before
    n = len(model.layers)
    assert set(captured) == {0, n - 1}
    assert tuple(captured[0].shape) == (1, 3, model.args.hidden_size)
    assert mx.array_equal(out, ref).item()


def test_capture_layers_restores_on_error(target: Any) -> None:
    model = target.model
    before = [type(layer) for layer in model.layers]
    with pytest.raises(KeyError), capture_layers(model, [0, 1]):
        raise KeyError("boom")
    assert [type(layer) for layer in model.layers] == before


@pytest.mark.parametrize("bad", [2, 99, -3])
def test_capture_layers_rejects_out_of_range(target: Any, bad: int) -> None:
    model = target.model
    before = [type(layer) for layer in model.layers]
    with pytest.raises(IndexError, match="out of range"), capture_layers(model, [0, bad]):
        pass
    assert [type(layer) for layer in model.layers] == before  # index 0 was swapped, then restored


# ---------------------------------------------------------------- registry / protocols


def test_make_provider_unknown_kind() -> None:
    with pytest.raises(ValueError) as ei:
        make_provider("nope")
    msg = str(ei.value)
    assert "'nope'" in msg
    for kind in KINDS:
        assert kind in msg


def test_make_provider_two_model(target: Any) -> None:
    p = make_provider("two-model", draft_model=target.model)
    assert isinstance(p, TwoModelProvider) and p.kind == "two-model"


def test_protocols_runtime_checkable(target: Any) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    src = FakeSource(zero_policy)
    assert isinstance(src, DraftSource)
    assert isinstance(FakeProvider(src), DraftProvider)
    view = TargetView(model=target.model, caches=make_prompt_cache(target.model))
    assert view.num_layers == len(target.model.layers) and view.offset == 0
    opened = TwoModelProvider(target.model).open(_sampler(), view)
    assert isinstance(opened, DraftSource)
    assert not isinstance(object(), DraftSource)
