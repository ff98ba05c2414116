"""Every registered family through the engine, against transformers on the same random checkpoint.

For each family of ``model_fixtures.FAMILIES`` (tiny random checkpoints
written by transformers itself) the engine serves, in one run with a small
KV cache and 16-token blocks:

- three greedy prompts (10, 40 and 70 tokens, 40 new tokens each: longer
  than the fixtures' 24-token sliding windows), whose blocks do not all fit
  at once, so the scheduler preempts and later resumes one of them;
- after them, a prompt that repeats the 70-token prompt's first 48 tokens,
  so its prefill starts from prefix-cache blocks.

Checked: every token equals ``transformers`` ``generate``'s, every
reported log-probability is within 1e-4 of transformers' log-softmax, the
run preempted and hit the prefix cache, and label scores (the summed
log-probability of each label's tokens after a prompt) equal transformers'.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import model_fixtures as mf
from jaxserve.engine.llm import LLM
from jaxserve.kernels.kv_cache import bytes_per_block
from jaxserve.models.config import ModelConfig
from jaxserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(900)

LOGPROB_ATOL = 1e-4
BLOCK = 16
NEW_TOKENS = 40
PROMPT_LENGTHS = (10, 40, 70)
SHARED_PREFIX = 48
# usable blocks: the three requests need 4 + 5 + 7 at their longest, and any two of them more than
# 8, so they preempt even when speculative decoding (on by default) finishes the short one early
CACHE_BLOCKS = 8


@pytest.fixture(scope="module")
def folder_of(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")

    @functools.cache
    def get(family: str) -> str:
        return mf.with_tokenizer(mf.FAMILIES[family](str(root / family)))

    return get


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, mf.VOCAB, n).tolist()


def _hf_logsoftmax(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def _llm(folder: str) -> LLM:
    c = ModelConfig.from_folder(folder)
    per_block = bytes_per_block(c.num_hidden_layers, BLOCK, c.num_key_value_heads, c.head_dim, "float32")
    return LLM(
        folder,
        max_num_seqs=4,
        max_model_len=128,
        max_num_batched_tokens=64,
        block_size=BLOCK,
        kv_cache_memory=(CACHE_BLOCKS + 1) * per_block,
        enable_prefix_caching=True,
    )


@pytest.mark.parametrize("family", list(mf.FAMILIES))
def test_engine_tokens_logprobs_and_scores_equal_transformers(family, folder_of):
    folder = folder_of(family)
    hf = mf.hf_model(folder)
    llm = _llm(folder)
    sched = llm.engine.scheduler
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=True, ignore_eos=True)
    prompts = [_prompt(n, seed=n) for n in PROMPT_LENGTHS]
    outs = llm.generate(prompts, params)
    assert sched.num_preemptions > 0, "the KV cache was meant to be too small for all three at once"

    hits_before = sched.prefix_cache_hits
    shared = prompts[-1][:SHARED_PREFIX] + _prompt(6, seed=99)
    [shared_out] = llm.generate([shared], params)
    assert sched.prefix_cache_hits > hits_before, "the shared prefix was meant to come from the cache"

    for prompt, out in zip([*prompts, shared], [*outs, shared_out]):
        assert out.error is None, out.error
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS)
        assert out.token_ids == theirs[0, len(prompt) :].tolist(), (family, len(prompt))
        ref = _hf_logsoftmax(hf, prompt + out.token_ids)[len(prompt) - 1 : -1]
        chosen = ref[np.arange(len(out.token_ids)), out.token_ids]
        np.testing.assert_allclose(out.logprobs, chosen, atol=LOGPROB_ATOL, err_msg=family)

    labels = ["alpha", "beta gamma", "the end"]
    text = "Once upon a time there was"
    [scores] = llm.score([text], labels)
    assert not isinstance(scores, Exception), scores
    tok = llm.engine.tokenizer
    prompt_ids = tok.encode(text)
    for label in scores:
        label_ids = tok.encode(label.label, add_special_tokens=False)
        ref = _hf_logsoftmax(hf, prompt_ids + label_ids)
        expected = sum(ref[len(prompt_ids) - 1 + j, t] for j, t in enumerate(label_ids))
        assert abs(label.logprob - expected) < LOGPROB_ATOL * len(label_ids), (family, label)
