"""Failure containment in Engine.step: a step that raises fails only the
request that makes it fail; every other request of the step ends with
exactly the tokens it produces alone (streamed once each), and a lost
device state raises EngineBroken."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

from engine_fixtures import build_engine_checkpoint
from jaxserve.engine import EngineBroken
from jaxserve.engine.args import EngineArgs
from jaxserve.engine.engine import Engine
from jaxserve.engine.types import RequestClass
from jaxserve.sampling_params import SamplingParams

MAX_TOKENS = 8
NUM_GOOD = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_engine_checkpoint(tmp_path_factory.mktemp("containment-ckpt"))


def _engine(checkpoint, async_scheduling: bool) -> Engine:
    # The tests count steps (a fault is injected at step N, when every
    # prompt has produced tokens), so the batch prompt and step caps beside
    # interactive work are off: they follow the wall clock for two seconds
    # after a test with interactive requests and would move those steps.
    # The async engine runs without speculative decoding, so that its steps
    # overlap (a row about to be guessed for is planned after its token is
    # fetched); the sync one guesses, so failed steps carry guesses too.
    engine = Engine(
        EngineArgs(
            model=str(checkpoint),
            max_num_seqs=8,
            max_num_batched_tokens=128,
            max_model_len=64,
            block_size=16,
            async_scheduling=async_scheduling,
            interactive_batch_prefill_tokens=0,
            interactive_step_tokens=0,
            num_speculative_tokens=0 if async_scheduling else EngineArgs().num_speculative_tokens,
        )
    )
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def engines(checkpoint):
    return {mode: _engine(checkpoint, mode) for mode in (False, True)}


def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(11)
    prompts = {f"g{i}": rng.integers(10, 500, size=n).tolist() for i, n in enumerate((3, 17, 9, 20, 5, 12))}
    prompts["bad"] = rng.integers(10, 500, size=7).tolist()
    return prompts


def _greedy(_rid: str) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _seeded(rid: str) -> SamplingParams:
    seed = 1000 + sorted(_prompts()).index(rid)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)


def _run(engine: Engine, prompts: dict[str, list[int]], params_for, on_step=None, interactive=()):
    """All prompts in one batch; returns (final outputs, streamed token ids)
    by id. The requests named in ``interactive`` are interactive, and the
    engine's ``on_urgent_outputs`` hook takes outputs too."""
    finals, streamed = {}, collections.defaultdict(list)

    def take(out):
        streamed[out.request_id] += out.new_token_ids
        if out.finished:
            assert out.request_id not in finals
            finals[out.request_id] = out

    for rid, prompt in prompts.items():
        rc = RequestClass.INTERACTIVE if rid in interactive else RequestClass.BATCH
        engine.add_request(rid, prompt, params_for(rid), request_class=rc)
    if interactive:
        engine.on_urgent_outputs = lambda outs: [take(o) for o in outs]
    try:
        step = 0
        while engine.has_unfinished():
            if on_step is not None:
                on_step(step)
            for out in engine.step():  # (a suspect's step alone returns its outputs here)
                take(out)
            step += 1
            assert step < 500, "the engine does not converge"
    finally:
        engine.on_urgent_outputs = None
    assert engine.allocator.num_used_blocks == 0
    assert not engine.containment.suspects
    return finals, streamed


def _alone(engine: Engine, params_for) -> dict[str, list[int]]:
    got = {}
    for rid, prompt in _prompts().items():
        finals, _ = _run(engine, {rid: prompt}, params_for)
        assert finals[rid].error is None
        got[rid] = finals[rid].token_ids
    return got


def _inject(monkeypatch, engine: Engine, stage: str, after_tokens: int = 2) -> list[bool]:
    """Make every step that holds request "bad" raise at ``stage`` once
    "bad" has delivered ``after_tokens`` tokens (whatever else shares the
    step). Returns a list that records, per fault, whether "bad" then held
    a token still on the device (the async-scheduling overlapped path)."""
    faults = []

    def fault(at: str, request_ids) -> None:
        state = engine._states.get("bad")
        if at == stage and "bad" in request_ids and state is not None and state.num_tokens_seen >= after_tokens:
            faults.append(engine.scheduler.get_request("bad").pending_index is not None)
            raise RuntimeError("injected fault")

    monkeypatch.setattr(engine, "_fault_point", fault)
    return faults


