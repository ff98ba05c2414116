"""Tenant limits judge arrivals: both limiters (in memory, and in a private
Redis shared by workers) count a job at the moment it arrived, whenever they
are asked, and a bucket never moves back in time."""

from __future__ import annotations

import asyncio

import pytest

from jaxserve.worker.limits import (
    LimitsConfig,
    LimitsFileError,
    MemoryLimiter,
    RedisLimiter,
    TenantLimit,
    load_limits,
)

pytestmark = pytest.mark.timeout(60)

CFG = LimitsConfig(tenants={"acme": TenantLimit(requests_per_s=1.0, burst=3.0, tokens_per_min=600.0, max_in_flight=10)})
T0 = 1_800_000_000.0  # an epoch time, like kj.received_at


@pytest.fixture(params=["memory", "redis"])
async def limiter(request):
    if request.param == "memory":
        yield MemoryLimiter(CFG)
        return
    import redis.asyncio as aioredis

    server = request.getfixturevalue("private_redis")
    r = aioredis.from_url(server.url)
    yield RedisLimiter(CFG, r, namespace="t")
    await r.aclose()


async def allowed(lim, n: int, at: float, first: int = 0) -> list[bool]:
    return [(await lim.arrive("acme", f"job{first + i}", at)).allowed for i in range(n)]


async def test_a_burst_is_judged_at_its_arrival_not_when_it_is_asked(limiter):
    assert await allowed(limiter, 12, T0) == [True] * 3 + [False] * 9
    # asked again later, for the same arrival moment: no refill
    await asyncio.sleep(1.2)
    assert await allowed(limiter, 3, T0 + 0.5, first=12) == [False] * 3
    # an arrival one second after the burst finds one request refilled
    assert await allowed(limiter, 2, T0 + 1.0, first=20) == [True, False]


async def test_an_arrival_older_than_the_last_one_judged_refills_nothing(limiter):
    assert await allowed(limiter, 3, T0) == [True] * 3
    assert await allowed(limiter, 1, T0 + 2.0) == [True]  # 2 refilled, 1 taken: 1 left
    assert await allowed(limiter, 1, T0 + 1.0, first=5) == [True]  # out of order: takes the one left, adds none
    assert await allowed(limiter, 1, T0 + 1.5, first=6) == [False]  # still before the stamp: nothing refilled
    refused = await limiter.arrive("acme", "job7", T0 + 2.0)
    assert not refused.allowed and refused.reason == "requests_per_s" and 0.9 < refused.retry_after_s <= 1.0


async def test_a_job_that_never_ran_gives_its_request_back(limiter):
    assert await allowed(limiter, 3, T0) == [True] * 3
    await limiter.release("acme", "job0", 0, unserved=True)  # answered from the store, say
    await limiter.release("acme", "job1", 0)  # ran: keeps its request
    assert await allowed(limiter, 2, T0, first=10) == [True, False]


async def test_tokens_are_charged_as_of_the_arrival(limiter):
    assert (await limiter.arrive("acme", "big", T0)).allowed
    assert (await limiter.charge("acme", "big", 600, T0)).allowed  # the whole minute's budget
    over = await limiter.charge("acme", "more", 100, T0 + 5.0)  # 5 s later: 50 tokens back, 100 asked
    assert not over.allowed and over.reason == "tokens_per_min" and over.retry_after_s == pytest.approx(5.0, abs=0.01)
    await limiter.release("acme", "big", 300)  # it used half: the rest comes back
    assert (await limiter.charge("acme", "more", 100, T0 + 5.0)).allowed


async def test_a_job_over_the_whole_minute_of_tokens_is_refused_for_good(limiter):
    # 600 a minute; a job of 601 would wait forever (and used to slip through uncharged)
    for i in range(4):
        assert (await limiter.arrive("acme", f"big{i}", T0 + i)).allowed
        over = await limiter.charge("acme", f"big{i}", 601, T0 + i)
        assert not over.allowed and over.reason == "tokens_per_min" and over.never and over.limit == 600
    assert (await limiter.charge("acme", "whole", 600, T0 + 4)).allowed  # nothing was taken


def test_a_burst_under_one_request_is_a_file_error(tmp_path):
    path = tmp_path / "limits.yaml"
    path.write_text("tenants:\n  acme: {requests_per_s: 1, burst: 0.5}\n")
    with pytest.raises(LimitsFileError, match=r"tenants.acme.burst must be at least 1 \(one request\), got 0.5"):
        load_limits(path)


async def test_max_in_flight_counts_from_arrival_until_release():
    lim = MemoryLimiter(LimitsConfig(tenants={"acme": TenantLimit(max_in_flight=2)}))
    assert [(await lim.arrive("acme", f"j{i}", T0)).allowed for i in range(3)] == [True, True, False]
    await lim.release("acme", "j0", 0)
    assert (await lim.arrive("acme", "j3", T0)).allowed
