"""The engine in a process of its own (jaxserve.worker.engine_process), with
a scripted engine double that really runs in the other process (no JAX):
commands and their errors cross intact, outputs stream in order with the
scheduler's statistics, step failures stay steps, a fatal failure or a
killed engine process fails every pending command and is reported once,
the shared clocks show a busy step, and neither process outlives the other
by accident (a SIGKILLed worker takes its engine process with it; the
engine process ignores the SIGINT/SIGTERM meant for the worker)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxserve.engine.types import EngineBroken, RequestClass, RequestOutput
from jaxserve.request_error import RequestError
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.engine_process import EngineBuildError, EngineProcess
from jaxserve.worker.engine_thread import EngineThreadDead
from queue_support import AMQP_URL, ByteTokenizer, EchoEngine, expected_completion


@dataclasses.dataclass
class Stats:
    num_running: int
    num_steps: int


class ScriptedEngine:
    """The engine interface EngineThread drives. Each ``add_request`` holds
    a request; each step plays the next action of ``script`` (``"ok"`` once
    it is empty): ``"ok"`` gives every held request one token (its last at
    ``max_tokens``), ``"fail"`` raises RuntimeError, ``"broken"`` raises
    EngineBroken, ``"sleep:S"`` sleeps S seconds first, ``"exit"`` ends the
    process at once (exit code 3); ``"sleep:S,broken"`` does both in turn.
    As the real engine, it hands interactive outputs to ``on_urgent_outputs``
    (set by the host) ahead of the step's others."""

    def __init__(self, script: tuple[str, ...] = (), fail_build: bool = False) -> None:
        if fail_build:
            raise FileNotFoundError("no checkpoint at /nowhere")
        self.script = list(script)
        self.tokenizer = ByteTokenizer()
        self.model_name = "scripted"
        self.max_num_seqs = 4
        self.max_model_len = 64
        self.interactive_reserved_seqs = 1
        self.num_computed_tokens = 0
        self.scheduler = self
        self.before_plan = None
        self.on_urgent_outputs = None
        self.held: dict[str, list] = {}  # id -> [tokens left, tokens so far, request class]
        self.steps = 0

    def stats(self) -> Stats:
        return Stats(num_running=len(self.held), num_steps=self.steps)

    def warmup(self) -> str:
        return "warm"

    def has_unfinished(self) -> bool:
        return bool(self.held)

    def add_request(self, request_id, prompt, params, *, request_class=RequestClass.BATCH, priority=0, deadline=None):
        params.validate()
        if request_id in self.held:
            raise RequestError("invalid_request", f"request id {request_id!r} is already running", retryable=True)
        self.held[request_id] = [params.max_tokens, 0, request_class]

    def add_score_request(self, request_id, prompt, labels, **kw):
        self.held[request_id] = [1, 0, kw.get("request_class", RequestClass.BATCH)]

    def abort(self, request_id: str) -> bool:
        return self.held.pop(request_id, None) is not None

    def step(self) -> list[RequestOutput]:
        for action in (self.script.pop(0) if self.script else "ok").split(","):
            if action.startswith("sleep:"):
                time.sleep(float(action.split(":")[1]))
            elif action == "fail":
                raise RuntimeError("step failed: bad luck")
            elif action == "broken":
                raise EngineBroken("the KV cache is gone")
            elif action == "exit":
                os._exit(3)
        if self.before_plan is not None:
            self.before_plan()
        self.steps += 1
        outputs, urgent = [], []
        for rid, state in list(self.held.items()):
            state[0] -= 1
            state[1] += 1
            self.num_computed_tokens += 1
            done = state[0] == 0
            output = RequestOutput(
                rid,
                [65 + state[1]],
                chr(65 + state[1]),
                finished=done,
                finish_reason="length" if done else None,
                completion_tokens=state[1],
            )
            interactive = self.on_urgent_outputs is not None and state[2] == RequestClass.INTERACTIVE
            (urgent if interactive else outputs).append(output)
            if done:
                del self.held[rid]
        if urgent:
            self.on_urgent_outputs(urgent)
        return outputs


