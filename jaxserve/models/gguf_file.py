"""Read a GGUF checkpoint (llama.cpp's single-file format) as Hugging Face tensors.

A GGUF file holds the model's configuration and tokenizer as metadata and its
weights as tensors in llama.cpp's layout: names like ``blk.3.attn_q.weight``,
shapes written innermost dimension first, and the rows of every Q and K
projection permuted (per head) for llama.cpp's interleaved rotary embedding.
:class:`GGUFCheckpoint` hides all three: it is asked for Hugging Face names
(``model.layers.3.self_attn.q_proj.weight``) and answers with arrays in
Hugging Face's ``[out, in]`` layout and row order, ready for jaxserve's
rotate-half rope. Parsing is PyPI ``gguf``'s (the ggml project's reference
reader), which memory-maps the file, so a tensor is read only when asked for
and peak host memory is about one dequantized tensor.

Two ways to read a tensor:

``get(name, expected_shape)``
    a float array (float32 for every quantized type and BF16, float16 for
    F16, float32 for F32), rows un-permuted.

``raw_blocks(name)`` -> :class:`QuantizedBlocks`
    the tensor's bytes as stored, for kernels that compute from quantized
    blocks without a round trip through float32: ``qtype`` (ggml's name,
    e.g. ``"Q8_0"``, ``"Q4_1"``), ``blocks`` (``uint8``, shaped ``[rows,
    bytes_per_row]``: one row per output channel, the blocks of that row
    along the input dimension, rows already un-permuted like ``get``'s),
    ``shape`` (the logical ``[rows, cols]``), ``block_size`` (weights per
    block) and ``type_size`` (bytes per block). Block layouts (32 weights a
    block): Q8_0 = f16 scale + 32 int8 (w = d*q); Q4_0 = f16 scale + 16 bytes,
    low nibbles are weights 0..15 and high nibbles 16..31 (w = d*(q-8));
    Q4_1 = f16 scale, f16 min + the same nibbles (w = d*q + m).
    ``QuantizedBlocks.dequantize()`` gives the same array as ``get``.

What differs by family (llama.cpp's architecture name, tensor names,
whether Q/K rows were permuted, Gemma's shifted norm weights, the metadata
keys of its settings) comes from the family's
:class:`~jaxserve.models.gguf_spec.GGUFSpec`, found by the file's
``general.architecture`` in :mod:`jaxserve.models.registry`.

Only what jaxserve serves is accepted: registered architectures and the
tensor types in :data:`SUPPORTED_TENSOR_TYPES`; anything else raises a
one-line :class:`ModelLoadError` naming it when the file is opened, before
any weight is read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxserve.models.errors import ModelLoadError
from jaxserve.models.gguf_spec import GLOBAL_NAMES, GGUFMetadata, GGUFSpec
from jaxserve.models.registry import family_of_gguf

#: tensor types jaxserve reads (each one is covered by tests/test_gguf.py)
SUPPORTED_TENSOR_TYPES: tuple[str, ...] = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

# GGUF tensors that are not weights of the model (llama.cpp writes rope tables)
_IGNORED_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


def hf_to_gguf_name(name: str, spec: GGUFSpec) -> str | None:
    """``model.layers.3.mlp.up_proj.weight`` -> ``blk.3.ffn_up.weight`` under
    ``spec``'s names (None when the name has no GGUF tensor)."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    prefix = "model.layers."
    if name.startswith(prefix):
        index, _, rest = name[len(prefix) :].partition(".")
        if index.isdigit() and rest in spec.layer_names:
            return f"blk.{index}.{spec.layer_names[rest]}"
    return None


def unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation.

    The converter stores, per head, the rows ``[0, half, 1, half+1, ...]`` of
    Hugging Face's ``[first half, second half]`` (it reshapes to ``[heads, 2,
    half]`` and swaps the last two axes); ``gguf_rows[result]`` restores
    Hugging Face's order. Whole rows move, so the same index applies to a
    float matrix, its biases and its quantized block rows.
    """
    if num_heads <= 0 or num_rows % (2 * num_heads):
        raise ModelLoadError(f"cannot un-permute {num_rows} rows over {num_heads} heads")
    half = num_rows // num_heads // 2
    return np.arange(num_rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(-1)


@dataclasses.dataclass(frozen=True)
class QuantizedBlocks:
    """A tensor's stored bytes: ``blocks`` is ``uint8 [rows, bytes_per_row]``."""

    qtype: str
    blocks: np.ndarray
    shape: tuple[int, ...]
    block_size: int
    type_size: int

    def dequantize(self) -> np.ndarray:
        """float32 ``shape`` (F16 and F32 blocks are read as their floats)."""
        import gguf

        qtype = gguf.GGMLQuantizationType[self.qtype]
        if self.qtype in ("F32", "F16"):
            dtype = np.float32 if self.qtype == "F32" else np.float16
            return self.blocks.view(dtype).reshape(self.shape).astype(np.float32)
        return np.asarray(gguf.quants.dequantize(self.blocks, qtype), dtype=np.float32).reshape(self.shape)


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key-value field of a ``gguf.GGUFReader`` as Python values (strings,
    numbers, bools, lists), without the ``GGUF.*`` header fields."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, np.generic):
            value = value.item()
        out[key] = value
    return out


