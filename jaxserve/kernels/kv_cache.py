"""Physical paged KV cache storage (device arrays only; no allocator here).

Layout
------
Per layer and KV head the cache is a sequence of fixed-size blocks; block
``b`` holds the keys/values of ``block_size`` consecutive positions of one
sequence. The token at position ``p`` of a sequence whose block table is
``bt`` lives in block ``bt[p // block_size]`` at offset ``p % block_size``
(its *slot* is ``block * block_size + offset``, the unit ``slot_mapping``
counts in).

- ``k``: ``[num_layers, num_blocks, num_kv_heads, head_dim, block_size]``:
  keys are stored *transposed* inside a block, so a gathered block is
  already the ``[head_dim, tokens]`` right-hand side of the ``q @ k``
  scores matmul;
- ``v``: ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``:
  values row-major, the ``[tokens, head_dim]`` right-hand side of ``p @ v``.

Why this order: decode attention is a batch of small matmuls, one per
(sequence, KV head), over keys gathered through the block table. Gathering
``cache[layer, block_ids]`` copies whole blocks (all KV heads of a block
are one contiguous run: 32 KiB for llama-56m at 64 tokens per block) and
yields ``[rows, kv_heads, head_dim, block_size]``, whose leading axes are
the batch axes of both matmuls: with one block per attention chunk no
transpose is materialised anywhere. Measured on a 2-core host for 64
sequences x 193 tokens x 8 layers (llama-56m shapes, blocks in random
order): 22.7 ms with the previous ``[kv_heads, layers, blocks, ...]``
layout and 16-token blocks (whose gathers XLA fused with a transpose),
14.9 ms with this layout and 32-token blocks, 12.3 ms with 64-token blocks.
The layer axis leads so that one layer's blocks are one region of memory.

Block 0 is the null block: padding tokens write their keys/values there and
block tables are padded with 0, but no sequence ever owns it, so whatever it
holds is never read as valid context. An allocator must hand out blocks
``1 .. num_blocks - 1`` only.

``KVCache`` is a pytree (``k``, ``v`` are leaves, ``block_size`` and
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
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

NULL_BLOCK = 0


def storage_dtype(dtype) -> jnp.dtype:
    """The array dtype a cache of logical ``dtype`` is stored in."""
    d = jnp.dtype(dtype)
    if d.itemsize == 2 and jnp.issubdtype(d, jnp.floating):
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


def cache_shapes(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the ``k`` and ``v`` storage arrays (see the module docstring)."""
    k = (num_layers, num_blocks, num_kv_heads, head_dim, block_size)
    v = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
    return k, v


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
    k: jax.Array
    v: jax.Array
    block_size: int = dataclasses.field(metadata=dict(static=True), default=16)
    #: logical element dtype name ("float32", "bfloat16", ...); None: derived from the storage
    dtype_name: str | None = dataclasses.field(metadata=dict(static=True), default=None)

    @property
    def dtype(self) -> jnp.dtype:
        """Logical element dtype (``k.dtype`` is the storage dtype)."""
        return logical_dtype(self.k, self.dtype_name)

    def replace(self, k: jax.Array, v: jax.Array) -> "KVCache":
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
    ) -> "KVCache":
        """Zero-filled cache of ``num_blocks`` blocks (block 0 included)."""
        if num_blocks < 2:
            raise ValueError("a KV cache needs at least 2 blocks (block 0 is the null block)")
        k_shape, v_shape = cache_shapes(num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        st = storage_dtype(dtype)
        k = jnp.zeros(k_shape, st, device=sharding)
        v = jnp.zeros(v_shape, st, device=sharding)
        return cls(k=k, v=v, block_size=block_size, dtype_name=jnp.dtype(dtype).name)

    @classmethod
    def abstract(
        cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32
    ) -> "KVCache":
        """Shape-only cache (``jax.ShapeDtypeStruct`` leaves) for ``jit(...).lower``."""
        k_shape, v_shape = cache_shapes(num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        st = storage_dtype(dtype)
        return cls(
            k=jax.ShapeDtypeStruct(k_shape, st),
            v=jax.ShapeDtypeStruct(v_shape, st),
            block_size=block_size,
            dtype_name=jnp.dtype(dtype).name,
        )

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.v.shape[-1]

    @property
    def nbytes(self) -> int:
        return 2 * int(np.prod(self.k.shape)) * jnp.dtype(self.k.dtype).itemsize

    def read_slots(self, layer: int, slots) -> tuple[jax.Array, jax.Array]:
        """Keys and values ``[n, kv_heads, head_dim]`` (logical dtype) held at ``slots`` of ``layer``."""
        slots = jnp.asarray(slots, jnp.int32)
        blk, off = slots // self.block_size, slots % self.block_size
        k = from_storage(self.k[layer, blk, :, :, off], self.dtype)  # [n, kvh, D]
        v = from_storage(self.v[layer, blk, :, off], self.dtype)  # [n, kvh, D]
        return k, v


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> int:
    """Bytes one block takes over all layers, keys and values together."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def num_blocks_for_budget(
    budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32
) -> int:
    """How many blocks (null block included) fit in ``budget_bytes``."""
    return int(budget_bytes) // bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
