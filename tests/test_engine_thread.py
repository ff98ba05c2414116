"""The engine thread's failure handling, with a scripted fake engine (no
JAX): a dead thread fails every pending and later command, EngineBroken and
N failed steps in a row are fatal, and busy_since_mono tells a hung step
from an idle engine."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxserve.engine import EngineBroken
from jaxserve.engine.types import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.engine_thread import EngineThread, EngineThreadDead


class Crash(BaseException):
    """Escapes ``except Exception``: kills the thread's loop."""


class FakeEngine:
    """Each ``step()`` plays the next entry of ``script``: ``"ok"`` returns
    one output, an exception instance is raised; the engine has work while
    the script is not empty. With ``gated``, a step first waits for
    ``release``."""

    def __init__(self, gated: bool = False) -> None:
        self.script: list = []
        self.step_calls = 0
        self.gated = gated
        self.in_step = threading.Event()
        self.release = threading.Event()
        self.before_plan = None  # set by EngineThread; step() calls it after the gate, as it plans
        self.log: list[str] = []  # commands and plans, in the order they happened

    def has_unfinished(self) -> bool:
        return bool(self.script)

    def step(self):
        self.step_calls += 1
        self.in_step.set()
        if self.gated:
            assert self.release.wait(5)
        action = self.script.pop(0)
        if isinstance(action, BaseException):
            raise action
        if self.before_plan is not None:
            self.before_plan()
        self.log.append("plan")
        return [RequestOutput(request_id=f"s{self.step_calls}", new_token_ids=[1], new_text="x")]

    def add_request(self, request_id, prompt, params, **_kw) -> None:
        params.validate()  # refuses as the engine does (tests/test_engine_host_contract.py)
        self.log.append(f"add {request_id}")

    def add_score_request(self, request_id, prompt, labels, **_kw) -> None:
        self.log.append(f"score {request_id}")

    def abort(self, request_id: str) -> bool:
        self.log.append(f"abort {request_id}")
        return True

    def warmup(self) -> None:
        pass


class Harness:
    def __init__(self, engine: FakeEngine, **kw) -> None:
        self.loop = asyncio.get_running_loop()
        self.outputs, self.step_errors, self.fatal = [], [], []
        self.thread = EngineThread(
            engine, self.loop, self.outputs.extend, self.step_errors.append, on_fatal=self.fatal.append, **kw
        )
        self.thread.start()

    async def until(self, predicate, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.005)


async def _dead(fut) -> EngineThreadDead:
    with pytest.raises(EngineThreadDead) as info:
        await asyncio.wait_for(fut, 5)
    return info.value


async def test_thread_death_fails_pending_and_later_futures():
    engine = FakeEngine(gated=True)
    h = Harness(engine)
    crash = Crash("the engine loop blew up")
    await h.thread.call(lambda e: e.script.append(crash))
    await h.until(engine.in_step.is_set)
    pending = [h.thread.abort("a"), h.thread.add_request("b", [1], SamplingParams()), h.thread.warmup()]
    engine.release.set()
    for fut in pending:
        err = await _dead(fut)
        assert err.__cause__ is crash and "the engine thread died" in str(err)
    await h.until(lambda: h.fatal)
    assert h.fatal == [crash] and h.thread.fatal_error is crash
    await h.until(lambda: not h.thread.alive)  # on_fatal runs just before the thread returns
    # and every later command fails at once
    err = await _dead(h.thread.add_request("c", [1], SamplingParams()))
    assert err.__cause__ is crash
    assert h.step_errors == []  # not a failed step: the thread itself died


async def test_engine_broken_is_fatal():
    engine = FakeEngine()
    h = Harness(engine)
    broken = EngineBroken("cache deleted")
    await h.thread.call(lambda e: e.script.extend([broken, "ok", "ok"]))
    await h.until(lambda: h.fatal)
    assert h.step_errors == [broken] and h.fatal == [broken]
    assert engine.step_calls == 1  # no step after it
    await h.until(lambda: not h.thread.alive)
    err = await _dead(h.thread.abort("x"))
    assert err.__cause__ is broken


async def test_consecutive_failures_are_fatal_and_a_success_resets_the_count():
    engine = FakeEngine()
    h = Harness(engine, max_consecutive_step_failures=3)
    fails = [RuntimeError(f"step failed {i}") for i in range(5)]
    script = [fails[0], fails[1], "ok", fails[2], fails[3], fails[4], "ok"]
    await h.thread.call(lambda e: e.script.extend(script))
    await h.until(lambda: h.fatal)
    assert h.step_errors == fails  # each failure reported, as before
    [fatal] = h.fatal
    assert isinstance(fatal, EngineBroken) and fatal.__cause__ is fails[4]
    assert "3 engine steps in a row failed" in str(fatal) and "step failed 4" in str(fatal)
    assert engine.step_calls == 6 and engine.script == ["ok"]  # it stopped at the third failure in a row
    assert [o.request_id for o in h.outputs] == ["s3"]
    await h.until(lambda: not h.thread.alive)
    assert h.thread.consecutive_step_failures == 3


