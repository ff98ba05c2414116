"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one job each
on the model's interactive queue (``X-Jaxserve-Queue: batch`` for its batch
queue), answered whole or streamed as server-sent events from the job's
replies.

The gateway keeps nothing for these: the job's key is new (or the
caller's ``Idempotency-Key``, scoped to the tenant), its replies come to the
gateway's own reply queue, and the refusals a queue producer would see
become OpenAI's status codes (:mod:`jaxserve.gateway.errors`). A stream
answers its status line only once the first reply is in, so a job refused
before its first token (``overloaded``, ``rate_limited``, a prompt over the
context) is a 4xx with ``Retry-After`` where it helps, not a 200 with an
error inside.

A client that goes away (the socket closes before the answer) cancels its
job on ``<prefix>.control``; the worker aborts it and frees its sequence at
once (``tests/test_gateway_disconnect.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxserve.client import AsyncClient, JobError, NoRoute, QueueFull, StreamDiverged, UnknownModel
from jaxserve.gateway.broker_view import BrokerView
from jaxserve.gateway.errors import ApiError, from_result, no_worker, queue_full
from jaxserve.gateway.keys import Principal, priority_header, queue_header
from jaxserve.gateway.metrics import GatewayMetrics, RecentEvents
from jaxserve.gateway.translate import ChunkWriter, Endpoint, completion, job_body, parse_body, validate
from jaxserve.wire import Result

log = structlog.get_logger("jaxserve.gateway")

#: names of AsyncClient.stream's own parameters, which a body field must not fill
_STREAM_ARGS = ("prompt", "messages", "stream", "queue", "key", "timeout", "expiration", "priority")


@dataclasses.dataclass
class Completions:
    client: AsyncClient
    view: BrokerView
    metrics: GatewayMetrics
    events: RecentEvents
    timeout_s: float = 600.0
    queue_full_retry_s: float = 2.0
    _lingering: set[asyncio.Future[Result]] = dataclasses.field(default_factory=set)

    async def handle(self, request: Request, endpoint: Endpoint, principal: Principal) -> Response:
        received = time.monotonic()
        body = parse_body(await request.body())
        priority = priority_header(request.headers.get("x-jaxserve-priority"), principal.priority)
        queue = queue_header(request.headers.get("x-jaxserve-queue"))
        job = job_body(body, endpoint, principal, priority)
        model = job["model"]
        request.state.model = model
        if isinstance(body.get("user"), str):
            request.state.user = body["user"][:256]  # OpenAI's end-user id: logged, never part of the job
        key = self._key(request, principal)
        validate(job, key)
        await self._check_worker(model, queue)
        if job.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._stream(request, job, key, endpoint, include_usage, received, queue)
        result = await self._submit(request, job, key, endpoint, queue)
        self.events.add("answer", model, queue)
        return JSONResponse(completion(result, endpoint, model))

    @staticmethod
    def _key(request: Request, principal: Principal) -> str:
        """The job's idempotency key: the caller's ``Idempotency-Key`` within
        its tenant (a retried request is answered from the workers' store),
        else a new one."""
        given = request.headers.get("idempotency-key")
        if not given:
            return "gw-" + uuid.uuid4().hex
        key = f"gw:{principal.tenant}:{given}"
        if len(key.encode()) > 255:  # AMQP's message_id is a short string
            key = "gw:" + hashlib.sha256(key.encode()).hexdigest()
        return key

    async def _check_worker(self, model: str, queue_class: str) -> None:
        """503 when the model is routed but no worker consumes its queue now
        (a model nobody routes is the broker's 404, at publish)."""
        served = self.view.snapshot.models.get(model)
        queue = served.queues.get(queue_class) if served is not None else None
        if queue is None:
            return
        seen = self.view.snapshot.queues.get(queue)
        if seen is not None and seen.consumers > 0:
            return
        if await self.view.consumers_now(queue) == 0:  # the snapshot may be old: ask the broker now
            raise no_worker(model, queue)

    def _forget(self, waiter: asyncio.Future[Result]) -> None:
        self._lingering.discard(waiter)
        if not waiter.cancelled():
            waiter.exception()  # a wait that timed out: retrieved, not reported as lost

    def _refusal(self, exc: BaseException, key: str, model: str) -> ApiError:
        if isinstance(exc, UnknownModel | JobError):
            return from_result(exc.result)
        if isinstance(exc, QueueFull):
            return queue_full(exc.queue, self.queue_full_retry_s)
        if isinstance(exc, NoRoute):
            return ApiError(503, f"{exc} (model {model!r})", "server_error", None, "no_worker")
        raise exc

    async def _submit(self, request: Request, job: dict[str, Any], key: str, endpoint: Endpoint, queue: str) -> Result:
        model = job["model"]
        try:
            # no AMQP expiration: a job past --request-timeout is cancelled
            # instead (workers remember a cancel for a job not yet delivered),
            # so no per-message TTL rides on every job
            await self.client.publish(job, key=key, queue=queue)
        except (UnknownModel, QueueFull, NoRoute) as exc:
            raise self._refusal(exc, key, model) from None
        waiter = asyncio.ensure_future(self.client.wait(key, self.timeout_s + 5.0))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done():
                self.metrics.disconnects.labels(_route(endpoint), model).inc()
                await _cancel(self.client, key, "disconnect")
                # the waiter stays to take the job's `cancelled` answer, so the
                # client forgets the key (its wait ends when the answer comes)
                self._lingering.add(waiter)
                waiter.add_done_callback(self._forget)
                raise ApiError(499, "the client closed the request", "invalid_request_error", None, "client_closed")
            try:
                result = waiter.result()
            except TimeoutError:
                await _cancel(self.client, key, "timeout")
                raise ApiError(504, f"no answer within {self.timeout_s:g}s", "timeout", None, "timeout") from None
        finally:
            gone.cancel()
            if waiter not in self._lingering:
                waiter.cancel()
        if not result.ok:
            raise from_result(result)
        return result

    async def _stream(
        self,
        request: Request,
        job: dict[str, Any],
        key: str,
        endpoint: Endpoint,
        include_usage: bool,
        received: float,
        queue: str,
    ) -> Response:
        model = job["model"]
        params = {k: v for k, v in job.items() if k not in _STREAM_ARGS}
        try:
            s = await self.client.stream(
                job.get("prompt"),
                messages=job.get("messages"),
                queue=queue,
                key=key,
                timeout=self.timeout_s,
                priority=job.get("priority"),
                **params,
            )
        except (UnknownModel, QueueFull, NoRoute) as exc:
            raise self._refusal(exc, key, model) from None
        first = asyncio.ensure_future(s.started.wait())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({first, gone}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (first, gone):
                t.cancel()
        if s.first is None:
            s.close()
            if gone in done:
                self.metrics.disconnects.labels(_route(endpoint), model).inc()
                await _cancel(self.client, key, "disconnect")
                raise ApiError(499, "the client closed the request", "invalid_request_error", None, "client_closed")
            await _cancel(self.client, key, "timeout")
            raise ApiError(504, f"no token within {self.timeout_s:g}s", "timeout", None, "timeout")
        if isinstance(s.first, Result) and not s.first.ok:
            s.close()
            raise from_result(s.first)
        writer = ChunkWriter(endpoint, model, include_usage)
        request.state.streaming = True  # its metrics and log line come when the stream ends
        return StreamingResponse(
            self._events(s, writer, key, endpoint, received, queue),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(
        self, s: Any, writer: ChunkWriter, key: str, endpoint: Endpoint, received: float, queue: str
    ) -> AsyncIterator[bytes]:
        model = writer.model
        route = _route(endpoint)
        status = "200"
        finished = False
        try:
            yield writer.opening()
            self.metrics.ttft.labels(model).observe(time.monotonic() - received)
            try:
                async for delta in s:
                    yield writer.delta(delta)
                finished = True
                yield writer.closing(s.result)
                self.events.add("answer", model, queue)
            except JobError as exc:
                finished = True
                refusal = from_result(exc.result)
                status = str(refusal.status)
                self.events.add("refusal", model, refusal.code or "error")
                yield writer.error(refusal)
            except StreamDiverged as exc:
                finished = True
                status = "500"
                yield writer.error(ApiError(500, str(exc), "server_error", None, "stream_diverged"))
            except TimeoutError:
                finished = True
                status = "504"
                await _cancel(self.client, key, "timeout")
                yield writer.error(ApiError(504, f"no answer within {self.timeout_s:g}s", "timeout", None, "timeout"))
        finally:
            if not finished:  # the client went away mid-stream: the job must not run on for nobody
                status = "499"
                self.metrics.disconnects.labels(route, model).inc()
                with anyio.CancelScope(shield=True):
                    await _cancel(self.client, key, "disconnect")
            self.metrics.requests.labels(route, model, status).inc()
            self.metrics.latency.labels(route, model).observe(time.monotonic() - received)
            log.info("gateway_stream_end", key=key, model=model, status=int(status), chunks=getattr(s, "chunks", 0))


def _route(endpoint: Endpoint) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body is read, so
    the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel(client: AsyncClient, key: str, why: str) -> None:
    try:
        await client.cancel(key)
        log.info("gateway_job_cancelled", key=key, reason=why)
    except Exception as exc:  # noqa: BLE001 - the broker may be away; the job then runs to its end
        log.warning("gateway_cancel_failed", key=key, reason=why, error=repr(exc))
