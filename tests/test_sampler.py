"""Device sampling: exact behaviour of each knob, and batch independence."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.engine.sampler import (
    SamplingRow,
    SamplingTensors,
    argmax,
    chosen_logprobs,
    host_sampling_tensors,
    sample,
)
from jaxserve.sampling_params import SamplingParams

VOCAB = 50


def _row(output_index=0, history=None, num_prompt=0, **params):
    """A greedy, unpenalized row with seed 0, but for ``params``
    (``SamplingParams`` fields)."""
    params = SamplingParams(**{"temperature": 0.0, "seed": 0, **params})
    return SamplingRow(params, output_index=output_index, history=history, num_prompt=num_prompt)


def _run(logits, rows, history_len=8):
    tensors = SamplingTensors(**host_sampling_tensors(rows, len(rows), history_len))
    tokens, logprobs = jax.jit(sample)(np.asarray(logits, np.float32), tensors)
    return np.asarray(tokens), np.asarray(logprobs)


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(size=(4, VOCAB)).astype(np.float32) * 3


def test_greedy_is_argmax_and_logprob_is_raw(logits):
    tokens, logprobs = _run(logits, [_row() for _ in range(4)])
    assert tokens.tolist() == logits.argmax(-1).tolist()
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(logprobs, raw[np.arange(4), tokens], rtol=1e-5)


def test_argmax_takes_the_first_of_tied_maxima_and_matches_numpy(logits):
    tied = np.array([[1.0, 5.0, 2.0, 5.0], [7.0, 7.0, 7.0, 7.0], [-3.0, -2.0, -2.5, -9.0]], np.float32)
    assert np.asarray(jax.jit(argmax)(tied)).tolist() == [1, 0, 1]
    assert np.asarray(jax.jit(argmax)(logits)).tolist() == logits.argmax(-1).tolist()
    tokens = np.array([3, 0, 49, 17], np.int32)
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(chosen_logprobs(logits, tokens)), raw[np.arange(4), tokens], rtol=1e-5)


def test_top_k_one_and_tiny_top_p_are_greedy(logits):
    rows = [_row(temperature=1.5, top_k=1, seed=i) for i in range(2)]
    rows += [_row(temperature=1.5, top_p=1e-6, seed=i) for i in range(2)]
    tokens, _ = _run(logits, rows)
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_seeded_sampling_is_independent_of_batch(logits):
    target = _row(temperature=1.0, seed=1234, output_index=5)
    alone, _ = _run(logits[2:3], [target])
    mixed_rows = [_row(temperature=0.7, seed=9), _row(), target, _row(temperature=2.0, seed=3)]
    mixed, _ = _run(logits[[0, 1, 2, 3]], mixed_rows)
    assert mixed[2] == alone[0]
    # and the seed matters: many seeds give more than one distinct token
    draws = {int(_run(logits[2:3], [_row(temperature=5.0, seed=s)])[0][0]) for s in range(20)}
    assert len(draws) > 1


def test_plain_temperature_draws_from_the_scaled_logits_whatever_shares_the_batch(logits):
    """No top-k/top-p/min-p: the draw is categorical over logits / T with the
    row's own key, the same when another row's filter makes the sort run."""
    import jax.numpy as jnp

    def expected(row_logits, seed, index, temp):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), index)
        return int(jax.random.categorical(key, jnp.asarray(row_logits) / temp))

    plain = [_row(temperature=0.8, seed=s, output_index=s % 3) for s in (7, 11, 13, 17)]
    alone, _ = _run(logits, plain)
    assert alone.tolist() == [expected(logits[i], r.params.seed, r.output_index, 0.8) for i, r in enumerate(plain)]
    with_filters = [
        plain[0],
        _row(temperature=1.0, top_p=0.5, seed=3),
        plain[2],
        _row(temperature=1.0, top_k=2, seed=4),
    ]
    mixed, _ = _run(logits, with_filters)
    assert mixed[0] == alone[0] and mixed[2] == alone[2]
    assert mixed[3] in set(np.argsort(-logits[3])[:2].tolist())


def test_top_k_restricts_support(logits):
    top3 = set(np.argsort(-logits[0])[:3].tolist())
    for seed in range(30):
        tokens, _ = _run(logits[:1], [_row(temperature=10.0, top_k=3, seed=seed)])
        assert int(tokens[0]) in top3


def test_min_p_restricts_support():
    logits = np.full((1, VOCAB), -10.0, np.float32)
    logits[0, 7] = 5.0
    logits[0, 8] = 4.9
    for seed in range(20):
        tokens, _ = _run(logits, [_row(temperature=1.0, min_p=0.5, seed=seed)])
        assert int(tokens[0]) in (7, 8)


def test_penalties_change_the_greedy_choice():
    logits = np.zeros((3, VOCAB), np.float32)
    logits[:, 3] = 2.0
    logits[:, 4] = 1.5
    history = [3, 3, 3]
    rows = [
        _row(repetition_penalty=2.0, history=history, num_prompt=3),  # prompt counts for repetition
        _row(frequency_penalty=0.3, history=[9] + history, num_prompt=1),  # 3 outputs * 0.3
        _row(presence_penalty=0.4, history=[3, 3], num_prompt=2),  # prompt only: no effect
    ]
    tokens, _ = _run(logits, rows)
    assert tokens.tolist() == [4, 4, 3]
