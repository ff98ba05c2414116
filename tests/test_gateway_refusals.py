"""The gateway's refusals, each as OpenAI's SDK sees it, against a real
broker and echo workers (``queue_support.EchoEngine`` in ``jaxserve
worker``): 401 for a missing or unknown key, 404 for a model outside the
key's list, the key's tenant and priority on the job, 429 with
``Retry-After`` when the worker is overloaded and when the queue is full,
503 (no ``Retry-After``) for a routed model nobody consumes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import time
import types
import urllib.error
import urllib.request

import openai
import pytest

from gateway_support import GatewayProcess, drop_prefix
from queue_support import AMQP_URL, start_worker_process, stop_process, unique_prefix, wait_log

pytestmark = pytest.mark.timeout(300)

KEYS = """
keys:
  sk-team-a-0001:
    tenant: team-a
    priority: 200
    models: [echo]
  sk-robots-0002:
    tenant: robots
  sk-metered-0003:
    tenant: metered
"""
# the workers' tenant limits: "metered" may send one request, then one every 10 s
LIMITS = "tenants:\n  metered: {requests_per_s: 0.1, burst: 1}\n"


def _sdk(gateway: GatewayProcess, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=30)


def _declare_ghost(prefix: str) -> None:
    """Routes for a model whose worker is gone: its queues exist, bound on
    the models exchange, with no consumer."""
    import aio_pika

    from jaxserve.wire.topology import Topology
    from jaxserve.worker.routing import ModelRoutes, declare_model_routes

    async def main() -> None:
        conn = await aio_pika.connect(AMQP_URL)
        try:
            await declare_model_routes(conn, ModelRoutes(Topology(prefix=prefix), served="ghost"))
        finally:
            await conn.close()

    asyncio.run(main())


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    prefix = unique_prefix()
    folder = tmp_path_factory.mktemp("gateway-keys")
    (folder / "keys.yaml").write_text(KEYS)
    (folder / "limits.yaml").write_text(LIMITS)
    worker = start_worker_process(
        prefix,
        folder / "worker.log",
        "--store",
        "memory",
        "--drain-timeout",
        "1",
        "--limits",
        str(folder / "limits.yaml"),
    )
    gateway = None
    try:
        wait_log(folder / "worker.log", "worker_consuming")
        _declare_ghost(prefix)
        gateway = GatewayProcess(prefix, folder / "state", folder / "gateway.log", "--keys", str(folder / "keys.yaml"))
        gateway.start()
        yield types.SimpleNamespace(gateway=gateway, worker_log=folder / "worker.log")
    finally:
        if gateway is not None:
            gateway.stop()
        stop_process(worker)
        drop_prefix(prefix)


def _job_starts(log_path) -> list[dict]:
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        if '"event": "job_start"' in line:
            out.append(json.loads(line))
    return out


def test_keys_decide_who_calls_and_what_their_jobs_carry(keyed):
    messages = [{"role": "user", "content": "hello there"}]
    with pytest.raises(openai.AuthenticationError) as info:
        _sdk(keyed.gateway, "sk-nobody-9999").chat.completions.create(model="echo", messages=messages)
    assert info.value.code == "invalid_api_key" and "9999" in info.value.message
    with pytest.raises(urllib.error.HTTPError) as no_key:
        urllib.request.urlopen(keyed.gateway.url + "/v1/models", timeout=10)
    assert no_key.value.code == 401 and json.loads(no_key.value.read())["error"]["code"] == "invalid_api_key"
    team_a = _sdk(keyed.gateway, "sk-team-a-0001")
    with pytest.raises(openai.NotFoundError) as info:
        team_a.chat.completions.create(model="ghost", messages=messages, max_tokens=3)
    assert info.value.code == "model_not_found"  # not in this key's models: as if it did not exist
    r = team_a.chat.completions.create(model="echo", messages=messages, max_tokens=3)
    assert r.choices[0].message.content.startswith("<|user|>hello")  # the echo engine repeats its prompt
    team_a.chat.completions.create(
        model="echo", messages=messages, max_tokens=2, extra_headers={"X-Jaxserve-Priority": "7"}
    )
    with pytest.raises(openai.BadRequestError) as info:
        team_a.chat.completions.create(
            model="echo", messages=messages, max_tokens=2, extra_headers={"X-Jaxserve-Priority": "300"}
        )
    assert info.value.param == "X-Jaxserve-Priority"
    _sdk(keyed.gateway, "sk-robots-0002").completions.create(model="echo", prompt="beep", max_tokens=2)
    wait_log(keyed.worker_log, '"tenant": "robots"')
    starts = [(s["tenant"], s["priority"]) for s in _job_starts(keyed.worker_log)]
    assert starts[-3:] == [("team-a", 200), ("team-a", 7), ("robots", 0)]
    assert [m.id for m in team_a.models.list().data] == ["echo"]  # ghost has no worker; the key sees echo only
    refusals = keyed.gateway.get_json("/status.json")["refusals"]["by_code"]
    assert sum(refusals["invalid_api_key"]) == 2 and sum(refusals["model_not_found"]) == 1


def test_routed_model_without_a_worker_is_503(keyed):
    robots = _sdk(keyed.gateway, "sk-robots-0002")
    with pytest.raises(openai.InternalServerError) as info:
        robots.chat.completions.create(model="ghost", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert info.value.status_code == 503 and info.value.code == "no_worker"
    assert "retry-after" not in info.value.response.headers  # nobody can say when a worker comes


@pytest.fixture(scope="module")
def stalled(tmp_path_factory):
    """A worker whose engine never steps: the first jobs are held, the
    next wait in a two-message queue."""
    prefix = unique_prefix()
    folder = tmp_path_factory.mktemp("gateway-full")
    worker = start_worker_process(
        prefix,
        folder / "worker.log",
        "--store",
        "memory",
        "--drain-timeout",
        "1",
        "--engine-arg",
        "stalled=1",
        "--interactive-prefetch",
        "2",
        "--max-queued-tokens",
        "50",
        "--interactive-max-length",
        "2",
    )
    gateway = None
    pool = concurrent.futures.ThreadPoolExecutor(8)
    try:
        wait_log(folder / "worker.log", "worker_consuming")
        gateway = GatewayProcess(prefix, folder / "state", folder / "gateway.log").start()
        yield types.SimpleNamespace(gateway=gateway, worker_log=folder / "worker.log", pool=pool)
    finally:
        if gateway is not None:
            gateway.kill()  # requests are still held: no graceful wait for them
        stop_process(worker)
        pool.shutdown(wait=False, cancel_futures=True)
        drop_prefix(prefix)


def test_overloaded_and_full_queue_are_429_with_retry_after(stalled):
    sdk = _sdk(stalled.gateway)

    def hold(prompt: str):
        return stalled.pool.submit(sdk.completions.create, model="echo", prompt=prompt, max_tokens=4)

    hold("x" * 20)  # admitted, and held: its engine never steps
    wait_log(stalled.worker_log, '"event": "job_start"')
    # 20 held + 100 over the worker's budget of 50 queued prompt tokens: overloaded at once
    with pytest.raises(openai.RateLimitError) as info:
        sdk.completions.create(model="echo", prompt="y" * 100, max_tokens=4)
    assert info.value.code == "overloaded"
    assert int(info.value.response.headers["retry-after"]) >= 1
    hold("z" * 20)  # 40 of 50: admitted, held; the worker's prefetch of 2 is full
    end = time.monotonic() + 20
    while len([1 for line in stalled.worker_log.read_text().splitlines() if '"job_start"' in line]) < 2:
        assert time.monotonic() < end
        time.sleep(0.05)
    refused = None
    for i in range(8):  # two wait in the queue; the broker refuses the next publish
        try:
            fut = hold(f"w{i}" * 10)
            fut.result(timeout=1.0)
        except concurrent.futures.TimeoutError:
            continue  # it waits in the queue
        except openai.RateLimitError as exc:
            refused = exc
            break
    assert refused is not None, "the queue never filled"
    assert refused.code == "queue_full" and int(refused.response.headers["retry-after"]) >= 1
    body = refused.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_metrics_and_json_logs_count_requests_by_route_model_and_status(keyed):
    team_a = _sdk(keyed.gateway, "sk-team-a-0001")
    team_a.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "count me"}], max_tokens=2, user="end-user-77"
    )
    with pytest.raises(openai.AuthenticationError):
        _sdk(keyed.gateway, "sk-nobody-0000").chat.completions.create(model="echo", messages=[], max_tokens=1)
    with urllib.request.urlopen(keyed.gateway.url + "/metrics", timeout=10) as resp:
        scraped = resp.read().decode()
    ok = 'jaxserve_gateway_requests_total{model_name="echo",route="/v1/chat/completions",status="200"}'
    line = next(x for x in scraped.splitlines() if x.startswith(ok))
    assert float(line.split()[-1]) >= 1
    assert 'route="/v1/chat/completions",status="401"' in scraped
    assert 'jaxserve_gateway_request_duration_seconds_count{model_name="echo",route="/v1/chat/completions"}' in scraped
    assert 'jaxserve_gateway_queue_consumers{model_name="echo",queue="interactive"} 1.0' in scraped
    lines = keyed.gateway.log.read_text().splitlines()
    assert lines and all(json.loads(x)["event"] for x in lines)  # JSON, one object a line, as the worker's
    requests = [json.loads(x) for x in lines if '"gateway_request"' in x]
    assert {"route", "status", "model", "tenant", "user", "duration_ms"} <= set(requests[-1])
    ok_line = next(r for r in reversed(requests) if r["status"] == 200)
    assert ok_line["user"] == "end-user-77" and ok_line["tenant"] == "team-a"
    assert requests[-1]["status"] == 401 and requests[-1]["tenant"] is None


def test_openai_batch_limits(keyed):
    robots = _sdk(keyed.gateway, "sk-robots-0002")
    line = json.dumps(
        {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"model": "echo", "prompt": "a"}}
    )
    rows = "\n".join(line.replace('"x"', f'"x{i}"') for i in range(50_001)).encode()
    upload = robots.files.create(file=("big.jsonl", io.BytesIO(rows)), purpose="batch")
    batch = robots.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    end = time.monotonic() + 60
    while batch.status == "validating" and time.monotonic() < end:
        time.sleep(0.2)
        batch = robots.batches.retrieve(batch.id)
    assert batch.status == "failed" and batch.errors.data[0].code == "batch_too_large"
    assert "50000" in batch.errors.data[0].message.replace(",", "")
    with pytest.raises(openai.BadRequestError) as info:
        robots.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    assert info.value.param == "purpose"
    with pytest.raises(openai.NotFoundError):  # another tenant's file does not exist for this one
        _sdk(keyed.gateway, "sk-team-a-0001").files.retrieve(upload.id)


def test_idempotency_key_answers_a_retry_from_the_workers_store(keyed):
    robots = _sdk(keyed.gateway, "sk-robots-0002")
    headers = {"Idempotency-Key": "order-42"}
    first = robots.completions.create(model="echo", prompt="same question", max_tokens=3, extra_headers=headers)
    again = robots.completions.create(model="echo", prompt="same question", max_tokens=3, extra_headers=headers)
    assert again.choices[0].text == first.choices[0].text
    wait_log(keyed.worker_log, '"job_replayed"')
    replayed = [json.loads(x) for x in keyed.worker_log.read_text().splitlines() if '"job_replayed"' in x]
    assert [r["key"] for r in replayed] == ["gw:robots:order-42"]  # answered from the store, not run again
    with pytest.raises(openai.ConflictError) as info:  # the same key for another request
        robots.completions.create(model="echo", prompt="other question", max_tokens=3, extra_headers=headers)
    assert info.value.code == "idempotency_key_reused"


def test_a_tenant_over_its_limits_is_429_with_retry_after(keyed):
    metered = _sdk(keyed.gateway, "sk-metered-0003")
    metered.completions.create(model="echo", prompt="first", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as info:
        metered.completions.create(model="echo", prompt="second", max_tokens=2)
    assert info.value.code == "rate_limit_exceeded" and info.value.type == "requests"
    assert 1 <= int(info.value.response.headers["retry-after"]) <= 10  # the bucket's refill, rounded up
    _sdk(keyed.gateway, "sk-robots-0002").completions.create(model="echo", prompt="others pass", max_tokens=2)
