"""Admission control and per-tenant limits against the real broker (and a
private Redis for limits shared by two workers)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from jaxserve.worker.admission import AdmissionConfig
from jaxserve.worker.limits import LimitsConfig, LimitsFileError, TenantLimit, load_limits
from jaxserve.worker.store import RedisStore
from queue_support import EchoEngine, wait_until

pytestmark = pytest.mark.timeout(120)


def limits(**tenants) -> LimitsConfig:
    return LimitsConfig(default=TenantLimit(), tenants={k: TenantLimit(**v) for k, v in tenants.items()})


async def test_overloaded_when_the_interactive_budget_is_full_while_batch_flows(harness, client):
    eng = EchoEngine(step_s=0.002, stalled=True)
    w = await harness.start(eng, admission=AdmissionConfig(max_queued_tokens=40))
    first = await client.publish({"prompt": "x" * 30, "max_tokens": 3})  # 30 prompt tokens held: admitted
    await wait_until(lambda: w.admission.held_tokens == 30)
    refused = await client.submit("y" * 30, max_tokens=3, timeout=10)  # 60 > 40: refused at once
    assert refused.error.code == "overloaded" and refused.error.retryable and refused.error.retry_after_s > 0
    assert eng.add_count[refused.id] == 0
    batch = [await client.publish({"prompt": f"batch {i} " * 8, "max_tokens": 3}, queue="batch") for i in range(5)]
    eng.unstall()
    results = await asyncio.gather(client.wait(first, timeout=20), *(client.wait(k, timeout=20) for k in batch))
    assert all(r.ok for r in results)  # batch is never refused by the interactive budget
    assert w.stats["rejected_overloaded"] == 1
    again = await client.submit("y" * 30, max_tokens=3, timeout=10)  # the budget is free again
    assert again.ok


async def test_latency_metrics_count_answered_jobs_under_the_served_name(harness, client):
    """A refusal is answered in microseconds: counted in the latency
    histograms it would pull their quantiles down exactly when the worker is
    overloaded. Metrics carry --served-model-name, as vLLM's do."""
    eng = EchoEngine(step_s=0.002, stalled=True, model_name="/models/echo-preset")
    w = await harness.start(eng, admission=AdmissionConfig(max_queued_tokens=40), served_model_name="public-name")
    first = await client.publish({"prompt": "x" * 30, "max_tokens": 3})
    await wait_until(lambda: w.admission.held_tokens == 30)
    refused = await client.submit("y" * 30, max_tokens=3, timeout=10)
    assert refused.error.code == "overloaded"
    eng.unstall()
    assert (await client.wait(first, timeout=20)).ok
    labels = {"model_name": "public-name", "queue": "interactive"}
    sample = w.served.metrics.registry.get_sample_value
    await wait_until(lambda: sample("jaxserve_jobs_total", {**labels, "outcome": "ok"}) == 1.0)
    assert sample("jaxserve_jobs_total", {**labels, "outcome": "overloaded"}) == 1.0
    assert sample("jaxserve_e2e_request_latency_seconds_count", labels) == 1.0
    assert sample("jaxserve_time_to_first_token_seconds_count", labels) == 1.0


async def test_a_tenant_over_its_burst_is_limited_and_another_is_not(harness, client):
    eng = EchoEngine(step_s=0.002)
    await harness.start(eng, limits=limits(acme={"requests_per_s": 0.01, "burst": 2}))
    acme = [client.submit(f"acme {i}", max_tokens=2, tenant="acme", timeout=10) for i in range(4)]
    beta = [client.submit(f"beta {i}", max_tokens=2, tenant="beta", timeout=10) for i in range(4)]
    got_acme, got_beta = await asyncio.gather(asyncio.gather(*acme), asyncio.gather(*beta))
    assert sorted(r.ok for r in got_acme) == [False, False, True, True]
    for r in got_acme:
        if not r.ok:
            assert r.error.code == "rate_limited" and r.error.retryable and r.error.retry_after_s > 10
            assert "requests_per_s" in r.error.message
    assert all(r.ok for r in got_beta)


