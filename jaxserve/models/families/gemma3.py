"""Gemma 3 (text): Gemma 2 with q/k norms, two rope bases, one global layer in six and no attention soft-capping.

What changes from :mod:`jaxserve.models.families.gemma2`, as transformers
computes it:

- ``q_norm`` / ``k_norm``: Gemma's RMSNorm (``1 + w``) over each head of q
  and k, before rope;
- the sliding ("local") layers rotate with their own rope: base
  ``rope_local_base_freq`` (10000), never scaled; the global layers with
  ``rope_theta`` (1e6) and the config's rope scaling (``linear`` x8 on the
  4B-27B models). transformers 5 writes both as ``rope_parameters`` per
  layer type; 4.x configs as ``rope_theta``, ``rope_local_base_freq`` and
  ``rope_scaling``; both are read;
- ``layer_types`` by default: every ``sliding_window_pattern``-th layer
  (6) global, the others sliding;
- no attention soft-capping: transformers' Gemma 3 attention never applies
  ``attn_logit_softcapping`` (and llama.cpp's converter refuses a config
  that sets it), so jaxserve ignores the key too; the final soft-cap
  applies when set (null by default).

The multimodal checkpoints (``Gemma3ForConditionalGeneration``: 4B, 12B,
27B) are served as text models: their ``text_config`` is read (what it
leaves out takes ``Gemma3TextConfig``'s defaults, as transformers does;
eos, dtype and tied embeddings may sit at the top level) and only the
language model's tensors are loaded, under the names transformers 5
saves (``model.language_model.*``) or the older layout the released files
use (``language_model.model.*``: :attr:`Family.checkpoint_prefixes`); the
vision tower is never read, and images are not accepted.

llama.cpp writes ``gemma3`` files (the multimodal models too, without the
vision tower): Q/K not permuted, every norm weight plus one, q/k norms as
``attn_q_norm`` / ``attn_k_norm``, the local base as ``rope.freq_base_swa``
(10000 when absent), no layer pattern unless the file stores one (llama.cpp
then assumes one global layer in six), no sliding at all without
``attention.sliding_window``, and no ``query_pre_attn_scalar`` (``head_dim``,
or ``hidden / heads`` for the 62-layer 27B model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxserve.models.config import ModelConfig, RopeConfig, optional_int, read_layer_types, read_rope
from jaxserve.models.families.gemma2 import (
    GEMMA_DEFAULTS,
    GEMMA_LAYER_NAMES,
    gemma_config,
    gemma_layer,
    gguf_layer_types,
    llama_cpp_attention_scalar,
    with_defaults,
)
from jaxserve.models.family import Family
from jaxserve.models.gguf_spec import QK_NORM_NAMES, GGUFMetadata, GGUFSpec, base_config, short_float
from jaxserve.models.weights import ModelWeights, qk_norms, top_params

ARCHITECTURE = "Gemma3ForCausalLM"
#: the multimodal checkpoints, served by their language model
MULTIMODAL_ARCHITECTURE = "Gemma3ForConditionalGeneration"
#: where the multimodal checkpoints keep the language model (transformers 5's layout)
MULTIMODAL_PREFIX = "model.language_model."

#: transformers' ``Gemma3TextConfig`` defaults, for keys a ``config.json`` leaves out
DEFAULTS: dict[str, Any] = {
    **GEMMA_DEFAULTS,
    "vocab_size": 262208,
    "max_position_embeddings": 131072,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10000.0,
}

#: keys of a multimodal config's top level that hold for its language model
_TOP_LEVEL_KEYS = ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "tie_word_embeddings")


def text_config(d: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """``(the language model's config, the architecture it is served as)``:
    a multimodal config's ``text_config`` (with the top-level keys that
    apply to it), else ``d`` itself."""
    archs = d.get("architectures") or []
    if MULTIMODAL_ARCHITECTURE not in archs and "text_config" not in d:
        return d, ARCHITECTURE
    text = dict(d.get("text_config") or {})
    for key in _TOP_LEVEL_KEYS:
        if key not in text and d.get(key) is not None:
            text[key] = d[key]
    return text, MULTIMODAL_ARCHITECTURE


def local_rope(d: Mapping[str, Any], source: str) -> RopeConfig:
    """The sliding layers' rope: ``rope_parameters["sliding_attention"]``
    (transformers 5; its base defaults to ``rope_local_base_freq``), else
    plain rope at ``rope_local_base_freq``."""
    params = d.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, Mapping) else None
    if isinstance(local, Mapping):
        theta = local.get("rope_theta", d["rope_local_base_freq"])
        return read_rope(d, source, layer_type="sliding_attention", theta=float(theta))
    return RopeConfig(theta=float(d["rope_local_base_freq"]))


def read_config(d: Mapping[str, Any], source: str) -> ModelConfig:
    text, architecture = text_config(d)
    text = with_defaults(text, DEFAULTS)
    c = gemma_config(text, architecture, source, family="gemma3")
    n, period = c.num_hidden_layers, int(text["sliding_window_pattern"])
    default = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]
    return dataclasses.replace(
        c,
        qk_norm="head",
        sliding_window=optional_int(text.get("sliding_window")),
        layer_types=read_layer_types(text, source, default),
        rope=read_rope(text, source, layer_type="full_attention"),
        local_rope=local_rope(text, source),
    )


def weights(c: ModelConfig) -> ModelWeights:
    prefix = MULTIMODAL_PREFIX if c.architecture == MULTIMODAL_ARCHITECTURE else "model."
    layers = []
    for i in range(c.num_hidden_layers):
        p = gemma_layer(c, i, prefix=prefix + "layers.{i}.")
        p.update(qk_norms(c, f"{prefix}layers.{i}.self_attn."))
        layers.append(p)
    return ModelWeights(top_params(c, embed=prefix + "embed_tokens.weight", norm=prefix + "norm.weight"), layers)


def gguf_config(meta: GGUFMetadata) -> dict[str, Any]:
    config = base_config(meta, ARCHITECTURE)
    config.pop("hidden_act")
    n = config["num_hidden_layers"]
    window = meta.get("attention.sliding_window")
    if window is None or int(window) == 0:  # llama.cpp: no sliding layer at all
        window, layer_types = None, ["full_attention"] * n
    else:
        window, layer_types = int(window), gguf_layer_types(meta, 6)
    global_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    global_rope.update(config.pop("rope_scaling") or {})
    final_cap = meta.get("final_logit_softcapping")
    config.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=llama_cpp_attention_scalar(config, large_layers=62),
        final_logit_softcapping=short_float(final_cap) if final_cap else None,
        sliding_window=window,
        layer_types=layer_types,
        rope_parameters={
            "full_attention": global_rope,
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": short_float(meta.get("rope.freq_base_swa", 10000.0)),
            },
        },
    )
    return config


GGUF = GGUFSpec(
    architectures=("gemma3",), layer_names={**GEMMA_LAYER_NAMES, **QK_NORM_NAMES}, config=gguf_config, norm_offset=1.0
)

FAMILY = Family(
    "gemma3",
    (ARCHITECTURE, MULTIMODAL_ARCHITECTURE),
    read_config,
    weights,
    gguf=GGUF,
    model_types=("gemma3_text", "gemma3"),
    end_of_turn=("<end_of_turn>",),
    fold_system=True,
    checkpoint_prefixes=((MULTIMODAL_PREFIX, "language_model.model."), ("lm_head.", "language_model.lm_head.")),
)
