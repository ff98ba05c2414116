"""Every way a model folder can be wrong raises ModelLoadError naming the offending thing."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import model_fixtures as mf
from jaxserve.models import ModelLoadError, load_model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return mf.llama2(str(tmp_path_factory.mktemp("base") / "llama2"), seed=7)


@pytest.fixture
def folder(base, tmp_path):
    import shutil

    d = str(tmp_path / "m")
    shutil.copytree(base, d)
    return d


def _rewrite_weights(folder: str, fn) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="nope"):
        load_model(tmp_path / "nope")


def test_missing_config(folder):
    os.remove(os.path.join(folder, "config.json"))
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(folder)


def test_unsupported_architecture(folder):
    mf.edit_config(folder, lambda d: d.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(ModelLoadError) as e:
        load_model(folder)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    assert "LlamaForCausalLM" in msg and "MistralForCausalLM" in msg and "Qwen2ForCausalLM" in msg


def test_unsupported_rope_type(folder):
    mf.edit_config(folder, lambda d: d.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}))
    with pytest.raises(ModelLoadError, match="yarn"):
        load_model(folder)


def test_missing_weights_file(folder):
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(ModelLoadError) as e:
        load_model(folder)
    assert "model.safetensors" in str(e.value) and "model.safetensors.index.json" in str(e.value)


def test_missing_shard_file(tmp_path):
    d = mf.llama2(str(tmp_path / "sharded"), seed=8, max_shard_size="100KB")
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(d, shard))
    with pytest.raises(ModelLoadError, match=shard):
        load_model(d)


def test_missing_tensor(folder):
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite_weights(folder, lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        load_model(folder)


def test_missing_lm_head_when_untied(folder):
    _rewrite_weights(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight"):
        load_model(folder)


def test_mismatched_shape(folder):
    name = "model.layers.0.self_attn.k_proj.weight"

    def shrink(t):
        t[name] = torch.zeros(16, 64)

    _rewrite_weights(folder, shrink)
    with pytest.raises(ModelLoadError) as e:
        load_model(folder)
    msg = str(e.value)
    assert name in msg and "[16, 64]" in msg and "[32, 64]" in msg


def test_config_shape_disagrees_with_weights(folder):
    mf.edit_config(folder, lambda d: d.update(intermediate_size=96))
    with pytest.raises(ModelLoadError, match=r"mlp\.(gate|up|down)_proj\.weight.*\[96, 64\]"):
        load_model(folder)