class Harness:
    def __init__(self, **engine_kw) -> None:
        self.loop = asyncio.get_running_loop()
        self.outputs: list[RequestOutput] = []
        self.stats: list = []
        self.step_errors: list[BaseException] = []
        self.fatal: list[BaseException] = []
        self.proc = EngineProcess(
            functools.partial(ScriptedEngine, **engine_kw),
            self.loop,
            self.outputs.extend,
            self.step_errors.append,
            on_step_report=lambda report: self.stats.append(report.stats),
            on_fatal=self.fatal.append,
        )

    async def until(self, predicate, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.005)

    def finished(self, rid: str) -> bool:
        return any(o.request_id == rid and o.finished for o in self.outputs)


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (nobody may reap it here)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


async def test_commands_outputs_and_statistics_cross_the_process_boundary():
    h = Harness()
    engine = await h.proc.start()
    try:
        assert h.proc.pid != os.getpid() and h.proc.alive
        # what the worker reads of the engine, including a working tokenizer
        assert (engine.model_name, engine.max_num_seqs, engine.max_model_len, engine.interactive_reserved_seqs) == (
            "scripted",
            4,
            64,
            1,
        )
        assert engine.tokenizer.encode("hi") == [104, 105]
        assert await h.proc.warmup() == "warm"
        assert await h.proc.add_request("a", [1, 2], SamplingParams(max_tokens=3)) is None
        await h.until(lambda: h.finished("a"))
        assert [(o.new_text, o.finished) for o in h.outputs] == [("B", False), ("C", False), ("D", True)]
        assert h.outputs[-1].finish_reason == "length" and h.outputs[-1].completion_tokens == 3
        assert [s.num_steps for s in h.stats if s is not None] == [1, 2, 3]
        assert h.proc.steps == 3 and engine.num_computed_tokens == 3
        assert h.proc.busy_s > 0 and h.proc.last_progress_mono <= time.monotonic()
        assert await h.proc.abort("a") is False and await h.proc.abort("nope") is False
        assert h.step_errors == [] and h.fatal == []
    finally:
        await asyncio.to_thread(h.proc.stop)
    assert not h.proc.alive and h.fatal == []


async def test_a_refused_request_keeps_its_error_code_and_the_engine_serves_on():
    h = Harness(script=("sleep:0.1",) * 30)
    await h.proc.start()
    try:
        with pytest.raises(RequestError) as bad:
            await h.proc.add_request("a", [1], SamplingParams(max_tokens=0))
        assert bad.value.code == "invalid_request" and "max_tokens must be in [1, 2147483647], got 0" in str(bad.value)
        await h.proc.add_request("b", [1], SamplingParams(max_tokens=50))
        with pytest.raises(RequestError) as dup:
            await h.proc.add_request("b", [1], SamplingParams(max_tokens=1))
        assert dup.value.code == "invalid_request" and dup.value.retryable is True
        await h.proc.add_score_request("c", [1], [[2], [3]], request_class=RequestClass.INTERACTIVE)
        await h.until(lambda: h.finished("c"))
        assert await h.proc.abort("b") is True
        assert not h.finished("b") and h.fatal == []
    finally:
        await asyncio.to_thread(h.proc.stop)


async def test_a_failed_step_is_reported_and_the_engine_goes_on():
    h = Harness(script=("ok", "fail", "ok"))
    await h.proc.start()
    try:
        await h.proc.add_request("a", [1], SamplingParams(max_tokens=4))
        await h.until(lambda: h.finished("a"))
        [err] = h.step_errors
        assert isinstance(err, RuntimeError) and str(err) == "step failed: bad luck"
        assert h.fatal == [] and h.proc.alive
        await h.proc.add_request("b", [1], SamplingParams(max_tokens=1))
        await h.until(lambda: h.finished("b"))
    finally:
        await asyncio.to_thread(h.proc.stop)


async def test_a_fatal_engine_failure_fails_pending_and_later_commands_once():
    h = Harness(script=("ok", "sleep:0.4,broken"))
    await h.proc.start()
    try:
        await h.proc.add_request("a", [1], SamplingParams(max_tokens=9))
        await h.until(lambda: h.proc.steps == 1 and h.proc.busy_since_mono is not None)
        pending = h.proc.abort("a")  # queued behind the step that breaks the engine
        await h.until(lambda: h.fatal)
        [fatal] = h.fatal
        assert isinstance(fatal, EngineBroken) and str(fatal) == "the KV cache is gone"
        assert h.proc.fatal_error is fatal and not h.proc.alive
        with pytest.raises(EngineThreadDead):
            await asyncio.wait_for(pending, 5)
        with pytest.raises(EngineThreadDead) as later:
            await h.proc.add_request("b", [1], SamplingParams())
        assert later.value.__cause__ is fatal
        await asyncio.sleep(0.2)
        assert len(h.fatal) == 1  # reported once, though the process lives on until stopped
    finally:
        await asyncio.to_thread(h.proc.stop)


