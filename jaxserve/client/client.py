"""Producer side of the queue contract: async :class:`AsyncClient` and sync
:class:`Client`.

* Publishing uses publisher confirms on its own connection; a broker nack
  (the queue is full: ``x-overflow: reject-publish``) raises
  :class:`QueueFull`; :func:`retry_with_backoff` retries such calls.
* Replies arrive on the client's own reply queue (``<prefix>.reply.<id>``, a
  classic queue with ``x-expires``, so it survives a dropped connection).
* A job naming a ``model`` is routed by it (docs/protocol.md, "Routing by
  model"): published to ``<prefix>.models`` with routing key
  ``<class>.<model>`` and ``mandatory``; a model no worker binds comes back
  unroutable and is answered ``unknown_model`` at once
  (:class:`UnknownModel`), without waiting in any queue. A job without
  ``model``, or any job when no worker has declared the models exchange
  (workers that predate routing), goes to the default model's queue as
  before, and that worker checks the name.
* ``stream`` is an async iterator of text deltas that puts chunks in order,
  drops duplicates, notices gaps (``Stream.gaps``) and fills them from the
  final result.

The exceptions live in :mod:`jaxserve.client.errors` and :class:`Stream` in
:mod:`jaxserve.client.stream`; both are re-exported here (``__all__``), so
``from jaxserve.client.client import Stream`` keeps working.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar, cast

import aio_pika
import aiormq.exceptions
import orjson

from jaxserve.client.errors import JobError, NoRoute, QueueError, QueueFull, StreamDiverged, UnknownModel
from jaxserve.client.stream import Stream
from jaxserve.wire import (
    DEFAULT_AMQP_URL,
    DEFAULT_PREFIX,
    QUEUE_CLASSES,
    Cancel,
    Result,
    Topology,
    WireDecodeError,
    amqp_compat,
    decode_reply,
    tracecontext,
)
from jaxserve.wire.topology import route_key

T = TypeVar("T")

# A reply whose properties do not decode must not drop the reply connection.
amqp_compat.install()


def _model_of(body: dict[str, Any] | bytes) -> Any:
    """The ``model`` a job body names (None: the default model). A body that
    is not a JSON object goes to the default queue, whose worker refuses it."""
    if isinstance(body, dict):
        return body.get("model")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return data.get("model") if isinstance(data, dict) else None


#: seconds a client trusts "no models exchange" before asking the broker again
#: (a client may start before the first routing-aware worker)
MODELS_EXCHANGE_RECHECK_S = 10.0


def build_job(prompt: str | None = None, *, messages: list[dict] | None = None, **params: Any) -> dict[str, Any]:
    """A job body; ``None`` values are left out."""
    body: dict[str, Any] = {}
    if prompt is not None:
        body["prompt"] = prompt
    if messages is not None:
        body["messages"] = messages
    body.update({k: v for k, v in params.items() if v is not None})
    return body


async def retry_with_backoff(
    fn: Callable[[], Awaitable[T]],
    *,
    attempts: int = 8,
    base: float = 0.2,
    max_delay: float = 10.0,
    retry_on: tuple[type[BaseException], ...] = (QueueFull,),
) -> T:
    """Call ``fn`` until it does not raise ``retry_on``; exponential backoff
    with full jitter. Re-raises the last error after ``attempts`` tries."""
    for attempt in range(attempts):
        try:
            return await fn()
        except retry_on:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(random.uniform(0, min(max_delay, base * (2**attempt))))
    raise AssertionError("unreachable")


class AsyncClient:
    def __init__(
        self,
        url: str = DEFAULT_AMQP_URL,
        *,
        prefix: str = DEFAULT_PREFIX,
        reply_queue: str | None = None,
        reply_queue_expires_ms: int = 300_000,
        on_unclaimed: Callable[[Result], Awaitable[None] | None] | None = None,
        name: str = "jaxserve-client",
    ) -> None:
        self.url = url
        self.topo = Topology(prefix=prefix)
        self.reply_queue = reply_queue or f"{prefix}.reply.{uuid.uuid4().hex}"
        self.reply_queue_expires_ms = reply_queue_expires_ms
        self.on_unclaimed = on_unclaimed
        self.name = name
        self._pub_conn: aio_pika.abc.AbstractRobustConnection | None = None
        # robust when connect() made it; `jaxserve status` sets a plain one
        self._sub_conn: aio_pika.abc.AbstractConnection | None = None
        self._pub_ch: aio_pika.abc.AbstractRobustChannel | None = None
        self._sub_ch: aio_pika.abc.AbstractRobustChannel | None = None
        self._reply_q: aio_pika.abc.AbstractRobustQueue | None = None
        self._reply_tag: str | None = None
        self._futures: dict[str, asyncio.Future] = {}
        self._streams: dict[str, Stream] = {}
        self._models_exchange: aio_pika.abc.AbstractExchange | None = None
        self._models_missing_at: float | None = None  # monotonic time of the last "no such exchange"

    async def connect(self) -> AsyncClient:
        self._pub_conn = await aio_pika.connect_robust(
            self.url, reconnect_interval=1.0, client_properties={"connection_name": f"{self.name}-publish"}
        )
        self._sub_conn = await aio_pika.connect_robust(
            self.url, reconnect_interval=1.0, client_properties={"connection_name": f"{self.name}-replies"}
        )
        self._pub_ch = await self._pub_conn.channel(publisher_confirms=True, on_return_raises=True)
        self._sub_ch = await self._sub_conn.channel()
        await self._sub_ch.set_qos(prefetch_count=256)
        self._reply_q = await self._sub_ch.declare_queue(
            self.reply_queue,
            durable=False,
            auto_delete=False,
            arguments={"x-expires": int(self.reply_queue_expires_ms)},
        )
        self._reply_tag = await self._reply_q.consume(self._on_reply)
        return self

    async def close(self) -> None:
        for conn in (self._sub_conn, self._pub_conn):
            if conn is not None and not conn.is_closed:
                await conn.close()

    async def delete_reply_queue(self) -> None:
        """Delete this client's reply queue (when done with it)."""
        if self._reply_q is not None and self._reply_tag is not None:
            try:
                await self._reply_q.cancel(self._reply_tag)
            except Exception:  # noqa: BLE001 - the queue goes anyway
                pass
            self._reply_tag = None
        if self._sub_ch is not None:
            await self._sub_ch.queue_delete(self.reply_queue)

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ---------------------------------------------------------- replies
    async def _on_reply(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        try:
            msg = decode_reply(message.body)
        except WireDecodeError:
            await message.ack()  # not ours to interpret
            return
        key = msg.id if msg.id is not None else message.correlation_id
        stream = self._streams.get(key) if key is not None else None
        if stream is not None:
            stream._deliver(msg)
        if isinstance(msg, Result):
            # The future stays until wait() takes it (it may be called late).
            fut = self._futures.get(key) if key is not None else None
            if fut is not None and not fut.done():
                fut.set_result(msg)
            elif fut is None and stream is None and self.on_unclaimed is not None:
                r = self.on_unclaimed(msg)
                if asyncio.iscoroutine(r):
                    await r
        await message.ack()

    # ---------------------------------------------------------- publishing
    async def _models_route(self) -> aio_pika.abc.AbstractExchange | None:
        """The models exchange when the deployment routes by model, else
        None. Asked with a passive declare on a channel of its own (a 404
        closes the channel it happens on); a missing exchange is asked again
        after :data:`MODELS_EXCHANGE_RECHECK_S`."""
        if self._models_exchange is not None:
            return self._models_exchange
        now = time.monotonic()
        if self._models_missing_at is not None and now - self._models_missing_at < MODELS_EXCHANGE_RECHECK_S:
            return None
        assert self._pub_conn is not None and self._pub_ch is not None
        probe = await self._pub_conn.channel()
        try:
            await probe.declare_exchange(self.topo.models, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            self._models_missing_at = now
            return None
        finally:
            if not probe.is_closed:
                await probe.close()
        self._models_exchange = await self._pub_ch.get_exchange(self.topo.models, ensure=False)
        return self._models_exchange

    async def publish(
        self,
        body: dict[str, Any] | bytes,
        *,
        key: str | None = None,
        queue: str = "interactive",
        reply_to: str | None = None,
        correlation_id: str | None = None,
        expiration: float | None = None,
        priority: int | None = None,
        expect_reply: bool = True,
    ) -> str:
        """Publish one job; returns its key. ``queue`` is a class
        (``interactive``, ``batch``: routed by the body's ``model``) or a
        queue name (published to as it is). Raises :class:`QueueFull`,
        :class:`NoRoute`, :class:`UnknownModel`."""
        if self._pub_ch is None:
            raise RuntimeError("call connect() first")
        key = key or uuid.uuid4().hex
        exchange: aio_pika.abc.AbstractExchange = self._pub_ch.default_exchange
        routing_key = self.topo.queue_for(queue) if queue in QUEUE_CLASSES else queue
        model = _model_of(body) if queue in QUEUE_CLASSES else None
        if isinstance(model, str):
            models = await self._models_route()
            if models is not None:
                try:
                    routing_key = route_key(queue, model)
                except ValueError:
                    raise UnknownModel(key, model, self.topo.prefix) from None
                exchange = models
        raw = body if isinstance(body, (bytes, bytearray)) else orjson.dumps(body)
        reply_to = reply_to or self.reply_queue
        if expect_reply and reply_to == self.reply_queue and key not in self._futures:
            self._futures[key] = asyncio.get_running_loop().create_future()
        now = time.time()
        headers: dict[str, Any] = {"x-published-at-ms": int(now * 1000)}
        trace = tracecontext.active()  # the caller's trace, if one is active (never made up)
        if trace is not None:
            headers.update(trace.headers())
        msg = aio_pika.Message(
            bytes(raw),
            headers=headers,
            content_type="application/json",
            message_id=key,
            correlation_id=correlation_id or key,
            reply_to=reply_to,
            expiration=expiration,
            priority=priority,
            timestamp=now,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        try:
            await exchange.publish(msg, routing_key=routing_key, mandatory=True)
        except aiormq.exceptions.PublishError:
            self._futures.pop(key, None)
            if exchange is not self._pub_ch.default_exchange:
                raise UnknownModel(key, cast(str, model), self.topo.prefix) from None
            raise NoRoute(f"no queue {routing_key!r}: is a worker running with prefix {self.topo.prefix!r}?") from None
        except aiormq.exceptions.DeliveryError:
            self._futures.pop(key, None)
            raise QueueFull(routing_key, key) from None
        return key

    async def wait(self, key: str, timeout: float | None = None) -> Result:
        fut = self._futures.get(key)
        if fut is None:
            fut = self._futures[key] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            # asyncio's own TimeoutError has no message: the CLI printed "Error: "
            raise TimeoutError(
                f"no result for {key!r} within {timeout:g}s: is a worker consuming prefix {self.topo.prefix!r}? "
                "(`jaxserve status` shows each queue's consumers)"
            ) from None
        finally:
            if fut.done():
                self._futures.pop(key, None)

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        queue: str = "interactive",
        key: str | None = None,
        timeout: float | None = None,
        expiration: float | None = None,
        priority: int | None = None,
        raise_on_error: bool = False,
        **params: Any,
    ) -> Result:
        """Publish a job and wait for its final result."""
        body = build_job(prompt, messages=messages, **params)
        try:
            key = await self.publish(body, key=key, queue=queue, expiration=expiration, priority=priority)
        except UnknownModel as exc:
            if raise_on_error:
                raise
            return exc.result
        result = await self.wait(key, timeout)
        if raise_on_error and not result.ok:
            raise JobError(result)
        return result

    async def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        queue: str = "interactive",
        key: str | None = None,
        timeout: float | None = None,
        expiration: float | None = None,
        priority: int | None = None,
        **params: Any,
    ) -> Stream:
        """Publish a streaming job; iterate the returned :class:`Stream`."""
        body = build_job(prompt, messages=messages, stream=True, **params)
        key = key or uuid.uuid4().hex
        s = Stream(self, key, timeout)
        self._streams[key] = s
        try:
            await self.publish(body, key=key, queue=queue, expiration=expiration, priority=priority, expect_reply=False)
        except BaseException:
            self._streams.pop(key, None)
            raise
        return s

    async def cancel(self, key: str) -> None:
        """Broadcast a cancel on ``<prefix>.control``; the worker running the
        job aborts it and answers ``cancelled``."""
        assert self._pub_ch is not None
        exch = await self._pub_ch.get_exchange(self.topo.control, ensure=False)
        await exch.publish(
            aio_pika.Message(Cancel(id=key).to_bytes(), content_type="application/json"),
            routing_key="",
            mandatory=False,
        )

    async def queue_depths(self, queues: Iterable[str] = ()) -> dict[str, dict[str, int]]:
        """Ready messages and consumers of every queue (passive declares),
        then of ``queues`` (other models' job queues,
        ``Topology.model_queue``); a queue that does not exist has -1."""
        assert self._sub_conn is not None
        out: dict[str, dict[str, int]] = {}
        names = [self.topo.interactive, self.topo.batch, self.topo.dead, self.topo.results, *queues]
        for name in dict.fromkeys(names):
            ch = await self._sub_conn.channel()
            try:
                q = await ch.declare_queue(name, passive=True)
                res = q.declaration_result
                # a declare-ok always carries both counts
                out[name] = {"messages": cast(int, res.message_count), "consumers": cast(int, res.consumer_count)}
            except aiormq.exceptions.ChannelNotFoundEntity:
                out[name] = {"messages": -1, "consumers": -1}
            finally:
                if not ch.is_closed:
                    await ch.close()
        return out


class Client:
    """Blocking wrapper of :class:`AsyncClient` (its loop runs in a thread)."""

    def __init__(self, url: str = DEFAULT_AMQP_URL, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxserve-client", daemon=True)
        self._thread.start()
        self._ac = AsyncClient(url, **kwargs)
        self._run(self._ac.connect())

    def _run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        # every caller passes a coroutine: an async def's call, or an async generator's __anext__()
        return asyncio.run_coroutine_threadsafe(cast("Coroutine[Any, Any, T]", coro), self._loop).result(timeout)

    def submit(self, prompt: str | None = None, **kwargs: Any) -> Result:
        return self._run(self._ac.submit(prompt, **kwargs))

    def publish(self, body: dict[str, Any], **kwargs: Any) -> str:
        return self._run(self._ac.publish(body, **kwargs))

    def wait(self, key: str, timeout: float | None = None) -> Result:
        return self._run(self._ac.wait(key, timeout))

    def cancel(self, key: str) -> None:
        self._run(self._ac.cancel(key))

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[str]:
        s = self._run(self._ac.stream(prompt, **kwargs))
        it = s.__aiter__()
        while True:
            try:
                yield self._run(it.__anext__())
            except StopAsyncIteration:
                return

    def queue_depths(self, queues: Iterable[str] = ()) -> dict[str, dict[str, int]]:
        return self._run(self._ac.queue_depths(queues))

    def close(self) -> None:
        try:
            self._run(self._ac.close(), timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = [
    "MODELS_EXCHANGE_RECHECK_S",
    "AsyncClient",
    "Client",
    "JobError",
    "NoRoute",
    "QueueError",
    "QueueFull",
    "Result",
    "Stream",
    "StreamDiverged",
    "UnknownModel",
    "build_job",
    "retry_with_backoff",
]
