"""The configuration every model family is read into, and the parsing pieces the families share.

:class:`ModelConfig` is one flat, frozen description of a decoder-only
transformer: the Llama shape (sizes, heads, rope, biases) plus the switches
the other families turn (per-layer sliding windows and rope, Gemma's norms
and soft-capping, q/k norms, attention sinks, mixtures of experts). The
generic decoder (:mod:`jaxserve.models.decoder`) reads only this object, so a
family is a way of *reading* a checkpoint's ``config.json`` (and GGUF
metadata) into it, plus the names of its weights: one module under
:mod:`jaxserve.models.families`, found through :mod:`jaxserve.models.registry`.
Every default is Llama's, so a switch a family does not mention costs
nothing in the decoder.

Both spellings of the rope settings are read (:func:`read_rope`):

- transformers 4.x: top-level ``rope_theta`` and ``rope_scaling`` (a dict with
  ``type`` or ``rope_type``, or null);
- transformers 5.x: ``rope_parameters`` (a dict holding ``rope_theta``,
  ``rope_type`` and the scaling parameters), or one such dict per layer
  type (``{"full_attention": {...}, "sliding_attention": {...}}``).

Sliding windows are per layer (:attr:`ModelConfig.layer_windows`): a
window at least as long as the context changes nothing and is dropped, so
a model whose windows never bind runs plain causal attention.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any, TypedDict

from jaxserve.json_files import read_json_object
from jaxserve.models.errors import ModelLoadError

#: rope types the model implements (:mod:`jaxserve.models.rope`)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")

#: MLP activations (``hidden_act`` / ``hidden_activation``) the decoder implements
SUPPORTED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}

#: the norms a layer may have, by where they sit: ``attn`` on the attention's
#: input, ``attn_out`` on its output (before the residual add), ``ffn`` and
#: ``ffn_out`` the same around the MLP. Llama: ``attn``, ``ffn``; Gemma: all
#: four; OLMo 2: ``attn_out``, ``ffn_out``.
NORM_PLACES = ("attn", "attn_out", "ffn", "ffn_out")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings.

    ``rope_type`` is one of ``default``, ``linear``, ``llama3``, ``yarn``.
    ``factor`` is used by ``linear``, ``llama3`` and ``yarn``; the two
    frequency factors by ``llama3`` only, ``original_max_position_embeddings``
    by ``llama3`` and ``yarn``.
    ``freq_factors``: each frequency divided by its factor after that (a
    GGUF file's ``rope_freqs`` tensor, which is how llama.cpp stores Llama
    3.1's scaling; written to the derived ``config.json`` as
    ``rope_freq_factors``).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None
    #: ``yarn``: the ramp between extrapolated and interpolated frequencies
    #: (``beta_fast`` / ``beta_slow`` rotations), its ends rounded outwards
    #: to whole dimensions when ``truncate``
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    #: cos and sin multiplied by this (``yarn``'s attention factor: it
    #: scales every attention logit by its square)
    attention_factor: float = 1.0
    #: ``longrope`` (Phi-3): each frequency divided by its ``short_factor``
    #: while a sequence stays within ``original_max_position_embeddings``,
    #: by its ``long_factor`` past it (which tokens use which:
    #: :func:`jaxserve.models.rope.long_rope_tokens`); its attention factor
    #: is ``attention_factor``
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: ``num_experts`` SwiGLU-style experts of width
    ``intermediate_size``, ``top_k`` of them per token.

    ``router``: ``softmax_topk`` (softmax over every expert in float32, then
    the top k: Mixtral, Qwen3-MoE) or ``topk_softmax`` (top k of the raw
    logits, then a softmax over those k: gpt-oss). ``normalize_topk``: the k
    weights of ``softmax_topk`` renormalized to sum to 1. ``activation``:
    ``silu`` (``silu(gate) * up``) or ``swiglu_oss`` (gpt-oss: gate clamped
    above at ``swiglu_limit``, up to +-``swiglu_limit``, then ``(up + 1) *
    gate * sigmoid(swiglu_alpha * gate)``). ``layers``: per layer whether it
    is a MoE layer (the others have a dense MLP of the config's
    ``intermediate_size``); empty means every layer."""

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str = "softmax_topk"
    normalize_topk: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    layers: tuple[bool, ...] = ()

    def is_moe_layer(self, i: int) -> bool:
        return not self.layers or self.layers[i]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    #: the window of the sliding layers (every layer when ``layer_types`` is empty)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    #: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU with tanh-approximate GELU)
    hidden_act: str = "silu"

    # -- what other families change (every default is Llama's) --------------
    #: the registry's name for the family that read this config
    family: str = "llama"
    #: per layer ``full_attention`` or ``sliding_attention``; empty: every layer
    #: slides when ``sliding_window`` is set
    layer_types: tuple[str, ...] = ()
    #: the rope of the sliding layers where it differs from ``rope`` (Gemma 3)
    local_rope: RopeConfig | None = None
    #: per layer whether rope applies (SmolLM3's NoPE layers); empty: every layer
    rope_layers: tuple[bool, ...] = ()
    #: rope on the first ``rotary_dim`` features of each head only (Phi-4-mini); None: all
    rotary_dim: int | None = None
    #: which norms a layer has (:data:`NORM_PLACES`)
    norms: tuple[str, ...] = ("attn", "ffn")
    #: RMSNorm as ``x * (norm_weight_offset + w)`` (Gemma stores w - 1: offset 1)
    norm_weight_offset: float = 0.0
    #: RMSNorm of q and k before rope: ``head`` (over each head, weight
    #: ``[head_dim]``: Qwen3, Gemma 3) or ``full`` (over all heads at once,
    #: weights ``[H * head_dim]`` / ``[KVH * head_dim]``: OLMo 2)
    qk_norm: str | None = None
    #: the embeddings multiplied by this (Gemma: sqrt(hidden_size))
    embed_scale: float | None = None
    #: attention scale; None: ``head_dim ** -0.5``
    attn_scale: float | None = None
    #: ``cap * tanh(score / cap)`` on the attention scores (Gemma 2)
    attn_logit_softcap: float | None = None
    #: the same on the final logits (Gemma 2)
    final_logit_softcap: float | None = None
    #: a learned per-head logit joins every attention softmax (gpt-oss)
    attention_sinks: bool = False
    moe: MoEConfig | None = None

    # convenience aliases -------------------------------------------------
    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def model_type(self) -> str:
        return self.family

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None for a layer that attends to its
        whole context (a window at least ``max_position_embeddings`` long
        cannot bind, so it is None as well)."""
        window = self.sliding_window
        if window is None or window >= self.max_position_embeddings:
            return (None,) * self.num_hidden_layers
        if not self.layer_types:
            return (window,) * self.num_hidden_layers
        return tuple(window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def effective_sliding_window(self) -> int | None:
        """The window when every layer slides with it (Mistral v0.1), else None
        (no window, or only some layers sliding: see :attr:`layer_windows`)."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    def layer_rope(self, i: int) -> RopeConfig | None:
        """The rope of layer ``i``; None for a layer without rope."""
        if self.rope_layers and not self.rope_layers[i]:
            return None
        if self.local_rope is not None and self.is_sliding_layer(i):
            return self.local_rope
        return self.rope

    def is_sliding_layer(self, i: int) -> bool:
        """Whether layer ``i`` is a sliding (local) layer by its type, even
        where its window cannot bind (a local layer keeps its own rope)."""
        if self.layer_types:
            return self.layer_types[i] == "sliding_attention"
        return self.sliding_window is not None

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(i)

    # parsing -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Read a Hugging Face ``config.json`` through its family's module."""
        from jaxserve.models.registry import family_of_config

        return family_of_config(d, source).read_config(d, source)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> ModelConfig:
        return cls.from_dict(read_json_config(path), source=os.fspath(path))

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> ModelConfig:
        return cls.from_json_file(os.path.join(os.fspath(folder), "config.json"))


