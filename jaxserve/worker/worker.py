"""The queue worker: RabbitMQ on asyncio, the engine on its own thread.

Life of a job (see docs/protocol.md for the wire contract):

1. A delivery arrives on the interactive or batch consumer. Each consumer has
   its own channel and a prefetch tied to the engine's capacity: the prefetch
   is the backpressure (batch never gets the interactive reserve).
2. It is parsed and validated; a bad job gets its error reply and is acked.
3. It is fenced by key: a key already running here attaches the delivery as a
   waiter; a key with a stored final result is replayed; a key claimed by
   another worker (Redis store) is held until that worker finishes or its
   lease runs out.
4. The engine thread runs it; text deltas are coalesced into ordered chunks
   by a per-job sender; the final result is published with publisher
   confirms, stored, and only then the delivery is acked on its own channel
   (if that channel died meanwhile, it is not acked: the broker redelivers
   and the redelivery is answered from the store without running again).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import time
import uuid
from typing import Any, Callable

import aio_pika
import aiormq.exceptions
import structlog
from yarl import URL

from jaxserve.engine.types import RequestClass, RequestError, RequestOutput
from jaxserve.metrics import EngineMetrics
from jaxserve.metrics import serve as serve_metrics
from jaxserve.worker import protocol
from jaxserve.worker.engine_thread import EngineThread
from jaxserve.worker.idempotency import MemoryStore
from jaxserve.worker.topology import BATCH, DEFAULT_AMQP_URL, INTERACTIVE, Topology, declare_topology

log = structlog.get_logger("jaxserve.worker")

QUORUM_MAX_PREFETCH = 2000

_CONNECTION_ERRORS = (
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelClosed,
    ConnectionError,
    asyncio.TimeoutError,
    RuntimeError,
)


@dataclasses.dataclass
class WorkerConfig:
    amqp_url: str = DEFAULT_AMQP_URL
    topology: Topology = dataclasses.field(default_factory=Topology)
    heartbeat: int = 30
    reconnect_interval: float = 1.0
    interactive_prefetch: int | None = None  # default: engine.max_num_seqs
    batch_prefetch: int | None = None  # default: max_num_seqs - interactive_reserved_seqs
    drain_timeout: float = 30.0
    max_body_bytes: int = protocol.DEFAULT_MAX_BODY_BYTES
    claim_lease_s: float = 30.0
    claim_poll_s: float = 0.5
    cancel_ttl_s: float = 600.0
    log_text: bool = False
    declare: bool = True
    metrics_port: int | None = None  # serve Prometheus /metrics here when set
    worker_id: str = dataclasses.field(default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}")


@dataclasses.dataclass
class Delivery:
    message: aio_pika.abc.AbstractIncomingMessage
    reply_to: str
    correlation_id: str | None

    @property
    def dest(self) -> str:
        return f"{self.reply_to}|{self.correlation_id or ''}"


class ActiveJob:
    """One key being served by this worker."""

    def __init__(self, key: str, delivery: Delivery, queue_class: str, received_at: float) -> None:
        self.key = key
        self.primary = delivery
        self.waiters: list[Delivery] = []
        self.queue_class = queue_class
        self.job: protocol.Job | None = None
        self.run = uuid.uuid4().hex[:12]
        self.received_at = received_at
        self.received_mono = time.monotonic()
        self.admitted_mono: float | None = None
        self.first_token_mono: float | None = None
        self.in_engine = False
        self.seq = 0
        self.pending_text: list[str] = []
        self.text_parts: list[str] = []
        self.outbox_event = asyncio.Event()
        self.final: dict[str, Any] | None = None
        self.done = asyncio.Event()
        self.sender: asyncio.Task | None = None
        self.deadline_handle: asyncio.TimerHandle | None = None
        self.requeue = False
        self.client_gone = False
        self.stop_outputs = False


def _published_at(message: aio_pika.abc.AbstractIncomingMessage) -> float | None:
    """When the producer published: header ``x-published-at-ms`` (epoch
    milliseconds, integer), else the AMQP ``timestamp`` (whole seconds)."""
    hdr = (message.headers or {}).get("x-published-at-ms")
    try:
        if hdr is not None:
            return int(hdr) / 1000.0
        if message.timestamp is not None:
            return message.timestamp.timestamp()
    except (TypeError, ValueError, OverflowError, AttributeError):
        pass
    return None


class Worker:
    def __init__(
        self,
        engine_factory: Callable[[], Any],
        config: WorkerConfig | None = None,
        store: Any = None,
    ) -> None:
        self.engine_factory = engine_factory
        self.cfg = config or WorkerConfig()
        self.topo = self.cfg.topology
        self.store = store if store is not None else MemoryStore()
        self.engine: Any = None
        self.engine_thread: EngineThread | None = None
        self.active: dict[str, ActiveJob] = {}
        self._tasks: set[asyncio.Task] = set()
        self._consume_conn: aio_pika.abc.AbstractRobustConnection | None = None
        self._publish_conn: aio_pika.abc.AbstractRobustConnection | None = None
        self._channels: dict[str, aio_pika.abc.AbstractRobustChannel] = {}
        self._queues: dict[str, aio_pika.abc.AbstractRobustQueue] = {}
        self._consumer_tags: dict[str, str] = {}
        self._pub_channel: aio_pika.abc.AbstractRobustChannel | None = None
        self._closing = False
        self.ready = asyncio.Event()
        self.stats: collections.Counter = collections.Counter()
        self.prefetch: dict[str, int] = {}
        self.metrics: EngineMetrics | None = None

    # ------------------------------------------------------------------ life
    def _url(self) -> URL:
        url = URL(self.cfg.amqp_url)
        return url.update_query(heartbeat=str(int(self.cfg.heartbeat)))

    async def start(self) -> None:
        """Build and compile the engine, connect, declare, then consume."""
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        self.engine = await asyncio.to_thread(self.engine_factory)
        self.metrics = EngineMetrics(str(getattr(self.engine, "model_name", "")))
        if self.cfg.metrics_port is not None:
            serve_metrics(self.metrics, self.cfg.metrics_port)
        record = self.metrics.record_step if hasattr(self.engine, "scheduler") else None
        self.engine_thread = EngineThread(
            self.engine, loop, self._on_outputs, self._on_step_error, on_step=record
        )
        self.engine_thread.start()
        # Compile every shape bucket before taking any job (no AMQP yet, so
        # nothing can miss a heartbeat while compilation holds the GIL).
        await self.engine_thread.warmup()
        log.info("engine_ready", model=getattr(self.engine, "model_name", None), warmup_s=round(time.monotonic() - t0, 3))

        max_seqs = int(getattr(self.engine, "max_num_seqs", 8))
        reserved = int(getattr(self.engine, "interactive_reserved_seqs", 0))
        reserved = min(max(reserved, 0), max(max_seqs - 1, 0))
        self.prefetch = {
            INTERACTIVE: min(QUORUM_MAX_PREFETCH, self.cfg.interactive_prefetch or max_seqs),
            BATCH: min(QUORUM_MAX_PREFETCH, self.cfg.batch_prefetch or max(1, max_seqs - reserved)),
        }

        url = self._url()
        kw = {"reconnect_interval": self.cfg.reconnect_interval, "client_properties": {"connection_name": f"jaxserve-worker-consume {self.cfg.worker_id}"}}
        self._consume_conn = await aio_pika.connect_robust(url, **kw)
        kw["client_properties"] = {"connection_name": f"jaxserve-worker-publish {self.cfg.worker_id}"}
        self._publish_conn = await aio_pika.connect_robust(url, **kw)
        for conn, name in ((self._consume_conn, "consume"), (self._publish_conn, "publish")):
            conn.reconnect_callbacks.add(self._make_reconnect_cb(name))
            conn.close_callbacks.add(self._make_close_cb(name))
        if self.cfg.declare:
            await declare_topology(self._consume_conn, self.topo)
        self._pub_channel = await self._publish_conn.channel(publisher_confirms=True, on_return_raises=True)

        # Control first, so a cancel for a job we are about to take is seen.
        ctl = await self._consume_conn.channel()
        self._channels["control"] = ctl
        ctl_ex = await ctl.declare_exchange(self.topo.control, aio_pika.ExchangeType.FANOUT, durable=True)
        ctl_q = await ctl.declare_queue("", exclusive=True, auto_delete=True)
        await ctl_q.bind(ctl_ex)
        self._queues["control"] = ctl_q
        self._consumer_tags["control"] = await ctl_q.consume(self._on_control, no_ack=True)

        for qc in (INTERACTIVE, BATCH):
            ch = await self._consume_conn.channel()
            await ch.set_qos(prefetch_count=self.prefetch[qc])
            self._channels[qc] = ch
            name = self.topo.queue_for(qc)
            q = await ch.declare_queue(name, durable=True, arguments=self.topo.job_queue_arguments(qc))
            self._queues[qc] = q
            self._consumer_tags[qc] = await q.consume(self._make_job_cb(qc), no_ack=False)
        log.info(
            "worker_consuming",
            worker_id=self.cfg.worker_id,
            interactive=self.topo.interactive,
            batch=self.topo.batch,
            prefetch=self.prefetch,
            heartbeat=self.cfg.heartbeat,
        )
        self._spawn(self._renew_loop())
        self.ready.set()

    def _make_reconnect_cb(self, name: str) -> Callable:
        def cb(*_: Any) -> None:
            self.stats[f"reconnect_{name}"] += 1
            log.warning("amqp_reconnected", connection=name)

        return cb

    def _make_close_cb(self, name: str) -> Callable:
        def cb(_conn: Any, exc: Any = None) -> None:
            if not self._closing:
                self.stats[f"connection_lost_{name}"] += 1
                log.warning("amqp_connection_lost", connection=name, error=str(exc) if exc else None)

        return cb

    async def run(self, stop: asyncio.Event) -> None:
        """Start, serve until ``stop`` is set, then drain and close."""
        await self.start()
        await stop.wait()
        await self.shutdown()

    async def stop_consuming(self) -> None:
        for qc in (INTERACTIVE, BATCH):
            q, tag = self._queues.get(qc), self._consumer_tags.pop(qc, None)
            if q is not None and tag is not None:
                try:
                    await q.cancel(tag)
                except _CONNECTION_ERRORS as exc:
                    log.warning("cancel_consumer_failed", queue=qc, error=str(exc))

    async def shutdown(self, drain_timeout: float | None = None) -> None:
        """Drain: stop consuming, let in-flight jobs finish within the
        deadline, requeue the rest, close everything."""
        timeout = self.cfg.drain_timeout if drain_timeout is None else drain_timeout
        log.info("worker_draining", in_flight=len(self.active), timeout_s=timeout)
        await self.stop_consuming()
        t_end = time.monotonic() + timeout
        while self.active and time.monotonic() < t_end:
            await asyncio.sleep(0.05)
        leftover = list(self.active.values())
        for aj in leftover:
            await self._requeue_job(aj)
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        for conn in (self._consume_conn, self._publish_conn):
            if conn is not None and not conn.is_closed:
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
        log.info("worker_stopped", requeued=len(leftover), stats=dict(self.stats))

    # ------------------------------------------------------------- helpers
    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("worker_task_failed", error=repr(task.exception()), exc_info=task.exception())

    async def _settle(self, message: aio_pika.abc.AbstractIncomingMessage, *, requeue: bool | None = None) -> bool:
        """Ack (requeue None) or nack on the delivery's own channel. If that
        channel is gone, do nothing: the broker has requeued it already."""
        try:
            if requeue is None:
                await message.ack()
                self.stats["acked"] += 1
            else:
                await message.nack(requeue=requeue)
                self.stats["nacked"] += 1
            return True
        except (aiormq.exceptions.ChannelInvalidStateError, aiormq.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
            self.stats["settle_skipped"] += 1
            log.warning("settle_skipped_channel_closed", message_id=message.message_id, error=type(exc).__name__)
            return False

    async def _publish(self, routing_key: str, payload: dict[str, Any], *, correlation_id: str | None, message_id: str | None, deadline: float | None = None) -> str:
        """Publish a reply with confirms. Retries through reconnects.
        Returns 'ok', 'unroutable' or 'failed'."""
        body = protocol.dumps(payload)
        msg = aio_pika.Message(
            body,
            content_type="application/json",
            correlation_id=correlation_id,
            message_id=message_id,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            timestamp=time.time(),
        )
        delay = 0.05
        nacks = 0
        while True:
            ch = self._pub_channel
            try:
                if ch is None:
                    raise aiormq.exceptions.ChannelInvalidStateError("no publish channel")
                await ch.default_exchange.publish(msg, routing_key=routing_key, mandatory=True, timeout=10)
                return "ok"
            except aiormq.exceptions.PublishError:
                self.stats["reply_unroutable"] += 1
                log.warning("reply_unroutable", reply_to=routing_key, message_id=message_id)
                return "unroutable"
            except aiormq.exceptions.DeliveryError:
                nacks += 1
                if nacks >= 5:
                    log.error("reply_nacked", reply_to=routing_key, message_id=message_id)
                    return "failed"
            except _CONNECTION_ERRORS as exc:
                self.stats["publish_retry"] += 1
                log.debug("publish_retry", error=type(exc).__name__)
            if self._closing or (deadline is not None and time.monotonic() > deadline):
                return "failed"
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _reply_final(self, d: Delivery, result: dict[str, Any]) -> str:
        return await self._publish(d.reply_to, result, correlation_id=d.correlation_id, message_id=result.get("id"))

    # ---------------------------------------------------------- deliveries
    def _make_job_cb(self, queue_class: str) -> Callable:
        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            # aiormq cancels this callback's task if the channel closes, so
            # the job lives in a task of its own.
            self._spawn(self._handle(message, queue_class))

        return on_message

    async def _handle(self, message: aio_pika.abc.AbstractIncomingMessage, queue_class: str) -> None:
        received_at = time.time()
        self.stats["received"] += 1
        d = Delivery(message, message.reply_to or self.topo.results, message.correlation_id)
        key = message.message_id if isinstance(message.message_id, str) and message.message_id else None
        try:
            job = protocol.parse_job(
                message.body,
                message_id=key,
                expiration=message.expiration,
                timestamp=_published_at(message),
                priority=message.priority,
                content_type=message.content_type,
                max_body_bytes=self.cfg.max_body_bytes,
                received_at=received_at,
            )
        except RequestError as err:
            await self._reject_invalid(d, key, err, queue_class, len(message.body))
            return

        existing = self.active.get(job.key)
        if existing is not None:
            # Redelivery (our channel died) or a duplicate publish: never
            # run a key twice; answer it when the running one finishes.
            existing.waiters.append(d)
            self.stats["fenced"] += 1
            log.info("job_fenced", key=job.key, redelivered=message.redelivered)
            return
        aj = ActiveJob(job.key, d, queue_class, received_at)
        aj.job = job
        self.active[job.key] = aj
        try:
            await self._admit(aj)
        except Exception as exc:  # noqa: BLE001 - never lose a delivery on a bug
            log.error("job_admit_failed", key=job.key, error=repr(exc), exc_info=exc)
            if not aj.done.is_set():
                await self._finish(aj, protocol.result_error(job.key, "internal", f"worker error: {exc!r}", True))

    def _count_job(self, queue_class: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.job(queue_class, outcome)

    async def _reject_invalid(self, d: Delivery, key: str | None, err: RequestError, queue_class: str, size: int) -> None:
        self.stats["invalid"] += 1
        self._count_job(queue_class, err.code)
        log.info("job_invalid", key=key, queue=queue_class, bytes=size, code=err.code, reason=err.message)
        result = protocol.result_error(key, err.code, err.message, err.retryable)
        await self._reply_final(d, result)
        await self._settle(d.message)

    async def _answered_from_store(self, aj: ActiveJob, key: str) -> bool:
        """Answer the job from the shared store when its key already has a
        final result (replay) or was cancelled; returns whether it did."""
        rec = await self.store.get(key)
        if rec is not None:
            await self._replay(aj, rec)
            return True
        if await self.store.is_cancelled(key):
            await self._finish(aj, protocol.result_error(key, "cancelled", "the job was cancelled"))
            return True
        return False

    async def _admit(self, aj: ActiveJob) -> None:
        job = aj.job
        assert job is not None
        key = job.key
        if await self._answered_from_store(aj, key):
            return
        if job.deadline is not None and time.time() >= job.deadline:
            await self._finish(aj, protocol.result_error(key, "expired", "the job's deadline passed before it started"))
            return
        # Claim the key (shared store: not started on two workers at once).
        while True:
            owner = await self.store.claim(key, self.cfg.worker_id, self.cfg.claim_lease_s)
            if owner is None:
                break
            self.stats["held_for_other_worker"] += 1
            log.info("job_held_claimed_elsewhere", key=key, owner=owner)
            await asyncio.sleep(self.cfg.claim_poll_s)
            if aj.requeue or self._closing:
                return
            if await self._answered_from_store(aj, key):
                return
        if aj.done.is_set() or aj.requeue:
            return

        # Build the prompt and check it against the engine's limits.
        try:
            prompt_ids = self._prepare_prompt(job)
        except RequestError as err:
            self.stats["invalid"] += 1
            log.info("job_invalid", key=key, code=err.code, reason=err.message)
            await self._finish(aj, protocol.result_error(key, err.code, err.message, err.retryable))
            return

        log_kw: dict[str, Any] = dict(
            key=key,
            queue=aj.queue_class,
            bytes=job.body_bytes,
            prompt_tokens=len(prompt_ids),
            max_tokens=job.params.max_tokens,
            stream=job.stream,
            redelivered=aj.primary.message.redelivered,
            tenant=job.tenant,
        )
        if self.cfg.log_text:
            log_kw["prompt"] = job.prompt if job.prompt is not None else job.messages
        log.info("job_start", **log_kw)

        if job.stream:
            aj.sender = self._spawn(self._sender(aj))
        deadline_mono = None
        if job.deadline is not None:
            remaining = job.deadline - time.time()
            deadline_mono = time.monotonic() + remaining
            aj.deadline_handle = asyncio.get_running_loop().call_later(max(0.0, remaining), self._on_deadline, aj)
        rc = RequestClass.INTERACTIVE if aj.queue_class == INTERACTIVE else RequestClass.BATCH
        assert self.engine_thread is not None
        try:
            aj.in_engine = True
            await self.engine_thread.add_request(
                key, prompt_ids, job.params, request_class=rc, priority=job.priority, deadline=deadline_mono
            )
        except RequestError as err:
            aj.in_engine = False
            await self._finish(aj, protocol.result_error(key, err.code, err.message, err.retryable))
            return
        aj.admitted_mono = time.monotonic()

    def _prepare_prompt(self, job: protocol.Job) -> list[int]:
        eng = self.engine
        name = getattr(eng, "model_name", None)
        if job.model is not None and name is not None and job.model not in (name, os.path.basename(str(name).rstrip("/"))):
            raise RequestError("unknown_model", f"model {job.model!r} is not served here; this worker serves {name!r}")
        max_len = int(getattr(eng, "max_model_len", 1 << 30))
        if job.params.max_tokens > max_len:
            raise RequestError("invalid_request", f"max_tokens {job.params.max_tokens} exceeds max_model_len {max_len}")
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
                raise RequestError("invalid_request", f"messages could not be rendered with the chat template: {exc}") from None
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

    async def _replay(self, aj: ActiveJob, rec: dict[str, Any]) -> None:
        self.stats["replayed"] += 1
        self._count_job(aj.queue_class, "replayed")
        result = dict(rec["result"])
        deliveries = [aj.primary, *aj.waiters]
        aj.waiters = []
        for d in deliveries:
            if d.message.redelivered and d.dest in rec.get("delivered", ()):
                # This very message was answered already (its ack was lost).
                await self._settle(d.message)
                continue
            status = await self._reply_final(d, {**result, "replayed": True})
            if status == "failed":
                await self._settle(d.message, requeue=True)
                continue
            if status == "ok":
                await self.store.mark_delivered(aj.key, d.dest)
            await self._settle(d.message)
        log.info("job_replayed", key=aj.key, deliveries=len(deliveries))
        self.active.pop(aj.key, None)
        aj.done.set()

    # -------------------------------------------------------- engine side
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            aj = self.active.get(out.request_id)
            if aj is None or aj.final is not None or aj.stop_outputs:
                continue
            if out.new_text:
                if aj.first_token_mono is None:
                    aj.first_token_mono = time.monotonic()
                    if aj.deadline_handle is not None:
                        aj.deadline_handle.cancel()
                aj.text_parts.append(out.new_text)
                if aj.job is not None and aj.job.stream:
                    aj.pending_text.append(out.new_text)
                    aj.outbox_event.set()
            elif out.new_token_ids and aj.first_token_mono is None:
                aj.first_token_mono = time.monotonic()
            if out.finished:
                aj.in_engine = False
                self._spawn(self._finish(aj, self._final_from_output(aj, out)))

    def _final_from_output(self, aj: ActiveJob, out: RequestOutput) -> dict[str, Any]:
        if out.error is not None:
            return protocol.result_error(aj.key, out.error.code, out.error.message, out.error.retryable)
        reason = out.finish_reason
        if reason in ("stop", "length"):
            text = out.text if (out.text or not aj.text_parts) else "".join(aj.text_parts)
            return protocol.result_ok(aj.key, text, reason, out.prompt_tokens, out.completion_tokens, self._timings(aj))
        if reason == "abort":
            return protocol.result_error(aj.key, "cancelled", "the job was aborted")
        return protocol.result_error(aj.key, "internal", f"the engine failed the request (finish_reason={reason!r})", True)

    def _timings(self, aj: ActiveJob) -> dict[str, float]:
        now = time.monotonic()
        t: dict[str, float] = {"total_s": round(now - aj.received_mono, 6)}
        if aj.admitted_mono is not None:
            t["admit_s"] = round(aj.admitted_mono - aj.received_mono, 6)
        if aj.first_token_mono is not None:
            t["ttft_s"] = round(aj.first_token_mono - aj.received_mono, 6)
        ts = _published_at(aj.primary.message)
        if ts is not None:
            t["queue_s"] = round(max(0.0, aj.received_at - ts), 6)
        return t

    def _on_step_error(self, exc: BaseException) -> None:
        self.stats["engine_step_errors"] += 1
        log.error("engine_step_failed", error=repr(exc), running=len(self.active))
        for aj in list(self.active.values()):
            if aj.in_engine and aj.final is None:
                self._spawn(self._abort_with(aj, "internal", f"engine step failed: {exc!r}", True))

    def _on_deadline(self, aj: ActiveJob) -> None:
        if aj.final is None and aj.first_token_mono is None and self.active.get(aj.key) is aj:
            self._spawn(self._abort_with(aj, "expired", "the job's deadline passed while it waited"))

    async def _abort_with(self, aj: ActiveJob, code: str, message: str, retryable: bool | None = None) -> None:
        if aj.final is not None or aj.stop_outputs:
            return
        result = protocol.result_error(aj.key, code, message, retryable)
        aj.stop_outputs = True  # later engine outputs no longer count
        if aj.in_engine and self.engine_thread is not None:
            aj.in_engine = False
            try:
                await self.engine_thread.abort(aj.key)
            except Exception as exc:  # noqa: BLE001
                log.warning("engine_abort_failed", key=aj.key, error=repr(exc))
        await self._finish(aj, result)

    # ------------------------------------------------------------ replies
    async def _sender(self, aj: ActiveJob) -> None:
        """Publish this job's chunks in order, coalescing deltas that pile
        up while a confirm is pending."""
        while True:
            await aj.outbox_event.wait()
            aj.outbox_event.clear()
            while aj.pending_text:
                text = "".join(aj.pending_text)
                aj.pending_text.clear()
                seq = aj.seq
                aj.seq += 1
                status = await self._publish(
                    aj.primary.reply_to,
                    protocol.chunk(aj.key, seq, text, aj.run),
                    correlation_id=aj.primary.correlation_id,
                    message_id=None,
                )
                self.stats["chunks"] += 1
                if status == "unroutable" and aj.primary.reply_to != self.topo.results and not aj.client_gone:
                    # The requester's reply queue is gone: stop generating.
                    aj.client_gone = True
                    self._spawn(self._abort_with(aj, "cancelled", "the reply queue disappeared (client gone)"))
            if aj.final is not None or aj.done.is_set():
                return

    async def _finish(self, aj: ActiveJob, result: dict[str, Any]) -> None:
        """Publish the final reply (after every chunk), store, then ack."""
        if aj.final is not None or aj.done.is_set():
            return
        aj.final = result
        if aj.deadline_handle is not None:
            aj.deadline_handle.cancel()
        if aj.requeue:
            return
        # Let the sender flush every chunk first.
        if aj.sender is not None:
            aj.outbox_event.set()
            try:
                await aj.sender
            except asyncio.CancelledError:
                if aj.requeue:
                    return
        ok = result["status"] == "ok"
        if ok:
            await self.store.put(aj.key, result, delivered=[])
        primary_status = "skipped"
        if not aj.client_gone:
            primary_status = await self._reply_final(aj.primary, result)
        if primary_status == "failed" and not ok:
            # Could not tell the requester (broker gone for good): requeue.
            await self._requeue_job(aj)
            return
        if ok and primary_status == "ok":
            await self.store.mark_delivered(aj.key, aj.primary.dest)
        if not ok:
            await self.store.release(aj.key, self.cfg.worker_id)
        await self._settle(aj.primary.message)
        for d in aj.waiters:
            if d.message.redelivered and d.dest == aj.primary.dest and primary_status == "ok":
                await self._settle(d.message)
                continue
            extra = {"replayed": True} if ok else {}
            st = await self._reply_final(d, {**result, **extra})
            if ok and st == "ok":
                await self.store.mark_delivered(aj.key, d.dest)
            await self._settle(d.message)
        aj.waiters = []
        self.active.pop(aj.key, None)
        aj.done.set()
        self.stats["done_" + result["status"]] += 1
        self._count_job(aj.queue_class, "ok" if ok else result["error"]["code"])
        kw: dict[str, Any] = dict(key=aj.key, queue=aj.queue_class, status=result["status"], reply=primary_status)
        if ok:
            kw.update(result["usage"], finish_reason=result["finish_reason"], **result["timings"], chunks=aj.seq)
            if self.cfg.log_text:
                kw["text"] = result["text"]
        else:
            kw.update(code=result["error"]["code"])
        log.info("job_done", **kw)

    async def _requeue_job(self, aj: ActiveJob) -> None:
        """Give the job back to the broker (drain deadline or lost broker)."""
        if aj.done.is_set():
            return
        aj.requeue = True
        if aj.deadline_handle is not None:
            aj.deadline_handle.cancel()
        if aj.in_engine and self.engine_thread is not None:
            aj.in_engine = False
            try:
                await self.engine_thread.abort(aj.key)
            except Exception:  # noqa: BLE001
                pass
        if aj.sender is not None:
            aj.sender.cancel()
        await self.store.release(aj.key, self.cfg.worker_id)
        for d in (aj.primary, *aj.waiters):
            await self._settle(d.message, requeue=True)
        self.active.pop(aj.key, None)
        aj.done.set()
        self.stats["requeued"] += 1
        log.info("job_requeued", key=aj.key, queue=aj.queue_class)

    # ------------------------------------------------------------ control
    async def _on_control(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        try:
            data = protocol.orjson.loads(message.body)
            if not isinstance(data, dict) or data.get("type") != "cancel" or not isinstance(data.get("id"), str):
                raise ValueError("not a cancel message")
        except Exception as exc:  # noqa: BLE001
            log.warning("control_message_invalid", error=str(exc))
            return
        key = data["id"]
        self.stats["cancel_received"] += 1
        await self.store.mark_cancelled(key, self.cfg.cancel_ttl_s)
        aj = self.active.get(key)
        log.info("cancel_received", key=key, running_here=aj is not None)
        if aj is not None and aj.final is None:
            await self._abort_with(aj, "cancelled", "the job was cancelled")

    async def _renew_loop(self) -> None:
        period = max(0.2, self.cfg.claim_lease_s / 3)
        while True:
            await asyncio.sleep(period)
            for key in list(self.active):
                try:
                    await self.store.renew(key, self.cfg.worker_id, self.cfg.claim_lease_s)
                except Exception as exc:  # noqa: BLE001
                    log.warning("claim_renew_failed", key=key, error=repr(exc))
