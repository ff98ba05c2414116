"""The last layer computed for the sampled rows only (``output_rows``) gives
those rows' hidden states of the full forward pass, and the same cache.

The model-level check runs every test family (biases, tied embeddings, a
sliding window) on both CPU kernels over a mixed step: a prompt chunk that
continues a cached prefix, a fresh prompt and a decode token, on shuffled
blocks, padded, with the rows picked out of order and repeated (padding
rows of ``logits_indices`` point at token 0). The runner always passes
the step's rows (``ModelRunner._forward_fn``), so these checks are what
keep the engine's tokens those of the full forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model_fixtures as mf
from jaxserve.kernels import cpu as cpu_kernel
from jaxserve.kernels.backends import REFERENCE, AttentionImpl
from jaxserve.kernels.kv_cache import KVCache
from jaxserve.models import load_model
from jaxserve.models.functional import forward_fn, split_model
from step_fixtures import paged_step

BLOCK = 8
NUM_BLOCKS = 24
T = 64
KERNELS = [
    "reference",
    pytest.param("cpu", marks=pytest.mark.skipif(not cpu_kernel.available(), reason="no C++ kernel")),
]


def _mixed_step(vocab: int):
    """Three sequences: 0 continues a 10-token cached prefix with 20 tokens,
    1 is a fresh 30-token prompt, 2 decodes one token at position 17."""
    ids, pos, meta = paged_step(
        vocab, [10, 0, 17], [20, 30, 1], tokens=T, block=BLOCK, num_blocks=NUM_BLOCKS, table_width=6, seed=4
    )
    # the rows a step would keep: last tokens, score rows, a repeat, padding (0)
    rows = jnp.asarray([29, 50, 27, 28, 29, 0, 0, 10], jnp.int32)
    return ids, pos, meta, rows


def _filled_cache(model) -> KVCache:
    """A cache whose every slot holds some key and value (the prefixes the
    step reads), the same for both runs."""
    c = model.config
    cache = KVCache.create(c.num_hidden_layers, NUM_BLOCKS, BLOCK, c.num_key_value_heads, c.head_dim, jnp.float32)
    rng = np.random.default_rng(9)
    return cache.replace(
        k=[jnp.asarray(rng.normal(size=a.shape), jnp.float32) for a in cache.k],
        v=[jnp.asarray(rng.normal(size=a.shape), jnp.float32) for a in cache.v],
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("prune_ck")
    return {name: make(str(root / name)) for name, make in mf.FAMILIES.items()}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", list(mf.FAMILIES))
def test_output_rows_equal_the_full_forward_rows(family, kernel, folders):
    model = load_model(folders[family]).model
    model.attention = REFERENCE if kernel == "reference" else AttentionImpl(kernel="cpu")
    graphdef, state = split_model(model)
    ids, pos, meta, rows = _mixed_step(model.config.vocab_size)
    run = jax.jit(lambda st, cache, r: forward_fn(graphdef, st, ids, pos, cache, meta, r))
    full, full_cache = jax.jit(lambda st, cache: forward_fn(graphdef, st, ids, pos, cache, meta))(
        state, _filled_cache(model)
    )
    picked, picked_cache = run(state, _filled_cache(model), rows)
    assert full.shape == (T, model.config.hidden_size)
    assert picked.shape == (rows.shape[0], model.config.hidden_size)
    np.testing.assert_allclose(np.asarray(picked), np.asarray(full)[np.asarray(rows)], rtol=1e-5, atol=1e-5)
    for a, b in zip((*full_cache.k, *full_cache.v), (*picked_cache.k, *picked_cache.v)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("count", [T, T + 3])
def test_as_many_rows_as_the_step_are_picked_from_the_full_pass(folders, count):
    """``output_rows`` as long as the step or longer (nothing to save): the
    full pass, then those rows in their order."""
    model = load_model(folders["llama2"]).model
    graphdef, state = split_model(model)
    ids, pos, meta, _ = _mixed_step(model.config.vocab_size)
    wanted = np.random.default_rng(count).integers(0, T, count).astype(np.int32)
    full, _ = forward_fn(graphdef, state, ids, pos, _filled_cache(model), meta)
    picked, _ = forward_fn(graphdef, state, ids, pos, _filled_cache(model), meta, jnp.asarray(wanted))
    np.testing.assert_array_equal(np.asarray(picked), np.asarray(full)[wanted])
