"""Queue-side CLI commands: ``worker``, ``submit``, ``chat``, ``batch``,
``status`` (module-level click commands; ``jaxserve.cli.main`` registers
them)."""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import sys
from typing import Any

import click

from jaxserve.cli.options import engine_option, quantization_option
from jaxserve.cli.price_options import price_options, prices_from_options
from jaxserve.engine.args import profile_values
from jaxserve.wire.topology import DEFAULT_AMQP_URL, DEFAULT_PREFIX

_amqp_option = click.option(
    "--amqp-url",
    envvar="JAXSERVE_AMQP_URL",
    default=DEFAULT_AMQP_URL,
    show_default=True,
    help="RabbitMQ URL (env JAXSERVE_AMQP_URL).",
)
_prefix_option = click.option(
    "--prefix",
    envvar="JAXSERVE_PREFIX",
    default=DEFAULT_PREFIX,
    show_default=True,
    help="Name prefix of queues and exchanges (env JAXSERVE_PREFIX).",
)


def _sampling_options(fn: Any) -> Any:
    for opt in reversed(
        [
            click.option(
                "--max-tokens", type=int, default=None, help="Completion length limit (default: the worker's, 16)."
            ),
            click.option("--temperature", type=float, default=None),
            click.option("--top-p", type=float, default=None),
            click.option("--top-k", type=int, default=None),
            click.option("--seed", type=int, default=None),
            click.option("--stop", multiple=True, help="Stop string (repeatable)."),
            click.option(
                "--model",
                default=None,
                help="Model to run the job: routes it to the workers serving that name (default: the deployment's "
                "default model); a model nobody serves is unknown_model at once.",
            ),
        ]
    ):
        fn = opt(fn)
    return fn


def _params(
    max_tokens: Any, temperature: Any, top_p: Any, top_k: Any, seed: Any, stop: tuple, model: Any
) -> dict[str, Any]:
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop": list(stop) or None,
        "model": model,
    }


# --------------------------------------------------------------------- worker
#: the engine settings of ``jaxserve worker``'s default factory (``build_engine``)
_SERVE = profile_values("serve")


def _serve_option(*decls: str, field: str, **attrs: Any) -> Any:
    return engine_option(*decls, field=field, profile="serve", forward_unset=True, **attrs)


@click.command("worker")
@_amqp_option
@_prefix_option
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
    help="The deployment's default model, which jobs without `model` reach (default: this worker's). A worker "
    "whose names do not include it consumes its model's own queues, PREFIX.interactive.MODEL and PREFIX.batch.MODEL.",
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
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    default=None,
    envvar="JAXSERVE_STATE_DIR",
    help="Folder of the sqlite store (default $XDG_STATE_HOME/jaxserve or ~/.local/state/jaxserve; env JAXSERVE_STATE_DIR).",
)
@click.option("--redis-url", envvar="JAXSERVE_REDIS_URL", default="redis://127.0.0.1:6379/0", show_default=True)
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
@click.option("--interactive-max-length", type=int, default=10_000, show_default=True)
@click.option("--batch-max-length", type=int, default=1_000_000, show_default=True)
@click.option(
    "--interactive-ttl-ms", type=int, default=120_000, show_default=True, help="x-message-ttl of the interactive queue."
)
@click.option("--max-body-bytes", type=int, default=1 << 20, show_default=True)
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
@click.option("--log-format", type=click.Choice(["console", "json"]), default="console", show_default=True)
@click.option("--log-level", default="info", show_default=True)
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
    model: str | None,
    engine_arg: tuple[str, ...],
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    max_model_len: int | None,
    kv_cache_memory: int | None,
    memory_fraction: float | None,
    dtype: str | None,
    quantization: str | None,
    interactive_reserved_seqs: int | None,
    policy: str | None,
    interactive_batch_prefill_tokens: int | None,
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
    reply_timeout: float,
    engine_hang_timeout: float,
    engine_process: bool,
    declare: bool,
    log_format: str,
    log_level: str,
    log_text: bool,
    **price_kwargs: Any,
) -> None:
    """Serve jobs from PREFIX.interactive and PREFIX.batch."""
    from jaxserve.cli.errors import check_broker, check_port_free, worker_errors
    from jaxserve.wire.topology import Topology
    from jaxserve.worker.admission import AdmissionConfig
    from jaxserve.worker.factory import build_from_path, load_factory, parse_engine_args
    from jaxserve.worker.limits import LimitsFileError, load_limits
    from jaxserve.worker.logs import configure_logging
    from jaxserve.worker.store import make_store
    from jaxserve.worker.worker import Worker, WorkerConfig

    try:
        limits = None if limits_path is None else load_limits(limits_path)
    except LimitsFileError as exc:
        raise click.ClickException(str(exc)) from None
    # model None: --price-* values price whatever this worker serves; a file names its models
    prices = prices_from_options(None, **price_kwargs)

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
    load_factory(engine_path)  # a bad --engine is one line now, before anything starts
    kwargs = parse_engine_args(engine_arg)
    if model is not None:
        kwargs["model"] = model
    flags = dict(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        kv_cache_memory=kv_cache_memory,
        memory_fraction=memory_fraction,
        dtype=dtype,
        quantization=quantization,
        interactive_reserved_seqs=interactive_reserved_seqs,
        policy=policy,
        interactive_batch_prefill_tokens=interactive_batch_prefill_tokens,
    )
    kwargs.update({k: v for k, v in flags.items() if v is not None})
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
        st = make_store(store, redis_url=redis_url, namespace=prefix, state_dir=state_dir)
        w = Worker(functools.partial(build_from_path, engine_path, kwargs), cfg, store=st, tracing=tracing)
        return await w.run(stop)

    with worker_errors(amqp_url, log_format):
        code = asyncio.run(main())
    if code:
        sys.exit(code)


