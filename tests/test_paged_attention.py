"""Paged attention against dense attention: shuffled block tables, mixed batches, GQA,
padding writes to the null block, multi-chunk online softmax, sliding windows, and
the per-layer score features (logit soft-capping, attention sinks), with the dense
oracle itself held to transformers' eager formulas for them."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import cpu as cpu_kernel
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


def _reference(case, sliding_window=None, **features):
    """Dense attention per sequence (``features``: ``logit_softcap``, ``sinks``); padding rows get zeros."""
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
                **features,
            )
        )
        t += new
    return np.asarray(jnp.concatenate(outs)), t


@functools.partial(
    jax.jit, static_argnames=("chunk_tokens", "sliding_window", "query_tile", "straggler_group", "logit_softcap")
)
def _step(
    q,
    kc,
    vc,
    k_new,
    v_new,
    meta,
    positions,
    chunk_tokens=None,
    sliding_window=None,
    query_tile=16,
    straggler_group=32,
    logit_softcap=None,
    sinks=None,
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
        logit_softcap=logit_softcap,
        sinks=sinks,
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


# ------------------------------------------------- logit soft-capping and attention sinks

#: a cap the scores of these cases cross: unit-normal queries and keys scaled
#: by 1/sqrt(D) give scores of spread ~1, and 3x queries (below) ~3, well into
#: tanh's bend, so a kernel that skipped or misplaced the cap would be far off
CAP = 2.0


def _sinks(heads: int, seed: int = 0) -> jax.Array:
    """One sink logit per query head, all different (a head mix-up shows), some
    large enough to take most of a row's mass."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(heads) * 2 + 2, jnp.float32)


FEATURES = {
    "softcap": lambda heads: {"logit_softcap": CAP},
    "sinks": lambda heads: {"sinks": _sinks(heads)},
    "both": lambda heads: {"logit_softcap": CAP, "sinks": _sinks(heads)},
}


def transformers_formulas(q, k, v, *, scale, q_positions, sliding_window=None, logit_softcap=None, sinks=None):
    """transformers' eager attention, one query head at a time in float64 numpy:
    ``w = q @ k^T * scaling``; gemma2's ``tanh(w / softcap) * softcap``; the
    additive mask; gpt_oss's sinks concatenated as a last column, the row max
    (sink included) subtracted, softmax, the column dropped; ``w @ v``. Head
    ``h`` reads kv head ``h // G`` (``repeat_kv``)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T, H, D = q.shape
    K, kvh, _ = k.shape
    G = H // kvh
    kpos = np.arange(K)
    visible = kpos[None, :] <= np.asarray(q_positions)[:, None]
    if sliding_window is not None:
        visible &= kpos[None, :] > np.asarray(q_positions)[:, None] - sliding_window
    out = np.zeros((T, H, D))
    for h in range(H):
        w = q[:, h] @ k[:, h // G].T * scale
        if logit_softcap is not None:
            w = np.tanh(w / logit_softcap) * logit_softcap
        w = w + np.where(visible, 0.0, -np.inf)
        if sinks is not None:
            w = np.concatenate([w, np.full((T, 1), float(sinks[h]))], axis=1)
        w = w - w.max(axis=1, keepdims=True)
        p = np.exp(w)
        p = p / p.sum(axis=1, keepdims=True)
        if sinks is not None:
            p = p[:, :-1]
        out[:, h] = p @ v[:, h // G]
    return out


def _dense_case(seed: int, *, T: int, K: int, kvh: int, G: int, D: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, kvh * G, D)).astype(np.float32) * 3
    k = rng.standard_normal((K, kvh, D)).astype(np.float32)
    v = rng.standard_normal((K, kvh, D)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("feature", ["softcap", "sinks", "both"])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_dense_oracle_is_the_transformers_formulas(feature, group):
    """dense_causal_attention with the features equals a direct transcription
    of transformers' eager attention, with and without a sliding window."""
    kvh, D, K = 2, 16, 23
    q, k, v = _dense_case(group, T=9, K=K, kvh=kvh, G=group, D=D)
    features = FEATURES[feature](kvh * group)
    positions = np.arange(K - 9, K)
    for window in (None, 5):
        got = dense_causal_attention(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=D**-0.5, sliding_window=window, **features
        )
        want = transformers_formulas(q, k, v, scale=D**-0.5, q_positions=positions, sliding_window=window, **features)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
        plain = transformers_formulas(q, k, v, scale=D**-0.5, q_positions=positions, sliding_window=window)
        assert np.max(np.abs(want - plain)) > 0.05  # the feature matters in this case