async def test_two_failures_then_successes_are_not_fatal():
    engine = FakeEngine()
    h = Harness(engine, max_consecutive_step_failures=3)
    script = [RuntimeError("a"), RuntimeError("b"), "ok", RuntimeError("c"), "ok"]
    await h.thread.call(lambda e: e.script.extend(script))
    await h.until(lambda: not engine.script)
    assert await h.thread.abort("x") is True  # still serving
    assert len(h.step_errors) == 3 and h.fatal == [] and h.thread.alive
    assert h.thread.consecutive_step_failures == 0
    h.thread.stop()


def test_max_consecutive_step_failures_is_checked():
    loop = asyncio.new_event_loop()
    try:
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match=f"max_consecutive_step_failures must be an integer >= 1, got {bad!r}"):
                EngineThread(FakeEngine(), loop, print, max_consecutive_step_failures=bad)
    finally:
        loop.close()


async def test_busy_since_mono_is_set_during_a_slow_step_and_none_when_idle():
    engine = FakeEngine(gated=True)
    h = Harness(engine)
    await h.thread.warmup()
    assert h.thread.busy_since_mono is None  # blocked waiting for work: idle, not hung
    after_warmup = h.thread.last_progress_mono
    before = time.monotonic()
    await h.thread.call(lambda e: e.script.append("ok"))
    assert h.thread.last_progress_mono >= before > after_warmup  # the command counted as progress
    await h.until(engine.in_step.is_set)
    await asyncio.sleep(0.05)
    busy_since = h.thread.busy_since_mono
    assert busy_since is not None and before <= busy_since <= time.monotonic() - 0.05
    progress_during_step = h.thread.last_progress_mono
    assert progress_during_step <= busy_since  # the slow step has not progressed
    released = time.monotonic()
    engine.release.set()
    await h.until(lambda: h.outputs)
    await h.until(lambda: h.thread.busy_since_mono is None)
    assert h.thread.last_progress_mono >= released
    h.thread.stop()
    assert not h.thread.alive


async def test_stop_fails_commands_queued_behind_it_without_on_fatal():
    engine = FakeEngine(gated=True)
    h = Harness(engine)
    await h.thread.call(lambda e: e.script.append("ok"))
    await h.until(engine.in_step.is_set)
    stopper = asyncio.ensure_future(asyncio.to_thread(h.thread.stop))
    await h.until(lambda: h.thread._cmds.qsize() == 1)  # the stop is queued
    late = h.thread.abort("x")
    engine.release.set()
    await stopper
    err = await _dead(late)
    assert err.__cause__ is None and "stopped" in str(err)
    assert h.fatal == [] and h.thread.fatal_error is None
    await _dead(h.thread.abort("y"))


async def test_admissions_queued_during_a_step_join_its_plan_other_commands_wait_in_order():
    """Requests that arrive while a step computes are admitted by the
    engine's before_plan hook, inside that step, so they are in the plan it
    makes; a non-admission command and everything behind it keep their order
    and run after the step, while the step still counts as busy."""
    engine = FakeEngine(gated=True)
    h = Harness(engine)
    await h.thread.call(lambda e: e.script.extend(["ok", "ok"]))
    await h.until(engine.in_step.is_set)
    params = SamplingParams(max_tokens=1)
    a, b = h.thread.add_request("a", [1], params), h.thread.add_request("b", [1], params)
    stop_c = h.thread.abort("c")
    d = h.thread.add_request("d", [1], params)
    busy_during = []
    engine.before_plan = (lambda hook: lambda: (hook(), busy_during.append(h.thread.busy_since_mono)))(
        engine.before_plan
    )
    engine.release.set()
    await asyncio.wait_for(asyncio.gather(a, b, stop_c, d), 5)
    await h.until(lambda: engine.log.count("plan") == 2)
    assert engine.log == ["add a", "add b", "plan", "abort c", "add d", "plan"]
    assert busy_during[0] is not None  # the admissions ran within the busy step
    h.thread.stop()


def test_the_worker_engine_defaults_favour_interactive_jobs(monkeypatch):
    """A queue worker's engine plans each step after the arrivals of the
    previous one (no async scheduling), unless the operator asks for it."""
    from jaxserve.engine.args import EngineArgs
    from jaxserve.engine.engine import Engine
    from jaxserve.worker.factory import build_engine, parse_engine_args

    seen: list[EngineArgs] = []
    monkeypatch.setattr(Engine, "from_args", classmethod(lambda cls, args: seen.append(args) or args))
    build_engine("tiny", max_num_seqs=8)
    build_engine("tiny", **parse_engine_args(["async_scheduling=true", "policy=fcfs", "interactive_reserved_seqs=0"]))
    assert seen[0] == EngineArgs(
        model="tiny", max_num_seqs=8, policy="priority", async_scheduling=False, interactive_reserved_seqs=2
    )
    assert seen[1].async_scheduling is True and seen[1].policy == "fcfs"
    assert seen[1].interactive_reserved_seqs == 0
