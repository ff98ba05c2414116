"""Deadlines gate only waiting work that has produced nothing: a request
preempted back to waiting after its first token is never expired."""

from __future__ import annotations

import time

import pytest

from engine_fixtures import build_engine_checkpoint
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.engine import Engine
from jaxserve.engine.request import RequestStatus
from jaxserve.engine.types import RequestClass
from jaxserve.sampling_params import SamplingParams

PROMPT_A = list(range(30, 50))
PROMPT_B = list(range(60, 80))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    checkpoint = build_engine_checkpoint(tmp_path_factory.mktemp("deadline-ckpt"))
    # 6 blocks of 16 tokens (5 usable): two requests growing to 60 tokens (4
    # blocks each) cannot both stay, so the batch one is preempted.
    engine = Engine(
        EngineArgs(
            model=str(checkpoint),
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=64,
            block_size=16,
            kv_cache_memory=6 * 8192,
            enable_prefix_caching=False,
        )
    )
    assert engine.num_blocks == 6
    engine.warmup()
    return engine


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _finish(engine: Engine, outputs: dict) -> None:
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out


def test_a_request_preempted_after_its_first_token_does_not_expire(engine):
    engine.add_request("alone", PROMPT_A, _params())
    reference = {}
    _finish(engine, reference)
    assert len(reference["alone"].token_ids) == 40

    engine.add_request("a", PROMPT_A, _params(), request_class=RequestClass.BATCH, deadline=time.monotonic() + 60)
    a = engine.scheduler.get_request("a")
    done = {}
    while a.num_output_tokens < 2:
        engine.step()
    engine.add_request("b", PROMPT_B, _params(), request_class=RequestClass.INTERACTIVE)
    for _ in range(100):
        for out in engine.step():
            assert not out.finished
        if a.status == RequestStatus.PREEMPTED:
            break
    assert a.status == RequestStatus.PREEMPTED and a.num_output_tokens > 2 and a.num_computed_tokens == 0
    # A waits for its recomputation; a fresh request waits behind it.
    engine.add_request("c", [5, 6, 7], _params(), request_class=RequestClass.BATCH, deadline=time.monotonic() + 60)
    # Both deadlines pass while they wait.
    a.deadline = time.monotonic() - 1.0
    engine.scheduler.get_request("c").deadline = time.monotonic() - 1.0
    _finish(engine, done)
    assert done["c"].finish_reason == "error" and done["c"].error.code == "expired"
    assert done["a"].error is None and done["a"].finish_reason == "length"
    assert done["a"].token_ids == reference["alone"].token_ids
    assert done["b"].error is None
    assert engine.scheduler.num_preemptions > 0
