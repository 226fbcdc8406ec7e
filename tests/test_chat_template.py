"""``--chat-template``: text prompts rendered by the target tokenizer's own chat template
(specparity/cases/prompts.py ``encode_text``, as mlx-lm 0.32.2 ``generate.py`` ``main`` renders
them), on ``generate``, ``record``, ``run`` (and the suite key ``chat_template``), ``bench``,
``ab``, ``audit`` and ``zoo list``; the rendered ids are the trace header's prompt; a
tokenizer without a template is one error line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specparity.cases.prompts import CHAT_SUFFIX, PromptError, encode_text
from tests import foreign
from tests.helpers import cli_rc

# foreign.CHAT_TEMPLATE renders one user turn "ba de fi" as "ku ba de fi la"
RENDERED = [foreign.VOCAB.index(w) for w in "ku ba de fi la".split()]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    foreign.build(root, ("olmo2",))
    chat = foreign.add_chat_template(foreign.write_model("olmo2", root / "olmo2-chat"))
    twin = foreign.add_chat_template(foreign.write_model("olmo2", root / "olmo2-chat-twin", drafter=True))
    (root / "p.jsonl").write_text(json.dumps({"id": "q", "text": "ba de fi"}) + "\n"
                                  + json.dumps({"id": "ids", "token_ids": [5, 9, 14]}) + "\n")
    return {"chat": chat, "twin": twin, "plain": root / "olmo2-tiny",
            "plain-twin": root / "olmo2-tiny-twin", "prompts": root / "p.jsonl"}


def _header(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[0])


def test_encode_text_renders_with_the_tokenizers_own_template(models: dict[str, Path]) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from transformers import AutoTokenizer

    tok = load_tokenizer(models["chat"])
    assert encode_text(tok, "ba de fi", chat_template=True) == RENDERED
    assert encode_text(tok, "ba de fi") == RENDERED[1:4]  # without: raw, as before
    # the Hugging Face tokenizer itself renders the same ids
    hf = AutoTokenizer.from_pretrained(str(models["chat"]))
    assert hf.apply_chat_template([{"role": "user", "content": "ba de fi"}], tokenize=True,
                                  add_generation_prompt=True, return_dict=False) == RENDERED
    with pytest.raises(PromptError, match="has no chat template"):
        encode_text(load_tokenizer(models["plain"]), "ba de fi", chat_template=True)
    # a flag that would change nothing is refused, not ignored
    from specparity.cases.prompts import Prompt, encode_prompts

    with pytest.raises(PromptError, match="these are all token ids"):
        encode_prompts([Prompt("ids", token_ids=(5, 9))], models["chat"], chat_template=True)


def test_generate_and_record_put_the_rendered_ids_in_the_header(models, tmp_path, capsys) -> None:
    g, r = tmp_path / "g.jsonl", tmp_path / "r.jsonl"
    common = ("--target", str(models["chat"]), "--draft", str(models["twin"]), "--prompt", "ba de fi",
              "-n", "6", "--gamma", "2", "--chat-template")
    assert cli_rc("generate", *common, "--trace", str(g)) == 0
    assert cli_rc("record", "--runner", "mlx_lm", *common, "--trace", str(r)) == 0
    hg, hr = _header(g), _header(r)
    assert hg["prompt"]["token_ids"] == hr["prompt"]["token_ids"] == RENDERED
    assert hg["case_id"] == hr["case_id"]
    plain = tmp_path / "plain.jsonl"
    assert cli_rc("generate", *common[:-1], "--trace", str(plain)) == 0
    assert _header(plain)["prompt"]["token_ids"] == RENDERED[1:4]
    assert _header(plain)["case_id"] != hg["case_id"]


def test_no_template_and_ids_are_one_line_usage_errors(models, tmp_path, capsys) -> None:
    capsys.readouterr()
    cases = [
        (("generate", "--target", str(models["plain"]), "--prompt", "ba de", "-n", "4", "--chat-template"),
         "has no chat template"),
        (("generate", "--target", str(models["chat"]), "--prompt-ids", "5,9", "-n", "4", "--chat-template"),
         "not --prompt-ids"),
        (("run", "--target", str(models["plain"]), "--draft", str(models["plain-twin"]), "--prompts-file",
          str(models["prompts"]), "--gammas", "2", "--max-tokens", "4", "--out", str(tmp_path / "r"),
          "--chat-template"), "has no chat template"),
        (("audit", "--target", str(models["plain"]), "--prompts-file", str(models["prompts"]),
          "--max-tokens", "4", "--chat-template"), "has no chat template"),
        (("audit", "--target", str(models["chat"]), "--max-tokens", "4", "--chat-template"),
         "give --prompts-file"),
        (("bench", "--target", str(models["plain"]), "--drafter", str(models["plain-twin"]),
          "--prompts-file", str(models["prompts"]), "--out", str(tmp_path / "b"), "--chat-template"),
         "has no chat template"),
        (("ab", "--target", str(models["plain"]), "--drafter-a", str(models["plain-twin"]),
          "--drafter-b", str(models["plain-twin"]), "--prompts-file", str(models["prompts"]),
          "--allow-small", "--out", str(tmp_path / "ab"), "--chat-template"), "has no chat template"),
        (("zoo", "list", "--max-tokens", "4", "--chat-template"), "give --prompts-file"),
    ]
    for argv, want in cases:
        assert cli_rc(*argv) == 2, argv
        err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
        assert len(err) == 1 and want in err[0], (argv, err)  # bench says its device first


def test_run_audit_and_suite_key_render_text_prompts(models, tmp_path: Path, capsys) -> None:
    from specparity.cases.suite import SuiteError, load_suite, suite_cases

    out = tmp_path / "run"
    assert cli_rc("run", "--target", str(models["chat"]), "--draft", str(models["twin"]), "--prompts-file",
                  str(models["prompts"]), "--gammas", "2", "--max-tokens", "4", "--runners", "mlx_lm",
                  "--out", str(out), "--quiet", "--chat-template") == 0
    heads = {h["prompt"]["id"]: h for h in map(_header, (out / "traces" / "engine").glob("*.jsonl"))}
    assert heads["q" + CHAT_SUFFIX]["prompt"]["token_ids"] == RENDERED
    assert heads["ids"]["prompt"]["token_ids"] == [5, 9, 14]  # token-id prompts as they are
    aj = tmp_path / "a.json"
    assert cli_rc("audit", "--target", str(models["chat"]), "--draft", str(models["twin"]),
                  "--prompts-file", str(models["prompts"]), "--max-tokens", "4", "--chat-template",
                  "--json", str(aj)) == 0
    assert json.loads(aj.read_text())["prompts"] == 2
    suite = tmp_path / "s.toml"
    suite.write_text(f'chat_template = true\nprompts_file = "{models["prompts"]}"\nmax_tokens = 4\n'
                     f'gammas = [2]\n[[pair]]\ntarget = "{models["chat"]}"\ndrafter = "{models["twin"]}"\n')
    cases = suite_cases(load_suite(suite))
    assert {c.prompt_id: c.prompt_tokens for c in cases}["q" + CHAT_SUFFIX] == tuple(RENDERED)
    suite.write_text(suite.read_text().replace("chat_template = true", 'chat_template = "yes"'))
    with pytest.raises(SuiteError, match=r"chat_template: expected true or false"):
        load_suite(suite)
