"""The worker's AMQP side: its connections, channels and consumers, and the
three reasons a job consumer stops taking deliveries.

Each job consumer (interactive, batch) has a connection and channel of its
own with a prefetch tied to the engine's capacity (the prefetch is the
backpressure); cancels arrive on a control connection and replies leave on
two publishing connections (interactive replies never wait behind batch
confirms), so no consumer shares another's fate.

A consumer pauses while the store is unreachable (a job taken then would
only be held; ``tests/test_queue_store_outage.py``), for drain, and batch
alone while interactive pressure is high (``pace_batch``, which
``jaxserve.worker.pacing`` calls once a second). One lock orders every
consume and cancel, so whatever changed last wins.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Any, cast

import aio_pika
import structlog
from yarl import URL

from jaxserve.metrics import EngineMetrics
from jaxserve.wire import BATCH, INTERACTIVE
from jaxserve.wire.topology import declare_topology
from jaxserve.worker.config import WorkerConfig
from jaxserve.worker.fallback import model_routes
from jaxserve.worker.replies import ReplyPublisher
from jaxserve.worker.routing import ModelRoutes, declare_model_routes
from jaxserve.worker.store_health import StoreHealth
from jaxserve.worker.worker_state import WorkerStateView

log = structlog.get_logger("jaxserve.worker")

OnMessage = Callable[[aio_pika.abc.AbstractIncomingMessage], Awaitable[None]]


class Connections:
    """Connections, consumers and their pausing for one worker; the two
    reply publishers; and the routes it consumes (set by :meth:`connect`).

    ``state``: the worker's (no consumer resumes while it drains or
    closes); ``store_health``: consumers pause while the store is down;
    ``on_job(message, queue class)`` takes a job delivery,
    ``on_control(message)`` a control message."""

    def __init__(
        self,
        cfg: WorkerConfig,
        stats: collections.Counter,
        state: WorkerStateView,
        store_health: StoreHealth,
        on_job: Callable[[Any, str], None],
        on_control: OnMessage,
    ) -> None:
        self.cfg = cfg
        self.topo = cfg.topology
        self.stats = stats
        self.state = state
        self.store_health = store_health
        self._on_job = on_job  # (message, queue class): takes the delivery
        self._on_control = on_control
        self.conns: dict[str, aio_pika.abc.AbstractRobustConnection] = {}
        self.channels: dict[str, aio_pika.abc.AbstractRobustChannel] = {}
        self.queues: dict[str, aio_pika.abc.AbstractRobustQueue] = {}
        self.consumer_tags: dict[str, str] = {}
        self.lock = asyncio.Lock()
        self.store_paused = False
        self.batch_paused = False
        self.publisher: ReplyPublisher | None = None  # batch replies (and the default)
        self.interactive_publisher: ReplyPublisher | None = None
        self.routes: ModelRoutes | None = None  # what it serves by model (worker.fallback), once connected
        self.metrics: EngineMetrics | None = None  # reconnects and queue depths, once connected

    def job_queue(self, queue_class: str) -> str:
        """The queue this worker consumes for ``queue_class``: its model's
        own when it routes by model and is not the default model."""
        return self.topo.queue_for(queue_class) if self.routes is None else self.routes.queue(queue_class)

    def control_connection(self) -> Any:
        """The control connection while it is open (a fallback's queue is
        looked up and a job re-routed over it), else None."""
        conn = self.conns.get("control")
        return None if conn is None or conn.is_closed else conn

    def url(self) -> URL:
        return URL(self.cfg.amqp_url).update_query(heartbeat=str(int(self.cfg.heartbeat)))

    def _job_cb(self, queue_class: str) -> OnMessage:
        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            # aiormq cancels this callback's task if the channel closes, so
            # the job lives in a task of its own (Worker.take).
            self._on_job(message, queue_class)

        return on_message

    async def _open(self, name: str) -> aio_pika.abc.AbstractRobustConnection:
        conn = await aio_pika.connect_robust(
            self.url(),
            reconnect_interval=self.cfg.reconnect_interval,
            client_properties={"connection_name": f"jaxserve-worker-{name} {self.cfg.worker_id}"},
        )
        conn.reconnect_callbacks.add(self._reconnect_cb(name))
        conn.close_callbacks.add(self._close_cb(name))
        self.conns[name] = conn
        return conn

    async def _publisher(self, name: str) -> ReplyPublisher:
        publisher = ReplyPublisher(
            self.url(), name=name, reconnect_interval=self.cfg.reconnect_interval, stats=self.stats
        )
        conn = await publisher.start()
        conn.reconnect_callbacks.add(self._reconnect_cb("publish"))
        conn.close_callbacks.add(self._close_cb("publish"))
        return publisher

    async def connect(self, prefetch: dict[str, int], served_model_name: str | None, metrics: EngineMetrics) -> None:
        """Publishers, then control (so a cancel for a job about to be taken
        is seen), then the two job consumers with their ``prefetch``."""
        self.metrics = metrics
        self.publisher = await self._publisher(self.cfg.worker_id)
        self.interactive_publisher = await self._publisher(f"{self.cfg.worker_id} interactive")
        control = await self._open("control")
        keep = self.channels.__setitem__
        if self.cfg.declare:
            await declare_topology(control, self.topo)
            # reads (or takes) the default model's claim
            self.routes = await model_routes(self.cfg, served_model_name, control, keep)
            if self.routes is not None:  # this model's queues and names on the models exchange
                await declare_model_routes(control, self.routes)
        else:
            self.routes = await model_routes(self.cfg, served_model_name)
        ctl = await control.channel()
        self.channels["control"] = ctl
        ctl_ex = await ctl.declare_exchange(self.topo.control, aio_pika.ExchangeType.FANOUT, durable=True)
        ctl_q = await ctl.declare_queue("", exclusive=True, auto_delete=True)
        await ctl_q.bind(ctl_ex)
        self.queues["control"] = ctl_q
        self.consumer_tags["control"] = await ctl_q.consume(self._on_control, no_ack=True)
        for qc in (INTERACTIVE, BATCH):
            conn = await self._open(qc)
            ch = await conn.channel()
            await ch.set_qos(prefetch_count=prefetch[qc])
            self.channels[qc] = ch
            q = await ch.declare_queue(self.job_queue(qc), durable=True, arguments=self.topo.job_queue_arguments(qc))
            self.queues[qc] = q
            async with self.lock:
                if self.store_health.up:
                    self.consumer_tags[qc] = await q.consume(self._job_cb(qc), no_ack=False)
                else:
                    self.store_paused = True  # consumed once the store answers
        log.info(
            "worker_consuming",
            worker_id=self.cfg.worker_id,
            interactive=self.job_queue(INTERACTIVE),
            batch=self.job_queue(BATCH),
            models=None if self.routes is None else list(self.routes.names),
            default_model=None if self.routes is None else self.routes.default_model,
            prefetch=prefetch,
            heartbeat=self.cfg.heartbeat,
        )

    def _reconnect_cb(self, name: str) -> Callable:
        def cb(*_: Any) -> None:
            self.stats[f"reconnect_{name}"] += 1
            metrics = self.metrics
            if metrics is not None:
                metrics.reconnects.labels(metrics.model_name, name).inc()
            log.info("amqp_reconnected", connection=name)  # the loss was the warning

        return cb

    def _close_cb(self, name: str) -> Callable:
        def cb(_conn: Any, exc: Any = None) -> None:
            if not self.state.closing:
                self.stats[f"connection_lost_{name}"] += 1
                log.warning("amqp_connection_lost", connection=name, error=str(exc) if exc else None)

        return cb

    @property
    def consuming(self) -> bool:
        """Both job consumers consume (batch may be paused by pacing)."""
        tags = self.consumer_tags
        return INTERACTIVE in tags and (BATCH in tags or self.batch_paused)

    async def stop_consuming(self) -> None:
        async with self.lock:
            await self._cancel_consumers()

    async def _cancel_consumers(self) -> None:
        for qc in (INTERACTIVE, BATCH):
            q, tag = self.queues.get(qc), self.consumer_tags.pop(qc, None)
            if q is not None and tag is not None:
                try:
                    await q.cancel(tag)
                except Exception as exc:  # noqa: BLE001 - a dead channel consumes nothing anyway
                    log.warning("cancel_consumer_failed", queue=qc, error=str(exc))

    async def close(self) -> None:
        for publisher in (self.publisher, self.interactive_publisher):
            if publisher is not None:
                await publisher.close()
        for conn in self.conns.values():
            if not conn.is_closed:
                try:
                    await conn.close()
                except Exception:  # noqa: BLE001
                    pass

    async def on_store_change(self, up: bool) -> None:
        """The store went down: both job consumers pause (a job taken now
        would only be held); it answers again: they resume (batch unless
        :meth:`pace_batch` holds it). Whatever changed last wins."""
        async with self.lock:
            if up != self.store_health.up or self.state.draining or self.state.closing:
                return
            if not up and not self.store_paused:
                self.store_paused = True
                await self._cancel_consumers()
                log.info("job_consumers_paused", reason="store unavailable")
            elif up and self.store_paused:
                while self.store_health.up and not (self.state.draining or self.state.closing):
                    try:
                        for qc in (INTERACTIVE, BATCH):
                            q = self.queues.get(qc)
                            if (
                                q is not None
                                and qc not in self.consumer_tags
                                and not (qc == BATCH and self.batch_paused)
                            ):
                                self.consumer_tags[qc] = await q.consume(self._job_cb(qc), no_ack=False)
                        self.store_paused = False
                        log.info("job_consumers_resumed", reason="store available")
                        return
                    except Exception as exc:  # noqa: BLE001 - a channel being restored: try again
                        log.warning("job_consumers_resume_failed", error=repr(exc))
                        await asyncio.sleep(1.0)

    async def pace_batch(self, pressure: float) -> None:
        """A worker saturated with interactive work stops taking batch
        deliveries (its batch consumer pauses) instead of holding them, and
        takes them again once the ``pressure`` (``InteractiveAdmission.pressure``)
        is below half the threshold (``jaxserve.worker.pacing``)."""
        limit = self.cfg.admission.pause_batch_at
        q = self.queues.get(BATCH)
        if q is None or self.state.closing or self.state.draining or self.store_paused:
            return
        async with self.lock:
            if self.store_paused:  # the store went down meanwhile: it resumes batch itself
                return
            try:
                if not self.batch_paused and pressure > limit and BATCH in self.consumer_tags:
                    await q.cancel(self.consumer_tags.pop(BATCH))
                    self.batch_paused = True
                    self.stats["batch_paused"] += 1
                    log.info("batch_consumer_paused", interactive_pressure=round(pressure, 2))
                elif self.batch_paused and pressure < limit / 2:
                    self.consumer_tags[BATCH] = await q.consume(self._job_cb(BATCH), no_ack=False)
                    self.batch_paused = False
                    log.info("batch_consumer_resumed", interactive_pressure=round(pressure, 2))
            except Exception as exc:  # noqa: BLE001 - a reconnect re-consumes anyway
                log.warning("batch_pacing_failed", error=repr(exc))

    async def queue_depth_loop(self, period_s: float = 5.0) -> None:
        """The broker's view for the metrics: ready messages and consumers of
        the job queues, the dead letters and the results queue."""
        names = {
            "interactive": self.job_queue(INTERACTIVE),
            "batch": self.job_queue(BATCH),
            "dead": self.topo.dead,
            "results": self.topo.results,
        }
        while True:
            conn = self.conns.get("control")
            metrics = self.metrics
            if conn is not None and not conn.is_closed and metrics is not None:
                for label, name in names.items():
                    try:
                        ch = await conn.channel()
                        try:
                            counts = (await ch.declare_queue(name, passive=True)).declaration_result
                            # a declare-ok always carries both counts
                            metrics.queue_depth.labels(metrics.model_name, label).set(cast(int, counts.message_count))
                            metrics.queue_consumers.labels(metrics.model_name, label).set(
                                cast(int, counts.consumer_count)
                            )
                        finally:
                            if not ch.is_closed:
                                await ch.close()
                    except Exception:  # noqa: BLE001 - a missing queue or a reconnect: next time
                        pass
            await asyncio.sleep(period_s)
