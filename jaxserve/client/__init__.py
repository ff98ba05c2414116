"""jaxserve.client: publish jobs to jaxserve workers over RabbitMQ."""

from jaxserve.client.client import (
    AsyncClient,
    Client,
    JobError,
    NoRoute,
    QueueError,
    QueueFull,
    Result,
    Stream,
    StreamDiverged,
    UnknownModel,
    build_job,
    retry_with_backoff,
)

__all__ = [
    "AsyncClient",
    "Client",
    "JobError",
    "NoRoute",
    "QueueError",
    "QueueFull",
    "Result",
    "Stream",
    "StreamDiverged",
    "UnknownModel",
    "build_job",
    "retry_with_backoff",
]
