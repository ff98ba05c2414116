"""Reported log-probabilities equal transformers' on the same tokens: the
chosen token's and the ``top_logprobs`` alternatives', for sampled, greedy
and constrained requests (a constraint masks the draw, never the reported
raw distribution), through every sampling path (the greedy program, the
sampling program, the top-20 branch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxserve.engine.llm import LLM
from jaxserve.engine.structured import json_schema_constraint
from jaxserve.sampling_params import SamplingParams, StructuredOutput
from tests.engine_fixtures import build_engine_checkpoint

pytestmark = pytest.mark.timeout(900)

ATOL = 2e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlamaForCausalLM

    folder = build_engine_checkpoint(tmp_path_factory.mktemp("logprobs_ckpt"))
    llm = LLM(str(folder), max_num_seqs=8, max_model_len=128, max_num_batched_tokens=64)
    hf = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    return llm, hf


def _hf_logprobs(hf, prompt_ids: list[int], output_ids: list[int]) -> np.ndarray:
    """log-softmax at each position that predicts an output token: [n, vocab]."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1).numpy()
    start = len(prompt_ids) - 1
    return logp[start : start + len(output_ids)]


def test_logprobs_and_top_logprobs_equal_transformers(setup):
    llm, hf = setup
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["a"],
    }
    cases = [
        (
            "sampled, top 5",
            "The quick brown fox",
            SamplingParams(max_tokens=12, temperature=1.0, seed=1, logprobs=True, top_logprobs=5),
        ),
        ("greedy, chosen only", "Once upon a time", SamplingParams(max_tokens=12, temperature=0.0, logprobs=True)),
        ("greedy, top 20", "Hello", SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=20)),
        (
            "penalised",
            "alpha beta",
            SamplingParams(max_tokens=10, temperature=0.7, seed=2, presence_penalty=1.0, logprobs=True, top_logprobs=2),
        ),
        (
            "json schema",
            "Give JSON:",
            SamplingParams(
                max_tokens=30,
                temperature=1.0,
                seed=3,
                logprobs=True,
                top_logprobs=3,
                structured=json_schema_constraint(schema),
            ),
        ),
        (
            "choice",
            "Pick:",
            SamplingParams(
                max_tokens=8,
                temperature=0.0,
                logprobs=True,
                top_logprobs=1,
                structured=StructuredOutput("choice", ("left", "right")),
            ),
        ),
    ]
    outs = llm.generate([p for _, p, _ in cases], [sp for _, _, sp in cases])
    tok = llm.engine.tokenizer
    for (name, prompt, params), out in zip(cases, outs):
        assert out.error is None, (name, out.error)
        assert len(out.logprobs) == len(out.token_ids) > 0, name
        ref = _hf_logprobs(hf, tok.encode(prompt), out.token_ids)
        chosen = ref[np.arange(len(out.token_ids)), out.token_ids]
        np.testing.assert_allclose(out.logprobs, chosen, atol=ATOL, err_msg=name)
        if not params.top_logprobs:
            assert out.top_logprobs is None, name
            continue
        assert len(out.top_logprobs) == len(out.token_ids), name
        for row, alternatives in zip(ref, out.top_logprobs):
            assert len(alternatives) == params.top_logprobs, name
            ids = [t for t, _ in alternatives]
            values = np.array([v for _, v in alternatives])
            # each reported value is that token's, and they are the largest ones
            np.testing.assert_allclose(values, row[ids], atol=ATOL, err_msg=name)
            np.testing.assert_allclose(values, np.sort(row)[::-1][: len(ids)], atol=ATOL, err_msg=name)
    # the constraint held while the reported distribution stayed the model's own
    assert outs[5].text in ("left", "right")
