"""Physical paged KV cache storage (device arrays only; no allocator here).

Layout
------
``k`` and ``v`` each have shape ``[num_layers, num_blocks * block_size,
num_kv_heads, head_dim]``: for every layer, a flat array of *slots*. Block
``b`` owns slots ``b * block_size ... b * block_size + block_size - 1``, and
the token at position ``p`` of a sequence whose block table is ``bt`` lives in
slot ``bt[p // block_size] * block_size + p % block_size``.

Block 0 is the null block: padding tokens write their keys/values there and
block tables are padded with 0, but no sequence ever owns it, so whatever it
holds is never read as valid context. An allocator must hand out blocks
``1 .. num_blocks - 1`` only.

``KVCache`` is a pytree (``k``, ``v`` are leaves, ``block_size`` and
``dtype`` are static metadata), so it can be passed through ``jax.jit`` and
donated (``donate_argnames=("kv_cache",)``) to make the per-step writes in place.

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
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        st = storage_dtype(dtype)
        k = jnp.zeros(shape, st, device=sharding)
        v = jnp.zeros(shape, st, device=sharding)
        return cls(k=k, v=v, block_size=block_size, dtype_name=jnp.dtype(dtype).name)

    @classmethod
    def abstract(
        cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32
    ) -> "KVCache":
        """Shape-only cache (``jax.ShapeDtypeStruct`` leaves) for ``jit(...).lower``."""
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        s = jax.ShapeDtypeStruct(shape, storage_dtype(dtype))
        return cls(k=s, v=s, block_size=block_size, dtype_name=jnp.dtype(dtype).name)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1] // self.block_size

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return 2 * int(np.prod(self.k.shape)) * jnp.dtype(self.k.dtype).itemsize


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> int:
    """Bytes one block takes over all layers, keys and values together."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def num_blocks_for_budget(
    budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32
) -> int:
    """How many blocks (null block included) fit in ``budget_bytes``."""
    return int(budget_bytes) // bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