async def test_a_killed_engine_process_is_fatal_and_fails_what_is_pending():
    h = Harness(script=("sleep:5",))
    await h.proc.start()
    await h.proc.add_request("a", [1], SamplingParams(max_tokens=2))
    await h.until(lambda: h.proc.busy_since_mono is not None)
    pending = h.proc.add_request("b", [1], SamplingParams(max_tokens=2))
    os.kill(h.proc.pid, signal.SIGKILL)
    with pytest.raises(EngineThreadDead) as died:
        await asyncio.wait_for(pending, 5)
    await h.until(lambda: h.fatal)
    assert str(h.fatal[0]) == "the engine process exited (exit code -9)"
    assert died.value.__cause__ is h.fatal[0] and not h.proc.alive
    with pytest.raises(EngineThreadDead):
        await h.proc.warmup()
    await asyncio.to_thread(h.proc.stop)  # nothing left to stop: returns at once
    assert len(h.fatal) == 1


async def test_an_engine_process_that_exits_mid_step_is_fatal():
    h = Harness(script=("exit",))
    await h.proc.start()
    await h.proc.add_request("a", [1], SamplingParams(max_tokens=2))
    await h.until(lambda: h.fatal)
    assert str(h.fatal[0]) == "the engine process exited (exit code 3)"


async def test_the_shared_clocks_show_a_slow_step_and_an_idle_engine():
    h = Harness(script=("sleep:0.4",))
    await h.proc.start()
    try:
        await h.proc.warmup()
        assert h.proc.busy_since_mono is None  # waiting for work: idle, not hung
        before = time.monotonic()
        await h.proc.add_request("a", [1], SamplingParams(max_tokens=1))
        await h.until(lambda: h.proc.busy_since_mono is not None)
        await asyncio.sleep(0.1)
        since = h.proc.busy_since_mono
        assert before <= since <= time.monotonic() - 0.1  # the engine process's clock is this one
        await h.until(lambda: h.finished("a"))
        await h.until(lambda: h.proc.busy_since_mono is None)
        assert h.proc.last_progress_mono >= since + 0.4 - 0.05
    finally:
        await asyncio.to_thread(h.proc.stop)


async def test_stop_fails_the_commands_behind_it_without_on_fatal():
    h = Harness(script=("sleep:0.5",))
    await h.proc.start()
    await h.proc.add_request("a", [1], SamplingParams(max_tokens=3))
    await h.until(lambda: h.proc.busy_since_mono is not None)
    stopper = asyncio.ensure_future(asyncio.to_thread(h.proc.stop))
    await asyncio.sleep(0.1)  # the stop is on its way, behind the slow step
    late = h.proc.abort("a")
    await stopper
    with pytest.raises(EngineThreadDead) as stopped:
        await asyncio.wait_for(late, 5)
    assert "stopped" in str(stopped.value)
    await h.until(lambda: not h.proc.alive)
    assert h.fatal == [] and h.proc.fatal_error is None


async def test_a_build_failure_is_raised_as_itself_with_the_engine_process_traceback():
    """So the command line's one-line messages for a model that cannot be
    loaded work whichever process loads it."""
    h = Harness(fail_build=True)
    with pytest.raises(FileNotFoundError) as failed:
        await h.proc.start()
    assert str(failed.value) == "no checkpoint at /nowhere"
    [note] = failed.value.__notes__
    assert note.startswith("in the engine process:") and 'raise FileNotFoundError("no checkpoint at /nowhere")' in note
    await h.until(lambda: not h.proc.alive)


async def test_an_engine_process_that_dies_while_building_is_a_build_error():
    h = Harness(script=("exit",))
    h.proc._setup = (h.proc._setup[0], pickle.dumps(functools.partial(os._exit, 4)), *h.proc._setup[2:])
    with pytest.raises(EngineBuildError, match=r"exited \(exit code 4\) before the engine was built"):
        await h.proc.start()


async def test_a_factory_that_does_not_pickle_is_refused_in_the_caller():
    loop = asyncio.get_running_loop()
    with pytest.raises(Exception, match="pickle|lambda"):
        EngineProcess(lambda: ScriptedEngine(), loop, print)


