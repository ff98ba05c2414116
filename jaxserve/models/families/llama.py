"""Llama 2 / 3 / 3.1 / 3.2 (and SmolLM2, which is a Llama): the layout the other families start from.

Optional attention and MLP biases (``attention_bias``, ``mlp_bias``), rope
``default`` / ``linear`` / ``llama3``, tied or untied embeddings. llama.cpp
writes these as ``llama`` with the Q and K rows permuted for its
interleaved rope (the reader un-permutes them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from jaxserve.models.config import ModelConfig, attention_biases, read_base
from jaxserve.models.family import Family
from jaxserve.models.gguf_spec import LLAMA_LAYER_NAMES, GGUFMetadata, GGUFSpec, base_config, bias_keys

ARCHITECTURE = "LlamaForCausalLM"


def read_config(d: Mapping[str, Any], source: str) -> ModelConfig:
    c = read_base(d, ARCHITECTURE, source, family="llama")
    return dataclasses.replace(c, **attention_biases(d), mlp_bias=bool(d.get("mlp_bias", False)))


def gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    config = base_config(meta, ARCHITECTURE)
    if meta.has_tensor("rope_freqs.weight"):  # Llama 3.1's scaling, as llama.cpp stores it
        config["rope_freq_factors"] = [float(f) for f in meta.tensor("rope_freqs.weight").reshape(-1)]
    config.update(bias_keys(meta, mlp=True))
    return config


def _dense(tensor_names: Collection[str]) -> bool:
    """llama.cpp writes Mixtral as ``llama`` too, with stacked expert tensors."""
    return "blk.0.ffn_gate_inp.weight" not in tensor_names


GGUF = GGUFSpec(
    architectures=("llama",), layer_names=LLAMA_LAYER_NAMES, config=gguf_config, permuted_qk=True, claims=_dense
)

FAMILY = Family("llama", (ARCHITECTURE,), read_config, gguf=GGUF, end_of_turn=("<|eot_id|>", "<|eom_id|>"))
