"""Weight-only quantization: formats, quantize/dequantize, and the pure-JAX products.

``--quantization int8`` and ``--quantization int4`` store every linear weight
of the model (the embedding and the vocabulary projection included) in blocks
of :data:`GROUP` = 32 consecutive input features of one output row, each block
with its own float16 scale: the layouts of GGUF's Q8_0, Q4_0 and Q4_1, so a
GGUF file's blocks are taken as they are (:func:`from_gguf_blocks`, a byte
split, never a round trip through float32), and a float checkpoint is
quantized tensor by tensor at load (:func:`quantize`). Group-wise rather than
per output channel because that is what the GGUF files hold, and because a
scale per 32 weights keeps one outlier from costing its whole row precision.

Kinds (:attr:`QuantizedWeight.kind`):

``q8_0``  ``q`` int8 ``[O, I]`` in [-127, 127]; w = d * q
``q4_0``  ``q`` uint8 ``[O, I // 2]`` packed nibbles; w = d * (nibble - 8)
``q4_1``  the same nibbles and a float16 ``min`` per block; w = d * nibble + m

Nibble order is GGUF's: byte j of a block's 16 holds weight j in its low
nibble and weight j + 16 in its high one, so one 16-byte load gives two runs
of 16 consecutive weights.

The products (:func:`matmul`) quantize the activations too, per token and per
block of 32 features, to int8 with a float32 scale (llama.cpp's Q8_0
activations): each block's product is an exact integer dot of int8 values,
then one float multiply by the two scales. The C++ CPU kernels
(``jaxserve/kernels/cpu/qmatmul_cpu.cc``) compute the same integers with
VNNI's ``vpdpbusd``; the pure-JAX path here (GPU/TPU, and the CPU with
``JAXSERVE_CPU_KERNEL=0``) does it with an int8 ``dot_general`` with int32
accumulation, so both paths share every rounding but the order of the
float sums over blocks (tests/test_quant_model.py: the same greedy tokens).
Each path sums a token's blocks in one order whatever the call's token
count, so a token's outputs do not depend on the rest of its batch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, overload

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.blocks import ordered_sum

if TYPE_CHECKING:
    from typing_extensions import TypeIs

#: weights per block (one scale, and for ``q4_1`` one min, per block)
GROUP = 32
#: ``--quantization`` values -> the kind a float checkpoint is quantized to
QUANTIZATIONS: dict[str, str] = {"int8": "q8_0", "int4": "q4_1"}
KINDS = ("q8_0", "q4_0", "q4_1")
#: GGUF tensor types taken as they are -> kind
GGUF_KINDS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}


@overload
def check_quantization(value: str) -> str: ...
@overload
def check_quantization(value: None) -> None: ...
def check_quantization(value: str | None) -> str | None:
    """``value`` if it is ``None`` or one of :data:`QUANTIZATIONS`, else a
    ``ValueError`` naming the field and the value."""
    if value is None or value in QUANTIZATIONS:
        return value
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset), got {value!r}")


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A ``[O, I]`` linear weight in blocks of :data:`GROUP` input features,
    or a stack of them (a mixture of experts' ``[X, O, I]``: every leaf has
    the leading ``X`` axis, and ``rows(j)`` is expert ``j``'s matrix).

    A JAX pytree (``q``, ``scale``, ``min`` are its leaves; ``kind`` is
    static), so it sits in an ``nnx.Param`` and goes through ``jit`` like a
    float array; ``min`` is ``None`` except for ``q4_1``."""

    q: Any
    scale: Any  # float16 [O, I // GROUP]
    min: Any  # float16 [O, I // GROUP] (q4_1) or None
    kind: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``(O, I)`` (a stack: ``(X, O, I)``) of the float weight."""
        *lead, n = self.q.shape
        return (*(int(d) for d in lead), int(n) * (1 if self.kind == "q8_0" else 2))

    @property
    def nbytes(self) -> int:
        leaves = [self.q, self.scale] + ([] if self.min is None else [self.min])
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in leaves)

    def rows(self, index) -> QuantizedWeight:
        """The weight of the output rows ``index`` (a slice or an index
        array); of a stack, the experts ``index`` (an int: one ``[O, I]``)."""
        return QuantizedWeight(
            self.q[index], self.scale[index], None if self.min is None else self.min[index], self.kind
        )


jax.tree_util.register_dataclass(QuantizedWeight, data_fields=["q", "scale", "min"], meta_fields=["kind"])


def is_quantized(w: Any) -> TypeIs[QuantizedWeight]:
    return isinstance(w, QuantizedWeight)


# ---------------------------------------------------------------- quantize (host, numpy)


def _blocks(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise ValueError(f"quantization needs a [out, in] weight with in a multiple of {GROUP}, got {list(w.shape)}")
    return w.reshape(w.shape[0], w.shape[1] // GROUP, GROUP)


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16)


def _safe_inverse(d: np.ndarray) -> np.ndarray:
    out = np.zeros_like(d, dtype=np.float32)
    np.divide(np.float32(1.0), d, out=out, where=d != 0)
    return out


def pack_nibbles(n: np.ndarray) -> np.ndarray:
    """uint8 ``[..., O, G, 32]`` values 0-15 -> ``[..., O, G * 16]`` bytes in GGUF's order."""
    n = n.astype(np.uint8)
    return (n[..., :16] | (n[..., 16:] << 4)).reshape(*n.shape[:-2], -1)


