"""Every sampling parameter reaches the sampler, and the greedy programs
serve only the rows they serve exactly.

A new field of ``SamplingParams`` fails ``test_every_field_has_a_changed_value``
until it has a changed value below. Then either it changes what the
sampling stage gives a request (``test_each_sampling_field_reaches_the_sampler``),
or it is listed in ``READ_ELSEWHERE`` with what reads it instead, and then
it must change nothing there. A row that ``is_plain_greedy`` hands to the
greedy programs (an argmax and its log-probability) must get from them what
``sample`` would give it (``test_the_greedy_programs_serve_a_row_exactly``):
a knob the greedy check ignores wrongly fails there. Rows are built as the
engine builds them (``step_inputs.sampling_row`` from a ``Request``).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.engine.request import Request
from jaxserve.engine.sampler import (
    SamplingTensors,
    argmax,
    chosen_logprobs,
    host_sampling_tensors,
    is_plain_greedy,
    mask_words,
    sample_with_top,
)
from jaxserve.engine.step_inputs import sampling_row
from jaxserve.sampling_params import SamplingParams, StructuredOutput

VOCAB = 40
ROWS = 32
PROMPT = [1, 2, 3, 2]
OUTPUT = [5, 5, 7]
#: structured output in these tests: the constraint's mask allows tokens 0 and 1
ALLOWED = (0, 1)

#: for each field, a non-default valid value, and what the request has
#: beside it so that the value can matter
CHANGED: dict[str, tuple[object, dict]] = {
    "max_tokens": (3, {}),
    "temperature": (0.5, {}),
    "top_p": (0.3, {}),
    "top_k": (2, {}),
    "min_p": (0.3, {}),
    "seed": (12345, {}),
    "repetition_penalty": (1.8, {}),
    "frequency_penalty": (1.5, {}),
    "presence_penalty": (1.5, {}),
    "stop": (("x",), {}),
    "stop_token_ids": ((3,), {}),
    "ignore_eos": (True, {}),
    "logprobs": (True, {"top_logprobs": 3}),
    "top_logprobs": (3, {"logprobs": True}),
    "structured": (StructuredOutput("regex", "a+"), {}),
    "num_speculative_tokens": (0, {}),
}

#: fields the sampler does not read, and who does
READ_ELSEWHERE = {
    "max_tokens": "the scheduler ends a request at max_tokens",
    "stop": "the output processor (OutputState) ends a request at a stop string",
    "stop_token_ids": "the output processor (OutputState) ends a request at a stop id",
    "ignore_eos": "the output processor (OutputState) does not stop at EOS",
    "num_speculative_tokens": "the scheduler's drafter (how many guessed tokens a step verifies, never which tokens come)",
}


@pytest.fixture(scope="module")
def logits():
    values = np.random.default_rng(0).normal(size=(ROWS, VOCAB)).astype(np.float32) * 3
    values[::2, OUTPUT[0]] += 6.0  # half the rows would pick a token the request already produced
    return values


def _row(params: SamplingParams):
    request = Request("r", PROMPT, params)
    for token in OUTPUT:
        request.append_output_token(token)
    mask = None
    if params.structured is not None:
        words = np.zeros(mask_words(VOCAB), np.int32)
        for token in ALLOWED:
            words[token // 32] |= 1 << (token % 32)
        mask = words
    return sampling_row(request, mask)


def _sampling_program(rows, logits):
    arrays = host_sampling_tensors(rows, len(rows), 16, mask_words(VOCAB))
    tokens, logprobs, top_values, top_ids = jax.jit(sample_with_top)(logits, SamplingTensors(**arrays))
    top = (np.asarray(top_values), np.asarray(top_ids)) if np.any(arrays["top_logprobs"]) else None
    return np.asarray(tokens), np.asarray(logprobs), top


def _greedy_programs(rows, logits):
    """What the runner's greedy programs compute: the first maximum and,
    when a row asks, its log-probability under the raw logits."""
    tokens = jax.jit(argmax)(logits)
    logprobs = chosen_logprobs(logits, tokens) if any(r.params.logprobs for r in rows) else np.zeros(len(rows))
    return np.asarray(tokens), np.asarray(logprobs), None


def _served(params: SamplingParams, logits):
    """What the sampling stage gives rows of ``params``: the program the
    runner picks for them, and what it returns."""
    rows = [_row(params)] * len(logits)
    program = _greedy_programs if is_plain_greedy(rows[0]) else _sampling_program
    return program(rows, logits)


def _params(temperature: float, name: str | None = None) -> tuple[SamplingParams, SamplingParams]:
    """The base parameters at ``temperature`` (with what ``name`` needs
    beside it) and the same with ``name`` changed."""
    base = SamplingParams(temperature=temperature, seed=7)
    if name is None:
        return base, base
    value, beside = CHANGED[name]
    base = dataclasses.replace(base, **beside)
    changed = dataclasses.replace(base, **{name: value})
    changed.validate()
    return base, changed


def _same(a, b) -> bool:
    tokens_a, logprobs_a, top_a = a
    tokens_b, logprobs_b, top_b = b
    if (top_a is None) != (top_b is None):
        return False
    if top_a is not None and not all(np.allclose(x, y) for x, y in zip(top_a, top_b)):
        return False
    return np.array_equal(tokens_a, tokens_b) and np.allclose(logprobs_a, logprobs_b, atol=1e-5)


def test_every_field_has_a_changed_value():
    assert set(CHANGED) == {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(READ_ELSEWHERE) <= set(CHANGED)


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_each_sampling_field_reaches_the_sampler(name, logits):
    changes = []
    for temperature in (0.0, 1.0):
        base, changed = _params(temperature, name)
        changes.append(not _same(_served(base, logits), _served(changed, logits)))
    if name in READ_ELSEWHERE:
        assert not any(changes), f"{name} is listed as read elsewhere, yet the sampler's result changes"
    else:
        assert any(changes), f"the sampler gives the same result whatever {name} is"


@pytest.mark.parametrize("name", [None, *sorted(CHANGED)])
def test_the_greedy_programs_serve_a_row_exactly(name, logits):
    _, params = _params(0.0, name)
    if name == "temperature":
        params = dataclasses.replace(params, temperature=0.0)
    rows = [_row(params)] * len(logits)
    if name is None:
        assert is_plain_greedy(rows[0])  # the plain greedy row: the check can fail
    if not is_plain_greedy(rows[0]):
        return  # the sampling program serves it
    greedy_tokens, greedy_logprobs, _ = _greedy_programs(rows, logits)
    tokens, logprobs, top = _sampling_program(rows, logits)
    assert top is None, "alternatives were asked for, which the greedy programs do not compute"
    assert np.array_equal(greedy_tokens, tokens)
    if params.logprobs:
        np.testing.assert_allclose(greedy_logprobs, logprobs, rtol=1e-5, atol=1e-6)