# --------------------------------------------------------------------- submit
@click.command("submit")
@click.argument("prompt")
@_amqp_option
@_prefix_option
@click.option("--queue", type=click.Choice(["interactive", "batch"]), default="interactive", show_default=True)
@click.option("--chat", is_flag=True, help="Send PROMPT as one user message (chat template) instead of a raw prompt.")
@click.option("--stream/--no-stream", default=False, show_default=True, help="Print text deltas as they arrive.")
@click.option("--key", default=None, help="Idempotency key (AMQP message_id); default: random.")
@click.option("--timeout", type=float, default=300.0, show_default=True)
@click.option("--expiration", type=float, default=None, help="Seconds the job may wait in the queue.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole final result as JSON.")
@click.option(
    "--fallback-model",
    "fallback_models",
    multiple=True,
    metavar="NAME",
    help="Re-route the job once to the first of these models with room when its model is overloaded (repeatable).",
)
@click.option(
    "--degrade-max-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Accept this smaller max_tokens instead of overloaded.",
)
@_sampling_options
def submit(
    prompt: str,
    amqp_url: str,
    prefix: str,
    queue: str,
    chat: bool,
    stream: bool,
    key: str | None,
    timeout: float,
    expiration: float | None,
    as_json: bool,
    fallback_models: tuple[str, ...],
    degrade_max_tokens: int | None,
    **sp: Any,
) -> None:
    """Submit one job and print its result (PROMPT '-' reads stdin)."""
    from jaxserve.client import AsyncClient, JobError

    if prompt == "-":
        prompt = sys.stdin.read()
    params = _params(**sp)
    params["fallback_models"] = list(fallback_models) or None
    params["degrade"] = None if degrade_max_tokens is None else {"max_tokens": degrade_max_tokens}
    text_kw: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}

    async def main() -> int:
        client = await AsyncClient(amqp_url, prefix=prefix, name="jaxserve-submit").connect()
        try:
            if stream:
                try:  # an unknown model is refused at the publish, before any chunk
                    s = await client.stream(
                        **text_kw, queue=queue, key=key, timeout=timeout, expiration=expiration, **params
                    )
                    async for delta in s:
                        if not as_json:
                            click.echo(delta, nl=False)
                except JobError as exc:
                    click.echo(json.dumps(exc.result.raw) if as_json else f"error: {exc}", err=not as_json)
                    return 1
                if as_json:
                    click.echo(json.dumps(s.result.raw if s.result else None))
                else:
                    click.echo()
                return 0
            r = await client.submit(**text_kw, queue=queue, key=key, timeout=timeout, expiration=expiration, **params)
            if as_json:
                click.echo(json.dumps(r.raw))
            elif r.ok:
                click.echo(r.text)
            else:
                click.echo(f"error: {r.error}", err=True)
            return 0 if r.ok else 1
        finally:
            await client.delete_reply_queue()
            await client.close()

    from jaxserve.cli.errors import broker_errors
    from jaxserve.client import QueueError

    with broker_errors(amqp_url):
        try:
            code = asyncio.run(main())
        except (
            QueueError,
            TimeoutError,
        ) as exc:  # no queue (no worker with this prefix), full queue, no result in time
            raise click.ClickException(str(exc)) from None
    sys.exit(code)


# ----------------------------------------------------------------------- chat
@click.command("chat")
@_amqp_option
@_prefix_option
@click.option("--system", default=None, help="System message.")
@click.option("--timeout", type=float, default=300.0, show_default=True)
@_sampling_options
def chat(amqp_url: str, prefix: str, system: str | None, timeout: float, **sp: Any) -> None:
    """Chat on the interactive queue, streaming tokens to the terminal.
    Empty line or EOF ends; '/reset' clears the history."""
    from jaxserve.client import AsyncClient, JobError

    params = _params(**sp)

    async def main() -> None:
        client = await AsyncClient(amqp_url, prefix=prefix, name="jaxserve-chat").connect()
        history: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        interactive = sys.stdin.isatty()
        try:
            while True:
                if interactive:
                    click.echo("> ", nl=False)
                line = await asyncio.to_thread(sys.stdin.readline)
                if not line or not line.strip():
                    return
                line = line.rstrip("\n")
                if line.strip() == "/reset":
                    history = history[:1] if system else []
                    continue
                history.append({"role": "user", "content": line})
                try:  # an unknown model is refused at the publish (UnknownModel), before any chunk
                    s = await client.stream(messages=history, queue="interactive", timeout=timeout, **params)
                    async for delta in s:
                        click.echo(delta, nl=False)
                except JobError as exc:
                    click.echo(f"\n[error {exc.code}: {exc}]", err=True)
                    history.pop()
                    continue
                click.echo()
                history.append({"role": "assistant", "content": s.result.text if s.result else s.text})
        finally:
            await client.delete_reply_queue()
            await client.close()

    asyncio.run(main())


