"""LongRoPE (Phi-3, Phi-4-mini) on both sides of the original context, against transformers.

The fixtures keep an original context of 24 tokens (of 256), so short and
long sequences fit the tests. transformers picks the factor set per
forward call (long when the sequence is longer than the original length;
Phi-3's ``generate`` recomputes the whole sequence long when it grows past
it). jaxserve picks once per request, by its prompt
(``jaxserve/models/families/phi3.py``):

- one forward pass over a whole sequence on either side equals
  transformers' logits (full and partial rotary);
- through the engine, with prompts prefilled in chunks that end before the
  original length, a request preempted after it crossed, and prefix-cache
  blocks of a short request that a long one must not take: a long prompt's
  tokens equal ``generate``'s and its log-probabilities are within 1e-4 of
  the logits ``generate`` reports; a short prompt that grows past the
  original length equals ``generate`` of the same model with the short
  factors kept throughout (the original length raised, the attention
  factor kept), which is transformers' own up to the crossing.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
import torch

import model_fixtures as mf
from jaxserve.engine.llm import LLM
from jaxserve.kernels.kv_cache import bytes_per_block
from jaxserve.models import load_model
from jaxserve.models.config import ModelConfig
from jaxserve.models.errors import ModelLoadError
from jaxserve.sampling_params import SamplingParams
from test_model_parity import F32_REL_BOUND, _hf_logits, _jax_logits, _rel

pytestmark = pytest.mark.timeout(900)

ORIGINAL = 24
BLOCK = 16
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def folder_of(tmp_path_factory):
    root = tmp_path_factory.mktemp("longrope")

    @functools.cache
    def get(name: str) -> str:
        return mf.with_tokenizer(mf.FAMILIES[name](str(root / name), original=ORIGINAL))

    return get


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, mf.VOCAB, n).tolist()


def test_config_reads_longrope_as_transformers_does(folder_of, tmp_path):
    c = ModelConfig.from_folder(folder_of("phi3"))
    assert c.rope.rope_type == "longrope" and c.rope.original_max_position_embeddings == ORIGINAL
    scale = 256 / ORIGINAL  # max_position_embeddings / original
    assert c.rope.attention_factor == pytest.approx(np.sqrt(1 + np.log(scale) / np.log(ORIGINAL)))
    assert c.rotary_dim is None and c.layer_windows == (24, 24)
    mini = ModelConfig.from_folder(folder_of("phi4mini"))
    assert mini.rotary_dim == 12 and mini.tie_word_embeddings and len(mini.rope.long_factor or ()) == 6

    # a transformers 4.x config: rope_scaling of type "su", the original length at the top level
    with open(os.path.join(folder_of("phi3"), "config.json")) as f:
        d = json.load(f)
    params = d.pop("rope_parameters")
    d["rope_theta"] = params.pop("rope_theta")
    d["rope_scaling"] = {"type": "su", "short_factor": params["short_factor"], "long_factor": params["long_factor"]}
    old = ModelConfig.from_dict(d)
    assert old.rope == c.rope

    d["rope_scaling"]["long_factor"] = d["rope_scaling"]["long_factor"][:-1]
    with pytest.raises(ModelLoadError, match="differ in length"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("name", ["phi3", "phi4mini"])
def test_one_pass_on_each_side_matches_transformers(name, folder_of):
    folder = folder_of(name)
    model = load_model(folder).model
    short, long = np.asarray(_prompt(20, seed=1), np.int32), np.asarray(_prompt(40, seed=2), np.int32)
    for ids in (short, long):
        assert _rel(_jax_logits(model, ids), _hf_logits(folder, ids)) < F32_REL_BOUND, (name, len(ids))
    # the long factors really change the result: the long sequence's first
    # 20 positions differ from the same tokens run on the short side
    head = long[:20]
    assert _rel(_hf_logits(folder, long)[:20], _hf_logits(folder, head)) > 1e-2


def _generate(hf, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and the log-probabilities of each under the logits ``generate`` saw."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=n,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, np.asarray(logprobs)


def _short_throughout(folder: str, dest: str) -> str:
    """A copy of ``folder`` whose model never switches to the long factors:
    the original length raised to the whole context, the attention factor
    kept as it was."""
    import shutil

    shutil.copytree(folder, dest)
    c = ModelConfig.from_folder(folder)

    def edit(d: dict) -> None:
        d["original_max_position_embeddings"] = d["max_position_embeddings"]
        d["rope_parameters"]["original_max_position_embeddings"] = d["max_position_embeddings"]
        d["rope_parameters"]["attention_factor"] = c.rope.attention_factor

    return mf.edit_config(dest, edit)


def _check(hf, prompt: list[int], out, n: int, what: str) -> None:
    assert out.error is None, out.error
    tokens, logprobs = _generate(hf, prompt, n)
    assert out.token_ids == tokens, what
    np.testing.assert_allclose(out.logprobs, logprobs, atol=LOGPROB_ATOL, err_msg=what)


def test_engine_keeps_each_requests_side(folder_of, tmp_path):
    folder = folder_of("phi3")
    hf = mf.hf_model(folder)
    hf_short = mf.hf_model(_short_throughout(folder, str(tmp_path / "short")))
    c = ModelConfig.from_folder(folder)
    per_block = bytes_per_block(c.num_hidden_layers, BLOCK, c.num_key_value_heads, c.head_dim, "float32")
    llm = LLM(
        folder,
        max_num_seqs=4,
        max_model_len=64,
        max_num_batched_tokens=16,  # prompts prefill in chunks: the first ones end before the original length
        block_size=BLOCK,
        kv_cache_memory=7 * per_block,  # 6 usable blocks: the crossing request is preempted past the crossing
        enable_prefix_caching=True,
    )
    sched = llm.engine.scheduler
    preempted: list[tuple[str, int]] = []
    preempt = sched._preempt

    def record(req, planned):
        preempted.append((req.request_id, req.num_computed_tokens))
        return preempt(req, planned)

    sched._preempt = record

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, logprobs=True, ignore_eos=True)

    # long from the start (40 > 24: every position long), and a short prompt
    # that grows past 24 (12 + 36: every position short); the second is
    # preempted once it holds 32 tokens and is computed again from its tokens
    long_prompt, crossing_prompt = _prompt(40, seed=3), _prompt(12, seed=4)
    long_out, crossing_out = llm.generate([long_prompt, crossing_prompt], [params(24), params(36)])
    assert any(rid == crossing_out.request_id and n > ORIGINAL for rid, n in preempted), preempted
    _check(hf, long_prompt, long_out, 24, "long prompt")
    _check(hf_short, crossing_prompt, crossing_out, 36, "short prompt past the original length")
    # transformers itself recomputes long at the crossing: the same up to it, then apart
    theirs, _ = _generate(hf, crossing_prompt, 36)
    crossing = ORIGINAL - len(crossing_prompt) + 1  # the first token sampled from a sequence past 24
    assert crossing_out.token_ids[:crossing] == theirs[:crossing]
    assert crossing_out.token_ids != theirs

    # a short request (20 + 4: all short) leaves its first block in the
    # prefix cache; a long prompt starting with the same 16 tokens must not
    # take it (its keys there are long), but a second long prompt shares
    # the first long one's blocks
    base = _prompt(40, seed=5)
    [short_out] = llm.generate([base[:20]], params(4))
    _check(hf, base[:20], short_out, 4, "short")
    hits = sched.prefix_cache_hits
    [first_out] = llm.generate([base], params(8))
    assert sched.prefix_cache_hits == hits, "a long prompt took a short request's block"
    _check(hf, base, first_out, 8, "long after short")
    second = base[:32] + _prompt(10, seed=6)
    [second_out] = llm.generate([second], params(8))
    assert sched.prefix_cache_hits > hits, "the second long prompt was meant to reuse the first one's blocks"
    _check(hf, second, second_out, 8, "long from the prefix cache")