def _check_contained(finals, streamed, alone, *, error_fragment: str, bad_tokens: int):
    bad = finals.pop("bad")
    assert bad.finished and bad.finish_reason == "error"
    assert bad.error is not None and bad.error.code == "internal" and bad.error.retryable is True
    assert bad.error.message.startswith("engine step failed for this request: ")
    assert error_fragment in bad.error.message
    assert bad.completion_tokens == bad_tokens
    assert len(streamed.pop("bad")) == bad_tokens  # what it produced before failing, streamed once
    assert sorted(finals) == [f"g{i}" for i in range(NUM_GOOD)]
    for rid, out in finals.items():
        assert out.error is None and out.finish_reason == "length", rid
        assert out.token_ids == alone[rid], rid
        assert streamed[rid] == alone[rid], rid  # no token delivered twice after the recomputation


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("stage", ["execute", "fetch"])
def test_greedy_step_failure_fails_only_the_culprit(engines, monkeypatch, async_scheduling, stage):
    engine = engines[async_scheduling]
    alone = _alone(engine, _greedy)
    failed0, isolated0 = engine.containment.num_failed_steps, engine.containment.num_isolated_steps
    faults = _inject(monkeypatch, engine, stage, after_tokens=2)
    finals, streamed = _run(engine, _prompts(), _greedy)
    _check_contained(finals, streamed, alone, error_fragment="RuntimeError('injected fault')", bad_tokens=2)
    # One batched failure (with async scheduling on, in the overlapped path:
    # "bad"'s token still on the device), then "bad" failed alone.
    assert faults == [async_scheduling, False]
    assert engine.containment.num_failed_steps == failed0 + 1
    # the six others passed one sampling step alone each, "bad" failed in its first
    assert engine.containment.num_isolated_steps == isolated0 + NUM_GOOD + 1


@pytest.mark.parametrize("after_tokens", [0, 2])
def test_a_failing_interactive_step_handed_over_early_fails_only_the_culprit(engines, monkeypatch, after_tokens):
    """Interactive outputs handed over before the next plan (the worker's
    ``on_urgent_outputs``), and an interactive prompt's own step collected in
    the call that launched it: a fetch failure there (``after_tokens=0``:
    "bad"'s first token; 2: a decode) is contained the same way, and no
    token reaches the caller twice."""
    engine = engines[False]
    alone = _alone(engine, _greedy)
    faults = _inject(monkeypatch, engine, "fetch", after_tokens=after_tokens)
    finals, streamed = _run(engine, _prompts(), _greedy, interactive={"bad", "g1", "g4"})
    _check_contained(finals, streamed, alone, error_fragment="RuntimeError('injected fault')", bad_tokens=after_tokens)
    assert len(faults) == 2  # in the batch, then alone


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seeded_sampling_survives_a_bad_row_in_the_sampler_arrays(engines, async_scheduling):
    """The production failure: one row's parameter does not fit the step's
    sampler arrays (OverflowError while they are built). Here "bad"'s top_k
    is corrupted after admission (validation refuses it at the door)."""
    engine = engines[async_scheduling]
    alone = _alone(engine, _seeded)
    isolated0 = engine.containment.num_isolated_steps

    def corrupt(step):
        if step == 3:
            bad = engine.scheduler.get_request("bad")
            assert bad.num_output_tokens == 2  # everyone has produced tokens: they are kept, not resampled
            bad.sampling_params.top_k = 2**40

    finals, streamed = _run(engine, _prompts(), _seeded, on_step=corrupt)
    _check_contained(finals, streamed, alone, error_fragment="OverflowError", bad_tokens=2)
    # every request of the failed step ran alone at least once
    assert engine.containment.num_isolated_steps - isolated0 >= NUM_GOOD + 1