# ---------------------------------------------------------------------- batch
from jaxserve.cli.batch_command import batch  # noqa: E402 - the command lives in its own module


# --------------------------------------------------------------------- status
def _job_queues(prefix: str, models: tuple[str, ...], listed: dict[str, int]) -> list[tuple[str | None, str, str]]:
    """(model, class, queue) of every job queue to show: the default
    model's (model None), each ``--model``'s, and every other model's queue
    rabbitmqctl lists (named by its queue-safe part, ``Topology.model_queue``)."""
    from jaxserve.wire.topology import QUEUE_CLASSES, Topology

    topo = Topology(prefix=prefix)
    rows: dict[str, tuple[str | None, str, str]] = {}
    for qc in QUEUE_CLASSES:
        rows[topo.queue_for(qc)] = (None, qc, topo.queue_for(qc))
    for model in models:
        for qc in QUEUE_CLASSES:
            name = topo.model_queue(qc, model)
            rows[name] = (model, qc, name)
    for name in sorted(listed):
        for qc in QUEUE_CLASSES:
            base = topo.queue_for(qc) + "."
            if name.startswith(base) and name not in rows:
                rows[name] = (name[len(base) :], qc, name)
    return sorted(rows.values(), key=lambda r: (r[0] is not None, r[0] or "", r[1]))


@click.command("status")
@_amqp_option
@_prefix_option
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--broker-details/--no-broker-details",
    default=None,
    help="Add unacked counts from rabbitmqctl and find every model's queues (default: when on PATH).",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="NAME",
    help="Also show this model's queues (repeatable; with --broker-details every model's are found).",
)
def status(amqp_url: str, prefix: str, as_json: bool, broker_details: bool | None, models: tuple[str, ...]) -> None:
    """Queue depths, consumers and dead letters, per served model."""
    import shutil
    import subprocess

    from jaxserve.client import AsyncClient

    if broker_details is None:
        broker_details = shutil.which("rabbitmqctl") is not None
    listed: dict[str, int] = {}  # queue -> unacked, from rabbitmqctl
    if broker_details:
        try:
            out = subprocess.run(
                ["rabbitmqctl", "-q", "list_queues", "name", "messages_unacknowledged"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout
            for line in out.splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0].startswith(prefix + ".") and parts[1].isdigit():
                    listed[parts[0]] = int(parts[1])
        except (subprocess.SubprocessError, OSError):
            pass
    job_queues = _job_queues(prefix, models, listed)

    async def main() -> dict[str, dict[str, Any]]:
        client = AsyncClient(amqp_url, prefix=prefix, name="jaxserve-status")
        import aio_pika

        conn = await aio_pika.connect(amqp_url)
        client._sub_conn = conn  # only passive declares are needed
        try:
            return dict(await client.queue_depths([name for _, _, name in job_queues]))
        finally:
            await conn.close()

    from jaxserve.cli.errors import broker_errors

    with broker_errors(amqp_url):
        depths = asyncio.run(main())
    for name, d in depths.items():
        if name in listed:
            d["unacked"] = listed[name]
    for model, qc, name in job_queues:
        depths[name].update({"model": model, "class": qc})
    if as_json:
        click.echo(json.dumps(depths))
        return
    click.echo(f"{'model':24s} {'class':11s} {'queue':48s} {'ready':>9s} {'unacked':>9s} {'consumers':>9s}")
    rows = [(model or "(default)", qc, name) for model, qc, name in job_queues]
    rows += [("-", "dead", f"{prefix}.dead"), ("-", "results", f"{prefix}.results")]
    idle: list[str] = []
    for label, qc, name in rows:
        d = depths[name]
        if d["messages"] < 0:
            click.echo(f"{label:24s} {qc:11s} {name:48s} {'(missing)':>9s}")
            continue
        click.echo(
            f"{label:24s} {qc:11s} {name:48s} {d['messages']:>9d} {str(d.get('unacked', '-')):>9s} {d['consumers']:>9d}"
        )
        if qc in ("interactive", "batch") and d["consumers"] == 0:
            idle.append(name)
    if idle:
        click.echo(f"\nno consumer on {', '.join(idle)}: jobs routed there wait for a worker")
    dead = depths.get(f"{prefix}.dead", {}).get("messages", 0)
    if dead > 0:
        click.echo(f"\n{dead} dead letter(s) in {prefix}.dead (x-first-death-reason says why)")


__all__ = ["worker", "submit", "chat", "batch", "status"]