async def test_the_engine_process_ignores_the_signals_meant_for_the_worker():
    h = Harness()
    await h.proc.start()
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(h.proc.pid, sig)
        await asyncio.sleep(0.3)
        assert h.proc.alive and h.fatal == []
        await h.proc.add_request("a", [1], SamplingParams(max_tokens=1))
        await h.until(lambda: h.finished("a"))
    finally:
        await asyncio.to_thread(h.proc.stop)


_ORPHAN_PARENT = """
import asyncio, functools, sys
from jaxserve.worker.engine_process import EngineProcess
from test_engine_process import ScriptedEngine

async def main():
    proc = EngineProcess(functools.partial(ScriptedEngine), asyncio.get_running_loop(), print)
    await proc.start()
    print(proc.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_a_sigkilled_worker_takes_its_engine_process_with_it():
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    worker = subprocess.Popen([sys.executable, "-c", _ORPHAN_PARENT], stdout=subprocess.PIPE, text=True, env=env)
    try:
        engine_pid = int(worker.stdout.readline())
        assert not _gone(engine_pid)
        worker.kill()
        worker.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(engine_pid):
            assert time.monotonic() < deadline, "the engine process outlived its worker"
            time.sleep(0.05)
    finally:
        worker.kill()


async def test_a_worker_with_its_engine_in_a_process_serves_streams_and_batch_jobs(prefix, client):
    """The worker with ``engine_process`` on, against the real broker: an
    interactive stream and batch jobs come back whole, the engine's step
    statistics reach the worker's metrics, and shutdown ends the engine
    process."""
    from jaxserve.wire.topology import Topology
    from jaxserve.worker.worker import Worker, WorkerConfig

    w = Worker(
        functools.partial(EchoEngine, step_s=0.001),
        WorkerConfig(amqp_url=AMQP_URL, topology=Topology(prefix=prefix), engine_process=True),
    )
    assert await w.start()
    engine_pid = w.host.pid
    try:
        assert engine_pid != os.getpid() and w.served.info is not None and w.served.info.model_name == "echo"
        stream = await client.stream("alpha beta gamma", max_tokens=7, timeout=20)
        text = "".join([d async for d in stream])
        assert text == expected_completion("alpha beta gamma", 7)[0] == stream.result.text
        assert stream.chunks >= 2 and stream.gaps == 0
        prompts = [f"doc{i} one two" for i in range(5)]
        results = await asyncio.gather(*(client.submit(p, queue="batch", max_tokens=4, timeout=20) for p in prompts))
        assert [r.text for r in results] == [expected_completion(p, 4)[0] for p in prompts]
        generated = w.served.metrics.registry.get_sample_value(
            "jaxserve_generation_tokens_total", {"model_name": "echo"}
        )
        assert generated == 7 + 5 * 4
    finally:
        await w.shutdown(drain_timeout=1.0)
    assert _gone(engine_pid)


def _maps_jax(pid: int) -> bool:
    """Whether the process has JAX's runtime library mapped."""
    return "libjax_common" in Path(f"/proc/{pid}/maps").read_text()


def test_the_engine_process_logs_in_the_workers_format_and_the_worker_process_holds_no_jax(prefix, tmp_path):
    """``jaxserve worker --log-format json`` with the real engine: every line
    on its stderr is JSON, and the engine process's own lines (the KV cache
    it sized, the programs it compiled) carry the worker's id and
    ``"process": "engine"``. JAX's runtime is the engine process's alone: the
    worker's process, serving, has not loaded it (it held about 150 MB there,
    the memory scenario in BENCHMARKS.md)."""
    import json

    from queue_support import start_worker_process, stop_process, wait_log

    log = tmp_path / "w.log"
    w = start_worker_process(prefix, log, engine=None)
    try:
        wait_log(log, "worker_consuming", timeout=180)
        children = [int(c) for t in Path(f"/proc/{w.pid}/task").iterdir() for c in (t / "children").read_text().split()]
        assert [_maps_jax(c) for c in children] == [True]  # the engine process (the check can fail)
        assert not _maps_jax(w.pid)
    finally:
        stop_process(w)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    [worker_id] = {r["worker_id"] for r in lines if r.get("event") == "worker_consuming"}
    engine_lines = {r["event"]: r for r in lines if r.get("process") == "engine"}
    assert {"engine.kv_cache", "runner.compiled"} <= set(engine_lines), sorted(engine_lines)
    assert all(r["worker_id"] == worker_id for r in engine_lines.values())
    assert all(r.get("process") != "engine" for r in lines if r.get("event") == "worker_consuming")
