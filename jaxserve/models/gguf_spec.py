"""What a family tells the GGUF reader: llama.cpp's names for its architecture, tensors and settings.

llama.cpp's converter (``convert_hf_to_gguf.py``) writes each family under
its own ``general.architecture`` name, with metadata keys prefixed by it
(``qwen3.attention.head_count``) and tensors under its own names
(``blk.3.attn_q_norm.weight``). A family's :class:`GGUFSpec` maps those
back: which architecture names it claims, its per-layer tensor names
(Hugging Face suffix -> GGUF suffix), whether the converter permuted the
Q/K rows for llama.cpp's interleaved rope, whether it shifted the norm
weights (Gemma's +1), and how to write the ``config.json`` the rest of
jaxserve reads from the metadata (:class:`GGUFMetadata` and
:func:`base_config` do the keys every family shares; :func:`bias_keys`,
:func:`expert_keys` and :func:`plain_config` the ones several share, so a
family's ``config`` holds only what is its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

from jaxserve.models.errors import ModelLoadError

#: Llama's per-layer tensors: Hugging Face suffix -> GGUF suffix (``blk.N.`` prefix)
LLAMA_LAYER_NAMES: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}
#: q/k norms (Qwen3, Gemma 3, OLMo 2)
QK_NORM_NAMES: dict[str, str] = {
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
#: the tensors outside the layers
GLOBAL_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


class GGUFMetadata:
    """A file's metadata read for one architecture: ``get``/``key`` take the
    name after the ``{arch}.`` prefix; ``key`` refuses a missing one."""

    def __init__(
        self,
        metadata: Mapping[str, Any],
        tensor_types: Mapping[str, str],
        path: str,
        embed_rows: int | None = None,
        read_tensor: Callable[[str], np.ndarray] | None = None,
    ) -> None:
        self.metadata = metadata
        #: a tensor's values by GGUF name (settings llama.cpp stores as tensors: rope_freqs)
        self.read_tensor = read_tensor
        self.arch = str(metadata.get("general.architecture"))
        self.tensor_types = tensor_types
        self.path = path
        self.embed_rows = embed_rows

    def get(self, name: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{name}", default)

    def key(self, name: str, default: Any = None) -> Any:
        value = self.get(name, default)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata key '{self.arch}.{name}' is missing")
        return value

    def has_tensor(self, name: str) -> bool:
        return name in self.tensor_types

    def tensor(self, name: str) -> np.ndarray:
        if self.read_tensor is None or not self.has_tensor(name):
            raise ModelLoadError(f"{self.path}: tensor {name} is missing")
        return self.read_tensor(name)

    def per_layer(self, name: str, default: Any = None) -> list[Any]:
        """A per-layer setting, stored either as one value or as an array."""
        value = self.key(name, default)
        n = int(self.key("block_count"))
        if isinstance(value, (list, tuple, np.ndarray)):
            values = list(value)
            if len(values) != n:
                raise ModelLoadError(f"{self.path}: '{self.arch}.{name}' has {len(values)} entries for {n} layers")
            return values
        return [value] * n


def short_float(value: Any) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def base_config(meta: GGUFMetadata, architecture: str, *, partial_rotary: bool = False) -> dict[str, Any]:
    """The ``config.json`` keys every family has, from the metadata llama.cpp
    writes for all of them (sizes, heads, norm epsilon, rope base and linear
    scaling, context, vocabulary, tied embeddings, bos/eos).

    A file whose rope turns only part of each head is refused
    (:func:`full_rotary`) unless the family reads ``rope.dimension_count``
    itself (``partial_rotary``: Phi-3)."""
    path = meta.path
    hidden = int(meta.key("embedding_length"))
    heads = int(meta.key("attention.head_count"))
    kv_heads = int(meta.key("attention.head_count_kv", heads))
    head_dim = int(meta.get("attention.key_length") or hidden // heads)
    rope_scaling = None
    scaling_type = meta.get("rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta.key("rope.scaling.factor"))}
    elif scaling_type == "yarn":
        rope_scaling = yarn_scaling(meta)
    elif scaling_type not in ("none", None):
        raise ModelLoadError(f"{path}: unsupported GGUF rope scaling type {scaling_type!r}; supported: linear, yarn")
    if not meta.has_tensor("token_embd.weight"):
        raise ModelLoadError(f"{path}: missing tensor token_embd.weight")
    tokens = meta.metadata.get("tokenizer.ggml.tokens")
    vocab = meta.embed_rows or meta.get("vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ModelLoadError(f"{path}: neither {meta.arch}.vocab_size nor tokenizer.ggml.tokens is present")
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": meta.arch,
        "hidden_size": hidden,
        "intermediate_size": int(meta.key("feed_forward_length")),
        "num_hidden_layers": int(meta.key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": short_float(meta.key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": short_float(meta.key("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(meta.key("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": not meta.has_tensor("output.weight"),
        "torch_dtype": "bfloat16" if meta.tensor_types.get("token_embd.weight") == "BF16" else "float32",
    }
    for field, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = meta.metadata.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[field] = int(value)
    if not partial_rotary:
        full_rotary(meta, head_dim)
    return config


def plain_config(architecture: str) -> Callable[[GGUFMetadata], dict[str, Any]]:
    """A :attr:`GGUFSpec.config` for a family whose files hold nothing
    beyond :func:`base_config`'s keys (Qwen2, Qwen3)."""

    def config(meta: GGUFMetadata) -> dict[str, Any]:
        return base_config(meta, architecture)

    return config


