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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import cast

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
    """The paged cache: one key and one value array per layer."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
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
        return cls(
            k=tuple(spec(k_shape, st) for _ in range(num_layers)),
            v=tuple(spec(v_shape, st) for _ in range(num_layers)),
            block_size=block_size,
            dtype_name=jnp.dtype(dtype).name,
            layout=layout,
        )

    @classmethod
    def from_stacked(cls, k: jax.Array, v: jax.Array, block_size: int, dtype=None) -> KVCache:
        """From stacked ``[layers, ...]`` storage arrays (``cache_shapes``)."""
        name = None if dtype is None else jnp.dtype(dtype).name
        return cls(k=tuple(k), v=tuple(v), block_size=block_size, dtype_name=name)

    def stacked(self) -> tuple[jax.Array, jax.Array]:
        """Stacked ``[layers, ...]`` copies of the key and value storage."""
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
    def nbytes(self) -> int:
        return 2 * self.num_layers * int(np.prod(self.k[0].shape)) * jnp.dtype(self.k[0].dtype).itemsize

    def read_slots(self, layer: int, slots) -> tuple[jax.Array, jax.Array]:
        """Keys and values ``[n, kv_heads, head_dim]`` (logical dtype) held at ``slots`` of ``layer``."""
        slots = jnp.asarray(slots, jnp.int32)
        blk, off = slots // self.block_size, slots % self.block_size
        if self.layout == "heads":
            k = jnp.swapaxes(self.k[layer][:, blk, off], 0, 1)  # [kvh, n, D] -> [n, kvh, D]
            v = jnp.swapaxes(self.v[layer][:, blk, off], 0, 1)
            return from_storage(k, self.dtype), from_storage(v, self.dtype)
        k = from_storage(self.k[layer][blk, :, :, off], self.dtype)  # [n, kvh, D]
        v = from_storage(self.v[layer][blk, :, off], self.dtype)  # [n, kvh, D]
        return k, v


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> int:
    """Bytes one block takes over all layers, keys and values together."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def num_blocks_for_budget(
    budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32
) -> int:
    """How many blocks (null block included) fit in ``budget_bytes``."""
    return int(budget_bytes) // bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
