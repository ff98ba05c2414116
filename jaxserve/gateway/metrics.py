"""Prometheus metrics of the gateway, on the workers' conventions
(:mod:`jaxserve.metrics`): a ``jaxserve_gateway_`` prefix, ``model_name``
for the model, one registry per gateway (tests run several in a process),
served at ``/metrics`` on the gateway's own port.

Besides the counters, :class:`RecentEvents` keeps the last minutes of
refusals and answers in memory: the status page draws "refusals by code"
and the per-model rates from it without a Prometheus server.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jaxserve.metrics import LATENCY_BUCKETS, M


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()

        def metric(kind: type[M], name: str, documentation: str, labels: list[str]) -> M:
            """One of the gateway's metrics, in its registry; a histogram on
            the workers' latency buckets."""
            extra: dict[str, Any] = {"buckets": LATENCY_BUCKETS} if kind is Histogram else {}
            return kind(name, documentation, labels, registry=r, **extra)

        self.requests = metric(
            Counter,
            "jaxserve_gateway_requests",
            "HTTP requests answered, by route, model and status code",
            ["route", "model_name", "status"],
        )
        self.latency = metric(
            Histogram,
            "jaxserve_gateway_request_duration_seconds",
            "Request received to response finished (a stream: to its last event)",
            ["route", "model_name"],
        )
        self.ttft = metric(
            Histogram,
            "jaxserve_gateway_time_to_first_token_seconds",
            "Streamed requests: received to the first event with a token",
            ["model_name"],
        )
        self.disconnects = metric(
            Counter,
            "jaxserve_gateway_client_disconnects",
            "Requests whose client went away before the answer; their jobs are cancelled",
            ["route", "model_name"],
        )
        self.batch_requests = metric(
            Counter,
            "jaxserve_gateway_batch_requests",
            "Batch API requests finished, by outcome (ok or the error code)",
            ["outcome"],
        )
        self.batches = metric(Gauge, "jaxserve_gateway_batches", "Batches by status", ["status"])
        self.queue_depth = metric(
            Gauge,
            "jaxserve_gateway_queue_depth",
            "Ready messages of a job queue, as the gateway sees the broker",
            ["model_name", "queue"],
        )
        self.queue_consumers = metric(
            Gauge,
            "jaxserve_gateway_queue_consumers",
            "Consumers of a job queue, as the gateway sees the broker",
            ["model_name", "queue"],
        )
        for status in ("validating", "in_progress", "finalizing", "cancelling"):
            self.batches.labels(status).set(0)


class RecentEvents:
    """Answers and refusals of the last ``window_s`` seconds, for the status
    page: refusals by code, and jobs answered per model and class."""

    def __init__(self, window_s: float = 600.0) -> None:
        self.window_s = window_s
        self._events: collections.deque[tuple[float, str, str, str]] = collections.deque()

    def add(self, kind: str, model: str, detail: str) -> None:
        """``kind``: "refusal" (detail: the code) or "answer" (detail: the queue class)."""
        now = time.time()
        self._events.append((now, kind, model, detail))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def refusals(self, bucket_s: float = 60.0) -> dict[str, list[int]]:
        """Code -> counts per ``bucket_s`` over the window, oldest first."""
        now = time.time()
        self._trim(now)
        n = max(1, int(self.window_s // bucket_s))
        out: dict[str, list[int]] = {}
        for t, kind, _, code in self._events:
            if kind == "refusal":
                i = min(n - 1, int((t - (now - self.window_s)) // bucket_s))
                out.setdefault(code, [0] * n)[i] += 1
        return out

    def rates(self, over_s: float = 60.0) -> dict[tuple[str, str], float]:
        """(model, queue class) -> answers per second over the last ``over_s``."""
        now = time.time()
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        for t, kind, model, qc in self._events:
            if kind == "answer" and t >= now - over_s:
                counts[(model, qc)] += 1
        return {k: v / over_s for k, v in counts.items()}
