"""Label scoring on the real engine against transformers on the same
weights: multi-token labels, with and without a chat template; one prompt
prefill shared by every label (the computed-token count says so); the same
numbers whatever the prefix cache holds or shares the batch; forks that wait
for sequence slots; aborts; a failing fork fails its job alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine_fixtures import build_engine_checkpoint
from jaxserve.engine import scoring
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.engine import Engine
from jaxserve.sampling_params import SamplingParams

LABELS = [" sleeps", " runs away quickly", " eats", " x", " the dog and then some more words here"]
RTOL = 1e-4  # float32 on both sides; measured ~4e-8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_engine_checkpoint(tmp_path_factory.mktemp("score_ck"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def make_engine(checkpoint: Path, **kw) -> Engine:
    args = dict(
        model=str(checkpoint),
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=256,
        block_size=16,
        enable_prefix_caching=False,
        seed=0,
    )
    args.update(kw)
    eng = Engine(EngineArgs(**args))
    eng.warmup()
    return eng


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return make_engine(checkpoint)


def reference(hf, prompt: list[int], labels: list[list[int]]) -> list[float]:
    out = []
    for label in labels:
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([prompt + label])).logits[0].double(), -1)
        out.append(sum(float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(label)))
    return out


def run(eng: Engine, until: set[str]) -> dict:
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert until <= set(done), (until, done)
    return done


def label_ids(eng: Engine, labels=LABELS) -> list[list[int]]:
    return [eng.tokenizer.encode(x, add_special_tokens=False) for x in labels]


def test_label_logprobs_equal_transformers(engine, hf):
    tok = engine.tokenizer
    prompt = tok.encode("The quick brown fox jumps over the lazy dog and then")
    labels = label_ids(engine)
    assert max(len(x) for x in labels) > 1
    engine.add_score_request("s", prompt, labels)
    out = run(engine, {"s"})["s"]
    np.testing.assert_allclose(out.label_logprobs, reference(hf, prompt, labels), rtol=RTOL)
    assert out.finish_reason == "stop" and out.error is None
    assert out.prompt_tokens == len(prompt) + sum(len(x) for x in labels) and out.completion_tokens == 0


def test_with_a_chat_template(engine, hf):
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "Classify: the match ended two to one."}]
    prompt = tok.encode_chat(messages, add_generation_prompt=True)
    labels = label_ids(engine, ["sports", "business", "science and technology"])
    engine.add_score_request("c", prompt, labels)
    out = run(engine, {"c"})["c"]
    np.testing.assert_allclose(out.label_logprobs, reference(hf, prompt, labels), rtol=RTOL)


def test_sixteen_labels_cost_one_prompt_prefill_plus_the_label_tokens(checkpoint):
    eng = make_engine(checkpoint, max_num_seqs=4)  # forks wait for the 4 sequence slots
    prompt = eng.tokenizer.encode("a document " * 20)
    labels = [eng.tokenizer.encode(f" label number {i}", add_special_tokens=False) for i in range(16)]
    before = eng.num_computed_tokens
    eng.add_score_request("j", prompt, labels)
    out = run(eng, {"j"})["j"]
    # the prompt but its last token once; per label: that token and the label's tokens but its last
    assert eng.num_computed_tokens - before == len(prompt) - 1 + sum(len(x) for x in labels)
    assert len(out.label_logprobs) == 16
    assert eng.allocator.num_free_blocks == eng.allocator.num_usable_blocks  # every block back


def test_independent_of_the_prefix_cache_and_of_batch_neighbours(checkpoint, hf):
    eng = make_engine(checkpoint, enable_prefix_caching=True)
    tok = eng.tokenizer
    prompt = tok.encode("shared prefix text " * 6)
    labels = label_ids(eng)
    eng.add_score_request("cold", prompt, labels)
    cold = run(eng, {"cold"})["cold"].label_logprobs
    hits_before = eng.scheduler.prefix_cache_hits
    eng.add_score_request("warm", prompt, labels)
    for i in range(3):  # neighbours: generation requests in the same steps
        eng.add_request(f"gen{i}", tok.encode(f"other request {i}"), SamplingParams(max_tokens=12, temperature=0))
    eng.add_score_request("other", tok.encode("another prompt entirely"), labels[:2])
    done = run(eng, {"warm", "gen0", "gen1", "gen2", "other"})
    assert eng.scheduler.prefix_cache_hits > hits_before  # the prompt's blocks came from the cache
    np.testing.assert_allclose(done["warm"].label_logprobs, cold, rtol=1e-6)
    np.testing.assert_allclose(cold, reference(hf, prompt, labels), rtol=RTOL)


def test_a_one_token_prompt_and_normalization(engine, hf):
    prompt = engine.tokenizer.encode("Hi")[:1]
    labels = label_ids(engine, [" a", " bb cc dd"])
    engine.add_score_request("one", prompt, labels)
    out = run(engine, {"one"})["one"]
    np.testing.assert_allclose(out.label_logprobs, reference(hf, prompt, labels), rtol=RTOL)
    mean = scoring.combine([" a", " bb cc dd"], out.label_logprobs, [len(x) for x in labels], "mean")
    assert mean[1].logprob == pytest.approx(out.label_logprobs[1] / len(labels[1]))
    assert sum(x.prob for x in mean) == pytest.approx(1.0)


def test_abort_frees_every_block(engine):
    prompt = engine.tokenizer.encode("to be aborted " * 10)
    engine.add_score_request("ab", prompt, label_ids(engine))
    engine.step()
    engine.step()
    assert engine.abort("ab") and not engine.abort("ab")
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.num_free_blocks == engine.allocator.num_usable_blocks


def test_a_failing_fork_fails_its_job_alone(checkpoint, monkeypatch):
    eng = make_engine(checkpoint)
    tok = eng.tokenizer
    calls = []

    def fault(stage, request_ids):
        calls.append(stage)
        if stage == "execute" and any(r.startswith("bad\x1f") for r in request_ids):
            raise RuntimeError("injected fault in a fork of 'bad'")

    monkeypatch.setattr(eng, "_fault_point", fault)
    eng.add_score_request("bad", tok.encode("this job fails"), label_ids(eng))
    eng.add_score_request("good", tok.encode("this job is fine"), label_ids(eng))
    eng.add_request("gen", tok.encode("generate as usual"), SamplingParams(max_tokens=6, temperature=0))
    done = run(eng, {"bad", "good", "gen"})
    assert done["bad"].error is not None and done["bad"].error.code == "internal" and done["bad"].error.retryable
    assert done["good"].error is None and len(done["good"].label_logprobs) == len(LABELS)
    assert done["gen"].error is None and len(done["gen"].token_ids) == 6
    assert eng.allocator.num_free_blocks == eng.allocator.num_usable_blocks
