"""Physical paged KV cache storage (device arrays only; no allocator here).

Layout
------
Per layer and KV head the cache is a sequence of fixed-size blocks; block
``b`` holds the keys/values of ``block_size`` consecutive positions of one
sequence. The token at position ``p`` of a sequence whose block table is
``bt`` lives in block ``bt[p // block_size]`` at offset ``p % block_size``
(its *slot* is ``block * block_size + offset``, the unit ``slot_mapping``
counts in).

Each layer has its own pair of arrays (``KVCache.k`` and ``KVCache.v`` are
tuples with one array per layer):

- keys ``[num_blocks, num_kv_heads, head_dim, block_size]``: stored
  *transposed* inside a block, so a block is already the ``[head_dim,
  tokens]`` right-hand side of the ``q @ k`` scores matmul;
- values ``[num_blocks, num_kv_heads, block_size, head_dim]``: row-major,
  the ``[tokens, head_dim]`` right-hand side of ``p @ v``.

Why this order: decode attention is a batch of small matmuls, one per
(sequence, KV head). Gathering ``cache[block_ids]`` copies whole blocks
(all KV heads of a block are one contiguous run: 64 KiB of keys for
llama-56m at 64 tokens per block) and yields ``[rows, kv_heads, head_dim,
block_size]``, whose leading axes are the batch axes of both matmuls: with
one block per attention chunk no transpose is materialised anywhere.
Measured on a 2-core host for 64 sequences x 193 tokens x 8 layers
(llama-56m shapes, blocks in random order): 22.7 ms with the earlier
``[kv_heads, layers, blocks, ...]`` layout and 16-token blocks (whose
gathers XLA fused with a transpose), 14.9 ms with this layout and 32-token
blocks, 12.3 ms with 64-token blocks.

Why one array per layer rather than one stacked ``[layers, ...]`` array: a
matmul can read a whole per-layer array in place, while a layer's slice of
a stacked array (inside a ``scan`` over layers) is first copied by XLA. The
"block-major" decode attention (``paged_attention.py``) multiplies every
block of the layer's cache by the query of the sequence owning it, reading
the cache once with no gather: 22.6 ms instead of 26.6 ms for the whole
forward of 64 decode tokens at 193 tokens of context (8 layers). The model
therefore runs its layers as an unrolled Python loop over per-layer weights
and caches.

The functions below also accept a *stacked* cache (``[layers, ...]`` in
front, as ``cache_shapes`` and ``keys_from_slots`` produce) with a layer
index, for tests and tools.

Block 0 is the null block: padding tokens write their keys/values there and
block tables are padded with 0, but no sequence ever owns it, so whatever it
holds is never read as valid context. An allocator must hand out blocks
``1 .. num_blocks - 1`` only.

``KVCache`` is a pytree (the per-layer arrays are leaves, ``block_size`` and
``dtype`` are static metadata), so it can be passed through ``jax.jit`` and
donated (``donate_argnames=("kv_cache",)``) to make the per-step writes in place.
``keys_from_slots``/``values_from_slots`` and their inverses convert to and
from the plain per-slot form ``[..., slots, kv_heads, head_dim]`` (tests,
debugging, migrations).

Storage dtype
-------------
``dtype`` is the cache's logical element type. 16-bit floats (bfloat16,
float16) are *stored* as their raw bits in ``uint16`` arrays: XLA's CPU
backend "normalises" a bfloat16 scatter or gather by converting the whole
operand to float32, which turns the in-place cache write into a full copy of
the cache per step (measured here: 0.01 ms -> 500+ ms for a 0.5 GB cache), and
a bitcast of the whole array is materialised as a copy too. Moving raw bits
costs nothing on any backend; ``write_kv``/``paged_attention`` bitcast only
the new rows and the gathered chunks. So ``k.dtype`` is the storage dtype
(``uint16`` for a bfloat16 cache); use ``KVCache.dtype`` for the logical one.

The ``heads`` layout (accelerator kernels)
------------------------------------------
``KVCache.layout`` names the arrays' layout. ``"blocks"`` (the default) is
the one above. ``"heads"`` is the layout of the paged-attention kernels JAX
ships in Pallas (``jax.experimental.pallas.ops.gpu.paged_attention`` and
``...ops.tpu.paged_attention``): keys and values alike ``[num_kv_heads,
num_blocks, block_size, head_dim]``, so those kernels read the cache in
place (``pallas_attention.py``). Converting per step instead would copy
every layer's whole cache each step. A ``heads`` cache stores its logical
dtype as it is (bfloat16 as bfloat16): the uint16 trick is a CPU-only
workaround and accelerator kernels want typed operands. The pure-JAX kernels
read both layouts (``paged_attention(..., layout=...)``); only the CPU's
default, ``blocks``, has the block-major decode path.

int8 caches (``--kv-cache-dtype int8``)
---------------------------------------
An ``int8`` cache stores each layer's keys and values as
:class:`QuantizedPages`: int8 arrays in the layout's shape, and a float32
scale per (token, kv head), the arrays' shape without ``head_dim``
(``blocks``: ``[num_blocks, num_kv_heads, block_size]`` for keys and values
alike; ``heads``: ``[num_kv_heads, num_blocks, block_size]``). A token's
head vector ``x`` (``head_dim`` floats) is stored as ``rint(x / s)`` with
``s = max|x| / 127`` (:func:`quantize_kv`) and read as ``q * s``
(:func:`dequantize_kv`).

Why one scale per token and kv head, not per block: a block is written a
few tokens at a time (prefill chunks of any length, then one token per
decode step), and a block-wide scale fixed by its first tokens would clip
later ones, while one that grows would re-quantize (and round again) what
is already stored, so a block's contents would depend on how its tokens
were chunked. A per-token scale depends on that token's vector alone: the
same keys give the same bytes whatever the chunking, so prefix-cache
sharing, a fork's block copy and a preempted request's recompute read what
an uninterrupted run wrote (``tests/test_kv_int8.py``). It also matches the
scale layout of JAX's GPU paged kernel (``[kv_heads, pages, page_size]``,
applied to scores and weights), which so reads the ``heads`` cache in place.
The kernels fold the scales into the scores (``q . k_int * s_k``) and the
softmax weights (``p * s_v``) instead of dequantizing every element.

Bytes per token and kv head: ``head_dim + 4`` against ``4 * head_dim``
(float32) and ``2 * head_dim`` (bfloat16): 68 against 256 and 128 at
``head_dim`` 64, 0.27x and 0.53x (:func:`bytes_per_block` counts the scales).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

NULL_BLOCK = 0

#: cache layouts: see the module docstring
LAYOUTS = ("blocks", "heads")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown KV cache layout {layout!r}; known: {', '.join(LAYOUTS)}")
    return layout


#: the dtype of an int8 cache's scales (one per token and kv head)
SCALE_DTYPE = jnp.float32
#: an int8 cache stores a head vector's largest magnitude as this integer
INT8_MAX = 127.0


def is_quantized(dtype) -> bool:
    """Whether a cache of logical ``dtype`` is stored as :class:`QuantizedPages` (int8)."""
    return dtype is not None and jnp.dtype(dtype) == jnp.dtype(jnp.int8)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """One layer's int8 keys or values (``q``, in the layout's shape) and
    their float32 scales (``scale``: one per token and kv head, the shape
    of ``q`` without its ``head_dim`` axis; see the module docstring). A
    pytree, so it travels through ``jit``, ``shard_map`` and donation like
    the plain arrays of a float cache; ``shape``/``dtype`` are ``q``'s."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.q.dtype)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)


