"""Presets: deterministic materialization, HF-compatible folders, name resolution."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from jaxserve import cache_folders, presets
from jaxserve.presets import (
    PresetError,
    UnknownModelError,
    list_presets,
    materialize_preset,
    preset_hash,
    resolve_model,
)
from jaxserve.tokenizer import Tokenizer

REPO_MODELS = Path(__file__).resolve().parents[1] / "models"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
TEXTS = [
    "Hello world! The quick brown fox.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Café naïve 你好 👩\u200d👩\u200d👧 🇯🇵 ∑ <|eot_id|> inline special",
    "numbers 1234567 and code: def f(x): return x**2",
]


def digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in FILES}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return materialize_preset("tiny", cache=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def llama56m(tmp_path_factory) -> Path:
    return materialize_preset("llama-56m", cache=tmp_path_factory.mktemp("cache"))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ------------------------------------------------------------ determinism


def test_listed_presets():
    assert {"tiny", "llama-56m"} <= set(list_presets())
    assert presets.presets_dir() == REPO_MODELS


def test_tiny_is_deterministic(tiny, tmp_path):
    again = materialize_preset("tiny", cache=tmp_path)
    assert again.name == tiny.name
    assert re.fullmatch(r"tiny-[0-9a-f]{16}", tiny.name)
    assert digests(again) == digests(tiny)


def test_llama_56m_is_deterministic_and_56m(llama56m):
    from safetensors import safe_open

    # Weights go through the same code as tiny's (checked byte for byte above);
    # rebuild the tokenizer, whose 31k reserved-token padding only shows here.
    preset = REPO_MODELS / "llama-56m.json"
    rebuilt = presets.build_tokenizer(preset, presets.load_preset(preset))
    assert rebuilt.to_str() == (llama56m / "tokenizer.json").read_text(encoding="utf-8")
    with safe_open(str(llama56m / "model.safetensors"), framework="np") as f:
        params = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    assert params == 56_369_664
    config = json.loads((llama56m / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (512, 8, 8)
    assert (config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == (4, 1408, 32000)
    tok = Tokenizer.from_folder(llama56m)
    assert tok.vocab_size == 32000
    assert tok.id_to_token(31999).startswith("<|reserved_special_token_")


def test_config_json(tiny):
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    expected = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "vocab_size": 512,
        "head_dim": 16,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rope_theta"] > 0 and "rms_norm_eps" in config
    assert config["bos_token_id"] == 0 and config["eos_token_id"] == 1
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 2]


def test_weights_layout(tiny):
    from safetensors.numpy import load_file

    weights = load_file(str(tiny / "model.safetensors"))
    expected = {"model.embed_tokens.weight": (512, 64), "model.norm.weight": (64,), "lm_head.weight": (512, 64)}
    for i in range(2):
        p = f"model.layers.{i}"
        expected.update(
            {
                f"{p}.self_attn.q_proj.weight": (64, 64),
                f"{p}.self_attn.k_proj.weight": (32, 64),
                f"{p}.self_attn.v_proj.weight": (32, 64),
                f"{p}.self_attn.o_proj.weight": (64, 64),
                f"{p}.mlp.gate_proj.weight": (128, 64),
                f"{p}.mlp.up_proj.weight": (128, 64),
                f"{p}.mlp.down_proj.weight": (64, 128),
                f"{p}.input_layernorm.weight": (64,),
                f"{p}.post_attention_layernorm.weight": (64,),
            }
        )
    assert {k: v.shape for k, v in weights.items()} == expected
    assert all(v.dtype == np.float32 for v in weights.values())
    for name, value in weights.items():
        if "norm" in name:
            assert np.all(value == 1.0)
        else:
            assert abs(float(value.std()) - 0.02) < 0.003, name
    assert not np.array_equal(weights["model.embed_tokens.weight"], weights["lm_head.weight"])


def test_tokenizer_recipe(tiny):
    tok = Tokenizer.from_folder(tiny)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    assert [tok.token_to_id(t) for t in specials] == [0, 1, 2, 3, 4]
    assert tok.bos_token_id == 0 and tok.eos_token_ids == (1, 2)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 0 and ids.count(0) == 1
        assert tok.decode(ids) == text.replace("<|eot_id|>", "")
        assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text
    assert len(tok.encode("the the the", add_special_tokens=False)) < len("the the the")  # merges learned


# ---------------------------------------------------------- transformers


def test_tiny_loads_with_transformers(tiny):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = Tokenizer.from_folder(tiny)
    hf = AutoTokenizer.from_pretrained(str(tiny))
    assert len(hf) == ours.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_token_id, ours.eos_token_ids[0])
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert hf(text, add_special_tokens=special)["input_ids"] == ids
            assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids)
            assert hf.decode(ids, skip_special_tokens=False) == ours.decode(ids, skip_special_tokens=False)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye 👋"},
    ]
    for agp in (True, False):
        assert ours.apply_chat_template(chat, agp) == hf.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=agp
        )
        assert ours.encode_chat(chat, agp) == hf.apply_chat_template(
            chat, tokenize=True, add_generation_prompt=agp, return_dict=False
        )

    model, info = AutoModelForCausalLM.from_pretrained(str(tiny), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.num_key_value_heads == 2 and not model.config.tie_word_embeddings
    assert list(model.generation_config.eos_token_id) == [1, 2]
    weights = load_file(str(tiny / "model.safetensors"))
    state = model.state_dict()
    for name in ("model.layers.1.self_attn.k_proj.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert np.array_equal(state[name].numpy(), weights[name])
    ids = torch.tensor([ours.encode("Hello world")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512)
    assert torch.isfinite(logits).all()


def test_llama_56m_loads_with_transformers(llama56m):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(llama56m))
    assert len(hf) == 32000
    assert hf("Hello")["input_ids"] == Tokenizer.from_folder(llama56m).encode("Hello")
    model, info = AutoModelForCausalLM.from_pretrained(str(llama56m), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert sum(p.numel() for p in model.parameters()) == 56_369_664


# ------------------------------------------------------------- resolution


def test_resolve_existing_folder(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(folder) == folder
    assert resolve_model(str(folder)) == folder
    assert isinstance(resolve_model(str(folder)), Path)


def test_resolve_preset_name_uses_cache(cache):
    first = resolve_model("tiny")
    assert first.parent == cache / "presets"
    assert first.name == f"tiny-{preset_hash(REPO_MODELS / 'tiny.json')}"
    assert all((first / f).is_file() for f in FILES)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in (cache / "presets").iterdir()] == [first.name]  # no temp dirs left
    # A preset file path works too.
    assert resolve_model(str(REPO_MODELS / "tiny.json")) == first


def test_cache_defaults_to_home(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_folders.cache_dir() == tmp_path / ".cache" / "jaxserve"


def test_unknown_name(cache):
    with pytest.raises(UnknownModelError) as err:
        resolve_model("no-such-model")
    message = str(err.value)
    assert "no-such-model" in message
    assert "tiny" in message and "llama-56m" in message
    assert "folder" in message
    assert isinstance(err.value, ValueError)
    with pytest.raises(UnknownModelError, match="does not exist"):
        resolve_model("./missing/model-dir")
    assert not cache.exists()


def copy_presets(dst: Path) -> Path:
    dst.mkdir()
    shutil.copy(REPO_MODELS / "tiny.json", dst / "tiny.json")
    shutil.copy(REPO_MODELS / "corpus.txt", dst / "corpus.txt")
    shutil.copytree(REPO_MODELS / "templates", dst / "templates")
    return dst


def test_presets_dir_override_and_hash(cache, tmp_path, monkeypatch, tiny):
    custom = copy_presets(tmp_path / "presets")
    data = json.loads((custom / "tiny.json").read_text())
    data["name"] = "tiny-seed7"
    data["seed"] = 7
    (custom / "tiny-seed7.json").write_text(json.dumps(data))
    monkeypatch.setenv("JAXSERVE_PRESETS_DIR", str(custom))
    assert list_presets() == ["tiny", "tiny-seed7"]

    same = resolve_model("tiny")
    assert same.name == tiny.name  # identical inputs, identical hash
    other = resolve_model("tiny-seed7")
    assert other.name.startswith("tiny-seed7-")
    assert digests(other)["tokenizer.json"] == digests(same)["tokenizer.json"]
    assert digests(other)["model.safetensors"] != digests(same)["model.safetensors"]

    # Any change to the preset or the files it references gives a new folder.
    before = preset_hash(custom / "tiny.json")
    (custom / "corpus.txt").write_text((custom / "corpus.txt").read_text() + "\nOne more line.\n")
    assert preset_hash(custom / "tiny.json") != before


def test_bad_presets(tmp_path, monkeypatch):
    custom = copy_presets(tmp_path / "presets")
    monkeypatch.setenv("JAXSERVE_PRESETS_DIR", str(custom))
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    base = json.loads((custom / "tiny.json").read_text())

    def write(**config_changes):
        data = json.loads(json.dumps(base))
        data["config"].update(config_changes)
        (custom / "bad.json").write_text(json.dumps(data))

    write(hidden_size=0)
    with pytest.raises(PresetError, match="hidden_size"):
        resolve_model("bad")
    write(num_key_value_heads=3)
    with pytest.raises(PresetError, match="num_key_value_heads"):
        resolve_model("bad")
    write(vocab_size=100)
    with pytest.raises(PresetError, match="vocab_size"):
        resolve_model("bad")
    (custom / "bad.json").write_text("{")
    with pytest.raises(PresetError, match="bad.json"):
        resolve_model("bad")
    assert not any(p.name.startswith(".") for p in (tmp_path / "cache" / "presets").glob("*"))


def test_concurrent_first_use(tmp_path):
    results: list[Path] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker():
        try:
            barrier.wait()
            results.append(materialize_preset("tiny", cache=tmp_path))
        except BaseException as exc:  # noqa: BLE001 # pragma: no cover - any failure in the thread is reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    folder = results[0]
    assert os.listdir(tmp_path / "presets") == [folder.name]
    Tokenizer.from_folder(folder)
    assert all((folder / f).is_file() for f in FILES)
