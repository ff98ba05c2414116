"""Load a Hugging Face checkpoint folder of any registered family into the decoder.

Reads ``config.json`` and either ``model.safetensors``, a sharded
``model.safetensors.index.json``, or (a folder without safetensors) the one
``*.gguf`` file it holds, read through
:class:`jaxserve.models.gguf_file.GGUFCheckpoint` under the same Hugging Face
tensor names (``jaxserve.presets.resolve_model`` makes such a folder for a
``.gguf`` path). The family (:mod:`jaxserve.models.registry`) says which
checkpoint tensors make each parameter of :class:`CausalLM`
(:mod:`jaxserve.models.weights`: Linear weights kept ``[out, in]`` as HF
stores them; q/k/v fused into ``wqkv``, gate/up into ``w_gate_up``). The
model is built abstractly (``nnx.eval_shape``, no random init) and filled
one parameter at a time on the host, so peak host memory is about one
fused parameter on top of the open files. Every parameter's value is made
by :func:`param_value` from its source tensors (one place to change how a
parameter is built, e.g. to keep quantized blocks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.json_files import read_json_object
from jaxserve.models import quant
from jaxserve.models.config import ModelConfig
from jaxserve.models.decoder import CausalLM, DecoderLayer
from jaxserve.models.errors import ModelLoadError
from jaxserve.models.registry import family
from jaxserve.models.weights import Part

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    folder: str

    @property
    def dtype(self) -> jnp.dtype:
        return self.model.dtype


def _resolve_dtype(dtype: Any) -> jnp.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = {"fp32": "float32", "float": "float32", "bf16": "bfloat16"}.get(dtype.lower(), dtype.lower())
        if name not in ("float32", "bfloat16"):
            raise ModelLoadError(f"unsupported model dtype {dtype!r}; use float32 or bfloat16")
        return jnp.dtype(name)
    d = jnp.dtype(dtype)
    if d not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ModelLoadError(f"unsupported model dtype {d}; use float32 or bfloat16")
    return d


class _TensorSource:
    """Name -> tensor (host numpy, ml_dtypes bfloat16 kept) over one or more safetensors files."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        single = os.path.join(folder, SINGLE_FILE)
        index = os.path.join(folder, INDEX_FILE)
        if os.path.isfile(index):
            weight_map = read_json_object(index, ModelLoadError).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index} must hold a weight_map object, got {type(weight_map).__name__}")
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            files = [SINGLE_FILE]
            weight_map = None
        else:
            raise ModelLoadError(
                f"no weights in {folder}: expected {SINGLE_FILE}, {INDEX_FILE} (sharded safetensors) or one .gguf file"
            )
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        # framework="flax" decodes every dtype (numpy cannot decode bfloat16); keep tensors on the host CPU
        self._cpu = jax.devices("cpu")[0]
        for fname in files:
            path = os.path.join(folder, fname)
            if not os.path.isfile(path):
                raise ModelLoadError(f"weights file {fname} listed in {INDEX_FILE} is missing from {folder}")
            try:
                h = self._stack.enter_context(safe_open(path, framework="flax"))
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"cannot open weights file {path}: {e}") from e
            self._handles[fname] = h
            for k in h.keys():
                self._where[k] = fname
        if weight_map is not None:
            for k in weight_map:
                if k not in self._where:
                    raise ModelLoadError(f"tensor {k} listed in {INDEX_FILE} is not in {weight_map[k]}")

    def close(self) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        return self._handles[self._where[name]].get_slice(name).get_dtype()

    def get(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._where:
            raise ModelLoadError(f"missing tensor {name} in checkpoint")
        found = self.shape(name)
        if found != tuple(expected_shape):
            raise ModelLoadError(f"tensor {name} has shape {list(found)}, expected {list(expected_shape)}")
        with jax.default_device(self._cpu):
            arr = self._handles[self._where[name]].get_tensor(name)
        return np.asarray(arr)


def open_tensor_source(folder: str) -> Any:
    """The folder's safetensors, else its one ``*.gguf`` file (a
    :class:`GGUFCheckpoint`, which answers the same calls)."""
    if not os.path.isfile(os.path.join(folder, SINGLE_FILE)) and not os.path.isfile(os.path.join(folder, INDEX_FILE)):
        from pathlib import Path

        from jaxserve.models.gguf_file import GGUFCheckpoint
        from jaxserve.models.gguf_folder import single_gguf_in

        gguf_path = single_gguf_in(Path(folder))
        if gguf_path is not None:
            return GGUFCheckpoint(gguf_path)
    return _TensorSource(folder)


class PrefixedSource:
    """A tensor source that also answers a name under a checkpoint's older
    prefix (:attr:`jaxserve.models.family.Family.checkpoint_prefixes`): a
    name the checkpoint lacks is looked up with each matching prefix
    swapped for its alternative."""

    def __init__(self, src: Any, prefixes: tuple[tuple[str, str], ...]) -> None:
        self._src = src
        self._prefixes = prefixes
        if hasattr(src, "raw_blocks"):  # a GGUF file's stored blocks, for the quantized loading
            self.raw_blocks = lambda name: src.raw_blocks(self._name(name))

    def _name(self, name: str) -> str:
        if name in self._src:
            return name
        for prefix, older in self._prefixes:
            if name.startswith(prefix) and older + name[len(prefix) :] in self._src:
                return older + name[len(prefix) :]
        return name

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self._src

    def shape(self, name: str) -> tuple[int, ...]:
        return self._src.shape(self._name(name))

    def dtype_name(self, name: str) -> str:
        return self._src.dtype_name(self._name(name))

    def get(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        return self._src.get(self._name(name), expected_shape)

    def close(self) -> None:
        self._src.close()


def _checkpoint_dtype(src: Any, name: str) -> jnp.dtype:
    d = src.dtype_name(name).upper()
    if d == "BF16":
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float32)


def load_model(folder: str | os.PathLike, dtype: Any = None, quantization: str | None = None) -> LoadedModel:
    """Load ``folder`` (config.json + safetensors, or one .gguf). ``dtype``
    None keeps the checkpoint's float32/bfloat16 (anything else becomes
    float32; float32 with ``quantization``). ``quantization``
    (``int8``/``int4``): every matrix quantized as it is read
    (``jaxserve.models.quant.load_param``)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise ModelLoadError(f"model folder not found: {folder}")
    config = ModelConfig.from_folder(folder)
    want = _resolve_dtype(dtype)
    src = open_tensor_source(folder)
    prefixes = family(config.family).checkpoint_prefixes
    if prefixes:
        src = PrefixedSource(src, prefixes)
    try:
        embed_name = family(config.family).weights(config).top["embed"][0].name
        if embed_name not in src:
            raise ModelLoadError(f"missing tensor {embed_name} in checkpoint")
        if want is None:
            want = jnp.dtype(jnp.float32) if quantization else _checkpoint_dtype(src, embed_name)
        np_dtype = np.dtype(want)  # ml_dtypes bfloat16 or float32
        model = nnx.eval_shape(lambda: CausalLM(config, dtype=want, rngs=nnx.Rngs(0)))
        _fill(
            model,
            config,
            src,
            np_dtype,
            quant.QUANTIZATIONS[quant.check_quantization(quantization)] if quantization else None,
        )
    finally:
        src.close()
    return LoadedModel(config=config, model=model, folder=folder)


def _read(src: Any, part: Part) -> np.ndarray:
    arr = src.get(part.name, part.shape)
    return arr if part.transform is None else part.transform(arr)


def param_value(src: Any, shape: tuple[int, ...], parts: list[Part], np_dtype: np.dtype) -> np.ndarray:
    """The host value of one parameter of ``shape`` from its parts (each
    fills ``part.where`` of it: q/k/v rows of ``wqkv``, one expert of a
    stack)."""
    if len(parts) == 1 and parts[0].where == slice(None):
        return _read(src, parts[0]).astype(np_dtype, copy=False).reshape(shape)
    out = np.empty(shape, np_dtype)
    for part in parts:
        out[part.where] = _read(src, part).astype(np_dtype, copy=False)
    return out


def _fill(model: CausalLM, c: ModelConfig, src: Any, np_dtype: np.dtype, qkind: str | None = None) -> None:
    """Every parameter from the parts its family names for it."""
    plan = family(c.family).weights(c)

    def put(where: str, param: nnx.Param | None, parts: list[Part] | None) -> None:
        if param is None or parts is None:
            if param is not None or parts:
                raise ModelLoadError(f"family {c.family!r}: the model's {where} and its checkpoint parts disagree")
            return
        shape = tuple(param.shape)
        if qkind is not None and where.split()[-1] in quant.QUANTIZED_PARAMS:  # quantized as it is read
            param.set_value(quant.load_param(src, parts, qkind, shape))
            return
        arr = param_value(src, shape, parts, np_dtype)
        param.set_value(jnp.asarray(arr))

    for name in ("embed", "norm", "lm_head"):
        put(name, getattr(model, name), plan.top.get(name))
    for i, (layer, params) in enumerate(zip(model.layers, plan.layers)):
        for name in DecoderLayer.NAMES:
            put(f"layer {i} {name}", getattr(layer, name), params.get(name))


__all__ = ["LoadedModel", "load_model", "ModelLoadError"]
