"""A job's two log lines (``job_start``, ``job_done`` or ``job_replayed``),
the job metrics recorded with the second, and the cost metric.

Only answered jobs feed the latency histograms: a refused or cancelled
job's short "latency" would pull the quantiles down exactly when the worker
is overloaded (``jaxserve_jobs_total`` counts every outcome;
``tests/test_queue_e2e.py`` scrapes both).
"""

from __future__ import annotations

import collections
import time
from typing import Any

import structlog

from jaxserve.cost.jobs import spent
from jaxserve.metrics import EngineMetrics
from jaxserve.wire import Result
from jaxserve.worker.lifecycle import KeyJob
from jaxserve.worker.limits import LimitsConfig

log = structlog.get_logger("jaxserve.worker")


def log_job_start(kj: KeyJob, prompt_tokens: int, log_text: bool, resumed_tokens: int = 0) -> None:
    """``resumed_tokens``: the tokens an earlier run saved that this one
    continues from (``jaxserve.worker.progress``); logged when there are any."""
    job = kj.job
    kw: dict[str, Any] = dict(
        key=kj.key,
        queue=kj.queue_class,
        bytes=job.body_bytes,
        prompt_tokens=prompt_tokens,
        max_tokens=job.params.max_tokens,
        stream=job.stream,
        priority=job.priority,
        redelivered=kj.primary.redelivered,
        tenant=job.tenant,
    )
    if resumed_tokens:
        kw["resumed_tokens"] = resumed_tokens
    if log_text:
        kw["prompt"] = job.prompt if job.prompt is not None else job.messages
    log.info("job_start", **kw)


def log_job_done(
    stats: collections.Counter,
    metrics: EngineMetrics,
    kj: KeyJob,
    result: Result,
    replayed: bool,
    replies: collections.Counter,
    log_text: bool,
    resumed_tokens: int = 0,
) -> None:
    outcome = "ok" if result.ok else result.error.code  # type: ignore[union-attr]
    if not replayed:
        stats["done_" + result.status] += 1
    metrics.job(kj.queue_class, "replayed" if replayed else outcome)
    kw: dict[str, Any] = dict(key=kj.key, queue=kj.queue_class, status=result.status, replies=dict(replies))
    if replayed:
        log.info("job_replayed", deliveries=len(kj.deliveries), **kw)
        return
    if result.ok:
        metrics.observe_job(
            kj.queue_class,
            e2e=time.monotonic() - kj.received_mono,
            ttft=None if kj.first_token_mono is None else kj.first_token_mono - kj.received_mono,
            broker_wait=kj.broker_wait_s,
            engine=kj.engine_metrics,
        )
    if result.ok:
        assert result.usage is not None
        kw.update(
            result.usage.model_dump(exclude_none=True),  # usage.cost only where priced
            finish_reason=result.finish_reason,
            **(result.timings or {}),
            chunks=kj.seq,
        )
        if resumed_tokens:  # of its completion_tokens, those an earlier run generated
            kw["resumed_tokens"] = resumed_tokens
        if log_text:
            kw["text"] = result.text
    else:
        kw.update(code=outcome)
    log.info("job_done", **kw)


def record_cost(metrics: EngineMetrics, limits: LimitsConfig | None, tenant: str | None, result: Result) -> None:
    """Count a freshly served result's cost in ``jaxserve_cost_total``, by
    the tenant's bounded label (``LimitsConfig.metric_label``: listed
    tenants by name, ``default``, ``other``); replays and cached answers
    cost nothing new and are not counted."""
    if not result.ok or result.cached or result.usage is None or result.usage.cost is None:
        return
    label = limits.metric_label(tenant or "") if limits is not None else "default"
    metrics.record_cost(label, spent(result), result.usage.cost["currency"])
