"""Paged attention against dense attention: shuffled block tables, mixed batches, GQA,
padding writes to the null block, multi-chunk online softmax, sliding windows."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.kv_cache import (
    KVCache,
    bytes_per_block,
    cache_shapes,
    keys_from_slots,
    keys_to_slots,
    layer_shapes,
    to_storage,
    values_from_slots,
    values_to_slots,
)
from jaxserve.kernels.paged_attention import dense_causal_attention, paged_attention, write_kv

BS = 4  # block size
NUM_BLOCKS = 48
KVH, H, D = 2, 4, 8  # GQA: 2 query heads per kv head
M = 12  # block-table width (max blocks per sequence)
SCALE = 1.0 / np.sqrt(D)

# (cached tokens before this step, new tokens in this step)
SEQS = [
    (36, 1),  # long decode
    (4, 1),  # short decode at a block boundary
    (10, 7),  # prefill chunk continuing a cached prefix
    (0, 6),  # fresh prefill
    (44, 1),  # decode filling its last block completely (45 -> 12 blocks)
]
NUM_PAD = 3  # padding tokens at the end of the step


# prefill-heavy: mostly one long chunk continuing a cached prefix (the tile pass does most work)
SEQS_PREFILL = [
    (20, 1),
    (8, 24),
    (0, 9),
]


def _build(seed: int = 0, dtype=jnp.float32, seqs=None):
    seqs = SEQS if seqs is None else seqs
    rng = np.random.default_rng(seed)
    # shuffled physical blocks: a random permutation of 1..NUM_BLOCKS-1
    perm = rng.permutation(np.arange(1, NUM_BLOCKS))
    S = len(seqs) + 1  # one padding sequence row
    block_tables = np.zeros((S, M), np.int32)
    nxt = 0
    full_k, full_v = [], []
    for s, (cached, new) in enumerate(seqs):
        total = cached + new
        nb = -(-total // BS)
        block_tables[s, :nb] = perm[nxt : nxt + nb]
        nxt += nb
        full_k.append(rng.standard_normal((total, KVH, D)).astype(np.float32))
        full_v.append(rng.standard_normal((total, KVH, D)).astype(np.float32))

    def slot(s, p):
        return block_tables[s, p // BS] * BS + p % BS

    # garbage everywhere (block 0 and unused blocks included) so masking errors show
    kc = rng.standard_normal((NUM_BLOCKS * BS, KVH, D)).astype(np.float32) * 100
    vc = rng.standard_normal((NUM_BLOCKS * BS, KVH, D)).astype(np.float32) * 100
    for s, (cached, _) in enumerate(seqs):
        for p in range(cached):
            kc[slot(s, p)] = full_k[s][p]
            vc[slot(s, p)] = full_v[s][p]

    tok_seq, pos, slots, k_new, v_new = [], [], [], [], []
    for s, (cached, new) in enumerate(seqs):
        for p in range(cached, cached + new):
            tok_seq.append(s)
            pos.append(p)
            slots.append(slot(s, p))
            k_new.append(full_k[s][p])
            v_new.append(full_v[s][p])
    for i in range(NUM_PAD):  # padding: point at the padding row, write into block 0
        tok_seq.append(S - 1)
        pos.append(0)
        slots.append(i % BS)
        k_new.append(rng.standard_normal((KVH, D)).astype(np.float32) * 1e3)
        v_new.append(rng.standard_normal((KVH, D)).astype(np.float32) * 1e3)
    T = len(tok_seq)
    context_lens = np.array([c + n for c, n in seqs] + [0], np.int32)
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray(np.array(slots, np.int32)),
        token_seq=jnp.asarray(np.array(tok_seq, np.int32)),
        block_tables=jnp.asarray(block_tables),
        context_lens=jnp.asarray(context_lens),
        logits_indices=jnp.zeros((S,), jnp.int32),
    )
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    return dict(
        q=jnp.asarray(q, dtype),
        # per-layer storage layout; uint16 bits for bfloat16
        kc=keys_from_slots(to_storage(jnp.asarray(kc), dtype), BS),
        vc=values_from_slots(to_storage(jnp.asarray(vc), dtype), BS),
        k_new=jnp.asarray(np.stack(k_new), dtype),
        v_new=jnp.asarray(np.stack(v_new), dtype),
        meta=meta,
        positions=jnp.asarray(np.array(pos, np.int32)),
        full_k=full_k,
        full_v=full_v,
        q_np=q,
        seqs=seqs,
    )


def _reference(case, sliding_window=None):
    """Dense attention per sequence; padding rows get zeros."""
    outs = []
    t = 0
    for s, (_cached, new) in enumerate(case["seqs"]):
        qs = jnp.asarray(case["q_np"][t : t + new])
        outs.append(
            dense_causal_attention(
                qs,
                jnp.asarray(case["full_k"][s]),
                jnp.asarray(case["full_v"][s]),
                scale=SCALE,
                sliding_window=sliding_window,
            )
        )
        t += new
    return np.asarray(jnp.concatenate(outs)), t


@functools.partial(jax.jit, static_argnames=("chunk_tokens", "sliding_window", "query_tile", "straggler_group"))
def _step(
    q, kc, vc, k_new, v_new, meta, positions, chunk_tokens=None, sliding_window=None, query_tile=16, straggler_group=32
):
    # uint16 storage means a bfloat16 cache (the default logical dtype for uint16)
    kc, vc = write_kv(kc, vc, k_new, v_new, meta.slot_mapping)
    out = paged_attention(
        q,
        kc,
        vc,
        meta,
        positions,
        block_size=BS,
        scale=SCALE,
        chunk_tokens=chunk_tokens,
        sliding_window=sliding_window,
        query_tile=query_tile,
        straggler_group=straggler_group,
    )
    return out, kc, vc


@pytest.mark.parametrize("chunk_tokens", [BS, 5 * BS, None])
def test_paged_matches_dense_mixed_batch(chunk_tokens):
    case = _build(seed=1)
    out, kc, _ = _step(
        case["q"],
        case["kc"],
        case["vc"],
        case["k_new"],
        case["v_new"],
        case["meta"],
        case["positions"],
        chunk_tokens=chunk_tokens,
    )
    ref, n_real = _reference(case)
    out = np.asarray(out)
    np.testing.assert_allclose(out[:n_real], ref, rtol=2e-5, atol=2e-5)
    # padding tokens see no valid key: finite zeros, never NaN
    assert np.all(np.isfinite(out[n_real:]))
    np.testing.assert_array_equal(out[n_real:], 0.0)


@pytest.mark.parametrize("query_tile,straggler_group", [(1, 32), (4, 3), (32, 5), ((8, 4), 3), ((16, 8, 2), 4)])
def test_query_tiles_and_straggler_groups(query_tile, straggler_group):
    """Every split between the tile pass and the straggler pass gives the same exact result."""
    case = _build(seed=6)
    out, _, _ = _step(
        case["q"],
        case["kc"],
        case["vc"],
        case["k_new"],
        case["v_new"],
        case["meta"],
        case["positions"],
        chunk_tokens=2 * BS,
        query_tile=query_tile,
        straggler_group=straggler_group,
    )
    ref, n_real = _reference(case)
    out = np.asarray(out)
    np.testing.assert_allclose(out[:n_real], ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(out[n_real:], 0.0)


@pytest.mark.parametrize("query_tile,straggler_group", [(8, 2), (16, 32), ((16, 4), 2), ((8, 2), 32)])
def test_prefill_heavy_step_uses_tiles(query_tile, straggler_group):
    """Single tile sizes and candidate lists (the largest with few stragglers wins at run time)."""
    case = _build(seed=8, seqs=SEQS_PREFILL)
    out, _, _ = _step(
        case["q"],
        case["kc"],
        case["vc"],
        case["k_new"],
        case["v_new"],
        case["meta"],
        case["positions"],
        chunk_tokens=2 * BS,
        query_tile=query_tile,
        straggler_group=straggler_group,
    )
    ref, n_real = _reference(case)
    np.testing.assert_allclose(np.asarray(out)[:n_real], ref, rtol=2e-5, atol=2e-5)


def test_any_token_order():
    """Tokens of a sequence need not be contiguous: shuffle the step's token order."""
    case = _build(seed=7)
    perm = np.random.default_rng(7).permutation(case["q"].shape[0])
    m = case["meta"]
    meta = AttentionMetadata(
        slot_mapping=m.slot_mapping[perm],
        token_seq=m.token_seq[perm],
        block_tables=m.block_tables,
        context_lens=m.context_lens,
        logits_indices=m.logits_indices,
    )
    out, _, _ = _step(
        case["q"][perm],
        case["kc"],
        case["vc"],
        case["k_new"][perm],
        case["v_new"][perm],
        meta,
        case["positions"][perm],
        chunk_tokens=2 * BS,
        query_tile=4,
        straggler_group=4,
    )
    ref, n_real = _reference(case)
    full = np.zeros_like(np.asarray(out))
    full[perm] = np.asarray(out)
    np.testing.assert_allclose(full[:n_real], ref, rtol=2e-5, atol=2e-5)


