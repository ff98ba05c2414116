"""Prometheus metrics of a jaxserve worker.

Names mirror vLLM's (``num_requests_running``, ``kv_cache_usage_perc``,
``time_to_first_token_seconds``, ...) under a ``jaxserve_`` prefix, so
dashboards built for one read the other with a prefix change. The engine
thread calls :meth:`EngineMetrics.record_step` after every step; the queue
side counts jobs with :meth:`EngineMetrics.job`.

Each ``EngineMetrics`` owns its own registry, so tests and several engines in
one process never collide; :func:`serve` exposes one over HTTP.

The same HTTP server answers the orchestrator's probes, from its own thread
(so a busy event loop or engine cannot fake an answer):

``/healthz``  liveness: 200 while the check registered with
              :meth:`EngineMetrics.set_health_checks` (``live``) passes, 503
              when it fails (a stuck engine, a stalled event loop), 200 while
              none is registered (the process answers, that is all it knows).
``/readyz``   readiness: 200 once the ``ready`` check passes (the worker is
              consuming), 503 before, while draining, and while no check is
              registered.

A check is a callable returning ``bool`` or ``(bool, reason)``; the reason is
the response body. A check that raises counts as failing.
"""

from __future__ import annotations

import errno
import socketserver
import threading
import time
from typing import Any, Callable, Iterable, Union
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

HealthCheck = Callable[[], Union[bool, tuple[bool, str]]]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class EngineMetrics:
    """All metrics of one worker, in one registry."""

    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        labels = ["model_name"]
        self.num_requests_running = Gauge("jaxserve_num_requests_running", "Requests in the running batch", labels, registry=r)
        self.num_requests_waiting = Gauge("jaxserve_num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_cache_usage_perc = Gauge("jaxserve_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", labels, registry=r)
        self.num_preemptions = Counter("jaxserve_num_preemptions", "Requests preempted to free KV blocks", labels, registry=r)
        self.prefix_cache_queries = Counter("jaxserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels, registry=r)
        self.prefix_cache_hits = Counter("jaxserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", labels, registry=r)
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "Prompt tokens of finished requests", labels, registry=r)
        self.generation_tokens = Counter("jaxserve_generation_tokens", "Tokens generated", labels, registry=r)
        self.engine_steps = Counter("jaxserve_engine_steps", "Engine iterations", labels, registry=r)
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "Arrival to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jaxserve_inter_token_latency_seconds", "Mean time between tokens of a request", labels,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds", "Arrival to finish", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("jaxserve_request_queue_time_seconds", "Arrival to first scheduled", labels,
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("jaxserve_request_prefill_time_seconds", "First scheduled to first token",
                                      labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("jaxserve_request_decode_time_seconds", "First token to finish", labels,
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.request_success = Counter("jaxserve_request_success", "Finished requests by finish reason",
                                       ["model_name", "finished_reason"], registry=r)
        self.jobs = Counter("jaxserve_jobs", "Queue jobs by queue and outcome (ok, error code, replayed)",
                            ["model_name", "queue", "outcome"], registry=r)
        self._last_stats = None
        self._ready_check: HealthCheck | None = None
        self._live_check: HealthCheck | None = None

    # ------------------------------------------------------------ health
    def set_health_checks(self, ready: HealthCheck | None = None, live: HealthCheck | None = None) -> None:
        """Register what ``/readyz`` and ``/healthz`` answer. Both are called
        from the HTTP server's threads: they must only read state (no event
        loop calls) and return quickly."""
        self._ready_check = ready
        self._live_check = live

    def readiness(self) -> tuple[bool, str]:
        return _run_check(self._ready_check, "no readiness check registered", default=False)

    def liveness(self) -> tuple[bool, str]:
        return _run_check(self._live_check, "alive (no liveness check registered)", default=True)

    def record_step(self, engine, outputs: Iterable) -> None:
        """Update gauges and per-request histograms after one engine step."""
        m = self.model_name
        stats = engine.scheduler.stats()
        self.num_requests_running.labels(m).set(stats.num_running)
        self.num_requests_waiting.labels(m).set(stats.num_waiting)
        self.kv_cache_usage_perc.labels(m).set(stats.kv_cache_usage)
        last = self._last_stats
        if last is not None:
            self.num_preemptions.labels(m).inc(max(0, stats.num_preemptions - last.num_preemptions))
            self.prefix_cache_queries.labels(m).inc(max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
            self.prefix_cache_hits.labels(m).inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
            self.engine_steps.labels(m).inc(max(0, stats.num_steps - last.num_steps))
        self._last_stats = stats
        for out in outputs:
            self.generation_tokens.labels(m).inc(len(out.new_token_ids))
            if not out.finished:
                continue
            t = out.metrics
            arrival, first_sched = t.get("arrival"), t.get("first_scheduled")
            first_token, finished = t.get("first_token"), t.get("finished", time.monotonic())
            self.prompt_tokens.labels(m).inc(out.prompt_tokens)
            self.request_success.labels(m, out.finish_reason or "error").inc()
            if arrival is not None:
                self.e2e.labels(m).observe(finished - arrival)
                if first_sched is not None:
                    self.queue_time.labels(m).observe(first_sched - arrival)
                if first_token is not None:
                    self.ttft.labels(m).observe(first_token - arrival)
            if first_sched is not None and first_token is not None:
                self.prefill_time.labels(m).observe(first_token - first_sched)
            if first_token is not None:
                self.decode_time.labels(m).observe(finished - first_token)
                if out.completion_tokens > 1:
                    self.itl.labels(m).observe((finished - first_token) / (out.completion_tokens - 1))

    def job(self, queue: str, outcome: str) -> None:
        self.jobs.labels(self.model_name, queue, outcome).inc()


def _run_check(check: HealthCheck | None, missing: str, default: bool) -> tuple[bool, str]:
    if check is None:
        return default, missing
    try:
        result = check()
    except Exception as exc:  # noqa: BLE001 - a broken check is a failed probe
        return False, f"check failed: {exc!r}"
    if isinstance(result, tuple):
        ok, reason = result
        return bool(ok), str(reason)
    return bool(result), "ok" if result else "failing"


class MetricsPortInUse(OSError):
    """The metrics port is taken by another process."""


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up the process exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # one access line per scrape/probe would drown the worker's log


def make_app(metrics: EngineMetrics) -> Callable:
    """The WSGI app: ``/healthz``, ``/readyz``, and Prometheus' exposition
    (``/metrics``, any other path) for ``metrics.registry``."""
    exposition = make_wsgi_app(metrics.registry)
    probes = {"/healthz": metrics.liveness, "/readyz": metrics.readiness}

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        probe = probes.get(environ.get("PATH_INFO", ""))
        if probe is None:
            return exposition(environ, start_response)
        ok, reason = probe()
        body = (reason + "\n").encode()
        start_response(
            "200 OK" if ok else "503 Service Unavailable",
            [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
        )
        return [body]

    return app


def serve(metrics: EngineMetrics, port: int, addr: str = "0.0.0.0") -> WSGIServer:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``addr:port`` from
    a daemon thread; returns the server (``shutdown()`` stops it). Raises
    :class:`MetricsPortInUse` when the port is taken."""
    try:
        server = make_server(addr, port, make_app(metrics), server_class=_ThreadingServer, handler_class=_QuietHandler)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise MetricsPortInUse(exc.errno, f"metrics port {port} is already in use ({addr}:{port})") from None
        raise
    threading.Thread(target=server.serve_forever, name=f"metrics-{port}", daemon=True).start()
    return server