def unpack_nibbles(packed):
    """``[..., O, G * 16]`` bytes -> ``[..., O, G, 32]`` values 0-15 (numpy or JAX arrays)."""
    xp = jnp if isinstance(packed, jax.Array) else np
    b = packed.reshape(*packed.shape[:-1], -1, 16)
    return xp.concatenate([b & 0x0F, b >> 4], axis=-1)


def quantize(w: np.ndarray, kind: str) -> QuantizedWeight:
    """Quantize a float ``[O, I]`` weight on the host (numpy in, numpy leaves
    out; ``I`` a multiple of 32). Scales are rounded to float16 before the
    weights are divided by them, so dequantizing uses exactly the stored
    scale. Peak extra memory is a few float32 copies of this one tensor; a
    stack ``[X, O, I]`` (or any ``[..., O, I]``) is quantized one matrix at
    a time, so its peak is a few copies of one expert's matrix. Rows are
    quantized independently of each other."""
    w = np.asarray(w)
    if w.ndim > 2:
        pieces = [quantize(w[i], kind) for i in np.ndindex(*w.shape[:-2])]
        return _stacked(pieces, w.shape[:-2])
    b = _blocks(w)
    if kind == "q8_0":
        d = _f16(np.abs(b).max(axis=-1) / 127.0)
        q = np.clip(np.rint(b * _safe_inverse(d.astype(np.float32))[..., None]), -127, 127).astype(np.int8)
        return QuantizedWeight(q.reshape(w.shape), d, None, kind)
    if kind == "q4_0":
        # llama.cpp's Q4_0: the value of largest magnitude maps to -8
        idx = np.abs(b).argmax(axis=-1)[..., None]
        extreme = np.take_along_axis(b, idx, axis=-1)[..., 0]
        d = _f16(extreme / -8.0)
        n = np.clip(np.rint(b * _safe_inverse(d.astype(np.float32))[..., None]) + 8, 0, 15)
        return QuantizedWeight(pack_nibbles(n), d, None, kind)
    if kind == "q4_1":
        lo, hi = b.min(axis=-1), b.max(axis=-1)
        d = _f16((hi - lo) / 15.0)
        m = _f16(lo)
        n = np.clip(
            np.rint((b - m.astype(np.float32)[..., None]) * _safe_inverse(d.astype(np.float32))[..., None]), 0, 15
        )
        return QuantizedWeight(pack_nibbles(n), d, m, kind)
    raise ValueError(f"unknown quantized weight kind {kind!r}; one of {', '.join(KINDS)}")