def read_json_config(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` as a dict; a missing or malformed file is a ModelLoadError."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(f"config file not found: {path}")
    return read_json_object(path, ModelLoadError)


# ---------------------------------------------------------------- shared parsing


def required(d: Mapping[str, Any], key: str, source: str) -> Any:
    if d.get(key) is None:
        raise ModelLoadError(f"{source}: required key {key!r} is missing")
    return d[key]


def optional_int(value: Any) -> int | None:
    """A setting that may be null (a sliding window): ``None`` stays ``None``."""
    return None if value is None else int(value)


def optional_float(value: Any) -> float | None:
    """A setting that may be null (a soft-cap): ``None`` stays ``None``."""
    return None if value is None else float(value)


class AttentionBiases(TypedDict):
    """:class:`ModelConfig`'s attention bias fields, to unpack into ``dataclasses.replace``."""

    qkv_bias: bool
    o_bias: bool


def attention_biases(d: Mapping[str, Any], default: bool = False) -> AttentionBiases:
    """``qkv_bias`` and ``o_bias`` from ``attention_bias``, which switches
    the q, k, v and o biases together in every family that has the key
    (transformers' default is ``False``, gpt-oss's ``True``). The families
    pass it to ``dataclasses.replace``; :func:`read_base` leaves it out
    because the families without the key (Mistral, Phi-3) ignore it and
    Qwen2 has q/k/v biases only."""
    bias = bool(d.get("attention_bias", default))
    return AttentionBiases(qkv_bias=bias, o_bias=bias)


def read_base(d: Mapping[str, Any], architecture: str, source: str, *, family: str) -> ModelConfig:
    """The Llama-shaped fields every family has (sizes, heads, rope, eos,
    dtype, ``hidden_act``), no biases and no window: the family module sets
    what it changes with ``dataclasses.replace``."""
    hidden = int(required(d, "hidden_size", source))
    heads = int(required(d, "num_attention_heads", source))
    kv_heads = d.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else int(kv_heads)
    head_dim = d.get("head_dim")
    head_dim = hidden // heads if head_dim is None else int(head_dim)
    if heads % kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    return ModelConfig(
        architecture=architecture,
        family=family,
        vocab_size=int(required(d, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(required(d, "intermediate_size", source)),
        num_hidden_layers=int(required(d, "num_hidden_layers", source)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope=read_rope(d, source),
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=_bos(d),
        eos_token_ids=_eos(d),
        torch_dtype=_dtype(d),
        hidden_act=read_activation(d, source),
    )


def read_activation(d: Mapping[str, Any], source: str, key: str = "hidden_act") -> str:
    act = d.get(key) or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(
            f"{source}: {key} {act!r} is not supported; supported: {', '.join(sorted(SUPPORTED_ACTIVATIONS))}"
        )
    return SUPPORTED_ACTIVATIONS[act]


def _eos(d: Mapping[str, Any]) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, (list, tuple)):
        return tuple(int(e) for e in eos)
    return (int(eos),)


def _bos(d: Mapping[str, Any]) -> int | None:
    bos = d.get("bos_token_id")
    if isinstance(bos, (list, tuple)):
        bos = bos[0] if bos else None
    return None if bos is None else int(bos)


def _dtype(d: Mapping[str, Any]) -> str | None:
    dtype = d.get("torch_dtype", d.get("dtype"))
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "")
    return _DTYPE_NAMES.get(name, name)


def rope_parameters(d: Mapping[str, Any], layer_type: str = "full_attention") -> tuple[Mapping[str, Any], Any]:
    """The rope scaling dict and theta of one layer type, from either spelling
    (see the module docstring)."""
    params = d.get("rope_parameters")
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        params = params.get(layer_type) or params.get("full_attention") or next(iter(params.values()))
    if isinstance(params, Mapping):
        return params, params.get("rope_theta", d.get("rope_theta", 10000.0))
    return d.get("rope_scaling") or {}, d.get("rope_theta", 10000.0)


def read_rope(
    d: Mapping[str, Any], source: str, layer_type: str = "full_attention", theta: float | None = None
) -> RopeConfig:
    """The :class:`RopeConfig` of one layer type; ``theta`` overrides the
    config's base (a family that keeps a second base under its own key)."""
    scaling, config_theta = rope_parameters(d, layer_type)
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    kw: dict[str, Any] = {"rope_type": rope_type, "theta": float(config_theta if theta is None else theta)}
    if rope_type in ("linear", "llama3"):
        if scaling.get("factor") is None:
            raise ModelLoadError(f"{source}: rope type {rope_type!r} needs a 'factor'")
        kw["factor"] = float(scaling["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if scaling.get(key) is None:
                raise ModelLoadError(f"{source}: rope type 'llama3' needs {key!r}")
        kw["low_freq_factor"] = float(scaling["low_freq_factor"])
        kw["high_freq_factor"] = float(scaling["high_freq_factor"])
        kw["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    if rope_type == "yarn":
        kw.update(_yarn(d, scaling, source))
    if rope_type == "longrope":
        kw.update(_longrope(d, scaling, source))
    if d.get("rope_freq_factors") is not None:
        kw["freq_factors"] = tuple(float(f) for f in d["rope_freq_factors"])
    return RopeConfig(**kw)


def _yarn(d: Mapping[str, Any], scaling: Mapping[str, Any], source: str) -> dict[str, Any]:
    """YaRN's settings as transformers reads them: ``factor`` defaults to
    ``max_position_embeddings / original_max_position_embeddings``, the
    attention factor to ``0.1 * ln(factor) + 1`` (or the ratio of two such
    terms with ``mscale`` / ``mscale_all_dim``), betas to 32 and 1;
    ``truncate`` sits beside the per-layer-type dicts when there are some."""
    original = scaling.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    if original is None:
        raise ModelLoadError(f"{source}: rope type 'yarn' needs 'original_max_position_embeddings'")
    factor = scaling.get("factor")
    if factor is None:
        factor = float(required(d, "max_position_embeddings", source)) / float(original)
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    params = d.get("rope_parameters")
    truncate = params.get("truncate") if isinstance(params, Mapping) else None
    if truncate is None:
        truncate = scaling.get("truncate", True)
    return {
        "factor": factor,
        "original_max_position_embeddings": int(original),
        "beta_fast": float(scaling.get("beta_fast") or 32.0),
        "beta_slow": float(scaling.get("beta_slow") or 1.0),
        "truncate": bool(truncate),
        "attention_factor": float(attention_factor),
    }


def _longrope(d: Mapping[str, Any], scaling: Mapping[str, Any], source: str) -> dict[str, Any]:
    """LongRoPE's settings as transformers reads them: both factor lists
    (one per rotated frequency), the original context (the scaling's own,
    else the config's top-level key, else ``max_position_embeddings``), and
    the attention factor: the scaling's ``attention_factor``, else
    ``sqrt(1 + ln(s) / ln(original))`` for the scale ``s`` (the scaling's
    ``factor``, else ``max_position_embeddings / original``), 1 when ``s``
    is at most 1. Phi-3 passes its top-level original context in the
    scaling (transformers gives that one priority for Phi-3)."""
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if not isinstance(values, (list, tuple)) or not values:
            raise ModelLoadError(f"{source}: rope type 'longrope' needs a list {key!r}")
        factors[key] = tuple(float(v) for v in values)
    if len(factors["short_factor"]) != len(factors["long_factor"]):
        raise ModelLoadError(f"{source}: rope 'short_factor' and 'long_factor' differ in length")
    max_positions = int(required(d, "max_position_embeddings", source))
    original = scaling.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    original = max_positions if original is None else int(original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        scale = scaling.get("factor")
        scale = max_positions / original if scale is None else float(scale)
        attention_factor = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
    return {
        **factors,
        "original_max_position_embeddings": original,
        "attention_factor": float(attention_factor),
    }


def read_layer_types(d: Mapping[str, Any], source: str, default: list[str] | None = None) -> tuple[str, ...]:
    """``layer_types`` (one ``full_attention``/``sliding_attention`` per layer),
    or ``default`` when the config has none; checked for length and values."""
    n = int(required(d, "num_hidden_layers", source))
    types = d.get("layer_types") or default or []
    if not types:
        return ()
    if len(types) != n or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ModelLoadError(
            f"{source}: layer_types must list 'full_attention' or 'sliding_attention' for each of the {n} layers, "
            f"got {types!r}"
        )
    return tuple(types)


__all__ = [
    "AttentionBiases",
    "MoEConfig",
    "ModelConfig",
    "NORM_PLACES",
    "RopeConfig",
    "SUPPORTED_ACTIVATIONS",
    "SUPPORTED_ROPE_TYPES",
    "attention_biases",
    "optional_float",
    "optional_int",
    "read_activation",
    "read_base",
    "read_json_config",
    "read_layer_types",
    "read_rope",
    "required",
    "rope_parameters",
]
