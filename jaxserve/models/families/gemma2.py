"""Gemma 2: four norms a layer stored as ``w - 1``, GeGLU, a scaled embedding, soft-capped logits, every other layer sliding.

What differs from Llama, as transformers computes it:

- RMSNorm multiplies by ``1 + w`` (``norm_weight_offset``), in float32, and
  a layer has four of them: on the attention's input and output, and on
  the MLP's input and output (``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm``); the residual adds the normed outputs;
- GeGLU with the tanh approximation of GELU (``hidden_activation``);
- the embeddings multiplied by ``sqrt(hidden_size)``, a float32 number
  rounded to the weight dtype before the multiply;
- attention scores scaled by ``query_pre_attn_scalar ** -0.5`` (not
  ``head_dim``'s) and soft-capped (``attn_logit_softcapping``) before the
  causal mask; the final logits soft-capped too
  (``final_logit_softcapping``);
- ``layer_types``: by default layers 0, 2, 4, ... slide over
  ``sliding_window`` tokens, the others attend to their whole context.

A ``config.json`` may leave out any key that has a default in
transformers' ``Gemma2Config`` (the soft-caps, the window, tied
embeddings); :data:`DEFAULTS` holds those defaults, so a key that is
absent reads as transformers reads it, while an explicit ``null`` (no
soft-cap, no window) stays null.

llama.cpp writes ``gemma2`` files: Q/K not permuted, every norm weight
stored plus one (:attr:`GGUFSpec.norm_offset`), the soft-caps and the
window as metadata. It stores no ``query_pre_attn_scalar``: it takes
``head_dim``, or ``hidden_size / num_attention_heads`` for the 46-layer
27B model (whose scalar is that), and so does :func:`gguf_config`; nor a
layer pattern unless the file has ``attention.sliding_window_pattern``
(then every other layer from the first, as llama.cpp assumes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxserve.models.config import (
    NORM_PLACES,
    ModelConfig,
    attention_biases,
    optional_float,
    optional_int,
    read_activation,
    read_base,
    read_layer_types,
)
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.family import Family
from jaxserve.models.gguf_spec import (
    LLAMA_LAYER_NAMES,
    GGUFMetadata,
    GGUFSpec,
    base_config,
    short_float,
)
from jaxserve.models.weights import ModelWeights, Params, llama_layer, top_params, whole

ARCHITECTURE = "Gemma2ForCausalLM"

#: the defaults transformers' ``Gemma2Config`` and ``Gemma3TextConfig`` share
#: (the 2B models' sizes), for keys a ``config.json`` leaves out
GEMMA_DEFAULTS: dict[str, Any] = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}

#: transformers' ``Gemma2Config`` defaults, for keys a ``config.json`` leaves out
DEFAULTS: dict[str, Any] = {
    **GEMMA_DEFAULTS,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}

#: Gemma's per-layer tensors (Gemma 2 and 3): Hugging Face suffix -> GGUF suffix
GEMMA_LAYER_NAMES: dict[str, str] = {
    **LLAMA_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def with_defaults(d: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` over ``defaults``, with the activation under the key
    :func:`read_base` reads (Gemma's configs name it ``hidden_activation``;
    some also carry a ``hidden_act`` that transformers ignores)."""
    merged = {**defaults, **d}
    merged["hidden_activation"] = merged.get("hidden_activation") or defaults["hidden_activation"]
    merged["hidden_act"] = merged["hidden_activation"]
    return merged


def causal_only(d: Mapping[str, Any], source: str) -> None:
    """A Gemma config for bidirectional attention (EmbeddingGemma) is not a causal LM."""
    if d.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention is set; jaxserve serves causal language models")


def gemma_config(d: Mapping[str, Any], architecture: str, source: str, *, family: str) -> ModelConfig:
    """What Gemma 2 and 3 read alike: the Llama fields, the four offset norms,
    the embedding scale, the attention scale, biases, the final soft-cap.
    ``d`` already holds the family's defaults (:func:`with_defaults`)."""
    causal_only(d, source)
    read_activation(d, source, "hidden_activation")  # refused under the name the config uses
    c = read_base(d, architecture, source, family=family)
    scalar = d.get("query_pre_attn_scalar")
    if scalar is None or float(scalar) <= 0:
        raise ModelLoadError(f"{source}: query_pre_attn_scalar must be a positive number, got {scalar!r}")
    return dataclasses.replace(
        c,
        **attention_biases(d),
        norms=NORM_PLACES,
        norm_weight_offset=1.0,
        # transformers keeps sqrt(hidden) as a float32 tensor and casts it to the weight dtype
        embed_scale=float(np.float32(math.sqrt(c.hidden_size))),
        attn_scale=float(scalar) ** -0.5,
        final_logit_softcap=optional_float(d.get("final_logit_softcapping")),
    )


