"""Cost in the worker (``jaxserve.cost.jobs``), against the real RabbitMQ (and the
real Redis where the limiter is Redis's): ``jaxserve worker`` as a
subprocess with the echo engine and its price flags or prices file.

* every ok result's ``usage.cost`` is its own prompt and completion tokens
  times the configured price, per million tokens or derived from the
  machine's price per hour and a ``jaxserve plan`` profile;
* a worker without a price for the model it serves adds no ``cost`` field;
* ``jaxserve_cost_total`` rises by exactly the results' cost, per bounded
  tenant label;
* a tenant with a ``cost_per_day`` budget is served until the budget is
  spent (the unspent part of each estimate comes back), then interactive
  jobs are ``rate_limited`` and batch jobs wait in the broker.

The echo engine tokenizes one token per byte and, without a stop, answers
``max_tokens`` words, one token each (``queue_support.EchoEngine``).
"""

from __future__ import annotations

import contextlib
import json
import re
import urllib.request

import orjson
import pytest

from jaxserve.planning import Profile
from queue_support import free_port, start_worker_process, stop_process, wait_log

pytestmark = pytest.mark.timeout(120)

REDIS_URL = "redis://127.0.0.1:6379/0"


@contextlib.contextmanager
def worker(prefix: str, tmp_path, *args: str):
    log = tmp_path / "worker.log"
    proc = start_worker_process(prefix, log, *args)
    try:
        wait_log(log, "worker_consuming", timeout=60)
        yield log
    finally:
        stop_process(proc)


def events(log, name: str) -> list[dict]:
    """The worker's JSON log events called ``name``."""
    out = []
    for line in log.read_bytes().splitlines():
        with contextlib.suppress(orjson.JSONDecodeError):
            event = orjson.loads(line)
            if isinstance(event, dict) and event.get("event") == name:
                out.append(event)
    return out


def limits_file(tmp_path, tenants: dict) -> str:
    path = tmp_path / "limits.yaml"
    path.write_text(json.dumps({"tenants": tenants}))  # JSON is YAML
    return str(path)


def amount(prompt_tokens: int, completion_tokens: int, prompt_per_million: float, completion_per_million: float):
    return (prompt_tokens * prompt_per_million + completion_tokens * completion_per_million) / 1e6


