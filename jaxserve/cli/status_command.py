"""``jaxserve status``: depth, consumers and dead letters of every served
model's job queues (passive declares; ``rabbitmqctl`` adds unacked counts and
finds the models nobody named)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import click

from jaxserve.cli.queue_options import amqp_option, prefix_option


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
@amqp_option
@prefix_option
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
