"""The queue worker: RabbitMQ on asyncio, the engine in a process of its own.

The event loop does I/O and bookkeeping only; the engine runs elsewhere:
in its own process with ``engine_process`` (``jaxserve worker``'s default;
``jaxserve.worker.engine_process``), so the loop never waits for the
engine's Python work to let go of the GIL, or on a thread of this process
(``jaxserve.worker.engine_thread``; the library default, for engines that
cannot be pickled, such as tests' doubles). Both have the same interface.

This class puts the worker together and owns its life (start, run, drain,
shutdown), its state (``jaxserve.worker.worker_state``), the table of the
runs it holds and the engine's callbacks; each part gets what it needs and
no more, and each job's run is its own object, which gets its
``JobServices``. The modules, in the order a job meets them (the wire
contract is ``docs/protocol.md``, the states :mod:`jaxserve.worker.lifecycle`'s):

* :mod:`~jaxserve.worker.connections`: connections, consumers, pausing;
  :mod:`~jaxserve.worker.pacing`: batch consumption under interactive pressure.
* :mod:`~jaxserve.worker.intake`: read, refuse, fence a delivery; new key -> run.
* :mod:`~jaxserve.worker.job_run`: the run, the one owner of a job's state,
  resources and settlements, delivery to ack;
  :mod:`~jaxserve.worker.steps`: its admission steps in order;
  :mod:`~jaxserve.worker.progress`: its tokens, saved as they come;
  :mod:`~jaxserve.worker.results`: its result;
  :mod:`~jaxserve.worker.replies`: its chunks and finals.
* :mod:`~jaxserve.worker.control`: cancels and claim leases;
  :mod:`~jaxserve.worker.health`: /readyz, /healthz, the watchdog;
  :mod:`~jaxserve.worker.startup`: engine build and warm-up.

Faults: a store outage stops the intake and makes jobs wait, at most
``store_hold_s``, then go back to the broker (never an error they did not
earn; ``jaxserve.worker.store_health``);
an engine failure of one request is that request's (the engine contains
it), a retryable internal error is requeued so ``x-delivery-limit`` ends a
job that keeps failing; an engine (thread or process) that dies or hangs, or fails
``max_consecutive_step_failures`` steps in a row, stops the worker: it
requeues what it holds and exits non-zero for its supervisor to restart;
a worker that dies mid-generation leaves the tokens it saved, and the
worker that takes each job back continues from them.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aio_pika
import structlog

from jaxserve.engine.types import RequestOutput
from jaxserve.wire import INTERACTIVE, amqp_compat
from jaxserve.worker import pacing, startup
from jaxserve.worker.admission import InteractiveAdmission
from jaxserve.worker.calibration import LabelCalibrations
from jaxserve.worker.config import WorkerConfig
from jaxserve.worker.connections import Connections
from jaxserve.worker.control import Control
from jaxserve.worker.engine_host import EngineHost, StepReport
from jaxserve.worker.health import Health
from jaxserve.worker.intake import Intake
from jaxserve.worker.job_run import JobRun, JobServices
from jaxserve.worker.lifecycle import JobState
from jaxserve.worker.limits import Limiter, MemoryLimiter, RedisLimiter
from jaxserve.worker.progress import TokenSaver
from jaxserve.worker.replies import Replies
from jaxserve.worker.run_table import RunTable
from jaxserve.worker.startup import EngineEvents, ServedEngine
from jaxserve.worker.store import IdempotencyStore, MemoryStore, RedisStore
from jaxserve.worker.store_health import StoreHealth
from jaxserve.worker.tracing import Tracing
from jaxserve.worker.worker_state import WorkerState

__all__ = ["Worker", "WorkerConfig"]

log = structlog.get_logger("jaxserve.worker")

amqp_compat.install()


class Worker:
    def __init__(
        self,
        engine_factory: Callable[[], Any],
        config: WorkerConfig | None = None,
        store: IdempotencyStore | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.engine_factory = engine_factory
        self.cfg = cfg = config or WorkerConfig()
        self.topo = cfg.topology
        self.store: IdempotencyStore = store if store is not None else MemoryStore()
        # Job traces (off unless configured: then no OpenTelemetry import)
        self.tracing = tracing if tracing is not None else Tracing.configure(cfg.otlp_endpoint)
        self.stats: collections.Counter = collections.Counter()
        self.state = WorkerState()
        self.runs: RunTable[JobRun] = RunTable()
        self._tasks: set[asyncio.Task] = set()
        self.admission = InteractiveAdmission(cfg.admission)
        self.limiter: Limiter | None = None
        if cfg.limits is not None:
            if isinstance(self.store, RedisStore):  # shared by every worker on that Redis
                self.limiter = RedisLimiter(cfg.limits, self.store._r, namespace=self.store.ns)
            else:
                self.limiter = MemoryLimiter(cfg.limits)
        self.calibrations = LabelCalibrations(self._submit_calibration)
        # Store outages: the job consumers pause while the store is down.
        self.store_health = StoreHealth(
            self.store.ping, on_change=self._on_store_change, spawn=self.spawn, retry_max_s=cfg.store_retry_max_s
        )
        self.control = Control(cfg, self.runs, self.store, self.store_health, spawn=self.spawn, stats=self.stats)
        self.connections = conns = Connections(
            cfg, self.stats, self.state, self.store_health, self.take, self.control.on_message
        )
        self.replies = Replies(
            lambda: (conns.publisher, conns.interactive_publisher),
            reply_timeout_s=cfg.reply_timeout_s,
            chunk_timeout_s=cfg.chunk_timeout_s,
            queue_for=conns.job_queue,
        )
        self.saver = TokenSaver(
            self.store,
            self.store_health,
            every_tokens=cfg.save_tokens_every,
            every_s=cfg.save_tokens_interval_s,
            stats=self.stats,
        )
        self.health = Health(
            self.state, self.store_health, lambda: conns.consuming, hang_timeout_s=cfg.engine_hang_timeout_s
        )
        self.host: EngineHost | None = None  # the engine's host, from the start of its build
        self.served: ServedEngine | None = None  # the engine, once built and warm
        self.intake: Intake | None = None  # the way in for jobs, once the engine serves

    # ------------------------------------------------------------------ life
    async def start(self, stop: asyncio.Event | None = None) -> bool:
        """Build and compile the engine, connect, declare, then consume.
        Returns False, without consuming, when ``stop`` is set first."""
        if not await self.start_engine(stop) or (stop is not None and stop.is_set()):
            return False
        served = self.served
        assert served is not None
        await self.store_health.check()  # a store down at start: consume once it answers
        await self.connections.connect(served.prefetch, served.served_model_name, served.metrics)
        self.spawn(self.control.renew_loop())
        self.spawn(self.health.watchdog_loop(self.on_engine_fatal))
        self.spawn(pacing.pace(served.host, self.admission, self.connections.pace_batch))
        self.spawn(self.connections.queue_depth_loop())
        if self.saver.enabled:
            self.spawn(self.saver.run())
        self.state.serving()
        return True

    async def start_engine(self, stop: asyncio.Event | None = None) -> bool:
        """Build the engine, start its host, compile every bucket, then make
        what jobs run with; no AMQP yet (``jaxserve.worker.startup``). False
        when ``stop`` is set first."""
        events = EngineEvents(self.on_outputs, self.on_step_error, self.on_step_report, self.on_engine_fatal)
        self.host = startup.make_host(self.engine_factory, self.cfg, events)
        self.health.watch(self.host)
        served = await startup.open_engine(
            self.host, self.cfg, stop, readiness=self.health.readiness, liveness=self.health.liveness
        )
        if served is None:
            return False
        self.served = served
        services = JobServices(
            cfg=self.cfg,
            engine=served,
            store=self.store,
            store_health=self.store_health,
            saver=self.saver,
            replies=self.replies,
            runs=self.runs,
            cancels=self.control.cancels,
            limiter=self.limiter,
            admission=self.admission,
            calibrations=self.calibrations,
            routing=self.connections,
            tracing=self.tracing,
            state=self.state,
            stats=self.stats,
            spawn=self.spawn,
        )
        self.intake = Intake(services, served.limits)
        return True

    async def run(self, stop: asyncio.Event) -> int:
        """Start, serve until ``stop`` is set or the engine fails for good,
        then drain and close. Returns the process exit status: 0, or 1 after
        a fatal engine failure (the supervisor should restart the worker)."""
        if await self.start(stop):
            stopper = asyncio.ensure_future(stop.wait())
            failed = asyncio.ensure_future(self.state.wait_failed())
            await asyncio.wait({stopper, failed}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            failed.cancel()
        await self.shutdown(drain_timeout=0.0 if self.state.failed else None)
        return 1 if self.state.failed else 0

    async def shutdown(self, drain_timeout: float | None = None) -> None:
        """Drain: stop consuming, let held jobs finish within the deadline,
        requeue the rest, close everything."""
        timeout = self.cfg.drain_timeout if drain_timeout is None else drain_timeout
        log.info("worker_draining", in_flight=len(self.runs), timeout_s=timeout)
        self.state.drain()
        await self.connections.stop_consuming()
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end and any(run.drain_waits() for run in self.runs):
            await asyncio.sleep(0.05)
        leftover = list(self.runs)
        for run in leftover:
            await run.requeue("drain")
        self.state.close()
        for t in list(self._tasks):
            t.cancel()
        await self.connections.close()
        if self.host is not None:
            await asyncio.to_thread(self.host.stop)
        try:
            await self.store.close()
        except Exception:  # noqa: BLE001
            pass
        self.tracing.shutdown()
        log.info("worker_stopped", requeued=len(leftover), fatal=self.state.fatal_error, stats=dict(self.stats))

    # -------------------------------------------------------------- helpers
    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` as a task the worker owns: shutdown cancels it, a
        failure is logged and counted (``worker_task_failed``)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.stats["worker_task_failed"] += 1
            log.error("worker_task_failed", error=repr(task.exception()), exc_info=task.exception())

    async def _on_store_change(self, up: bool) -> None:
        """The store went down or came back: the gauge says so, the job
        consumers pause or resume (``Connections.on_store_change``)."""
        if self.served is not None:
            metrics = self.served.metrics
            metrics.store_up.labels(metrics.model_name).set(1 if self.store_health.up else 0)
        await self.connections.on_store_change(up)

    # ------------------------------------------------------- deliveries in
    def take(self, message: aio_pika.abc.AbstractIncomingMessage, queue_class: str) -> None:
        """A job delivery (from a consumer callback, which aiormq cancels if
        its channel closes): the job lives in a task of its own."""
        assert self.intake is not None, "jobs are consumed once the engine serves"
        self.spawn(self.intake.take(message, queue_class))

    # ---------------------------------------------------------- engine side
    def on_step_report(self, report: StepReport) -> None:
        """Metrics of a step (its scheduler's snapshot, when the engine has
        one, and its outputs), from either host."""
        if self.served is None:
            return
        if report.stats is not None:
            self.served.metrics.record_stats(report.stats)
        self.served.metrics.record_outputs(report.outputs)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs (or the interactive ones the engine handed over
        early), each to the run it belongs to (``JobRun.on_output``),
        interactive jobs first: their chunks are queued for sending before
        any batch job's result is."""
        mine = []
        for out in outputs:
            if self.calibrations.on_output(out):
                continue
            run = self.runs.for_output(out.request_id)
            if run is not None and run.state is JobState.RUNNING:
                mine.append((run, out))
        if len(mine) > 1:
            mine.sort(key=lambda pair: pair[0].queue_class != INTERACTIVE)  # stable: step order within a class
        for run, out in mine:
            run.on_output(out)

    def on_step_error(self, exc: BaseException) -> None:
        """A step the engine could not pin on one request: its requests go
        back to the broker (they run again; a job that keeps causing this
        is dead-lettered by the delivery limit)."""
        self.stats["engine_step_errors"] += 1
        if self.served is not None:
            metrics = self.served.metrics
            metrics.engine_step_errors.labels(metrics.model_name).inc()
        log.error("engine_step_failed", error=repr(exc), running=len(self.runs))
        for run in self.runs:
            run.step_failed(exc)

    def on_engine_fatal(self, exc: BaseException) -> None:
        if not self.state.fail(repr(exc)):
            return
        self.stats["engine_fatal"] += 1
        log.error("engine_fatal", error=repr(exc), held=len(self.runs))

    async def _submit_calibration(self, request_id: str, tokens: Any, request_class: Any, priority: int) -> None:
        assert self.host is not None
        await self.host.add_score_request(
            request_id, tokens.prompt_ids, tokens.label_ids, request_class=request_class, priority=priority
        )
