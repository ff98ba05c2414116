"""Pure-JAX paged attention: the default kernel on every backend and the test oracle.

One step is a flat batch of ``T`` tokens from up to ``S`` sequences (see
``attention_metadata.py``). Each token attends to the keys of its own
sequence at positions ``<= positions[t]`` and ``< context_lens[seq]``
(and, with a sliding window ``W``, ``> positions[t] - W``).

Algorithm
---------
The context is walked in chunks of KV blocks with an online (flash style)
softmax. The trip count is dynamic, ``ceil(max visible context /
chunk_tokens)``, through ``lax.fori_loop``, so work follows the real context
length of the step and the block-table width ``M`` needs no context-length
shape bucket of its own (only its maximum matters). Per chunk, rows gather
their sequence's block-table columns and copy those whole blocks of keys and
values out of the cache (``kv_cache.py`` explains the layout that makes
this a copy of contiguous blocks followed by two transpose-free batched
matmuls). A row is either a tile of consecutive tokens of one sequence
(which then reads its context once for the whole tile) or a single
"straggler" token (see ``paged_attention``). Grouped-query attention reshapes
the query heads into ``[kv_heads, group]``. Scores, the running max, the
normaliser and the accumulator are float32; the matmuls run in the cache
dtype with float32 accumulation.

Two per-layer features of the scores, both off by default (and then absent
from the traced program): ``logit_softcap`` (Gemma 2) turns each scaled score
``s`` into ``cap * tanh(s / cap)`` before the mask and the softmax, and
``sinks`` (gpt-oss), a float32 logit per query head, joins every row's
softmax as one more column that takes probability mass and adds no value:
the online softmax starts at max ``sink[h]`` and normaliser 1 instead of
``-inf`` and 0, so a row that sees no key still gets zeros.
:func:`dense_causal_attention` states both the way transformers computes them.

Block-major decode: when every sequence of the step has exactly one token
(and the metadata says so, see ``AttentionMetadata.block_major``), the
layer's whole cache is used as a matmul operand in place: each physical
block meets the query of the sequence owning it, the per-block partial
softmax results are merged per sequence through the block tables. No copy
of the context is made; the whole cache is read once, so the runner picks
it when the step's sequences hold most of the cache (``runner.py``).

The cache may be given per layer (``k`` ``[blocks, kv_heads, head_dim,
block_size]``, ``v`` ``[blocks, kv_heads, block_size, head_dim]``; the
model's form) or as a stacked cache (a leading layer axis) with a (traced)
``layer`` index, which gathers and scatters straight into the big array
(tests and tools; block-major attention needs the per-layer form).

``layout="heads"`` (``kv_cache.py``: ``[kv_heads, blocks, block_size,
head_dim]`` for keys and values, the Pallas kernels' layout) is read by the
same gathering kernel, the gathered blocks transposed into the operands
above (accelerators fuse that transpose into the gather); it is what
accelerator steps the Pallas kernels do not take run on
(``pallas_attention.py``). Per layer only, without block-major decode.

An int8 cache (``kv_cache.QuantizedPages``: int8 values, a float32 scale
per token and kv head) is read by every path above: the gathered int8
blocks are widened to the queries' dtype (exact), each score is multiplied
by its key's scale and each softmax weight by its value's scale before the
values' matmul (the normaliser keeps the unscaled weights), so no element
is dequantized on its own; ``write_kv`` quantizes each new token's vector by
itself (``tests/test_kv_int8.py``). Block-major decode converts the whole
int8 cache to the queries' dtype for its matmuls: a copy on the CPU (where
the C++ kernel serves by default), fused into the matmul by accelerators.

One module: the gathering walk, the tiled rows and block-major decode
are three paths of one :func:`paged_attention` call,
sharing its metadata and shape conventions, and the dense reference beside
them is what ``tests/test_paged_attention.py`` holds every path to.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.kv_cache import QuantizedPages, from_storage, logical_dtype, quantize_kv, to_storage

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
    layout: str = "blocks",
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's keys/values ``[T, kv_heads, head_dim]`` into their slots.

    ``k_cache``/``v_cache`` are storage arrays in the layout of
    ``kv_cache.py``, per layer or stacked with ``layer`` given;
    ``cache_dtype`` is their logical dtype (default: bfloat16 for uint16
    storage, else the storage dtype). Slots out of range are dropped (padding
    may use either a block-0 slot or an out-of-range slot). ``layout="heads"``:
    per-layer ``[kv_heads, blocks, block_size, head_dim]`` arrays.

    An int8 cache (:class:`~jaxserve.kernels.kv_cache.QuantizedPages`)
    gets each token's vector quantized on its own (``quantize_kv``) and its
    scale written beside it; nothing already stored is touched.
    """
    block_size = v_cache.shape[-2]
    blk = slot_mapping // block_size
    off = slot_mapping % block_size
    if isinstance(k_cache, QuantizedPages) and isinstance(v_cache, QuantizedPages):
        # (the same pytree type back: QuantizedPages in, QuantizedPages out)
        return cast(
            "tuple[jax.Array, jax.Array]", _write_quantized(k_cache, v_cache, k_new, v_new, blk, off, layer, layout)
        )
    dtype = logical_dtype(k_cache, cache_dtype)
    if layout == "heads":  # typed storage (kv_cache.py)
        if layer is not None:
            raise ValueError(f"the heads layout is per layer only, got layer={layer!r}")
        # adjacent advanced indices stay in place: the updates are [kvh, T, D]
        k_new = jnp.swapaxes(k_new.astype(dtype).astype(k_cache.dtype), 0, 1)
        v_new = jnp.swapaxes(v_new.astype(dtype).astype(v_cache.dtype), 0, 1)
        k_cache = k_cache.at[:, blk, off].set(k_new, mode="drop")
        v_cache = v_cache.at[:, blk, off].set(v_new, mode="drop")
        return k_cache, v_cache
    if layout != "blocks":
        raise ValueError(f"unknown KV cache layout {layout!r}")
    k_new = to_storage(k_new, dtype)  # [T, kvh, D]
    v_new = to_storage(v_new, dtype)
    # numpy indexing rules: block and offset indices separated by slices put the
    # token axis first, so both updates are [T, kvh, D] as given
    lead = () if layer is None else (layer,)
    k_cache = k_cache.at[(*lead, blk, slice(None), slice(None), off)].set(k_new, mode="drop")
    v_cache = v_cache.at[(*lead, blk, slice(None), off)].set(v_new, mode="drop")
    return k_cache, v_cache


