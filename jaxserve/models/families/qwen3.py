"""Qwen3 (dense): Qwen2 without the q/k/v biases, with an RMSNorm over each head of q and k before rope.

``head_dim`` is set apart from ``hidden_size / num_attention_heads`` (the
0.6B model: hidden 1024, 16 heads of 128). ``attention_bias`` is read as
Llama reads it. llama.cpp writes ``qwen3`` files, Q/K not permuted, with
the norms as ``attn_q_norm`` / ``attn_k_norm``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxserve.models.config import ModelConfig, attention_biases, read_base
from jaxserve.models.families.qwen2 import sliding_layers
from jaxserve.models.family import Family
from jaxserve.models.gguf_spec import LLAMA_LAYER_NAMES, QK_NORM_NAMES, GGUFSpec, plain_config
from jaxserve.models.weights import ModelWeights, llama_layer, qk_norms, top_params

ARCHITECTURE = "Qwen3ForCausalLM"


def read_config(d: Mapping[str, Any], source: str) -> ModelConfig:
    c = read_base(d, ARCHITECTURE, source, family="qwen3")
    window, layer_types = sliding_layers(d, source)
    return dataclasses.replace(c, **attention_biases(d), qk_norm="head", sliding_window=window, layer_types=layer_types)


def weights(c: ModelConfig) -> ModelWeights:
    layers = []
    for i in range(c.num_hidden_layers):
        p = llama_layer(c, i)
        p.update(qk_norms(c, f"model.layers.{i}.self_attn."))
        layers.append(p)
    return ModelWeights(top_params(c), layers)


GGUF = GGUFSpec(
    architectures=("qwen3",), layer_names={**LLAMA_LAYER_NAMES, **QK_NORM_NAMES}, config=plain_config(ARCHITECTURE)
)

FAMILY = Family("qwen3", (ARCHITECTURE,), read_config, weights, gguf=GGUF, end_of_turn=("<|im_end|>",))
