"""structlog setup for the worker and the CLI (JSON or console)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    processors = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # aio-pika/aiormq use stdlib logging; keep them quiet unless debugging.
    logging.basicConfig(level=logging.WARNING if lvl > logging.DEBUG else logging.DEBUG, stream=sys.stderr)
