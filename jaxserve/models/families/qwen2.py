"""Qwen2 / Qwen2.5: Llama with q/k/v biases; optional sliding windows on the layers ``layer_types`` names.

``use_sliding_window`` switches the window on; ``layer_types`` (or, in older
configs, ``max_window_layers``: layers from that index on slide) says which
layers slide, so a mixed model runs each layer as configured. llama.cpp
writes ``qwen2`` files without permuting Q/K.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxserve.models.config import ModelConfig, read_base, read_layer_types
from jaxserve.models.family import Family
from jaxserve.models.gguf_spec import LLAMA_LAYER_NAMES, GGUFSpec, plain_config

ARCHITECTURE = "Qwen2ForCausalLM"


def sliding_layers(d: Mapping[str, Any], source: str) -> tuple[int | None, tuple[str, ...]]:
    """``(window, layer_types)`` of a Qwen config: no window unless
    ``use_sliding_window``; layers from ``max_window_layers`` on slide when
    the config lists no ``layer_types``."""
    window = d.get("sliding_window")
    if window is None or not d.get("use_sliding_window", False):
        return None, ()
    n = int(d.get("num_hidden_layers", 0))
    first = int(d.get("max_window_layers", n))
    default = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return int(window), read_layer_types(d, source, default)


def read_config(d: Mapping[str, Any], source: str) -> ModelConfig:
    c = read_base(d, ARCHITECTURE, source, family="qwen2")
    window, layer_types = sliding_layers(d, source)
    return dataclasses.replace(c, qkv_bias=True, sliding_window=window, layer_types=layer_types)


GGUF = GGUFSpec(architectures=("qwen2",), layer_names=LLAMA_LAYER_NAMES, config=plain_config(ARCHITECTURE))

FAMILY = Family("qwen2", (ARCHITECTURE,), read_config, gguf=GGUF, end_of_turn=("<|im_end|>",))
