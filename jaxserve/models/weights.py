"""Where each parameter of the decoder comes from in a checkpoint.

A family module answers, for a :class:`~jaxserve.models.config.ModelConfig`,
with a :class:`ModelWeights`: for every parameter of the generic decoder
(:mod:`jaxserve.models.decoder`) the list of checkpoint tensors that make
it, each a :class:`Part` (Hugging Face name, its shape in the checkpoint,
and the index of the parameter it fills). Fused parameters are several
parts (q, k and v rows into ``wqkv``); a checkpoint that already fuses them
(Phi-3's ``qkv_proj``) is one part. The loader (:mod:`jaxserve.models.loader`)
fills the parameters from these lists and nothing else, so a family never
touches the loading code, and GGUF files answer the same Hugging Face names
(:mod:`jaxserve.models.gguf_file`).

:func:`llama_layer` is the layout most families share (Llama's names);
families start from it and add or rename what they change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from jaxserve.models.config import ModelConfig


class Part(NamedTuple):
    """One checkpoint tensor's share of a parameter."""

    #: the tensor's Hugging Face name
    name: str
    #: its shape in the checkpoint
    shape: tuple[int, ...]
    #: the index of the parameter it fills (rows ``slice(a, b)``, an expert
    #: ``(j, slice(a, b))``, or ``slice(None)`` for all of it)
    where: Any = slice(None)
    #: checkpoint layout -> parameter layout (e.g. a transpose), applied after
    #: reading; None for a tensor stored as the parameter wants it
    transform: Callable[[np.ndarray], np.ndarray] | None = None


#: parameter name -> its parts
Params = dict[str, list[Part]]


@dataclasses.dataclass(frozen=True)
class ModelWeights:
    """The parts of every parameter: ``top`` holds ``embed``, ``norm`` and
    ``lm_head`` (absent with tied embeddings); ``layers[i]`` the parameters of
    layer ``i``. A parameter missing from its dict is one the config says the
    model does not have (a bias, a norm)."""

    top: Params
    layers: list[Params]


def whole(name: str, shape: tuple[int, ...]) -> list[Part]:
    return [Part(name, shape)]


def rows(named_shapes: list[tuple[str, int]], cols: int) -> list[Part]:
    """Matrices stacked by rows in this order into one ``[sum, cols]`` parameter."""
    parts, start = [], 0
    for name, n in named_shapes:
        parts.append(Part(name, (n, cols), slice(start, start + n)))
        start += n
    return parts


def vector_rows(named_sizes: list[tuple[str, int]]) -> list[Part]:
    """Vectors (biases) concatenated in this order into one parameter."""
    parts, start = [], 0
    for name, n in named_sizes:
        parts.append(Part(name, (n,), slice(start, start + n)))
        start += n
    return parts


def top_params(c: ModelConfig, *, embed: str = "model.embed_tokens.weight", norm: str = "model.norm.weight") -> Params:
    E, V = c.hidden_size, c.vocab_size
    top: Params = {"embed": whole(embed, (V, E)), "norm": whole(norm, (E,))}
    if not c.tie_word_embeddings:
        top["lm_head"] = whole("lm_head.weight", (V, E))
    return top


def llama_layer(c: ModelConfig, i: int, *, prefix: str = "model.layers.{i}.") -> Params:
    """Llama's per-layer names (``self_attn.{q,k,v,o}_proj``,
    ``mlp.{gate,up,down}_proj``, ``input_layernorm``,
    ``post_attention_layernorm``) for the decoder's parameters, with the
    biases and norms the config has."""
    pre = prefix.format(i=i)
    E = c.hidden_size
    qs, kvs = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn, mlp = pre + "self_attn.", pre + "mlp."
    p: Params = {
        "attn_norm": whole(pre + "input_layernorm.weight", (E,)),
        "ffn_norm": whole(pre + "post_attention_layernorm.weight", (E,)),
        "wqkv": rows([(attn + "q_proj.weight", qs), (attn + "k_proj.weight", kvs), (attn + "v_proj.weight", kvs)], E),
        "wo": whole(attn + "o_proj.weight", (E, qs)),
    }
    if c.qkv_bias:
        p["bqkv"] = vector_rows([(attn + "q_proj.bias", qs), (attn + "k_proj.bias", kvs), (attn + "v_proj.bias", kvs)])
    if c.o_bias:
        p["bo"] = whole(attn + "o_proj.bias", (E,))
    if not c.is_moe_layer(i):
        p.update(dense_mlp(c, mlp))
    return p


def dense_mlp(c: ModelConfig, mlp: str) -> Params:
    """``{gate,up,down}_proj`` under ``mlp`` (a name prefix ending in a dot)."""
    E, I = c.hidden_size, c.intermediate_size
    p: Params = {
        "w_gate_up": rows([(mlp + "gate_proj.weight", I), (mlp + "up_proj.weight", I)], E),
        "w_down": whole(mlp + "down_proj.weight", (E, I)),
    }
    if c.mlp_bias:
        p["b_gate_up"] = vector_rows([(mlp + "gate_proj.bias", I), (mlp + "up_proj.bias", I)])
        p["b_down"] = whole(mlp + "down_proj.bias", (E,))
    return p


def qk_norms(c: ModelConfig, attn: str) -> Params:
    """``q_norm``/``k_norm`` under ``attn``, shaped as the config's ``qk_norm`` says."""
    D = c.head_dim
    if c.qk_norm == "full":
        return {
            "q_norm": whole(attn + "q_norm.weight", (c.num_attention_heads * D,)),
            "k_norm": whole(attn + "k_norm.weight", (c.num_key_value_heads * D,)),
        }
    return {"q_norm": whole(attn + "q_norm.weight", (D,)), "k_norm": whole(attn + "k_norm.weight", (D,))}


def per_expert_moe(c: ModelConfig, router: str, expert: str, gate: str, up: str, down: str) -> Params:
    """A MoE layer stored one tensor per expert (Mixtral, Qwen3-MoE): the
    router ``[X, E]`` under ``router`` and, for each expert ``j`` (``{j}`` in
    ``expert``), its ``gate`` / ``up`` ``[I, E]`` into its rows of
    ``experts_gate_up`` and its ``down`` ``[E, I]`` into ``experts_down``."""
    assert c.moe is not None
    X, I, E = c.moe.num_experts, c.moe.intermediate_size, c.hidden_size
    p: Params = {"router": whole(router, (X, E)), "experts_gate_up": [], "experts_down": []}
    for j in range(X):
        pre = expert.format(j=j)
        p["experts_gate_up"] += [
            Part(pre + gate, (I, E), (j, slice(0, I))),
            Part(pre + up, (I, E), (j, slice(I, 2 * I))),
        ]
        p["experts_down"].append(Part(pre + down, (E, I), (j, slice(None))))
    return p


def llama_weights(c: ModelConfig) -> ModelWeights:
    return ModelWeights(top_params(c), [llama_layer(c, i) for i in range(c.num_hidden_layers)])


__all__ = [
    "ModelWeights",
    "Params",
    "Part",
    "dense_mlp",
    "llama_layer",
    "llama_weights",
    "per_expert_moe",
    "qk_norms",
    "rows",
    "top_params",
    "vector_rows",
    "whole",
]