def _write_quantized(
    k_cache: QuantizedPages,
    v_cache: QuantizedPages,
    k_new: jax.Array,
    v_new: jax.Array,
    blk: jax.Array,
    off: jax.Array,
    layer,
    layout: str,
) -> tuple[QuantizedPages, QuantizedPages]:
    """``write_kv`` for an int8 cache: values and scales scattered alike."""
    kq, ks = quantize_kv(k_new)  # [T, kvh, D], [T, kvh]
    vq, vs = quantize_kv(v_new)
    if layout == "heads":
        if layer is not None:
            raise ValueError(f"the heads layout is per layer only, got layer={layer!r}")
        # [kvh, T, D] and [kvh, T] updates (adjacent advanced indices stay in place)
        k_out = QuantizedPages(
            k_cache.q.at[:, blk, off].set(jnp.swapaxes(kq, 0, 1), mode="drop"),
            k_cache.scale.at[:, blk, off].set(jnp.swapaxes(ks, 0, 1), mode="drop"),
        )
        v_out = QuantizedPages(
            v_cache.q.at[:, blk, off].set(jnp.swapaxes(vq, 0, 1), mode="drop"),
            v_cache.scale.at[:, blk, off].set(jnp.swapaxes(vs, 0, 1), mode="drop"),
        )
        return k_out, v_out
    if layout != "blocks":
        raise ValueError(f"unknown KV cache layout {layout!r}")
    lead = () if layer is None else (layer,)
    # token axis first in every update, as in write_kv
    k_out = QuantizedPages(
        k_cache.q.at[(*lead, blk, slice(None), slice(None), off)].set(kq, mode="drop"),
        k_cache.scale.at[(*lead, blk, slice(None), off)].set(ks, mode="drop"),
    )
    v_out = QuantizedPages(
        v_cache.q.at[(*lead, blk, slice(None), off)].set(vq, mode="drop"),
        v_cache.scale.at[(*lead, blk, slice(None), off)].set(vs, mode="drop"),
    )
    return k_out, v_out


