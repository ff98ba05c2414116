"""What reaches running jobs from outside their own delivery: cancels (the
control fanout, kept in a local cache so a store outage cannot lose one;
``tests/test_worker_lifecycle.py``) and the claim leases of running jobs,
renewed until another worker is found owning one.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING

import aio_pika
import structlog

from jaxserve.wire import WireDecodeError, amqp_compat, decode_cancel
from jaxserve.worker.lifecycle import JobState
from jaxserve.worker.store import StoreUnavailable

if TYPE_CHECKING:
    from jaxserve.worker.worker import Worker

log = structlog.get_logger("jaxserve.worker")

MAX_REMEMBERED_CANCELS = 100_000


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


async def on_control(w: Worker, message: aio_pika.abc.AbstractIncomingMessage) -> None:
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
    w.stats["cancel_received"] += 1
    w.cancels.remember(key)
    run = w.active.get(key)
    log.info("cancel_received", key=key, running_here=run is not None)
    if run is not None:
        w.spawn(run.cancel("cancelled", "the job was cancelled"))
    await w.best_effort("mark_cancelled", w.store.mark_cancelled, key, w.cfg.cancel_ttl_s)


async def renew_loop(w: Worker) -> None:
    """Keep the claims of running jobs alive; a claim found taken by
    another worker means that worker runs the key now: the run gives ours back."""
    cfg = w.cfg
    period = max(0.2, cfg.claim_lease_s / 3)
    while True:
        await asyncio.sleep(period)
        for run in list(w.active.values()):
            if not run.claimed or run.state is not JobState.RUNNING or not w.store_health.up:
                continue
            try:
                if await w.store.renew(run.key, cfg.worker_id, cfg.claim_lease_s):
                    continue
                owner = await w.store.claim(run.key, cfg.worker_id, cfg.claim_lease_s)
            except StoreUnavailable as exc:
                w.store_health.failed(exc)
                log.warning("claim_renew_failed", key=run.key, error=str(exc))
                continue
            if owner is not None:
                await run.lease_lost(owner)
