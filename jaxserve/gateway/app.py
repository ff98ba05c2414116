"""The gateway's ASGI app: routes, the lifespan that connects it, and the
one wrapper every API route goes through (the caller's key, OpenAI-shaped
refusals, metrics and one log line per request).

Starlette rather than FastAPI: every request body is checked by the wire's
own models (:func:`jaxserve.wire.parse_job`) so that HTTP and queue
producers get the same message for the same mistake; FastAPI's request
models, its dependency injection and its generated OpenAPI schema would be
a second definition of the same contract. Starlette gives routing,
streaming responses, multipart uploads and the lifespan, and nothing else
to keep in step. uvicorn serves it (``jaxserve gateway``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from jaxserve.client import AsyncClient
from jaxserve.gateway.batch_runner import RunnerContext
from jaxserve.gateway.batches import Batches
from jaxserve.gateway.broker_view import BrokerView
from jaxserve.gateway.completions import Completions
from jaxserve.gateway.errors import ApiError, invalid, not_found
from jaxserve.gateway.files import Files, check_purpose, new_file_id
from jaxserve.gateway.keys import OPEN, KeyRing, Principal, priority_header
from jaxserve.gateway.metrics import GatewayMetrics, RecentEvents
from jaxserve.gateway.status_page import queue_rows, set_gauges, status_data
from jaxserve.gateway.store import GatewayStore, make_store, public
from jaxserve.gateway.translate import parse_body
from jaxserve.wire.topology import Topology

log = structlog.get_logger("jaxserve.gateway")
STATIC = Path(__file__).with_name("static")


@dataclasses.dataclass
class GatewayConfig:
    amqp_url: str
    prefix: str
    state_dir: Path
    store: str = "sqlite"  # sqlite | redis
    redis_url: str = "redis://127.0.0.1:6379/0"
    files_dir: Path | None = None  # default: <state_dir>/gateway-<prefix>/files
    keys_path: Path | None = None
    management_url: str | None = None
    request_timeout_s: float = 600.0
    batch_max_in_flight: int = 512
    broker_poll_s: float = 5.0
    owned_by: str = "jaxserve"
    queue_full_retry_s: float = 2.0
    lease_s: float = 30.0

    @property
    def home(self) -> Path:
        return self.state_dir / f"gateway-{self.prefix}"


@dataclasses.dataclass
class Gateway:
    """Everything the routes reach, built by the lifespan."""

    config: GatewayConfig
    keys: KeyRing
    store: GatewayStore
    files: Files
    client: AsyncClient
    view: BrokerView
    batches: Batches
    completions: Completions
    metrics: GatewayMetrics
    events: RecentEvents
    owner: str
    first_seen: dict[str, int] = dataclasses.field(default_factory=dict)


Handler = Callable[[Request, Gateway, Principal], Awaitable[Response]]


def api(route: str, handler: Handler, *, auth: bool = True) -> Callable[[Request], Awaitable[Response]]:
    """One API route: authenticate, run, answer refusals in OpenAI's shape,
    count and log the request."""

    async def endpoint(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        started = time.monotonic()
        request.state.model = ""
        request.state.streaming = False
        principal: Principal | None = None
        try:
            principal = gw.keys.authenticate(request.headers.get("authorization")) if auth else OPEN
            response = await handler(request, gw, principal)
        except ApiError as exc:
            response = JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())
            gw.events.add("refusal", request.state.model, exc.code or str(exc.status))
            if exc.status >= 500:
                log.warning("gateway_refused", route=route, status=exc.status, code=exc.code, message=exc.message)
        model = request.state.model
        if not request.state.streaming:
            gw.metrics.requests.labels(route, model, str(response.status_code)).inc()
            gw.metrics.latency.labels(route, model).observe(time.monotonic() - started)
        if not request.state.streaming and auth:  # the status page polls status.json: no line for each look
            log.info(
                "gateway_request",
                method=request.method,
                route=route,
                status=response.status_code,
                model=model or None,
                tenant=principal.tenant if principal is not None else None,
                user=getattr(request.state, "user", None),
                duration_ms=round(1000 * (time.monotonic() - started), 1),
            )
        return response

    return endpoint


# ---------------------------------------------------------------- handlers
async def chat(request: Request, gw: Gateway, who: Principal) -> Response:
    return await gw.completions.handle(request, "chat", who)


async def completions(request: Request, gw: Gateway, who: Principal) -> Response:
    return await gw.completions.handle(request, "completions", who)


def _model_card(gw: Gateway, name: str, root: str) -> dict[str, Any]:
    created = gw.first_seen.setdefault(name, int(time.time()))
    return {"id": name, "object": "model", "created": created, "owned_by": gw.config.owned_by, "root": root}


async def _served(gw: Gateway, who: Principal) -> dict[str, Any]:
    snap = await gw.view.fresh(max_age_s=2 * gw.view.interval_s)  # the poller keeps it this fresh
    out = {}
    for name, model in snap.models.items():
        if who.models is not None and name not in who.models:
            continue
        consumers = [snap.queues[q].consumers for q in model.queues.values() if q in snap.queues]
        if consumers and not any(consumers):
            continue  # routed, but no worker serves it now
        out[name] = _model_card(gw, name, model.root)
    return out


async def list_models(request: Request, gw: Gateway, who: Principal) -> Response:
    return JSONResponse({"object": "list", "data": list((await _served(gw, who)).values())})


async def get_model(request: Request, gw: Gateway, who: Principal) -> Response:
    name = request.path_params["model"]
    request.state.model = name
    card = (await _served(gw, who)).get(name)
    if card is None:
        raise not_found(
            f"The model {name!r} does not exist or you do not have access to it.", "model", "model_not_found"
        )
    return JSONResponse(card)


async def upload_file(request: Request, gw: Gateway, who: Principal) -> Response:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > gw.files.max_bytes + 1_000_000:
        raise invalid(f"File is too large: the limit is {gw.files.max_bytes} bytes.", "file", "file_too_large")
    form = await request.form(max_files=1, max_fields=8)
    try:
        purpose = check_purpose(form.get("purpose"))
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise invalid("file is a required multipart field", "file", "missing_required_parameter")
        file_id = new_file_id()
        size = await asyncio.to_thread(gw.files.write_upload, upload.file, file_id)
        record = await gw.files.register(file_id, size, upload.filename or "upload.jsonl", purpose, who.tenant)
    finally:
        await form.close()
    return JSONResponse(public(record))


async def list_files(request: Request, gw: Gateway, who: Principal) -> Response:
    return JSONResponse(await gw.files.listing(who.tenant))


async def get_file(request: Request, gw: Gateway, who: Principal) -> Response:
    return JSONResponse(public(await gw.files.get(request.path_params["file_id"], who.tenant)))


async def file_content(request: Request, gw: Gateway, who: Principal) -> Response:
    file_id = request.path_params["file_id"]
    await gw.files.get(file_id, who.tenant)
    return FileResponse(gw.files.path(file_id), media_type="application/octet-stream")


async def delete_file(request: Request, gw: Gateway, who: Principal) -> Response:
    file_id = request.path_params["file_id"]
    await gw.files.get(file_id, who.tenant)
    for batch in await gw.store.open_batches():  # a batch resumed after a restart reads its input again
        if batch["input_file_id"] == file_id:
            raise ApiError(
                409,
                f"File {file_id} is the input of batch {batch['id']}, which is {batch['status']}; delete it once "
                "the batch has ended (or cancel the batch)",
                "invalid_request_error",
                "file_id",
                "file_in_use",
            )
    return JSONResponse(await gw.files.delete(file_id, who.tenant))


async def create_batch(request: Request, gw: Gateway, who: Principal) -> Response:
    priority = priority_header(request.headers.get("x-jaxserve-priority"), who.priority)
    return JSONResponse(await gw.batches.create(parse_body(await request.body()), who, priority))


async def get_batch(request: Request, gw: Gateway, who: Principal) -> Response:
    return JSONResponse(await gw.batches.get(request.path_params["batch_id"], who))


async def list_batches(request: Request, gw: Gateway, who: Principal) -> Response:
    try:
        limit = int(request.query_params.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise invalid(f"limit must be an integer 1-100, got {request.query_params.get('limit')!r}", "limit")
    return JSONResponse(await gw.batches.listing(who, request.query_params.get("after"), limit))


async def cancel_batch(request: Request, gw: Gateway, who: Principal) -> Response:
    return JSONResponse(await gw.batches.cancel(request.path_params["batch_id"], who))


async def status_json(request: Request, gw: Gateway, who: Principal) -> Response:
    return JSONResponse(await status_data(gw.view.snapshot, gw.events, gw.batches))


async def status_html(request: Request) -> Response:
    return HTMLResponse((STATIC / "status.html").read_text(encoding="utf-8"))


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    set_gauges(gw.metrics, queue_rows(gw.view.snapshot, gw.events))
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def healthz(request: Request) -> Response:
    return PlainTextResponse("ok\n")


async def readyz(request: Request) -> Response:
    gw: Gateway | None = getattr(request.app.state, "gateway", None)
    conn = gw.client._pub_conn if gw is not None else None
    # a robust connection stays open while it reconnects: its `connected` event says whether it is up now
    connected = getattr(conn, "connected", None)
    ok = conn is not None and not conn.is_closed and (connected is None or connected.is_set())
    return PlainTextResponse("ok\n" if ok else "broker unavailable\n", status_code=200 if ok else 503)


#: the OpenAI API's routes, path -> {method: handler}, each served through :func:`api`
_API_ROUTES: dict[str, dict[str, Handler]] = {
    "/v1/chat/completions": {"POST": chat},
    "/v1/completions": {"POST": completions},
    "/v1/models": {"GET": list_models},
    "/v1/models/{model:path}": {"GET": get_model},
    "/v1/files": {"POST": upload_file, "GET": list_files},
    "/v1/files/{file_id}": {"GET": get_file, "DELETE": delete_file},
    "/v1/files/{file_id}/content": {"GET": file_content},
    "/v1/batches": {"POST": create_batch, "GET": list_batches},
    "/v1/batches/{batch_id}": {"GET": get_batch},
    "/v1/batches/{batch_id}/cancel": {"POST": cancel_batch},
}
#: a path parameter as the ``route`` label of metrics and logs names it:
#: an object's id is ``{id}`` whatever its kind, a model name has no converter
_LABEL_PARAMS = {"{model:path}": "{model}", "{file_id}": "{id}", "{batch_id}": "{id}"}


def route_label(path: str) -> str:
    """The ``route`` label of requests to ``path`` (``/v1/files/{file_id}``
    -> ``/v1/files/{id}``)."""
    for param, label in _LABEL_PARAMS.items():
        path = path.replace(param, label)
    return path


def routes() -> list[Route]:
    api_routes = [
        Route(path, api(route_label(path), handler), methods=[method])
        for path, handlers in _API_ROUTES.items()
        for method, handler in handlers.items()
    ]
    return [
        *api_routes,
        Route("/status.json", api("/status.json", status_json, auth=False), methods=["GET"]),
        Route("/", status_html, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]


async def not_found_route(request: Request, exc: Exception) -> Response:
    err = ApiError(
        404, f"Unknown request URL: {request.method} {request.url.path}.", "invalid_request_error", None, "unknown_url"
    )
    return JSONResponse(err.body(), status_code=404)


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    err = ApiError(
        405,
        f"{request.method} is not allowed on {request.url.path}.",
        "invalid_request_error",
        None,
        "method_not_allowed",
    )
    return JSONResponse(err.body(), status_code=405)


def create_app(config: GatewayConfig) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gw = await _build(config)
        app.state.gateway = gw
        tasks = [
            asyncio.create_task(gw.view.run(), name="broker-view"),
            asyncio.create_task(gw.batches.run(), name="batch-adoption"),
        ]
        try:
            yield
        finally:
            await gw.batches.stop()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await gw.client.delete_reply_queue()
            await gw.client.close()
            await gw.view.close()
            await gw.store.close()
            log.info("gateway_stopped")

    return Starlette(
        routes=routes(),
        lifespan=lifespan,
        exception_handlers={404: not_found_route, 405: method_not_allowed},
    )


async def _build(config: GatewayConfig) -> Gateway:
    owner = f"gw-{uuid.uuid4().hex[:12]}"
    keys = KeyRing.load(config.keys_path) if config.keys_path is not None else KeyRing()
    store = make_store(config.store, state_dir=config.home, redis_url=config.redis_url, namespace=config.prefix)
    files = Files(store, config.files_dir or config.home / "files")
    topo = Topology(prefix=config.prefix)
    client = AsyncClient(
        config.amqp_url,
        prefix=config.prefix,
        reply_queue=f"{config.prefix}.reply.{owner}",
        name=f"jaxserve-gateway-{owner}",
    )
    await client.connect()
    view = BrokerView(config.amqp_url, topo, management_url=config.management_url, interval_s=config.broker_poll_s)
    await view.connect()
    await view.refresh()
    gateway_metrics = GatewayMetrics()
    events = RecentEvents()
    ctx = RunnerContext(
        amqp_url=config.amqp_url,
        prefix=config.prefix,
        store=store,
        files=files,
        work_dir=files.folder / "batches",  # beside the files: replicas that share those share these
        owner=owner,
        metrics=gateway_metrics,
        events=events,
        max_in_flight=config.batch_max_in_flight,
        lease_s=config.lease_s,
    )
    batches = Batches(ctx)
    completions_ = Completions(
        client,
        view,
        gateway_metrics,
        events,
        timeout_s=config.request_timeout_s,
        queue_full_retry_s=config.queue_full_retry_s,
    )
    log.info(
        "gateway_started",
        gateway_id=owner,
        prefix=config.prefix,
        store=config.store,
        files_dir=str(files.folder),
        broker_view=view.source,
        models=sorted(view.snapshot.models),
    )
    if keys.open:
        log.warning(
            "gateway_open",
            message="no --keys file: every request is accepted, as tenant 'default' (pass --keys FILE to require API keys)",
        )
    else:
        log.info("gateway_keys", keys=len(keys.entries), tenants=sorted({p.tenant for _, p in keys.entries}))
    if view.source == "amqp":
        log.warning(
            "gateway_models_unlisted",
            message="neither --management-url nor rabbitmqctl: /v1/models cannot list the served names",
        )
    return Gateway(
        config=config,
        keys=keys,
        store=store,
        files=files,
        client=client,
        view=view,
        batches=batches,
        completions=completions_,
        metrics=gateway_metrics,
        events=events,
        owner=owner,
    )