def _stacked(pieces: list[QuantizedWeight], lead: tuple[int, ...]) -> QuantizedWeight:
    """Weights of one shape and kind stacked into one of ``lead + shape``."""

    def stack(leaves: list[np.ndarray]) -> np.ndarray:
        return np.stack(leaves).reshape(*lead, *leaves[0].shape)

    first = pieces[0]
    mins = None if first.min is None else stack([p.min for p in pieces])
    return QuantizedWeight(stack([p.q for p in pieces]), stack([p.scale for p in pieces]), mins, first.kind)


def dequantize(w: QuantizedWeight, dtype=jnp.float32):
    """The float ``[O, I]`` (a stack: ``[X, O, I]``) weight (numpy for numpy
    leaves, JAX otherwise)."""
    xp = jnp if isinstance(w.q, jax.Array) else np
    shape = w.shape
    d = w.scale.astype(xp.float32)[..., None]
    if w.kind == "q8_0":
        v = w.q.reshape(*shape[:-1], shape[-1] // GROUP, GROUP).astype(xp.float32) * d
    else:
        n = unpack_nibbles(w.q).astype(xp.float32)
        v = d * (n - 8.0) if w.kind == "q4_0" else d * n + w.min.astype(xp.float32)[..., None]
    return v.reshape(shape).astype(dtype)


def from_gguf_blocks(qtype: str, blocks: np.ndarray, shape: tuple[int, ...]) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8 ``[rows, bytes_per_row]``, as
    ``jaxserve.models.gguf_file.QuantizedBlocks`` holds them) as a
    :class:`QuantizedWeight` of the logical ``shape`` (``[O, I]``, or a
    stack ``[X, O, I]`` whose ``X * O`` rows the blocks hold in order):
    the scale, min and quant bytes of each block split into their own
    arrays, values untouched."""
    kind = GGUF_KINDS.get(qtype)
    if kind is None:
        raise ValueError(f"GGUF tensor type {qtype} is not taken as blocks; one of {', '.join(GGUF_KINDS)}")
    lead, I = tuple(int(s) for s in shape[:-1]), int(shape[-1])
    O = int(np.prod(lead))
    head = {"q8_0": 2, "q4_0": 2, "q4_1": 4}[kind]
    body = GROUP if kind == "q8_0" else GROUP // 2
    blocks = np.ascontiguousarray(blocks, np.uint8).reshape(O, I // GROUP, head + body)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].reshape(*lead, -1)
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].reshape(*lead, -1) if kind == "q4_1" else None
    qbytes = np.ascontiguousarray(blocks[..., head:]).reshape(*lead, -1)
    q = qbytes.view(np.int8) if kind == "q8_0" else qbytes
    return QuantizedWeight(q, d, m, kind)


def load_param(src: Any, parts: list[Any], kind: str, shape: tuple[int, ...] | None = None) -> QuantizedWeight:
    """One parameter of logical ``shape`` (``[O, I]``, or an expert stack
    ``[X, O, I]``; None: ``[O, I]`` from the parts' rows), quantized, from a
    checkpoint's tensors (``jaxserve.models.weights.Part``: HF name, HF
    shape, the index of the parameter it fills: rows, an expert, or an
    expert's rows). GGUF tensors already in blocks of the width ``kind``
    asks for (Q8_0 for int8; Q4_0 or Q4_1 for int4) are taken as they are,
    never through float32 (a fused parameter takes each part's blocks into
    its rows, an expert stack each expert's or the whole stack's); any
    other tensor, a GGUF block of the other width included, is read as float
    and quantized to ``kind``: ``--quantization int8`` on a Q4_1 file gives
    int8 weights, as asked, not the file's 4-bit ones. Rows quantize
    independently, so each part is quantized on its own (peak memory: a few
    float32 copies of one part, never of a whole expert stack) unless a
    part splits rows (its index reaches the input axis). JAX arrays as
    leaves."""
    if shape is None:
        shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    shape = tuple(int(s) for s in shape)
    raw = getattr(src, "raw_blocks", None)
    bits = kind[:2]  # "q8" or "q4": the block width asked for
    as_stored = all(p.transform is None and GGUF_KINDS.get(src.dtype_name(p.name), "")[:2] == bits for p in parts)
    if raw is not None and as_stored:
        pieces = [(p, from_gguf_blocks(src.dtype_name(p.name), raw(p.name).blocks, p.shape)) for p in parts]
        if len({q.kind for _, q in pieces}) == 1:
            return to_device(_assembled(pieces, shape, pieces[0][1].kind))
    if all(_whole_rows(p.where, len(shape)) for p in parts):
        pieces = []
        for p in parts:
            value = src.get(p.name, p.shape)
            value = np.asarray(value if p.transform is None else p.transform(value), np.float32)
            pieces.append((p, quantize(value, kind)))
        return to_device(_assembled(pieces, shape, kind))
    arr = np.empty(shape, np.float32)
    for p in parts:
        value = src.get(p.name, p.shape)
        arr[p.where] = value if p.transform is None else p.transform(value)
    return to_device(quantize(arr, kind))


def _whole_rows(where: Any, ndim: int) -> bool:
    """Whether the index ``where`` leaves the last (input) axis whole."""
    index = where if isinstance(where, tuple) else (where,)
    return len(index) < ndim or index[ndim - 1] == slice(None)


def _assembled(pieces: list[tuple[Any, QuantizedWeight]], shape: tuple[int, ...], kind: str) -> QuantizedWeight:
    """The weight of ``shape`` whose index ``part.where`` holds each piece (host numpy)."""
    G = shape[-1] // GROUP
    body = shape[-1] if kind == "q8_0" else shape[-1] // 2
    q = np.empty((*shape[:-1], body), np.int8 if kind == "q8_0" else np.uint8)
    scale = np.empty((*shape[:-1], G), np.float16)
    mins = np.empty((*shape[:-1], G), np.float16) if kind == "q4_1" else None
    if len(pieces) == 1 and pieces[0][0].where == slice(None) and pieces[0][1].q.shape == q.shape:
        return pieces[0][1]
    for part, piece in pieces:
        q[part.where] = piece.q.reshape(q[part.where].shape)
        scale[part.where] = piece.scale.reshape(scale[part.where].shape)
        if mins is not None:
            mins[part.where] = piece.min.reshape(mins[part.where].shape)
    return QuantizedWeight(q, scale, mins, kind)


#: the layer matrices of ``jaxserve.models.decoder`` that quantization stores as blocks
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")
#: a mixture of experts' stacks (``[X, O, I]``, ``jaxserve.models.moe``), stored as blocks too
EXPERT_STACKS = ("experts_gate_up", "experts_down")
#: every parameter quantization stores as blocks (the MoE router stays float:
#: it is small, and its top-k choice is what a rounding would change)
QUANTIZED_PARAMS = frozenset({"embed", "lm_head", *MATRICES, *EXPERT_STACKS})


def quantize_model(model: Any, kind: str) -> None:
    """Quantize a loaded float model's matrices (the embedding, ``lm_head``
    and every layer's :data:`MATRICES` and :data:`EXPERT_STACKS`) in place, one at a time, with
    :func:`quantize`: what ``load_model(..., quantization=...)`` does as it
    reads a float checkpoint, for a model already in memory (benchmarks)."""
    params = [model.embed] + ([] if model.lm_head is None else [model.lm_head])
    params += [getattr(layer, name) for layer in model.layers for name in MATRICES + EXPERT_STACKS]
    for p in params:
        if p is None:  # a MoE layer has no dense MLP, a dense one no expert stacks
            continue
        p.set_value(to_device(quantize(np.asarray(p[...], np.float32), kind)))


def to_device(w: QuantizedWeight) -> QuantizedWeight:
    """The same weight with JAX arrays as leaves."""
    return jax.tree.map(jnp.asarray, w)


# ---------------------------------------------------------------- activations


def quantize_activations(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Feature-major float ``x`` ``[I, T]`` -> ``(xq int8 [T, G, 32], dx
    float32 [T, G], sx int32 [T, G])``: per token and block of 32 features,
    d = max|x| / 127, xq = round-half-even(x * (1 / d)), and sx the block's
    sum of xq (what the ``q4_0`` offset and the ``q4_1`` min multiply). The
    C++ kernels compute the same values."""
    I, T = x.shape
    xt = x.astype(jnp.float32).T.reshape(T, I // GROUP, GROUP)
    amax = jnp.max(jnp.abs(xt), axis=-1)
    d = amax * jnp.float32(1.0 / 127.0)
    inv = jnp.where(d > 0, jnp.float32(1.0) / jnp.where(d > 0, d, 1.0), 0.0)
    xq = jnp.round(xt * inv[..., None]).astype(jnp.int8)
    return xq, d, jnp.sum(xq.astype(jnp.int32), axis=-1)


def matmul(w: QuantizedWeight, x: jax.Array) -> jax.Array:
    """``dequantize(w) @ x`` as the quantized kernels compute it: float32
    ``[O, T]`` for feature-major ``x`` ``[I, T]``, with ``x`` quantized per
    token and block (:func:`quantize_activations`) and each block's product
    an int8 x int8 dot with int32 accumulation, scaled by the weight's and
    the token's scales (plus ``min * dx * sum(xq)`` for ``q4_1``)."""
    O, I = w.shape
    if x.shape[0] != I:
        raise ValueError(f"quantized matmul: weight [{O}, {I}] @ x {list(x.shape)}")
    G = I // GROUP
    xq, dx, sx = quantize_activations(x)
    if w.kind == "q8_0":
        wq = w.q.reshape(O, G, GROUP)
    else:
        wq = unpack_nibbles(w.q).astype(jnp.int8)
    # [G, O, 32] x [G, T, 32] -> [G, O, T] int32 (batch over blocks)
    acc = jax.lax.dot_general(wq, xq, (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.int32)
    if w.kind == "q4_0":
        acc = acc - 8 * sx.T[:, None, :]
    scaled = acc.astype(jnp.float32) * (w.scale.astype(jnp.float32).T[:, :, None] * dx.T[:, None, :])
    if w.kind == "q4_1":
        scaled = scaled + w.min.astype(jnp.float32).T[:, :, None] * (dx * sx.astype(jnp.float32)).T[:, None, :]
    return ordered_sum(scaled, axis=0)  # a token's bits whatever the call's token count


def embed(w: QuantizedWeight, ids: jax.Array) -> jax.Array:
    """Rows ``ids`` of the dequantized ``[V, E]`` embedding, float32 ``[T, E]``:
    a gather of the quantized rows, then their dequantization."""
    return dequantize(w.rows(ids))


# ---------------------------------------------------------------- numpy reference


def reference_matmul(w: QuantizedWeight, x: np.ndarray) -> np.ndarray:
    """:func:`matmul` in numpy (float64 sums of the same integer dots), the
    tests' reference for the kernels."""
    w = jax.tree.map(np.asarray, w)
    x = np.asarray(x, np.float32)
    O, I = w.shape
    G = I // GROUP
    xt = x.T.reshape(x.shape[1], G, GROUP)
    d = np.abs(xt).max(axis=-1) * np.float32(1.0 / 127.0)
    inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, np.float32(1.0)), np.float32(0.0)).astype(np.float32)
    xq = np.rint(xt * inv[..., None]).astype(np.int64)
    sx = xq.sum(axis=-1)
    wq = w.q.reshape(O, G, GROUP).astype(np.int64) if w.kind == "q8_0" else unpack_nibbles(w.q).astype(np.int64)
    acc = np.einsum("ogk,tgk->otg", wq, xq)
    if w.kind == "q4_0":
        acc = acc - 8 * sx[None]
    out = acc * (w.scale.astype(np.float64)[:, None, :] * d.astype(np.float64)[None])
    if w.kind == "q4_1":
        out = out + w.min.astype(np.float64)[:, None, :] * (d.astype(np.float64) * sx)[None]
    return out.sum(axis=-1)


__all__ = [
    "EXPERT_STACKS",
    "GROUP",
    "KINDS",
    "QUANTIZATIONS",
    "QuantizedWeight",
    "check_quantization",
    "dequantize",
    "embed",
    "from_gguf_blocks",
    "is_quantized",
    "load_param",
    "matmul",
    "quantize_model",
    "quantize",
    "quantize_activations",
    "reference_matmul",
    "to_device",
]
