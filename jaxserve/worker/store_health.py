"""Whether the idempotency store answers, and the probe that finds it back.

Without the store the worker cannot tell a new job from a replay or a key
claimed elsewhere, nor keep a result for a redelivery, so it must not start
jobs; but an outage must not fail them either, nor hold them without bound.
The first store call that raises :class:`StoreUnavailable` marks the store
down (:meth:`StoreHealth.failed`); the worker then:

* says so: ``/readyz`` answers 503 "store unavailable (...)" and the gauge
  ``jaxserve_store_up`` drops to 0 (the ``on_change`` callback);
* takes no more jobs: both job consumers pause (``on_change`` again), so a
  job it gives back is not redelivered to it in a loop, which would spend
  the quorum queue's ``x-delivery-limit``;
* holds the jobs it has for at most ``--store-hold`` seconds (they wait on
  :meth:`StoreHealth.wait_up`, none of them calls the store meanwhile), then
  gives them back to the broker (``JobRun.store_call``);
* asks the store alone, from one probe task (``ping``), with exponential
  backoff up to ``retry_max_s``; when it answers, the store is up, the gauge
  1, and the consumers resume.

``tests/test_queue_store_outage.py`` pins this against a real Redis that is
stopped and started again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

from jaxserve.worker.store.base import StoreUnavailable

log = structlog.get_logger("jaxserve.worker")


class StoreHealth:
    """The store's state as the worker last saw it, and its outage probe.

    ``ping``: one cheap store round trip (``IdempotencyStore.ping``).
    ``on_change(up)``: awaited after each change (the worker pauses or
    resumes its consumers and sets the gauge). ``spawn``: runs a coroutine
    as a task the worker owns (so a shutdown cancels the probe).
    """

    def __init__(
        self,
        ping: Callable[[], Awaitable[Any]],
        *,
        on_change: Callable[[bool], Coroutine[Any, Any, None]],
        spawn: Callable[[Coroutine[Any, Any, Any]], Any],
        retry_max_s: float = 5.0,
        first_retry_s: float = 0.1,
    ) -> None:
        self._ping = ping
        self._on_change = on_change
        self._spawn = spawn
        self.retry_max_s = retry_max_s
        self.first_retry_s = min(first_retry_s, retry_max_s)
        self._up = asyncio.Event()
        self._up.set()
        self.error = ""  # the last failure, for /readyz and the logs
        self.down_since: float | None = None  # monotonic
        self.outages = 0

    @property
    def up(self) -> bool:
        """Read from the metrics server's thread too: a plain flag read."""
        return self._up.is_set()

    def failed(self, exc: BaseException) -> bool:
        """A store call failed: mark the store down and start the probe.
        True when this call began the outage."""
        self.error = str(exc)
        if not self._up.is_set():
            return False
        self._up.clear()
        self.down_since = time.monotonic()
        self.outages += 1
        log.warning("store_down", error=self.error)
        self._spawn(self._on_change(False))
        self._spawn(self._probe())
        return True

    async def check(self) -> bool:
        """One ping (at start-up, before consuming): whether the store
        answers; a failure begins an outage."""
        try:
            await self._ping()
        except StoreUnavailable as exc:
            self.failed(exc)
            return False
        return True

    async def best_effort(self, what: str, fn: Callable[..., Awaitable[Any]], *args: Any, stats: Any) -> None:
        """A store write whose loss costs nothing but efficiency (skipped,
        and counted in ``stats``, while the store is down)."""
        if not self.up:
            stats["store_write_skipped"] += 1
            return
        try:
            await fn(*args)
        except StoreUnavailable as exc:
            stats["store_write_skipped"] += 1
            self.failed(exc)
            log.warning("store_write_skipped", what=what, error=str(exc))

    async def wait_up(self, timeout: float | None) -> bool:
        """Wait until the store is up again, at most ``timeout`` seconds
        (None: no bound); returns whether it is."""
        if self._up.is_set():
            return True
        try:
            await asyncio.wait_for(self._up.wait(), timeout)
        except TimeoutError:
            pass
        return self._up.is_set()

    async def _probe(self) -> None:
        delay = self.first_retry_s
        while True:
            await asyncio.sleep(delay)
            try:
                await self._ping()
            except StoreUnavailable as exc:
                self.error = str(exc)
                delay = min(delay * 2, self.retry_max_s)
                continue
            down_s = 0.0 if self.down_since is None else time.monotonic() - self.down_since
            self._up.set()
            self.down_since = None
            log.info("store_up", down_s=round(down_s, 3))
            await self._on_change(True)
            return