def test_padding_writes_do_not_disturb_results():
    case = _build(seed=2)
    args = (case["q"], case["kc"], case["vc"], case["k_new"], case["v_new"], case["meta"], case["positions"])
    out1, kc1, _ = _step(*args, chunk_tokens=2 * BS)
    # different garbage written by the padding tokens into block 0
    k_new2 = case["k_new"].at[-NUM_PAD:].set(-7e3)
    v_new2 = case["v_new"].at[-NUM_PAD:].set(9e3)
    out2, kc2, _ = _step(
        case["q"], case["kc"], case["vc"], k_new2, v_new2, case["meta"], case["positions"], chunk_tokens=2 * BS
    )
    n_real = sum(n for _, n in SEQS)
    np.testing.assert_array_equal(np.asarray(out1)[:n_real], np.asarray(out2)[:n_real])
    # the padding really wrote into block 0 and nowhere else
    slots1, slots2 = np.asarray(keys_to_slots(kc1)), np.asarray(keys_to_slots(kc2))
    assert np.all(slots2[:NUM_PAD] == -7e3)
    np.testing.assert_array_equal(slots1[BS:], slots2[BS:])


def test_sliding_window_matches_dense():
    case = _build(seed=3)
    window = 9
    for query_tile in (1, 4):
        out, _, _ = _step(
            case["q"],
            case["kc"],
            case["vc"],
            case["k_new"],
            case["v_new"],
            case["meta"],
            case["positions"],
            chunk_tokens=2 * BS,
            sliding_window=window,
            query_tile=query_tile,
            straggler_group=3,
        )
        ref, n_real = _reference(case, sliding_window=window)
        np.testing.assert_allclose(np.asarray(out)[:n_real], ref, rtol=2e-5, atol=2e-5)


