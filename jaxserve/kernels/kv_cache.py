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

``KVCache`` is a pytree (``k``, ``v`` are leaves, ``block_size`` is static
metadata), so it can be passed through ``jax.jit`` and donated
(``donate_argnames=("kv_cache",)``) to make the per-step writes in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

NULL_BLOCK = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array
    v: jax.Array
    block_size: int = dataclasses.field(metadata=dict(static=True), default=16)

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
        k = jnp.zeros(shape, dtype, device=sharding)
        v = jnp.zeros(shape, dtype, device=sharding)
        return cls(k=k, v=v, block_size=block_size)

    @classmethod
    def abstract(
        cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32
    ) -> "KVCache":
        """Shape-only cache (``jax.ShapeDtypeStruct`` leaves) for ``jit(...).lower``."""
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        s = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
        return cls(k=s, v=s, block_size=block_size)

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