def test_dense_oracle_matches_transformers_own_eager_attention():
    """The oracle against transformers' own functions: gemma2's
    eager_attention_forward (softcap) and gpt_oss's (sinks, read from the module)."""
    torch = pytest.importorskip("torch")
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    kvh, G, D, K, T = 2, 4, 32, 20, 7
    q, k, v = _dense_case(3, T=T, K=K, kvh=kvh, G=G, D=D)
    positions = np.arange(K - T, K)
    visible = np.arange(K)[None, :] <= positions[:, None]
    mask = torch.from_numpy(np.where(visible, 0.0, torch.finfo(torch.float32).min).astype(np.float32))[None, None]
    tq, tk, tv = (torch.from_numpy(x).transpose(0, 1)[None] for x in (q, k, v))  # [1, heads, tokens, D]
    sinks = _sinks(kvh * G, seed=4)

    module = SimpleNamespace(num_key_value_groups=G, training=False, head_dim=D)
    want, _ = gemma2_eager(module, tq, tk, tv, mask, scaling=D**-0.5, softcap=CAP)
    got = dense_causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=D**-0.5, logit_softcap=CAP)
    np.testing.assert_allclose(np.asarray(got), want[0].numpy(), rtol=2e-5, atol=2e-5)

    module = SimpleNamespace(num_key_value_groups=G, training=False, sinks=torch.tensor(np.asarray(sinks)))
    want, _ = gpt_oss_eager(module, tq, tk, tv, mask, scaling=D**-0.5)
    got = dense_causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=D**-0.5, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), want[0].numpy(), rtol=2e-5, atol=2e-5)


def test_dense_oracle_row_that_sees_no_key_gets_zeros():
    """A query before every key (position -1): with sinks the transcription's
    softmax puts all the mass on the sink, so zeros; without, the oracle says
    zeros too (the kernels' padding rows), not NaN."""
    q, k, v = _dense_case(5, T=3, K=6, kvh=1, G=2, D=8)
    positions = jnp.asarray([-1, 2, 5])
    sinks = _sinks(2)
    got = np.asarray(
        dense_causal_attention(*map(jnp.asarray, (q, k, v)), scale=0.3, q_positions=positions, sinks=sinks)
    )
    want = transformers_formulas(q, k, v, scale=0.3, q_positions=np.asarray(positions), sinks=sinks)
    np.testing.assert_array_equal(want[0], 0.0)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    plain = np.asarray(dense_causal_attention(*map(jnp.asarray, (q, k, v)), scale=0.3, q_positions=positions))
    np.testing.assert_array_equal(plain[0], 0.0)
    assert np.all(np.isfinite(plain))


def test_feature_arguments_are_checked():
    q, k, v = (jnp.asarray(x) for x in _dense_case(0, T=2, K=4, kvh=1, G=2, D=4))
    for bad in (0.0, -1.0, jnp.float32(2.0)):
        with pytest.raises(ValueError, match="logit_softcap must be a positive Python float"):
            dense_causal_attention(q, k, v, scale=0.5, logit_softcap=bad)
    with pytest.raises(ValueError, match=r"sinks must hold one logit per query head, \[2\]"):
        dense_causal_attention(q, k, v, scale=0.5, sinks=jnp.zeros(1))


