"""structlog setup for the worker and the CLI (JSON or console).

One format for everything the process logs: structlog's own loggers and every
standard-library logger (aio_pika, aiormq, asyncio, jax, warnings, ...) are
rendered by the same processors, so ``--log-format json`` writes only JSON
lines, one object per line.

The worker calls :func:`bind_worker_context` once it knows its id and model;
from then on every line carries ``worker_id`` and ``model``, whichever logger
or thread wrote it.

A broker that drops the worker's connections (``CONNECTION_FORCED``, a
restart) is reported by the worker itself, one ``amqp_connection_lost``
warning per connection with the broker's reason
(``jaxserve.worker.connections``); what aiormq and aio-pika log about the
same event (an error per connection, tracebacks of their reader task,
failing close callbacks, every reconnect attempt) says nothing more and
drowned the console in about 240 lines, so :class:`AmqpReconnectNoise`
drops it (``tests/test_logging.py``). Console tracebacks never print local
variables: they may hold job text or secrets.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

# Fields every line of this process carries (bind_worker_context). Threads do
# not inherit context variables, so the engine thread, the metrics server and
# the libraries' own threads read them from here; a context variable of the
# same name (bound in one task) wins over it.
_process_context: dict[str, Any] = {}

# The handler configure_logging installed on the root logger, so a second call
# replaces it instead of adding another.
_HANDLER_NAME = "jaxserve"

# configure_logging's format and level, when it writes to stderr: what
# logging_setup hands a worker's engine process.
_configured: dict[str, str] = {}


def bind_worker_context(worker_id: str | None = None, model: str | None = None, **fields: Any) -> None:
    """Add ``worker_id``, ``model`` (and any other ``fields``) to every log
    line from now on, in every thread and task of the process. ``None``
    values are skipped, so the id can be bound first and the model once the
    engine is built. Safe to call before or after :func:`configure_logging`."""
    values = {"worker_id": worker_id, "model": model, **fields}
    values = {k: v for k, v in values.items() if v is not None}
    _process_context.update(values)
    structlog.contextvars.bind_contextvars(**values)


def clear_worker_context() -> None:
    """Forget what :func:`bind_worker_context` bound (tests, a second worker
    in the same process)."""
    structlog.contextvars.unbind_contextvars(*_process_context)
    _process_context.clear()


def _add_process_context(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    for key, value in _process_context.items():
        event_dict.setdefault(key, value)
    return event_dict


class AmqpReconnectNoise(logging.Filter):
    """Drops aiormq's and aio-pika's records of a connection going away or
    coming back (matched on their format strings, which name the event);
    keeps every other record of theirs."""

    _EVENTS = {
        "aiormq.connection": (
            "Unexpected connection close from remote",
            "Cancelling cause reader exited abnormally",
        ),
        "aio_pika.robust_connection": ("Connection attempt to ", "Connection to %s closed. Reconnecting"),
    }

    def filter(self, record: logging.LogRecord) -> bool:
        starts = self._EVENTS.get(record.name)
        msg = record.msg if isinstance(record.msg, str) else ""
        if starts is not None and msg.startswith(starts):
            return False
        if record.name == "aio_pika.tools" and msg.startswith("Callback %r error"):
            # a robust channel's close callback failing because its connection is already gone
            first = record.args[0] if isinstance(record.args, tuple) and record.args else None
            return "._on_close of" not in repr(first)
        return True


def _stdlib_level(level: int) -> int:
    """Libraries log at WARNING and above unless the worker is debugging."""
    return level if level <= logging.DEBUG or level >= logging.WARNING else logging.WARNING


def configure_logging(fmt: str = "console", level: str = "info", stream: TextIO | None = None) -> None:
    """Route structlog and the standard library through one renderer.

    ``fmt`` is ``json`` (one JSON object per line) or ``console``; ``level``
    a logging level name; ``stream`` defaults to ``sys.stderr`` (stdout is
    the commands' output: ``generate --json``, ``status --json``).
    """
    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    out = stream if stream is not None else sys.stderr
    _configured.clear()
    if stream is None:
        _configured.update(fmt=fmt, level=level)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        _add_process_context,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        # Tracebacks become one "exception" string inside the object.
        final: list[Any] = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        isatty = getattr(out, "isatty", None)
        tracebacks = (
            structlog.dev.RichTracebackFormatter(show_locals=False)
            if structlog.dev.rich is not None
            else structlog.dev.plain_traceback
        )
        final = [structlog.dev.ConsoleRenderer(colors=bool(isatty and isatty()), exception_formatter=tracebacks)]

    # structlog's loggers: filtered at ``lvl`` before any processing, written
    # with one write() per line (the stdlib handler below writes whole lines
    # too, so the two never interleave inside a line).
    structlog.configure(
        processors=[*shared, *final],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )

    # Everything else: one handler on the root logger with the same chain.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = logging.StreamHandler(out)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    handler.addFilter(AmqpReconnectNoise())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(_stdlib_level(lvl))
    # Libraries that attached a handler of their own (jax does when
    # JAX_LOGGING_LEVEL is set) would print past the renderer: send their
    # records up to the root handler instead.
    for logger in list(logging.root.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger):
            for own in list(logger.handlers):
                if not isinstance(own, logging.NullHandler):
                    logger.removeHandler(own)
            logger.propagate = True
    # warnings.warn() goes to the "py.warnings" logger, not raw to stderr.
    logging.captureWarnings(True)


def logging_setup() -> dict[str, Any] | None:
    """This process's logging (format, level and the bound fields), as plain
    values for another process that writes to the same stderr: the worker's
    engine process (``apply_logging_setup`` there). None when
    :func:`configure_logging` has not set up stderr."""
    if not _configured:
        return None
    return {**_configured, "context": dict(_process_context)}


def apply_logging_setup(setup: dict[str, Any], **fields: Any) -> None:
    """Log like the process that made ``setup`` (:func:`logging_setup`), each
    line also carrying ``fields``."""
    configure_logging(setup["fmt"], setup["level"])
    bind_worker_context(**setup["context"], **fields)