def bias_keys(meta: GGUFMetadata, *, mlp: bool) -> dict[str, bool]:
    """``attention_bias`` (with ``mlp`` also ``mlp_bias``) as the file's
    tensors say: llama.cpp stores no flag, it writes the biases or not, so
    layer 0's ``attn_q.bias`` (``ffn_gate.bias``) stands for every layer."""
    keys = {"attention_bias": meta.has_tensor("blk.0.attn_q.bias")}
    if mlp:
        keys["mlp_bias"] = meta.has_tensor("blk.0.ffn_gate.bias")
    return keys


def expert_keys(meta: GGUFMetadata, *, count_key: str = "num_local_experts") -> dict[str, int]:
    """The expert count (under ``count_key``, the name the family's
    ``config.json`` gives it: Mixtral's and gpt-oss's ``num_local_experts``,
    Qwen3-MoE's ``num_experts``) and the experts per token, which llama.cpp
    writes alike for every mixture-of-experts family."""
    return {
        count_key: int(meta.key("expert_count")),
        "num_experts_per_tok": int(meta.key("expert_used_count")),
    }


def yarn_scaling(meta: GGUFMetadata) -> dict[str, Any]:
    """A ``yarn`` ``rope_scaling`` from the keys the converter writes (the
    betas and the attention factor only when the checkpoint set them; the
    ramp's rounding is not stored: a family whose model does not round sets
    ``truncate`` itself)."""
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": short_float(meta.key("rope.scaling.factor")),
        "original_max_position_embeddings": int(meta.key("rope.scaling.original_context_length")),
    }
    for key, name in (
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        ("yarn_attn_factor", "attention_factor"),
    ):
        value = meta.get(f"rope.scaling.{key}")
        if value is not None:
            scaling[name] = short_float(value)
    return scaling


def full_rotary(meta: GGUFMetadata, head_dim: int) -> None:
    """Refuse a file whose rope covers part of each head (a family that
    supports that reads ``rope.dimension_count`` itself)."""
    rotary = meta.get("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise ModelLoadError(
            f"{meta.path}: {meta.arch}.rope.dimension_count={rotary} differs from the head size {head_dim}; "
            "partial rotary embeddings are not supported for this architecture"
        )


@dataclasses.dataclass(frozen=True)
class JoinedTensor:
    """A Hugging Face tensor the converter wrote as several GGUF tensors
    (gpt-oss's ``gate_up_proj``: gate and up interleaved in one tensor, split
    into ``ffn_gate_exps`` and ``ffn_up_exps``, each transposed): answered
    by swapping each part's last two axes when ``transposed``, then
    interleaving the parts along the last axis (a single part: as it is)."""

    #: the GGUF per-layer suffixes, in interleaving order
    parts: tuple[str, ...]
    transposed: bool = False


@dataclasses.dataclass(frozen=True)
class GGUFSpec:
    """How a family's GGUF files are read (see the module docstring)."""

    #: llama.cpp's ``general.architecture`` names this family reads
    architectures: tuple[str, ...]
    #: Hugging Face per-layer suffix -> GGUF per-layer suffix
    layer_names: Mapping[str, str]
    #: the file's ``config.json`` (the Hugging Face architecture name included)
    config: Callable[[GGUFMetadata], dict[str, Any]]
    #: the converter permuted the Q and K rows (``LlamaModel.permute``)
    permuted_qk: bool = False
    #: the converter stored every norm weight plus this (Gemma: 1.0)
    norm_offset: float = 0.0
    #: per-expert Hugging Face suffix (``{j}`` the expert) -> the stacked GGUF suffix
    expert_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: Hugging Face per-layer suffix -> the GGUF tensors it was split into
    joined_names: Mapping[str, JoinedTensor] = dataclasses.field(default_factory=dict)
    #: of files under a shared architecture name, whether this family's
    #: (Mixtral is ``llama`` with expert tensors); None: every file
    claims: Callable[[Collection[str]], bool] | None = None


__all__ = [
    "GGUFMetadata",
    "GGUFSpec",
    "GLOBAL_NAMES",
    "JoinedTensor",
    "LLAMA_LAYER_NAMES",
    "QK_NORM_NAMES",
    "base_config",
    "bias_keys",
    "expert_keys",
    "full_rotary",
    "plain_config",
    "short_float",
    "yarn_scaling",
]
