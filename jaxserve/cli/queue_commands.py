"""Queue-side CLI commands: ``worker``, ``submit``, ``chat``, ``batch``,
``status`` (module-level click commands; ``jaxserve.cli.main`` registers
them)."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import click
import orjson

from jaxserve.wire.topology import DEFAULT_AMQP_URL, DEFAULT_PREFIX

_amqp_option = click.option(
    "--amqp-url", envvar="JAXSERVE_AMQP_URL", default=DEFAULT_AMQP_URL, show_default=True, help="RabbitMQ URL (env JAXSERVE_AMQP_URL)."
)
_prefix_option = click.option(
    "--prefix", envvar="JAXSERVE_PREFIX", default=DEFAULT_PREFIX, show_default=True, help="Name prefix of queues and exchanges (env JAXSERVE_PREFIX)."
)


def _sampling_options(fn: Any) -> Any:
    for opt in reversed(
        [
            click.option("--max-tokens", type=int, default=None, help="Completion length limit (default: the worker's, 16)."),
            click.option("--temperature", type=float, default=None),
            click.option("--top-p", type=float, default=None),
            click.option("--top-k", type=int, default=None),
            click.option("--seed", type=int, default=None),
            click.option("--stop", multiple=True, help="Stop string (repeatable)."),
            click.option("--model", default=None, help="Model name the worker must serve."),
        ]
    ):
        fn = opt(fn)
    return fn


def _params(max_tokens: Any, temperature: Any, top_p: Any, top_k: Any, seed: Any, stop: tuple, model: Any) -> dict[str, Any]:
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
@click.command("worker")
@_amqp_option
@_prefix_option
@click.option("--engine", "engine_path", default="jaxserve.worker.factory:build_engine", show_default=True, help="Engine factory MODULE:CALLABLE.")
@click.option("--model", default=None, help="Model path for the engine factory.")
@click.option("--engine-arg", multiple=True, metavar="KEY=VALUE", help="Keyword argument for the engine factory (repeatable).")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=None, help="Sequences in the running batch (engine default 32).")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=None, help="Token budget of one engine step.")
@click.option("--max-model-len", type=click.IntRange(min=2), default=None, help="Prompt + output tokens per request.")
@click.option("--kv-cache-memory", type=click.IntRange(min=1), default=None, help="Bytes for the KV cache.")
@click.option("--memory-fraction", type=click.FloatRange(0.0, 1.0, min_open=True), default=None,
              help="Fraction of device memory for weights + KV cache (gpu_memory_utilization).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default=None, help="Default: the checkpoint's.")
@click.option("--interactive-reserved-seqs", type=click.IntRange(min=0), default=None,
              help="Sequence slots batch jobs may not take (default: a quarter of max-num-seqs).")
@click.option("--policy", type=click.Choice(["fcfs", "priority"]), default=None, help="Order within a class (default priority).")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None, help="Serve Prometheus /metrics on this port.")
@click.option("--store", type=click.Choice(["sqlite", "memory", "redis"]), default="sqlite", show_default=True,
              help="Idempotency store: sqlite (a durable file under --state-dir), memory (per process) or redis (shared).")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None, envvar="JAXSERVE_STATE_DIR",
              help="Folder of the sqlite store (default $XDG_STATE_HOME/jaxserve or ~/.local/state/jaxserve; env JAXSERVE_STATE_DIR).")
@click.option("--redis-url", envvar="JAXSERVE_REDIS_URL", default="redis://127.0.0.1:6379/0", show_default=True)
@click.option("--heartbeat", type=int, default=30, show_default=True, help="AMQP heartbeat timeout (s).")
@click.option("--interactive-prefetch", type=int, default=None, help="Default: engine max_num_seqs.")
@click.option("--batch-prefetch", type=int, default=None, help="Default: max_num_seqs - interactive_reserved_seqs.")
@click.option("--drain-timeout", type=float, default=30.0, show_default=True, help="SIGTERM: seconds to finish in-flight jobs before requeueing them.")
@click.option("--delivery-limit", type=int, default=10, show_default=True, help="x-delivery-limit of the job queues.")
@click.option("--interactive-max-length", type=int, default=10_000, show_default=True)
@click.option("--batch-max-length", type=int, default=1_000_000, show_default=True)
@click.option("--interactive-ttl-ms", type=int, default=120_000, show_default=True, help="x-message-ttl of the interactive queue.")
@click.option("--max-body-bytes", type=int, default=1 << 20, show_default=True)
@click.option("--claim-lease", type=float, default=30.0, show_default=True, help="Lease (s) of a key in progress, renewed while it runs.")
@click.option("--reply-timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Seconds a final reply may take to be confirmed; then the job is requeued (or acked if its destination cannot take it).")
@click.option("--engine-hang-timeout", type=click.FloatRange(min=1.0), default=300.0, show_default=True,
              help="An engine step busy longer than this is a hung engine: requeue everything and exit 1.")
@click.option("--declare/--no-declare", default=True, show_default=True, help="Declare the topology at start.")
@click.option("--log-format", type=click.Choice(["console", "json"]), default="console", show_default=True)
@click.option("--log-level", default="info", show_default=True)
@click.option("--log-text/--no-log-text", default=False, show_default=True, help="Log prompts and outputs (off: ids, sizes, timings only).")
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
    interactive_reserved_seqs: int | None,
    policy: str | None,
    metrics_port: int | None,
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
    reply_timeout: float,
    engine_hang_timeout: float,
    declare: bool,
    log_format: str,
    log_level: str,
    log_text: bool,
) -> None:
    """Serve jobs from PREFIX.interactive and PREFIX.batch."""
    from jaxserve.worker.factory import load_factory, parse_engine_args
    from jaxserve.wire.topology import Topology, TopologyMismatch
    from jaxserve.worker.logs import configure_logging
    from jaxserve.worker.store import make_store
    from jaxserve.worker.worker import Worker, WorkerConfig

    configure_logging(log_format, log_level)
    factory = load_factory(engine_path)
    kwargs = parse_engine_args(engine_arg)
    if model is not None:
        kwargs["model"] = model
    flags = dict(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        kv_cache_memory=kv_cache_memory, memory_fraction=memory_fraction, dtype=dtype,
        interactive_reserved_seqs=interactive_reserved_seqs, policy=policy,
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
        reply_timeout_s=reply_timeout,
        engine_hang_timeout_s=engine_hang_timeout,
        log_text=log_text,
        declare=declare,
        metrics_port=metrics_port,
    )

    async def main() -> int:
        # Signals first: a SIGTERM during the engine build or warm-up stops
        # the worker before it consumes anything.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        st = make_store(store, redis_url=redis_url, namespace=prefix, state_dir=state_dir)
        w = Worker(lambda: factory(**kwargs), cfg, store=st)
        return await w.run(stop)

    try:
        code = asyncio.run(main())
    except TopologyMismatch as exc:
        raise click.ClickException(str(exc)) from None
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
@_sampling_options
def submit(prompt: str, amqp_url: str, prefix: str, queue: str, chat: bool, stream: bool, key: str | None, timeout: float, expiration: float | None, as_json: bool, **sp: Any) -> None:
    """Submit one job and print its result (PROMPT '-' reads stdin)."""
    from jaxserve.client import AsyncClient, JobError

    if prompt == "-":
        prompt = sys.stdin.read()
    params = _params(**sp)
    text_kw: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}

    async def main() -> int:
        client = await AsyncClient(amqp_url, prefix=prefix, name="jaxserve-submit").connect()
        try:
            if stream:
                s = await client.stream(**text_kw, queue=queue, key=key, timeout=timeout, expiration=expiration, **params)
                try:
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

    sys.exit(asyncio.run(main()))


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
        history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
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
                s = await client.stream(messages=history, queue="interactive", timeout=timeout, **params)
                try:
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
def _job_from_line(raw: dict[str, Any], lineno: int, line: bytes) -> tuple[str, dict[str, Any], str | None]:
    """(key, job body, custom_id) from one input line: an OpenAI Batch API
    line (``custom_id`` + ``body``) or a plain job body (key from ``id`` /
    ``message_id`` / ``custom_id``, else derived from the line)."""
    if "custom_id" in raw and isinstance(raw.get("body"), dict):
        body = dict(raw["body"])
        body.pop("stream", None)
        return str(raw["custom_id"]), body, str(raw["custom_id"])
    body = dict(raw)
    key = body.pop("message_id", None) or body.pop("id", None) or body.pop("custom_id", None)
    if key is None:
        key = f"line{lineno}-{hashlib.sha256(line).hexdigest()[:16]}"
    body.pop("stream", None)
    return str(key), body, None


@click.command("batch")
@click.argument("input_path", metavar="INPUT.jsonl", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", "output_path", required=True, type=click.Path(dir_okay=False), help="OUT.jsonl (appended; keys already in it are skipped).")
@_amqp_option
@_prefix_option
@click.option("--queue", type=click.Choice(["interactive", "batch"]), default="batch", show_default=True)
@click.option("--max-in-flight", type=int, default=512, show_default=True, help="Jobs published but not answered yet.")
@click.option("--idle-timeout", type=float, default=600.0, show_default=True, help="Give up when no result arrives for this long.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def batch(input_path: str, output_path: str, amqp_url: str, prefix: str, queue: str, max_in_flight: int, idle_timeout: float, progress: bool) -> None:
    """Run every line of INPUT.jsonl as a job; write one result per key to OUT.

    Resumable: a rerun skips keys already in OUT. OpenAI Batch API lines
    (custom_id, method, url, body) are accepted; custom_id is the key."""
    from tqdm import tqdm

    from jaxserve.client import AsyncClient, QueueFull, retry_with_backoff

    done: set[str] = set()
    if os.path.exists(output_path):
        with open(output_path, "rb") as f:
            for line in f:
                try:
                    rec = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # a torn last line from a crash
                if isinstance(rec, dict) and rec.get("id") is not None:
                    done.add(str(rec["id"]))

    jobs: list[tuple[str, dict[str, Any], str | None]] = []
    seen: set[str] = set()
    bad_lines = 0
    with open(input_path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                raw = orjson.loads(line)
                if not isinstance(raw, dict):
                    raise ValueError("not an object")
            except (orjson.JSONDecodeError, ValueError):
                bad_lines += 1
                click.echo(f"line {lineno}: not a JSON object, skipped", err=True)
                continue
            key, body, custom_id = _job_from_line(raw, lineno, line)
            if key in seen:
                continue
            seen.add(key)
            if key not in done:
                jobs.append((key, body, custom_id))
    skipped = len(seen) - len(jobs)
    # A durable reply queue named after OUT: results that arrive while this
    # command is down wait there for the rerun.
    reply_queue = f"{prefix}.reply.batch-{hashlib.sha256(os.path.abspath(output_path).encode()).hexdigest()[:16]}"
    pending = {k: c for k, _, c in jobs}
    counts: collections.Counter = collections.Counter()

    async def main() -> int:
        out = open(output_path, "ab")
        bar = tqdm(total=len(jobs), disable=not progress, unit="job", file=sys.stderr)
        window = asyncio.Semaphore(max_in_flight)
        last_result = [time.monotonic()]
        all_done = asyncio.Event()
        if not jobs:
            all_done.set()

        async def on_final(msg: Any) -> None:
            key = msg.id
            if key not in pending:
                return  # a duplicate (at-least-once) or a key of another run
            custom_id = pending.pop(key)
            rec = msg.to_dict()
            if custom_id is not None:
                rec["custom_id"] = custom_id
            out.write(orjson.dumps(rec) + b"\n")
            out.flush()
            counts["ok" if msg.ok else (msg.error.code if msg.error else "unknown")] += 1
            last_result[0] = time.monotonic()
            bar.update(1)
            window.release()
            if not pending:
                all_done.set()

        client = AsyncClient(amqp_url, prefix=prefix, reply_queue=reply_queue, reply_queue_expires_ms=86_400_000, on_unclaimed=on_final, name="jaxserve-batch")
        await client.connect()
        try:
            def idle() -> bool:
                return time.monotonic() - last_result[0] > idle_timeout

            async def take_slot() -> bool:
                """A place in the in-flight window, unless results stop
                coming for --idle-timeout (a full window must not hang)."""
                while True:
                    try:
                        await asyncio.wait_for(window.acquire(), 1.0)
                        return True
                    except asyncio.TimeoutError:
                        if idle():
                            return False

            for key, body, _ in jobs:
                if not await take_slot():
                    click.echo(f"no result for {idle_timeout:g}s with {max_in_flight} jobs in flight; giving up", err=True)
                    break
                if key not in pending:  # answered by a leftover reply already
                    window.release()
                    continue
                await retry_with_backoff(lambda: client.publish(body, key=key, queue=queue, expect_reply=False), attempts=30, max_delay=5.0, retry_on=(QueueFull,))
            while not all_done.is_set():
                try:
                    await asyncio.wait_for(all_done.wait(), 1.0)
                except asyncio.TimeoutError:
                    if idle():
                        break
        finally:
            bar.close()
            out.close()
            if not pending:
                try:
                    await client.delete_reply_queue()
                except Exception:  # noqa: BLE001
                    pass
            await client.close()
        return len(pending)

    missing = asyncio.run(main())
    errors = {k: v for k, v in counts.items() if k != "ok"}
    summary = {"ok": counts.get("ok", 0), "errors": errors, "skipped_already_done": skipped, "bad_lines": bad_lines, "missing": missing}
    click.echo(f"batch summary: {json.dumps(summary)}", err=True)
    if missing:
        sys.exit(2)


# --------------------------------------------------------------------- status
@click.command("status")
@_amqp_option
@_prefix_option
@click.option("--json", "as_json", is_flag=True)
@click.option("--broker-details/--no-broker-details", default=None, help="Add unacked counts from rabbitmqctl (default: when on PATH).")
def status(amqp_url: str, prefix: str, as_json: bool, broker_details: bool | None) -> None:
    """Queue depths, consumers and dead letters."""
    import shutil
    import subprocess

    from jaxserve.client import AsyncClient

    async def main() -> dict[str, dict[str, int]]:
        client = AsyncClient(amqp_url, prefix=prefix, name="jaxserve-status")
        import aio_pika

        conn = await aio_pika.connect(amqp_url)
        client._sub_conn = conn  # only passive declares are needed
        try:
            return await client.queue_depths()
        finally:
            await conn.close()

    depths = asyncio.run(main())
    if broker_details is None:
        broker_details = shutil.which("rabbitmqctl") is not None
    if broker_details:
        try:
            out = subprocess.run(
                ["rabbitmqctl", "-q", "list_queues", "name", "messages_unacknowledged"], capture_output=True, text=True, timeout=20, check=True
            ).stdout
            for line in out.splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0] in depths and parts[1].isdigit():
                    depths[parts[0]]["unacked"] = int(parts[1])
        except (subprocess.SubprocessError, OSError):
            pass
    if as_json:
        click.echo(json.dumps(depths))
        return
    click.echo(f"{'queue':40s} {'ready':>9s} {'unacked':>9s} {'consumers':>9s}")
    for name, d in depths.items():
        if d["messages"] < 0:
            click.echo(f"{name:40s} {'(missing)':>9s}")
            continue
        click.echo(f"{name:40s} {d['messages']:>9d} {str(d.get('unacked', '-')):>9s} {d['consumers']:>9d}")
    dead = depths.get(f"{prefix}.dead", {}).get("messages", 0)
    if dead > 0:
        click.echo(f"\n{dead} dead letter(s) in {prefix}.dead (x-first-death-reason says why)")


__all__ = ["worker", "submit", "chat", "batch", "status"]
