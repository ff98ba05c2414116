"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama with fused projections, LongRoPE, partial rotary and a sliding window.

The checkpoint fuses what Llama keeps apart: ``self_attn.qkv_proj`` holds
the q, k and v rows in that order and ``mlp.gate_up_proj`` the gate rows
then the up rows, which is exactly the decoder's ``wqkv`` / ``w_gate_up``,
so each is one part read whole. The long-context models (Phi-3-mini-128k,
Phi-3.5-mini, Phi-4-mini) scale rope with ``longrope`` (older configs say
``su``; transformers reads ``yarn`` in a Phi-3 config as ``longrope`` too):
a ``short_factor`` list while a sequence stays within
``original_max_position_embeddings`` and a ``long_factor`` list past it,
with cos and sin multiplied by an attention factor derived from the ratio
of the two context lengths. Phi-4-mini rotates only the first
``partial_rotary_factor`` (0.75) of each head and ties its embeddings.
``sliding_window`` applies to every layer when set (Phi-3-mini-4k's 2047;
the 128k models' 262144 is past their context and dropped).

Which factors a token gets. transformers decides per forward call (long
when the call's sequence is longer than the original length), and
Phi-3's ``generate`` drops its cache and recomputes the whole sequence with
the long factors on the step where it first grows past the original
length, so a sequence never mixes the two sets. vLLM and llama.cpp pick
one set for the whole server from its context size (``max_model_len`` /
``n_ctx`` per sequence above the original length: long for every request),
which keeps the cache consistent but changes every short request. jaxserve
decides per request, once, from its prompt: a prompt longer than the
original length rotates every position long, any other request every
position short, to its end, whatever the chunking, prefix-cache hits or
preemptions (the engine sends each row's choice as
``AttentionMetadata.long_rope_from`` and keeps the two kinds of keys apart
in the prefix cache by their salt; a label-scoring job goes by its prompt).
A sequence that stays on one side of the original length therefore
matches transformers exactly. One that starts short and grows past it
matches transformers up to the crossing, then keeps the short factors
where transformers would recompute everything long: recomputing a running
sequence's cache mid-generation (a pause of one prefill of the original
length, 4096 tokens for Phi-3-mini-128k) is left to the engine; it never
mixes sets within a sequence, which neither transformers nor llama.cpp
does either.

llama.cpp writes ``phi3`` files: ``attn_qkv`` and ``ffn_up`` (gate and up
rows fused, as in the checkpoint) unpermuted, the factor lists as the
tensors ``rope_factors_long`` / ``rope_factors_short``, the attention
factor as ``rope.scaling.attn_factor``, the original length as
``rope.scaling.original_context_length``, partial rotary as
``rope.dimension_count`` and the window as ``attention.sliding_window`` (0:
none). llama.cpp itself ignores a Phi-3 window; jaxserve applies it, as
transformers does. A turn ends with ``<|end|>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxserve.models.config import ModelConfig, optional_int, read_base, rope_parameters
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.family import Family
from jaxserve.models.gguf_spec import GGUFMetadata, GGUFSpec, base_config, short_float
from jaxserve.models.weights import ModelWeights, top_params, whole

ARCHITECTURE = "Phi3ForCausalLM"
#: Phi3Config's defaults for the keys a config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096}


def _normalized(d: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` with its rope settings in one ``rope_parameters`` dict as
    transformers' Phi3Config reads them: ``su`` and ``yarn`` are
    ``longrope``, and a longrope scaling takes the top-level
    ``original_max_position_embeddings`` (Phi-3 keeps it there; transformers
    prefers it over the scaling's own)."""
    d = {**DEFAULTS, **d}
    scaling, theta = rope_parameters(d)
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in ("su", "yarn", "longrope"):
        scaling["rope_type"] = "longrope"
        scaling.pop("type", None)
        scaling["original_max_position_embeddings"] = int(d["original_max_position_embeddings"])
    d.pop("rope_scaling", None)
    d["rope_parameters"] = {**scaling, "rope_theta": theta}
    return d


def rotary_dim(d: Mapping[str, Any], head_dim: int, source: str) -> int | None:
    """The rotated features of each head (``partial_rotary_factor`` of it,
    from the rope parameters or the top level); None when it is all of them."""
    params, _ = rope_parameters(d)
    factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if factor is None:
        return None
    rotary = int(head_dim * float(factor))
    if rotary <= 0 or rotary > head_dim or rotary % 2:
        raise ModelLoadError(
            f"{source}: partial_rotary_factor {factor} gives {rotary} rotated features of {head_dim}; "
            "they must be an even number, at least 2"
        )
    return None if rotary == head_dim else rotary


def read_config(d: Mapping[str, Any], source: str) -> ModelConfig:
    d = _normalized(d)
    c = read_base(d, ARCHITECTURE, source, family="phi3")
    rotary = rotary_dim(d, c.head_dim, source)
    if c.rope.short_factor is not None and len(c.rope.short_factor) != (rotary or c.head_dim) // 2:
        raise ModelLoadError(
            f"{source}: rope short_factor and long_factor need {(rotary or c.head_dim) // 2} entries "
            f"(half the rotated features), got {len(c.rope.short_factor)}"
        )
    return dataclasses.replace(c, rotary_dim=rotary, sliding_window=optional_int(d.get("sliding_window")))


def weights(c: ModelConfig) -> ModelWeights:
    E, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    q_size, kv_size = c.num_attention_heads * D, c.num_key_value_heads * D
    layers = []
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        layers.append(
            {
                "attn_norm": whole(pre + "input_layernorm.weight", (E,)),
                "wqkv": whole(pre + "self_attn.qkv_proj.weight", (q_size + 2 * kv_size, E)),
                "wo": whole(pre + "self_attn.o_proj.weight", (E, q_size)),
                "ffn_norm": whole(pre + "post_attention_layernorm.weight", (E,)),
                "w_gate_up": whole(pre + "mlp.gate_up_proj.weight", (2 * I, E)),
                "w_down": whole(pre + "mlp.down_proj.weight", (E, I)),
            }
        )
    return ModelWeights(top_params(c), layers)


#: llama.cpp's per-layer names for Phi-3 (the fused tensors kept fused)
GGUF_LAYER_NAMES: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    config = base_config(meta, ARCHITECTURE, partial_rotary=True)
    head_dim = config["head_dim"]
    rotary = int(meta.get("rope.dimension_count") or head_dim)
    if rotary != head_dim:
        factor = rotary / head_dim
        if int(head_dim * factor) != rotary:
            raise ModelLoadError(
                f"{meta.path}: {meta.arch}.rope.dimension_count={rotary} of {head_dim} is not readable"
            )
        config["partial_rotary_factor"] = factor
    window = meta.get("attention.sliding_window")
    config["sliding_window"] = int(window) if window else None
    original = meta.get("rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = int(original)
    if meta.has_tensor("rope_factors_long.weight") or meta.has_tensor("rope_factors_short.weight"):
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "short_factor": [short_float(f) for f in meta.tensor("rope_factors_short.weight").reshape(-1)],
            "long_factor": [short_float(f) for f in meta.tensor("rope_factors_long.weight").reshape(-1)],
            "original_max_position_embeddings": int(meta.key("rope.scaling.original_context_length")),
        }
        attention_factor = meta.get("rope.scaling.attn_factor")
        if attention_factor is not None:
            scaling["attention_factor"] = short_float(attention_factor)
        config["rope_scaling"] = scaling
    return config


GGUF = GGUFSpec(architectures=("phi3",), layer_names=GGUF_LAYER_NAMES, config=gguf_config)

FAMILY = Family("phi3", (ARCHITECTURE,), read_config, weights, gguf=GGUF, end_of_turn=("<|end|>",))
