"""``jaxserve dead list | show | requeue`` against the real broker.

Dead letters are made the way production makes them: jobs published to the
job queues of the real topology (``declare_topology`` under a unique
prefix), taken by a consumer and nacked without requeue (or left to expire),
so RabbitMQ dead-letters them through ``<prefix>.dlx`` into ``<prefix>.dead``
with its own ``x-death`` / ``x-first-death-*`` headers. The commands run as
subprocesses, as an operator runs them.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aio_pika
import pytest

from jaxserve.wire.topology import Topology, declare_topology, delete_topology

AMQP_URL = os.environ.get("JAXSERVE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
REPO = Path(__file__).resolve().parents[1]


def amqp(coro_fn, *args):
    async def main():
        conn = await aio_pika.connect(AMQP_URL)
        try:
            return await coro_fn(conn, *args)
        finally:
            await conn.close()

    return asyncio.run(main())


@pytest.fixture
def topo():
    t = Topology(prefix=f"ops-{uuid.uuid4().hex[:10]}")
    amqp(declare_topology, t)
    yield t

    async def teardown(conn, t):
        await delete_topology(conn, t)

    amqp(teardown, t)


def dead_cli(topo: Topology, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "jaxserve", "dead", *args, "--prefix", topo.prefix, "--amqp-url", AMQP_URL],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )


def job(key: str, **props) -> aio_pika.Message:
    body = json.dumps({"prompt": f"job {key}", "max_tokens": 4}).encode()
    defaults = dict(
        message_id=key,
        correlation_id=f"corr-{key}",
        reply_to="ops.reply.somewhere",
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=7,
        headers={"x-published-at-ms": 1_700_000_000_000, "tenant": "acme"},
    )
    defaults.update(props)
    return aio_pika.Message(body, **defaults)


async def _queue_len(conn, name: str) -> int:
    ch = await conn.channel()
    try:
        q = await ch.declare_queue(name, passive=True)
        return int(q.declaration_result.message_count)
    finally:
        await ch.close()


async def _wait_dead(conn, topo: Topology, n: int, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if await _queue_len(conn, topo.dead) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{topo.dead} did not reach {n} messages (has {await _queue_len(conn, topo.dead)})")


async def _reject_into_dead(conn, topo: Topology, jobs: list[tuple[str, aio_pika.Message]]) -> None:
    """Publish each job to its queue, take it as a worker would and nack it
    without requeue: the broker dead-letters it (reason ``rejected``)."""
    ch = await conn.channel()
    for queue_class, message in jobs:
        await ch.default_exchange.publish(message, routing_key=topo.queue_for(queue_class), mandatory=True)
        q = await ch.get_queue(topo.queue_for(queue_class))
        got = await q.get(no_ack=False, timeout=10)
        assert got.message_id == message.message_id
        await got.nack(requeue=False)
    await _wait_dead(conn, topo, len(jobs))
    await ch.close()


def dead_letters(topo, *jobs):
    amqp(_reject_into_dead, topo, list(jobs))


def list_json(topo: Topology) -> list[dict]:
    proc = dead_cli(topo, "list", "--json")
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


async def _take_all(conn, name: str) -> list[aio_pika.IncomingMessage]:
    ch = await conn.channel()
    q = await ch.get_queue(name)
    out = []
    while (m := await q.get(no_ack=True, fail=False)) is not None:
        out.append(m)
    await ch.close()
    return out


async def _peek_delivery_counts(conn, name: str) -> list[int]:
    """x-delivery-count of every message in ``name`` (taken and handed back
    at the end of the test only: that counts one delivery each)."""
    ch = await conn.channel()
    q = await ch.get_queue(name)
    taken = []
    while (m := await q.get(no_ack=False, fail=False)) is not None:
        taken.append(m)
    counts = [int((m.headers or {}).get("x-delivery-count") or 0) for m in taken]
    for m in taken:
        await m.nack(requeue=True)
    await ch.close()
    return counts


# ---------------------------------------------------------------------- list
def test_list_shows_key_queue_reason_count_age_and_keeps_every_letter(topo):
    dead_letters(topo, ("batch", job("kb1")), ("interactive", job("ki1")), ("batch", job("kb2")))

    first = list_json(topo)
    assert [r["key"] for r in first] == ["kb1", "ki1", "kb2"]
    by_key = {r["key"]: r for r in first}
    assert by_key["kb1"]["queue"] == topo.batch
    assert by_key["ki1"]["queue"] == topo.interactive
    for r in first:
        assert r["reason"] == "rejected"
        assert r["count"] == 1
        assert 0 <= r["age_s"] < 120
        assert [(d["queue"], d["reason"], d["count"]) for d in r["deaths"]] == [(r["queue"], "rejected", 1)]

    # Reading is not taking: the same letters, in the same order, again and
    # again, and none of them was counted as a failed delivery (a quorum
    # queue drops a message after 20 of those on RabbitMQ 4).
    for _ in range(3):
        again = list_json(topo)
        assert [(r["key"], r["queue"], r["reason"], r["count"]) for r in again] == [
            (r["key"], r["queue"], r["reason"], r["count"]) for r in first
        ]
    assert amqp(_queue_len, topo.dead) == 3

    table = dead_cli(topo, "list")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:5] == ["key", "queue", "reason", "count", "age"]
    assert [line.split()[:4] for line in lines[1:4]] == [
        ["kb1", topo.batch, "rejected", "1"],
        ["ki1", topo.interactive, "rejected", "1"],
        ["kb2", topo.batch, "rejected", "1"],
    ]
    assert lines[-1] == f"3 dead letter(s) in {topo.dead}"
    assert amqp(_peek_delivery_counts, topo.dead) == [0, 0, 0]


def test_list_on_an_empty_dead_queue_and_a_missing_prefix(topo):
    proc = dead_cli(topo, "list")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"no dead letters in {topo.dead}"

    missing = Topology(prefix=f"ops-missing-{uuid.uuid4().hex[:8]}")
    proc = dead_cli(missing, "list")
    assert proc.returncode != 0
    assert "no queue" in proc.stderr and "Traceback" not in proc.stderr


def test_expired_job_is_listed_with_reason_expired(topo):
    async def expire(conn, topo):
        ch = await conn.channel()
        await ch.default_exchange.publish(job("kexp", expiration=0.05), routing_key=topo.interactive, mandatory=True)
        await ch.close()
        await _wait_dead(conn, topo, 1)

    amqp(expire, topo)
    (row,) = list_json(topo)
    assert (row["key"], row["queue"], row["reason"]) == ("kexp", topo.interactive, "expired")


# ---------------------------------------------------------------------- show
def test_show_prints_properties_headers_and_body(topo):
    dead_letters(topo, ("batch", job("ks1")), ("batch", job("ks2", priority=3, headers={"tenant": "other"})))
    proc = dead_cli(topo, "show", "ks2")
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)
    assert shown["key"] == "ks2"
    assert shown["queue"] == topo.batch and shown["reason"] == "rejected"
    props = shown["properties"]
    assert props["message_id"] == "ks2"
    assert props["correlation_id"] == "corr-ks2"
    assert props["reply_to"] == "ops.reply.somewhere"
    assert props["content_type"] == "application/json"
    assert props["priority"] == 3
    assert props["delivery_mode"] == 2
    assert shown["headers"]["tenant"] == "other"
    assert shown["headers"]["x-first-death-reason"] == "rejected"
    assert shown["headers"]["x-first-death-queue"] == topo.batch
    assert shown["body_encoding"] == "json"
    assert shown["body"] == {"prompt": "job ks2", "max_tokens": 4}
    # show took nothing away
    assert [r["key"] for r in list_json(topo)] == ["ks1", "ks2"]

    proc = dead_cli(topo, "show", "nope")
    assert proc.returncode != 0
    assert "no dead letter with key 'nope'" in proc.stderr and "Traceback" not in proc.stderr


# ------------------------------------------------------------------- requeue
def test_requeue_one_key_then_all_to_their_original_queues(topo):
    dead_letters(topo, ("batch", job("kr1")), ("interactive", job("kr2")), ("batch", job("kr3")))

    proc = dead_cli(topo, "requeue", "kr2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"requeued kr2 -> {topo.interactive}"
    assert amqp(_queue_len, topo.dead) == 2
    (back,) = amqp(_take_all, topo.interactive)
    assert back.message_id == "kr2"
    assert back.correlation_id == "corr-kr2"
    assert back.reply_to == "ops.reply.somewhere"
    assert back.content_type == "application/json"
    assert back.priority == 7
    assert back.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert json.loads(back.body) == {"prompt": "job kr2", "max_tokens": 4}
    headers = back.headers
    assert headers["tenant"] == "acme" and headers["x-published-at-ms"] == 1_700_000_000_000
    assert headers["jaxserve-requeues"] == 1
    assert not [
        h for h in headers if h.startswith(("x-death", "x-first-death", "x-last-death")) or h == "jaxserve-death"
    ]
    assert [r["key"] for r in list_json(topo)] == ["kr1", "kr3"]

    proc = dead_cli(topo, "requeue", "--all")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n")[:2]) == [f"requeued kr1 -> {topo.batch}", f"requeued kr3 -> {topo.batch}"]
    assert amqp(_queue_len, topo.dead) == 0
    assert [m.message_id for m in amqp(_take_all, topo.batch)] == ["kr1", "kr3"]


def test_requeued_job_that_dies_again_comes_back_with_its_requeue_count(topo):
    dead_letters(topo, ("batch", job("kagain")))
    assert dead_cli(topo, "requeue", "kagain").returncode == 0

    async def reject_again(conn, topo):
        ch = await conn.channel()
        q = await ch.get_queue(topo.batch)
        m = await q.get(no_ack=False, timeout=10)
        assert m.message_id == "kagain"
        await m.nack(requeue=False)
        await _wait_dead(conn, topo, 1)
        await ch.close()

    amqp(reject_again, topo)
    (row,) = list_json(topo)
    assert (row["key"], row["queue"], row["reason"], row["count"]) == ("kagain", topo.batch, "rejected", 1)
    proc = dead_cli(topo, "show", "kagain")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["headers"]["jaxserve-requeues"] == 1


def test_requeue_needs_a_key_or_all_and_an_unknown_key_changes_nothing(topo):
    dead_letters(topo, ("batch", job("ku1")))
    for args in ((), ("ku1", "--all")):
        proc = dead_cli(topo, "requeue", *args)
        assert proc.returncode == 2, proc.stderr  # click usage error
    proc = dead_cli(topo, "requeue", "not-there")
    assert proc.returncode != 0
    assert "no dead letter with key 'not-there'" in proc.stderr and "Traceback" not in proc.stderr
    assert [r["key"] for r in list_json(topo)] == ["ku1"]


def test_requeue_into_a_queue_that_no_longer_exists_keeps_the_letter(topo):
    dead_letters(topo, ("batch", job("kgone")), ("interactive", job("kstay")))

    async def drop_batch(conn, topo):
        ch = await conn.channel()
        await ch.queue_delete(topo.batch)
        await ch.close()

    amqp(drop_batch, topo)
    proc = dead_cli(topo, "requeue", "--all")
    assert proc.returncode == 1
    assert proc.stdout.strip() == f"requeued kstay -> {topo.interactive}"
    assert f"kept kgone in {topo.dead}" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    rows = list_json(topo)
    assert [(r["key"], r["queue"], r["reason"]) for r in rows] == [("kgone", topo.batch, "rejected")]
    assert [m.message_id for m in amqp(_take_all, topo.interactive)] == ["kstay"]


def test_death_record_survives_without_the_brokers_x_headers(topo):
    """RabbitMQ 3.13+ treats x- headers published by a client as plain data:
    the copy's own jaxserve-death header must be enough to list and requeue."""
    dead_letters(topo, ("batch", job("krec")))
    list_json(topo)  # one pass writes the record onto the copy

    async def strip_x_headers(conn, topo):
        (m,) = await _take_all(conn, topo.dead)
        headers = {k: v for k, v in m.headers.items() if not k.startswith("x-")}
        assert json.loads(headers["jaxserve-death"])["queue"] == topo.batch
        ch = await conn.channel(publisher_confirms=True)
        await ch.default_exchange.publish(
            aio_pika.Message(m.body, message_id=m.message_id, headers=headers), routing_key=topo.dead
        )
        await ch.close()

    amqp(strip_x_headers, topo)
    (row,) = list_json(topo)
    assert (row["key"], row["queue"], row["reason"], row["count"]) == ("krec", topo.batch, "rejected", 1)
    proc = dead_cli(topo, "requeue", "krec")
    assert proc.returncode == 0, proc.stderr
    assert [m.message_id for m in amqp(_take_all, topo.batch)] == ["krec"]


def test_broker_not_reachable_is_one_line(topo):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve", "dead", "list", "--amqp-url", "amqp://guest:guest@127.0.0.1:1/"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "cannot reach RabbitMQ" in proc.stderr
