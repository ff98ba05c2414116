"""Publishing replies: publisher confirms, a deadline on every reply, and
direct reply-to kept apart.

Every publish ends in a :class:`PublishOutcome` within its deadline; nothing
retries for ever. Ordinary replies go over one robust connection and are
retried across reconnects until the deadline. Replies to RabbitMQ's direct
reply-to pseudo queue (``amq.rabbitmq.reply-to.*``) go over a connection of
their own, opened on demand, one attempt each: on RabbitMQ 3.10 a publish to
such a name whose encoded part is garbage closes the *connection* with 541
INTERNAL_ERROR, so sharing a connection would let one caller's bad
``reply_to`` drop every other reply in flight (direct reply-to is
at-most-once anyway).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aio_pika
import aiormq.exceptions
import structlog

from jaxserve.wire import INTERACTIVE
from jaxserve.wire.job import DIRECT_REPLY_TO

if TYPE_CHECKING:
    from jaxserve.wire import Chunk, Result
    from jaxserve.worker.lifecycle import Delivery

log = structlog.get_logger("jaxserve.worker")

_RETRY_ERRORS = (
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelClosed,
    ConnectionError,
    asyncio.TimeoutError,
    RuntimeError,
)
MAX_NACKS = 5


class PublishOutcome(enum.Enum):
    CONFIRMED = "confirmed"  # the broker confirmed it
    UNROUTABLE = "unroutable"  # no queue of that name: the requester is gone
    REFUSED = "refused"  # the broker dropped the connection over this destination
    NACKED = "nacked"  # the broker refused it MAX_NACKS times (reply queue full, internal error)
    FAILED = "failed"  # no confirm before the deadline (broker unreachable), or shutting down

    @property
    def undeliverable(self) -> bool:
        """Retrying cannot help: the destination itself is the problem."""
        return self in (PublishOutcome.UNROUTABLE, PublishOutcome.REFUSED)


class ReplyPublisher:
    """Publishes to the default exchange with confirms and ``mandatory``."""

    def __init__(
        self, url: Any, *, name: str, reconnect_interval: float = 1.0, stats: collections.Counter | None = None
    ) -> None:
        self.url = url
        self.name = name
        self.reconnect_interval = reconnect_interval
        self.stats = stats if stats is not None else collections.Counter()
        self.conn: aio_pika.abc.AbstractRobustConnection | None = None
        self.channel: aio_pika.abc.AbstractChannel | None = None
        self._direct_conn: aio_pika.abc.AbstractConnection | None = None
        self._direct_channel: aio_pika.abc.AbstractChannel | None = None
        self._direct_lock = asyncio.Lock()
        self.closing = False

    async def start(self) -> aio_pika.abc.AbstractRobustConnection:
        self.conn = await aio_pika.connect_robust(
            self.url,
            reconnect_interval=self.reconnect_interval,
            client_properties={"connection_name": f"jaxserve-worker-publish {self.name}"},
        )
        self.channel = await self.conn.channel(publisher_confirms=True, on_return_raises=True)
        return self.conn

    async def close(self) -> None:
        self.closing = True
        for conn in (self._direct_conn, self.conn):
            if conn is not None and not conn.is_closed:
                try:
                    await conn.close()
                except Exception:  # noqa: BLE001
                    pass

    @staticmethod
    def message(body: bytes, *, correlation_id: str | None, message_id: str | None) -> aio_pika.Message:
        return aio_pika.Message(
            body,
            content_type="application/json",
            correlation_id=correlation_id,
            message_id=message_id,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            timestamp=time.time(),
        )

    async def publish_message(self, routing_key: str, msg: aio_pika.Message, timeout_s: float) -> PublishOutcome:
        """A prepared message to a queue through the default exchange (a
        job the worker gives back to the tail of its queue)."""
        return await self._publish_robust(routing_key, msg, timeout_s)

    async def publish(
        self, routing_key: str, body: bytes, *, correlation_id: str | None, message_id: str | None, timeout_s: float
    ) -> PublishOutcome:
        msg = self.message(body, correlation_id=correlation_id, message_id=message_id)
        if routing_key.startswith(DIRECT_REPLY_TO):
            outcome = await self._publish_direct(routing_key, msg, timeout_s)
        else:
            outcome = await self._publish_robust(routing_key, msg, timeout_s)
        if outcome is not PublishOutcome.CONFIRMED:
            self.stats[f"reply_{outcome.value}"] += 1
            log.warning("reply_not_confirmed", reply_to=routing_key, message_id=message_id, outcome=outcome.value)
        return outcome

    async def _publish_robust(self, routing_key: str, msg: aio_pika.Message, timeout_s: float) -> PublishOutcome:
        deadline = time.monotonic() + timeout_s
        delay, nacks = 0.05, 0
        while True:
            remaining = deadline - time.monotonic()
            if self.closing or remaining <= 0:
                return PublishOutcome.FAILED
            ch = self.channel
            try:
                if ch is None:
                    raise aiormq.exceptions.ChannelInvalidStateError("no publish channel")
                await ch.default_exchange.publish(
                    msg, routing_key=routing_key, mandatory=True, timeout=min(10.0, remaining)
                )
                return PublishOutcome.CONFIRMED
            except aiormq.exceptions.PublishError:
                return PublishOutcome.UNROUTABLE
            except aiormq.exceptions.DeliveryError:
                nacks += 1
                if nacks >= MAX_NACKS:
                    return PublishOutcome.NACKED
            except _RETRY_ERRORS as exc:
                self.stats["publish_retry"] += 1
                log.debug("publish_retry", error=type(exc).__name__)
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)

    async def _publish_direct(self, routing_key: str, msg: aio_pika.Message, timeout_s: float) -> PublishOutcome:
        """One attempt over the direct reply-to connection."""
        async with self._direct_lock:
            try:
                if self._direct_channel is None or self._direct_channel.is_closed:
                    if self._direct_conn is None or self._direct_conn.is_closed:
                        self._direct_conn = await asyncio.wait_for(
                            aio_pika.connect(
                                self.url,
                                client_properties={"connection_name": f"jaxserve-worker-direct-reply {self.name}"},
                            ),
                            timeout_s,
                        )
                    self._direct_channel = await self._direct_conn.channel(
                        publisher_confirms=True, on_return_raises=True
                    )
            except Exception:  # noqa: BLE001 - the broker is unreachable: not this destination's fault
                self._direct_channel = None
                return PublishOutcome.FAILED
            try:
                await self._direct_channel.default_exchange.publish(
                    msg, routing_key=routing_key, mandatory=True, timeout=min(5.0, timeout_s)
                )
                return PublishOutcome.CONFIRMED
            except aiormq.exceptions.PublishError:
                return PublishOutcome.UNROUTABLE
            except aiormq.exceptions.DeliveryError:
                return PublishOutcome.NACKED
            except Exception:  # noqa: BLE001 - the broker closed the connection over this name
                self._direct_channel = None
                conn, self._direct_conn = self._direct_conn, None
                if conn is not None and not conn.is_closed:
                    try:
                        await conn.close()
                    except Exception:  # noqa: BLE001
                        pass
                return PublishOutcome.REFUSED


class Replies:
    """Which publisher and deadline each kind of reply of a worker uses:
    interactive replies on a connection of their own (their confirms never
    wait behind a burst of batch replies), finals within ``reply_timeout_s``,
    chunks within the shorter ``chunk_timeout_s``. ``publishers()`` returns
    (batch and default, interactive) as they are now: reconnects replace
    neither, but the tests' fake publisher replaces the default one."""

    def __init__(
        self,
        publishers: Callable[[], tuple[ReplyPublisher | None, ReplyPublisher | None]],
        *,
        reply_timeout_s: float,
        chunk_timeout_s: float,
        queue_for: Callable[[str], str],
    ) -> None:
        self._publishers = publishers
        self.reply_timeout_s = reply_timeout_s
        self.chunk_timeout_s = chunk_timeout_s
        self._queue_for = queue_for

    def publisher_for(self, queue_class: str) -> ReplyPublisher:
        default, interactive = self._publishers()
        publisher = (interactive if queue_class == INTERACTIVE else None) or default
        assert publisher is not None
        return publisher

    async def final(self, d: Delivery, result: Result) -> PublishOutcome:
        """A final result to the reply destination of one delivery."""
        return await self.publisher_for(d.queue_class).publish(
            d.reply_to,
            result.to_bytes(),
            correlation_id=d.correlation_id,
            message_id=result.id,
            timeout_s=self.reply_timeout_s,
        )

    async def chunk(self, d: Delivery, chunk: Chunk) -> PublishOutcome:
        return await self.publisher_for(d.queue_class).publish(
            d.reply_to,
            chunk.to_bytes(),
            correlation_id=d.correlation_id,
            message_id=None,
            timeout_s=self.chunk_timeout_s,
        )

    async def republish(self, queue_class: str, msg: aio_pika.Message) -> PublishOutcome:
        """A job back at the tail of its own queue (a deferred batch job),
        over the default publisher as before."""
        default, _ = self._publishers()
        assert default is not None
        return await default.publish_message(self._queue_for(queue_class), msg, self.reply_timeout_s)
