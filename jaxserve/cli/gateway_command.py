"""``jaxserve gateway``: the OpenAI-compatible HTTP door onto the queues
(``jaxserve.gateway``; docs/gateway.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from jaxserve.cli.queue_options import amqp_option, prefix_option, redis_url_option, state_dir_option


@click.command("gateway")
@amqp_option
@prefix_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@state_dir_option(
    "Folder of the gateway's SQLite store and files, as the worker's (default $XDG_STATE_HOME/jaxserve or "
    "~/.local/state/jaxserve; env JAXSERVE_STATE_DIR)."
)
@click.option(
    "--store",
    type=click.Choice(["sqlite", "redis"]),
    default="sqlite",
    show_default=True,
    help="Where batches and file records live: sqlite (under --state-dir, one gateway) or redis (shared by "
    "replicas; give them one --files-dir).",
)
@redis_url_option()
@click.option(
    "--files-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder of uploaded and output files (default: under --state-dir); replicas share one.",
)
@click.option(
    "--keys",
    "keys_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    envvar="JAXSERVE_GATEWAY_KEYS",
    help="API keys file (YAML: keys: {KEY: {tenant, priority, models}}). Without it the gateway is open and "
    "every request is tenant 'default'.",
)
@click.option(
    "--management-url",
    default=None,
    envvar="JAXSERVE_MANAGEMENT_URL",
    help="RabbitMQ management API (http://user:pass@host:15672) for model names, depths and rates; without it "
    "the gateway asks rabbitmqctl when on PATH.",
)
@click.option(
    "--request-timeout",
    "request_timeout_s",
    type=click.FloatRange(min=1.0),
    default=600.0,
    show_default=True,
    help="Seconds a chat or completion request may wait for its answer (504 after, the job cancelled).",
)
@click.option(
    "--batch-max-in-flight",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Jobs of one batch published and not answered yet.",
)
@click.option(
    "--batch-lease",
    "lease_s",
    type=click.FloatRange(min=1.0),
    default=30.0,
    show_default=True,
    help="Seconds a gateway holds a batch without renewing it; a batch whose gateway died is taken over after this.",
)
@click.option(
    "--broker-poll",
    "broker_poll_s",
    type=click.FloatRange(min=0.5),
    default=5.0,
    show_default=True,
    help="Seconds between two looks at the broker's models and queues (status page, /metrics, 503s).",
)
@click.option("--owned-by", default="jaxserve", show_default=True, help="owned_by of the models /v1/models lists.")
@click.option("--log-format", type=click.Choice(["console", "json"]), default="console", show_default=True)
@click.option("--log-level", default="info", show_default=True)
def gateway(
    amqp_url: str,
    host: str,
    port: int,
    state_dir: str | None,
    files_dir: str | None,
    keys_path: str | None,
    log_format: str,
    log_level: str,
    **settings: Any,
) -> None:
    """Serve OpenAI's API (chat and completions, streamed or not; models;
    files and batches) over the workers' queues, with a status page at /."""
    # ``settings``: the options named as the ``GatewayConfig`` field they set, passed on as given
    import uvicorn

    from jaxserve.cli.errors import broker_errors, check_broker, check_port_free
    from jaxserve.gateway.app import GatewayConfig, create_app
    from jaxserve.gateway.keys import KeyRing, KeysFileError
    from jaxserve.worker.logs import configure_logging
    from jaxserve.worker.store.sqlite import default_state_dir

    configure_logging(log_format, log_level)
    if keys_path is not None:
        try:
            KeyRing.load(keys_path)  # a bad keys file stops the start with one line naming the entry
        except KeysFileError as exc:
            raise click.ClickException(str(exc)) from None
    check_port_free(port, host, "--port")
    check_broker(amqp_url)
    config = GatewayConfig(
        amqp_url=amqp_url,
        state_dir=Path(state_dir) if state_dir else default_state_dir(),
        files_dir=Path(files_dir) if files_dir else None,
        keys_path=Path(keys_path) if keys_path else None,
        **settings,
    )
    with broker_errors(amqp_url):
        uvicorn.run(
            create_app(config),
            host=host,
            port=port,
            log_config=None,  # the process's structlog handler renders uvicorn's records too
            access_log=False,  # one gateway_request line per request instead
            timeout_graceful_shutdown=10,
        )
