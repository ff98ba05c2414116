"""Prometheus metrics of a jaxserve worker.

Names mirror vLLM's (``num_requests_running``, ``kv_cache_usage_perc``,
``time_to_first_token_seconds``, ...) under a ``jaxserve_`` prefix, so
dashboards built for one read the other with a prefix change. The worker
feeds each step's report from its engine host (``Worker.on_step_report``,
on the event loop) to :meth:`EngineMetrics.record_stats` and
:meth:`EngineMetrics.record_outputs`; the queue side counts jobs with
:meth:`EngineMetrics.job`.

Each ``EngineMetrics`` owns its own registry, so tests and several engines in
one process never collide; :func:`serve` exposes one over HTTP.

The same HTTP server answers the orchestrator's probes, from its own thread
(so a busy event loop or engine cannot fake an answer):

``/healthz``  liveness: 200 while the check registered with
              :meth:`EngineMetrics.set_health_checks` (``live``) passes, 503
              when it fails (a stuck engine, a stalled event loop), 200 while
              none is registered (the process answers, that is all it knows).
``/readyz``   readiness: 200 once the ``ready`` check passes (the worker is
              consuming), 503 before, while draining, while the worker's
              store does not answer, and while no check is registered.

A check is a callable returning ``bool`` or ``(bool, reason)``; the reason is
the response body. A check that raises counts as failing.
"""

from __future__ import annotations

import errno
import socketserver
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, make_wsgi_app
from prometheus_client.metrics import MetricWrapperBase

from jaxserve.wire.topology import QUEUE_CLASSES

HealthCheck = Callable[[], bool | tuple[bool, str]]
#: a metric type (Counter, Gauge, Histogram)
M = TypeVar("M", bound=MetricWrapperBase)

#: buckets (seconds) of every latency histogram, the worker's and the
#: gateway's (``jaxserve.gateway.metrics``), so their quantiles compare
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


