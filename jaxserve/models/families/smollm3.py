"""SmolLM3: Llama with some layers that have no rope at all (NoPE), and optional sliding windows.

``no_rope_layers`` holds a 0/1 per layer (1: rope); without it every
``no_rope_layer_interval``-th layer (4: layers 3, 7, 11, ...) has none.
On those layers q and k reach attention as projected: rope is skipped,
not applied with an identity rotation, so nothing of position enters
their scores (:attr:`ModelConfig.rope_layers`). ``use_sliding_window``
with a ``sliding_window`` makes the layers that ``layer_types`` names
slide; without ``layer_types`` those are the NoPE layers, as transformers
defaults them. Tied embeddings and rope base 2e6 unless the config says
otherwise.

llama.cpp writes ``smollm3`` files with Llama's tensor names and the Q/K
rows permuted (its converter is Llama's). The files hold no NoPE pattern:
llama.cpp fixes it at every fourth layer, so jaxserve reads a file that
way too (a checkpoint with another pattern cannot be told apart once
converted). A turn ends with ``<|im_end|>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxserve.models.config import ModelConfig, attention_biases, optional_int, read_base, read_layer_types, read_rope
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.family import Family
from jaxserve.models.gguf_spec import LLAMA_LAYER_NAMES, GGUFMetadata, GGUFSpec, base_config, bias_keys

ARCHITECTURE = "SmolLM3ForCausalLM"
#: SmolLM3Config's defaults for the keys a config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": True}
DEFAULT_THETA = 2000000.0
#: llama.cpp's fixed NoPE interval for ``smollm3`` files
GGUF_NO_ROPE_INTERVAL = 4


def rope_flags(d: Mapping[str, Any], n: int, source: str) -> tuple[bool, ...]:
    """Per layer whether it has rope (``no_rope_layers``, or the interval's default)."""
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = int(d.get("no_rope_layer_interval") or 4)
        return tuple((i + 1) % interval != 0 for i in range(n))
    if not isinstance(flags, (list, tuple)) or len(flags) < n or any(f not in (0, 1) for f in flags):
        raise ModelLoadError(f"{source}: no_rope_layers must hold a 0 or 1 for each of the {n} layers, got {flags!r}")
    return tuple(bool(f) for f in flags[:n])


def read_config(d: Mapping[str, Any], source: str) -> ModelConfig:
    d = {**DEFAULTS, **d}
    c = read_base(d, ARCHITECTURE, source, family="smollm3")
    params = d.get("rope_parameters")
    has_theta = "rope_theta" in d or (isinstance(params, Mapping) and "rope_theta" in params)
    if not has_theta:
        c = dataclasses.replace(c, rope=read_rope(d, source, theta=DEFAULT_THETA))
    n = c.num_hidden_layers
    rope = rope_flags(d, n, source)
    window = d.get("sliding_window")
    layer_types: tuple[str, ...] = ()
    if window is None or not d.get("use_sliding_window", False):
        window = None
    else:
        default = ["full_attention" if r else "sliding_attention" for r in rope]
        layer_types = read_layer_types(d, source, default)
    return dataclasses.replace(
        c,
        **attention_biases(d),
        mlp_bias=bool(d.get("mlp_bias", False)),
        rope_layers=() if all(rope) else rope,
        sliding_window=optional_int(window),
        layer_types=layer_types,
    )


def gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    config = base_config(meta, ARCHITECTURE)
    config["no_rope_layer_interval"] = GGUF_NO_ROPE_INTERVAL
    config.update(bias_keys(meta, mlp=True))
    return config


GGUF = GGUFSpec(architectures=("smollm3",), layer_names=LLAMA_LAYER_NAMES, config=gguf_config, permuted_qk=True)

FAMILY = Family("smollm3", (ARCHITECTURE,), read_config, gguf=GGUF, end_of_turn=("<|im_end|>",))