def open_reader(path: str | os.PathLike[str]) -> Any:
    """A ``gguf.GGUFReader`` over ``path``; a file that is not GGUF, or one cut
    short or corrupt, is a one-line ModelLoadError that says which."""
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError, struct and numpy errors alike
        size = os.path.getsize(path)
        raise ModelLoadError(
            f"GGUF file {path} is truncated or corrupt ({size} bytes; the reader stopped with: {exc})"
        ) from exc
    return reader


class GGUFCheckpoint:
    """The tensors of one GGUF file under Hugging Face names (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], reader: Any = None) -> None:
        self.path = os.fspath(path)
        self._reader = reader if reader is not None else open_reader(self.path)
        self.metadata = read_metadata(self._reader)
        self._tensors = {t.name: t for t in self._reader.tensors}
        arch = self.metadata.get("general.architecture")
        self.family = family_of_gguf(arch, self._tensors, self.path)
        assert self.family.gguf is not None
        self.spec: GGUFSpec = self.family.gguf
        check_tensor_types(self._reader.tensors, self.path)
        self._heads = int(_required(self.metadata, f"{arch}.attention.head_count", self.path))
        self._kv_heads = int(self.metadata.get(f"{arch}.attention.head_count_kv", self._heads))

    def hf_config(self) -> dict[str, Any]:
        """The file's ``config.json`` (see :func:`hf_config`)."""
        types = {name: t.tensor_type.name for name, t in self._tensors.items()}
        embed = self._tensors.get("token_embd.weight")
        rows = int(embed.shape[-1]) if embed is not None and len(embed.shape) == 2 else None
        read = lambda name: np.asarray(self._tensors[name].data, np.float32)  # noqa: E731 - F32 settings tensors
        return self.spec.config(GGUFMetadata(self.metadata, types, self.path, rows, read))

    # -- the interface the loader uses (same as its safetensors source) ------
    def close(self) -> None:
        self._tensors = {}
        self._reader = None

    def __contains__(self, name: str) -> bool:
        gguf_name = hf_to_gguf_name(name, self.spec)
        return gguf_name is not None and gguf_name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """Hugging Face shape (``[out, in]`` for a matrix)."""
        return tuple(int(d) for d in reversed(self._tensor(name).shape.tolist()))

    def dtype_name(self, name: str) -> str:
        """ggml's type name: ``F32``, ``BF16``, ``Q4_1``, ..."""
        return self._tensor(name).tensor_type.name

    def get(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        found = self.shape(name)
        if found != tuple(expected_shape):
            raise ModelLoadError(
                f"{self.path}: tensor {hf_to_gguf_name(name, self.spec)} ({name}) has shape {list(found)}, "
                f"expected {list(expected_shape)}"
            )
        tensor = self._tensor(name)
        qtype = tensor.tensor_type.name
        if qtype in ("F32", "F16"):
            values = np.asarray(tensor.data).reshape(found)
        else:
            import gguf

            values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
            values = values.reshape(found)
        if self.spec.norm_offset and name.endswith("norm.weight"):  # the converter stored w + offset
            values = values.astype(np.float32) - np.float32(self.spec.norm_offset)
        return self._unpermuted(name, values)

    def raw_blocks(self, name: str) -> QuantizedBlocks:
        """The stored blocks of ``name`` (see :class:`QuantizedBlocks`)."""
        import gguf

        tensor = self._tensor(name)
        shape = self.shape(name)
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        blocks = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
        return QuantizedBlocks(
            qtype=tensor.tensor_type.name,
            blocks=self._unpermuted(name, blocks),
            shape=shape,
            block_size=int(block_size),
            type_size=int(type_size),
        )

    # -- helpers ---------------------------------------------------------------
    def _tensor(self, name: str) -> Any:
        gguf_name = hf_to_gguf_name(name, self.spec)
        if gguf_name is None or gguf_name not in self._tensors:
            raise ModelLoadError(f"{self.path}: missing tensor {gguf_name or name} ({name})")
        return self._tensors[gguf_name]

    def _unpermuted(self, name: str, rows: np.ndarray) -> np.ndarray:
        if not self.spec.permuted_qk:
            return rows
        if ".self_attn.q_proj." in name:
            return rows[unpermute_rows(rows.shape[0], self._heads)]
        if ".self_attn.k_proj." in name:
            return rows[unpermute_rows(rows.shape[0], self._kv_heads)]
        return rows


def _required(metadata: Mapping[str, Any], key: str, path: str) -> Any:
    if metadata.get(key) is None:
        raise ModelLoadError(f"{path}: GGUF metadata key {key!r} is missing")
    return metadata[key]


def check_tensor_types(tensors: Any, path: str) -> None:
    """Refuse the first tensor whose type jaxserve cannot read, naming both."""
    for tensor in tensors:
        if tensor.name in _IGNORED_TENSORS:
            continue
        qtype = tensor.tensor_type.name
        if qtype not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} has unsupported GGUF type {qtype}; "
                f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
            )


__all__ = [
    "GGUFCheckpoint",
    "QuantizedBlocks",
    "SUPPORTED_TENSOR_TYPES",
    "check_tensor_types",
    "hf_to_gguf_name",
    "open_reader",
    "read_metadata",
    "unpermute_rows",
]