#: The worker's metrics labelled by model alone, ``(kind, name, help)``:
#: :class:`EngineMetrics` declares each from this table, as the attribute
#: named after it (less ``jaxserve_``), and creates its series at start-up,
#: at zero, so a dashboard finds every one before the first job (one table,
#: not a declaration each, so no metric is declared and then left out of
#: that start-up list).
_PER_MODEL: tuple[tuple[type[Gauge] | type[Counter], str, str], ...] = (
    (Gauge, "jaxserve_num_requests_running", "Requests in the running batch"),
    (Gauge, "jaxserve_num_requests_waiting", "Requests waiting to be scheduled"),
    (Gauge, "jaxserve_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)"),
    (Counter, "jaxserve_num_preemptions", "Requests preempted to free KV blocks"),
    (Counter, "jaxserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    (Counter, "jaxserve_prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    (Counter, "jaxserve_prompt_tokens", "Prompt tokens of finished requests"),
    (Counter, "jaxserve_generation_tokens", "Tokens generated"),
    (Counter, "jaxserve_engine_steps", "Engine iterations"),
    # speculative decoding (vLLM's spec_decode_* counters)
    (Counter, "jaxserve_spec_decode_num_drafts", "Sequences' steps that carried guessed tokens"),
    (Counter, "jaxserve_spec_decode_num_draft_tokens", "Guessed tokens verified"),
    (Counter, "jaxserve_spec_decode_num_accepted_tokens", "Guessed tokens the model kept"),
    (Counter, "jaxserve_engine_step_errors", "Engine steps that raised"),
    (Gauge, "jaxserve_kv_cache_bytes", "Bytes of the KV cache"),
    (Gauge, "jaxserve_model_load_seconds", "Seconds to build the engine (load the model)"),
    (Gauge, "jaxserve_warmup_seconds", "Seconds to compile every shape bucket"),
    # 0 while the idempotency store does not answer: the worker then takes
    # no jobs and /readyz says "store unavailable" (worker.store_health)
    (Gauge, "jaxserve_store_up", "1 while the idempotency store answers, 0 during an outage"),
)


class EngineMetrics:
    """All metrics of one worker, in one registry."""

    # declared from _PER_MODEL
    num_requests_running: Gauge
    num_requests_waiting: Gauge
    kv_cache_usage_perc: Gauge
    num_preemptions: Counter
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    engine_steps: Counter
    spec_decode_num_drafts: Counter
    spec_decode_num_draft_tokens: Counter
    spec_decode_num_accepted_tokens: Counter
    engine_step_errors: Counter
    kv_cache_bytes: Gauge
    model_load_seconds: Gauge
    warmup_seconds: Gauge
    store_up: Gauge

    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        for kind, name, documentation in _PER_MODEL:
            metric = kind(name, documentation, ["model_name"], registry=r)
            metric.labels(model_name)  # the series, at zero from start-up
            setattr(self, name.removeprefix("jaxserve_"), metric)
        self.store_up.labels(model_name).set(1)

        # Latencies, by queue class (interactive | batch). The worker observes
        # them per job (observe_job, observe_tokens): it knows the class.
        def by_queue(name: str, documentation: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            """A histogram by model and queue class, with both classes'
            series from start-up; every latency the worker observes per job
            is one, on the latency buckets."""
            histogram = Histogram(name, documentation, ["model_name", "queue"], buckets=buckets, registry=r)
            for queue in QUEUE_CLASSES:
                histogram.labels(model_name, queue)
            return histogram

        self.ttft = by_queue("jaxserve_time_to_first_token_seconds", "Receipt to first token")
        self.itl = by_queue(
            "jaxserve_inter_token_latency_seconds", "Time between two tokens, one observation per token", _ITL_BUCKETS
        )
        self.e2e = by_queue("jaxserve_e2e_request_latency_seconds", "Receipt to final result")
        self.queue_time = by_queue(
            "jaxserve_request_queue_time_seconds", "Engine arrival to first scheduled (engine wait)"
        )
        self.broker_wait = by_queue(
            "jaxserve_broker_wait_seconds", "Publish (producer timestamp) to receipt by the worker"
        )
        self.prefill_time = by_queue("jaxserve_request_prefill_time_seconds", "First scheduled to first token")
        self.decode_time = by_queue("jaxserve_request_decode_time_seconds", "First token to finish")

        def by_model(kind: type[M], name: str, documentation: str, labels: list[str]) -> M:
            """A counter or gauge labelled by model first, then ``labels``."""
            return kind(name, documentation, ["model_name", *labels], registry=r)

        # The worker's own health and the broker as it sees it.
        self.rejections = by_model(
            Counter,
            "jaxserve_rejections",
            "Jobs refused at admission, by error code, reason and tenant",
            ["queue", "code", "reason", "tenant"],
        )
        # What served jobs cost (jaxserve.cost), by tenant as the limits file
        # bounds it (listed tenants by name, "default", "other": the worker
        # passes LimitsConfig.metric_label), so label values stay few.
        self.cost = by_model(
            Counter,
            "jaxserve_cost",
            "Cost of served jobs' tokens at the worker's prices, by tenant and currency",
            ["tenant", "currency"],
        )
        # Jobs that accepted a degraded answer instead of overloaded
        # (jaxserve.worker.fallback): re-routed to a fallback model
        # ("fallback", counted by the model that passed them on) or run with
        # their degrade.max_tokens ("max_tokens").
        self.degradations = by_model(
            Counter,
            "jaxserve_degradations",
            "Jobs answered degraded instead of overloaded, by reason (fallback, max_tokens)",
            ["queue", "reason"],
        )
        self.requeues = by_model(
            Counter, "jaxserve_requeues", "Jobs given back to the broker, by reason", ["queue", "reason"]
        )
        self.reconnects = by_model(Counter, "jaxserve_reconnects", "AMQP reconnections, by connection", ["connection"])
        self.queue_depth = by_model(
            Gauge, "jaxserve_queue_depth", "Ready messages in a queue (interactive, batch, dead, results)", ["queue"]
        )
        self.queue_consumers = by_model(Gauge, "jaxserve_queue_consumers", "Consumers of a queue", ["queue"])
        ProcessCollector(namespace="jaxserve", registry=r)  # jaxserve_process_resident_memory_bytes, cpu, fds
        for q in QUEUE_CLASSES:  # series present from start-up, at zero
            self.requeues.labels(model_name, q, "drain")
            for code in ("overloaded", "rate_limited"):
                self.rejections.labels(model_name, q, code, "none", "default")
            for reason in ("fallback", "max_tokens"):
                self.degradations.labels(model_name, q, reason)
        for c in ("interactive", "batch", "control", "publish"):
            self.reconnects.labels(model_name, c)
        self.request_success = by_model(
            Counter, "jaxserve_request_success", "Finished requests by finish reason", ["finished_reason"]
        )
        self.jobs = by_model(
            Counter, "jaxserve_jobs", "Queue jobs by queue and outcome (ok, error code, replayed)", ["queue", "outcome"]
        )
        m = model_name
        self._step_children: dict[str, Any] = {  # gauges and counters
            "running": self.num_requests_running.labels(m),
            "waiting": self.num_requests_waiting.labels(m),
            "kv_usage": self.kv_cache_usage_perc.labels(m),
            "preemptions": self.num_preemptions.labels(m),
            "prefix_queries": self.prefix_cache_queries.labels(m),
            "prefix_hits": self.prefix_cache_hits.labels(m),
            "steps": self.engine_steps.labels(m),
            "drafts": self.spec_decode_num_drafts.labels(m),
            "draft_tokens": self.spec_decode_num_draft_tokens.labels(m),
            "accepted_tokens": self.spec_decode_num_accepted_tokens.labels(m),
            "generation": self.generation_tokens.labels(m),
            "prompt": self.prompt_tokens.labels(m),
        }
        self._itl_children = {q: self.itl.labels(m, q) for q in QUEUE_CLASSES}
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
        """Update gauges and per-request histograms after one engine step.
        Runs on the engine thread after every step, holding the GIL the event
        loop needs: one update per metric, through the children cached at
        construction (``labels()`` is a locked lookup)."""
        self.record_stats(engine.scheduler.stats())
        self.record_outputs(outputs)

    def record_stats(self, stats) -> None:
        """The scheduler's snapshot after a step (``SchedulerStats``): the
        gauges, and the counters' growth since the last snapshot."""
        c = self._step_children
        c["running"].set(stats.num_running)
        c["waiting"].set(stats.num_waiting)
        c["kv_usage"].set(stats.kv_cache_usage)
        last = self._last_stats
        if last is not None:
            c["preemptions"].inc(max(0, stats.num_preemptions - last.num_preemptions))
            c["prefix_queries"].inc(max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
            c["prefix_hits"].inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
            c["steps"].inc(max(0, stats.num_steps - last.num_steps))
            for name in ("drafts", "draft_tokens", "accepted_tokens"):  # (an engine stand-in's stats may lack them)
                grown = getattr(stats, f"num_{name}", 0) - getattr(last, f"num_{name}", 0)
                c[name].inc(max(0, grown))
        self._last_stats = stats

    def record_outputs(self, outputs: Iterable) -> None:
        """Tokens generated, prompts finished and finish reasons of one
        step's outputs."""
        c = self._step_children
        generated = prompt = 0
        for out in outputs:
            generated += len(out.new_token_ids)
            if out.finished:
                prompt += out.prompt_tokens
                self.request_success.labels(self.model_name, out.finish_reason or "error").inc()
        if generated:
            c["generation"].inc(generated)
        if prompt:
            c["prompt"].inc(prompt)

    def job(self, queue: str, outcome: str) -> None:
        self.jobs.labels(self.model_name, queue, outcome).inc()

    def observe_tokens(self, queue: str, gap_s: float, n: int) -> None:
        """``n`` tokens arrived ``gap_s`` after the previous ones: one
        inter-token latency observation per token (vLLM's metric)."""
        h = self._itl_children.get(queue) or self.itl.labels(self.model_name, queue)
        for _ in range(n):
            h.observe(gap_s / n)

    def observe_job(
        self, queue: str, *, e2e: float, ttft: float | None, broker_wait: float | None, engine: dict[str, float] | None
    ) -> None:
        """A finished job's latencies; ``engine``: the engine's timestamps of
        its request (arrival, first_scheduled, first_token, finished)."""
        m = self.model_name
        self.e2e.labels(m, queue).observe(e2e)
        if ttft is not None:
            self.ttft.labels(m, queue).observe(ttft)
        if broker_wait is not None:
            self.broker_wait.labels(m, queue).observe(broker_wait)
        t = engine or {}
        arrival, first_sched, first_token = t.get("arrival"), t.get("first_scheduled"), t.get("first_token")
        finished = t.get("finished", time.monotonic())
        if arrival is not None and first_sched is not None:
            self.queue_time.labels(m, queue).observe(first_sched - arrival)
        if first_sched is not None and first_token is not None:
            self.prefill_time.labels(m, queue).observe(first_token - first_sched)
        if first_token is not None:
            self.decode_time.labels(m, queue).observe(finished - first_token)

    def rejection(self, code: str, reason: str, queue: str, tenant: str) -> None:
        self.rejections.labels(self.model_name, queue, code, reason, tenant).inc()

    def degradation(self, queue: str, reason: str) -> None:
        self.degradations.labels(self.model_name, queue, reason).inc()

    def record_cost(self, tenant: str, amount: float, currency: str) -> None:
        """A served job's ``usage.cost``; ``tenant`` is already a bounded
        label (``LimitsConfig.metric_label``, or "default" without limits)."""
        if amount > 0:
            self.cost.labels(self.model_name, tenant, currency).inc(amount)


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
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one access line per scrape/probe would drown the worker's log


def make_app(metrics: EngineMetrics) -> Callable:
    """The WSGI app: ``/healthz``, ``/readyz``, and Prometheus' exposition
    at ``/metrics`` for ``metrics.registry``; any other path is 404 (a
    scraper or probe pointed at a wrong path should fail, not read metrics
    back as if it were right; ``tests/test_metrics.py``)."""
    exposition = make_wsgi_app(metrics.registry)
    probes = {"/healthz": metrics.liveness, "/readyz": metrics.readiness}

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        probe = probes.get(path)
        if probe is None:
            if path != "/metrics":
                return _text(start_response, "404 Not Found", f"not found: {path}; try /metrics, /healthz or /readyz")
            return exposition(environ, start_response)
        ok, reason = probe()
        return _text(start_response, "200 OK" if ok else "503 Service Unavailable", reason)

    return app


def _text(start_response: Callable, status: str, line: str) -> list[bytes]:
    """Answer ``line`` as one line of plain text: the probes' answers and
    the 404 are read by people and orchestrators alike, so they share one
    form."""
    body = (line + "\n").encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
    return [body]


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
