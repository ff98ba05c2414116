"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention (q/k norms per head) with a mixture of SwiGLU experts.

The router is a bias-free linear layer; softmax over all experts in
float32, the top ``num_experts_per_tok`` kept, renormalized to sum to 1
only when ``norm_topk_prob`` (transformers' default is not to; the released
models set it). Experts are ``moe_intermediate_size`` wide, stored one
tensor per expert; there is no shared expert (Qwen2-MoE's). Which layers
are MoE: a layer listed in ``mlp_only_layers`` has a dense MLP of
``intermediate_size``, and otherwise every ``decoder_sparse_step``-th layer
(``(i + 1) % step == 0``) is MoE. ``use_sliding_window`` puts the window on
every layer.

llama.cpp writes ``qwen3moe`` files, Q/K not permuted, router
``ffn_gate_inp``, experts stacked into ``ffn_{gate,up,down}_exps``. It
stores no ``norm_topk_prob`` and always renormalizes (as the released
models do), so a file is read that way unless it says otherwise
(``expert_weights_norm``); a layer without a router is read as dense.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxserve.models.config import ModelConfig, MoEConfig, attention_biases, optional_int, read_base, required
from jaxserve.models.family import Family
from jaxserve.models.gguf_spec import (
    LLAMA_LAYER_NAMES,
    QK_NORM_NAMES,
    GGUFMetadata,
    GGUFSpec,
    base_config,
    expert_keys,
)
from jaxserve.models.weights import ModelWeights, llama_layer, per_expert_moe, qk_norms, top_params

ARCHITECTURE = "Qwen3MoeForCausalLM"


def moe_layers(d: Mapping[str, Any], num_experts: int, source: str) -> tuple[bool, ...]:
    """Per layer whether it is MoE, as transformers decides it."""
    n = int(required(d, "num_hidden_layers", source))
    step = int(d.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in d.get("mlp_only_layers") or ()}
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(n))


def read_config(d: Mapping[str, Any], source: str) -> ModelConfig:
    c = read_base(d, ARCHITECTURE, source, family="qwen3_moe")
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    c = dataclasses.replace(c, **attention_biases(d), qk_norm="head", sliding_window=optional_int(window))
    num_experts = d.get("num_experts", d.get("num_local_experts"))
    num_experts = int(num_experts) if num_experts is not None else 0
    layers = moe_layers(d, num_experts, source)
    if not any(layers):
        return c
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=int(required(d, "num_experts_per_tok", source)),
        intermediate_size=int(required(d, "moe_intermediate_size", source)),
        router="softmax_topk",
        normalize_topk=bool(d.get("norm_topk_prob", False)),
        layers=() if all(layers) else layers,
    )
    return dataclasses.replace(c, moe=moe)


def weights(c: ModelConfig) -> ModelWeights:
    layers = []
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        p = llama_layer(c, i)
        p.update(qk_norms(c, pre + "self_attn."))
        if c.is_moe_layer(i):
            p.update(
                per_expert_moe(
                    c,
                    pre + "mlp.gate.weight",
                    pre + "mlp.experts.{j}.",
                    "gate_proj.weight",
                    "up_proj.weight",
                    "down_proj.weight",
                )
            )
        layers.append(p)
    return ModelWeights(top_params(c), layers)


def gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    config = base_config(meta, ARCHITECTURE)
    n = config["num_hidden_layers"]
    config.update(expert_keys(meta, count_key="num_experts"))
    config["moe_intermediate_size"] = int(meta.key("expert_feed_forward_length"))
    config["norm_topk_prob"] = bool(meta.get("expert_weights_norm", True))
    config["mlp_only_layers"] = [i for i in range(n) if not meta.has_tensor(f"blk.{i}.ffn_gate_inp.weight")]
    return config


GGUF = GGUFSpec(
    architectures=("qwen3moe",),
    layer_names={**LLAMA_LAYER_NAMES, **QK_NORM_NAMES, "mlp.gate.weight": "ffn_gate_inp.weight"},
    expert_names={
        "mlp.experts.{j}.gate_proj.weight": "ffn_gate_exps.weight",
        "mlp.experts.{j}.up_proj.weight": "ffn_up_exps.weight",
        "mlp.experts.{j}.down_proj.weight": "ffn_down_exps.weight",
    },
    config=gguf_config,
)

FAMILY = Family("qwen3_moe", (ARCHITECTURE,), read_config, weights, gguf=GGUF, end_of_turn=("<|im_end|>",))
