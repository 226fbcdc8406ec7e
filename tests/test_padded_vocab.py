"""Padded-vocabulary pairs: a drafter with the target's tokenizer but another number of
embedding rows (engine/sources/two_model.py ``check_compatible``), as real Qwen pairs have.

Accepted when the tokenizers map every id both models have to the same token; refused,
naming the first differing id and both tokens, when ids could mean different tokens; a
padding id one model would feed the other (past its embedding, a segfault on MLX) stops
the run with its reason. The engine-vs-mlx-lm rounds on a padded pair are
``conformance/test_padded_vocab_vs_mlx_lm.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.sources.two_model import (
    TwoModelProvider,
    TwoModelSource,
    VocabMismatchError,
    check_compatible,
)
from tests import foreign
from tests.helpers import cli_rc


class _Tok:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def _model(v: int) -> Any:
    return SimpleNamespace(args=SimpleNamespace(vocab_size=v))


WORDS = {w: i for i, w in enumerate(["<unk>", "</s>", "ba", "be", "bi"])}


def test_padded_vocab_with_one_tokenizer_is_accepted() -> None:
    tok = _Tok(WORDS)
    check_compatible(_model(8), _model(5), tok, _Tok(dict(WORDS)))  # target padded
    check_compatible(_model(5), _model(16), tok, _Tok(dict(WORDS)))  # drafter padded
    check_compatible(_model(8), _model(16), tok, _Tok(dict(WORDS)))  # both


def test_padded_vocab_without_tokenizers_is_refused_with_the_reason() -> None:
    with pytest.raises(VocabMismatchError, match=r"vocab_size 5 != target vocab_size 8 and no tokenizers"):
        check_compatible(_model(8), _model(5))


def test_differing_token_is_refused_naming_the_first_id_and_both_tokens() -> None:
    other = dict(WORDS)
    other["bi"], other["be"] = 3, 4  # ids 3 and 4 swapped
    with pytest.raises(VocabMismatchError) as ei:
        check_compatible(_model(8), _model(8), _Tok(WORDS), _Tok(other))
    assert "id 3 is 'be' for the target but 'bi' for the drafter" in str(ei.value)


def test_token_outside_the_other_vocabulary_is_refused() -> None:
    wide = {**WORDS, "bo": 6}  # the target's tokenizer has a token at id 6 ...
    with pytest.raises(VocabMismatchError,
                       match=r"id 6 is 'bo' for the target but outside the drafter's vocabulary \[0, 5\)"):
        check_compatible(_model(8), _model(5), _Tok(wide), _Tok(WORDS))  # ... the drafter lacks
    with pytest.raises(VocabMismatchError, match=r"id 6 is 'bo' for the drafter but outside the target"):
        check_compatible(_model(5), _model(8), _Tok(WORDS), _Tok(wide))
    # the same token at the same id, both models have it: fine
    check_compatible(_model(8), _model(8), _Tok(wide), _Tok(dict(wide)))
    # a token past both models' rows (a tokenizer larger than the models) neither emits: fine
    check_compatible(_model(5), _model(5), _Tok(wide), _Tok(dict(wide)))


@pytest.fixture(scope="module")
def padded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("padded")
    return {
        "target": foreign.write_padded("phi3", root / "phi3-pad128", 128),
        "twin": foreign.write_model("phi3", root / "phi3-twin", drafter=True),
        "twin-pad": foreign.write_padded("phi3", root / "phi3-twin-pad144", 144, drafter=True),
        "plain": foreign.write_model("phi3", root / "phi3"),
    }


def test_generate_runs_a_padded_pair_both_ways(padded: dict[str, Path], tmp_path: Path) -> None:
    """The target padded (Qwen-like) and the drafter padded: both run, and speculation is
    lossless (the same tokens as plain decode of the target)."""
    from engine.executor import GenerationParams, plain_generate, spec_generate
    from specparity.runners import load_model

    for tdir, ddir in ((padded["target"], padded["twin"]), (padded["plain"], padded["twin-pad"])):
        t, d = load_model(str(tdir)), load_model(str(ddir))
        provider = TwoModelProvider(d.model, draft_tokenizer=d.tokenizer)
        provider.check_target(t.model, t.tokenizer)
        ids = [5, 9, 14, 22, 30]
        p = GenerationParams(max_tokens=12, gamma=3, eos_ids=(1,))
        spec = spec_generate(t.model, provider, ids, p)
        assert spec.output_ids == plain_generate(t.model, ids, p).output_ids, (tdir.name, ddir.name)
        assert spec.speculation is not None and spec.speculation.accepted > 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "p", "text": "ba de fi go"}\n')
    assert cli_rc("audit", "--target", str(padded["target"]), "--draft", str(padded["twin"]),
                  "--prompts-file", str(prompts), "--max-tokens", "6", "--gamma", "2") == 0
    out = tmp_path / "g.jsonl"
    assert cli_rc("generate", "--target", str(padded["target"]), "--draft", str(padded["twin"]),
                  "--prompt", "ba de fi go", "-n", "6", "--gamma", "2", "--trace", str(out)) == 0
    head = json.loads(out.read_text().splitlines()[0])
    assert head["source"] == "two-model"


def test_a_padding_id_is_never_fed_to_a_model_that_lacks_it(padded: dict[str, Path]) -> None:
    """Planted: the target 'emits' a padding id the drafter's embedding lacks, and a drafter
    'proposes' one past the target's; each stops with its reason instead of indexing past
    the table."""
    import mlx.core as mx

    from engine.sampler import SamplerParams, StepSampler
    from specparity.runners import load_model

    twin = load_model(str(padded["twin"]))
    src = TwoModelSource(twin.model, StepSampler.from_params(SamplerParams()), 512, target_vocab=128)
    src.prefill([5, 9, 14], None)
    src.draft([22], 1, 0, None)  # the first feed is the prompt's last token
    with pytest.raises(VocabMismatchError, match=r"target emitted id 120 is a padding row outside the "
                                                  r"drafter's vocabulary \[0, 112\)"):
        src.draft([120], 2, 0, None)
    wide = load_model(str(padded["twin-pad"]))
    src = TwoModelSource(wide.model, StepSampler.from_params(SamplerParams()), 512, target_vocab=112)
    src.prefill([5, 9, 14], None)
    assert all(t < 112 for t in src.draft([22], 3, 0, None))  # greedy never picks a zero row
    real = src.sampler.sample_window
    src.sampler.sample_window = lambda logits: mx.array([140], mx.uint32)  # type: ignore[method-assign]
    try:
        with pytest.raises(VocabMismatchError, match=r"drafter proposed id 140, a padding row outside "
                                                      r"the target's vocabulary \[0, 112\)"):
            src.draft([22], 2, 0, None)
    finally:
        src.sampler.sample_window = real  # type: ignore[method-assign]


def test_a_prompt_id_past_the_drafters_rows_is_refused_naming_the_drafter(padded: dict[str, Path],
                                                                            capsys) -> None:  # noqa: ANN001
    """Id 120 is a padding row of the 128-row target, past the 112-row drafter's table."""
    from specparity.cases.case import Case, model_label
    from specparity.cases.prompts import PromptError
    from specparity.runners import run_case

    t, d = padded["target"], padded["twin"]
    capsys.readouterr()
    assert cli_rc("generate", "--target", str(t), "--draft", str(d), "--prompt-ids", "5,120",
                  "-n", "4") != 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and "the prompt token 120 is a padding row outside the drafter's " \
        "vocabulary [0, 112)" in err[0], err
    case = Case(model_label(t), model_label(d), "pad", 2, 4, target_path=str(t), draft_path=str(d),
                prompt_tokens=(5, 120))
    with pytest.raises(PromptError, match=r"drafter .*phi3-twin: prompt 'pad': token id\(s\) 120"):
        run_case("engine", case)
