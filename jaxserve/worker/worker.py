"""The queue worker: RabbitMQ on asyncio, the engine in a process of its own.

The event loop does I/O and bookkeeping only; the engine runs elsewhere:
in its own process with ``engine_process`` (``jaxserve worker``'s default;
``jaxserve.worker.engine_process``), so the loop never waits for the
engine's Python work to let go of the GIL, or on a thread of this process
(``jaxserve.worker.engine_thread``; the library default, for engines that
cannot be pickled, such as tests' doubles). Both have the same interface.

Life of a job (the states are :mod:`jaxserve.worker.lifecycle`'s; the wire
contract is ``docs/protocol.md``):

1. A delivery arrives on the interactive or batch consumer. Each consumer
   has a connection and channel of its own and a prefetch tied to the
   engine's capacity: the prefetch is the backpressure (batch never gets the
   interactive reserve). Control (cancels) has its own connection too, and
   replies go out over a publishing connection, so no consumer shares
   another's fate.
2. Properties that do not decode, a forbidden ``reply_to`` or a bad body get
   an ``invalid_request`` result (``jaxserve.wire`` does every range check)
   and are acked.
3. The key is fenced: a key already here attaches the delivery to its job; a
   key with a stored result is replayed (or refused as reused, if the body
   differs); a key claimed by another worker is held until that claim ends.
4. The engine runs it; text deltas are coalesced into ordered chunks
   by a per-job sender; the final result is stored, published with
   confirms, and only then is each delivery acked on its own channel.

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
import dataclasses
import hashlib
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import aio_pika
import orjson
import structlog
from yarl import URL

from jaxserve.engine import scoring
from jaxserve.engine.types import RequestClass, RequestError, RequestOutput
from jaxserve.metrics import EngineMetrics
from jaxserve.metrics import serve as serve_metrics
from jaxserve.tokenizer import labels as label_prompts
from jaxserve.wire import (
    BATCH,
    DEFAULT_AMQP_URL,
    DEFAULT_MAX_BODY_BYTES,
    INTERACTIVE,
    Chunk,
    JobLimits,
    JobProperties,
    Result,
    Topology,
    WireDecodeError,
    amqp_compat,
    check_reply_to,
    decode_cancel,
    outputs,
    parse_job,
)
from jaxserve.wire.republish import copy_message
from jaxserve.wire.topology import declare_topology
from jaxserve.worker.admission import AdmissionConfig, InteractiveAdmission
from jaxserve.worker.calibration import LabelCalibrations
from jaxserve.worker.engine_process import EngineProcess, kv_cache_bytes
from jaxserve.worker.engine_thread import EngineThread
from jaxserve.worker.lifecycle import Delivery, JobState, KeyJob, Settlement
from jaxserve.worker.limits import LimitsConfig, MemoryLimiter, RedisLimiter
from jaxserve.worker.logs import bind_worker_context
from jaxserve.worker.priority import deprioritize_other_threads, deprioritize_process
from jaxserve.worker.replies import PublishOutcome, ReplyPublisher
from jaxserve.worker.store import MemoryStore, Record, RedisStore, StoreUnavailable
from jaxserve.worker.store_health import StoreHealth
from jaxserve.worker.tracing import JobTimes, JobTrace, Tracing

log = structlog.get_logger("jaxserve.worker")

amqp_compat.install()

QUORUM_MAX_PREFETCH = 2000
_ADMISSION = frozenset({JobState.ADMITTING, JobState.HELD})


class _Abandoned(Exception):
    """The job left the phase a coroutine was serving (requeued, cancelled,
    finished by someone else): that coroutine stops quietly."""


@dataclasses.dataclass
class WorkerConfig:
    amqp_url: str = DEFAULT_AMQP_URL
    topology: Topology = dataclasses.field(default_factory=Topology)
    heartbeat: int = 30
    reconnect_interval: float = 1.0
    interactive_prefetch: int | None = None  # default: engine.max_num_seqs
    batch_prefetch: int | None = None  # default: max_num_seqs - interactive_reserved_seqs
    drain_timeout: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    claim_lease_s: float = 30.0
    claim_poll_s: float = 0.5
    # Cancels outlive any wait a job can have in the broker by default.
    cancel_ttl_s: float = 86400.0
    # Every final reply ends within this (then: requeue or, for a destination
    # that can never take it, ack); chunks get the shorter chunk_timeout_s.
    reply_timeout_s: float = 60.0
    chunk_timeout_s: float = 10.0
    store_retry_max_s: float = 5.0  # backoff cap of the outage probe while the store is unreachable
    # While the store is unreachable a job waits for it at most this long,
    # then goes back to the broker (--store-hold).
    store_hold_s: float = 10.0
    engine_hang_timeout_s: float = 300.0  # one step or command busy longer: the engine is hung
    # nice value for every thread but the event loop's once the engine is
    # compiled (jaxserve.worker.priority, --compute-nice); 0 leaves
    # priorities alone.
    compute_nice: int = 0
    # Run the engine in a process of its own (jaxserve.worker.engine_process)
    # instead of a thread of this one: the event loop then never waits for
    # the engine's Python work to let go of the GIL. The engine factory must
    # then pickle (a module-level callable, or a functools.partial of one);
    # `jaxserve worker` turns it on (--engine-process, the default there).
    engine_process: bool = False
    max_consecutive_step_failures: int = 5
    log_text: bool = False
    # The name jobs write in ``model`` (and results carry); default: the
    # engine's model name without its folder.
    served_model_name: str | None = None
    # Interactive admission (overloaded when a job cannot start in time) and
    # per-tenant limits (--limits FILE; None: no limits).
    admission: AdmissionConfig = dataclasses.field(default_factory=AdmissionConfig)
    limits: LimitsConfig | None = None
    defer_wait_max_s: float = 1.0  # a batch job over its tenant's limit waits this long at most before going back
    declare: bool = True
    metrics_port: int | None = None  # serve Prometheus /metrics here when set
    # Trace jobs and export to this OTLP collector (--otlp-endpoint); the
    # OTEL_* variables configure tracing too (jaxserve.worker.tracing).
    otlp_endpoint: str | None = None
    worker_id: str = dataclasses.field(
        default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    )


def _published_at(message: Any) -> float | None:
    """When the producer published: header ``x-published-at-ms`` (epoch
    milliseconds, integer), else the AMQP ``timestamp`` (whole seconds)."""
    hdr = (message.headers or {}).get("x-published-at-ms")
    try:
        if hdr is not None and not isinstance(hdr, bool):
            return int(hdr) / 1000.0
        if message.timestamp is not None:
            return message.timestamp.timestamp()
    except (TypeError, ValueError, OverflowError, AttributeError, OSError):
        pass
    return None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


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
        self.engine: Any = None
        self.engine_thread: EngineThread | EngineProcess | None = None
        self.active: dict[str, KeyJob] = {}
        self._by_rid: dict[str, KeyJob] = {}  # engine request id -> job
        self.label_calibrations = LabelCalibrations(self._submit_calibration)
        self._token_bytes: Any = None  # token id -> bytes, for logprobs results (built on first use)
        self._cancelled_here: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self._conns: dict[str, aio_pika.abc.AbstractRobustConnection] = {}
        self._channels: dict[str, aio_pika.abc.AbstractRobustChannel] = {}
        self._queues: dict[str, aio_pika.abc.AbstractRobustQueue] = {}
        self._consumer_tags: dict[str, str] = {}
        self.publisher: ReplyPublisher | None = None  # batch replies (and the default)
        # Interactive replies on a connection of their own, so their confirms
        # never wait behind a burst of batch replies.
        self.interactive_publisher: ReplyPublisher | None = None
        self.limits = JobLimits(max_body_bytes=self.cfg.max_body_bytes)
        self._closing = False
        self._fatal = asyncio.Event()
        self.fatal_error: str | None = None
        self._loop_tick = time.monotonic()  # the watchdog's last run (liveness)
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
        self._batch_paused = False
        self._draining = False
        # Store outages: the job consumers pause while the store is down
        # (jaxserve.worker.store_health); one lock orders every consume/cancel.
        self.store_health = StoreHealth(
            lambda: self.store.ping(),
            on_change=self._on_store_change,
            spawn=self._spawn,
            retry_max_s=self.cfg.store_retry_max_s,
        )
        self._store_paused = False
        self._consumers_lock = asyncio.Lock()
        # Job traces (off unless configured: then no OpenTelemetry import)
        self.tracing = tracing if tracing is not None else Tracing.configure(self.cfg.otlp_endpoint)
        self._traces: dict[str, JobTrace] = {}  # engine request id -> its job's trace

    # ------------------------------------------------------------------ life
    def _url(self) -> URL:
        return URL(self.cfg.amqp_url).update_query(heartbeat=str(int(self.cfg.heartbeat)))

    @staticmethod
    async def _unless_stopped(awaitable: Any, stop: asyncio.Event | None) -> tuple[bool, Any]:
        """Await ``awaitable``: (True, its value), or (False, None) when
        ``stop`` is set first (it is left to finish on its own)."""
        fut = asyncio.ensure_future(awaitable)
        if stop is None:
            return True, await fut
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({fut, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if fut.done():
            return True, fut.result()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return False, None

    async def start(self, stop: asyncio.Event | None = None) -> bool:
        """Build and compile the engine, connect, declare, then consume.
        Returns False, without consuming, when ``stop`` is set first."""
        if not await self.start_engine(stop) or (stop is not None and stop.is_set()):
            return False
        await self.store_health.check()  # a store down at start: consume once it answers
        await self._connect()
        self._spawn(self._renew_loop())
        self._spawn(self._watchdog_loop())
        self._spawn(self._queue_depth_loop())
        self.ready.set()
        return True

    async def start_engine(self, stop: asyncio.Event | None = None) -> bool:
        """Build the engine, start its thread, compile every bucket; no AMQP
        yet. False when ``stop`` is set first."""
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        bind_worker_context(worker_id=self.cfg.worker_id)
        if self.cfg.engine_process:
            # Set before the build, so a shutdown meanwhile stops the process.
            self.engine_thread = EngineProcess(
                self.engine_factory,
                loop,
                self._on_outputs,
                self._on_step_error,
                on_step=self._record_remote_step,
                on_fatal=self._on_engine_fatal,
                max_consecutive_step_failures=self.cfg.max_consecutive_step_failures,
            )
            built, self.engine = await self._unless_stopped(self.engine_thread.start(), stop)
        else:
            built, self.engine = await self._unless_stopped(asyncio.to_thread(self.engine_factory), stop)
        if not built:
            log.info("worker_stopped_before_consuming", phase="engine_build")
            return False
        load_s = time.monotonic() - t0
        bind_worker_context(model=self.served_model_name)
        # the served name, as vLLM labels its metrics (--served-model-name)
        self.metrics = EngineMetrics(self.served_model_name or "")
        self.metrics.set_health_checks(ready=self._readiness, live=self._liveness)
        self.metrics.model_load_seconds.labels(self.metrics.model_name).set(load_s)
        kv = kv_cache_bytes(self.engine)
        if kv is not None:
            self.metrics.kv_cache_bytes.labels(self.metrics.model_name).set(kv)
        if self.cfg.metrics_port is not None:
            serve_metrics(self.metrics, self.cfg.metrics_port)
        if not self.cfg.engine_process:
            self.engine_thread = EngineThread(
                self.engine,
                loop,
                self._on_outputs,
                self._on_step_error,
                on_step=self.metrics.record_step if hasattr(self.engine, "scheduler") else None,
                on_fatal=self._on_engine_fatal,
                max_consecutive_step_failures=self.cfg.max_consecutive_step_failures,
            )
            self.engine_thread.start()
        log.info(
            "engine_warmup_started",
            model=getattr(self.engine, "model_name", None),
            load_s=round(load_s, 3),
            engine_process=getattr(self.engine_thread, "pid", None),
        )
        # Compile every shape bucket before taking any job (no AMQP yet, so
        # nothing can miss a heartbeat while compilation holds the GIL).
        host = cast("EngineThread | EngineProcess", self.engine_thread)  # set above on both paths
        if not (await self._unless_stopped(host.warmup(), stop))[0]:
            log.info("worker_stopped_before_consuming", phase="warmup")
            return False
        self.metrics.warmup_seconds.labels(self.metrics.model_name).set(time.monotonic() - t0 - load_s)
        if self.cfg.compute_nice:
            if self.cfg.engine_process:
                # the engine process is running (it built the engine)
                niced = deprioritize_process(cast(int, cast(EngineProcess, host).pid), self.cfg.compute_nice)
            else:
                niced = deprioritize_other_threads(self.cfg.compute_nice)
            log.info("compute_threads_deprioritized", nice=self.cfg.compute_nice, threads=niced)
        log.info(
            "engine_ready", model=getattr(self.engine, "model_name", None), warmup_s=round(time.monotonic() - t0, 3)
        )
        self.limits = JobLimits(
            max_body_bytes=self.cfg.max_body_bytes,
            vocab_size=self._vocab_size(),
            max_model_len=getattr(self.engine, "max_model_len", None),
        )
        max_seqs = int(getattr(self.engine, "max_num_seqs", 8))
        reserved = int(getattr(self.engine, "interactive_reserved_seqs", 0))
        reserved = min(max(reserved, 0), max(max_seqs - 1, 0))
        self.prefetch = {
            INTERACTIVE: min(QUORUM_MAX_PREFETCH, self.cfg.interactive_prefetch or max_seqs),
            BATCH: min(QUORUM_MAX_PREFETCH, self.cfg.batch_prefetch or max(1, max_seqs - reserved)),
        }
        return True

    @property
    def served_model_name(self) -> str | None:
        if self.cfg.served_model_name:
            return self.cfg.served_model_name
        name = getattr(self.engine, "model_name", None)
        return None if name is None else os.path.basename(str(name).rstrip("/"))

    def _vocab_size(self) -> int | None:
        cfg = getattr(self.engine, "model_config", None)
        size = getattr(cfg, "vocab_size", None) or getattr(self.engine, "vocab_size", None)
        return int(size) if isinstance(size, int) else None

    async def _open(self, name: str) -> aio_pika.abc.AbstractRobustConnection:
        conn = await aio_pika.connect_robust(
            self._url(),
            reconnect_interval=self.cfg.reconnect_interval,
            client_properties={"connection_name": f"jaxserve-worker-{name} {self.cfg.worker_id}"},
        )
        conn.reconnect_callbacks.add(self._make_reconnect_cb(name))
        conn.close_callbacks.add(self._make_close_cb(name))
        self._conns[name] = conn
        return conn

    async def _connect(self) -> None:
        self.publisher = ReplyPublisher(
            self._url(), name=self.cfg.worker_id, reconnect_interval=self.cfg.reconnect_interval, stats=self.stats
        )
        pub = await self.publisher.start()
        pub.reconnect_callbacks.add(self._make_reconnect_cb("publish"))
        pub.close_callbacks.add(self._make_close_cb("publish"))
        self.interactive_publisher = ReplyPublisher(
            self._url(),
            name=f"{self.cfg.worker_id} interactive",
            reconnect_interval=self.cfg.reconnect_interval,
            stats=self.stats,
        )
        ipub = await self.interactive_publisher.start()
        ipub.reconnect_callbacks.add(self._make_reconnect_cb("publish"))
        ipub.close_callbacks.add(self._make_close_cb("publish"))
        control = await self._open("control")
        if self.cfg.declare:
            await declare_topology(control, self.topo)
        # Control first, so a cancel for a job we are about to take is seen.
        ctl = await control.channel()
        self._channels["control"] = ctl
        ctl_ex = await ctl.declare_exchange(self.topo.control, aio_pika.ExchangeType.FANOUT, durable=True)
        ctl_q = await ctl.declare_queue("", exclusive=True, auto_delete=True)
        await ctl_q.bind(ctl_ex)
        self._queues["control"] = ctl_q
        self._consumer_tags["control"] = await ctl_q.consume(self._on_control, no_ack=True)
        for qc in (INTERACTIVE, BATCH):
            conn = await self._open(qc)
            ch = await conn.channel()
            await ch.set_qos(prefetch_count=self.prefetch[qc])
            self._channels[qc] = ch
            q = await ch.declare_queue(
                self.topo.queue_for(qc), durable=True, arguments=self.topo.job_queue_arguments(qc)
            )
            self._queues[qc] = q
            async with self._consumers_lock:
                if self.store_health.up:
                    self._consumer_tags[qc] = await q.consume(self._make_job_cb(qc), no_ack=False)
                else:
                    self._store_paused = True  # consumed once the store answers
        log.info(
            "worker_consuming",
            worker_id=self.cfg.worker_id,
            interactive=self.topo.interactive,
            batch=self.topo.batch,
            prefetch=self.prefetch,
            heartbeat=self.cfg.heartbeat,
        )

    def _make_reconnect_cb(self, name: str) -> Callable:
        def cb(*_: Any) -> None:
            self.stats[f"reconnect_{name}"] += 1
            if self.metrics is not None:
                self.metrics.reconnects.labels(self.metrics.model_name, name).inc()
            log.warning("amqp_reconnected", connection=name)

        return cb

    def _make_close_cb(self, name: str) -> Callable:
        def cb(_conn: Any, exc: Any = None) -> None:
            if not self._closing:
                self.stats[f"connection_lost_{name}"] += 1
                log.warning("amqp_connection_lost", connection=name, error=str(exc) if exc else None)

        return cb

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
        async with self._consumers_lock:
            await self._cancel_consumers()

    async def _cancel_consumers(self) -> None:
        for qc in (INTERACTIVE, BATCH):
            q, tag = self._queues.get(qc), self._consumer_tags.pop(qc, None)
            if q is not None and tag is not None:
                try:
                    await q.cancel(tag)
                except Exception as exc:  # noqa: BLE001 - a dead channel consumes nothing anyway
                    log.warning("cancel_consumer_failed", queue=qc, error=str(exc))

    async def shutdown(self, drain_timeout: float | None = None) -> None:
        """Drain: stop consuming, let held jobs finish within the deadline,
        requeue the rest, close everything."""
        timeout = self.cfg.drain_timeout if drain_timeout is None else drain_timeout
        log.info("worker_draining", in_flight=len(self.active), timeout_s=timeout)
        self._draining = True
        await self.stop_consuming()
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end and any(self._drain_waits_for(kj) for kj in self.active.values()):
            await asyncio.sleep(0.05)
        leftover = list(self.active.values())
        for kj in leftover:
            await self._requeue(kj, "drain")
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        for publisher in (self.publisher, self.interactive_publisher):
            if publisher is not None:
                await publisher.close()
        for conn in self._conns.values():
            if not conn.is_closed:
                try:
                    await conn.close()
                except Exception:  # noqa: BLE001
                    pass
        if self.engine_thread is not None:
            await asyncio.to_thread(self.engine_thread.stop)
        try:
            await self.store.close()
        except Exception:  # noqa: BLE001
            pass
        self.tracing.shutdown()
        log.info("worker_stopped", requeued=len(leftover), fatal=self.fatal_error, stats=dict(self.stats))

    # ------------------------------------------------------------- helpers
    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.stats["worker_task_failed"] += 1
            log.error("worker_task_failed", error=repr(task.exception()), exc_info=task.exception())

    def _forget(self, kj: KeyJob) -> None:
        """Remove ``kj`` from the active table, only if it is still the one
        serving its key."""
        if self.active.get(kj.key) is kj:
            del self.active[kj.key]
        if self._by_rid.get(kj.request_id) is kj:
            del self._by_rid[kj.request_id]
        trace = self._traces.pop(kj.request_id, None)
        if trace is not None:
            settled = kj.state is JobState.SETTLED
            times = JobTimes.of(kj, self._broker_wait(kj), trace.result_ready_at)
            trace.end(times, kj.result if settled else None, None if settled else kj.state.value)

    async def _store(self, kj: KeyJob | None, fn: Callable, *args: Any) -> Any:
        """Call the store. While it is unreachable the job is HELD (in
        admission) and waits for the outage probe to find the store back
        (``self.store_health``; the job itself does not call it meanwhile),
        at most ``store_hold_s``: then it goes back to the broker, once (the
        consumers are paused, so it is not redelivered here in a loop).
        Raises :class:`_Abandoned` when the job leaves the phase it was in
        meanwhile, or went back."""
        # read only when there is a job
        phase = frozenset() if kj is None else (_ADMISSION if kj.state in _ADMISSION else frozenset({kj.state}))
        health = self.store_health
        give_up_at: float | None = None
        while True:
            if health.up:
                try:
                    value = await fn(*args)
                except StoreUnavailable as exc:
                    self.stats["store_unavailable"] += 1
                    health.failed(exc)
                    if give_up_at is None:
                        log.warning(
                            "store_unavailable_waiting",
                            key=None if kj is None else kj.key,
                            error=str(exc),
                            hold_s=self.cfg.store_hold_s,
                        )
                else:
                    if kj is not None:
                        if kj.state not in phase:
                            raise _Abandoned
                        if kj.state is JobState.HELD:
                            kj.to(JobState.ADMITTING)
                    return value
            if kj is None:
                await health.wait_up(None)
                continue
            if kj.state is JobState.ADMITTING:
                kj.to(JobState.HELD)
            if self._closing or kj.state not in phase:
                raise _Abandoned from None
            now = time.monotonic()
            give_up_at = now + self.cfg.store_hold_s if give_up_at is None else give_up_at
            back = await health.wait_up(max(0.0, give_up_at - now))
            if kj.state not in phase:
                raise _Abandoned from None
            if not back:
                self.stats["store_hold_expired"] += 1
                await self._requeue(kj, f"store unavailable for {self.cfg.store_hold_s:g}s")
                raise _Abandoned from None

    async def _best_effort(self, what: str, fn: Callable, *args: Any) -> None:
        """A store write whose loss costs nothing but efficiency (skipped
        while the store is down)."""
        if not self.store_health.up:
            self.stats["store_write_skipped"] += 1
            return
        try:
            await fn(*args)
        except StoreUnavailable as exc:
            self.stats["store_write_skipped"] += 1
            self.store_health.failed(exc)
            log.warning("store_write_skipped", what=what, error=str(exc))

    def _drain_waits_for(self, kj: KeyJob) -> bool:
        """Drain waits for a job that can finish: not for one held in
        admission (it has not started: it goes back to the broker at once),
        nor, while the store is down, for one that started (its result could
        not be stored)."""
        if kj.state is JobState.HELD:
            return False
        return self.store_health.up or kj.state in (JobState.RECEIVED, JobState.ADMITTING)

    async def _on_store_change(self, up: bool) -> None:
        """The store went down: both job consumers pause (a job taken now
        would only be held); it answers again: they resume (batch unless
        ``_pace_batch`` holds it). Whatever changed last wins."""
        if self.metrics is not None:
            self.metrics.store_up.labels(self.metrics.model_name).set(1 if self.store_health.up else 0)
        async with self._consumers_lock:
            if up != self.store_health.up or self._draining or self._closing:
                return
            if not up and not self._store_paused:
                self._store_paused = True
                await self._cancel_consumers()
                log.info("job_consumers_paused", reason="store unavailable", held=len(self.active))
            elif up and self._store_paused:
                while self.store_health.up and not (self._draining or self._closing):
                    try:
                        for qc in (INTERACTIVE, BATCH):
                            q = self._queues.get(qc)
                            if (
                                q is not None
                                and qc not in self._consumer_tags
                                and not (qc == BATCH and self._batch_paused)
                            ):
                                self._consumer_tags[qc] = await q.consume(self._make_job_cb(qc), no_ack=False)
                        self._store_paused = False
                        log.info("job_consumers_resumed", reason="store available")
                        return
                    except Exception as exc:  # noqa: BLE001 - a channel being restored: try again
                        log.warning("job_consumers_resume_failed", error=repr(exc))
                        await asyncio.sleep(1.0)

    def _count_job(self, queue_class: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.job(queue_class, outcome)

    # ---------------------------------------------------------- deliveries
    def _make_job_cb(self, queue_class: str) -> Callable:
        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            # aiormq cancels this callback's task if the channel closes, so
            # the job lives in a task of its own.
            self._spawn(self._handle(message, queue_class))

        return on_message

    async def _handle(self, message: aio_pika.abc.AbstractIncomingMessage, queue_class: str) -> None:
        """Every delivery ends answered and settled, whatever its content:
        an unexpected failure while reading it (a bug, a pathological body)
        is answered ``invalid_request`` and acked rather than left unsettled,
        which would hold a prefetch slot for ever."""
        made: list[Delivery] = []
        try:
            kj = await self._read(message, queue_class, made)
        except Exception as exc:  # noqa: BLE001
            self.stats["unreadable"] += 1
            log.error("job_unreadable", message_id=_text(message.message_id), error=repr(exc)[:300])
            d = made[-1] if made else Delivery(message, queue_class, self.topo.results, None, self.stats)
            if d.settled is None:  # never settle a delivery twice (the broker would close the channel)
                d.reply_to = self.topo.results
                err = RequestError("invalid_request", f"the job could not be read ({type(exc).__name__})")
                await self._refuse(d, _text(message.message_id), err, len(message.body or b""))
            return
        if kj is None:
            return
        try:
            await self._admit(kj)
        except _Abandoned:
            pass
        except Exception as exc:  # a worker bug: give the job back, never lose it (logged with its traceback)
            self.stats["admit_failed"] += 1
            log.error("job_admit_failed", key=kj.key, error=repr(exc), exc_info=exc)
            await self._requeue(kj, f"worker error: {exc!r}")

    async def _read(
        self, message: aio_pika.abc.AbstractIncomingMessage, queue_class: str, made: list[Delivery]
    ) -> KeyJob | None:
        """A delivery as a new job in the active table, or None when it was
        answered here (refused, or attached to the job already serving its key)."""
        received_at = time.time()
        self.stats["received"] += 1
        key = _text(message.message_id)
        reply_to = _text(message.reply_to) or self.topo.results
        bad = amqp_compat.undecodable_properties(message)
        if bad:
            if "reply_to" in bad:
                reply_to = self.topo.results
            d = Delivery(message, queue_class, reply_to, _text(message.correlation_id), self.stats)
            made.append(d)
            err = RequestError("invalid_request", f"AMQP properties that do not decode: {', '.join(bad)}")
            await self._refuse(d, key, err, len(message.body))
            return None
        d = Delivery(message, queue_class, reply_to, _text(message.correlation_id), self.stats)
        made.append(d)
        try:
            check_reply_to(message.reply_to, self.topo.reserved_names())
        except RequestError as err:
            d.reply_to = self.topo.results  # never into the worker's own queues
            await self._refuse(d, key, err, len(message.body))
            return None
        try:
            job = parse_job(
                message.body,
                JobProperties(
                    message_id=message.message_id,
                    reply_to=message.reply_to,
                    correlation_id=message.correlation_id,
                    content_type=message.content_type,
                    expiration=message.expiration,
                    published_at=_published_at(message),
                    priority=message.priority,
                ),
                self.limits,
                received_at=received_at,
            )
        except RequestError as err:
            await self._refuse(d, key, err, len(message.body))
            return None

        existing = self.active.get(job.key)
        if existing is not None:
            if existing.job.fingerprint != job.fingerprint:
                await self._refuse(d, job.key, self._reused(job.key), len(message.body))
                return None
            # A redelivery (our channel died) or a duplicate publish: never
            # run a key twice; the running job answers it when it ends.
            existing.attach(d)
            self.stats["fenced"] += 1
            log.info("job_fenced", key=job.key, redelivered=d.redelivered, state=existing.state.value)
            return None
        kj = KeyJob(job.key, job, d, received_at)
        self.active[job.key] = kj
        trace = self.tracing.start_job(
            message.headers,
            queue=self.topo.queue_for(queue_class),
            queue_class=queue_class,
            message_id=job.key,
            correlation_id=d.correlation_id,
            body_size=len(message.body),
            redelivered=d.redelivered,
            received_mono=kj.received_mono,
            broker_wait_s=self._broker_wait(kj),
        )
        if trace is not None:
            self._traces[kj.request_id] = trace
        return kj

    @staticmethod
    def _reused(key: str) -> RequestError:
        return RequestError(
            "idempotency_key_reused",
            f"key {key!r} was already used for a different job body; use a new message_id for a new job",
        )

    async def _refuse(self, d: Delivery, key: str | None, err: RequestError, size: int) -> None:
        """Answer a delivery that never becomes a job, then settle it."""
        self.stats["invalid"] += 1
        self._count_job(d.queue_class, err.code)
        log.info("job_invalid", key=key, queue=d.queue_class, bytes=size, code=err.code, reason=err.message)
        result = Result.failure(key, err.code, err.message, err.retryable)
        trace_id = self.tracing.parent_trace_id(d.message.headers)  # never a job: no spans, the producer's id only
        if trace_id is not None:
            result = result.model_copy(update={"trace_id": trace_id})
        outcome = await self._publish_final(d, result)
        await d.settle(
            Settlement.ACK if outcome is PublishOutcome.CONFIRMED or outcome.undeliverable else Settlement.REQUEUE
        )

    def _publisher_for(self, queue_class: str) -> ReplyPublisher:
        publisher = self.interactive_publisher if queue_class == INTERACTIVE else None
        publisher = publisher or self.publisher
        assert publisher is not None
        return publisher

    async def _publish_final(self, d: Delivery, result: Result) -> PublishOutcome:
        return await self._publisher_for(d.queue_class).publish(
            d.reply_to,
            result.to_bytes(),
            correlation_id=d.correlation_id,
            message_id=result.id,
            timeout_s=self.cfg.reply_timeout_s,
        )

    def _cancelled_locally(self, key: str) -> bool:
        expires = self._cancelled_here.get(key)
        return expires is not None and expires > time.monotonic()

    def _remember_cancel(self, key: str) -> None:
        now = time.monotonic()
        self._cancelled_here[key] = now + self.cfg.cancel_ttl_s
        self._cancelled_here.move_to_end(key)
        while self._cancelled_here:
            oldest, expires = next(iter(self._cancelled_here.items()))
            if expires > now and len(self._cancelled_here) <= 100_000:
                break
            del self._cancelled_here[oldest]

    async def _admit(self, kj: KeyJob) -> None:
        job, key = kj.job, kj.key
        kj.to(JobState.ADMITTING)
        if self._cancelled_locally(key):
            await self._finish(kj, Result.failure(key, "cancelled", "the job was cancelled"))
            return
        if not await self._limit_on_arrival(kj):
            return
        rec = await self._store(kj, self.store.get, key)
        if rec is not None:
            await self._answer_from_record(kj, rec)
            return
        if await self._store(kj, self.store.is_cancelled, key):
            await self._finish(kj, Result.failure(key, "cancelled", "the job was cancelled"))
            return
        if job.deadline is not None and time.time() >= job.deadline:
            await self._finish(kj, Result.failure(key, "expired", "the job's deadline passed before it started"))
            return
        if job.deadline is not None:
            remaining = job.deadline - time.time()
            kj.deadline_handle = asyncio.get_running_loop().call_later(max(0.0, remaining), self._on_deadline, kj)
        # Claim the key (a shared store: never started on two workers at once).
        while True:
            owner = await self._store(kj, self.store.claim, key, self.cfg.worker_id, self.cfg.claim_lease_s)
            if owner is None:
                break
            self.stats["held_for_other_worker"] += 1
            log.info("job_held_claimed_elsewhere", key=key, owner=owner)
            kj.to(JobState.HELD)
            await asyncio.sleep(self.cfg.claim_poll_s)
            if kj.state is not JobState.HELD:
                return
            kj.to(JobState.ADMITTING)
            rec = await self._store(kj, self.store.get, key)
            if rec is not None:
                await self._answer_from_record(kj, rec)
                return
        kj.claimed = True
        try:
            prompt_ids = self._prepare_prompt(job)
            label_ids = calibration = None
            if job.labels is not None:
                prompt_ids, label_ids, calibration = self._prepare_labels(job, prompt_ids)
        except RequestError as err:
            self.stats["invalid"] += 1
            log.info("job_invalid", key=key, code=err.code, reason=err.message)
            await self._finish(kj, Result.failure(key, err.code, err.message, err.retryable))
            return
        kj.label_ids = label_ids
        if job.deterministic and job.use_cache:
            kj.cache_key = self._cache_key(job, prompt_ids, label_ids, calibration)
            hit = await self._store(kj, self.store.cache_get, kj.cache_key)
            if hit is not None:
                self.stats["cache_hits"] += 1
                log.info("job_cache_hit", key=key, queue=kj.queue_class)
                cached = Result.model_validate(
                    {**hit, "id": key, "cached": True, "timings": self._timings(kj), "trace_id": None}
                )
                await self._finish(kj, cached)
                return
        if calibration is not None and not await self._calibrate(kj, calibration):
            return
        if not await self._within_limits(kj, prompt_ids, label_ids):
            return
        self._log_start(kj, len(prompt_ids))
        if job.stream:
            kj.sender = self._spawn(self._sender(kj))
        deadline_mono = None if job.deadline is None else time.monotonic() + (job.deadline - time.time())
        rc = RequestClass.INTERACTIVE if kj.queue_class == INTERACTIVE else RequestClass.BATCH
        assert self.engine_thread is not None
        kj.to(JobState.RUNNING)
        kj.in_engine = True
        self._by_rid[kj.request_id] = kj
        try:
            if label_ids is not None:
                await self.engine_thread.add_score_request(
                    kj.request_id,
                    prompt_ids,
                    label_ids,
                    request_class=rc,
                    priority=job.engine_priority,
                    deadline=deadline_mono,
                )
            else:
                await self.engine_thread.add_request(
                    kj.request_id,
                    prompt_ids,
                    job.params,
                    request_class=rc,
                    priority=job.engine_priority,
                    deadline=deadline_mono,
                )
        except RequestError as err:
            kj.in_engine = False
            if kj.state is JobState.RUNNING:
                await self._finish(kj, Result.failure(key, err.code, err.message, err.retryable))
            return
        except Exception as exc:  # noqa: BLE001 - the engine thread is gone
            kj.in_engine = False
            await self._requeue(kj, f"engine unavailable: {exc!r}")
            return
        kj.admitted_mono = time.monotonic()

    async def _limit_on_arrival(self, kj: KeyJob) -> bool:
        """The tenant's in-flight and request-rate limits, judged as of the
        job's arrival (``kj.received_at``) and asked before any store
        look-up, so neither a slow store nor a loaded machine moves the
        moment a job is counted (``tests/test_queue_tenant_arrival.py``).
        Passing sets ``kj.limit_tokens`` to 0 (counted, no tokens charged
        yet); a job that then never runs gives its request back
        (``_release_limits``). Returns whether the job may go on."""
        if self.limiter is None:
            return True
        try:
            decision = await self.limiter.arrive(kj.job.tenant or "", kj.request_id, kj.received_at)
        except Exception as exc:  # noqa: BLE001 - a limiter outage must not stop serving: fail open
            self.stats["limiter_unavailable"] += 1
            log.warning("limiter_unavailable", key=kj.key, error=repr(exc))
            return True
        if not decision.allowed:
            await self._over_limit(kj, decision)
            return False
        kj.limit_tokens = 0
        return True

    async def _over_limit(self, kj: KeyJob, decision: Any) -> None:
        """Interactive: answered rate_limited with retry_after_s; batch: it
        waits, back in the broker (``_defer``)."""
        tenant = kj.job.tenant or ""
        self._count_rejection("rate_limited", decision.reason, kj.queue_class, tenant)
        if kj.queue_class == INTERACTIVE:
            await self._finish(
                kj,
                Result.failure(
                    kj.key,
                    "rate_limited",
                    f"tenant {tenant!r} is over its {decision.reason} limit",
                    retry_after_s=round(decision.retry_after_s, 3),
                ),
            )
        else:
            await self._defer(kj, decision.retry_after_s, decision.reason)

    async def _within_limits(self, kj: KeyJob, prompt_ids: list[int], label_ids: list[list[int]] | None) -> bool:
        """The tenant's tokens limit (charged as of the job's arrival), then
        (interactive) the admission budget. A job over them is answered
        (interactive: rate_limited or overloaded, with retry_after_s) or
        given back to its queue to wait (batch); returns whether it may run."""
        job, key = kj.job, kj.key
        tenant = job.tenant or ""
        if self.limiter is not None and kj.limit_tokens is not None:  # counted on arrival: now its tokens
            tokens = len(prompt_ids) + (max(len(x) for x in label_ids) if label_ids else job.params.max_tokens)
            try:
                decision = await self.limiter.charge(tenant, kj.request_id, tokens, kj.received_at)
            except Exception as exc:  # noqa: BLE001 - a limiter outage must not stop serving: fail open
                self.stats["limiter_unavailable"] += 1
                log.warning("limiter_unavailable", key=key, error=repr(exc))
                decision = None
            if decision is not None and not decision.allowed:
                await self._release_limits(kj, used_tokens=0)
                await self._over_limit(kj, decision)
                return False
            if decision is not None:
                kj.limit_tokens = tokens
        if kj.queue_class == INTERACTIVE:
            waited = self._broker_wait(kj)
            if waited is not None and waited > self.cfg.admission.target_ttft_s:
                # It could not start in time already: the worker (or fleet) is
                # behind, and the producer should know now, not after more waiting.
                await self._release_limits(kj, used_tokens=0)
                self._count_rejection("overloaded", "broker_wait", kj.queue_class, tenant)
                await self._finish(
                    kj,
                    Result.failure(
                        key,
                        "overloaded",
                        f"the job waited {waited:.2f}s in the broker, over the {self.cfg.admission.target_ttft_s:g}s "
                        "target time to first token; retry later",
                        retry_after_s=round(min(waited, 30.0), 3),
                    ),
                )
                return False
            retry = self.admission.try_admit(kj.request_id, len(prompt_ids))
            if retry is not None:
                await self._release_limits(kj, used_tokens=0)
                self._count_rejection("overloaded", "interactive_token_budget", kj.queue_class, tenant)
                await self._finish(
                    kj,
                    Result.failure(
                        key,
                        "overloaded",
                        f"the worker holds {self.admission.held_tokens} interactive prompt tokens not yet started "
                        f"(budget {self.admission.budget}); retry later",
                        retry_after_s=retry,
                    ),
                )
                return False
            kj.admission_held = True
        return True

    @staticmethod
    def _broker_wait(kj: KeyJob) -> float | None:
        """Seconds from the producer's publish timestamp (header
        x-published-at-ms, else the AMQP timestamp) to receipt; None when the
        job carries none."""
        ts = _published_at(kj.primary.message)
        return None if ts is None else max(0.0, kj.received_at - ts)

    def _count_rejection(self, code: str, reason: str, queue_class: str, tenant: str) -> None:
        self.stats[f"rejected_{code}"] += 1
        label = self.cfg.limits.metric_label(tenant) if self.cfg.limits is not None else "default"
        if self.metrics is not None and hasattr(self.metrics, "rejection"):
            self.metrics.rejection(code, reason, queue_class, label)

    async def _release_limits(self, kj: KeyJob, used_tokens: int) -> None:
        """The job leaves its tenant's in-flight count and gives back the
        tokens it was charged but did not use; it leaves the admission budget."""
        if kj.admission_held:
            kj.admission_held = False
            self.admission.release(kj.request_id)
        if kj.limit_tokens is None or self.limiter is None:
            return
        charged, kj.limit_tokens = kj.limit_tokens, None
        unserved = kj.admitted_mono is None  # never reached the engine: its request is given back
        try:
            await self.limiter.release(
                kj.job.tenant or "", kj.request_id, max(0, charged - used_tokens), unserved=unserved
            )
        except Exception as exc:  # noqa: BLE001
            log.warning("limiter_release_failed", key=kj.key, error=repr(exc))

    async def _defer(self, kj: KeyJob, wait_s: float, reason: str) -> None:
        """A batch job over its tenant's limit waits in the broker: after a
        short pause it is published again at the tail of its queue (same
        body and properties, with a confirm) and only then acked, so the
        jobs of other tenants behind it come forward."""
        kj.to(JobState.REQUEUED)
        self._forget(kj)
        if kj.deadline_handle is not None:
            kj.deadline_handle.cancel()
        if kj.claimed:
            await self._best_effort("release", self.store.release, kj.key, self.cfg.worker_id)
        await asyncio.sleep(min(max(wait_s, 0.0), self.cfg.defer_wait_max_s))
        message = kj.primary.message
        headers = dict(message.headers or {})
        headers["x-jaxserve-deferred"] = int(headers.get("x-jaxserve-deferred") or 0) + 1
        copy = copy_message(message, headers, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        assert self.publisher is not None
        outcome = await self.publisher.publish_message(
            self.topo.queue_for(kj.queue_class), copy, self.cfg.reply_timeout_s
        )
        how = Settlement.ACK if outcome is PublishOutcome.CONFIRMED else Settlement.REQUEUE
        for d in kj.unsettled():
            await d.settle(how)
        self.stats["deferred"] += 1
        log.info("job_deferred", key=kj.key, reason=reason, tenant=kj.job.tenant, republished=how is Settlement.ACK)

    def _log_start(self, kj: KeyJob, prompt_tokens: int) -> None:
        job = kj.job
        kw: dict[str, Any] = dict(
            key=kj.key,
            queue=kj.queue_class,
            bytes=job.body_bytes,
            prompt_tokens=prompt_tokens,
            max_tokens=job.params.max_tokens,
            stream=job.stream,
            priority=job.priority,
            redelivered=kj.primary.redelivered,
            tenant=job.tenant,
        )
        if self.cfg.log_text:
            kw["prompt"] = job.prompt if job.prompt is not None else job.messages
        log.info("job_start", **kw)

    def _prepare_prompt(self, job: Any) -> list[int]:
        eng = self.engine
        name = getattr(eng, "model_name", None)
        served = self.served_model_name
        if (
            job.model is not None
            and name is not None
            and job.model not in (served, name, os.path.basename(str(name).rstrip("/")))
        ):
            raise RequestError(
                "unknown_model", f"model {job.model!r} is not served here; this worker serves {served!r}"
            )
        max_len = int(getattr(eng, "max_model_len", 1 << 30))
        tok = eng.tokenizer
        if job.messages is not None:
            try:
                if hasattr(tok, "encode_chat"):
                    # the template writes its own BOS: no post-processor specials
                    ids = list(tok.encode_chat(job.messages, add_generation_prompt=True))
                else:
                    ids = list(tok.encode(tok.apply_chat_template(job.messages, add_generation_prompt=True)))
            except RequestError:
                raise
            except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
                raise RequestError(
                    "invalid_request", f"messages could not be rendered with the chat template: {exc}"
                ) from None
        else:
            ids = list(tok.encode(job.prompt or ""))
        if not ids:
            raise RequestError("invalid_request", "the prompt is empty")
        if len(ids) + job.params.max_tokens > max_len:
            raise RequestError(
                "context_length_exceeded",
                f"this model's maximum context length is {max_len} tokens; the prompt has {len(ids)} tokens "
                f"and max_tokens is {job.params.max_tokens}",
            )
        return ids

    def _prepare_labels(self, job: Any, prompt_ids: list[int]) -> tuple[list[int], list[list[int]], Any]:
        """The prompt and each label's tokens in the job's label form, and the
        content-free request to calibrate against when the job asks for one
        (``jaxserve.tokenizer.labels``: labels tokenized with the text they
        follow, the chat form, few-shot turns)."""
        tok = self.engine.tokenizer
        request = label_prompts.LabelRequest(
            labels=tuple(job.labels),
            prompt=job.prompt,
            messages=None if job.messages is None else tuple(job.messages),
            form=job.label_prompt,
            few_shot=tuple(label_prompts.FewShot(t, lab) for t, lab in job.few_shot),
            first_token_only=job.label_normalization == "first",
        )
        try:
            tokens = label_prompts.prepare(tok, request)
            calibration = (
                label_prompts.prepare(tok, request.content_free(job.calibration_input)) if job.calibrate else None
            )
        except label_prompts.LabelPromptError as exc:
            raise RequestError("invalid_request", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
            raise RequestError(
                "invalid_request", f"the labels' prompt could not be rendered ({job.label_prompt}): {exc}"
            ) from None
        prompt_ids, out = tokens.prompt_ids, tokens.label_ids
        max_len = int(getattr(self.engine, "max_model_len", 1 << 30))
        longest = max(len(ids) for ids in out)
        if len(prompt_ids) + longest > max_len:
            raise RequestError(
                "context_length_exceeded",
                f"this model's maximum context length is {max_len} tokens; the prompt has {len(prompt_ids)} tokens "
                f"and the longest label {longest}",
            )
        return prompt_ids, out, calibration

    async def _submit_calibration(self, request_id: str, tokens: Any, request_class: Any, priority: int) -> None:
        assert self.engine_thread is not None
        await self.engine_thread.add_score_request(
            request_id, tokens.prompt_ids, tokens.label_ids, request_class=request_class, priority=priority
        )

    async def _calibrate(self, kj: KeyJob, tokens: Any) -> bool:
        """The job's content-free label scores (``self.label_calibrations``:
        computed once per label set, form and template); False when the job
        was answered (the engine refused the content-free input) or
        requeued (the engine is gone)."""
        rc = RequestClass.INTERACTIVE if kj.queue_class == INTERACTIVE else RequestClass.BATCH
        try:
            kj.label_calibration = await self.label_calibrations.get(tokens, rc, kj.job.engine_priority)
        except RequestError as err:
            if err.retryable:
                await self._requeue(kj, f"label calibration: {err.message}")
            else:
                await self._finish(
                    kj, Result.failure(kj.key, err.code, f"label calibration: {err.message}", err.retryable)
                )
            return False
        except Exception as exc:  # noqa: BLE001 - the engine thread is gone
            await self._requeue(kj, f"engine unavailable: {exc!r}")
            return False
        return True

    def _cache_key(
        self, job: Any, prompt_ids: list[int], label_ids: list[list[int]] | None, calibration: Any = None
    ) -> str:
        """What determines a deterministic job's result, hashed: the served
        model, the prompt's token ids and every parameter that shapes the
        output (not the key, the tenant or the priority)."""
        p = job.params
        what = {
            "model": self.served_model_name,
            "prompt": prompt_ids,
            "labels": label_ids,
            "normalization": job.label_normalization if label_ids is not None else None,
            **({"calibration": calibration.identity()} if calibration is not None else {}),
            "params": None
            if label_ids is not None
            else [
                p.max_tokens,
                p.temperature,
                p.top_p,
                p.top_k,
                p.min_p,
                p.seed if job.seed_given else None,
                p.repetition_penalty,
                p.frequency_penalty,
                p.presence_penalty,
                list(p.stop),
            ],
        }
        if label_ids is None and (p.structured is not None or p.logprobs):
            # a constraint changes the text, logprobs the result's fields
            s = p.structured
            what["output"] = [None if s is None else [s.kind, s.value], p.logprobs, p.top_logprobs]
        return hashlib.sha256(orjson.dumps(what)).hexdigest()[:40]

    async def _answer_from_record(self, kj: KeyJob, rec: Record) -> None:
        if rec.fingerprint is not None and rec.fingerprint != kj.job.fingerprint:
            self.stats["key_reused"] += 1
            await self._finish(kj, Result.failure(kj.key, "idempotency_key_reused", self._reused(kj.key).message))
            return
        self.stats["replayed"] += 1
        await self._finish(kj, Result.model_validate(rec.result), record=rec)

    # -------------------------------------------------------- engine side
    def _record_remote_step(self, stats: Any, outputs: list[RequestOutput]) -> None:
        """Metrics of a step that ran in the engine process (its scheduler's
        snapshot, when it has one, and its outputs)."""
        if self.metrics is None:
            return
        if stats is not None:
            self.metrics.record_stats(stats)
        self.metrics.record_outputs(outputs)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs (or the interactive ones the engine handed over
        early), interactive jobs first: their chunks are queued for sending
        before any batch job's result is."""
        mine = []
        for out in outputs:
            if self.label_calibrations.on_output(out):
                continue
            kj = self._by_rid.get(out.request_id)
            if kj is not None and kj.state is JobState.RUNNING:
                mine.append((kj, out))
        if len(mine) > 1:
            mine.sort(key=lambda pair: pair[0].queue_class != INTERACTIVE)  # stable: step order within a class
        for kj, out in mine:
            n_new = len(out.new_token_ids)
            if n_new and kj.first_token_mono is not None and self.metrics is not None:
                now = time.monotonic()
                self.metrics.observe_tokens(kj.queue_class, now - kj.last_token_mono, n_new)
                kj.last_token_mono = now
            if kj.job.stream:
                kj.pending_tokens += n_new
            if out.new_text:
                if kj.first_token_mono is None:
                    self._first_token(kj)
                kj.text_parts.append(out.new_text)
                if kj.job.stream:
                    kj.pending_text.append(out.new_text)
                    kj.outbox.set()
            elif out.new_token_ids and kj.first_token_mono is None:
                self._first_token(kj)
                if kj.job.stream:
                    # The first token goes out at once, even while its text
                    # is held back (part of a UTF-8 character, a piece that
                    # may merge with the next): the caller's time to first
                    # token is this chunk, not the first decodable text.
                    kj.pending_text.append("")
                    kj.outbox.set()
            if out.finished:
                kj.in_engine = False
                kj.engine_metrics = out.metrics
                result = self._final_from_output(kj, out)
                if result.error is not None and result.error.code == "internal" and result.error.retryable:
                    self._spawn(self._requeue(kj, f"engine: {result.error.message}"))
                else:
                    self._spawn(self._finish(kj, result))

    def _first_token(self, kj: KeyJob) -> None:
        """From its first token on, a job's deadline no longer applies and
        its prompt leaves the interactive admission budget."""
        kj.first_token_mono = kj.last_token_mono = time.monotonic()
        if kj.deadline_handle is not None:
            kj.deadline_handle.cancel()
        if kj.admission_held:
            kj.admission_held = False
            self.admission.release(kj.request_id)

    def _final_from_output(self, kj: KeyJob, out: RequestOutput) -> Result:
        if out.error is not None:
            return Result.failure(kj.key, out.error.code, out.error.message, out.error.retryable)
        reason = out.finish_reason
        if out.label_logprobs is not None and kj.job.labels is not None and kj.label_ids is not None:
            cal, norm = kj.label_calibration, kj.job.label_normalization
            offsets = None if cal is None else scoring.normalize(cal.logprobs, cal.token_counts, norm)
            scored = scoring.combine(
                kj.job.labels, out.label_logprobs, [len(ids) for ids in kj.label_ids], norm, offsets
            )
            labels = [{"label": s.label, "logprob": s.logprob, "prob": s.prob} for s in scored]
            return Result.success(
                kj.key,
                scoring.best(scored).label,
                "stop",
                out.prompt_tokens,
                0,
                self._timings(kj),
                labels=labels,
                model=self.served_model_name,
            )
        if reason in ("stop", "length"):
            text = out.text if (out.text or not kj.text_parts) else "".join(kj.text_parts)
            return Result.success(
                kj.key,
                text,
                reason,
                out.prompt_tokens,
                out.completion_tokens,
                self._timings(kj),
                model=self.served_model_name,
                **self._extras(kj, out, text),
            )
        if reason == "abort":
            return Result.failure(kj.key, "cancelled", "the job was aborted")
        return Result.failure(kj.key, "internal", f"the engine failed the request (finish_reason={reason!r})", True)

    def _extras(self, kj: KeyJob, out: RequestOutput, text: str) -> dict[str, Any]:
        """A result's logprobs (OpenAI's chat shape) and parsed JSON
        (``jaxserve.wire.outputs``), for the jobs that asked."""
        params, extras = kj.job.params, {}
        if params.logprobs and out.logprobs is not None:
            if self._token_bytes is None:
                self._token_bytes = outputs.token_bytes_for(self.engine.tokenizer)
            extras["logprobs"] = outputs.chat_logprobs(out.token_ids, out.logprobs, out.top_logprobs, self._token_bytes)
        kind = None if params.structured is None else params.structured.kind
        parsed = outputs.parsed_json(kind, text, out.finish_reason)
        if parsed is not None:
            extras["parsed"] = parsed
        return extras

    def _timings(self, kj: KeyJob) -> dict[str, float]:
        now = time.monotonic()
        t: dict[str, float] = {"total_s": round(now - kj.received_mono, 6)}
        if kj.admitted_mono is not None:
            t["admit_s"] = round(kj.admitted_mono - kj.received_mono, 6)
        if kj.first_token_mono is not None:
            t["ttft_s"] = round(kj.first_token_mono - kj.received_mono, 6)
        ts = _published_at(kj.primary.message)
        if ts is not None:
            t["queue_s"] = round(max(0.0, kj.received_at - ts), 6)
        return t

    def _on_step_error(self, exc: BaseException) -> None:
        """A step the engine could not pin on one request: its requests go
        back to the broker (they run again; a job that keeps causing this
        is dead-lettered by the delivery limit)."""
        self.stats["engine_step_errors"] += 1
        if self.metrics is not None:
            self.metrics.step_errors.labels(self.metrics.model_name).inc()
        log.error("engine_step_failed", error=repr(exc), running=len(self.active))
        for kj in list(self.active.values()):
            if kj.in_engine and kj.state is JobState.RUNNING:
                self._spawn(self._requeue(kj, f"engine step failed: {exc!r}"))

    def _on_engine_fatal(self, exc: BaseException) -> None:
        if self._fatal.is_set():
            return
        self.stats["engine_fatal"] += 1
        self.fatal_error = repr(exc)
        log.error("engine_fatal", error=repr(exc), held=len(self.active))
        self._fatal.set()

    def _on_deadline(self, kj: KeyJob) -> None:
        if (
            kj.first_token_mono is None
            and self.active.get(kj.key) is kj
            and kj.state in (*_ADMISSION, JobState.RUNNING)
        ):
            self._spawn(self._abort_with(kj, "expired", "the job's deadline passed while it waited"))

    async def _abort_with(self, kj: KeyJob, code: str, message: str) -> None:
        """End a job that has not finished with an error result."""
        if kj.state not in (*_ADMISSION, JobState.RUNNING):
            return
        result = Result.failure(kj.key, code, message)
        if kj.in_engine and self.engine_thread is not None:
            kj.in_engine = False
            try:
                await self.engine_thread.abort(kj.request_id)
            except Exception as exc:  # noqa: BLE001
                log.warning("engine_abort_failed", key=kj.key, error=repr(exc))
        await self._finish(kj, result)

    # ------------------------------------------------------------ replies
    async def _sender(self, kj: KeyJob) -> None:
        """Publish this job's chunks in order, coalescing deltas that pile
        up while a confirm is pending."""
        publisher = self._publisher_for(kj.queue_class)
        while True:
            await kj.outbox.wait()
            kj.outbox.clear()
            while kj.pending_text:
                text = "".join(kj.pending_text)
                kj.pending_text.clear()
                chunk = Chunk(id=kj.key, seq=kj.seq, text=text, run=kj.run, tokens=kj.pending_tokens)
                kj.pending_tokens = 0
                kj.seq += 1
                outcome = await publisher.publish(
                    kj.primary.reply_to,
                    chunk.to_bytes(),
                    correlation_id=kj.primary.correlation_id,
                    message_id=None,
                    timeout_s=self.cfg.chunk_timeout_s,
                )
                self.stats["chunks"] += 1
                if outcome.undeliverable and kj.primary.reply_to != self.topo.results and not kj.client_gone:
                    # The requester's reply queue is gone: stop generating.
                    kj.client_gone = True
                    self._spawn(self._abort_with(kj, "cancelled", "the reply queue disappeared (client gone)"))
            if kj.state is not JobState.RUNNING:
                return

    async def _finish(self, kj: KeyJob, result: Result, record: Record | None = None) -> None:
        """Store a fresh ok result, then answer every delivery of the key
        (those that arrive meanwhile too) and settle each once."""
        if kj.state not in (*_ADMISSION, JobState.RUNNING):
            return
        kj.to(JobState.FINISHING)
        trace = self._traces.get(kj.request_id)
        if trace is not None:
            trace.result_ready(kj.primary.reply_to)
            result = result.model_copy(update={"trace_id": trace.trace_id})
        kj.result = result
        if kj.deadline_handle is not None:
            kj.deadline_handle.cancel()
        if kj.sender is not None:  # every chunk goes out before the final
            kj.outbox.set()
            try:
                await kj.sender
            except asyncio.CancelledError:
                pass
        used = result.usage.prompt_tokens + result.usage.completion_tokens if result.usage is not None else 0
        await self._release_limits(kj, used)
        try:
            delivered = set(record.delivered) if record is not None else set()
            if result.ok and record is None:
                await self._store(kj, self.store.put, kj.key, Record(result.to_dict(), [], kj.job.fingerprint))
                if kj.cache_key is not None and not result.cached:
                    await self._best_effort("cache_put", self.store.cache_put, kj.cache_key, result.to_dict())
            elif not result.ok and kj.claimed:
                await self._best_effort("release", self.store.release, kj.key, self.cfg.worker_id)
        except _Abandoned:
            return
        replies: collections.Counter = collections.Counter()
        while (d := kj.next_unsettled()) is not None:
            if kj.state is not JobState.FINISHING:
                return
            if result.ok and d.redelivered and d.dest in delivered:
                await d.settle(Settlement.ACK)  # this very message was answered already (its ack was lost)
                replies["already"] += 1
                continue
            if d is kj.primary and kj.client_gone:
                outcome = PublishOutcome.UNROUTABLE
            else:
                replayed = result.ok and (record is not None or d is not kj.primary)
                outcome = await self._publish_final(
                    d, result.model_copy(update={"replayed": True}) if replayed else result
                )
            replies[outcome.value] += 1
            if d.settled is not None:  # requeued by a drain while we published
                continue
            if outcome is PublishOutcome.CONFIRMED:
                if result.ok:
                    delivered.add(d.dest)
                    await self._best_effort("mark_delivered", self.store.mark_delivered, kj.key, d.dest)
                await d.settle(Settlement.ACK)
            elif outcome.undeliverable:
                self.stats["reply_undeliverable"] += 1
                await d.settle(Settlement.ACK)  # nobody can take it; a resubmission is answered from the store
            else:
                await d.settle(Settlement.REQUEUE)  # answered from the store on redelivery
        if kj.state is not JobState.FINISHING:
            return
        kj.to(JobState.SETTLED)
        self._forget(kj)
        self._log_done(kj, result, record is not None, replies)

    def _log_done(self, kj: KeyJob, result: Result, replayed: bool, replies: collections.Counter) -> None:
        outcome = "ok" if result.ok else result.error.code  # type: ignore[union-attr]
        if not replayed:
            self.stats["done_" + result.status] += 1
        self._count_job(kj.queue_class, "replayed" if replayed else outcome)
        kw: dict[str, Any] = dict(key=kj.key, queue=kj.queue_class, status=result.status, replies=dict(replies))
        if replayed:
            log.info("job_replayed", deliveries=len(kj.deliveries), **kw)
            return
        if self.metrics is not None and result.ok:
            # latencies of answered jobs only: a refused or cancelled job's
            # short "latency" would pull the quantiles down exactly when the
            # worker is overloaded (jaxserve_jobs_total counts every outcome)
            ts = _published_at(kj.primary.message)
            self.metrics.observe_job(
                kj.queue_class,
                e2e=time.monotonic() - kj.received_mono,
                ttft=None if kj.first_token_mono is None else kj.first_token_mono - kj.received_mono,
                broker_wait=None if ts is None else max(0.0, kj.received_at - ts),
                engine=kj.engine_metrics,
            )
        if result.ok:
            assert result.usage is not None
            kw.update(
                result.usage.model_dump(), finish_reason=result.finish_reason, **(result.timings or {}), chunks=kj.seq
            )
            if self.cfg.log_text:
                kw["text"] = result.text
        else:
            kw.update(code=outcome)
        log.info("job_done", **kw)

    async def _requeue(self, kj: KeyJob, reason: str) -> None:
        """Give the job back to the broker: every unsettled delivery is
        nacked with requeue (drain, lost lease, retryable failure)."""
        if kj.terminal:
            return
        kj.to(JobState.REQUEUED)
        self._forget(kj)
        if kj.deadline_handle is not None:
            kj.deadline_handle.cancel()
        if kj.sender is not None:
            kj.sender.cancel()
        if kj.in_engine and self.engine_thread is not None:
            kj.in_engine = False
            try:
                await self.engine_thread.abort(kj.request_id)
            except Exception:  # noqa: BLE001 - a dead engine holds nothing
                pass
        for d in kj.unsettled():
            await d.settle(Settlement.REQUEUE)
        await self._release_limits(kj, used_tokens=0)
        if kj.claimed:
            await self._best_effort("release", self.store.release, kj.key, self.cfg.worker_id)
        self.stats["requeued"] += 1
        self._count_job(kj.queue_class, "requeued")
        if self.metrics is not None:  # bounded: drain, engine, lease, worker
            kind = reason.split(":")[0].split()[0].lower()
            self.metrics.requeues.labels(self.metrics.model_name, kj.queue_class, kind).inc()
        log.info("job_requeued", key=kj.key, queue=kj.queue_class, reason=reason, deliveries=len(kj.deliveries))

    # ------------------------------------------------------------ control
    async def _on_control(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        if amqp_compat.undecodable_properties(message):
            log.warning("control_message_invalid", error="properties do not decode")
            return
        try:
            key = decode_cancel(message.body).id
        except WireDecodeError as exc:
            log.warning("control_message_invalid", error=str(exc))
            return
        self.stats["cancel_received"] += 1
        # Locally first: a store outage must not delay or lose the cancel.
        self._remember_cancel(key)
        kj = self.active.get(key)
        log.info("cancel_received", key=key, running_here=kj is not None)
        if kj is not None:
            self._spawn(self._abort_with(kj, "cancelled", "the job was cancelled"))
        await self._best_effort("mark_cancelled", self.store.mark_cancelled, key, self.cfg.cancel_ttl_s)

    async def _renew_loop(self) -> None:
        """Keep the claims of running jobs alive; a claim found taken by
        another worker means that worker runs the key now: give ours back."""
        period = max(0.2, self.cfg.claim_lease_s / 3)
        while True:
            await asyncio.sleep(period)
            for kj in list(self.active.values()):
                if not kj.claimed or kj.state is not JobState.RUNNING or not self.store_health.up:
                    continue
                try:
                    if await self.store.renew(kj.key, self.cfg.worker_id, self.cfg.claim_lease_s):
                        continue
                    owner = await self.store.claim(kj.key, self.cfg.worker_id, self.cfg.claim_lease_s)
                except StoreUnavailable as exc:
                    self.store_health.failed(exc)
                    log.warning("claim_renew_failed", key=kj.key, error=str(exc))
                    continue
                if owner is not None and kj.state is JobState.RUNNING:
                    self.stats["lease_lost"] += 1
                    log.warning("claim_lost", key=kj.key, owner=owner)
                    kj.claimed = False
                    await self._requeue(kj, f"lease lost to {owner}")

    async def _queue_depth_loop(self, period_s: float = 5.0) -> None:
        """The broker's view for the metrics: ready messages and consumers of
        the job queues, the dead letters and the results queue."""
        names = {
            "interactive": self.topo.interactive,
            "batch": self.topo.batch,
            "dead": self.topo.dead,
            "results": self.topo.results,
        }
        while True:
            conn = self._conns.get("control")
            if conn is not None and not conn.is_closed and self.metrics is not None:
                for label, name in names.items():
                    try:
                        ch = await conn.channel()
                        try:
                            res = (await ch.declare_queue(name, passive=True)).declaration_result
                            # a declare-ok always carries both counts
                            self.metrics.queue_depth.labels(self.metrics.model_name, label).set(
                                cast(int, res.message_count)
                            )
                            self.metrics.queue_consumers.labels(self.metrics.model_name, label).set(
                                cast(int, res.consumer_count)
                            )
                        finally:
                            if not ch.is_closed:
                                await ch.close()
                    except Exception:  # noqa: BLE001 - a missing queue or a reconnect: next time
                        pass
            await asyncio.sleep(period_s)

    async def _pace_batch(self) -> None:
        """A worker saturated with interactive work stops taking batch
        deliveries (its batch consumer pauses) instead of holding them, and
        takes them again once the pressure is below half the threshold."""
        pressure = self.admission.pressure
        limit = self.cfg.admission.pause_batch_at
        q = self._queues.get(BATCH)
        if q is None or self._closing or self._draining or self._store_paused:
            return
        async with self._consumers_lock:
            if self._store_paused:  # the store went down meanwhile: it resumes batch itself
                return
            try:
                if not self._batch_paused and pressure > limit and BATCH in self._consumer_tags:
                    await q.cancel(self._consumer_tags.pop(BATCH))
                    self._batch_paused = True
                    self.stats["batch_paused"] += 1
                    log.info("batch_consumer_paused", interactive_pressure=round(pressure, 2))
                elif self._batch_paused and pressure < limit / 2:
                    self._consumer_tags[BATCH] = await q.consume(self._make_job_cb(BATCH), no_ack=False)
                    self._batch_paused = False
                    log.info("batch_consumer_resumed", interactive_pressure=round(pressure, 2))
            except Exception as exc:  # noqa: BLE001 - a reconnect re-consumes anyway
                log.warning("batch_pacing_failed", error=repr(exc))

    # ------------------------------------------------------------ health
    def _readiness(self) -> tuple[bool, str]:
        """``/readyz`` (read from the metrics server's thread: reads only)."""
        if self._closing or self._fatal.is_set():
            return False, "stopping"
        if not self.ready.is_set():
            return False, "warming up"
        if not self.store_health.up:
            return False, f"store unavailable ({self.store_health.error})"
        if INTERACTIVE not in self._consumer_tags or (BATCH not in self._consumer_tags and not self._batch_paused):
            return False, "not consuming"
        return True, "consuming"

    def _liveness(self) -> tuple[bool, str]:
        """``/healthz``: false once the engine is dead or hung, or the event
        loop has not run the watchdog for 30 s."""
        et = self.engine_thread
        if self._fatal.is_set():
            return False, f"engine failed: {self.fatal_error}"
        if et is None:
            return True, "starting"
        if not et.alive:
            return False, "the engine died (its thread or process is gone)"
        now = time.monotonic()
        since = et.busy_since_mono
        if self.ready.is_set() and since is not None and now - since > self.cfg.engine_hang_timeout_s:
            return False, f"the engine has been busy in one call for {now - since:.0f}s"
        if self.ready.is_set() and now - self._loop_tick > 30.0:
            return False, f"the event loop has been stalled for {now - self._loop_tick:.0f}s"
        return True, "alive"

    async def _watchdog_loop(self) -> None:
        """An engine thread that died or is stuck in one step is fatal."""
        et = self.engine_thread
        assert et is not None
        while True:
            await asyncio.sleep(1.0)
            self._loop_tick = time.monotonic()
            computed = getattr(self.engine, "num_computed_tokens", None)
            if isinstance(computed, int):
                self.admission.observe(computed, et.busy_s)
            await self._pace_batch()
            if not et.alive:
                self._on_engine_fatal(RuntimeError("the engine died (its thread or process is gone)"))
                return
            since = et.busy_since_mono
            if since is not None and time.monotonic() - since > self.cfg.engine_hang_timeout_s:
                self._on_engine_fatal(
                    RuntimeError(f"the engine has been busy in one call for over {self.cfg.engine_hang_timeout_s:g}s")
                )
                return
