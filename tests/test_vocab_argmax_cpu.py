"""The C++ one-pass greedy pick over vocabulary logits
(jaxserve/kernels/cpu/vocab_argmax_cpu.cc): the same tokens as
``sampler.argmax`` on random logits of every size, ties across the
threads' runs of rows, NaN / infinity columns, its shape contract, and the
runner's greedy programs taking it on the CPU kernel path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model_fixtures as mf
from jaxserve.engine.buckets import Buckets
from jaxserve.engine.runner import ModelRunner, SeqWork
from jaxserve.engine.sampler import SamplingRow, argmax
from jaxserve.kernels import cpu
from jaxserve.kernels.backends import AttentionImpl
from jaxserve.models import load_model
from jaxserve.sampling_params import SamplingParams

needs_kernel = pytest.mark.skipif(not cpu.available(), reason="the C++ kernel did not build here")

_kernel = jax.jit(cpu.vocab_argmax_cpu)
_reference = jax.jit(lambda x: argmax(x, axis=0))


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 5, 1500, 4099, 32000])
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 24, 64])
def test_matches_the_samplers_argmax(vocab, rows):
    x = np.random.default_rng(vocab + rows).standard_normal((vocab, rows)).astype(np.float32)
    got = np.asarray(_kernel(x))
    assert got.dtype == np.int32 and got.shape == (rows,)
    np.testing.assert_array_equal(got, np.asarray(_reference(x)))
    np.testing.assert_array_equal(got, x.argmax(axis=0))


@needs_kernel
def test_ties_go_to_the_first_index_across_runs_of_rows_and_nan_columns_to_zero():
    vocab, rows = 9000, 32  # several runs of rows (>= 1024 each), so ties cross them
    x = np.random.default_rng(0).uniform(-1, 1, (vocab, rows)).astype(np.float32)
    x[[10, 8990], 0] = 5.0  # tie: first run and last run
    x[[4500, 4501], 1] = 5.0  # tie: adjacent rows, possibly either side of a run's border
    x[[2048, 7000], 2] = 5.0
    x[:, 3] = -np.inf  # nothing above -inf: index 0
    x[[77, 80], 4] = np.inf  # first +inf
    x[123, 5] = np.nan  # a NaN anywhere: 0 (sampler.argmax's contract)
    x[8999, 6] = np.nan
    x[:, 7] = 1.0  # constant column: 0
    got = np.asarray(_kernel(x))
    assert got[:8].tolist() == [10, 4500, 2048, 0, 77, 0, 0, 0]
    # elsewhere the sampler's argmax (whose CPU max skips NaN: columns 5, 6 differ there)
    same = np.ones(rows, bool)
    same[[5, 6]] = False
    np.testing.assert_array_equal(got[same], np.asarray(_reference(x))[same])


@needs_kernel
def test_logits_it_does_not_take_are_refused_with_the_shape_in_the_message():
    assert not cpu.vocab_argmax_serves(jnp.zeros((100, 0), jnp.float32))
    assert not cpu.vocab_argmax_serves(jnp.zeros((100, 16), jnp.bfloat16))
    assert not cpu.vocab_argmax_serves(jnp.zeros((100,), jnp.float32))
    assert cpu.vocab_argmax_serves(jnp.zeros((100, 1), jnp.float32))
    with pytest.raises(ValueError, match=r"bfloat16\[100, 16\]"):
        cpu.vocab_argmax_cpu(jnp.zeros((100, 16), jnp.bfloat16))


def _runner(model, cfg, cpu_argmax: bool | None = None) -> ModelRunner:
    r = ModelRunner(
        model,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        num_blocks=40,
        block_size=16,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=64,
        buckets=Buckets(tokens=(16, 64), seqs=(16,)),
    )
    if cpu_argmax is not None:
        r.cpu_argmax = cpu_argmax
    r.warmup()
    return r


@needs_kernel
def test_the_runners_greedy_programs_take_it_with_the_same_tokens(tmp_path):
    loaded = load_model(mf.llama2(str(tmp_path / "ck")))
    cfg = loaded.config
    loaded.model.attention = AttentionImpl(kernel="cpu")
    on, off = _runner(loaded.model, cfg), _runner(loaded.model, cfg, cpu_argmax=False)
    assert on.cpu_argmax  # the default on the CPU kernel path
    assert cpu.TARGET_ARGMAX in on._forward[16].as_text() and cpu.TARGET_ARGMAX not in off._forward[16].as_text()
    greedy = SamplingRow(SamplingParams(temperature=0.0))
    rng = np.random.default_rng(1)
    prompts = [
        SeqWork(
            token_ids=rng.integers(3, cfg.vocab_size, 12).tolist(),
            start_pos=0,
            block_ids=[1 + 2 * i, 2 + 2 * i],
            sampling=greedy,
        )
        for i in range(4)
    ]
    tokens = []
    for r in (on, off):
        first = r.execute(prompts).fetch()[0].tolist()
        decodes = [
            SeqWork(token_ids=[t], start_pos=12, block_ids=[1 + 2 * i, 2 + 2 * i], sampling=greedy)
            for i, t in enumerate(first)
        ]
        tokens.append((first, r.execute(decodes).fetch()[0].tolist()))
    assert tokens[0] == tokens[1]