def test_planning_failure_isolates_everyone_and_fails_the_culprit(engines, monkeypatch):
    engine = engines[False]
    alone = _alone(engine, _greedy)
    scheduler = engine.scheduler
    real_admission = scheduler._admission

    def admission(req, budget):
        if req.request_id == "bad":
            raise ValueError("injected planning fault")
        return real_admission(req, budget)

    monkeypatch.setattr(scheduler, "_admission", admission)
    prompts = _prompts()
    bad_prompt = prompts.pop("bad")

    def add_bad(step):
        if step == 2:  # arrives while the others decode
            engine.add_request("bad", bad_prompt, _greedy("bad"))

    finals, streamed = _run(engine, prompts, _greedy, on_step=add_bad)
    _check_contained(finals, streamed, alone, error_fragment="injected planning fault", bad_tokens=0)


def test_detokenizer_failure_is_the_requests_own(engines, monkeypatch):
    """A failure while one request's token is processed is pinned on it at
    once: no recomputation, no isolation."""
    engine = engines[True]
    alone = _alone(engine, _greedy)
    failed0, isolated0 = engine.containment.num_failed_steps, engine.containment.num_isolated_steps
    faults = _inject(monkeypatch, engine, "process", after_tokens=2)
    finals, streamed = _run(engine, _prompts(), _greedy)
    _check_contained(finals, streamed, alone, error_fragment="injected fault", bad_tokens=2)
    assert len(faults) == 1
    assert (engine.containment.num_failed_steps, engine.containment.num_isolated_steps) == (failed0, isolated0)


def test_lost_kv_cache_raises_engine_broken(checkpoint, monkeypatch):
    engine = Engine(
        EngineArgs(model=str(checkpoint), max_num_seqs=2, max_num_batched_tokens=32, max_model_len=32, block_size=16)
    )
    engine.warmup()
    for rid in ("a", "bad"):
        engine.add_request(rid, [11, 12, 13], _greedy(rid))
    engine.step()
    engine.step()

    def fault(at, request_ids):
        if at == "execute":
            # what a failing call that had the cache donated leaves behind
            for array in jax.tree.leaves(engine.runner.kv_cache):
                array.delete()
            raise RuntimeError("device program failed")

    monkeypatch.setattr(engine, "_fault_point", fault)
    with pytest.raises(EngineBroken, match="deleted") as info:
        engine.step()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "device program failed" in str(info.value)
    monkeypatch.setattr(engine, "_fault_point", lambda *_: None)
    with pytest.raises(EngineBroken):  # and at every later call
        engine.step()


def test_a_suspect_aborted_during_the_isolation_is_dropped(engines, monkeypatch):
    engine = engines[False]
    alone = _alone(engine, _greedy)
    _inject(monkeypatch, engine, "execute", after_tokens=2)
    aborted = []

    def abort_g3(_step):
        if "g3" in engine.containment.suspects and not aborted:
            aborted.append(engine.abort("g3"))

    finals, streamed = _run(engine, _prompts(), _greedy, on_step=abort_g3)
    assert aborted == [True] and "g3" not in finals
    assert finals.pop("bad").error.code == "internal"
    assert {rid: out.token_ids for rid, out in finals.items()} == {
        rid: tokens for rid, tokens in alone.items() if rid not in ("g3", "bad")
    }


def test_a_failed_recovery_raises_engine_broken(checkpoint, monkeypatch):
    engine = Engine(
        EngineArgs(model=str(checkpoint), max_num_seqs=2, max_num_batched_tokens=32, max_model_len=32, block_size=16)
    )
    engine.warmup()
    engine.add_request("bad", [11, 12, 13], _greedy("bad"))

    def fault(at, request_ids):
        raise RuntimeError("step fault")

    def reset(*_args):
        raise ValueError("scheduler state inconsistent")

    monkeypatch.setattr(engine, "_fault_point", fault)
    monkeypatch.setattr(engine.scheduler, "reset_for_recompute", reset)
    with pytest.raises(EngineBroken, match="recovering from a failed step") as info:
        engine.step()
    assert "step fault" in str(info.value) and isinstance(info.value.__cause__, ValueError)
    with pytest.raises(EngineBroken):
        engine.step()
