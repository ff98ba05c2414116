"""Adapters from jaxserve's paged cache to the paged-attention kernels JAX ships in Pallas.

What JAX 0.10.2 ships (``jax/experimental/pallas/ops/``), and what each
adapter below maps onto it:

``gpu/paged_attention.py`` (Triton): ``paged_attention(q [B, H, D], k_pages
[KVH, P, PS, D], v_pages [KVH, P, PS, D], block_tables [B, pages], lengths
[B], *, block_h, pages_per_compute_block, k_splits, num_warps, num_stages,
interpret, ...)``. One query token per batch row, attending to that row's
keys at positions ``< lengths[b]``; grouped-query heads; a flash-decoding
split of the pages into ``k_splits`` partitions merged at the end; logit
soft-capping (``attn_logits_soft_cap``, applied to the scores of the
adapter's scaled ``q``). No softmax scale (the adapter scales ``q``), no
sliding window, no attention sinks, no causal mask within a row. Runs in
interpret mode on the CPU (``interpret=True``).
JAX 0.11 marks the module deprecated (a warning at import), same API.

``tpu/paged_attention`` (Mosaic): ``paged_attention(q [B, H, D], k_pages,
v_pages [KVH, P, PS, D], lengths [B], page_indices [B, pages], *,
pages_per_compute_block, attn_logits_soft_cap, megacore_mode, inline_seq_dim,
...)``: the same semantics (soft-capping; no sliding window, no sinks), no
``interpret`` argument; on the CPU it runs in the TPU
interpret mode of ``jax.experimental.pallas.tpu.force_tpu_interpret_mode``.
It casts every key and value block it loads to bfloat16 (its
``_maybe_dequantize`` defaults to that dtype) whatever the cache's dtype:
float32 models get bfloat16-accurate decode attention on TPU (the TPU's
default matmul precision does the same to float32 in XLA).

``tpu/ragged_paged_attention`` (Mosaic): ``ragged_paged_attention(q [T, H,
D], kv_pages [P, PS, 2 * KVH, D] (keys and values interleaved per head),
kv_lens [S], page_indices [S, pages], cu_q_lens [S + 1], num_seqs [1], *,
sm_scale, sliding_window, soft_cap, ...)``: mixed prefill and decode in one
call, sequence ``s`` owning the tokens ``cu_q_lens[s]:cu_q_lens[s + 1]``,
which sit at the *last* positions of its ``kv_lens[s]`` keys (causal within
the chunk); sliding windows and soft-capping (after ``sm_scale``, before
the mask, as Gemma 2's); no sinks. It does **not** run in JAX 0.10.2's TPU interpret
mode: the interpreter handles only indexing transforms of a ref
(``jax/_src/pallas/mosaic/interpret/utils.py``, ``to_range``: "assume only
NDIndexer transforms") and the kernel reshapes its VMEM buffer
(``kernel.py``: ``cur_async_copy_kv.wait().reshape(...)``), so the
interpreter raises ``AttributeError: 'ReshapeTransform' object has no
attribute 'indices'``; with a head_dim below 128 it fails earlier, at trace
time (``assert shape[1] % arr.shape[1] == 0`` in its ``broadcast_to_shape``:
its softmax statistics are 128 lanes wide). ``tpu_ragged_attention``
therefore takes the kernel as a parameter, and the tests run the adapter
through the module's own pure-JAX reference (``ref_ragged_paged_attention``,
same inputs and layout) against jaxserve's reference.

jaxserve's side: the cache in the ``heads`` layout (``kv_cache.py``: keys
and values ``[KVH, P, BS, D]``, exactly the two paged kernels' layout, read
in place) and a step's ``AttentionMetadata``. The two paged kernels are
driven *per token*: token ``t`` becomes batch row ``t`` with its sequence's
block table (``block_tables[token_seq[t]]``) and ``lengths[t] =
min(positions[t] + 1, context_lens[token_seq[t]])``, which is exactly the
reference's causal mask for any token, decode or prefill; padding tokens
(length 0) get zeros. That is the decode step (one token per sequence, each
reading its context once) and stays exact for the few prefill tokens a
decode-sized step may carry (each rereads its sequence's context). The
ragged kernel gets the step as it is (tokens grouped by sequence in row
order, padding last: the runner's layout) with keys and values interleaved
into its combined layout, a copy of at most the blocks the step's tables can
name.

The other attention kernels shipped there are not paged, so they have no
use here: ``gpu/decode_attention.py`` (decode over contiguous K/V),
``gpu/attention.py`` and ``gpu/attention_mgpu.py`` (dense flash attention),
``tpu/flash_attention.py`` and ``tpu/splash_attention``.

None of the three has attention sinks (gpt-oss): a learned logit per query
head that joins each row's softmax, which would need each row's softmax
statistics, and the kernels return only the normalised output. Which
features each kernel computes is ``KERNEL_FEATURES``; a layer that needs
another runs the reference kernel for that call (``backends.attend``).

int8 caches (``kv_cache.QuantizedPages``: int8 pages and a float32 scale
per token and kv head, ``[KVH, P, PS]`` in the ``heads`` layout): the GPU
kernel takes exactly that (``k_scales_pages``/``v_scales_pages``, applied to
the scores and the softmax weights), so ``gpu_paged_attention`` reads an
int8 cache in place. The TPU paged kernel takes a ``QuantizedTensor`` of
int8 pages with scales ``[KVH, P, PS, 1]`` but broadcasts them to the
pages' full shape before its call (``paged_attention_kernel.py``:
``jnp.broadcast_to(k_scales_pages, (..., head_dim))``), a float32 array four
times the int8 pages' bytes written and read per layer and step, more than
a float32 cache's own; the ragged kernel takes only one static scale per
tensor (``k_scale``/``v_scale``). So on TPU an int8 cache's layers run the
reference over the same ``heads`` cache (``KERNEL_READS_INT8``).

Which adapter runs for which step is ``backends.py``'s business.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.kv_cache import QuantizedPages, from_storage, is_quantized, logical_dtype

#: tokens of one inner iteration of the GPU kernel (pages_per_compute_block x block size)
GPU_KEYS_PER_ITERATION = 128
#: most flash-decoding partitions of a sequence's pages in the GPU kernel
GPU_MAX_K_SPLITS = 16
#: the GPU kernel's query-head block (it requires a multiple of 16)
GPU_BLOCK_H = 16

#: the per-layer attention features (``layer_features``) each shipped kernel computes
KERNEL_FEATURES: dict[str, frozenset[str]] = {
    "gpu": frozenset({"logit_softcap"}),
    "tpu": frozenset({"logit_softcap"}),
    "tpu_ragged": frozenset({"logit_softcap", "sliding_window"}),
}


#: whether each shipped kernel reads an int8 cache (module docstring)
KERNEL_READS_INT8: dict[str, bool] = {"gpu": True, "tpu": False, "tpu_ragged": False}


def kernel_reads(kernel: str, cache_dtype) -> bool:
    """Whether the shipped ``kernel`` (a ``KERNEL_FEATURES`` key) reads a cache of ``cache_dtype``."""
    return KERNEL_READS_INT8[kernel] or not is_quantized(cache_dtype)


def layer_features(*, sliding_window: int | None, logit_softcap: float | None, sinks: object) -> frozenset[str]:
    """The names of the features one layer's attention call uses (``sinks``: the array or ``None``)."""
    used = {"sliding_window": sliding_window, "logit_softcap": logit_softcap, "sinks": sinks}
    return frozenset(name for name, value in used.items() if value is not None and value is not False)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def per_token_tables(meta: AttentionMetadata, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token block tables ``[T, M]`` and visible-key counts ``[T]`` (the
    reference's mask: keys at positions ``< min(pos + 1, context_len)``)."""
    positions = positions.astype(jnp.int32)
    limit = jnp.minimum(positions + 1, meta.context_lens[meta.token_seq]).astype(jnp.int32)
    return meta.block_tables[meta.token_seq], limit


def _pad_tables(tables: jax.Array, width: int) -> jax.Array:
    """Pad block tables with the null block 0 (never read: masked by the lengths)."""
    extra = width - tables.shape[1]
    return tables if extra == 0 else jnp.pad(tables, ((0, 0), (0, extra)))


def _scaled_query(q: jax.Array, scale: float, cdtype) -> jax.Array:
    # as the reference does: scale in float32, then the cache dtype for the matmuls
    return (q.astype(jnp.float32) * scale).astype(cdtype)


def gpu_kernel_unsupported(*, head_dim: int, block_size: int) -> str | None:
    """Why the shipped GPU kernel cannot serve these shapes (None: it can).

    Triton wants power-of-two tensor shapes and dot operands of at least 16
    in every dimension. (Layers whose features it lacks, see
    ``KERNEL_FEATURES``, run the reference per call: not a reason here.)"""
    if not _is_pow2(head_dim) or head_dim < 16:
        return f"the GPU paged-attention kernel needs a power-of-two head_dim >= 16, got {head_dim}"
    if not _is_pow2(block_size) or block_size > GPU_KEYS_PER_ITERATION:
        return (
            f"the GPU paged-attention kernel needs a power-of-two block_size <= {GPU_KEYS_PER_ITERATION}, "
            f"got {block_size}"
        )
    return None


def gpu_split(num_pages: int, block_size: int, max_k_splits: int = GPU_MAX_K_SPLITS) -> tuple[int, int, int]:
    """``(pages_per_compute_block, k_splits, padded table width)`` for a table
    of ``num_pages`` pages: inner iterations of ``GPU_KEYS_PER_ITERATION``
    keys, up to ``max_k_splits`` partitions of whole iterations."""
    ppcb = max(1, GPU_KEYS_PER_ITERATION // block_size)
    iterations = -(-num_pages // ppcb)
    k_splits = max(1, min(max_k_splits, iterations))
    per_split = -(-iterations // k_splits) * ppcb
    return ppcb, k_splits, k_splits * per_split


def _gpu_kernel():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # JAX 0.11 deprecates the module
        from jax.experimental.pallas.ops.gpu import paged_attention as module
    return module.paged_attention


def gpu_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    meta: AttentionMetadata,
    positions: jax.Array,
    *,
    scale: float,
    cache_dtype=None,
    interpret: bool = False,
    logit_softcap: float | None = None,
    max_k_splits: int = GPU_MAX_K_SPLITS,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Attention of ``q`` ``[T, H, D]`` through the shipped GPU kernel, one
    kernel batch row per token (module docstring). ``k_cache``/``v_cache``:
    one layer in the ``heads`` layout ``[KVH, P, BS, D]``, already holding
    this step's keys (or an int8 cache's ``QuantizedPages``, read with their
    scales: the queries then stay in ``q.dtype``). ``logit_softcap``: the
    kernel's own soft-cap of the (scaled) scores. Returns ``[T, H, D]`` in
    ``q.dtype``; zeros for tokens that see no key."""
    T, H, D = q.shape
    kvh, _, block_size, _ = k_cache.shape
    if H % kvh:
        raise ValueError(f"{H} query heads are not a multiple of {kvh} kv heads")
    tables, limit = per_token_tables(meta, positions)
    ppcb, k_splits, width = gpu_split(tables.shape[1], block_size, max_k_splits)
    scales = {}
    if isinstance(k_cache, QuantizedPages) and isinstance(v_cache, QuantizedPages):
        cdtype = jnp.dtype(q.dtype)
        k_pages, v_pages = k_cache.q, v_cache.q
        scales = dict(k_scales_pages=k_cache.scale, v_scales_pages=v_cache.scale)
    else:
        cdtype = logical_dtype(k_cache, cache_dtype)
        k_pages, v_pages = from_storage(k_cache, cdtype), from_storage(v_cache, cdtype)
    out = _gpu_kernel()(
        _scaled_query(q, scale, cdtype),
        k_pages,
        v_pages,
        _pad_tables(tables, width),
        limit,
        block_h=GPU_BLOCK_H,
        pages_per_compute_block=ppcb,
        k_splits=k_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        attn_logits_soft_cap=logit_softcap,
        **scales,
    )
    return jnp.where((limit > 0)[:, None, None], out.astype(jnp.float32), 0.0).astype(q.dtype)


def _tpu_interpret(interpret: bool):
    if not interpret:
        return contextlib.nullcontext()
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.force_tpu_interpret_mode()


def tpu_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    meta: AttentionMetadata,
    positions: jax.Array,
    *,
    scale: float,
    cache_dtype=None,
    interpret: bool = False,
    pages_per_compute_block: int | None = None,
    logit_softcap: float | None = None,
) -> jax.Array:
    """``gpu_paged_attention``'s contract through the shipped TPU paged kernel
    (``interpret``: the TPU interpret mode, for CPU tests). Lengths are
    clamped to at least 1 (the kernel divides by the softmax sum) and
    tokens that see no key get zeros."""
    T, H, D = q.shape
    kvh, _, block_size, _ = k_cache.shape
    if H % kvh:
        raise ValueError(f"{H} query heads are not a multiple of {kvh} kv heads")
    cdtype = logical_dtype(k_cache, cache_dtype)
    tables, limit = per_token_tables(meta, positions)
    ppcb = pages_per_compute_block or max(1, min(tables.shape[1], 512 // block_size))
    width = -(-tables.shape[1] // ppcb) * ppcb
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel

    with _tpu_interpret(interpret):
        out = kernel(
            _scaled_query(q, scale, cdtype),
            from_storage(k_cache, cdtype),
            from_storage(v_cache, cdtype),
            jnp.maximum(limit, 1),
            _pad_tables(tables, width),
            pages_per_compute_block=ppcb,
            attn_logits_soft_cap=logit_softcap,
        )
    return jnp.where((limit > 0)[:, None, None], out.astype(jnp.float32), 0.0).astype(q.dtype)


def _tileable(heads: int, packing: int) -> bool:
    # the ragged kernel's own rule (get_min_heads_per_blk) for the combined kv heads
    if heads % packing:
        return False
    heads //= packing
    return heads in (1, 2, 4, 8) or heads % 8 == 0


def tpu_ragged_unsupported(*, head_dim: int, num_kv_heads: int, cache_dtype) -> str | None:
    """Why the shipped ragged TPU kernel cannot serve these shapes (None: it can)."""
    if head_dim % 128:
        return f"the ragged TPU kernel needs head_dim a multiple of 128, got {head_dim}"
    packing = max(1, 4 // jnp.dtype(cache_dtype).itemsize)
    if not _tileable(2 * num_kv_heads, packing):
        return f"the ragged TPU kernel cannot tile {2 * num_kv_heads} combined kv heads of {jnp.dtype(cache_dtype)}"
    return None


def combine_kv_pages(k: jax.Array, v: jax.Array) -> jax.Array:
    """``heads``-layout keys and values ``[KVH, P, BS, D]`` -> the ragged
    kernel's ``[P, BS, 2 * KVH, D]`` (head ``h``'s keys at ``2h``, values at
    ``2h + 1``)."""
    kvh, pages, block_size, d = k.shape
    both = jnp.stack([k, v], axis=-2)  # [KVH, P, BS, 2, D]
    return jnp.transpose(both, (1, 2, 0, 3, 4)).reshape(pages, block_size, 2 * kvh, d)


def ragged_inputs(meta: AttentionMetadata) -> dict[str, jax.Array]:
    """The ragged kernel's sequence metadata for a step in the runner's layout.

    ``kv_lens``/``page_indices`` are the real rows' (the padding row, last,
    is left out), ``cu_q_lens`` the running token counts per row, and
    ``num_seqs`` the rows holding tokens, which must be the first ones."""
    rows = meta.block_tables.shape[0]
    seqs = rows - 1
    counts = jnp.zeros(rows, jnp.int32).at[meta.token_seq].add(1, mode="drop")[:seqs]
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    return dict(
        kv_lens=meta.context_lens[:seqs].astype(jnp.int32),
        page_indices=meta.block_tables[:seqs].astype(jnp.int32),
        cu_q_lens=cu,
        num_seqs=jnp.sum(counts > 0, dtype=jnp.int32).reshape(1),
    )


def _shipped_ragged_kernel(interpret: bool) -> Callable:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    if not interpret:
        return ragged_paged_attention

    def run(*args, **kwargs):
        with _tpu_interpret(True):
            return ragged_paged_attention(*args, **kwargs)

    return run


def tpu_ragged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    meta: AttentionMetadata,
    positions: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
    cache_dtype=None,
    interpret: bool = False,
    kernel: Callable | None = None,
    logit_softcap: float | None = None,
) -> jax.Array:
    """Attention of a whole step (prefill, decode or both) through the shipped
    ragged TPU kernel, or through ``kernel`` with its signature (the module's
    ``ref_ragged_paged_attention``, called eagerly, in tests).

    Preconditions, the runner's layout: each row's tokens are contiguous and
    consecutive at the end of its context, rows in order, rows with tokens
    first, padding tokens after all of them (``positions`` are implied by
    that and not read). Keys and values are interleaved into the kernel's
    layout from at most the blocks the step's tables can name. Returns
    ``[T, H, D]`` in ``q.dtype``, zeros for padding tokens."""
    del positions  # implied by the layout: a row's tokens end its context
    T, H, D = q.shape
    kvh, num_pages, _, _ = k_cache.shape
    if H % kvh:
        raise ValueError(f"{H} query heads are not a multiple of {kvh} kv heads")
    cdtype = logical_dtype(k_cache, cache_dtype)
    k = from_storage(k_cache, cdtype)
    v = from_storage(v_cache, cdtype)
    inputs = ragged_inputs(meta)
    tables = inputs["page_indices"]
    if tables.size < num_pages:
        # copy only the blocks the tables can name (static bound: rows x width)
        flat = tables.reshape(-1)
        kv_pages = combine_kv_pages(k[:, flat], v[:, flat])
        inputs["page_indices"] = jnp.arange(tables.size, dtype=jnp.int32).reshape(tables.shape)
    else:
        kv_pages = combine_kv_pages(k, v)
    run = kernel or _shipped_ragged_kernel(interpret)
    out = run(
        _scaled_query(q, scale, cdtype),
        kv_pages,
        sm_scale=1.0,
        sliding_window=sliding_window,
        soft_cap=logit_softcap,
        **inputs,
    )
    out = out.astype(jnp.float32)
    if out.shape[0] < T:  # the reference returns the real tokens only
        out = jnp.pad(out, ((0, T - out.shape[0]), (0, 0), (0, 0)))
    valid = jnp.arange(T) < inputs["cu_q_lens"][-1]
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype)


__all__ = [
    "GPU_BLOCK_H",
    "KERNEL_FEATURES",
    "combine_kv_pages",
    "gpu_kernel_unsupported",
    "gpu_paged_attention",
    "gpu_split",
    "kernel_reads",
    "layer_features",
    "per_token_tables",
    "ragged_inputs",
    "tpu_paged_attention",
    "tpu_ragged_attention",
    "tpu_ragged_unsupported",
]
