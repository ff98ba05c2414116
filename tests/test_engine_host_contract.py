"""One contract for the engine host (``EngineHost``): both hosts, the
engine thread and the engine process, over every engine double the tests
use (EchoEngine of the queue tests, FakeEngine of test_engine_thread.py,
ScriptedEngine of test_engine_process.py), answer the same checks through
the EngineHost protocol alone: the engine's description as EngineInfo,
commands and their RequestError crossing intact, outputs and a StepReport
on the event loop, a stop that fails every later command without calling
on_fatal, and an EngineBroken step that is fatal once.

Each double is built by a module-level factory, so the engine process can
unpickle it."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from jaxserve.engine import EngineBroken
from jaxserve.engine.types import RequestClass, RequestOutput
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.engine_host import EngineHost, EngineInfo, HostedEngine, StepReport, engine_info
from jaxserve.worker.engine_loop import EngineThreadDead
from jaxserve.worker.engine_process import EngineProcess
from jaxserve.worker.engine_thread import EngineThread
from queue_support import EchoEngine
from test_engine_process import ScriptedEngine
from test_engine_thread import FakeEngine


def fake_engine(script: tuple[Any, ...] = ()) -> FakeEngine:
    """FakeEngine steps only while its script has entries: one ``"ok"``
    per step the contract needs."""
    engine = FakeEngine()
    engine.script.extend(script)
    return engine


def ready_echo(**kwargs: Any) -> EchoEngine:
    return EchoEngine(step_s=0.0, **kwargs)


@dataclasses.dataclass(frozen=True)
class Double:
    name: str
    serving: Callable[[], Any]  # an engine that serves the requests below
    broken: Callable[[], Any]  # an engine whose first step raises EngineBroken
    #: whether its outputs answer the requests added (FakeEngine plays a script instead)
    answers_requests: bool = True
    #: whether it hands interactive outputs over before the step ends (on_urgent_outputs)
    urgent: bool = False


DOUBLES = [
    Double("echo", functools.partial(ready_echo), functools.partial(ready_echo, break_after_steps=1)),
    Double(
        "scripted",
        functools.partial(ScriptedEngine),
        functools.partial(ScriptedEngine, script=("broken",)),
        urgent=True,
    ),
    Double(
        "fake",
        functools.partial(fake_engine, ("ok", "ok")),
        functools.partial(fake_engine, (EngineBroken("the KV cache is gone"),)),
        answers_requests=False,
    ),
]


class Events:
    """What a host hands the event loop, and on which thread."""

    def __init__(self) -> None:
        self.outputs: list[RequestOutput] = []
        self.batches: list[list[RequestOutput]] = []  # one per on_outputs call
        self.reports: list[StepReport] = []
        self.step_errors: list[BaseException] = []
        self.fatal: list[BaseException] = []
        self.threads: set[threading.Thread] = set()

    def _seen(self) -> None:
        self.threads.add(threading.current_thread())

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        self._seen()
        self.batches.append(list(outputs))
        self.outputs.extend(outputs)

    def on_step_report(self, report: StepReport) -> None:
        self._seen()
        self.reports.append(report)

    def on_step_error(self, exc: BaseException) -> None:
        self._seen()
        self.step_errors.append(exc)

    def on_fatal(self, exc: BaseException) -> None:
        self._seen()
        self.fatal.append(exc)


def make_host(kind: str, factory: Callable[[], Any], events: Events) -> EngineHost:
    """The host under test, built the one way the worker can build either."""
    loop = asyncio.get_running_loop()
    callbacks: dict[str, Any] = {"on_step_report": events.on_step_report, "on_fatal": events.on_fatal}
    if kind == "thread":
        return EngineThread.from_factory(factory, loop, events.on_outputs, events.on_step_error, **callbacks)
    return EngineProcess(factory, loop, events.on_outputs, events.on_step_error, **callbacks)


async def until(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    """Poll for a state the host reaches on its own (the timeout only
    bounds a failure; no check depends on it)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


hosts = pytest.mark.parametrize("kind", ["thread", "process"])
doubles = pytest.mark.parametrize("double", DOUBLES, ids=[d.name for d in DOUBLES])


@doubles
def test_every_engine_double_is_a_hosted_engine(double):
    assert isinstance(double.serving(), HostedEngine)
    assert isinstance(double.broken(), HostedEngine)


def test_the_real_engine_is_a_hosted_engine():
    from jaxserve.engine.engine import Engine

    assert issubclass(Engine, HostedEngine)


def test_a_partial_engine_is_not_a_hosted_engine():
    """The protocol check can fail: an engine without ``add_score_request``
    (FakeEngine before commit 31f38c8) is not one."""

    class NoScoring:
        def add_request(self, request_id, prompt, params, **kw): ...
        def abort(self, request_id): ...
        def warmup(self): ...
        def has_unfinished(self): ...
        def step(self): ...

    assert not isinstance(NoScoring(), HostedEngine)


