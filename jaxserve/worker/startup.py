"""The engine's start: make its host (on a thread, or in its own process),
build the engine, compile every shape bucket, then size the job limits and
the prefetch from what the engine can hold. No AMQP yet, so nothing can
miss a heartbeat while compilation holds the GIL; a ``stop`` set meanwhile
ends it early (``tests/test_queue_faults.py`` stops a worker before it
consumes).

What comes out is one :class:`ServedEngine`: the host and what the rest of
the worker reads about the engine it serves, made once and never changed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import structlog

from jaxserve.metrics import EngineMetrics
from jaxserve.metrics import serve as serve_metrics
from jaxserve.wire import BATCH, INTERACTIVE, JobLimits
from jaxserve.worker.config import WorkerConfig
from jaxserve.worker.engine_host import EngineHost, EngineInfo, FailureCallback, OutputsCallback, StepReportCallback
from jaxserve.worker.engine_process import EngineProcess
from jaxserve.worker.engine_thread import EngineThread
from jaxserve.worker.logs import bind_worker_context
from jaxserve.worker.prompts import served_name
from jaxserve.worker.results import ResultContext

log = structlog.get_logger("jaxserve.worker")

QUORUM_MAX_PREFETCH = 2000

HealthCheck = Callable[[], tuple[bool, str]]


@dataclasses.dataclass(frozen=True)
class EngineEvents:
    """Where the host delivers what its engine says (on the event loop)."""

    on_outputs: OutputsCallback
    on_step_error: FailureCallback
    on_step_report: StepReportCallback
    on_fatal: FailureCallback


@dataclasses.dataclass(frozen=True)
class ServedEngine:
    """The engine a worker serves, once it is built and warm: its host
    (requests in), what it says of itself, the name jobs reach it by, the
    metrics labelled with that name, how results are built, and the limits
    and prefetch that follow from its size."""

    host: EngineHost
    info: EngineInfo
    served_model_name: str | None
    metrics: EngineMetrics
    results: ResultContext
    limits: JobLimits
    prefetch: dict[str, int]


def make_host(factory: Callable[[], Any], cfg: WorkerConfig, events: EngineEvents) -> EngineHost:
    """The engine's host, before the build (so a shutdown meanwhile can
    stop it): a process of its own, or a thread of this one. The worker's
    id is bound to the logs first: an engine process logs with it too."""
    bind_worker_context(worker_id=cfg.worker_id)
    loop = asyncio.get_running_loop()
    kwargs: dict[str, Any] = dict(
        on_step_report=events.on_step_report,
        on_fatal=events.on_fatal,
        max_consecutive_step_failures=cfg.max_consecutive_step_failures,
    )
    if cfg.engine_process:
        return EngineProcess(factory, loop, events.on_outputs, events.on_step_error, **kwargs)
    return EngineThread.from_factory(factory, loop, events.on_outputs, events.on_step_error, **kwargs)


async def unless_stopped(awaitable: Any, stop: asyncio.Event | None) -> tuple[bool, Any]:
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


async def open_engine(
    host: EngineHost,
    cfg: WorkerConfig,
    stop: asyncio.Event | None,
    *,
    readiness: HealthCheck,
    liveness: HealthCheck,
) -> ServedEngine | None:
    """Build the engine in ``host``, compile every bucket, start the
    metrics (and their server, with the health checks); None when ``stop``
    is set first."""
    t0 = time.monotonic()
    built, info = await unless_stopped(host.open(), stop)
    if not built:
        log.info("worker_stopped_before_consuming", phase="engine_build")
        return None
    load_s = time.monotonic() - t0
    served = served_name(cfg.served_model_name, info)
    bind_worker_context(model=served)
    # the served name, as vLLM labels its metrics (--served-model-name)
    metrics = EngineMetrics(served or "")
    metrics.set_health_checks(ready=readiness, live=liveness)
    metrics.model_load_seconds.labels(metrics.model_name).set(load_s)
    if info.kv_cache_bytes is not None:
        metrics.kv_cache_bytes.labels(metrics.model_name).set(info.kv_cache_bytes)
    if info.kv_cache_summary is not None:  # how much memory the cache took, for what, and why
        log.info("kv_cache_reserved", bytes=info.kv_cache_bytes, summary=info.kv_cache_summary)
    if cfg.metrics_port is not None:
        serve_metrics(metrics, cfg.metrics_port)
    log.info("engine_warmup_started", model=info.model_name, load_s=round(load_s, 3), engine_process=host.pid)
    if not (await unless_stopped(host.warmup(), stop))[0]:
        log.info("worker_stopped_before_consuming", phase="warmup")
        return None
    metrics.warmup_seconds.labels(metrics.model_name).set(time.monotonic() - t0 - load_s)
    log.info("engine_ready", model=info.model_name, warmup_s=round(time.monotonic() - t0, 3))
    max_seqs = info.max_num_seqs if info.max_num_seqs is not None else 8
    reserved = min(max(info.interactive_reserved_seqs or 0, 0), max(max_seqs - 1, 0))
    return ServedEngine(
        host=host,
        info=info,
        served_model_name=served,
        metrics=metrics,
        results=ResultContext(served, info.tokenizer, cfg.prices),
        limits=JobLimits(
            max_body_bytes=cfg.max_body_bytes, vocab_size=info.vocab_size, max_model_len=info.max_model_len
        ),
        prefetch={
            INTERACTIVE: min(QUORUM_MAX_PREFETCH, cfg.interactive_prefetch or max_seqs),
            BATCH: min(QUORUM_MAX_PREFETCH, cfg.batch_prefetch or max(1, max_seqs - reserved)),
        },
    )
