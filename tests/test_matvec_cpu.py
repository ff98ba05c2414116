"""The C++ few-token matmul (jaxserve/kernels/cpu/matvec_cpu.cc): against a
float64 reference on ragged shapes (rows that are no multiple of the 4-row
tile, reductions that are no multiple of 16), bitwise independence of a
token's column from the batch and its size, its shape contract, and the
model using it in few-token programs with XLA's results."""

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
from test_last_layer_pruning import BLOCK, NUM_BLOCKS, _filled_cache

needs_kernel = pytest.mark.skipif(not cpu.available(), reason="the C++ kernel did not build here")

_mv = jax.jit(cpu.matvec_cpu)


def _operands(rows: int, inner: int, tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, inner), np.float32), rng.standard_normal((inner, tokens), np.float32)


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize(("rows", "inner"), [(1, 5), (3, 16), (37, 77), (1000, 512), (7, 1408), (130, 33)])
def test_matches_a_float64_reference(rows, inner, tokens):
    w, x = _operands(rows, inner, tokens)
    out = np.asarray(_mv(w, x))
    ref = w.astype(np.float64) @ x.astype(np.float64)
    # a float32 sum of `inner` products: error ~ sqrt(inner) ulps of the terms' magnitude
    tol = 1e-6 * np.sqrt(inner) * np.abs(w).max() * np.abs(x).max() * 4
    assert out.shape == (rows, tokens) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol)


@needs_kernel
@pytest.mark.parametrize("inner", [512, 77])
def test_a_tokens_column_does_not_depend_on_the_batch_or_its_size(inner):
    """Every token count runs the same arithmetic per output (16 lanes, one
    tree), so a column's result is bitwise the same alone, in any smaller
    batch next to other tokens, and in the full 32."""
    w, x = _operands(203, inner, 32, seed=1)
    full = np.asarray(_mv(w, x))
    rng = np.random.default_rng(2)
    for tokens in (1, 2, 4, 8, 16):
        cols = rng.choice(32, size=tokens, replace=False)
        part = np.asarray(_mv(w, np.ascontiguousarray(x[:, cols])))
        np.testing.assert_array_equal(part, full[:, cols])


@needs_kernel
def test_each_row_is_its_own_dot_product():
    """One row of ones against one-hot token columns picks single weights:
    an output written to the wrong row or token would show."""
    rows, inner = 9, 40
    w = np.arange(rows * inner, dtype=np.float32).reshape(rows, inner)
    x = np.zeros((inner, 4), np.float32)
    x[[0, 17, 31, 39], [0, 1, 2, 3]] = 1.0
    np.testing.assert_array_equal(np.asarray(_mv(w, x)), w[:, [0, 17, 31, 39]])


@needs_kernel
def test_shapes_it_does_not_take_are_refused_with_the_shapes_in_the_message():
    w, x = _operands(8, 16, 3)
    assert not cpu.matvec_pays(jnp.asarray(w), jnp.asarray(x))  # 3 tokens: no power of two
    with pytest.raises(ValueError, match=r"float32\[8, 16\] @ float32\[16, 3\]"):
        cpu.matvec_cpu(jnp.asarray(w), jnp.asarray(x))
    with pytest.raises(ValueError, match=r"@ float32\[8, 8\]"):  # inner dimensions disagree
        cpu.matvec_cpu(jnp.asarray(w), jnp.zeros((8, 8), jnp.float32))
    with pytest.raises(ValueError, match=r"bfloat16\[8, 16\]"):
        cpu.matvec_cpu(jnp.asarray(w, jnp.bfloat16), jnp.zeros((16, 8), jnp.float32))
    assert all(cpu.matvec_pays(jnp.asarray(w), jnp.zeros((16, t), jnp.float32)) for t in (1, 2, 4, 8, 16))
    for t in (32, 64):  # the tiled matmul's (32: computed here too, slower)
        assert not cpu.matvec_pays(jnp.asarray(w), jnp.zeros((16, t), jnp.float32))
        assert cpu.matmul_pays(jnp.asarray(w), jnp.zeros((16, t), jnp.float32))


def _small_step(vocab: int, tokens: int):
    """A ``tokens``-token step: sequence 0 continues a 10-token cached prefix
    with ``tokens - 4`` tokens, sequence 1 decodes one token at position 17,
    the rest is padding."""
    ids, pos, meta = paged_step(
        vocab,
        [10, 17],
        [tokens - 4, 1],
        tokens=tokens,
        block=BLOCK,
        num_blocks=NUM_BLOCKS,
        table_width=6,
        seed=5,
        logits_rows=2,
    )
    return ids, pos, meta, jnp.asarray([tokens - 5, tokens - 4], jnp.int32)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("matvec_ck")
    return {name: make(str(root / name)) for name, make in mf.FAMILIES.items()}


