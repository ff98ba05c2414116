"""The worker's prompt checks that need no broker (``jaxserve.worker.prompts``):
the name a model is served under, which names a worker answers, and the
refusal of a chat request to a model without a chat template."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from jaxserve.presets import resolve_model
from jaxserve.request_error import RequestError
from jaxserve.tokenizer.tokenizer import Tokenizer
from jaxserve.wire import JobProperties, parse_job
from jaxserve.worker.engine_host import EngineInfo
from jaxserve.worker.prompts import prepare_labels, prepare_prompt, served_name


def _job(**body):
    return parse_job(json.dumps(body).encode(), JobProperties(message_id="k"))


@pytest.mark.parametrize(
    "model_name, served",
    [
        ("/models/SmolLM2-135M-Instruct-Q8_0.gguf", "SmolLM2-135M-Instruct-Q8_0"),
        ("llama.GGUF", "llama"),
        ("/models/Llama-3.2-1B-Instruct/", "Llama-3.2-1B-Instruct"),
        ("tiny", "tiny"),
        (".gguf", ".gguf"),  # nothing but the extension: kept as it is
    ],
)
def test_a_gguf_files_served_name_is_its_stem(model_name, served):
    assert served_name(None, EngineInfo(model_name=model_name)) == served
    assert served_name("mine", EngineInfo(model_name=model_name)) == "mine"


def test_a_gguf_model_answers_to_its_stem_and_its_file_name():
    info = EngineInfo(
        model_name="/m/small.gguf", max_model_len=64, tokenizer=Tokenizer.from_folder(resolve_model("tiny"))
    )
    served = served_name(None, info)
    for name in ("small", "small.gguf", "/m/small.gguf"):
        assert prepare_prompt(info, served, _job(prompt="hi", model=name, max_tokens=2))
    with pytest.raises(RequestError, match="'tiny' is not served here"):
        prepare_prompt(info, served, _job(prompt="hi", model="tiny", max_tokens=2))


@pytest.fixture(scope="module")
def no_template(tmp_path_factory):
    """The tiny preset's folder with its chat template taken out."""
    folder = tmp_path_factory.mktemp("models") / "no-template"
    shutil.copytree(resolve_model("tiny"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_messages_to_a_model_without_a_chat_template_say_what_to_send(no_template):
    info = EngineInfo(model_name=str(no_template), max_model_len=256, tokenizer=Tokenizer.from_folder(no_template))
    with pytest.raises(RequestError) as chat:
        prepare_prompt(info, "plain-model", _job(messages=[{"role": "user", "content": "hi"}], max_tokens=2))
    assert chat.value.code == "invalid_request"
    assert (
        chat.value.message == "messages: model 'plain-model' has no chat template; send `prompt` instead of `messages`"
    )
    with pytest.raises(RequestError) as labels:
        prepare_labels(info, _job(prompt="hi", labels=["a", "b"], label_prompt="chat"), "plain-model")
    assert labels.value.message == (
        "label_prompt: model 'plain-model' has no chat template; send `label_prompt: \"plain\"` with a `prompt`"
    )
    # the plain forms still work
    assert prepare_prompt(info, "plain-model", _job(prompt="hi", max_tokens=2))
    assert prepare_labels(info, _job(prompt="hi", labels=["a", "b"]), "plain-model")[1]


def test_the_engines_own_name_is_not_a_name_when_served_as_another():
    info = SimpleNamespace(model_name="tiny", max_model_len=64, tokenizer=Tokenizer.from_folder(resolve_model("tiny")))
    with pytest.raises(RequestError, match="'tiny' is not served here; this worker serves 'smol'"):
        prepare_prompt(info, "smol", _job(prompt="hi", model="tiny", max_tokens=2))
    assert prepare_prompt(info, "smol", _job(prompt="hi", model="smol", max_tokens=2))
    assert prepare_prompt(info, "tiny", _job(prompt="hi", model="tiny", max_tokens=2))