async def test_tokens_per_minute_and_max_in_flight(harness, client):
    eng = EchoEngine(step_s=0.002, stalled=True)
    w = await harness.start(eng, limits=limits(acme={"max_in_flight": 1}, big={"tokens_per_min": 100}))
    held = await client.publish({"prompt": "first", "max_tokens": 3, "tenant": "acme"})
    await wait_until(lambda: eng.add_count[held] == 1)
    second = await client.submit("second", max_tokens=3, tenant="acme", timeout=10)
    assert second.error.code == "rate_limited" and "max_in_flight" in second.error.message
    eng.unstall()
    assert (await client.wait(held, timeout=10)).ok
    assert (await client.submit("third", max_tokens=3, tenant="acme", timeout=10)).ok  # the slot came back
    # 100 tokens a minute: prompt + max_tokens are charged; the unused part comes back at the end
    assert (await client.submit("a" * 10, max_tokens=80, tenant="big", timeout=10)).ok  # 10 + 80 charged, all used
    over = await client.submit("b" * 10, max_tokens=80, tenant="big", timeout=10)
    assert over.error.code == "rate_limited" and "tokens_per_min" in over.error.message
    assert w.stats["rejected_rate_limited"] == 2


async def test_a_job_larger_than_its_tenants_whole_limit_is_refused_for_good(harness, client):
    """Budgets smaller than one job: four 20-token jobs (10 prompt + 10
    max_tokens, the echo engine's one token per byte) of a tenant with 10
    tokens a minute, and of one whose day's budget is less than one job's
    cost. Each is rate_limited, not retryable, saying it can never fit, and
    none reaches the engine; a batch one is answered too (a wait in the
    broker would never end)."""
    from jaxserve.cost.prices import PriceTable

    eng = EchoEngine(step_s=0.002)
    prices = PriceTable.from_values(prompt_per_million=1.0, completion_per_million=1.0)  # 20 tokens: 0.00002
    cfg = limits(small={"tokens_per_min": 10}, poor={"cost_per_day": 0.00001})
    w = await harness.start(eng, limits=cfg, prices=prices)
    for tenant, reason, whole in (("small", "tokens_per_min", "10"), ("poor", "cost_per_day", "1e-05 USD")):
        jobs = [client.submit("0123456789", max_tokens=10, tenant=tenant, timeout=10) for _ in range(3)]
        batch = await client.publish({"prompt": "0123456789", "max_tokens": 10, "tenant": tenant}, queue="batch")
        for r in [*(await asyncio.gather(*jobs)), await client.wait(batch, timeout=10)]:
            assert r.error is not None and r.error.code == "rate_limited", r.raw
            assert not r.error.retryable and r.error.retry_after_s is None
            assert f"tenant {tenant!r}'s whole {reason} of {whole}: it can never be admitted" in r.error.message
    assert sum(eng.add_count.values()) == 0 and w.stats["rejected_rate_limited"] == 8
    assert (await client.submit("01234", max_tokens=5, tenant="small", timeout=10)).ok  # a job that fits runs


async def test_limits_are_shared_by_two_workers_through_redis(harness, client, prefix, private_redis):
    cfg = limits(acme={"requests_per_s": 0.01, "burst": 3})
    workers = [
        await harness.start(EchoEngine(step_s=0.002), store=RedisStore(private_redis.url, namespace=prefix), limits=cfg)
        for _ in range(2)
    ]
    results = await asyncio.gather(
        *(client.submit(f"acme {i}", max_tokens=2, tenant="acme", timeout=15) for i in range(10))
    )
    assert sum(r.ok for r in results) == 3  # the burst, across both workers
    assert all(r.error.code == "rate_limited" for r in results if not r.ok)
    assert all(w.stats["received"] > 0 for w in workers)  # both workers took jobs