def visible_keys(
    meta: AttentionMetadata, positions: jax.Array, sliding_window: int | None
) -> tuple[jax.Array, jax.Array | None]:
    """Per token, the key positions it sees: ``lower <= kpos < limit``
    (``lower`` is ``None`` without a sliding window). Padding tokens belong
    to a row of context 0 and see nothing."""
    positions = positions.astype(jnp.int32)
    limit = jnp.minimum(positions + 1, meta.context_lens[meta.token_seq])
    lower = None if sliding_window is None else positions - (sliding_window - 1)
    return limit, lower


def check_features(logit_softcap: float | None, sinks: jax.Array | None, num_heads: int) -> None:
    """Raise ``ValueError`` for a soft-cap that is not a positive number or
    sinks that are not one logit per query head (``[num_heads]``)."""
    if logit_softcap is not None and not (isinstance(logit_softcap, numbers.Real) and logit_softcap > 0):
        raise ValueError(f"logit_softcap must be a positive Python float or None, got {logit_softcap!r}")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must hold one logit per query head, [{num_heads}], got {list(sinks.shape)}")


def soft_cap(s: jax.Array, logit_softcap: float | None) -> jax.Array:
    """``cap * tanh(s / cap)`` (identity for ``None``): Gemma 2's attention logit soft-capping."""
    return s if logit_softcap is None else logit_softcap * jnp.tanh(s / logit_softcap)


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


