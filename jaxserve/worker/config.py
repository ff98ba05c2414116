"""The worker's settings, and the two readings of a delivery's properties
that several worker modules share (when the producer published, a text
property or None).

Kept apart from the worker so that the CLI (``jaxserve.cli.queue_commands``)
and the tests build a :class:`WorkerConfig` without reading any of the
worker's machinery.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

from jaxserve.cost.prices import PriceTable
from jaxserve.wire import DEFAULT_AMQP_URL, DEFAULT_MAX_BODY_BYTES, Topology
from jaxserve.worker.admission import AdmissionConfig
from jaxserve.worker.limits import LimitsConfig


@dataclasses.dataclass
class WorkerConfig:
    """Every setting of one worker (the `jaxserve worker` flags map onto these)."""

    amqp_url: str = DEFAULT_AMQP_URL
    topology: Topology = dataclasses.field(default_factory=Topology)
    heartbeat: int = 30
    reconnect_interval: float = 1.0
    interactive_prefetch: int | None = None  # default: engine.max_num_seqs
    batch_prefetch: int | None = None  # default: max_num_seqs - interactive_reserved_seqs
    drain_timeout: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    claim_lease_s: float = 30.0
    claim_poll_s: float = 0.5
    # Cancels outlive any wait a job can have in the broker by default.
    cancel_ttl_s: float = 86400.0
    # Every final reply ends within this (then: requeue or, for a destination
    # that can never take it, ack); chunks get the shorter chunk_timeout_s.
    reply_timeout_s: float = 60.0
    chunk_timeout_s: float = 10.0
    store_retry_max_s: float = 5.0  # backoff cap of the outage probe while the store is unreachable
    # While the store is unreachable a job waits for it at most this long,
    # then goes back to the broker (--store-hold).
    store_hold_s: float = 10.0
    engine_hang_timeout_s: float = 300.0  # one step or command busy longer: the engine is hung
    # Each running job's generated tokens go to the store once it has this
    # many unsaved ones, else every save_tokens_interval_s; all jobs' in one
    # write. A job whose worker dies continues from them elsewhere
    # (jaxserve.worker.progress). 0: nothing saved.
    save_tokens_every: int = 16
    save_tokens_interval_s: float = 1.0
    # Run the engine in a process of its own (jaxserve.worker.engine_process)
    # instead of a thread of this one: the event loop then never waits for
    # the engine's Python work to let go of the GIL. The engine factory must
    # then pickle (a module-level callable, or a functools.partial of one);
    # `jaxserve worker` turns it on (--engine-process, the default there).
    engine_process: bool = False
    max_consecutive_step_failures: int = 5
    log_text: bool = False
    # The name jobs write in ``model`` (and results carry); default: the
    # engine's model name without its folder.
    served_model_name: str | None = None
    # Routing by model (docs/protocol.md, "Routing by model";
    # jaxserve.worker.routing): declare and bind this model's routes, and
    # consume its queues. Further names jobs may use for this model
    # (`jaxserve worker --served-model-name A --served-model-name B`: A is
    # the name results carry, B an alias, as vLLM's --served-model-name A B).
    # default_model: the deployment's default model (jobs without `model`);
    # None: this worker's. A worker whose names do not include it consumes
    # its model's own queues, <prefix>.<class>.<model>.
    model_routes: bool = False
    model_aliases: tuple[str, ...] = ()
    default_model: str | None = None
    # The deployment's defaults for interactive jobs that name no
    # fallback_models / degrade of their own (--fallback-model,
    # --degrade-max-tokens); batch jobs only ever get what they ask for.
    fallback_models: tuple[str, ...] = ()
    degrade_max_tokens: int | None = None
    # Interactive admission (overloaded when a job cannot start in time) and
    # per-tenant limits (--limits FILE; None: no limits).
    admission: AdmissionConfig = dataclasses.field(default_factory=AdmissionConfig)
    limits: LimitsConfig | None = None
    # Per-model prices (--prices FILE or --price-*; jaxserve.cost): results
    # carry usage.cost, tenants' cost_per_day is charged, jaxserve_cost_total
    # counts (jaxserve.cost.jobs). None: no cost anywhere.
    prices: PriceTable | None = None
    defer_wait_max_s: float = 1.0  # a batch job over its tenant's limit waits this long at most before going back
    declare: bool = True
    metrics_port: int | None = None  # serve Prometheus /metrics here when set
    # Trace jobs and export to this OTLP collector (--otlp-endpoint); the
    # OTEL_* variables configure tracing too (jaxserve.worker.tracing).
    otlp_endpoint: str | None = None
    worker_id: str = dataclasses.field(
        default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    )


def published_at(message: Any) -> float | None:
    """When the producer published: header ``x-published-at-ms`` (epoch
    milliseconds, integer), else the AMQP ``timestamp`` (whole seconds)."""
    hdr = (message.headers or {}).get("x-published-at-ms")
    try:
        if hdr is not None and not isinstance(hdr, bool):
            return int(hdr) / 1000.0
        if message.timestamp is not None:
            return message.timestamp.timestamp()
    except (TypeError, ValueError, OverflowError, AttributeError, OSError):
        pass
    return None


def text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
