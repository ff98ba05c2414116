"""The queue worker: RabbitMQ on asyncio, the engine in a process of its own.

The event loop does I/O and bookkeeping only; the engine runs elsewhere:
in its own process with ``engine_process`` (``jaxserve worker``'s default;
``jaxserve.worker.engine_process``), so the loop never waits for the
engine's Python work to let go of the GIL, or on a thread of this process
(``jaxserve.worker.engine_thread``; the library default, for engines that
cannot be pickled, such as tests' doubles). Both have the same interface.

This class owns the worker's life (start, run, drain, shutdown), the tables
of the jobs it holds and the engine's callbacks; each job's run is its own
object. The modules, in the order a job meets them (the wire contract is
``docs/protocol.md``, the states :mod:`jaxserve.worker.lifecycle`'s):

* :mod:`~jaxserve.worker.connections`: connections, consumers, pausing.
* :mod:`~jaxserve.worker.intake`: read, refuse, fence a delivery; new key -> run.
* :mod:`~jaxserve.worker.job_run`: the run, the one owner of a job's state,
  resources and settlements, delivery to ack;
  :mod:`~jaxserve.worker.steps`: its admission steps in order;
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
requeues what it holds and exits non-zero for its supervisor to restart.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import structlog

from jaxserve.engine.types import RequestOutput
from jaxserve.metrics import EngineMetrics
from jaxserve.wire import INTERACTIVE, JobLimits, amqp_compat
from jaxserve.worker import control, intake, startup
from jaxserve.worker.admission import InteractiveAdmission
from jaxserve.worker.calibration import LabelCalibrations
from jaxserve.worker.config import WorkerConfig, published_at
from jaxserve.worker.connections import Connections
from jaxserve.worker.engine_host import EngineHost, EngineInfo, StepReport
from jaxserve.worker.health import Health
from jaxserve.worker.job_run import JobRun
from jaxserve.worker.lifecycle import JobState, KeyJob
from jaxserve.worker.limits import MemoryLimiter, RedisLimiter
from jaxserve.worker.prompts import served_name
from jaxserve.worker.replies import Replies, ReplyPublisher
from jaxserve.worker.results import ResultContext
from jaxserve.worker.routing import ModelRoutes
from jaxserve.worker.store import MemoryStore, RedisStore
from jaxserve.worker.store_health import StoreHealth
from jaxserve.worker.tracing import JobTrace, Tracing

__all__ = ["Worker", "WorkerConfig"]

log = structlog.get_logger("jaxserve.worker")

amqp_compat.install()


class Worker:
    def __init__(
        self,
        engine_factory: Callable[[], Any],
        config: WorkerConfig | None = None,
        store: Any = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.engine_factory = engine_factory
        self.cfg = config or WorkerConfig()
        self.topo = self.cfg.topology
        self.store = store if store is not None else MemoryStore()
        self.host: EngineHost | None = None  # the engine's host (startup makes it)
        self.info: EngineInfo | None = None  # what the host says of its engine, once built
        self.engine: Any = None  # the engine, or its process's proxy: for tests and tools only
        self.active: dict[str, JobRun] = {}  # job key -> the run serving it
        self.by_rid: dict[str, JobRun] = {}  # engine request id -> its run
        self.traces: dict[str, JobTrace] = {}  # engine request id -> its job's trace
        self.label_calibrations = LabelCalibrations(self._submit_calibration)
        self.cancels = control.CancelCache(self.cfg.cancel_ttl_s)
        self._tasks: set[asyncio.Task] = set()
        self.publisher: ReplyPublisher | None = None  # batch replies (and the default)
        self.interactive_publisher: ReplyPublisher | None = None
        self.replies = Replies(
            lambda: (self.publisher, self.interactive_publisher),
            reply_timeout_s=self.cfg.reply_timeout_s,
            chunk_timeout_s=self.cfg.chunk_timeout_s,
            queue_for=self.job_queue,
        )
        self._result_context: ResultContext | None = None
        self.routes: ModelRoutes | None = None  # what it serves by model (worker.fallback), once connected
        self.limits = JobLimits(max_body_bytes=self.cfg.max_body_bytes)
        self._closing = False
        self._draining = False
        self._fatal = asyncio.Event()
        self.fatal_error: str | None = None
        self.ready = asyncio.Event()
        self.stats: collections.Counter = collections.Counter()
        self.prefetch: dict[str, int] = {}
        self.metrics: EngineMetrics | None = None
        self.admission = InteractiveAdmission(self.cfg.admission)
        self.limiter: Any = None
        if self.cfg.limits is not None:
            if isinstance(self.store, RedisStore):  # shared by every worker on that Redis
                self.limiter = RedisLimiter(self.cfg.limits, self.store._r, namespace=self.store.ns)
            else:
                self.limiter = MemoryLimiter(self.cfg.limits)
        self.connections = Connections(self, self._take, self._on_control)
        # Store outages: the job consumers pause while the store is down.
        self.store_health = StoreHealth(
            lambda: self.store.ping(),
            on_change=self.connections.on_store_change,
            spawn=self.spawn,
            retry_max_s=self.cfg.store_retry_max_s,
        )
        self.health = Health(self)
        # Job traces (off unless configured: then no OpenTelemetry import)
        self.tracing = tracing if tracing is not None else Tracing.configure(self.cfg.otlp_endpoint)

    # ------------------------------------------------------------------ life
    async def start(self, stop: asyncio.Event | None = None) -> bool:
        """Build and compile the engine, connect, declare, then consume.
        Returns False, without consuming, when ``stop`` is set first."""
        if not await self.start_engine(stop) or (stop is not None and stop.is_set()):
            return False
        await self.store_health.check()  # a store down at start: consume once it answers
        await self.connections.connect()
        self.spawn(self._renew_loop())
        self.spawn(self.health.watchdog_loop())
        self.spawn(self.connections.queue_depth_loop())
        self.ready.set()
        return True

    async def start_engine(self, stop: asyncio.Event | None = None) -> bool:
        """Build the engine, start its host, compile every bucket; no AMQP
        yet (``jaxserve.worker.startup``). False when ``stop`` is set first."""
        return await startup.start_engine(self, stop)

    @property
    def served_model_name(self) -> str | None:
        return served_name(self.cfg.served_model_name, self.info)

    def job_queue(self, queue_class: str) -> str:
        """The queue this worker consumes for ``queue_class``: its model's
        own when it routes by model and is not the default model."""
        return self.topo.queue_for(queue_class) if self.routes is None else self.routes.queue(queue_class)

    @property
    def engine_info(self) -> EngineInfo:
        assert self.info is not None, "the engine is not built yet"
        return self.info

    @property
    def result_context(self) -> ResultContext:
        if self._result_context is None:
            self._result_context = ResultContext(self.served_model_name, self.engine_info.tokenizer, self.cfg.prices)
        return self._result_context

    async def run(self, stop: asyncio.Event) -> int:
        """Start, serve until ``stop`` is set or the engine fails for good,
        then drain and close. Returns the process exit status: 0, or 1 after
        a fatal engine failure (the supervisor should restart the worker)."""
        if await self.start(stop):
            stopper = asyncio.ensure_future(stop.wait())
            fatal = asyncio.ensure_future(self._fatal.wait())
            await asyncio.wait({stopper, fatal}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            fatal.cancel()
        await self.shutdown(drain_timeout=0.0 if self._fatal.is_set() else None)
        return 1 if self._fatal.is_set() else 0

    async def stop_consuming(self) -> None:
        await self.connections.stop_consuming()

    async def shutdown(self, drain_timeout: float | None = None) -> None:
        """Drain: stop consuming, let held jobs finish within the deadline,
        requeue the rest, close everything."""
        timeout = self.cfg.drain_timeout if drain_timeout is None else drain_timeout
        log.info("worker_draining", in_flight=len(self.active), timeout_s=timeout)
        self._draining = True
        await self.stop_consuming()
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end and any(run.drain_waits() for run in self.active.values()):
            await asyncio.sleep(0.05)
        leftover = list(self.active.values())
        for run in leftover:
            await run.requeue("drain")
        self._closing = True
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
        log.info("worker_stopped", requeued=len(leftover), fatal=self.fatal_error, stats=dict(self.stats))

    # -------------------------------------------------------------- helpers
    def spawn(self, coro: Any) -> asyncio.Task:
        """Run ``coro`` as a task the worker owns: shutdown cancels it, a
        failure is logged and counted (``worker_task_failed``)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    _spawn = spawn  # tests/test_worker_lifecycle.py drives a worker without AMQP through these names

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.stats["worker_task_failed"] += 1
            log.error("worker_task_failed", error=repr(task.exception()), exc_info=task.exception())

    async def best_effort(self, what: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """A store write whose loss costs nothing but efficiency."""
        await self.store_health.best_effort(what, fn, *args, stats=self.stats)

    def count_job(self, queue_class: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.job(queue_class, outcome)

    @staticmethod
    def broker_wait(kj: KeyJob) -> float | None:
        """Seconds from the producer's publish timestamp (header
        x-published-at-ms, else the AMQP timestamp) to receipt; None when the
        job carries none."""
        ts = published_at(kj.primary.message)
        return None if ts is None else max(0.0, kj.received_at - ts)

    # ------------------------------------------------------- deliveries in
    def _take(self, message: aio_pika.abc.AbstractIncomingMessage, queue_class: str) -> None:
        self.spawn(self._handle(message, queue_class))

    async def _handle(self, message: aio_pika.abc.AbstractIncomingMessage, queue_class: str) -> None:
        await intake.take(self, message, queue_class)

    async def _on_control(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        await control.on_control(self, message)

    async def _renew_loop(self) -> None:
        await control.renew_loop(self)

    # ---------------------------------------------------------- engine side
    def on_step_report(self, report: StepReport) -> None:
        """Metrics of a step (its scheduler's snapshot, when the engine has
        one, and its outputs), from either host."""
        if self.metrics is None:
            return
        if report.stats is not None:
            self.metrics.record_stats(report.stats)
        self.metrics.record_outputs(report.outputs)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs (or the interactive ones the engine handed over
        early), interactive jobs first: their chunks are queued for sending
        before any batch job's result is."""
        mine = []
        for out in outputs:
            if self.label_calibrations.on_output(out):
                continue
            run = self.by_rid.get(out.request_id)
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
        if self.metrics is not None:
            self.metrics.step_errors.labels(self.metrics.model_name).inc()
        log.error("engine_step_failed", error=repr(exc), running=len(self.active))
        for run in list(self.active.values()):
            run.step_failed(exc)

    def on_engine_fatal(self, exc: BaseException) -> None:
        if self._fatal.is_set():
            return
        self.stats["engine_fatal"] += 1
        self.fatal_error = repr(exc)
        log.error("engine_fatal", error=repr(exc), held=len(self.active))
        self._fatal.set()

    async def _submit_calibration(self, request_id: str, tokens: Any, request_class: Any, priority: int) -> None:
        assert self.host is not None
        await self.host.add_score_request(
            request_id, tokens.prompt_ids, tokens.label_ids, request_class=request_class, priority=priority
        )
