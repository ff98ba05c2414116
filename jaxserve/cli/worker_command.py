"""``jaxserve worker``: serve jobs from the queues with a continuous-batching
engine. Its options (engine, admission, limits, store, topology, prices,
timeouts, logging) are the deployment's contract, so they live with the one
command that takes them; the engine is built in the command, never at import,
so ``--help`` stays instant and importing this module imports no JAX
(``tests/test_settings_sources.py::test_the_worker_command_imports_no_jax``)."""

from __future__ import annotations

import asyncio
import functools
import signal
import sys
from typing import Any

import click

from jaxserve.cli.options import engine_option, kv_cache_dtype_option, quantization_option, speculative_options
from jaxserve.cli.price_options import price_options, prices_from_options
from jaxserve.cli.queue_options import amqp_option, prefix_option, redis_url_option, state_dir_option
from jaxserve.engine.args import profile_values

#: the engine settings of ``jaxserve worker``'s default factory (``build_engine``)
_SERVE = profile_values("serve")


#: the flags that are the engine factory's settings (``EngineArgs`` fields),
#: each None unless given: the worker hands the factory the given ones, over
#: its ``--engine-arg`` values; every other option the command does not name
#: is a ``--price-*`` flag
_ENGINE_FLAGS = (
    "model",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "kv_cache_memory",
    "memory_fraction",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "num_speculative_tokens",
    "speculative_method",
    "interactive_reserved_seqs",
    "policy",
    "interactive_batch_prefill_tokens",
)


def _serve_option(*decls: str, field: str, **attrs: Any) -> Any:
    return engine_option(*decls, field=field, profile="serve", forward_unset=True, **attrs)


