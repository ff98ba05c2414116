"""Pure-JAX paged attention: the default kernel on every backend and the test oracle.

One step is a flat batch of ``T`` tokens from up to ``S`` sequences (see
``attention_metadata.py``). Each token attends to the keys of its own
sequence at positions ``<= positions[t]`` and ``< context_lens[seq]``
(and, with a sliding window ``W``, ``> positions[t] - W``).

Algorithm
---------
The context is walked in chunks of ``chunk_blocks`` KV blocks with an online
(flash style) softmax. The trip count is dynamic,
``ceil(max visible context / chunk_tokens)``, through ``lax.fori_loop``, so
work follows the real context length of the step and the block-table width
``M`` never needs a context-length shape bucket of its own (only its maximum
matters). Per chunk every token gathers its own sequence's block-table
columns (``block_tables[token_seq]``), turns them into slots and gathers keys
and values ``[T, chunk_tokens, kv_heads, head_dim]``. Grouped-query attention
reshapes the query heads into ``[kv_heads, group]``. Scores, the running max,
the normaliser and the accumulator are float32; the matmuls run in the cache
dtype with float32 accumulation.

The cache may be given per layer (``[slots, kv_heads, head_dim]``) or as the
whole stacked cache (``[layers, slots, kv_heads, head_dim]``) with a (traced)
``layer`` index: the latter gathers and scatters straight into the big array,
so that inside a ``scan`` over layers no per-layer copy of the cache is made.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.kv_cache import from_storage, logical_dtype, to_storage

_NEG = -1e30
# Bytes of gathered keys per chunk the default chunk size aims at. On the CPU a
# chunk's keys and values should stay in cache between the gather and the two
# matmuls (measured on a 2-core host: 2 MiB chunks ran 2-4x faster than 16 MiB
# ones); accelerators prefer fewer, bigger loop iterations.
_CHUNK_BYTES_CPU = 2 * 1024 * 1024
_CHUNK_BYTES_ACCEL = 32 * 1024 * 1024
_MAX_CHUNK_TOKENS = 4096


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    cache_dtype=None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's keys/values ``[T, kv_heads, head_dim]`` into their slots.

    ``k_cache``/``v_cache`` are storage arrays (see ``kv_cache.py``) of shape
    ``[slots, kvh, hd]``, or ``[layers, slots, kvh, hd]`` with ``layer`` given;
    ``cache_dtype`` is their logical dtype (default: bfloat16 for uint16
    storage, else the storage dtype). Slots out of range are dropped (padding
    may use either a block-0 slot or an out-of-range slot).
    """
    dtype = logical_dtype(k_cache, cache_dtype)

    def scatter(cache, new):
        new = to_storage(new, dtype)
        if layer is None:
            return cache.at[slot_mapping].set(new, mode="drop")
        return cache.at[layer, slot_mapping].set(new, mode="drop")

    return scatter(k_cache, k_new), scatter(v_cache, v_new)