def scale_axis(layout: str, keys: bool) -> int:
    """The (negative) axis of an array of ``layout`` that an int8 cache's
    scale does not have: ``head_dim`` (second to last for ``blocks`` keys,
    stored transposed; last otherwise)."""
    return -2 if check_layout(layout) == "blocks" and keys else -1


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x`` ``[..., head_dim]`` -> int8 ``rint(x / s)`` and float32 scales
    ``s = max|x| * float32(1 / 127)`` ``[...]`` (a zero vector: scale 0,
    zeros). Each vector's bytes depend on that vector alone (module
    docstring). The scale is a product, not ``max|x| / 127``: XLA rewrites a
    division by a constant into that product itself, so spelling it so
    keeps every backend and the numpy reference (``tests/test_kv_int8.py``)
    on the same float32 bits."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) * jnp.float32(1.0 / INT8_MAX)
    safe = jnp.where(scale > 0.0, scale, 1.0)
    q = jnp.clip(jnp.round(x / safe[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def dequantize_kv(q: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 ``q * scale`` (``scale`` broadcast over the last axis of ``q``)."""
    return q.astype(jnp.float32) * scale[..., None]


def storage_dtype(dtype, layout: str = "blocks") -> jnp.dtype:
    """The array dtype a cache of logical ``dtype`` is stored in (``layout``:
    16-bit floats become ``uint16`` bits in the ``blocks`` layout only)."""
    d = jnp.dtype(dtype)
    if check_layout(layout) == "blocks" and d.itemsize == 2 and jnp.issubdtype(d, jnp.floating):
        return jnp.dtype(jnp.uint16)
    return d


def to_storage(x: jax.Array, dtype) -> jax.Array:
    """Cast ``x`` to the logical ``dtype`` and then to its storage form."""
    x = x.astype(dtype)
    st = storage_dtype(dtype)
    return x if st == x.dtype else jax.lax.bitcast_convert_type(x, st)


def from_storage(x: jax.Array, dtype) -> jax.Array:
    """View stored cache elements as the logical ``dtype`` (a bitcast for 16-bit floats)."""
    d = jnp.dtype(dtype)
    return x if x.dtype == d else jax.lax.bitcast_convert_type(x, d)


def logical_dtype(storage: jax.Array | jnp.dtype, dtype=None) -> jnp.dtype:
    """Logical dtype of cache storage: ``dtype`` if given, else bfloat16 for uint16
    storage and the storage dtype otherwise."""
    if dtype is not None:
        return jnp.dtype(dtype)
    st = jnp.dtype(getattr(storage, "dtype", storage))
    return jnp.dtype(jnp.bfloat16) if st == jnp.dtype(jnp.uint16) else st


def layer_shapes(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, layout: str = "blocks"
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one layer's key and value arrays (see the module docstring)."""
    if check_layout(layout) == "heads":
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        return shape, shape
    return (num_blocks, num_kv_heads, head_dim, block_size), (num_blocks, num_kv_heads, block_size, head_dim)


def blocks_to_heads(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One layer's ``blocks``-layout key/value arrays -> the ``heads`` layout
    ``[kv_heads, blocks, block_size, head_dim]`` (tests and conversions)."""
    return jnp.transpose(k, (1, 0, 3, 2)), jnp.transpose(v, (1, 0, 2, 3))


def heads_to_blocks(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of ``blocks_to_heads``."""
    return jnp.transpose(k, (1, 0, 3, 2)), jnp.transpose(v, (1, 0, 2, 3))


def scale_shape(num_blocks: int, block_size: int, num_kv_heads: int, layout: str = "blocks") -> tuple[int, ...]:
    """Shape of one layer's key (and value) scales in an int8 cache."""
    if check_layout(layout) == "heads":
        return (num_kv_heads, num_blocks, block_size)
    return (num_blocks, num_kv_heads, block_size)


def _drop_axis(sharding, axis: int, ndim: int):
    """``sharding`` of an ``ndim`` array, for the array without ``axis`` (a
    scale beside its int8 values); shardings other than named ones as they are."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    kept = spec[: axis % ndim] + spec[axis % ndim + 1 :]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*kept))


def cache_shapes(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of *stacked* key and value arrays: a layer axis in front of ``layer_shapes``."""
    k, v = layer_shapes(num_blocks, block_size, num_kv_heads, head_dim)
    return (num_layers, *k), (num_layers, *v)


def values_from_slots(x: jax.Array, block_size: int) -> jax.Array:
    """Per-slot values ``[..., slots, kv_heads, head_dim]`` -> ``v`` storage layout
    ``[..., blocks, kv_heads, block_size, head_dim]``."""
    *lead, slots, kvh, d = x.shape
    if slots % block_size:
        raise ValueError(f"{slots} slots are not a whole number of blocks of {block_size}")
    return jnp.swapaxes(x.reshape(*lead, slots // block_size, block_size, kvh, d), -3, -2)


def keys_from_slots(x: jax.Array, block_size: int) -> jax.Array:
    """Per-slot keys ``[..., slots, kv_heads, head_dim]`` -> ``k`` storage layout
    ``[..., blocks, kv_heads, head_dim, block_size]``."""
    return jnp.swapaxes(values_from_slots(x, block_size), -1, -2)


def values_to_slots(v: jax.Array) -> jax.Array:
    """``v`` storage layout -> per-slot ``[..., slots, kv_heads, head_dim]``."""
    *lead, nb, kvh, bs, d = v.shape
    return jnp.swapaxes(v, -3, -2).reshape(*lead, nb * bs, kvh, d)


def keys_to_slots(k: jax.Array) -> jax.Array:
    """``k`` storage layout -> per-slot ``[..., slots, kv_heads, head_dim]``."""
    return values_to_slots(jnp.swapaxes(k, -1, -2))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The paged cache: one key and one value array per layer (an int8
    cache's are :class:`QuantizedPages`, which quack like arrays for
    ``shape`` and ``dtype``)."""

    k: tuple[Any, ...]
    v: tuple[Any, ...]
    block_size: int = dataclasses.field(metadata=dict(static=True), default=16)
    #: logical element dtype name ("float32", "bfloat16", ...); None: derived from the storage
    dtype_name: str | None = dataclasses.field(metadata=dict(static=True), default=None)
    #: array layout, ``"blocks"`` or ``"heads"`` (module docstring)
    layout: str = dataclasses.field(metadata=dict(static=True), default="blocks")

    def __post_init__(self):
        # lists, generators or a stacked array's layers become tuples, so the
        # pytree structure is stable
        object.__setattr__(self, "k", tuple(self.k))
        object.__setattr__(self, "v", tuple(self.v))
        check_layout(self.layout)

    @property
    def dtype(self) -> jnp.dtype:
        """Logical element dtype (``k[i].dtype`` is the storage dtype)."""
        return logical_dtype(self.k[0], self.dtype_name)

    def replace(self, k, v) -> KVCache:
        return dataclasses.replace(self, k=k, v=v)

    @classmethod
    def create(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=jnp.float32,
        *,
        sharding: jax.sharding.Sharding | None = None,
        layout: str = "blocks",
    ) -> KVCache:
        """Zero-filled cache of ``num_blocks`` blocks (block 0 included);
        ``sharding`` places every layer's arrays (tensor parallelism shards
        them on the kv-heads axis, ``jaxserve.models.sharding``)."""
        if num_blocks < 2:
            raise ValueError("a KV cache needs at least 2 blocks (block 0 is the null block)")
        k_shape, v_shape = layer_shapes(num_blocks, block_size, num_kv_heads, head_dim, layout)
        st = storage_dtype(dtype, layout)
        if is_quantized(dtype):
            s_shape = scale_shape(num_blocks, block_size, num_kv_heads, layout)

            def pages(shape, keys: bool) -> QuantizedPages:
                s_sharding = _drop_axis(sharding, scale_axis(layout, keys), len(shape))
                return QuantizedPages(
                    jnp.zeros(shape, st, device=sharding), jnp.zeros(s_shape, SCALE_DTYPE, device=s_sharding)
                )

            kq = tuple(pages(k_shape, True) for _ in range(num_layers))
            vq = tuple(pages(v_shape, False) for _ in range(num_layers))
            return cls(k=kq, v=vq, block_size=block_size, dtype_name=jnp.dtype(dtype).name, layout=layout)
        k = tuple(jnp.zeros(k_shape, st, device=sharding) for _ in range(num_layers))
        v = tuple(jnp.zeros(v_shape, st, device=sharding) for _ in range(num_layers))
        return cls(k=k, v=v, block_size=block_size, dtype_name=jnp.dtype(dtype).name, layout=layout)

    @classmethod
    def abstract(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=jnp.float32,
        *,
        layout: str = "blocks",
    ) -> KVCache:
        """Shape-only cache (``jax.ShapeDtypeStruct`` leaves) for ``jit(...).lower``."""
        k_shape, v_shape = layer_shapes(num_blocks, block_size, num_kv_heads, head_dim, layout)
        st = storage_dtype(dtype, layout)
        # a ShapeDtypeStruct stands for an array of that shape when lowering
        spec = cast("Callable[..., jax.Array]", jax.ShapeDtypeStruct)
        if is_quantized(dtype):
            s_shape = scale_shape(num_blocks, block_size, num_kv_heads, layout)
            return cls(
                k=tuple(QuantizedPages(spec(k_shape, st), spec(s_shape, SCALE_DTYPE)) for _ in range(num_layers)),
                v=tuple(QuantizedPages(spec(v_shape, st), spec(s_shape, SCALE_DTYPE)) for _ in range(num_layers)),
                block_size=block_size,
                dtype_name=jnp.dtype(dtype).name,
                layout=layout,
            )
        return cls(
            k=tuple(spec(k_shape, st) for _ in range(num_layers)),
            v=tuple(spec(v_shape, st) for _ in range(num_layers)),
            block_size=block_size,
            dtype_name=jnp.dtype(dtype).name,
            layout=layout,
        )

    @classmethod
    def from_stacked(cls, k: jax.Array, v: jax.Array, block_size: int, dtype=None) -> KVCache:
        """From stacked ``[layers, ...]`` storage arrays (``cache_shapes``;
        :class:`QuantizedPages` of stacked arrays for an int8 cache)."""
        name = None if dtype is None else jnp.dtype(dtype).name
        if isinstance(k, QuantizedPages) and isinstance(v, QuantizedPages):
            ks = tuple(QuantizedPages(k.q[i], k.scale[i]) for i in range(k.q.shape[0]))
            vs = tuple(QuantizedPages(v.q[i], v.scale[i]) for i in range(v.q.shape[0]))
            return cls(k=ks, v=vs, block_size=block_size, dtype_name=name or "int8")
        return cls(k=tuple(k), v=tuple(v), block_size=block_size, dtype_name=name)

    def stacked(self) -> tuple[jax.Array, jax.Array]:
        """Stacked ``[layers, ...]`` copies of the key and value storage
        (:class:`QuantizedPages` of stacked arrays for an int8 cache)."""
        if isinstance(self.k[0], QuantizedPages):
            stack = lambda *xs: jnp.stack(xs)  # noqa: E731
            return jax.tree.map(stack, *self.k), jax.tree.map(stack, *self.v)
        return jnp.stack(self.k), jnp.stack(self.v)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[1 if self.layout == "heads" else 0]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_kv_heads(self) -> int:
        return self.k[0].shape[0 if self.layout == "heads" else 1]

    @property
    def head_dim(self) -> int:
        return self.v[0].shape[-1]

    @property
    def quantized(self) -> bool:
        """An int8 cache (its layers are :class:`QuantizedPages`)."""
        return isinstance(self.k[0], QuantizedPages)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's arrays, an int8 cache's scales included."""
        if self.quantized:
            return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves((self.k, self.v)))
        return 2 * self.num_layers * int(np.prod(self.k[0].shape)) * jnp.dtype(self.k[0].dtype).itemsize

    def read_slots(self, layer: int, slots) -> tuple[jax.Array, jax.Array]:
        """Keys and values ``[n, kv_heads, head_dim]`` (logical dtype; an
        int8 cache's dequantized to float32) held at ``slots`` of ``layer``."""
        slots = jnp.asarray(slots, jnp.int32)
        blk, off = slots // self.block_size, slots % self.block_size
        if self.quantized:
            kp, vp = cast(QuantizedPages, self.k[layer]), cast(QuantizedPages, self.v[layer])
            if self.layout == "heads":  # [kvh, n, ...] -> [n, kvh, ...]
                kq, ks = jnp.swapaxes(kp.q[:, blk, off], 0, 1), jnp.swapaxes(kp.scale[:, blk, off], 0, 1)
                vq, vs = jnp.swapaxes(vp.q[:, blk, off], 0, 1), jnp.swapaxes(vp.scale[:, blk, off], 0, 1)
            else:
                kq, ks = kp.q[blk, :, :, off], kp.scale[blk, :, off]
                vq, vs = vp.q[blk, :, off], vp.scale[blk, :, off]
            return dequantize_kv(kq, ks), dequantize_kv(vq, vs)
        if self.layout == "heads":
            k = jnp.swapaxes(self.k[layer][:, blk, off], 0, 1)  # [kvh, n, D] -> [n, kvh, D]
            v = jnp.swapaxes(self.v[layer][:, blk, off], 0, 1)
            return from_storage(k, self.dtype), from_storage(v, self.dtype)
        k = from_storage(self.k[layer][blk, :, :, off], self.dtype)  # [n, kvh, D]
        v = from_storage(self.v[layer][blk, :, off], self.dtype)  # [n, kvh, D]
        return k, v


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> int:
    """Bytes one block takes over all layers, keys and values together (an
    int8 cache's float32 scales included: ``head_dim + 4`` bytes per token
    and kv head)."""
    per_head = head_dim * jnp.dtype(dtype).itemsize
    if is_quantized(dtype):
        per_head += jnp.dtype(SCALE_DTYPE).itemsize
    return 2 * num_layers * block_size * num_kv_heads * per_head


def num_blocks_for_budget(
    budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32
) -> int:
    """How many blocks (null block included) fit in ``budget_bytes``."""
    return int(budget_bytes) // bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
