"""gpt-oss (20b, 120b): attention sinks, alternating sliding and full layers, YaRN, biased experts.

What differs from Llama:

- attention: biases on q, k, v and o; a learned per-head "sink" logit
  (``self_attn.sinks``) joins every softmax row, taking probability mass
  and adding no value; layers alternate a sliding window (``layer_types``;
  by default layers 0, 2, 4, ... slide, 128 tokens) and full attention;
  YaRN rope (``truncate`` false: the ramp's ends are not rounded), whose
  attention factor multiplies cos and sin;
- MoE in every layer: a router with a bias; the top ``num_experts_per_tok``
  of the raw logits, then a softmax over those k (``topk_softmax``);
  experts with biases, gate and up interleaved in one ``[X, E, 2I]``
  tensor (``gate_up_proj``, columns gate, up, gate, up, ...), ``down_proj``
  ``[X, I, E]`` (both ``[in, out]``, the transpose of a Linear weight),
  and the clamped activation ``(clip(up) + 1) * g * sigmoid(alpha * g)``
  with ``g = min(gate, limit)`` (:func:`jaxserve.models.moe.expert_activation`).

The released checkpoints store the experts as MXFP4 (``*_blocks`` /
``*_scales`` with ``quantization_config.quant_method`` ``mxfp4``): such a
folder is refused in one line naming the format; llama.cpp's GGUF of it
(MXFP4 experts) is read. llama.cpp writes ``gpt-oss`` files, Q/K not
permuted, with gate and up split (``ffn_gate_exps`` / ``ffn_up_exps``,
each ``[X, I, E]``, and their biases) and ``ffn_down_exps`` ``[X, E, I]``;
the reader joins them back into the Hugging Face tensors. It stores the
window and YaRN's factor, original context and betas, but neither the
layer pattern, the ramp's rounding nor the activation's constants: llama.cpp
fixes those for gpt-oss (even layers slide; no rounding; 7.0 and 1.702),
and so does this reading.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxserve.models.config import (
    ModelConfig,
    MoEConfig,
    attention_biases,
    optional_int,
    read_base,
    read_layer_types,
    required,
)
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.family import Family
from jaxserve.models.gguf_spec import (
    LLAMA_LAYER_NAMES,
    GGUFMetadata,
    GGUFSpec,
    JoinedTensor,
    base_config,
    bias_keys,
    expert_keys,
)
from jaxserve.models.weights import ModelWeights, Part, llama_layer, top_params, whole

ARCHITECTURE = "GptOssForCausalLM"
#: transformers' defaults for what a config may leave out
DEFAULT_WINDOW = 128
DEFAULT_SWIGLU_LIMIT = 7.0
DEFAULT_SWIGLU_ALPHA = 1.702


def default_layer_types(n: int) -> list[str]:
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]


def read_config(d: Mapping[str, Any], source: str) -> ModelConfig:
    quant = d.get("quantization_config")
    if isinstance(quant, Mapping) and quant.get("quant_method"):
        raise ModelLoadError(
            f"{source}: the experts are stored as {str(quant['quant_method']).upper()} (quantization_config), "
            "which jaxserve does not read from a Hugging Face folder; use the model's GGUF file "
            "(llama.cpp's MXFP4 is read) or a checkpoint with bfloat16 experts"
        )
    c = read_base(d, ARCHITECTURE, source, family="gpt_oss")
    n = c.num_hidden_layers
    window = d.get("sliding_window", DEFAULT_WINDOW)
    top_k = d.get("num_experts_per_tok", d.get("experts_per_token"))
    if top_k is None:
        raise ModelLoadError(f"{source}: required key 'num_experts_per_tok' is missing")
    moe = MoEConfig(
        num_experts=int(required(d, "num_local_experts", source)),
        top_k=int(top_k),
        intermediate_size=c.intermediate_size,
        router="topk_softmax",
        router_bias=True,
        expert_bias=True,
        activation="swiglu_oss",
        swiglu_limit=float(d.get("swiglu_limit", DEFAULT_SWIGLU_LIMIT)),
        swiglu_alpha=float(d.get("swiglu_alpha", DEFAULT_SWIGLU_ALPHA)),
    )
    return dataclasses.replace(
        c,
        **attention_biases(d, default=True),
        attention_sinks=True,
        sliding_window=optional_int(window),
        layer_types=read_layer_types(d, source, default_layer_types(n)),
        moe=moe,
    )


def _gate_up(a: np.ndarray) -> np.ndarray:
    """``[X, E, 2I]`` (columns gate, up, gate, up, ...) -> ``[X, 2I, E]``: gate rows, then up rows."""
    t = np.swapaxes(a, 1, 2)
    return np.concatenate([t[:, 0::2], t[:, 1::2]], axis=1)


def _gate_up_bias(b: np.ndarray) -> np.ndarray:
    return np.concatenate([b[:, 0::2], b[:, 1::2]], axis=1)


def _transposed(a: np.ndarray) -> np.ndarray:
    return np.swapaxes(a, 1, 2)


def weights(c: ModelConfig) -> ModelWeights:
    assert c.moe is not None
    X, I, E, H = c.moe.num_experts, c.moe.intermediate_size, c.hidden_size, c.num_attention_heads
    layers = []
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        experts = pre + "mlp.experts."
        p = llama_layer(c, i)
        p["sinks"] = whole(pre + "self_attn.sinks", (H,))
        p["router"] = whole(pre + "mlp.router.weight", (X, E))
        p["b_router"] = whole(pre + "mlp.router.bias", (X,))
        p["experts_gate_up"] = [Part(experts + "gate_up_proj", (X, E, 2 * I), transform=_gate_up)]
        p["experts_b_gate_up"] = [Part(experts + "gate_up_proj_bias", (X, 2 * I), transform=_gate_up_bias)]
        p["experts_down"] = [Part(experts + "down_proj", (X, I, E), transform=_transposed)]
        p["experts_b_down"] = whole(experts + "down_proj_bias", (X, E))
        layers.append(p)
    return ModelWeights(top_params(c), layers)


def gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    config = base_config(meta, ARCHITECTURE)
    config.update(bias_keys(meta, mlp=False))
    config["sliding_window"] = int(meta.key("attention.sliding_window"))
    config["layer_types"] = default_layer_types(config["num_hidden_layers"])
    config.update(expert_keys(meta))
    config["intermediate_size"] = int(meta.key("expert_feed_forward_length", config["intermediate_size"]))
    if config["rope_scaling"] is not None and config["rope_scaling"]["rope_type"] == "yarn":
        config["rope_scaling"]["truncate"] = False
    return config


_EXPERTS = "mlp.experts."

GGUF = GGUFSpec(
    architectures=("gpt-oss",),
    layer_names={
        **{k: v for k, v in LLAMA_LAYER_NAMES.items() if k.startswith(("input_layernorm", "self_attn."))},
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.sinks": "attn_sinks.weight",
        "mlp.router.weight": "ffn_gate_inp.weight",
        "mlp.router.bias": "ffn_gate_inp.bias",
        _EXPERTS + "down_proj_bias": "ffn_down_exps.bias",
    },
    joined_names={
        _EXPERTS + "gate_up_proj": JoinedTensor(("ffn_gate_exps.weight", "ffn_up_exps.weight"), transposed=True),
        _EXPERTS + "gate_up_proj_bias": JoinedTensor(("ffn_gate_exps.bias", "ffn_up_exps.bias")),
        _EXPERTS + "down_proj": JoinedTensor(("ffn_down_exps.weight",), transposed=True),
    },
    config=gguf_config,
)

FAMILY = Family("gpt_oss", (ARCHITECTURE,), read_config, weights, gguf=GGUF, end_of_turn=("<|return|>", "<|call|>"))