def default_chunk_tokens(
    num_tokens: int, num_kv_heads: int, head_dim: int, itemsize: int, block_size: int, backend: str | None = None
) -> int:
    """Chunk length (a multiple of ``block_size``) keeping one chunk's gathered keys
    near a per-backend byte target: long chunks for small steps, short ones for big
    prefills. ``backend`` defaults to ``jax.default_backend()``."""
    backend = backend or jax.default_backend()
    budget = _CHUNK_BYTES_CPU if backend == "cpu" else _CHUNK_BYTES_ACCEL
    per_key = max(1, num_tokens * num_kv_heads * head_dim * itemsize)
    tokens = min(_MAX_CHUNK_TOKENS, max(block_size, budget // per_key))
    return max(block_size, tokens // block_size * block_size)


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    meta: AttentionMetadata,
    positions: jax.Array,
    *,
    block_size: int,
    scale: float,
    layer: jax.Array | int | None = None,
    sliding_window: int | None = None,
    chunk_tokens: int | None = None,
    cache_dtype=None,
) -> jax.Array:
    """Attention of ``q`` ``[T, heads, head_dim]`` over the paged cache.

    ``k_cache``/``v_cache`` are storage arrays (``[slots, kvh, hd]``, or
    ``[layers, slots, kvh, hd]`` with ``layer``) of logical dtype
    ``cache_dtype`` (see ``write_kv``). Returns ``[T, heads, head_dim]`` in
    ``q.dtype``. The cache must already hold this step's keys/values (call
    ``write_kv`` first). Tokens with no
    visible key (padding) get zeros.
    """
    T, H, D = q.shape
    kvh = k_cache.shape[-2]
    if H % kvh:
        raise ValueError(f"{H} query heads are not a multiple of {kvh} kv heads")
    G = H // kvh
    block_tables = meta.block_tables
    M = block_tables.shape[1]

    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(T, kvh, D, jnp.dtype(k_cache.dtype).itemsize, block_size)
    chunk_blocks = max(1, min(chunk_tokens // block_size, M))
    C = chunk_blocks * block_size
    n_max = -(-M // chunk_blocks)

    # Per-token view of the block tables, padded to whole chunks (padding -> block 0, masked anyway).
    bt_tok = block_tables[meta.token_seq]  # [T, M]
    if n_max * chunk_blocks != M:
        bt_tok = jnp.pad(bt_tok, ((0, 0), (0, n_max * chunk_blocks - M)))
    positions = positions.astype(jnp.int32)
    ctx_tok = meta.context_lens[meta.token_seq]
    limit = jnp.minimum(positions + 1, ctx_tok)  # keys at kpos < limit are visible
    if sliding_window is not None:
        lower = positions - (sliding_window - 1)  # keys at kpos >= lower are visible
        start = jnp.clip(jnp.min(jnp.maximum(lower, 0)) // C, 0, n_max)
    else:
        lower = None
        start = jnp.int32(0)
    stop = jnp.clip((jnp.max(limit) + C - 1) // C, 0, n_max)

    cdtype = logical_dtype(k_cache, cache_dtype)
    qg = (q.astype(jnp.float32) * scale).astype(cdtype).reshape(T, kvh, G, D)
    offs = jnp.arange(block_size, dtype=jnp.int32)
    kpos_in_chunk = jnp.arange(C, dtype=jnp.int32)

    def gather(cache, slots):
        out = cache[slots] if layer is None else cache[layer, slots]
        return from_storage(out, cdtype)

    def body(c, carry):
        m, l, acc = carry
        cols = jax.lax.dynamic_slice_in_dim(bt_tok, c * chunk_blocks, chunk_blocks, axis=1)  # [T, CB]
        slots = (cols[:, :, None] * block_size + offs).reshape(T, C)
        # [T, kvh, C, D]: kv heads next to the token batch dim, so both matmuls below are
        # plain batched GEMMs (XLA CPU is several times slower on the [T, C, kvh, D] order)
        k = jnp.swapaxes(gather(k_cache, slots), 1, 2)
        v = jnp.swapaxes(gather(v_cache, slots), 1, 2)
        s = jnp.einsum("tkgd,tkcd->tkgc", qg, k, preferred_element_type=jnp.float32)
        kpos = c * C + kpos_in_chunk
        valid = kpos[None, :] < limit[:, None]
        if lower is not None:
            valid = valid & (kpos[None, :] >= lower[:, None])
        valid = valid[:, None, None, :]
        s = jnp.where(valid, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
        l = l * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum("tkgc,tkcd->tkgd", p.astype(cdtype), v, preferred_element_type=jnp.float32)
        acc = acc * alpha[..., None] + pv
        return m_new, l, acc

    init = (
        jnp.full((T, kvh, G), _NEG, jnp.float32),
        jnp.zeros((T, kvh, G), jnp.float32),
        jnp.zeros((T, kvh, G, D), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(start, stop, body, init)
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
    return out.reshape(T, H, D).astype(q.dtype)


def dense_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    q_positions: jax.Array | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Dense reference for one sequence, float32 throughout.

    ``k``/``v`` ``[K, kv_heads, head_dim]`` are the sequence's keys at
    positions ``0..K-1``; ``q`` ``[T, heads, head_dim]`` sits at
    ``q_positions`` (default: the last ``T`` positions, ``K-T..K-1``).
    """
    T, H, D = q.shape
    K, kvh, _ = k.shape
    G = H // kvh
    if q_positions is None:
        q_positions = jnp.arange(K - T, K)
    qf = q.astype(jnp.float32).reshape(T, kvh, G, D)
    s = jnp.einsum("tkgd,ckd->tkgc", qf, k.astype(jnp.float32)) * scale
    kpos = jnp.arange(K)
    mask = kpos[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        mask = mask & (kpos[None, :] > q_positions[:, None] - sliding_window)
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("tkgc,ckd->tkgd", p, v.astype(jnp.float32))
    return out.reshape(T, H, D)


def make_slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Host helper: slots of ``positions`` of one sequence with ``block_table`` (numpy)."""
    positions = np.asarray(positions)
    return (np.asarray(block_table)[positions // block_size] * block_size + positions % block_size).astype(np.int32)


__all__ = [
    "paged_attention",
    "write_kv",
    "dense_causal_attention",
    "default_chunk_tokens",
    "make_slot_mapping",
]