def cost_samples(port: int) -> dict[tuple[str, str, str], float]:
    """``jaxserve_cost_total`` by (model_name, tenant, currency), read from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for labels, value in re.findall(r"^jaxserve_cost_total\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        kv = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[(kv["model_name"], kv["tenant"], kv["currency"])] = float(value)
    return out


async def test_cost_is_the_tokens_times_the_price_per_million(prefix, tmp_path, client):
    flags = ("--price-prompt-per-million", "2", "--price-completion-per-million", "30", "--price-currency", "EUR")
    with worker(prefix, tmp_path, "--store", "memory", *flags):
        for prompt, max_tokens in (("hello there", 5), ("a much longer prompt than the first one", 17)):
            r = await client.submit(prompt, max_tokens=max_tokens, timeout=20)
            assert r.ok, r.raw
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), max_tokens)
            assert r.raw["usage"]["cost"] == {
                "amount": pytest.approx(amount(len(prompt), max_tokens, 2, 30)),
                "currency": "EUR",
            }


async def test_cost_from_the_hardware_price_and_a_plan_profile(prefix, tmp_path, client):
    # 7.2 per hour = 0.002 per second; the fastest prefill chunk runs 12800
    # tokens/s -> 0.15625 per million; the saturation batch (32) at the
    # longest context decodes 1000 tokens/s -> 2.0 per million
    Profile(
        model="synthetic",
        prefill={256: 10000.0, 512: 12800.0},
        decode={128: {1: 100.0, 8: 640.0, 32: 1280.0}, 1024: {1: 90.0, 8: 500.0, 32: 1000.0}},
        kv_bytes_per_token=1024,
        block_size=16,
    ).save(tmp_path / "profile.json")
    prices = tmp_path / "prices.yaml"
    prices.write_text("currency: USD\nmodels:\n  echo: {hardware_per_hour: 7.2, profile: profile.json}\n")
    with worker(prefix, tmp_path, "--store", "memory", "--prices", str(prices)):
        r = await client.submit("price me by the hour", max_tokens=9, timeout=20)
    assert r.ok, r.raw
    assert r.raw["usage"]["cost"] == {"amount": pytest.approx(amount(20, 9, 0.15625, 2.0)), "currency": "USD"}


async def test_no_price_for_the_served_model_no_cost_field(prefix, tmp_path, client):
    """The choice: a result the worker cannot price has no ``cost`` at all
    (not a zero, which would read as "free")."""
    prices = tmp_path / "prices.yaml"
    prices.write_text("models:\n  another-model: {prompt_per_million: 1, completion_per_million: 1}\n")
    with worker(prefix, tmp_path, "--store", "memory", "--prices", str(prices)):
        r = await client.submit("who pays", max_tokens=3, timeout=20)
    assert r.ok, r.raw
    assert "cost" not in r.raw["usage"] and r.usage.cost is None


async def test_the_cost_metric_rises_by_the_results_cost_per_bounded_tenant(prefix, tmp_path, client):
    port = free_port()
    flags = ("--price-prompt-per-million", "3", "--price-completion-per-million", "7")
    limits = limits_file(tmp_path, {"acme": {}})
    with worker(prefix, tmp_path, "--store", "memory", "--metrics-port", str(port), "--limits", limits, *flags):
        assert cost_samples(port) == {}
        spent: dict[str, float] = {"acme": 0.0, "other": 0.0, "default": 0.0}
        for i, (tenant, label) in enumerate([("acme", "acme"), ("acme", "acme"), ("zed", "other"), (None, "default")]):
            r = await client.submit(f"job {i} " * (i + 1), max_tokens=4 + i, timeout=20, tenant=tenant)
            assert r.ok, r.raw
            spent[label] += r.raw["usage"]["cost"]["amount"]
        got = cost_samples(port)
    assert got == {("echo", label, "USD"): pytest.approx(total) for label, total in spent.items()}
    assert spent["acme"] == pytest.approx(amount(6, 4, 3, 7) + amount(12, 5, 3, 7))


async def test_a_tenant_over_its_daily_budget_is_limited(prefix, tmp_path, client):
    """One currency unit per token, a budget of 20 a day, the limiter on
    Redis. The first job is charged its estimate (5 prompt + 10 max_tokens
    = 15) but stops after one token: 9 come back, so the second (4 + 4)
    still fits and leaves 6; the third (8) does not."""
    flags = ("--price-prompt-per-million", "1000000", "--price-completion-per-million", "1000000")
    limits = limits_file(tmp_path, {"acme": {"cost_per_day": 20}})
    args = ("--store", "redis", "--redis-url", REDIS_URL, "--limits", limits, *flags)
    with worker(prefix, tmp_path, *args) as log:
        first = await client.submit("ab cd", max_tokens=10, stop=["cd"], tenant="acme", timeout=20)
        assert first.ok and first.usage.completion_tokens == 1, first.raw
        assert first.raw["usage"]["cost"]["amount"] == pytest.approx(6.0)
        second = await client.submit("abcd", max_tokens=4, tenant="acme", timeout=20)
        assert second.ok and second.raw["usage"]["cost"]["amount"] == pytest.approx(8.0), second.raw
        over = await client.submit("efgh", max_tokens=4, tenant="acme", timeout=20)
        assert over.error is not None and over.error.code == "rate_limited", over.raw
        assert "cost_per_day" in over.error.message and over.error.retryable
        # 2 short of 8, refilled at 20 a day: 2 / 20 x 86400 s
        assert over.error.retry_after_s == pytest.approx(8640, rel=0.01)
        assert (await client.submit("efgh", max_tokens=4, tenant="beta", timeout=20)).ok  # no budget: served
        # a batch job over the budget is not failed: it waits in the broker
        await client.publish({"prompt": "ijkl", "max_tokens": 4, "tenant": "acme"}, queue="batch")
        wait_log(log, '"job_deferred"', timeout=30)
    deferred = events(log, "job_deferred")
    assert deferred and all(e["reason"] == "cost_per_day" and e["tenant"] == "acme" for e in deferred)
    assert not [e for e in events(log, "job_start") if e["queue"] == "batch"]  # never reached the engine