def test_stacked_cache_with_layer_index():
    """The model's form: whole stacked cache (a leading layer axis) and a traced layer index."""
    case = _build(seed=4)
    # only layer 1 holds the real cached prefix; the others hold scaled garbage
    kc = jnp.stack([case["kc"] * f for f in (7.0, 1.0, 3.0)], axis=0)
    vc = jnp.stack([case["vc"] * f for f in (5.0, 1.0, -2.0)], axis=0)

    @jax.jit
    def step(k, v, layer, q, k_new, v_new, meta, positions):
        k, v = write_kv(k, v, k_new, v_new, meta.slot_mapping, layer=layer)
        out = paged_attention(q, k, v, meta, positions, block_size=BS, scale=SCALE, layer=layer, chunk_tokens=3 * BS)
        return out, k, v

    out, k, v = step(kc, vc, jnp.int32(1), case["q"], case["k_new"], case["v_new"], case["meta"], case["positions"])
    new_cache = KVCache.from_stacked(k, v, BS)
    ref, n_real = _reference(case)
    np.testing.assert_allclose(np.asarray(out)[:n_real], ref, rtol=2e-5, atol=2e-5)
    # other layers untouched
    for layer in (0, 2):
        np.testing.assert_array_equal(np.asarray(k[layer]), np.asarray(kc[layer]))
        np.testing.assert_array_equal(np.asarray(v[layer]), np.asarray(vc[layer]))
    # layer 1 now holds this step's keys/values at their slots
    k1, v1 = new_cache.read_slots(1, case["meta"].slot_mapping[:n_real])
    np.testing.assert_array_equal(np.asarray(k1), np.asarray(case["k_new"][:n_real]))
    np.testing.assert_array_equal(np.asarray(v1), np.asarray(case["v_new"][:n_real]))


def test_bfloat16_cache_close_to_dense():
    case = _build(seed=5, dtype=jnp.bfloat16)
    out, _, _ = _step(
        case["q"],
        case["kc"],
        case["vc"],
        case["k_new"],
        case["v_new"],
        case["meta"],
        case["positions"],
        chunk_tokens=2 * BS,
    )
    ref, n_real = _reference(case)
    out = np.asarray(out.astype(jnp.float32))[:n_real]
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < 2e-2, rel


def test_bfloat16_write_is_exact_and_in_place():
    """bfloat16 caches live as uint16 bits; a donated write must not copy the cache."""
    c = KVCache.create(num_layers=2, num_blocks=8, block_size=BS, num_kv_heads=KVH, head_dim=D, dtype=jnp.bfloat16)
    assert c.k[1].dtype == jnp.uint16 and c.dtype == jnp.bfloat16
    new = jnp.asarray(np.random.default_rng(0).standard_normal((3, KVH, D)), jnp.float32)
    slots = jnp.asarray([5, 9, 30], jnp.int32)

    @functools.partial(jax.jit, donate_argnums=0)
    def write(cache, new, slots):
        k, v = write_kv(cache.k[1], cache.v[1], new, -new, slots, cache_dtype=cache.dtype)
        return cache.replace(k=(cache.k[0], k), v=(cache.v[0], v))

    hlo = write.lower(c, new, slots).compile().as_text()
    for shape in layer_shapes(8, BS, KVH, D):  # no float32 round trip of the layer's cache
        assert f"f32[{','.join(map(str, shape))}]" not in hlo
    c = write(c, new, slots)
    got_k, got_v = c.read_slots(1, slots)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(new.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray((-new).astype(jnp.bfloat16)))
    assert not np.any(np.asarray(c.k[0])) and not np.any(np.asarray(c.v[0]))