def read_config(d: Mapping[str, Any], source: str) -> ModelConfig:
    d = with_defaults(d, DEFAULTS)
    c = gemma_config(d, ARCHITECTURE, source, family="gemma2")
    n = c.num_hidden_layers
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return dataclasses.replace(
        c,
        sliding_window=optional_int(d.get("sliding_window")),
        layer_types=read_layer_types(d, source, default),
        attn_logit_softcap=optional_float(d.get("attn_logit_softcapping")),
    )


def gemma_layer(c: ModelConfig, i: int, *, prefix: str = "model.layers.{i}.") -> Params:
    """Llama's names plus the post-attention, pre- and post-feedforward norms
    (``post_attention_layernorm`` is the attention's output norm here, not the
    MLP's input norm it is in Llama)."""
    p = llama_layer(c, i, prefix=prefix)
    pre, E = prefix.format(i=i), c.hidden_size
    p["attn_out_norm"] = whole(pre + "post_attention_layernorm.weight", (E,))
    p["ffn_norm"] = whole(pre + "pre_feedforward_layernorm.weight", (E,))
    p["ffn_out_norm"] = whole(pre + "post_feedforward_layernorm.weight", (E,))
    return p


def weights(c: ModelConfig) -> ModelWeights:
    return ModelWeights(top_params(c), [gemma_layer(c, i) for i in range(c.num_hidden_layers)])


def llama_cpp_attention_scalar(config: Mapping[str, Any], large_layers: int) -> int:
    """The ``query_pre_attn_scalar`` llama.cpp assumes for a file that does not
    store one: ``hidden_size / num_attention_heads`` for the 27B models (told
    apart by their layer count, ``large_layers``), ``head_dim`` otherwise."""
    if config["num_hidden_layers"] == large_layers:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return int(config["head_dim"])


def gguf_layer_types(meta: GGUFMetadata, every: int) -> list[str]:
    """Which layers slide in a file, as llama.cpp decides:
    ``attention.sliding_window_pattern`` as one flag per layer, or as a
    period ``n`` (layer ``i`` slides unless ``i % n == n - 1``; 0: all
    slide), or without the key the family's period ``every``."""
    n = int(meta.key("block_count"))
    pattern = meta.get("attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple, np.ndarray)):
        flags = [bool(x) for x in pattern]
        if len(flags) != n:
            raise ModelLoadError(
                f"{meta.path}: '{meta.arch}.attention.sliding_window_pattern' has {len(flags)} entries for {n} layers"
            )
    else:
        period = every if pattern is None else int(pattern)
        flags = [period == 0 or i % period < period - 1 for i in range(n)]
    return ["sliding_attention" if f else "full_attention" for f in flags]


def gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    config = base_config(meta, ARCHITECTURE)
    config.pop("hidden_act")
    local_base = meta.get("rope.freq_base_swa")
    if local_base is not None and short_float(local_base) != config["rope_theta"]:
        raise ModelLoadError(
            f"{meta.path}: gemma2.rope.freq_base_swa={short_float(local_base)} differs from rope.freq_base="
            f"{config['rope_theta']}; a separate rope base for the sliding layers is not supported for Gemma 2"
        )
    config.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=llama_cpp_attention_scalar(config, large_layers=46),
        # llama.cpp's defaults for a file without the keys (Gemma 2's own)
        attn_logit_softcapping=short_float(meta.get("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=short_float(meta.get("final_logit_softcapping", 30.0)),
        sliding_window=int(meta.get("attention.sliding_window", 4096)),
        layer_types=gguf_layer_types(meta, 2),
    )
    return config


GGUF = GGUFSpec(architectures=("gemma2",), layer_names=GEMMA_LAYER_NAMES, config=gguf_config, norm_offset=1.0)

FAMILY = Family(
    "gemma2", (ARCHITECTURE,), read_config, weights, gguf=GGUF, end_of_turn=("<end_of_turn>",), fold_system=True
)
