"""Tokenizer.from_folder: BOS from the post-processor, EOS ids, templates, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jaxserve.presets import materialize_preset
from jaxserve.tokenizer import ChatTemplateError, Tokenizer, TokenizerLoadError

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return materialize_preset("tiny", cache=tmp_path_factory.mktemp("cache"))


@pytest.fixture
def folder(tiny_folder, tmp_path) -> Path:
    """A writable copy of the tiny preset's tokenizer files."""
    out = tmp_path / "model"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        shutil.copy(tiny_folder / name, out / name)
    return out


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def test_basic_properties(tiny_folder):
    tok = Tokenizer.from_folder(tiny_folder)
    assert tok.vocab_size == 512
    assert tok.bos_token == BOS
    assert tok.bos_token_id == tok.token_to_id(BOS) == 0
    assert tok.id_to_token(tok.bos_token_id) == BOS
    assert tok.chat_template is not None and "<|start_header_id|>" in tok.chat_template
    assert tok.model_max_length == 2048
    assert {tok.token_to_id(t) for t in (BOS, EOS, EOT)} <= tok.all_special_ids


def test_bos_comes_from_post_processor(tiny_folder):
    tok = Tokenizer.from_folder(tiny_folder)
    with_bos = tok.encode("Hello world")
    without = tok.encode("Hello world", add_special_tokens=False)
    assert with_bos == [tok.bos_token_id] + without
    assert tok.decode(with_bos) == "Hello world"
    assert tok.decode(with_bos, skip_special_tokens=False) == BOS + "Hello world"
    assert tok.encode_batch(["a", "b c"]) == [tok.encode("a"), tok.encode("b c")]


def test_no_bos_without_post_processor(folder):
    data = json.loads((folder / "tokenizer.json").read_text())
    data["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data))
    tok = Tokenizer.from_folder(folder)
    # tokenizer_config still names a BOS token, but encoding never adds one itself.
    assert tok.bos_token_id == 0
    assert tok.encode("Hello world") == tok.encode("Hello world", add_special_tokens=False)
    assert tok.encode("Hello world")[0] != tok.bos_token_id


def test_special_tokens_in_text_are_parsed(tiny_folder):
    tok = Tokenizer.from_folder(tiny_folder)
    ids = tok.encode(f"{EOT}hi", add_special_tokens=False)
    assert ids[0] == tok.token_to_id(EOT)


def test_eos_ids_union(folder):
    tok = Tokenizer.from_folder(folder)
    eos, eot = tok.token_to_id(EOS), tok.token_to_id(EOT)
    assert tok.eos_token_ids == (eos, eot)  # tokenizer_config eos + generation_config [eos, eot]

    edit_json(folder / "generation_config.json", eos_token_id=7)
    edit_json(folder / "config.json", eos_token_id=[eot, 9, 7])
    assert Tokenizer.from_folder(folder).eos_token_ids == (eos, 7, eot, 9)

    (folder / "generation_config.json").unlink()
    (folder / "config.json").unlink()
    assert Tokenizer.from_folder(folder).eos_token_ids == (eos,)


def test_special_tokens_as_dicts(folder):
    # Older tokenizer_config files store AddedToken dicts.
    edit_json(
        folder / "tokenizer_config.json",
        bos_token={"content": BOS, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        eos_token={"__type": "AddedToken", "content": EOT},
    )
    (folder / "generation_config.json").unlink()
    (folder / "config.json").unlink()
    tok = Tokenizer.from_folder(folder)
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == (tok.token_to_id(EOT),)
    assert tok.special_tokens_map == {"bos_token": BOS, "eos_token": EOT}


def test_no_tokenizer_config(folder):
    (folder / "tokenizer_config.json").unlink()
    tok = Tokenizer.from_folder(folder)
    assert tok.bos_token_id is None
    assert tok.chat_template is None
    assert tok.eos_token_ids == (1, 2)  # generation_config/config only
    assert tok.encode("x")[0] == 0  # still the post-processor's BOS


def test_missing_tokenizer_json(folder, tmp_path):
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError) as err:
        Tokenizer.from_folder(folder)
    assert str(folder / "tokenizer.json") in str(err.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_folder(tmp_path / "nowhere")


def test_malformed_files(folder):
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match="tokenizer_config.json"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        Tokenizer.from_folder(folder)


# ------------------------------------------------------------ chat templates


MESSAGES = [{"role": "user", "content": "hi"}]


def test_template_string(tiny_folder):
    tok = Tokenizer.from_folder(tiny_folder)
    out = tok.apply_chat_template(MESSAGES)
    assert out == (
        f"{BOS}<|start_header_id|>user<|end_header_id|>\n\nhi{EOT}<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("\n\n")
    ids = tok.encode_chat(MESSAGES)
    assert ids.count(tok.bos_token_id) == 1  # the template's BOS only
    assert tok.decode(ids, skip_special_tokens=False) == out


def test_template_list_form(folder):
    edit_json(
        folder / "tokenizer_config.json",
        chat_template=[
            {"name": "default", "template": "D{{ messages[0].content }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}"},
            {"name": "rag", "template": "R{{ documents[0].title }}"},
        ],
    )
    tok = Tokenizer.from_folder(folder)
    assert tok.chat_template == "D{{ messages[0].content }}"
    assert set(tok.chat_templates) == {"default", "tool_use", "rag"}
    assert tok.apply_chat_template(MESSAGES) == "Dhi"
    assert tok.apply_chat_template(MESSAGES, tools=[{"name": "f"}]) == "T1"
    assert tok.apply_chat_template(MESSAGES, chat_template="rag", documents=[{"title": "x", "text": "y"}]) == "Rx"
    assert tok.apply_chat_template(MESSAGES, chat_template="literal {{ bos_token }}") == f"literal {BOS}"


def test_template_list_without_default(folder):
    edit_json(
        folder / "tokenizer_config.json", chat_template=[{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]
    )
    tok = Tokenizer.from_folder(folder)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="'a', 'b'"):
        tok.apply_chat_template(MESSAGES)
    assert tok.apply_chat_template(MESSAGES, chat_template="b") == "B"


def test_template_files_take_priority(folder):
    (folder / "chat_template.jinja").write_text("file:{{ messages | length }}")
    tok = Tokenizer.from_folder(folder)
    assert tok.chat_template == "file:{{ messages | length }}"
    assert tok.apply_chat_template(MESSAGES) == "file:1"
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("extra")
    tok = Tokenizer.from_folder(folder)
    assert set(tok.chat_templates) == {"default", "tool_use"}
    assert tok.apply_chat_template(MESSAGES, tools=[]) == "extra"


def test_missing_template(folder):
    edit_json(folder / "tokenizer_config.json", chat_template=None)
    tok = Tokenizer.from_folder(folder)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template") as err:
        tok.apply_chat_template(MESSAGES)
    assert str(folder) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_bad_template_config(folder):
    edit_json(folder / "tokenizer_config.json", chat_template=[{"name": "x"}])
    with pytest.raises(TokenizerLoadError, match="chat_template"):
        Tokenizer.from_folder(folder)
