"""Model configuration for the Llama family, parsed from a Hugging Face ``config.json``.

Supported architectures: ``LlamaForCausalLM`` (Llama 2 and Llama 3/3.1/3.2 with
``llama3`` rope scaling), ``MistralForCausalLM`` and ``Qwen2ForCausalLM``.

Both spellings of the rope settings are read:

- transformers 4.x: top-level ``rope_theta`` and ``rope_scaling`` (a dict with
  ``type`` or ``rope_type``, or null);
- transformers 5.x: ``rope_parameters`` (a dict holding ``rope_theta``,
  ``rope_type`` and the scaling parameters).

Sliding windows (Mistral v0.1, Qwen2 with ``use_sliding_window``) are
recorded in ``sliding_window``; the attention masks keys older than the
window, so a window at least as long as the context changes nothing. Qwen2's
mixed layout (only some layers sliding) is refused with a ``ModelLoadError``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from jaxserve.models.errors import ModelLoadError

#: architecture name -> model_type (used when ``architectures`` is absent)
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}

#: rope types the model implements
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

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


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings.

    ``rope_type`` is one of ``default``, ``linear``, ``llama3``. ``factor`` is
    used by ``linear`` and ``llama3``; the other three fields by ``llama3`` only.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    hidden_act: str = "silu"

    # convenience aliases -------------------------------------------------
    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def effective_sliding_window(self) -> int | None:
        """The window the attention must apply, or None when it cannot matter
        (no window, or a window at least ``max_position_embeddings`` long)."""
        if self.sliding_window is None or self.sliding_window >= self.max_position_embeddings:
            return None
        return self.sliding_window

    # parsing -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
        arch = _architecture(d, source)
        model_type = SUPPORTED_ARCHITECTURES[arch]

        def req(key: str) -> Any:
            if d.get(key) is None:
                raise ModelLoadError(f"{source}: required key {key!r} is missing")
            return d[key]

        hidden = int(req("hidden_size"))
        heads = int(req("num_attention_heads"))
        kv_heads = d.get("num_key_value_heads")
        kv_heads = heads if kv_heads is None else int(kv_heads)
        head_dim = d.get("head_dim")
        head_dim = hidden // heads if head_dim is None else int(head_dim)
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")

        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        elif model_type == "llama":
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
            mlp_bias = bool(d.get("mlp_bias", False))
        else:  # mistral has no biases
            qkv_bias = o_bias = mlp_bias = False

        max_pos = int(d.get("max_position_embeddings", 2048))
        window = _sliding_window(d, model_type, source)

        eos = d.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, (list, tuple)):
            eos_ids = tuple(int(e) for e in eos)
        else:
            eos_ids = (int(eos),)
        bos = d.get("bos_token_id")
        if isinstance(bos, (list, tuple)):
            bos = bos[0] if bos else None

        dtype = d.get("torch_dtype", d.get("dtype"))
        if dtype is not None:
            dtype = _DTYPE_NAMES.get(str(dtype).replace("torch.", ""), str(dtype).replace("torch.", ""))

        return cls(
            architecture=arch,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_hidden_layers=int(req("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=_rope(d, source),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_window=window,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            torch_dtype=dtype,
            hidden_act="silu",
        )

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> ModelConfig:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ModelLoadError(f"config file not found: {path}")
        try:
            with open(path, "rb") as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from e
        if not isinstance(d, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return cls.from_dict(d, source=path)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> ModelConfig:
        return cls.from_json_file(os.path.join(os.fspath(folder), "config.json"))


def _architecture(d: Mapping[str, Any], source: str) -> str:
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    archs = d.get("architectures")
    if archs:
        if isinstance(archs, str):
            archs = [archs]
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                return a
        raise ModelLoadError(f"{source}: unsupported architecture {', '.join(map(str, archs))}; supported: {supported}")
    mt = d.get("model_type")
    if mt in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[mt]
    raise ModelLoadError(
        f"{source}: unsupported architecture (no 'architectures', model_type {mt!r}); supported: {supported}"
    )


def _rope(d: Mapping[str, Any], source: str) -> RopeConfig:
    params = d.get("rope_parameters")
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        # per-layer-type form ({"full_attention": {...}}): the Llama family has one type
        params = params.get("full_attention") or next(iter(params.values()))
    if isinstance(params, Mapping):
        scaling: Mapping[str, Any] = params
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    else:
        scaling = d.get("rope_scaling") or {}
        theta = d.get("rope_theta", 10000.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    kw: dict[str, Any] = {"rope_type": rope_type, "theta": float(theta)}
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
    return RopeConfig(**kw)


def _sliding_window(d: Mapping[str, Any], model_type: str, source: str) -> int | None:
    window = d.get("sliding_window")
    if window is None:
        return None
    window = int(window)
    if model_type == "mistral":
        return window
    if model_type == "qwen2":
        if not d.get("use_sliding_window", False):
            return None
        layer_types = d.get("layer_types")
        n = int(d.get("num_hidden_layers", 0))
        if layer_types is None:
            mwl = int(d.get("max_window_layers", n))
            layer_types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]
        kinds = set(layer_types)
        if kinds == {"sliding_attention"}:
            return window
        if kinds <= {"full_attention"}:
            return None
        if window >= int(d.get("max_position_embeddings", 2048)):
            return None
        raise ModelLoadError(
            f"{source}: sliding_window={window} on only some layers (layer_types/max_window_layers) is not supported"
        )
    # Llama has no sliding window
    return None
