"""The engine's start: build it (on a thread, or in its own process), start
its host, compile every shape bucket, then size the job limits and the
prefetch from what the engine can hold. No AMQP yet, so nothing can miss a
heartbeat while compilation holds the GIL; a ``stop`` set meanwhile ends it
early (``tests/test_queue_worker.py`` stops a worker during warm-up).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, cast

import structlog

from jaxserve.metrics import EngineMetrics
from jaxserve.metrics import serve as serve_metrics
from jaxserve.wire import BATCH, INTERACTIVE, JobLimits
from jaxserve.worker.engine_process import EngineProcess, kv_cache_bytes
from jaxserve.worker.engine_thread import EngineThread
from jaxserve.worker.logs import bind_worker_context
from jaxserve.worker.priority import deprioritize_other_threads, deprioritize_process

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
    if cfg.engine_process:
        # Set before the build, so a shutdown meanwhile stops the process.
        w.engine_thread = EngineProcess(
            w.engine_factory,
            loop,
            w.on_outputs,
            w.on_step_error,
            on_step=w.record_remote_step,
            on_fatal=w.on_engine_fatal,
            max_consecutive_step_failures=cfg.max_consecutive_step_failures,
        )
        built, w.engine = await unless_stopped(w.engine_thread.start(), stop)
    else:
        built, w.engine = await unless_stopped(asyncio.to_thread(w.engine_factory), stop)
    if not built:
        log.info("worker_stopped_before_consuming", phase="engine_build")
        return False
    load_s = time.monotonic() - t0
    bind_worker_context(model=w.served_model_name)
    # the served name, as vLLM labels its metrics (--served-model-name)
    metrics = w.metrics = EngineMetrics(w.served_model_name or "")
    metrics.set_health_checks(ready=w.health.readiness, live=w.health.liveness)
    metrics.model_load_seconds.labels(metrics.model_name).set(load_s)
    kv = kv_cache_bytes(w.engine)
    if kv is not None:
        metrics.kv_cache_bytes.labels(metrics.model_name).set(kv)
    if cfg.metrics_port is not None:
        serve_metrics(metrics, cfg.metrics_port)
    if not cfg.engine_process:
        w.engine_thread = EngineThread(
            w.engine,
            loop,
            w.on_outputs,
            w.on_step_error,
            on_step=metrics.record_step if hasattr(w.engine, "scheduler") else None,
            on_fatal=w.on_engine_fatal,
            max_consecutive_step_failures=cfg.max_consecutive_step_failures,
        )
        w.engine_thread.start()
    log.info(
        "engine_warmup_started",
        model=getattr(w.engine, "model_name", None),
        load_s=round(load_s, 3),
        engine_process=getattr(w.engine_thread, "pid", None),
    )
    host = cast("EngineThread | EngineProcess", w.engine_thread)  # set above on both paths
    if not (await unless_stopped(host.warmup(), stop))[0]:
        log.info("worker_stopped_before_consuming", phase="warmup")
        return False
    metrics.warmup_seconds.labels(metrics.model_name).set(time.monotonic() - t0 - load_s)
    if cfg.compute_nice:
        if cfg.engine_process:
            # the engine process is running (it built the engine)
            niced = deprioritize_process(cast(int, cast(EngineProcess, host).pid), cfg.compute_nice)
        else:
            niced = deprioritize_other_threads(cfg.compute_nice)
        log.info("compute_threads_deprioritized", nice=cfg.compute_nice, threads=niced)
    log.info("engine_ready", model=getattr(w.engine, "model_name", None), warmup_s=round(time.monotonic() - t0, 3))
    w.limits = JobLimits(
        max_body_bytes=cfg.max_body_bytes,
        vocab_size=_vocab_size(w.engine),
        max_model_len=getattr(w.engine, "max_model_len", None),
    )
    max_seqs = int(getattr(w.engine, "max_num_seqs", 8))
    reserved = int(getattr(w.engine, "interactive_reserved_seqs", 0))
    reserved = min(max(reserved, 0), max(max_seqs - 1, 0))
    w.prefetch = {
        INTERACTIVE: min(QUORUM_MAX_PREFETCH, cfg.interactive_prefetch or max_seqs),
        BATCH: min(QUORUM_MAX_PREFETCH, cfg.batch_prefetch or max(1, max_seqs - reserved)),
    }
    return True


def _vocab_size(engine: Any) -> int | None:
    cfg = getattr(engine, "model_config", None)
    size = getattr(cfg, "vocab_size", None) or getattr(engine, "vocab_size", None)
    return int(size) if isinstance(size, int) else None
