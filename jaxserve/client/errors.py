"""The client's exceptions, apart from the client so that callers that only
catch them (``jaxserve.cli.submit_command``, ``jaxserve.batch.run``,
``jaxserve.loadtest.runner``) read one short module. Re-exported from
``jaxserve.client`` and ``jaxserve.client.client``, where they always lived."""

from __future__ import annotations

from jaxserve.wire import Result


class QueueError(Exception):
    """Base class of the client's errors."""


class QueueFull(QueueError):
    """The broker refused the job: the queue is at its length limit
    (``x-overflow: reject-publish``). Retry later (see :func:`retry_with_backoff`)."""

    def __init__(self, queue: str, key: str) -> None:
        super().__init__(f"queue {queue!r} is full; job {key!r} was not accepted (retry with backoff)")
        self.queue = queue
        self.key = key


class NoRoute(QueueError):
    """The job's queue does not exist (no worker has declared the topology)."""


class JobError(QueueError):
    """A final result with ``status: error``."""

    def __init__(self, result: Result) -> None:
        err = result.error
        super().__init__(f"{err.code}: {err.message}" if err is not None else "error result without an error")
        self.result = result
        self.code = err.code if err is not None else None
        self.retryable = bool(err is not None and err.retryable)


class UnknownModel(JobError):
    """No worker serves the job's ``model``: the broker returned it from the
    models exchange, so it was never queued. ``result`` is the
    ``unknown_model`` error result a worker would have answered."""

    def __init__(self, key: str, model: str, prefix: str) -> None:
        super().__init__(
            Result.failure(
                key,
                "unknown_model",
                f"model {model!r} is not served under prefix {prefix!r}: no worker routes it "
                "(`jaxserve status` lists the served models' queues)",
            )
        )
        self.model = model


class StreamDiverged(QueueError):
    """The job was restarted elsewhere and produced a different text than
    what the stream already yielded. ``result`` holds the final result."""

    def __init__(self, result: Result) -> None:
        super().__init__(f"stream of {result.id!r} diverged after a restart; use result.text")
        self.result = result
