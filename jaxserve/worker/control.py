"""What reaches running jobs from outside their own delivery: cancels (the
control fanout, kept in a local cache so a store outage cannot lose one;
``tests/test_worker_lifecycle.py``) and the claim leases of running jobs,
renewed until another worker is found owning one.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import aio_pika
import structlog

from jaxserve.wire import WireDecodeError, amqp_compat, decode_cancel
from jaxserve.worker.config import WorkerConfig
from jaxserve.worker.lifecycle import JobState
from jaxserve.worker.run_table import RunsView
from jaxserve.worker.store import IdempotencyStore, StoreUnavailable
from jaxserve.worker.store_health import StoreHealth

log = structlog.get_logger("jaxserve.worker")

MAX_REMEMBERED_CANCELS = 100_000

Spawn = Callable[[Coroutine[Any, Any, Any]], Any]


class CancelCache:
    """Keys cancelled while this worker ran, each for ``ttl_s``."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._until: collections.OrderedDict[str, float] = collections.OrderedDict()

    def seen(self, key: str) -> bool:
        expires = self._until.get(key)
        return expires is not None and expires > time.monotonic()

    def remember(self, key: str) -> None:
        now = time.monotonic()
        self._until[key] = now + self.ttl_s
        self._until.move_to_end(key)
        while self._until:
            oldest, expires = next(iter(self._until.items()))
            if expires > now and len(self._until) <= MAX_REMEMBERED_CANCELS:
                break
            del self._until[oldest]


class ControlledRun(Protocol):
    """What a cancel and a lost claim reach of a run (``JobRun``): each
    an event it judges against its own state."""

    state: JobState

    @property
    def key(self) -> str: ...

    @property
    def claimed(self) -> bool: ...

    async def cancel(self, code: str, message: str) -> None: ...

    async def lease_lost(self, owner: str) -> None: ...


@dataclasses.dataclass(eq=False)
class Control:
    """Cancels for the runs in ``runs`` (remembered in :attr:`cancels`,
    then recorded in the store for the other workers) and the claim
    leases of the running ones."""

    cfg: WorkerConfig
    runs: RunsView[ControlledRun]
    store: IdempotencyStore
    store_health: StoreHealth
    _: dataclasses.KW_ONLY
    spawn: Spawn
    stats: collections.Counter
    cancels: CancelCache = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.cancels = CancelCache(self.cfg.cancel_ttl_s)

    async def on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        """A cancel: remembered here first, then its job (if here) is told,
        then the store records it for the other workers."""
        if amqp_compat.undecodable_properties(message):
            log.warning("control_message_invalid", error="properties do not decode")
            return
        try:
            key = decode_cancel(message.body).id
        except WireDecodeError as exc:
            log.warning("control_message_invalid", error=str(exc))
            return
        self.stats["cancel_received"] += 1
        self.cancels.remember(key)
        run = self.runs.get(key)
        log.info("cancel_received", key=key, running_here=run is not None)
        if run is not None:
            self.spawn(run.cancel("cancelled", "the job was cancelled"))
        await self.store_health.best_effort(
            "mark_cancelled", self.store.mark_cancelled, key, self.cfg.cancel_ttl_s, stats=self.stats
        )

    async def renew_loop(self) -> None:
        """Keep the claims of running jobs alive; a claim found taken by
        another worker means that worker runs the key now: the run gives ours back."""
        cfg = self.cfg
        period = max(0.2, cfg.claim_lease_s / 3)
        while True:
            await asyncio.sleep(period)
            for run in self.runs:
                if not run.claimed or run.state is not JobState.RUNNING or not self.store_health.up:
                    continue
                try:
                    if await self.store.renew(run.key, cfg.worker_id, cfg.claim_lease_s):
                        continue
                    owner = await self.store.claim(run.key, cfg.worker_id, cfg.claim_lease_s)
                except StoreUnavailable as exc:
                    self.store_health.failed(exc)
                    log.warning("claim_renew_failed", key=run.key, error=str(exc))
                    continue
                if owner is not None:
                    await run.lease_lost(owner)