def default_query_tiles(num_tokens: int) -> tuple[int, ...]:
    """Tile sizes tried for a step of ``num_tokens`` tokens: 64 then 16 for big
    (prefill-sized) steps, 16 alone otherwise. Each candidate is one more
    branch compiled into every program of that size, so the large tile is
    offered only where long prefill chunks are likely."""
    return (64, 16) if num_tokens >= 1024 else (16,)


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
    query_tile: int | tuple[int, ...] | None = None,
    straggler_group: int = 32,
    layout: str = "blocks",
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of ``q`` ``[T, heads, head_dim]`` over the paged cache.

    ``k_cache``/``v_cache`` are storage arrays (per layer, or stacked with
    ``layer``; see ``write_kv``) of logical dtype ``cache_dtype``. Returns ``[T, heads, head_dim]`` in
    ``q.dtype``. The cache must already hold this step's keys/values (call
    ``write_kv`` first). Tokens with no visible key (padding) get zeros.

    Two passes keep the key gathers proportional to the work:

    1. *tile pass*: the step is cut into tiles of ``query_tile`` consecutive
       tokens; each tile gathers the keys of the sequence of its first token
       once and serves every token of the tile that belongs to that sequence
       (a prefill chunk reads its context once per tile, not once per token);
    2. *straggler pass*: the remaining tokens (decode tokens of other
       sequences sharing a tile, any token order) are compacted and run in
       groups of ``straggler_group`` tokens, each gathering its own
       sequence's keys; the number of groups is dynamic.

    ``query_tile`` may list several tile sizes, largest first (default:
    ``default_query_tiles(T)``): at run time
    (``lax.switch``) the step uses the largest one that leaves at most an
    eighth of its valid tokens as stragglers, else the last one if it leaves
    at most half, else the plain per-token kernel on all tokens (a
    decode-heavy step). Big tiles read a long prefill chunk's context fewer
    times (16 prompts x 128 tokens, 8 layers: 165 ms with tiles of 16, 98 ms
    with 64), small ones lose fewer tokens to stragglers when prompts are
    short. Results are exact for any token order and any choice; they are
    fastest when each sequence's tokens are contiguous (the runner's natural
    layout). ``query_tile=1`` always uses the per-token kernel.

    With ``meta.block_owner`` given (and a per-layer cache whose storage is
    its logical dtype), the program also holds the block-major decode kernel
    and ``meta.block_major`` picks between the two at run time.

    ``layout="heads"``: per-layer caches in the Pallas kernels' layout (module
    docstring); gathering kernel only.

    ``logit_softcap`` (static) and ``sinks`` (float32 ``[heads]``, traced):
    the module docstring's score features; every path applies them.
    """
    T, H, D = q.shape
    if layout == "heads":
        if layer is not None:
            raise ValueError(f"the heads layout is per layer only, got layer={layer!r}")
        kvh = k_cache.shape[0]
    elif layout == "blocks":
        kvh = k_cache.shape[-3]
    else:
        raise ValueError(f"unknown KV cache layout {layout!r}")
    if H % kvh:
        raise ValueError(f"{H} query heads are not a multiple of {kvh} kv heads")
    G = H // kvh
    check_features(logit_softcap, sinks, H)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(kvh, G)
    quantized = isinstance(k_cache, QuantizedPages)
    # an int8 cache's matmuls run in the queries' dtype (int8 -> float is exact)
    cdtype = jnp.dtype(q.dtype) if quantized else logical_dtype(k_cache, cache_dtype)
    block_tables = meta.block_tables
    token_seq = meta.token_seq
    positions = positions.astype(jnp.int32)
    limit, lower = visible_keys(meta, positions, sliding_window)
    qs = (q.astype(jnp.float32) * scale).astype(cdtype).reshape(T, kvh, G, D)

    block_major_possible = (
        layout == "blocks"
        and meta.block_owner is not None
        and T <= 2 * block_tables.shape[0]  # a bucket a decode step can use
        # a stacked cache's layer, or a 16-bit cache viewed as floats, would be copied whole
        # (an int8 cache's conversion too, on the CPU: it is taken for its exactness
        # there and for accelerators, which fuse the conversion into the matmul)
        and layer is None
        and (jnp.dtype(k_cache.dtype) == cdtype or quantized)
    )
    if block_major_possible:
        gathered = functools.partial(
            paged_attention,
            q,
            k_cache,
            v_cache,
            dataclasses.replace(meta, block_owner=None),
            positions,
            block_size=block_size,
            scale=scale,
            sliding_window=sliding_window,
            chunk_tokens=chunk_tokens,
            cache_dtype=cache_dtype,
            query_tile=query_tile,
            straggler_group=straggler_group,
            logit_softcap=logit_softcap,
            sinks=sinks,
        )
        major = functools.partial(
            _block_major_decode,
            qs=qs,
            k_cache=k_cache,
            v_cache=v_cache,
            meta=meta,
            limit=limit,
            lower=lower,
            block_size=block_size,
            cdtype=cdtype,
            logit_softcap=logit_softcap,
            sink=sink,
        )
        out = jax.lax.cond(meta.block_major, major, lambda: gathered().reshape(T, kvh, G, D).astype(jnp.float32))
        return out.reshape(T, H, D).astype(q.dtype)

    flash = functools.partial(
        _flash_rows,
        k_cache=k_cache,
        v_cache=v_cache,
        layer=layer,
        block_size=block_size,
        chunk_tokens=chunk_tokens,
        cdtype=cdtype,
        layout=layout,
        logit_softcap=logit_softcap,
        sink=sink,
    )

    def per_token(_):
        low = None if lower is None else lower[:, None]
        return flash(qs[:, :, None], block_tables[token_seq], limit[:, None], low)[:, :, 0]

    if query_tile is None:
        query_tile = default_query_tiles(T)
    tiles = (query_tile,) if isinstance(query_tile, int) else tuple(query_tile)
    tiles = tuple(sorted({max(1, min(t, T)) for t in tiles} - {1}, reverse=True))
    if not tiles:
        return per_token(None).reshape(T, H, D).astype(q.dtype)

    def split(Qt):
        """Tile membership for tiles of ``Qt``: does a token belong to the
        sequence of its tile's first token? Returns (tile_seq, member, stragglers, count)."""
        nT = -(-T // Qt)
        seq_p = jnp.pad(token_seq, (0, nT * Qt - T))
        tile_seq = seq_p[::Qt]
        member = seq_p.reshape(nT, Qt) == tile_seq[:, None]
        strag = jnp.logical_not(member.reshape(-1)[:T]) & (limit > 0)
        return tile_seq, member, strag, jnp.sum(strag.astype(jnp.int32))

    def two_pass(Qt, tile_seq, member, strag, n_strag):
        nT = tile_seq.shape[0]
        pad = nT * Qt - T
        lim_p = jnp.pad(limit, (0, pad))  # padding rows: limit 0, nothing visible
        # pass 1: query tiles
        q_tile = jnp.pad(qs, ((0, pad), (0, 0), (0, 0), (0, 0))).reshape(nT, Qt, kvh, G, D).transpose(0, 2, 1, 3, 4)
        low_tile = None if lower is None else jnp.pad(lower, (0, pad)).reshape(nT, Qt)
        out_a = flash(q_tile, block_tables[tile_seq], jnp.where(member, lim_p.reshape(nT, Qt), 0), low_tile)
        out_a = out_a.transpose(0, 2, 1, 3, 4).reshape(nT * Qt, kvh, G, D)[:T]

        # pass 2: stragglers (tokens not of their tile's sequence), compacted into groups
        Rg = max(1, min(straggler_group, T))
        n_groups = (n_strag + Rg - 1) // Rg
        order = jnp.argsort(jnp.logical_not(strag).astype(jnp.int32), stable=True)  # stragglers first
        order = jnp.pad(order, (0, -(-T // Rg) * Rg - T))
        lane = jnp.arange(Rg, dtype=jnp.int32)

        def group(gi, out_b):
            idx = jax.lax.dynamic_slice_in_dim(order, gi * Rg, Rg)
            ok = gi * Rg + lane < n_strag
            res = flash(
                qs[idx][:, :, None],
                block_tables[token_seq[idx]],
                jnp.where(ok, limit[idx], 0)[:, None],
                None if lower is None else lower[idx][:, None],
            )
            return out_b.at[jnp.where(ok, idx, T)].set(res[:, :, 0], mode="drop")

        out_b = jax.lax.fori_loop(0, n_groups, group, jnp.zeros((T, kvh, G, D), jnp.float32))
        return jnp.where(strag[:, None, None, None], out_b, out_a)

    n_valid = jnp.sum((limit > 0).astype(jnp.int32))
    splits = [split(Qt) for Qt in tiles]
    # the first tile size whose stragglers are few enough; the last may leave up to half
    fits = [n_strag * (2 if i == len(tiles) - 1 else 8) <= n_valid for i, (*_, n_strag) in enumerate(splits)]
    choice = jnp.int32(len(tiles))  # per-token
    for i in reversed(range(len(tiles))):
        choice = jnp.where(fits[i], i, choice)
    branches = [(lambda _, Qt=Qt, sp=sp: two_pass(Qt, *sp)) for Qt, sp in zip(tiles, splits)] + [per_token]
    out = jax.lax.switch(choice, branches, None)
    return out.reshape(T, H, D).astype(q.dtype)


def _block_major_decode(
    *,
    qs,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    limit,
    lower,
    block_size: int,
    cdtype,
    logit_softcap: float | None = None,
    sink: jax.Array | None = None,
) -> jax.Array:
    """Decode attention that reads the layer's whole cache in place, block by block.

    For steps where every sequence has exactly one token and no block
    belongs to two sequences: each physical block is multiplied by the query
    of the sequence owning it (``meta.block_owner``), giving per-block
    partial softmax results (max, normaliser, weighted values), which are
    then gathered through the block tables (small arrays) and merged per
    sequence. Unowned blocks get the padding row's empty context and drop
    out. The cache arrays are matmul operands as they are: no gathered copy
    of the context is made, which halves the memory traffic of a step that
    uses most of the cache. ``qs`` ``[T, kvh, G, D]`` (scaled); ``sink``
    ``[kvh, G]`` joins each row's merge as a block of normaliser 1 and no
    value; returns float32 ``[T, kvh, G, D]``.
    """
    T, kvh, G, D = qs.shape
    rows = meta.block_tables.shape[0]  # S + 1; the last row is padding
    token_seq = meta.token_seq
    # each row's (only) token; the padding row's limit stays 0
    row_token = jnp.zeros(rows, jnp.int32).at[token_seq].set(jnp.arange(T, dtype=jnp.int32), mode="drop")
    row_limit = jnp.zeros(rows, jnp.int32).at[token_seq].max(limit, mode="drop")
    row_limit = row_limit.at[rows - 1].set(0)
    owner = meta.block_owner
    qb = qs[row_token[owner]]  # [NB, kvh, G, D]
    k_scale = v_scale = None
    if isinstance(k_cache, QuantizedPages) and isinstance(v_cache, QuantizedPages):
        k, k_scale = k_cache.q.astype(cdtype), k_cache.scale[:, :, None, :]  # scales [NB, kvh, 1, BS]
        v, v_scale = v_cache.q.astype(cdtype), v_cache.scale[:, :, None, :]
    else:
        k = from_storage(k_cache, cdtype)  # [NB, kvh, D, BS]
        v = from_storage(v_cache, cdtype)  # [NB, kvh, BS, D]
    s = jnp.einsum("bkgd,bkdc->bkgc", qb, k, preferred_element_type=jnp.float32)
    if k_scale is not None:
        s = s * k_scale
    s = soft_cap(s, logit_softcap)
    kpos = cast(jax.Array, meta.block_index)[:, None] * block_size + jnp.arange(block_size, dtype=jnp.int32)[None, :]
    valid = kpos < row_limit[owner][:, None]
    if lower is not None:
        row_lower = jnp.zeros(rows, jnp.int32).at[token_seq].set(lower, mode="drop")
        valid = valid & (kpos >= row_lower[owner][:, None])
    valid = valid[:, None, None, :]  # [NB, 1, 1, BS]
    s = jnp.where(valid, s, _NEG)
    m = jnp.max(s, axis=-1)  # [NB, kvh, G]
    p = jnp.where(valid, jnp.exp(s - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    if v_scale is not None:  # the values' scales weigh the probabilities, not every element
        p = p * v_scale
    o = jnp.einsum("bkgc,bkcd->bkgd", p.astype(cdtype), v, preferred_element_type=jnp.float32)
    # merge each row's blocks (null-block padding has l == 0 and drops out)
    bt = meta.block_tables
    m_r, l_r, o_r = m[bt], l[bt], o[bt]  # [S+1, M, kvh, G(, D)]
    seen = l_r > 0.0
    m_max = jnp.max(jnp.where(seen, m_r, _NEG), axis=1)
    if sink is not None:
        m_max = jnp.maximum(m_max, sink)
    w = jnp.where(seen, jnp.exp(m_r - m_max[:, None]), 0.0)
    l_tot = jnp.sum(w * l_r, axis=1)
    if sink is not None:
        l_tot = l_tot + jnp.exp(sink - m_max)
    o_tot = jnp.sum(w[..., None] * o_r, axis=1) / jnp.where(l_tot == 0.0, 1.0, l_tot)[..., None]
    return o_tot[token_seq]


def _flash_rows(
    qr: jax.Array,
    bt_rows: jax.Array,
    limit: jax.Array,
    lower: jax.Array | None,
    *,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer,
    block_size: int,
    chunk_tokens: int | None,
    cdtype,
    layout: str = "blocks",
    logit_softcap: float | None = None,
    sink: jax.Array | None = None,
) -> jax.Array:
    """Online-softmax attention of ``R`` rows, each with its own block table.

    ``qr`` ``[R, kvh, Q, G, D]`` (scaled, cache dtype): ``Q`` query tokens per
    row sharing the row's keys; ``bt_rows`` ``[R, M]``; ``limit``/``lower``
    ``[R, Q]``: key positions ``lower <= kpos < limit`` are visible. Scores
    are soft-capped with ``logit_softcap``; ``sink`` ``[kvh, G]`` starts each
    row's max and normaliser. Returns float32 ``[R, kvh, Q, G, D]`` (zeros
    where nothing is visible).
    """
    R, kvh, Q, G, D = qr.shape
    M = bt_rows.shape[1]
    quantized = isinstance(k_cache, QuantizedPages) and isinstance(v_cache, QuantizedPages)
    if chunk_tokens is None:
        # an int8 cache's chunks are gathered as int8 but used in cdtype
        itemsize = jnp.dtype(cdtype if quantized else k_cache.dtype).itemsize
        chunk_tokens = default_chunk_tokens(R, kvh, D, itemsize, block_size)
    chunk_blocks = max(1, min(chunk_tokens // block_size, M))
    C = chunk_blocks * block_size
    n_max = -(-M // chunk_blocks)
    if n_max * chunk_blocks != M:  # whole chunks; extra columns -> block 0, masked anyway
        bt_rows = jnp.pad(bt_rows, ((0, 0), (0, n_max * chunk_blocks - M)))

    stop = jnp.clip((jnp.max(limit) + C - 1) // C, 0, n_max)
    if lower is not None:
        first = jnp.where(limit > 0, jnp.maximum(lower, 0), jnp.iinfo(jnp.int32).max)
        start = jnp.minimum(jnp.min(first) // C, stop)
    else:
        start = jnp.int32(0)

    # per (row, kv head): [Q*G, D] queries against [D, C] keys and [C, D] values
    q2 = qr.reshape(R, kvh, Q * G, D)
    kpos_in_chunk = jnp.arange(C, dtype=jnp.int32)

    def gather(cache, cols):
        # whole blocks, all kv heads of a block at once: [R, CB, kvh, ...]
        out = cache[cols] if layer is None else cache[layer, cols]
        return from_storage(out, cdtype)

    def gather_quantized(pages: QuantizedPages, cols, keys: bool) -> tuple[jax.Array, jax.Array]:
        """A chunk of int8 keys ``[R, kvh, D, C]`` (values ``[R, kvh, C, D]``)
        in cdtype, and their scales ``[R, kvh, C]``."""
        if layout == "heads":  # [kvh, R, CB, BS(, D)]
            x = jnp.transpose(pages.q[:, cols], (1, 0, 4, 2, 3) if keys else (1, 0, 2, 3, 4))
            sc = jnp.transpose(pages.scale[:, cols], (1, 0, 2, 3))
        else:  # [R, CB, kvh, ...]
            lead = () if layer is None else (layer,)
            x = jnp.moveaxis(pages.q[(*lead, cols)], 1, 3 if keys else 2)
            sc = jnp.moveaxis(pages.scale[(*lead, cols)], 1, 2)
        shape = (R, kvh, D, C) if keys else (R, kvh, C, D)
        return x.astype(cdtype).reshape(shape), sc.reshape(R, kvh, C)

    def body(c, carry):
        m, l, acc = carry
        cols = jax.lax.dynamic_slice_in_dim(bt_rows, c * chunk_blocks, chunk_blocks, axis=1)  # [R, CB]
        k_scale = v_scale = None
        if quantized:
            k, k_scale = gather_quantized(cast(QuantizedPages, k_cache), cols, True)
            v, v_scale = gather_quantized(cast(QuantizedPages, v_cache), cols, False)
        elif layout == "heads":
            # [kvh, R, CB, BS, D] -> [R, kvh, D, C] and [R, kvh, C, D]
            k = jnp.transpose(from_storage(k_cache[:, cols], cdtype), (1, 0, 4, 2, 3)).reshape(R, kvh, D, C)
            v = jnp.transpose(from_storage(v_cache[:, cols], cdtype), (1, 0, 2, 3, 4)).reshape(R, kvh, C, D)
        else:
            # [R, CB, kvh, D, BS] -> [R, kvh, D, C] and [R, CB, kvh, BS, D] -> [R, kvh, C, D]: free
            # reshapes for one block per chunk, a transpose fused into the gather otherwise
            k = jnp.moveaxis(gather(k_cache, cols), 1, 3).reshape(R, kvh, D, C)
            v = jnp.moveaxis(gather(v_cache, cols), 1, 2).reshape(R, kvh, C, D)
        s = jnp.einsum("rkqd,rkdc->rkqc", q2, k, preferred_element_type=jnp.float32)
        if k_scale is not None:
            s = s * k_scale[:, :, None, :]
        s = soft_cap(s.reshape(R, kvh, Q, G, C), logit_softcap)
        kpos = c * C + kpos_in_chunk
        valid = kpos[None, None, :] < limit[:, :, None]
        if lower is not None:
            valid = valid & (kpos[None, None, :] >= lower[:, :, None])
        valid = valid[:, None, :, None, :]  # [R, 1, Q, 1, C]
        s = jnp.where(valid, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
        l = l * alpha + jnp.sum(p, axis=-1)
        pw = p.reshape(R, kvh, Q * G, C)
        if v_scale is not None:  # the values' scales weigh the probabilities
            pw = pw * v_scale[:, :, None, :]
        pv = jnp.einsum("rkqc,rkcd->rkqd", pw.astype(cdtype), v, preferred_element_type=jnp.float32)
        acc = acc * alpha[..., None] + pv.reshape(R, kvh, Q, G, D)
        return m_new, l, acc

    if sink is None:
        m0, l0 = jnp.full((R, kvh, Q, G), _NEG, jnp.float32), jnp.zeros((R, kvh, Q, G), jnp.float32)
    else:  # the sink column, exp(sink - sink) = 1, before any key
        m0 = jnp.broadcast_to(sink[None, :, None, :], (R, kvh, Q, G))
        l0 = jnp.ones((R, kvh, Q, G), jnp.float32)
    init = (m0, l0, jnp.zeros((R, kvh, Q, G, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(start, stop, body, init)
    return acc / jnp.where(l == 0.0, 1.0, l)[..., None]


def dense_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    q_positions: jax.Array | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Dense reference for one sequence, float32 throughout.

    ``k``/``v`` ``[K, kv_heads, head_dim]`` are the sequence's keys at
    positions ``0..K-1``; ``q`` ``[T, heads, head_dim]`` sits at
    ``q_positions`` (default: the last ``T`` positions, ``K-T..K-1``).

    The features as transformers' eager attention computes them: scores
    ``q @ k * scale``, soft-capped (``cap * tanh(s / cap)``, Gemma 2) before
    the mask; ``sinks`` ``[heads]`` appended as a last column of every row,
    the softmax taken over it and the column dropped (gpt-oss). A row that
    sees no key gets zeros (the paged kernels' padding rows).
    """
    T, H, D = q.shape
    K, kvh, _ = k.shape
    G = H // kvh
    check_features(logit_softcap, sinks, H)
    if q_positions is None:
        q_positions = jnp.arange(K - T, K)
    qf = q.astype(jnp.float32).reshape(T, kvh, G, D)
    s = soft_cap(jnp.einsum("tkgd,ckd->tkgc", qf, k.astype(jnp.float32)) * scale, logit_softcap)
    kpos = jnp.arange(K)
    mask = kpos[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        mask = mask & (kpos[None, :] > q_positions[:, None] - sliding_window)
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    if sinks is not None:
        column = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kvh, G, 1), (T, kvh, G, 1))
        p = jax.nn.softmax(jnp.concatenate([s, column], axis=-1), axis=-1)[..., :K]
    else:
        p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(jnp.any(mask, axis=-1)[:, None, None, None], p, 0.0)
    out = jnp.einsum("tkgc,ckd->tkgd", p, v.astype(jnp.float32))
    return out.reshape(T, H, D)


def make_slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Host helper: slots of ``positions`` of one sequence with ``block_table`` (numpy)."""
    positions = np.asarray(positions)
    return (np.asarray(block_table)[positions // block_size] * block_size + positions % block_size).astype(np.int32)


__all__ = [
    "paged_attention",
    "visible_keys",
    "check_features",
    "soft_cap",
    "write_kv",
    "dense_causal_attention",
    "default_chunk_tokens",
    "default_query_tiles",
    "make_slot_mapping",
]
