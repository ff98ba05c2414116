"""The worker's own state, apart from any job's: warming up, serving,
draining, closing, failed for good.

The worker alone moves it (:class:`WorkerState`, owned by
:class:`~jaxserve.worker.worker.Worker`); the parts that must know it read
it through :class:`WorkerStateView`: the connections (no consumer resumes
while the worker drains or closes, no lost connection is a warning then),
the health checks (``/readyz``, ``/healthz``) and a job held through a store
outage (it stops waiting when the worker closes).
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class WorkerStateView(Protocol):
    """What the rest of the worker reads of its state (read from the
    metrics server's thread too: plain reads)."""

    @property
    def ready(self) -> bool:
        """The engine is built and warm, the consumers started."""
        ...

    @property
    def draining(self) -> bool:
        """Shutting down: no more jobs are taken."""
        ...

    @property
    def closing(self) -> bool:
        """Past the drain: connections and tasks are being closed."""
        ...

    @property
    def fatal_error(self) -> str | None:
        """Why the engine failed for good (the worker then exits 1); None
        while it has not."""
        ...


class WorkerState:
    """The one record of where the worker is (see the module docstring).
    Its flags are plain attributes, each moved by its method (``serving``,
    ``drain``, ``close``, ``fail``); the other parts get it as a
    :class:`WorkerStateView`, which reads them only."""

    def __init__(self) -> None:
        self.ready = False
        self.draining = False
        self.closing = False
        self.fatal_error: str | None = None
        self._failed = asyncio.Event()

    @property
    def failed(self) -> bool:
        return self._failed.is_set()

    def serving(self) -> None:
        self.ready = True

    def drain(self) -> None:
        self.draining = True

    def close(self) -> None:
        self.closing = True

    def fail(self, error: str) -> bool:
        """The engine failed for good; False when it had already."""
        if self._failed.is_set():
            return False
        self.fatal_error = error
        self._failed.set()
        return True

    async def wait_failed(self) -> None:
        await self._failed.wait()
