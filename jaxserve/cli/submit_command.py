"""``jaxserve submit`` and ``jaxserve chat``: a producer's view of the queue
from the terminal (one job, or a conversation streamed token by token).
Together because both are thin loops over :class:`jaxserve.client.AsyncClient`
with the same sampling options (``jaxserve.cli.queue_options``)."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import click

from jaxserve.cli.queue_options import amqp_option, prefix_option, sampling_options, sampling_params


@click.command("submit")
@click.argument("prompt")
@amqp_option
@prefix_option
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
@sampling_options
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
    params = sampling_params(**sp)
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
@amqp_option
@prefix_option
@click.option("--system", default=None, help="System message.")
@click.option("--timeout", type=float, default=300.0, show_default=True)
@sampling_options
def chat(amqp_url: str, prefix: str, system: str | None, timeout: float, **sp: Any) -> None:
    """Chat on the interactive queue, streaming tokens to the terminal.
    Empty line or EOF ends; '/reset' clears the history."""
    from jaxserve.client import AsyncClient, JobError

    params = sampling_params(**sp)

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