def test_kv_cache_create_and_sizing():
    c = KVCache.create(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=jnp.bfloat16)
    # one array per layer: blocks, kv heads; keys transposed inside a block, values row-major
    assert len(c.k) == len(c.v) == 2
    assert c.k[1].shape == (5, 2, 8, 4) and c.v[1].shape == (5, 2, 4, 8) and c.dtype == jnp.bfloat16
    assert tuple(x.shape for x in c.stacked()) == cache_shapes(2, 5, 4, 2, 8)
    assert c.num_blocks == 5 and c.block_size == 4 and c.num_slots == 20
    assert (c.num_layers, c.num_kv_heads, c.head_dim) == (2, 2, 8)
    assert bytes_per_block(2, 4, 2, 8, jnp.bfloat16) * 5 == c.nbytes
    leaves, treedef = jax.tree_util.tree_flatten(c)
    assert len(leaves) == 4
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.block_size == 4 and back.dtype == jnp.bfloat16


def test_slot_form_round_trip_and_block_contents():
    """Token at slot b*BS+o of layer l, head h: keys at k[l, b, h, :, o], values at v[l, b, h, o, :]."""
    L, nb = 3, 5
    x = jnp.asarray(np.random.default_rng(9).standard_normal((L, nb * BS, KVH, D)), jnp.float32)
    k, v = keys_from_slots(x, BS), values_from_slots(x, BS)
    assert (k.shape, v.shape) == cache_shapes(L, nb, BS, KVH, D)
    np.testing.assert_array_equal(np.asarray(keys_to_slots(k)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(values_to_slots(v)), np.asarray(x))
    layer, block, offset, head = 2, 3, 1, 1
    slot = block * BS + offset
    np.testing.assert_array_equal(np.asarray(k[layer, block, head, :, offset]), np.asarray(x[layer, slot, head]))
    np.testing.assert_array_equal(np.asarray(v[layer, block, head, offset, :]), np.asarray(x[layer, slot, head]))


# decode only: one token per sequence (block-major attention's precondition)
SEQS_DECODE = [(36, 1), (4, 1), (44, 1), (0, 1), (17, 1), (7, 1)]


def _with_owners(case, major: bool):
    bt = np.asarray(case["meta"].block_tables)
    pad_row = bt.shape[0] - 1
    owner = np.full(NUM_BLOCKS, pad_row, np.int32)
    index = np.zeros(NUM_BLOCKS, np.int32)
    used = bt[:pad_row] > 0
    owner[bt[:pad_row][used]] = np.nonzero(used)[0]
    index[bt[:pad_row][used]] = np.nonzero(used)[1]
    return dataclasses.replace(
        case["meta"], block_owner=jnp.asarray(owner), block_index=jnp.asarray(index), block_major=jnp.asarray(major)
    )


@pytest.mark.parametrize("sliding_window", [None, 6])
def test_block_major_decode_matches_dense(sliding_window):
    """Every block of the cache times its owner's query, partial softmaxes merged
    per sequence: equal to dense attention, padding tokens get zeros, blocks
    nobody owns (garbage-filled) are ignored."""
    case = _build(seed=11, seqs=SEQS_DECODE)
    ref, n_real = _reference(case, sliding_window=sliding_window)
    for major in (True, False):
        out, _, _ = _step(
            case["q"],
            case["kc"],
            case["vc"],
            case["k_new"],
            case["v_new"],
            _with_owners(case, major),
            case["positions"],
            sliding_window=sliding_window,
        )
        out = np.asarray(out)
        np.testing.assert_allclose(out[:n_real], ref, rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(out[n_real:], 0.0)


def test_block_major_is_compiled_only_with_owners():
    case = _build(seed=12, seqs=SEQS_DECODE)
    args = (case["q"], case["kc"], case["vc"], case["k_new"], case["v_new"])
    plain = _step.lower(*args, case["meta"], case["positions"]).as_text()
    owned = _step.lower(*args, _with_owners(case, True), case["positions"]).as_text()
    # the block-major scores: one matmul over all NUM_BLOCKS blocks of the cache
    whole_cache = f"tensor<{NUM_BLOCKS}x{KVH}x{H // KVH}x{D}xf32>, tensor<{NUM_BLOCKS}x{KVH}x{D}x{BS}xf32>"
    assert whole_cache not in plain and whole_cache in owned