@hosts
@doubles
async def test_a_host_describes_serves_and_reports_on_the_loop(kind, double):
    events = Events()
    host = make_host(kind, double.serving, events)
    with pytest.raises(RuntimeError):
        host.info  # noqa: B018 - not built yet
    try:
        info = await host.open()
        assert isinstance(host, EngineHost)  # (on 3.11 the check reads every property: after open)
        assert isinstance(info, EngineInfo) and info == host.info
        # The description is the engine's own, whichever process built it.
        assert dataclasses.replace(info, tokenizer=None) == dataclasses.replace(
            engine_info(double.serving()), tokenizer=None
        )
        assert (info.tokenizer is None) == (getattr(double.serving(), "tokenizer", None) is None)
        assert host.alive and host.fatal_error is None
        assert (host.pid is None) == (kind == "thread")
        await host.warmup()

        # A refused request crosses with its code; an accepted one resolves.
        with pytest.raises(RequestError) as refused:
            await host.add_request("bad", [104, 105], SamplingParams(max_tokens=0))
        assert refused.value.code == "invalid_request"
        await host.add_request("r1", [104, 105], SamplingParams(max_tokens=2))
        await host.add_score_request("s1", [104, 105], [[104], [120]])
        interactive = RequestClass.INTERACTIVE
        await host.add_request("i1", [104, 105, 106], SamplingParams(max_tokens=3), request_class=interactive)
        if double.answers_requests:
            await until(lambda: {o.request_id for o in events.outputs if o.finished} >= {"r1", "s1", "i1"})
        else:
            await until(lambda: len(events.outputs) == 2)  # its script's two steps
        assert isinstance(await host.abort("never-added"), bool)

        # Every output is in one report, in order, after it reached on_outputs.
        await until(lambda: sum(len(r.outputs) for r in events.reports) == len(events.outputs))
        assert [o for r in events.reports for o in r.outputs] == events.outputs
        assert all((r.stats is not None) == info.has_scheduler for r in events.reports)
        if double.urgent:
            # Interactive tokens leave alone, ahead of their step's others,
            # and each step's report lists them first. (i1 was added last
            # and runs longest, so its last step has no other output: a
            # report of urgent outputs alone, which the sum above counts.)
            assert all([o.request_id for o in b] == ["i1"] for b in events.batches if "i1" in {o.request_id for o in b})
            for report in events.reports:
                ids = [o.request_id for o in report.outputs]
                assert ids == sorted(ids, key=lambda rid: rid != "i1")
        assert events.threads == {threading.current_thread()}  # all on the loop's thread
        assert events.step_errors == [] and events.fatal == []

        # The watchdog's view: steps ran, and an idle engine is not busy.
        await until(lambda: host.busy_since_mono is None)
        assert host.steps and host.steps >= 1 and host.busy_s is not None
        assert host.last_progress_mono <= time.monotonic()
        computed = host.num_computed_tokens
        assert computed is None or computed >= 1
    finally:
        await asyncio.to_thread(host.stop)

    # Stopped: not alive, not fatal, and every later command fails.
    assert not host.alive and host.fatal_error is None
    with pytest.raises(EngineThreadDead) as dead:
        await host.add_request("late", [104], SamplingParams(max_tokens=1))
    assert dead.value.__cause__ is None
    with pytest.raises(EngineThreadDead):
        await host.abort("r1")
    assert events.fatal == []


@hosts
@doubles
async def test_an_engine_broken_step_is_fatal_once_and_kills_the_host(kind, double):
    events = Events()
    host = make_host(kind, double.broken, events)
    try:
        await host.open()
        if double.answers_requests:  # FakeEngine steps on its own, from the start
            await host.warmup()
            await host.add_request("r1", [104, 105], SamplingParams(max_tokens=2))
        await until(lambda: events.fatal and not host.alive)
        [fatal] = events.fatal
        assert isinstance(fatal, EngineBroken)
        assert [type(e) for e in events.step_errors] == [EngineBroken]  # the step, reported first
        assert isinstance(host.fatal_error, EngineBroken)
        with pytest.raises(EngineThreadDead) as dead:
            await host.add_request("r2", [104], SamplingParams(max_tokens=1))
        assert isinstance(dead.value.__cause__, EngineBroken)
    finally:
        await asyncio.to_thread(host.stop)
    assert len(events.fatal) == 1  # stop() after a death reports nothing more
    assert events.threads == {threading.current_thread()}


@hosts
async def test_a_host_stopped_before_it_opened_fails_its_commands(kind):
    """A shutdown during the build (the worker stops the host it has made)
    leaves nothing waiting: the build is not served, commands fail."""
    events = Events()
    host = make_host(kind, DOUBLES[0].serving, events)
    await asyncio.to_thread(host.stop)
    assert not host.alive
    with pytest.raises(EngineThreadDead):
        await host.warmup()
    with pytest.raises(EngineThreadDead):
        await host.open()
    assert not host.alive and events.fatal == []
