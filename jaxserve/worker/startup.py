"""The engine's start: build it (on a thread, or in its own process), start
its host, compile every shape bucket, then size the job limits and the
prefetch from what the engine can hold. No AMQP yet, so nothing can miss a
heartbeat while compilation holds the GIL; a ``stop`` set meanwhile ends it
early (``tests/test_queue_faults.py`` stops a worker before it consumes).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import structlog

from jaxserve.metrics import EngineMetrics
from jaxserve.metrics import serve as serve_metrics
from jaxserve.wire import BATCH, INTERACTIVE, JobLimits
from jaxserve.worker.engine_host import EngineHost
from jaxserve.worker.engine_process import EngineProcess
from jaxserve.worker.engine_thread import EngineThread
from jaxserve.worker.logs import bind_worker_context

if TYPE_CHECKING:
    from jaxserve.worker.worker import Worker

log = structlog.get_logger("jaxserve.worker")

QUORUM_MAX_PREFETCH = 2000


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


async def start_engine(w: Worker, stop: asyncio.Event | None) -> bool:
    """Build the engine, start its host, compile every bucket; False when
    ``stop`` is set first."""
    cfg = w.cfg
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    bind_worker_context(worker_id=cfg.worker_id)
    callbacks: dict[str, Any] = dict(
        on_step_report=w.on_step_report,
        on_fatal=w.on_engine_fatal,
        max_consecutive_step_failures=cfg.max_consecutive_step_failures,
    )
    # Made before the build, so a shutdown meanwhile stops it.
    host: EngineHost
    if cfg.engine_process:
        host = EngineProcess(w.engine_factory, loop, w.on_outputs, w.on_step_error, **callbacks)
    else:
        host = EngineThread.from_factory(w.engine_factory, loop, w.on_outputs, w.on_step_error, **callbacks)
    w.host = host
    built, info = await unless_stopped(host.open(), stop)
    if not built:
        log.info("worker_stopped_before_consuming", phase="engine_build")
        return False
    w.info = info
    w.engine = getattr(host, "engine", None)  # not in EngineHost: both hosts keep one, for tests and tools
    load_s = time.monotonic() - t0
    bind_worker_context(model=w.served_model_name)
    # the served name, as vLLM labels its metrics (--served-model-name)
    metrics = w.metrics = EngineMetrics(w.served_model_name or "")
    metrics.set_health_checks(ready=w.health.readiness, live=w.health.liveness)
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
        return False
    metrics.warmup_seconds.labels(metrics.model_name).set(time.monotonic() - t0 - load_s)
    log.info("engine_ready", model=info.model_name, warmup_s=round(time.monotonic() - t0, 3))
    w.limits = JobLimits(
        max_body_bytes=cfg.max_body_bytes, vocab_size=info.vocab_size, max_model_len=info.max_model_len
    )
    max_seqs = info.max_num_seqs if info.max_num_seqs is not None else 8
    reserved = min(max(info.interactive_reserved_seqs or 0, 0), max(max_seqs - 1, 0))
    w.prefetch = {
        INTERACTIVE: min(QUORUM_MAX_PREFETCH, cfg.interactive_prefetch or max_seqs),
        BATCH: min(QUORUM_MAX_PREFETCH, cfg.batch_prefetch or max(1, max_seqs - reserved)),
    }
    return True
