"""ModelConfig parsing (transformers 4.x and 5.x keys) and rope frequencies against transformers."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.models import ModelConfig, ModelLoadError
from jaxserve.models.rope import inv_frequencies

BASE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    max_position_embeddings=4096,
)


def test_defaults_and_llama2_keys():
    c = ModelConfig.from_dict(
        {**BASE, "rope_theta": 10000.0, "rope_scaling": None, "eos_token_id": 2, "torch_dtype": "float16"}
    )
    assert c.num_key_value_heads == 8 and c.head_dim == 8
    assert c.rope.rope_type == "default" and c.rope_theta == 10000.0
    assert c.eos_token_ids == (2,) and c.torch_dtype == "float16"
    assert not (c.qkv_bias or c.o_bias or c.mlp_bias or c.tie_word_embeddings)
    assert c.sliding_window is None


def test_llama3_4x_and_5x_keys_agree():
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    c4 = ModelConfig.from_dict(
        {
            **BASE,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", **scaling},
            "eos_token_id": [128001, 128009],
            "dtype": "bfloat16",
        }
    )
    c4b = ModelConfig.from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **scaling}})
    c5 = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}})
    assert c4.rope == c4b.rope == c5.rope
    assert c5.rope.factor == 8.0 and c5.rope_theta == 500000.0
    assert c4.eos_token_ids == (128001, 128009) and c4.torch_dtype == "bfloat16"


def test_qwen2_and_mistral_specifics():
    q = ModelConfig.from_dict(
        {
            **BASE,
            "architectures": ["Qwen2ForCausalLM"],
            "num_key_value_heads": 2,
            "sliding_window": 4096,
            "use_sliding_window": False,
        }
    )
    assert q.qkv_bias and not q.o_bias and not q.mlp_bias and q.sliding_window is None
    m = ModelConfig.from_dict(
        {
            **BASE,
            "architectures": ["MistralForCausalLM"],
            "sliding_window": 4096,
            "max_position_embeddings": 32768,
            "head_dim": 16,
        }
    )
    assert m.sliding_window == 4096 and m.effective_sliding_window == 4096 and m.head_dim == 16
    m2 = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert m2.effective_sliding_window is None  # window >= context: plain causal attention
    ll = ModelConfig.from_dict({**BASE, "attention_bias": True, "mlp_bias": True})
    assert ll.qkv_bias and ll.o_bias and ll.mlp_bias


def test_model_type_fallback_and_errors():
    d = {k: v for k, v in BASE.items() if k != "architectures"}
    assert ModelConfig.from_dict({**d, "model_type": "mistral"}).architecture == "MistralForCausalLM"
    with pytest.raises(ModelLoadError, match="FalconForCausalLM"):
        ModelConfig.from_dict({**BASE, "architectures": ["FalconForCausalLM"]})
    with pytest.raises(ModelLoadError, match="dynamic"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ModelLoadError, match="hidden_size"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "hidden_size"})


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_inv_freq_matches_transformers(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"}, head_dim=32, rope_parameters=params)
    if params["rope_type"] == "default":
        inv, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        inv, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu")
    c = ModelConfig.from_dict({**BASE, "head_dim": 32, "rope_parameters": params})
    np.testing.assert_allclose(inv_frequencies(c.rope, 32), inv.numpy(), rtol=1e-6)
