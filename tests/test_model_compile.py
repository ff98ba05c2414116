"""The engine-facing pure functions: AOT lowering, cache donation without copies, and
agreement between the forward/logits split and the fused step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.kernels.attention_metadata import AttentionMetadata
from jaxserve.kernels.kv_cache import KVCache
from jaxserve.models import CausalLM, ModelConfig, make_forward, make_logits, make_step

CFG = ModelConfig.from_dict(
    dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
)
BS = 16


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_donated_cache_is_updated_in_place(dtype):
    """Temporaries do not grow with the cache: every layer's writes alias its donated arrays."""
    model = nnx.eval_shape(lambda: CausalLM(CFG, dtype=dtype, rngs=nnx.Rngs(0)))
    fn, state = make_step(model)
    T, S = 16, 16
    meta = AttentionMetadata(_i32(T), _i32(T), _i32(S, 32), _i32(S), _i32(S))
    temps = []
    for num_blocks in (129, 2049):
        cache = KVCache.abstract(CFG.num_hidden_layers, num_blocks, BS, CFG.num_key_value_heads, CFG.head_dim, dtype)
        compiled = jax.jit(fn, donate_argnames=("kv_cache",)).lower(state, _i32(T), _i32(T), cache, meta).compile()
        mem = compiled.memory_analysis()
        if mem is None:
            pytest.skip("backend reports no memory analysis")
        cache_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in (*cache.k, *cache.v))
        assert mem.alias_size_in_bytes >= cache_bytes
        temps.append(mem.temp_size_in_bytes)
    grown = temps[1] - temps[0]
    assert grown < 1 << 20, temps  # 16x more cache (24 MB f32), temporaries unchanged


def test_forward_logits_and_step_agree():
    model = CausalLM(CFG, dtype=jnp.float32, rngs=nnx.Rngs(1))
    fwd, state = make_forward(model)
    logits_fn, _ = make_logits(model)
    step_fn, _ = make_step(model)
    fwd_j = jax.jit(fwd, donate_argnames=("kv_cache",))
    step_j = jax.jit(step_fn, donate_argnames=("kv_cache",))

    rng = np.random.default_rng(0)
    # two sequences: 5 prompt tokens and 3 prompt tokens, then 1 padding token
    table = np.array([[3, 0], [1, 0]], np.int32)
    ids = np.concatenate([rng.integers(0, 300, 8), [0]]).astype(np.int32)
    pos = np.array([0, 1, 2, 3, 4, 0, 1, 2, 0], np.int32)
    seq = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1], np.int32)
    slots = np.where(np.arange(9) < 8, table[seq, pos // BS] * BS + pos % BS, 0).astype(np.int32)
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray(slots),
        token_seq=jnp.asarray(seq),
        block_tables=jnp.asarray(table),
        context_lens=jnp.asarray([5, 3], jnp.int32),
        logits_indices=jnp.asarray([4, 7], jnp.int32),
    )
    mk = lambda: model.make_kv_cache(4, BS)  # noqa: E731
    hidden, cache1 = fwd_j(state, jnp.asarray(ids), jnp.asarray(pos), mk(), meta)
    assert hidden.shape == (9, CFG.hidden_size) and hidden.dtype == jnp.float32
    all_logits = jax.jit(logits_fn)(state, hidden)
    assert all_logits.shape == (9, CFG.vocab_size) and all_logits.dtype == jnp.float32
    picked, cache2 = step_j(state, jnp.asarray(ids), jnp.asarray(pos), mk(), meta)
    np.testing.assert_allclose(np.asarray(picked), np.asarray(all_logits)[[4, 7]], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache1.stacked()[0]), np.asarray(cache2.stacked()[0]))
    # each sequence is independent of the other one in the batch
    solo, _ = fwd_j(
        state,
        jnp.asarray(ids[5:8]),
        jnp.asarray(pos[5:8]),
        mk(),
        AttentionMetadata(
            jnp.asarray(slots[5:8]),
            jnp.zeros(3, jnp.int32),
            jnp.asarray(table[1:]),
            jnp.asarray([3], jnp.int32),
            jnp.asarray([2], jnp.int32),
        ),
    )
    np.testing.assert_allclose(np.asarray(solo), np.asarray(hidden)[5:8], rtol=1e-5, atol=1e-5)