@click.command("worker")
@amqp_option
@prefix_option
@click.option(
    "--engine",
    "engine_path",
    default="jaxserve.worker.factory:build_engine",
    show_default=True,
    help="Engine factory MODULE:CALLABLE.",
)
@_serve_option("--model", field="model", help="Model path or preset name for the engine factory.")
@click.option(
    "--engine-arg", multiple=True, metavar="KEY=VALUE", help="Keyword argument for the engine factory (repeatable)."
)
@_serve_option(
    "--max-num-seqs", field="max_num_seqs", type=click.IntRange(min=1), help="Sequences in the running batch."
)
@click.option(
    "--max-num-batched-tokens", type=click.IntRange(min=1), default=None, help="Token budget of one engine step."
)
@click.option("--max-model-len", type=click.IntRange(min=2), default=None, help="Prompt + output tokens per request.")
@click.option("--kv-cache-memory", type=click.IntRange(min=1), default=None, help="Bytes for the KV cache.")
@click.option(
    "--memory-fraction",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=None,
    help="Fraction of device memory for weights + KV cache (gpu_memory_utilization).",
)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default=None, help="Default: the checkpoint's.")
@quantization_option
@kv_cache_dtype_option("serve", forward_unset=True)
@speculative_options("serve", forward_unset=True)
@_serve_option(
    "--interactive-reserved-seqs",
    field="interactive_reserved_seqs",
    type=click.IntRange(min=0),
    help="Sequence slots batch jobs may not take (a quarter of --max-num-seqs unless given).",
)
@_serve_option("--policy", field="policy", type=click.Choice(["fcfs", "priority"]), help="Order within a class.")
@_serve_option(
    "--interactive-batch-prefill-tokens",
    field="interactive_batch_prefill_tokens",
    type=click.IntRange(min=0),
    help=f"While interactive jobs are about (waiting, running, or seen in the last "
    f"{_SERVE['interactive_recent_s']:g} s), the batch prompt tokens one engine step may carry, so an "
    "arriving interactive prompt waits for a short step (0: no cap).",
)
@click.option(
    "--metrics-port", type=click.IntRange(1, 65535), default=None, help="Serve Prometheus /metrics on this port."
)
@click.option(
    "--otlp-endpoint",
    default=None,
    metavar="URL",
    help="Trace every job (OpenTelemetry, continuing the producer's traceparent) and export the spans to this "
    "OTLP collector (http/protobuf, e.g. http://127.0.0.1:4318; OTEL_EXPORTER_OTLP_PROTOCOL=grpc for gRPC). "
    "The standard OTEL_* variables configure tracing too; needs jaxserve[otel].",
)
@click.option(
    "--served-model-name",
    multiple=True,
    metavar="NAME",
    help="The model name jobs use in `model` and results carry (default: the model folder's name). Repeat it "
    "for aliases, as vLLM's --served-model-name A B: every name reaches this worker, results carry the first.",
)
@click.option(
    "--default-model",
    default=None,
    metavar="NAME",
    help="The deployment's default model, which jobs without `model` reach (default: the one the broker records, "
    "set by the first worker started on the prefix to its own model; this flag moves it). A worker whose names do "
    "not include it consumes its model's own queues, PREFIX.interactive.MODEL and PREFIX.batch.MODEL.",
)
@click.option(
    "--model-routes/--no-model-routes",
    default=True,
    show_default=True,
    help="Bind this worker's names on PREFIX.models, so producers route jobs by `model` and learn of an unknown "
    "one at once; --no-model-routes: consume the single-model queues only, as before routing.",
)
@click.option(
    "--fallback-model",
    "fallback_models",
    multiple=True,
    metavar="NAME",
    help="The deployment's default fallback_models for interactive jobs that name none: an overloaded job is "
    "re-routed once to the first with room (repeatable).",
)
@click.option(
    "--degrade-max-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="The deployment's default degrade.max_tokens for interactive jobs that name none: an overloaded job "
    "runs with this smaller max_tokens instead.",
)
@click.option(
    "--limits",
    "limits_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Per-tenant limits (YAML: default/tenants with requests_per_s, burst, tokens_per_min, max_in_flight, cost_per_day); shared through Redis with --store redis.",
)
@price_options
@click.option(
    "--target-ttft",
    type=click.FloatRange(min=0.01),
    default=2.0,
    show_default=True,
    help="Interactive admission: refuse (overloaded) a job whose queued prompt tokens could not be prefilled in this many seconds.",
)
@click.option(
    "--max-queued-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Interactive admission: a fixed budget of queued prompt tokens instead of --target-ttft x the measured prefill rate.",
)
@click.option(
    "--store",
    type=click.Choice(["sqlite", "memory", "redis"]),
    default="sqlite",
    show_default=True,
    help="Idempotency store: sqlite (a durable file under --state-dir), memory (per process) or redis (shared).",
)
@state_dir_option(
    "Folder of the sqlite store (default $XDG_STATE_HOME/jaxserve or ~/.local/state/jaxserve; env JAXSERVE_STATE_DIR)."
)
@redis_url_option(
    "Redis for --store redis: results, claims, cancels and tenant limits shared by every worker on it "
    "(env JAXSERVE_REDIS_URL)."
)
@click.option("--heartbeat", type=int, default=30, show_default=True, help="AMQP heartbeat timeout (s).")
@click.option("--interactive-prefetch", type=int, default=None, help="Default: engine max_num_seqs.")
@click.option("--batch-prefetch", type=int, default=None, help="Default: max_num_seqs - interactive_reserved_seqs.")
@click.option(
    "--drain-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="SIGTERM: seconds to finish in-flight jobs before requeueing them.",
)
@click.option("--delivery-limit", type=int, default=10, show_default=True, help="x-delivery-limit of the job queues.")
@click.option(
    "--interactive-max-length",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="x-max-length of the interactive queue: jobs waiting beyond it are refused at publish (reject-publish).",
)
@click.option(
    "--batch-max-length",
    type=click.IntRange(min=1),
    default=1_000_000,
    show_default=True,
    help="x-max-length of the batch queue: jobs waiting beyond it are refused at publish (reject-publish).",
)
@click.option(
    "--interactive-ttl-ms", type=int, default=120_000, show_default=True, help="x-message-ttl of the interactive queue."
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(min=1),
    default=1 << 20,
    show_default=True,
    help="Largest job body accepted; a larger one is answered invalid_request.",
)
@click.option(
    "--claim-lease",
    type=float,
    default=30.0,
    show_default=True,
    help="Lease (s) of a key in progress, renewed while it runs.",
)
@click.option(
    "--store-hold",
    type=click.FloatRange(min=0.0),
    default=10.0,
    show_default=True,
    help="While the store is unreachable (the worker then takes no jobs), seconds a job it holds waits for it before going back to the broker.",
)
@click.option(
    "--save-tokens-every",
    type=click.IntRange(min=0),
    default=16,
    show_default=True,
    help="Save each running job's generated tokens to the store once it has this many unsaved ones "
    "(else every --save-tokens-interval), all jobs in one write: a job whose worker dies continues from them "
    "on the next worker. 0: save nothing.",
)
@click.option(
    "--save-tokens-interval",
    type=click.FloatRange(min=0.01),
    default=1.0,
    show_default=True,
    help="Seconds between two saves of the tokens of running jobs that have fewer than --save-tokens-every unsaved.",
)
@click.option(
    "--reply-timeout",
    type=click.FloatRange(min=0.1),
    default=60.0,
    show_default=True,
    help="Seconds a final reply may take to be confirmed; then the job is requeued (or acked if its destination cannot take it).",
)
@click.option(
    "--engine-hang-timeout",
    type=click.FloatRange(min=1.0),
    default=300.0,
    show_default=True,
    help="An engine step busy longer than this is a hung engine: requeue everything and exit 1.",
)
@click.option(
    "--engine-process/--engine-thread",
    "engine_process",
    default=True,
    show_default=True,
    help="Run the engine in a process of its own (the event loop never waits for the engine's Python "
    "work to release the GIL), or on a thread of the worker's process.",
)
@click.option("--declare/--no-declare", default=True, show_default=True, help="Declare the topology at start.")
@click.option(
    "--log-format",
    type=click.Choice(["console", "json"]),
    default="console",
    show_default=True,
    help="json: one JSON object per line on stderr, whichever library wrote it (for log collectors).",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error", "critical"], case_sensitive=False),
    default="info",
    show_default=True,
    help="Lowest level logged (info: one line per job start and end; libraries log warnings and above unless debug).",
)
@click.option(
    "--log-text/--no-log-text",
    default=False,
    show_default=True,
    help="Log prompts and outputs (off: ids, sizes, timings only).",
)
def worker(
    amqp_url: str,
    prefix: str,
    engine_path: str,
    engine_arg: tuple[str, ...],
    metrics_port: int | None,
    otlp_endpoint: str | None,
    served_model_name: tuple[str, ...],
    default_model: str | None,
    model_routes: bool,
    fallback_models: tuple[str, ...],
    degrade_max_tokens: int | None,
    limits_path: str | None,
    target_ttft: float,
    max_queued_tokens: int | None,
    store: str,
    state_dir: str | None,
    redis_url: str,
    heartbeat: int,
    interactive_prefetch: int | None,
    batch_prefetch: int | None,
    drain_timeout: float,
    delivery_limit: int,
    interactive_max_length: int,
    batch_max_length: int,
    interactive_ttl_ms: int,
    max_body_bytes: int,
    claim_lease: float,
    store_hold: float,
    save_tokens_every: int,
    save_tokens_interval: float,
    reply_timeout: float,
    engine_hang_timeout: float,
    engine_process: bool,
    declare: bool,
    log_format: str,
    log_level: str,
    log_text: bool,
    **options: Any,
) -> None:
    """Serve jobs from PREFIX.interactive and PREFIX.batch."""
    from jaxserve.cli.errors import check_broker, check_port_free, worker_errors
    from jaxserve.wire.topology import Topology
    from jaxserve.worker.admission import AdmissionConfig
    from jaxserve.worker.factory import EngineArgError, build_from_path, check_engine_args
    from jaxserve.worker.limits import LimitsFileError, load_limits
    from jaxserve.worker.logs import configure_logging
    from jaxserve.worker.store import make_store
    from jaxserve.worker.worker import Worker, WorkerConfig

    try:
        limits = None if limits_path is None else load_limits(limits_path)
    except LimitsFileError as exc:
        raise click.ClickException(str(exc)) from None
    engine_flags = {name: options.pop(name) for name in _ENGINE_FLAGS}
    given = {k: v for k, v in engine_flags.items() if v is not None}
    try:  # a bad --engine or --engine-arg is one line now, before anything starts
        kwargs = check_engine_args(engine_path, engine_arg, given)
    except (EngineArgError, ImportError, AttributeError, TypeError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    # model None: --price-* values price whatever this worker serves; a file names its models
    prices = prices_from_options(None, **options)  # the --price-* flags are what is left

    configure_logging(log_format, log_level)
    from jaxserve.worker.tracing import Tracing

    try:
        tracing = Tracing.configure(otlp_endpoint)  # a bad OTEL_* setting is one line now
    except (ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    # Before the engine build (minutes for a real model): a taken port or an
    # unreachable broker is one line now, not a traceback later.
    with worker_errors(amqp_url, log_format):
        if metrics_port is not None:
            check_port_free(metrics_port)
        check_broker(amqp_url)
    topo = Topology(
        prefix=prefix,
        delivery_limit=delivery_limit,
        interactive_max_length=interactive_max_length,
        batch_max_length=batch_max_length,
        interactive_ttl_ms=interactive_ttl_ms,
    )
    cfg = WorkerConfig(
        amqp_url=amqp_url,
        topology=topo,
        heartbeat=heartbeat,
        interactive_prefetch=interactive_prefetch,
        batch_prefetch=batch_prefetch,
        drain_timeout=drain_timeout,
        max_body_bytes=max_body_bytes,
        claim_lease_s=claim_lease,
        store_hold_s=store_hold,
        save_tokens_every=save_tokens_every,
        save_tokens_interval_s=save_tokens_interval,
        reply_timeout_s=reply_timeout,
        engine_hang_timeout_s=engine_hang_timeout,
        engine_process=engine_process,
        log_text=log_text,
        declare=declare,
        metrics_port=metrics_port,
        otlp_endpoint=otlp_endpoint,
        served_model_name=served_model_name[0] if served_model_name else None,
        model_aliases=tuple(served_model_name[1:]),
        default_model=default_model,
        model_routes=model_routes,
        fallback_models=tuple(fallback_models),
        degrade_max_tokens=degrade_max_tokens,
        admission=AdmissionConfig(target_ttft_s=target_ttft, max_queued_tokens=max_queued_tokens),
        limits=limits,
        prices=prices,
    )

    async def main() -> int:
        # Signals first: a SIGTERM during the engine build or warm-up stops
        # the worker before it consumes anything.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        job_store = make_store(store, redis_url=redis_url, namespace=prefix, state_dir=state_dir)
        queue_worker = Worker(
            functools.partial(build_from_path, engine_path, kwargs), cfg, store=job_store, tracing=tracing
        )
        return await queue_worker.run(stop)

    with worker_errors(amqp_url, log_format):
        code = asyncio.run(main())
    if code:
        sys.exit(code)
