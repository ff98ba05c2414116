"""Turn the errors a user can cause (bad model path, bad config, a broker that
is not there, a port that is taken) into one clean line on stderr instead of
a traceback.

The queue commands use:

* :func:`broker_errors` around the code that talks to RabbitMQ: a refused or
  failed connection, a refused login, a lost connection become one
  ``Error: ...`` line (exit status 1). It also mutes aiormq/aio-pika's own
  log records of the failed connect, which carry a traceback of their own.
* :func:`check_broker`: connect once and close, before anything slow (the
  worker checks before it builds the engine).
* :func:`check_port_free`: the metrics port, before the engine build.
* :func:`model_errors`: a model folder or preset that cannot be loaded.
* :func:`worker_errors`: all of the above for ``jaxserve worker``; with
  ``--log-format json`` the error is one JSON log line instead, so the
  worker's stderr stays JSON only.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import sys
from collections.abc import Iterator

import click

# Loggers that report every failed connection attempt with a traceback.
_AMQP_LOGGERS = ("aiormq", "aio_pika")


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    from jaxserve.models.errors import ModelLoadError
    from jaxserve.presets import PresetError
    from jaxserve.tokenizer.tokenizer import TokenizerLoadError

    try:
        yield
    except (ModelLoadError, PresetError, TokenizerLoadError, FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc


@contextlib.contextmanager
def model_errors() -> Iterator[None]:
    """A model that cannot be loaded (unknown preset, missing folder, broken
    config, weights or tokenizer): one line. Narrower than
    :func:`user_errors`, for code that runs much more than the model load."""
    from jaxserve.models.errors import ModelLoadError
    from jaxserve.presets import PresetError
    from jaxserve.tokenizer.tokenizer import TokenizerLoadError

    try:
        yield
    except (ModelLoadError, PresetError, TokenizerLoadError) as exc:
        raise click.ClickException(f"cannot load the model: {exc}") from None


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for messages)."""
    from yarl import URL

    try:
        parsed = URL(url)
    except (TypeError, ValueError):
        return "(unparsable URL)"
    return str(parsed.with_password("***")) if parsed.password else str(parsed)


@contextlib.contextmanager
def muted_amqp_logs() -> Iterator[None]:
    """Raise aiormq's and aio-pika's loggers to CRITICAL for the block."""
    loggers = [logging.getLogger(name) for name in _AMQP_LOGGERS]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, saved):
            lg.setLevel(level)


@contextlib.contextmanager
def broker_errors(amqp_url: str, *, mute: bool = True) -> Iterator[None]:
    """RabbitMQ unreachable, login refused, connection lost: one line.

    ``mute`` (default) silences aiormq/aio-pika's log records for the block;
    pass ``mute=False`` around a long run whose reconnect warnings matter
    (and call :func:`check_broker` first, muted, for the start-up case)."""
    import aiormq.exceptions

    where = redact_url(amqp_url)
    with muted_amqp_logs() if mute else contextlib.nullcontext():
        try:
            yield
        except aiormq.exceptions.ProbableAuthenticationError as exc:
            raise click.ClickException(
                f"RabbitMQ at {where} refused the login ({_reason(exc)}); check the user and password in --amqp-url / JAXSERVE_AMQP_URL"
            ) from None
        except (aiormq.exceptions.AMQPConnectionError, ConnectionError, socket.gaierror) as exc:
            raise click.ClickException(
                f"cannot reach RabbitMQ at {where} ({_reason(exc)}); start it or point --amqp-url / JAXSERVE_AMQP_URL at it"
            ) from None


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())  # one line, whatever the library put in
    return text or type(exc).__name__


def check_broker(amqp_url: str, timeout: float = 15.0) -> None:
    """Open one connection to ``amqp_url`` and close it; a click error
    (one line) when that fails or takes longer than ``timeout`` seconds."""
    import aio_pika

    async def probe() -> None:
        conn = await asyncio.wait_for(
            aio_pika.connect(amqp_url, client_properties={"connection_name": "jaxserve-check"}), timeout
        )
        await conn.close()

    with broker_errors(amqp_url):
        try:
            asyncio.run(probe())
        except TimeoutError:
            raise click.ClickException(
                f"cannot reach RabbitMQ at {redact_url(amqp_url)} (no answer within {timeout:g}s); "
                "start it or point --amqp-url / JAXSERVE_AMQP_URL at it"
            ) from None


def check_port_free(port: int, addr: str = "0.0.0.0", what: str = "--metrics-port") -> None:
    """A click error (one line) when ``addr:port`` cannot be bound now."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # The same option the HTTP server sets, so a port in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise click.ClickException(
                f"{what} {port} is already in use on {addr}; pick another port or stop what holds it"
            ) from None
        raise click.ClickException(f"cannot listen on {addr}:{port} for {what}: {_reason(exc)}") from None
    finally:
        sock.close()


@contextlib.contextmanager
def worker_errors(amqp_url: str, log_format: str = "console") -> Iterator[None]:
    """``jaxserve worker``: broker, model, metrics port and topology errors as
    one line. With ``log_format`` json the line is a JSON log record
    (``worker_failed``) and the process exits 1; otherwise click's
    ``Error: ...``."""
    from jaxserve.metrics import MetricsPortInUse
    from jaxserve.wire.topology import TopologyMismatch
    from jaxserve.worker.factory import EngineArgError
    from jaxserve.worker.routing import DefaultModelConflict

    try:
        with broker_errors(amqp_url, mute=False), model_errors():
            try:
                yield
            except MetricsPortInUse as exc:
                raise click.ClickException(
                    f"{exc.strerror}; pick another --metrics-port or stop what holds it"
                ) from None
            except (TopologyMismatch, DefaultModelConflict, EngineArgError) as exc:
                raise click.ClickException(str(exc)) from None
    except click.ClickException as exc:
        if log_format != "json":
            raise
        import structlog

        structlog.get_logger("jaxserve.worker").error("worker_failed", error=exc.format_message())
        sys.exit(exc.exit_code)
