"""A tenant's daily budget (``cost_per_day``) in both limiters: charged at
admission with the cost of prompt + max_tokens, judged as of the arrival,
settled by the cost actually spent, refilled over 24 hours; a tenant over
it is limited while others are not."""

from __future__ import annotations

import pytest

from jaxserve.cost.prices import PriceTable
from jaxserve.worker.limits import (
    DAY_S,
    LimitsConfig,
    LimitsFileError,
    MemoryLimiter,
    RedisLimiter,
    TenantLimit,
    load_limits,
)

pytestmark = pytest.mark.timeout(60)

T0 = 1_800_000_000.0
# 2 per million prompt tokens, 10 per million completion tokens
PRICES = PriceTable.from_values(prompt_per_million=2.0, completion_per_million=10.0)
CFG = LimitsConfig(
    default=TenantLimit(cost_per_day=100.0),
    tenants={"acme": TenantLimit(cost_per_day=0.01, tokens_per_min=100_000.0)},
)


@pytest.fixture(params=["memory", "redis"])
async def limiter(request):
    if request.param == "memory":
        yield MemoryLimiter(CFG)
        return
    import redis.asyncio as aioredis

    server = request.getfixturevalue("private_redis")
    r = aioredis.from_url(server.url)
    yield RedisLimiter(CFG, r, namespace="tc")
    await r.aclose()


def estimate(prompt: int, max_tokens: int) -> float:
    """What the worker charges at admission: the job's tokens at its price."""
    cost = PRICES.cost_of("m", prompt, max_tokens)
    assert cost is not None
    return cost.amount


async def admit(lim, tenant: str, job: str, prompt: int, max_tokens: int, at: float):
    assert (await lim.arrive(tenant, job, at)).allowed
    return await lim.charge(tenant, job, prompt + max_tokens, at, cost=estimate(prompt, max_tokens))


async def test_a_tenant_over_its_daily_budget_is_limited(limiter):
    # 500 prompt + 500 completion tokens: 0.001 + 0.005 = 0.006 of acme's 0.01 a day
    assert (await admit(limiter, "acme", "a", 500, 500, T0)).allowed
    over = await admit(limiter, "acme", "b", 500, 500, T0 + 1.0)
    assert not over.allowed and over.reason == "cost_per_day"
    # 0.004 left + 1 s of refill at 0.01 / day; 0.006 needed: the rest refills at 0.01 per day
    left = 0.004 + 0.01 / DAY_S
    assert over.retry_after_s == pytest.approx((0.006 - left) / (0.01 / DAY_S), rel=1e-6)
    # another tenant, under the default budget, is not limited
    assert (await admit(limiter, "other", "c", 500, 500, T0 + 1.0)).allowed


async def test_the_unspent_estimate_comes_back_when_the_job_ends(limiter):
    assert (await admit(limiter, "acme", "a", 500, 500, T0)).allowed
    # it generated 100 of its 500 tokens: 0.004 of the 0.005 completion estimate was not spent
    await limiter.release("acme", "a", 400, unused_cost=estimate(0, 400))
    assert (await admit(limiter, "acme", "b", 500, 500, T0 + 1.0)).allowed  # 0.008 left: 0.006 fits


async def test_a_budget_refusal_takes_no_tokens(limiter):
    assert (await admit(limiter, "acme", "a", 500, 500, T0)).allowed
    assert not (await admit(limiter, "acme", "b", 500, 500, T0)).allowed
    # the refused job's tokens went back: the whole remaining minute of tokens is there
    assert (await limiter.charge("acme", "c", 100_000 - 1000, T0, cost=0.0)).allowed


async def test_a_job_larger_than_the_whole_budget_is_refused_for_good(limiter):
    # 1000 + 1000 tokens: 0.012, more than acme's whole 0.01 a day; four of them, as a new user sent
    for i in range(4):
        over = await admit(limiter, "acme", f"big{i}", 1000, 1000, T0 + i)
        assert not over.allowed and over.reason == "cost_per_day" and over.never, over
        assert over.needed == pytest.approx(0.012) and over.limit == 0.01
    # nothing was taken: the whole budget (and every token) is still there
    assert (await admit(limiter, "acme", "fits", 0, 1000, T0 + 4)).allowed  # 0.01
    assert (await limiter.charge("acme", "t", 100_000 - 1000, T0 + 4, cost=0.0)).allowed
    # tokens the same way: more than the minute's whole 100 000 never fits
    tokens = await limiter.charge("acme", "huge", 100_001, T0 + 5, cost=0.0)
    assert not tokens.allowed and tokens.reason == "tokens_per_min" and tokens.never


async def test_the_budget_refills_over_a_day(limiter):
    assert (await admit(limiter, "acme", "a", 0, 1000, T0)).allowed  # 0.01: all of it
    assert not (await admit(limiter, "acme", "b", 0, 100, T0 + DAY_S / 20)).allowed  # 0.0005 back, 0.001 asked
    assert (await admit(limiter, "acme", "c", 0, 100, T0 + DAY_S / 10 + 60)).allowed  # 0.001 back, and a little


async def test_jobs_without_a_price_are_never_refused_by_the_budget(limiter):
    for i in range(5):  # cost 0: the worker has no prices
        assert (await limiter.charge("acme", f"j{i}", 10, T0, cost=0.0)).allowed


def test_the_limits_file_takes_cost_per_day(tmp_path):
    path = tmp_path / "limits.yaml"
    path.write_text("default: {cost_per_day: 50}\ntenants:\n  acme: {requests_per_s: 2, cost_per_day: 2.5}\n")
    cfg = load_limits(path)
    assert cfg.for_tenant("acme") == TenantLimit(requests_per_s=2.0, cost_per_day=2.5)
    assert cfg.for_tenant("someone").cost_per_day == 50.0
    path.write_text("tenants:\n  acme: {cost_per_day: -1}\n")
    with pytest.raises(LimitsFileError, match="cost_per_day must be a positive number"):
        load_limits(path)