async def test_batch_tenants_share_capacity_fairly(harness, client):
    """Tenant A has 30 batch jobs queued ahead of tenant B's 5; A may run one
    job at a time: its jobs over the limit go back to the tail of the queue,
    so B's jobs come forward and finish long before A's backlog."""
    eng = EchoEngine(step_s=0.01, max_num_seqs=4, interactive_reserved_seqs=1)
    w = await harness.start(eng, limits=limits(A={"max_in_flight": 1}), defer_wait_max_s=0.05)
    done: dict[str, float] = {}
    a = [
        await client.publish({"prompt": f"a{i} long job", "max_tokens": 10, "tenant": "A"}, queue="batch")
        for i in range(30)
    ]
    b = [
        await client.publish({"prompt": f"b{i} job", "max_tokens": 10, "tenant": "B"}, queue="batch") for i in range(5)
    ]
    for k in a + b:
        asyncio.ensure_future(client.wait(k, timeout=60)).add_done_callback(
            lambda f: done.__setitem__(f.result().id, time.monotonic())
        )
    await wait_until(lambda: len(done) == 35, timeout=60)
    a_order = sorted(done[k] for k in a)
    assert max(done[k] for k in b) < a_order[9]  # B all done before A's tenth
    assert w.stats["deferred"] > 0 and eng.max_running_seen <= 4


def test_limits_file_shape(tmp_path):
    good = tmp_path / "limits.yaml"
    good.write_text(
        "default: {requests_per_s: 50, burst: 100}\ntenants:\n  acme: {requests_per_s: 1, burst: 5, tokens_per_min: 20000, max_in_flight: 8}\n"
    )
    cfg = load_limits(good)
    assert cfg.for_tenant("acme") == TenantLimit(1.0, 5.0, 20000.0, 8)
    assert cfg.for_tenant("other") == TenantLimit(50.0, 100.0, None, None)
    assert (
        cfg.metric_label("acme") == "acme" and cfg.metric_label("zzz") == "other" and cfg.metric_label("") == "default"
    )
    for text, needle in [
        ("tenants: {acme: {rps: 1}}", "unknown keys"),
        ("default: {burst: -1}", "positive"),
        ("default: {max_in_flight: 1.5}", "integer"),
        ("other: 1", "expected the keys"),
    ]:
        bad = tmp_path / f"bad-{uuid.uuid4().hex[:4]}.yaml"
        bad.write_text(text)
        with pytest.raises(LimitsFileError, match=needle):
            load_limits(bad)


async def test_an_interactive_job_that_waited_past_the_target_in_the_broker_is_overloaded(harness, client, prefix):
    import aio_pika
    import orjson

    from queue_support import AMQP_URL

    eng = EchoEngine(step_s=0.002)
    w = await harness.start(eng, admission=AdmissionConfig(target_ttft_s=0.5))
    conn = await aio_pika.connect(AMQP_URL)
    try:
        ch = await conn.channel()
        stale = int((time.time() - 3.0) * 1000)  # published 3 s ago by the producer's clock
        await ch.default_exchange.publish(
            aio_pika.Message(
                orjson.dumps({"prompt": "late", "max_tokens": 2}),
                message_id="stale",
                reply_to=client.reply_queue,
                correlation_id="stale",
                headers={"x-published-at-ms": stale},
            ),
            routing_key=f"{prefix}.interactive",
        )
        r = await client.wait("stale", timeout=10)
    finally:
        await conn.close()
    assert r.error.code == "overloaded" and "waited" in r.error.message and r.error.retry_after_s >= 3.0
    assert eng.add_count["stale"] == 0 and w.stats["rejected_overloaded"] == 1
    assert (await client.submit("on time", max_tokens=2, timeout=10)).ok  # a fresh job is served


async def test_chunks_say_how_many_tokens_they_carry(harness, client, monkeypatch):
    from jaxserve.client.client import Stream

    await harness.start(EchoEngine(step_s=0.002))
    chunks = []
    orig = Stream._deliver

    def spy(self, msg):
        chunks.append(msg)
        orig(self, msg)

    monkeypatch.setattr(Stream, "_deliver", spy)  # before the job is published: no chunk is missed
    s = await client.stream("count my tokens please", max_tokens=9, timeout=10)
    text = "".join([d async for d in s])
    assert text == s.result.text
    assert sum(c.tokens for c in chunks if c.type == "chunk") == s.result.usage.completion_tokens == 9


async def test_a_stream_records_when_its_first_chunk_arrived(harness, client):
    await harness.start(EchoEngine(step_s=0.02))
    t0 = time.monotonic()
    s = await client.stream("time my first token", max_tokens=5, timeout=10)
    first_delta = None
    async for _ in s:
        first_delta = first_delta or time.monotonic()
    assert s.first_chunk_at is not None and t0 < s.first_chunk_at <= first_delta