@pytest.mark.parametrize("feature,sliding_window", [("softcap", None), ("sinks", None), ("both", None), ("both", 9)])
def test_paged_features_match_dense(feature, sliding_window):
    """Every path of the gathering kernel with the features: the per-token
    kernel (query_tile=1), tiles with stragglers, chunked online softmax
    (chunks of 2 blocks); padding tokens (no key) get zeros, sinks or not."""
    case = _build(seed=13)
    case["q"] = case["q"] * 3
    case["q_np"] = case["q_np"] * 3
    features = FEATURES[feature](H)
    ref, n_real = _reference(case, sliding_window=sliding_window, **features)
    plain, _ = _reference(case, sliding_window=sliding_window)
    assert np.max(np.abs(ref - plain)) > 0.1
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
            sliding_window=sliding_window,
            query_tile=query_tile,
            straggler_group=3,
            **features,
        )
        out = np.asarray(out)
        np.testing.assert_allclose(out[:n_real], ref, rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(out[n_real:], 0.0)


def test_prefill_sized_step_with_features_uses_tiles():
    """A prefill-heavy step (the tile pass does most of the work), both features and a window."""
    case = _build(seed=14, seqs=SEQS_PREFILL)
    features = FEATURES["both"](H)
    ref, n_real = _reference(case, sliding_window=11, **features)
    out, _, _ = _step(
        case["q"],
        case["kc"],
        case["vc"],
        case["k_new"],
        case["v_new"],
        case["meta"],
        case["positions"],
        chunk_tokens=2 * BS,
        sliding_window=11,
        query_tile=(16, 4),
        straggler_group=2,
        **features,
    )
    np.testing.assert_allclose(np.asarray(out)[:n_real], ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("feature,sliding_window", [("softcap", None), ("sinks", 6), ("both", None), ("both", 6)])
def test_block_major_decode_with_features(feature, sliding_window):
    """Block-major decode merges the per-block partial softmaxes with the sink
    as one more term: equal to dense attention, and to the gathering kernel."""
    case = _build(seed=15, seqs=SEQS_DECODE)
    case["q"] = case["q"] * 3
    case["q_np"] = case["q_np"] * 3
    features = FEATURES[feature](H)
    ref, n_real = _reference(case, sliding_window=sliding_window, **features)
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
            **features,
        )
        out = np.asarray(out)
        np.testing.assert_allclose(out[:n_real], ref, rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(out[n_real:], 0.0)


def random_paged_case(seed: int, *, block_size: int, head_dim: int, kv_heads: int, group: int, seqs):
    """A per-layer ``blocks`` cache of shuffled blocks full of unit-normal
    garbage, and one step's tokens over it: ``seqs`` lists (context before the
    step, tokens in it); two padding tokens follow. Returns ``q`` (3x unit
    normal), ``k``, ``v``, ``meta``, ``positions``."""
    rng = np.random.default_rng(seed)
    width = max(-(-(c + n) // block_size) for c, n in seqs)
    num_blocks = len(seqs) * width + 2
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(seqs) + 1, width), np.int32)
    tok_seq, pos = [], []
    for s, (cached, new) in enumerate(seqs):
        nb = -(-(cached + new) // block_size)
        tables[s, :nb] = perm[s * width : s * width + nb]
        tok_seq += [s] * new
        pos += list(range(cached, cached + new))
    tok_seq += [len(seqs)] * 2
    pos += [0, 0]
    T = len(tok_seq)
    meta = AttentionMetadata(
        slot_mapping=jnp.zeros(T, jnp.int32),
        token_seq=jnp.asarray(np.array(tok_seq, np.int32)),
        block_tables=jnp.asarray(tables),
        context_lens=jnp.asarray(np.array([c + n for c, n in seqs] + [0], np.int32)),
        logits_indices=jnp.zeros(len(seqs) + 1, jnp.int32),
    )
    k = jnp.asarray(rng.standard_normal((num_blocks, kv_heads, head_dim, block_size)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((num_blocks, kv_heads, block_size, head_dim)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((T, kv_heads * group, head_dim)) * 3, jnp.float32)
    return q, k, v, meta, jnp.asarray(np.array(pos, np.int32))


def dense_from_cache(q, k_cache, v_cache, meta, positions, *, scale, **kwargs) -> np.ndarray:
    """``dense_causal_attention`` of each sequence's tokens over its keys and
    values read back from a per-layer ``blocks`` cache through its block
    table; zeros for tokens of rows with no context (padding)."""
    kc, vc = np.asarray(k_cache), np.asarray(v_cache)
    block_size = vc.shape[2]
    seq, pos = np.asarray(meta.token_seq), np.asarray(positions)
    tables, ctx = np.asarray(meta.block_tables), np.asarray(meta.context_lens)
    out = np.zeros(q.shape, np.float32)
    for s in np.unique(seq):
        if ctx[s] == 0:
            continue
        p = np.arange(ctx[s])
        blocks = tables[s, p // block_size]
        keys, values = kc[blocks, :, :, p % block_size], vc[blocks, :, p % block_size, :]  # [n, kvh, D]
        rows = np.nonzero(seq == s)[0]
        out[rows] = np.asarray(
            dense_causal_attention(
                q[rows], jnp.asarray(keys), jnp.asarray(values), scale=scale, q_positions=pos[rows], **kwargs
            )
        )
    return out


@pytest.mark.parametrize("group,head_dim", [(1, 64), (8, 64), (4, 128), (2, 256)])
def test_groups_and_head_dims_with_features(group, head_dim):
    """GQA groups 1-8 (gpt-oss: 64 query heads over 8 kv heads), head dims 64,
    128 and 256 (Gemma), decode and prefill tokens, both features and a window."""
    seqs = [(40, 1), (15, 1), (9, 20), (0, 6)]
    q, k, v, meta, positions = random_paged_case(
        group, block_size=16, head_dim=head_dim, kv_heads=2, group=group, seqs=seqs
    )
    features = FEATURES["both"](2 * group)
    scale = head_dim**-0.5
    out = jax.jit(
        lambda q, k, v, sinks: paged_attention(
            q, k, v, meta, positions, block_size=16, scale=scale, sliding_window=12, logit_softcap=CAP, sinks=sinks
        )
    )(q, k, v, features["sinks"])
    want = dense_from_cache(q, k, v, meta, positions, scale=scale, sliding_window=12, **features)
    np.testing.assert_allclose(np.asarray(out), want, rtol=3e-5, atol=3e-5)
    np.testing.assert_array_equal(np.asarray(out)[-2:], 0.0)


TP_CHILD = """
import dataclasses, json, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "tests")
from test_paged_attention import CAP, _sinks, dense_from_cache, random_paged_case
from jaxserve.kernels import cpu
from jaxserve.kernels.backends import REFERENCE, AttentionImpl, cache_spec, write_and_attend
from jaxserve.kernels.kv_cache import blocks_to_heads
from jaxserve.kernels.paged_attention import write_kv

KVH, G, D, BS = 4, 2, 16, 16
seqs = [(40, 1), (15, 1), (9, 20), (0, 6)]
q, k_cache, v_cache, meta, positions = random_paged_case(3, block_size=BS, head_dim=D, kv_heads=KVH, group=G, seqs=seqs)
T = q.shape[0]
rng = np.random.default_rng(4)
k_new = jnp.asarray(rng.standard_normal((T, KVH, D)), jnp.float32)
v_new = jnp.asarray(rng.standard_normal((T, KVH, D)), jnp.float32)
tables = np.asarray(meta.block_tables)
slots = [int(tables[s, p // BS]) * BS + p % BS if s < len(seqs) else 0
         for s, p in zip(np.asarray(meta.token_seq), np.asarray(positions))]
meta = dataclasses.replace(meta, slot_mapping=jnp.asarray(slots, jnp.int32))
sinks = _sinks(KVH * G, seed=9)
kb, vb = write_kv(k_cache, v_cache, k_new, v_new, meta.slot_mapping)
# max_kernel_tokens: all 30 tokens of this step through the GPU kernel (exact for any token)
impls = [REFERENCE, AttentionImpl(kernel="gpu", interpret=True, max_kernel_tokens=64)] + ([AttentionImpl(kernel="cpu")] if cpu.available() else [])
report = {"devices": jax.device_count()}
for tp in (2, 4):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    for impl in impls:
        # the GPU kernel itself takes the soft-capped layer; sink layers take the reference
        names = ("softcap", "both") if impl.kernel == "gpu" else ("both",)
        for name, feats in [(n, dict(logit_softcap=CAP, sinks=sinks if n == "both" else None)) for n in names]:
            want = dense_from_cache(q, kb, vb, meta, positions, scale=D**-0.5, sliding_window=None, **feats)
            kc, vc = (k_cache, v_cache) if impl.layout == "blocks" else blocks_to_heads(k_cache, v_cache)
            spec = jax.sharding.NamedSharding(mesh, cache_spec(impl.layout))
            kc, vc = jax.device_put(kc, spec), jax.device_put(vc, spec)
            cap = feats.get("logit_softcap")
            step = jax.jit(lambda q, k, v, kc, vc, meta, pos, sinks: write_and_attend(
                impl, q, k, v, kc, vc, meta, pos, block_size=BS, scale=D**-0.5, cache_dtype=jnp.float32,
                mesh=mesh, logit_softcap=cap, sinks=sinks))
            _, _, out = step(q, k_new, v_new, kc, vc, meta, positions, feats.get("sinks"))
            report[f"{impl.kernel}-{tp}-{name}"] = float(np.max(np.abs(np.asarray(out) - want)))
print("REPORT " + json.dumps(report))
"""


def test_tensor_parallel_splits_sinks_with_their_heads():
    """write_and_attend with a mesh of 2 and 4 virtual CPU devices (a child
    process: the device count is fixed when JAX starts), each device on its
    kv heads, their query heads and those heads' sinks (all different): the
    one-device dense result for the reference kernel over the blocks layout,
    the GPU kernel's adapter (interpreted; sink layers take the reference over
    the heads layout) and the C++ kernel."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", TP_CHILD], env=env, capture_output=True, text=True, timeout=600, cwd=root
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, f"child failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    report = json.loads(lines[-1][len("REPORT ") :])
    assert report.pop("devices") == 4
    kernels = {"reference", "gpu"} | ({"cpu"} if cpu_kernel.available() else set())
    assert {key.split("-")[0] for key in report} == kernels and len(report) == (len(kernels) + 1) * 2
    for key, err in report.items():
        assert err < 3e-5, (key, err)
