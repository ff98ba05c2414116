"""Mixtral (8x7B, 8x22B): Mistral's attention with a mixture of SwiGLU experts in every layer.

The router is a bias-free linear layer; a token's weights are the softmax
over all experts (float32), of which the top ``num_experts_per_tok`` are
kept and renormalized to sum to 1 (:func:`jaxserve.models.moe.route`,
``softmax_topk``). Each expert is a Llama MLP (``w1`` gate, ``w3`` up,
``w2`` down), stored one tensor per expert. An optional ``sliding_window``
applies to every layer, as in Mistral.

llama.cpp writes Mixtral as ``llama`` with the router as ``ffn_gate_inp``
and each layer's experts stacked into ``ffn_{gate,up,down}_exps``
(``[X, I, E]`` in Hugging Face order), Q/K permuted like Llama's; the
Llama family declines those files (its ``claims``) and this one takes them.
The converter writes no window for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from jaxserve.models.config import ModelConfig, MoEConfig, optional_int, read_base, required
from jaxserve.models.family import Family
from jaxserve.models.gguf_spec import LLAMA_LAYER_NAMES, GGUFMetadata, GGUFSpec, base_config, expert_keys
from jaxserve.models.weights import ModelWeights, llama_layer, per_expert_moe, top_params

ARCHITECTURE = "MixtralForCausalLM"
_MOE = "block_sparse_moe."


def read_config(d: Mapping[str, Any], source: str) -> ModelConfig:
    c = read_base(d, ARCHITECTURE, source, family="mixtral")
    moe = MoEConfig(
        num_experts=int(required(d, "num_local_experts", source)),
        top_k=int(required(d, "num_experts_per_tok", source)),
        intermediate_size=c.intermediate_size,
        router="softmax_topk",
        normalize_topk=True,
    )
    return dataclasses.replace(c, sliding_window=optional_int(d.get("sliding_window")), moe=moe)


def weights(c: ModelConfig) -> ModelWeights:
    layers = []
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}.{_MOE}"
        p = llama_layer(c, i)
        p.update(per_expert_moe(c, pre + "gate.weight", pre + "experts.{j}.", "w1.weight", "w3.weight", "w2.weight"))
        layers.append(p)
    return ModelWeights(top_params(c), layers)


def gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    return {**base_config(meta, ARCHITECTURE), **expert_keys(meta)}


def _has_experts(tensor_names: Collection[str]) -> bool:
    return "blk.0.ffn_gate_inp.weight" in tensor_names


GGUF = GGUFSpec(
    architectures=("llama",),
    layer_names={**LLAMA_LAYER_NAMES, _MOE + "gate.weight": "ffn_gate_inp.weight"},
    expert_names={
        _MOE + "experts.{j}.w1.weight": "ffn_gate_exps.weight",
        _MOE + "experts.{j}.w3.weight": "ffn_up_exps.weight",
        _MOE + "experts.{j}.w2.weight": "ffn_down_exps.weight",
    },
    config=gguf_config,
    permuted_qk=True,
    claims=_has_experts,
)

FAMILY = Family("mixtral", (ARCHITECTURE,), read_config, weights, gguf=GGUF)
