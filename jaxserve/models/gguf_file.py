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

Mixtures of experts: llama.cpp stacks each layer's experts into one tensor
(``blk.N.ffn_up_exps``, ``[X, I, E]`` in Hugging Face order); a family's
per-expert names (``GGUFSpec.expert_names``:
``model.layers.N.mlp.experts.J.up_proj.weight``) are answered by ``get``
and ``raw_blocks`` with expert J's slice of it, read from the memory map
alone. A Hugging Face tensor the converter split into several
(``GGUFSpec.joined_names``: gpt-oss's interleaved gate/up) is joined back
for ``get``; it has no stored blocks of its own.

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
    "MXFP4",  # gpt-oss's released experts (read as float: gguf.quants dequantizes it)
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


def hf_expert_name(name: str, spec: GGUFSpec) -> tuple[str, int] | None:
    """``model.layers.3.mlp.experts.7.up_proj.weight`` -> (``blk.3.ffn_up_exps.weight``, 7)
    under ``spec``'s ``expert_names`` (None when the name is not one)."""
    prefix = "model.layers."
    if not spec.expert_names or not name.startswith(prefix):
        return None
    index, _, rest = name[len(prefix) :].partition(".")
    if not index.isdigit():
        return None
    for pattern, stacked in spec.expert_names.items():
        head, _, tail = pattern.partition("{j}")
        if rest.startswith(head) and rest.endswith(tail) and len(rest) > len(head) + len(tail):
            expert = rest[len(head) : len(rest) - len(tail)]
            if expert.isdigit():
                return f"blk.{index}.{stacked}", int(expert)
    return None


def _joined(name: str, spec: GGUFSpec) -> tuple[list[str], bool] | None:
    """The GGUF tensors a joined Hugging Face tensor was split into, and
    whether each is transposed (:class:`~jaxserve.models.gguf_spec.JoinedTensor`)."""
    prefix = "model.layers."
    if not spec.joined_names or not name.startswith(prefix):
        return None
    index, _, rest = name[len(prefix) :].partition(".")
    joined = spec.joined_names.get(rest)
    if joined is None or not index.isdigit():
        return None
    return [f"blk.{index}.{part}" for part in joined.parts], joined.transposed


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
        joined = _joined(name, self.spec)
        if joined is not None:
            return all(part in self._tensors for part in joined[0])
        expert = hf_expert_name(name, self.spec)
        if expert is not None:
            stacked, j = expert
            return stacked in self._tensors and j < self._gguf_shape(self._tensors[stacked])[0]
        gguf_name = hf_to_gguf_name(name, self.spec)
        return gguf_name is not None and gguf_name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """Hugging Face shape (``[out, in]`` for a matrix; one expert's of a stacked tensor)."""
        joined = _joined(name, self.spec)
        if joined is not None:
            parts, transposed = joined
            dims = list(self._gguf_shape(self._by_gguf_name(parts[0], name)))
            if transposed:
                dims[-2:] = dims[-1], dims[-2]
            dims[-1] *= len(parts)
            return tuple(dims)
        tensor, expert = self._tensor_and_expert(name)
        shape = self._gguf_shape(tensor)
        return shape if expert is None else shape[1:]

    def dtype_name(self, name: str) -> str:
        """ggml's type name: ``F32``, ``BF16``, ``Q4_1``, ..."""
        joined = _joined(name, self.spec)
        if joined is not None:
            return self._by_gguf_name(joined[0][0], name).tensor_type.name
        return self._tensor_and_expert(name)[0].tensor_type.name

    def get(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        found = self.shape(name)
        if found != tuple(expected_shape):
            raise ModelLoadError(
                f"{self.path}: tensor {self._gguf_label(name)} ({name}) has shape {list(found)}, "
                f"expected {list(expected_shape)}"
            )
        joined = _joined(name, self.spec)
        if joined is not None:
            return self._join(name, *joined)
        tensor, expert = self._tensor_and_expert(name)
        data = tensor.data if expert is None else tensor.data[expert]  # one expert: a slice of the memory map
        values = _dequantized(data, tensor.tensor_type).reshape(found)
        if self.spec.norm_offset and name.endswith("norm.weight"):  # the converter stored w + offset
            values = values.astype(np.float32) - np.float32(self.spec.norm_offset)
        return self._unpermuted(name, values)

    def raw_blocks(self, name: str) -> QuantizedBlocks:
        """The stored blocks of ``name`` (see :class:`QuantizedBlocks`)."""
        import gguf

        if _joined(name, self.spec) is not None:
            raise ModelLoadError(f"{self.path}: {name} is split over several GGUF tensors; it has no blocks of its own")
        tensor, expert = self._tensor_and_expert(name)
        shape = self.shape(name)
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        data = tensor.data if expert is None else tensor.data[expert]
        blocks = np.asarray(data).view(np.uint8).reshape(rows, -1)
        return QuantizedBlocks(
            qtype=tensor.tensor_type.name,
            blocks=self._unpermuted(name, blocks),
            shape=shape,
            block_size=int(block_size),
            type_size=int(type_size),
        )

    # -- helpers ---------------------------------------------------------------
    def _tensor(self, name: str) -> Any:
        return self._tensor_and_expert(name)[0]

    def _tensor_and_expert(self, name: str) -> tuple[Any, int | None]:
        """The GGUF tensor holding ``name``, and the expert's index in it when
        ``name`` is one expert's share of a stacked tensor."""
        expert = hf_expert_name(name, self.spec)
        if expert is not None:
            stacked, j = expert
            tensor = self._by_gguf_name(stacked, name)
            count = self._gguf_shape(tensor)[0]
            if j >= count:
                raise ModelLoadError(f"{self.path}: {name} asks for expert {j} of {stacked}, which has {count}")
            return tensor, j
        gguf_name = hf_to_gguf_name(name, self.spec)
        if gguf_name is None:
            raise ModelLoadError(f"{self.path}: missing tensor {name}")
        return self._by_gguf_name(gguf_name, name), None

    def _by_gguf_name(self, gguf_name: str, name: str) -> Any:
        if gguf_name not in self._tensors:
            raise ModelLoadError(f"{self.path}: missing tensor {gguf_name} ({name})")
        return self._tensors[gguf_name]

    @staticmethod
    def _gguf_shape(tensor: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(tensor.shape.tolist()))

    def _gguf_label(self, name: str) -> str:
        joined = _joined(name, self.spec)
        if joined is not None:
            return " + ".join(joined[0])
        expert = hf_expert_name(name, self.spec)
        if expert is not None:
            return f"{expert[0]}[{expert[1]}]"
        return str(hf_to_gguf_name(name, self.spec))

    def _join(self, name: str, parts: list[str], transposed: bool) -> np.ndarray:
        """A joined tensor's values (:class:`~jaxserve.models.gguf_spec.JoinedTensor`)."""
        values = []
        for part in parts:
            tensor = self._by_gguf_name(part, name)
            v = _dequantized(tensor.data, tensor.tensor_type).reshape(self._gguf_shape(tensor))
            values.append(np.swapaxes(v, -1, -2) if transposed else v)
        if len(values) == 1:
            return np.ascontiguousarray(values[0])
        stacked = np.stack(values, axis=-1)
        return stacked.reshape(*stacked.shape[:-2], -1)

    def _unpermuted(self, name: str, rows: np.ndarray) -> np.ndarray:
        if not self.spec.permuted_qk:
            return rows
        if ".self_attn.q_proj." in name:
            return rows[unpermute_rows(rows.shape[0], self._heads)]
        if ".self_attn.k_proj." in name:
            return rows[unpermute_rows(rows.shape[0], self._kv_heads)]
        return rows


def _dequantized(data: np.ndarray, tensor_type: Any) -> np.ndarray:
    """Stored values as floats: F32 and F16 as they are, other types through ``gguf.quants``."""
    if tensor_type.name in ("F32", "F16"):
        return np.asarray(data)
    import gguf

    return np.asarray(gguf.quants.dequantize(np.asarray(data), tensor_type), np.float32)


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
        if qtype == "MXFP4" and not _gguf_reads("MXFP4"):
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} has GGUF type MXFP4, which the installed gguf package cannot "
                "dequantize; upgrade it (pip install -U gguf)"
            )


def _gguf_reads(qtype: str) -> bool:
    """Whether the installed ``gguf`` package dequantizes ``qtype`` (MXFP4 came in 2025)."""
    import gguf

    kind = getattr(gguf.GGMLQuantizationType, qtype, None)
    return kind is not None and hasattr(gguf.quants, qtype)


__all__ = [
    "GGUFCheckpoint",
    "QuantizedBlocks",
    "SUPPORTED_TENSOR_TYPES",
    "check_tensor_types",
    "hf_expert_name",
    "hf_to_gguf_name",
    "open_reader",
    "read_metadata",
    "unpermute_rows",
]
