"""OLMo 2: Llama with its norms moved after the sublayers, and q/k norms over all heads at once.

A layer is ``h = x + norm(attn(x))``, then ``h + norm(mlp(h))``: no norm
on a sublayer's input (``norms=("attn_out", "ffn_out")``; the checkpoint
names them ``post_attention_layernorm`` and ``post_feedforward_layernorm``).
``q_norm`` / ``k_norm`` are RMSNorms over the whole projected q (``heads *
head_dim`` features) and k (``kv_heads * head_dim``), before rope
(``qk_norm="full"``), not over each head as Qwen3's are.

llama.cpp writes ``olmo2`` files with the Q/K rows as the checkpoint has
them, the sublayer norms as ``post_attention_norm`` / ``post_ffw_norm``
and the q/k norms as ``attn_q_norm`` / ``attn_k_norm``. The instruct
models' template ends a turn with the eos token, ``<|endoftext|>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxserve.models.config import ModelConfig, attention_biases, read_base
from jaxserve.models.family import Family
from jaxserve.models.gguf_spec import LLAMA_LAYER_NAMES, QK_NORM_NAMES, GGUFMetadata, GGUFSpec, base_config, bias_keys
from jaxserve.models.weights import ModelWeights, llama_layer, qk_norms, top_params, whole

ARCHITECTURE = "Olmo2ForCausalLM"
#: Olmo2Config's defaults for the keys a config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048}


def read_config(d: Mapping[str, Any], source: str) -> ModelConfig:
    c = read_base({**DEFAULTS, **d}, ARCHITECTURE, source, family="olmo2")
    return dataclasses.replace(c, **attention_biases(d), norms=("attn_out", "ffn_out"), qk_norm="full")


def weights(c: ModelConfig) -> ModelWeights:
    E = c.hidden_size
    layers = []
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        p = llama_layer(c, i)
        del p["attn_norm"], p["ffn_norm"]
        p["attn_out_norm"] = whole(pre + "post_attention_layernorm.weight", (E,))
        p["ffn_out_norm"] = whole(pre + "post_feedforward_layernorm.weight", (E,))
        p.update(qk_norms(c, pre + "self_attn."))
        layers.append(p)
    return ModelWeights(top_params(c), layers)


#: llama.cpp's per-layer names for OLMo 2 (no input norms; the two post-norms)
GGUF_LAYER_NAMES: dict[str, str] = {
    **{
        k: v
        for k, v in LLAMA_LAYER_NAMES.items()
        if k not in ("input_layernorm.weight", "post_attention_layernorm.weight")
    },
    **QK_NORM_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    return {**base_config(meta, ARCHITECTURE), **bias_keys(meta, mlp=False)}


GGUF = GGUFSpec(architectures=("olmo2",), layer_names=GGUF_LAYER_NAMES, config=gguf_config)

FAMILY = Family("olmo2", (ARCHITECTURE,), read_config, weights, gguf=GGUF, end_of_turn=("<|endoftext|>",))
