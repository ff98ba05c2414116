"""Tenant limits count arrivals, whatever happens between a job's receipt
and its start: a slow store and a CPU kept busy by other processes must not
spread a burst over the seconds the refill needs to let it through.

The finding this pins: a tenant limited to 1 request/s with a burst of 3
sent 12 interactive jobs at once on a loaded machine, and 10 to 12 of them
were answered ok, because the limiter was asked after the store look-ups and
judged each job at that later moment.
"""

from __future__ import annotations

import asyncio
import collections

import pytest

from busy_cpu import busy_cpu
from jaxserve.worker.limits import LimitsConfig, TenantLimit
from jaxserve.worker.store import MemoryStore
from queue_support import EchoEngine

pytestmark = pytest.mark.timeout(180)


class SlowStore(MemoryStore):
    """A store on one slow connection: every call waits its turn, then
    ``delay_s`` (a Redis far away or under load)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.calls: collections.Counter = collections.Counter()
        self._turn: asyncio.Lock | None = None

    async def _slow(self, name: str) -> None:
        self.calls[name] += 1
        self._turn = self._turn or asyncio.Lock()
        async with self._turn:
            await asyncio.sleep(self.delay_s)

    async def get(self, key):
        await self._slow("get")
        return await super().get(key)

    async def is_cancelled(self, key):
        await self._slow("is_cancelled")
        return await super().is_cancelled(key)

    async def claim(self, key, owner, lease_s):
        await self._slow("claim")
        return await super().claim(key, owner, lease_s)

    async def put(self, key, record):
        await self._slow("put")
        return await super().put(key, record)

    async def cache_get(self, cache_key):
        await self._slow("cache_get")
        return await super().cache_get(cache_key)


ACME = LimitsConfig(tenants={"acme": TenantLimit(requests_per_s=1.0, burst=3.0)})


async def test_a_burst_is_limited_at_arrival_beside_a_slow_store_and_busy_cpus(harness, client):
    store = SlowStore(delay_s=0.25)
    with busy_cpu(2):
        w = await harness.start(EchoEngine(step_s=0.002), store=store, limits=ACME)
        keys = await asyncio.gather(
            *(client.publish({"prompt": f"acme {i}", "max_tokens": 2, "tenant": "acme"}) for i in range(12))
        )
        results = await asyncio.gather(*(client.wait(k, timeout=120) for k in keys))
    codes = collections.Counter("ok" if r.ok else r.error.code for r in results)
    assert codes == {"ok": 3, "rate_limited": 9}, codes
    for r in results:
        if not r.ok:
            assert r.error.retryable and r.error.retry_after_s > 0 and "requests_per_s" in r.error.message
    assert w.stats["rejected_rate_limited"] == 9
    assert store.calls["get"] == 3  # the refused jobs never waited for the store


async def test_a_replayed_job_gives_its_request_back(harness, client):
    """A job answered from the store did not run: it does not spend its
    tenant's rate (it is counted on arrival, before the store says it is a
    replay, and gives the request back)."""
    cfg = LimitsConfig(tenants={"acme": TenantLimit(requests_per_s=0.01, burst=2.0)})
    await harness.start(EchoEngine(step_s=0.002), limits=cfg)
    first = await client.submit("once", key="k-replayed", max_tokens=2, tenant="acme", timeout=30)
    replays = [await client.submit("once", key="k-replayed", max_tokens=2, tenant="acme", timeout=30) for _ in range(3)]
    assert first.ok and all(r.ok and r.replayed for r in replays)
    fresh = [await client.submit(f"new {i}", max_tokens=2, tenant="acme", timeout=30) for i in range(2)]
    assert [r.ok for r in fresh] == [True, False]  # the burst of 2: the first job's request and one more