@needs_kernel
@pytest.mark.parametrize("tokens", [8, 16])
@pytest.mark.parametrize("family", list(mf.FAMILIES))
def test_the_model_takes_it_in_few_token_programs_with_xlas_results(family, tokens, folders):
    """Every test family on the CPU attention kernel, a step of 8 or 16
    tokens and the vocabulary projection of its two sampled rows: with the
    kernel on, the programs call it and their hidden states, cache and
    logits equal those of the same programs on XLA's matmul (kernel off)."""
    model = load_model(folders[family]).model
    model.attention = AttentionImpl(kernel="cpu")
    graphdef, state = split_model(model)
    ids, pos, meta, rows = _small_step(model.config.vocab_size, tokens)

    def run():
        step = jax.jit(lambda st, cache: forward_fn(graphdef, st, ids, pos, cache, meta))
        text = step.lower(state, _filled_cache(model)).as_text()
        hidden, cache = step(state, _filled_cache(model))
        logits = jax.jit(lambda st, h: logits_t_fn(graphdef, st, h))
        return text, hidden, cache, logits(state, hidden[rows]), logits.lower(state, hidden[rows]).as_text()

    on = run()
    saved = cpu.MATVEC_TOKENS
    cpu.MATVEC_TOKENS = ()
    try:
        off = run()
    finally:
        cpu.MATVEC_TOKENS = saved
    assert cpu.TARGET_MATVEC in on[0] and cpu.TARGET_MATVEC not in off[0]
    assert cpu.TARGET_MATVEC in on[4] and cpu.TARGET_MATVEC not in off[4]
    np.testing.assert_allclose(np.asarray(on[1]), np.asarray(off[1]), rtol=1e-5, atol=1e-5)
    for a, b in zip((*on[2].k, *on[2].v), (*off[2].k, *off[2].v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(on[3]), np.asarray(off[3]), rtol=1e-4, atol=1e-4)


def test_a_single_token_bucket_is_added_below_the_powers_of_two():
    from jaxserve.engine.buckets import Buckets

    assert Buckets.build(64, 4).tokens == (8, 16, 32, 64)
    assert Buckets.build(64, 4, single_token=True).tokens == (1, 8, 16, 32, 64)
    assert Buckets.build(64, 4, single_token=True).token_bucket(1) == 1
    assert Buckets.build(64, 4, single_token=True).token_bucket(2) == 8


@needs_kernel
def test_one_sequence_decodes_in_a_one_token_program_with_the_eight_token_programs_tokens(tmp_path):
    """On the C++ kernels' path the runner compiles a 1-token bucket (the
    matrix-vector kernel then multiplies no padding columns): a lone decode
    token runs there, calls the kernel, and picks the same greedy tokens and
    log-probabilities as the 8-token program; the pure-JAX path keeps 8 as
    its smallest bucket."""
    from jaxserve.engine.buckets import Buckets
    from jaxserve.engine.runner import ModelRunner, SeqWork
    from jaxserve.engine.sampler import SamplingRow
    from jaxserve.sampling_params import SamplingParams

    loaded = load_model(mf.llama2(str(tmp_path / "ck")))
    cfg, model = loaded.config, loaded.model
    sizes = dict(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        num_blocks=8,
        block_size=16,
        max_num_seqs=1,
        max_num_batched_tokens=32,
        max_model_len=64,
    )
    assert ModelRunner(model, **sizes).buckets.tokens[0] == 8  # reference attention
    model.attention = AttentionImpl(kernel="cpu")
    one = ModelRunner(model, **sizes)
    eight = ModelRunner(model, **sizes, buckets=Buckets(tokens=(8, 32), seqs=(1,)))
    assert one.buckets.tokens == (1, 8, 16, 32)
    for r in (one, eight):
        r.warmup()
    assert cpu.TARGET_MATVEC in one._forward[1].as_text()
    prompt = np.random.default_rng(2).integers(3, cfg.vocab_size, 12).tolist()
    tokens, logprobs = {}, {}
    for name, r in (("one", one), ("eight", eight)):
        for with_logprobs in (False, True):
            sampling = SamplingRow(SamplingParams(temperature=0.0, logprobs=with_logprobs))
            first = r.execute([SeqWork(token_ids=prompt, start_pos=0, block_ids=[1], sampling=sampling)]).fetch()[0]
            seq, lps = [int(first[0])], []
            for step in range(3):
                t, lp = r.execute(
                    [SeqWork(token_ids=[seq[-1]], start_pos=12 + step, block_ids=[1, 2], sampling=sampling)]
                ).fetch()
                seq.append(int(t[0]))
                lps.append(float(lp[0]))
            tokens[name, with_logprobs], logprobs[name, with_logprobs] = seq, lps
    assert tokens["one", False] == tokens["eight", False] == tokens["one", True] == tokens["eight", True]
    np.testing.assert_allclose(logprobs["one", True], logprobs["eight", True], rtol=1e-5, atol=1e-5)
