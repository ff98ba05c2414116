"""The C++ dense matmul of decode steps (jaxserve/kernels/cpu/matmul_cpu.cc):
against a float64 reference on ragged shapes (rows that are no multiple of
the register tile, odd reductions), bitwise independence of a token's
column from the rest of the batch, its shape contract, and the model using
it exactly where it serves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model_fixtures as mf
from jaxserve.kernels import cpu
from jaxserve.kernels.backends import AttentionImpl
from jaxserve.models import load_model
from jaxserve.models.functional import forward_fn, logits_t_fn, split_model
from step_fixtures import paged_step
from test_last_layer_pruning import _filled_cache, _mixed_step

needs_kernel = pytest.mark.skipif(not cpu.available(), reason="the C++ kernel did not build here")

_mm = jax.jit(cpu.matmul_cpu)


def _operands(rows: int, inner: int, tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, inner), np.float32), rng.standard_normal((inner, tokens), np.float32)


@needs_kernel
@pytest.mark.parametrize("tokens", [16, 32, 48, 64, 80, 208, 512])
@pytest.mark.parametrize(("rows", "inner"), [(1, 5), (37, 77), (1000, 512), (7, 1408)])
def test_matches_a_float64_reference(rows, inner, tokens):
    """(more than 64 tokens: x copied into 64-column panels, the last one
    narrower at 80 and 208)"""
    w, x = _operands(rows, inner, tokens)
    out = np.asarray(_mm(w, x))
    ref = w.astype(np.float64) @ x.astype(np.float64)
    # a float32 sum of `inner` products: error ~ sqrt(inner) ulps of the terms' magnitude
    tol = 1e-6 * np.sqrt(inner) * np.abs(w).max() * np.abs(x).max() * 4
    assert out.shape == (rows, tokens) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol)


@needs_kernel
def test_a_tokens_column_does_not_depend_on_the_rest_of_the_batch():
    w, x = _operands(100, 300, 64, seed=1)
    full = np.asarray(_mm(w, x))
    # the same columns at other places in smaller batches, next to other tokens
    rng = np.random.default_rng(2)
    for tokens in (16, 32, 48):
        cols = rng.choice(64, size=tokens, replace=False)
        part = np.asarray(_mm(w, np.ascontiguousarray(x[:, cols])))
        np.testing.assert_array_equal(part, full[:, cols])


@needs_kernel
def test_a_wide_batchs_columns_equal_the_same_columns_in_narrow_batches():
    """Panels (more than 64 tokens) change where a column is read, not its
    sum: every column of a 208-token product equals the same column in a
    16- or 64-token one."""
    w, x = _operands(100, 300, 208, seed=3)
    wide = np.asarray(_mm(w, x))
    for lo, width in ((0, 64), (64, 64), (192, 16), (128, 64)):
        part = np.asarray(_mm(w, np.ascontiguousarray(x[:, lo : lo + width])))
        np.testing.assert_array_equal(part, wide[:, lo : lo + width])


@needs_kernel
def test_shapes_it_does_not_take_are_refused_with_the_shapes_in_the_message():
    w, x = _operands(8, 16, 24)
    assert not cpu.matmul_pays(jnp.asarray(w), jnp.asarray(x))  # 24 tokens: no multiple of 16
    with pytest.raises(ValueError, match=r"float32\[8, 16\] @ float32\[16, 24\]"):
        cpu.matmul_cpu(jnp.asarray(w), jnp.asarray(x))
    with pytest.raises(ValueError, match=r"@ float32\[8, 32\]"):  # inner dimensions disagree
        cpu.matmul_cpu(jnp.asarray(w), jnp.zeros((8, 32), jnp.float32))
    with pytest.raises(ValueError, match=r"bfloat16\[8, 16\]"):
        cpu.matmul_cpu(jnp.asarray(w, jnp.bfloat16), jnp.zeros((16, 64), jnp.float32))
    wide = _operands(8, 16, 64)[1]
    assert cpu.matmul_pays(jnp.asarray(w), jnp.asarray(wide))
    assert not cpu.matmul_pays(jnp.asarray(w, jnp.bfloat16), jnp.asarray(wide))
    assert not cpu.matmul_pays(jnp.asarray(w), jnp.zeros((16, cpu.MATMUL_MAX_TOKENS + 16), jnp.float32))
    assert not cpu.matmul_pays(jnp.zeros((cpu.MATMUL_MAX_ROWS + 1, 16), jnp.float32), jnp.asarray(wide))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("matmul_ck")
    return {name: make(str(root / name)) for name, make in mf.FAMILIES.items()}


@needs_kernel
@pytest.mark.parametrize("family", list(mf.FAMILIES))
def test_the_model_takes_it_in_decode_sized_programs_with_xlas_results(family, folders):
    """Every test family on the CPU attention kernel, a mixed 64-token step:
    with the kernel on, the program calls it and its hidden states, cache and
    logits equal those of the same program on XLA's matmul (kernel off)."""
    model = load_model(folders[family]).model
    model.attention = AttentionImpl(kernel="cpu")
    graphdef, state = split_model(model)
    ids, pos, meta, rows = _mixed_step(model.config.vocab_size)

    def run():
        step = jax.jit(lambda st, cache: forward_fn(graphdef, st, ids, pos, cache, meta))
        text = step.lower(state, _filled_cache(model)).as_text()
        hidden, cache = step(state, _filled_cache(model))
        picked = jnp.zeros((64, hidden.shape[1]), jnp.float32).at[: rows.shape[0]].set(hidden[rows])
        logits = jax.jit(lambda st, h: logits_t_fn(graphdef, st, h))
        return text, hidden, cache, logits(state, picked), logits.lower(state, picked).as_text()

    on = run()
    saved = cpu.MATMUL_MAX_TOKENS
    cpu.MATMUL_MAX_TOKENS = 0
    try:
        off = run()
    finally:
        cpu.MATMUL_MAX_TOKENS = saved
    assert cpu.TARGET_MATMUL in on[0] and cpu.TARGET_MATMUL not in off[0]
    assert (cpu.TARGET_MATMUL in on[4]) == (model.config.vocab_size <= cpu.MATMUL_MAX_ROWS)
    np.testing.assert_allclose(np.asarray(on[1]), np.asarray(off[1]), rtol=1e-5, atol=1e-5)
    for a, b in zip((*on[2].k, *on[2].v), (*off[2].k, *off[2].v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(on[3]), np.asarray(off[3]), rtol=1e-4, atol=1e-4)


def _prefill_step(vocab: int):
    """A 128-token step: sequence 0 continues a 16-token cached prefix with
    100 tokens, sequence 1 is a fresh 20-token prompt, the rest padding."""
    ids, pos, meta = paged_step(
        vocab, [16, 0], [100, 20], tokens=128, block=8, num_blocks=24, table_width=16, seed=6, logits_rows=2
    )
    return ids, pos, meta, 120


@needs_kernel
@pytest.mark.parametrize("family", list(mf.FAMILIES))
def test_prefill_sized_programs_on_the_cpu_path_equal_the_reference_path(family, folders):
    """Above MATMUL_QKV_MAX_TOKENS the CPU path projects keys and values
    token-major (a second dot, no transpose; the other matrices take the
    C++ matmul up to MATMUL_MAX_TOKENS): its hidden states for a
    128-token step equal those of the reference attention path (XLA's fused
    projection, the pure-JAX kernel) on the same cached prefix."""
    from test_last_layer_pruning import _filled_cache

    ids, pos, meta, used = _prefill_step(load_model(folders[family]).config.vocab_size)
    hidden = {}
    for kernel in ("cpu", "reference"):
        model = load_model(folders[family]).model
        model.attention = AttentionImpl(kernel=kernel)
        graphdef, state = split_model(model)
        cache = _filled_cache(model)  # the same prefix keys and values, in this kernel's layout
        hidden[kernel] = np.asarray(
            jax.jit(lambda st, c, graphdef=graphdef: forward_fn(graphdef, st, ids, pos, c, meta)[0])(state, cache)
        )
    np.testing.assert_allclose(hidden["cpu"][:used], hidden["reference"][:used], rtol=1e-4, atol=1e-4)
