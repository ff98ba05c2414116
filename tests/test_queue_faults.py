"""Faults and hostile input against the real RabbitMQ and Redis: one job can
never hurt another, and no job is lost, stuck or given a second effect.

Each test here reproduces a finding of the reliability review and pins the
behaviour that replaced it (they fail on the code before it). Faults are
made real: a private Redis that is killed and restarted, bytes on the wire
that no client library would produce, a reply queue that refuses every
publish, a worker process that gets SIGTERM in its warm-up or whose engine
breaks.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aio_pika
import orjson
import pytest

from jaxserve.wire.topology import Topology, declare_topology
from jaxserve.worker.store import Record, RedisStore
from queue_support import (
    AMQP_URL,
    REPO,
    EchoEngine,
    start_worker_process,
    stop_process,
    wait_log,
    wait_until,
    worker_env,
)
from raw_amqp import RawPublisher

pytestmark = pytest.mark.timeout(180)


# ----------------------------------------------------------------- helpers
async def reply_queue(prefix: str, **arguments):
    conn = await aio_pika.connect(AMQP_URL)
    ch = await conn.channel()
    q = await ch.declare_queue(
        f"{prefix}.reply.t-{uuid.uuid4().hex[:6]}", arguments={"x-expires": 120_000, **arguments}
    )
    return conn, ch, q


async def drain_queue(q, settle_s: float = 0.5, timeout: float = 30.0, until=None) -> list[dict]:
    """Every message on ``q`` until ``until(msgs)`` holds and nothing more
    arrived for ``settle_s`` (so duplicates would be seen)."""
    msgs: list[dict] = []
    end = time.monotonic() + timeout
    quiet_since = time.monotonic()
    while time.monotonic() < end:
        m = await q.get(no_ack=True, fail=False)
        if m is None:
            if (until is None or until(msgs)) and time.monotonic() - quiet_since > settle_s:
                return msgs
            await asyncio.sleep(0.02)
            continue
        quiet_since = time.monotonic()
        msgs.append({**orjson.loads(m.body), "_correlation_id": m.correlation_id})
    raise AssertionError(f"timed out with {len(msgs)} messages")


def finals(msgs: list[dict]) -> list[dict]:
    return [m for m in msgs if m.get("type") == "result"]


def by_id(msgs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = collections.defaultdict(list)
    for m in finals(msgs):
        out[m["id"]].append(m)
    return out


async def queue_depth(name: str) -> int:
    conn = await aio_pika.connect(AMQP_URL)
    try:
        ch = await conn.channel()
        q = await ch.declare_queue(name, passive=True)
        return q.declaration_result.message_count
    finally:
        await conn.close()


def _json_lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_bytes().splitlines():
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a library's plain-text line
        if isinstance(rec, dict):
            out.append(rec)
    return out


# ------------------------------------------------------- one job, one effect
ODD_VALID = {  # extreme but legal: must be served normally
    "seed_minus_one": {"temperature": 0.7, "seed": -1},
    "seed_2_32": {"temperature": 0.7, "seed": 2**32},
    "seed_2_40": {"temperature": 0.7, "seed": 2**40},
    "seed_u64_max": {"temperature": 0.7, "seed": 2**64 - 1},
    "seed_i64_min": {"temperature": 0.7, "seed": -(2**63)},
    "temperature_two": {"temperature": 2.0, "top_p": 1e-9},
    "penalties_at_bounds": {"temperature": 0.5, "frequency_penalty": -2, "presence_penalty": 2, "seed": 3},
}
ODD_INVALID = {  # refused at the door, each with one invalid_request
    "seed_2_64": b'{"prompt": "odd", "temperature": 0.7, "seed": 18446744073709551616}',
    "seed_huge_negative": b'{"prompt": "odd", "seed": -92233720368547758080}',
    "top_k_2_40": orjson.dumps({"prompt": "odd", "temperature": 0.7, "top_k": 2**40}),
    "top_k_over_vocab": orjson.dumps({"prompt": "odd", "top_k": 10**7}),
    "temperature_1e308": b'{"prompt": "odd", "temperature": 1e308}',
    "temperature_nan_string": orjson.dumps({"prompt": "odd", "temperature": "NaN"}),
    "top_p_infinity_string": orjson.dumps({"prompt": "odd", "top_p": "Infinity"}),
    "max_tokens_2_63": orjson.dumps({"prompt": "odd", "max_tokens": 2**63 - 1}),
    "nested_prompt": orjson.dumps({"prompt": {"a": [[[["deep"]]]]}}),
    "messages_nested": orjson.dumps({"messages": [{"role": "user", "content": [[{"type": "text"}]]}]}),
    "stop_nested": orjson.dumps({"prompt": "odd", "stop": [["x"]]}),
    "deep_nesting": b'{"prompt": "odd", "extra": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    "deep_nesting_in_content": b'{"messages": [{"role": "user", "content": ' + b"[" * 1000 + b"]" * 1000 + b"}]}",
    "priority_huge": orjson.dumps({"prompt": "odd", "priority": 10**9}),
    "frequency_penalty_inf": b'{"prompt": "odd", "frequency_penalty": 1e999}',
}


async def test_poison_values_never_touch_ordinary_jobs(harness, prefix):
    """40 ordinary greedy jobs on the real engine beside jobs with every
    out-of-range value: the ordinary ones all succeed with the text they
    have alone, the odd ones get exactly one final each."""
    from jaxserve.worker.factory import build_engine

    eng = await asyncio.to_thread(build_engine, "tiny", max_num_seqs=16, max_model_len=256)
    await harness.start(eng, interactive_prefetch=64, batch_prefetch=64)
    conn, ch, q = await reply_queue(prefix)
    pub = await RawPublisher().open()
    try:

        async def send(key: str, body: bytes, reply: str = q.name) -> None:
            await pub.publish(
                f"{prefix}.batch",
                body,
                {"message_id": key, "reply_to": reply, "correlation_id": key, "content_type": "application/json"},
            )

        ordinary = {f"ord-{i}": f"document number {i} is about" for i in range(40)}
        alone = {}
        for key, prompt in list(ordinary.items())[:4]:  # each alone first: the reference text
            await send(
                key + "-alone", orjson.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0, "cache": False})
            )
        ref = by_id(await drain_queue(q, until=lambda ms: len(finals(ms)) >= 4))
        alone = {k.removesuffix("-alone"): v[0]["text"] for k, v in ref.items()}

        items = list(ordinary.items())
        for i, (key, prompt) in enumerate(items):
            await send(key, orjson.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0, "cache": False}))
            if i % 3 == 0:  # odd jobs interleaved with the ordinary ones
                for name, extra in ODD_VALID.items():
                    await send(f"odd-{name}-{i}", orjson.dumps({"prompt": "odd one", "max_tokens": 6, **extra}))
                for name, body in ODD_INVALID.items():
                    await send(f"bad-{name}-{i}", body)
        n_odd = len(range(0, len(items), 3)) * (len(ODD_VALID) + len(ODD_INVALID))
        got = by_id(
            await drain_queue(q, settle_s=1.0, timeout=120, until=lambda ms: len(finals(ms)) >= len(items) + n_odd)
        )
    finally:
        await pub.close()
        await conn.close()
    for key in ordinary:
        [only] = got[key]
        assert only["status"] == "ok", only
        if key in alone:
            assert only["text"] == alone[key]  # batch neighbours changed nothing
    for key, answers in got.items():
        assert len(answers) == 1, (key, answers)
        if key.startswith("odd-"):
            assert answers[0]["status"] == "ok", answers
        if key.startswith("bad-"):
            assert answers[0]["error"]["code"] == "invalid_request", answers
    assert len(got) == len(items) + n_odd


async def test_undecodable_properties_cost_only_themselves(harness, client, prefix):
    w = await harness.start(EchoEngine(step_s=0.002), interactive_prefetch=40)
    conn, ch, q = await reply_queue(prefix)
    pub = await RawPublisher().open()
    bad_props = {
        "bad_content_type": {
            "content_type": b"\xff\xfeapplication/json",
            "message_id": "bad-ct",
            "correlation_id": "bad-ct",
            "reply_to": q.name,
        },
        "bad_message_id": {"message_id": b"\xc3\x28", "correlation_id": "bad-mid", "reply_to": q.name},
        "bad_correlation_id": {"message_id": "bad-cid", "correlation_id": b"\xed\xa0\x80", "reply_to": q.name},
        "bad_timestamp": {
            "message_id": "bad-ts",
            "correlation_id": "bad-ts",
            "reply_to": q.name,
            "timestamp": 2**64 - 1,
        },
        "bad_reply_to": {"message_id": "bad-rt", "correlation_id": "bad-rt", "reply_to": b"\xff" + q.name.encode()},
    }
    try:
        keys = []
        for i in range(30):
            keys.append(await client.publish({"prompt": f"innocent {i}", "max_tokens": 5}))
            if i % 6 == 0:
                name = list(bad_props)[i // 6]
                await pub.publish(
                    f"{prefix}.interactive", orjson.dumps({"prompt": "x", "max_tokens": 2}), bad_props[name]
                )
        results = await asyncio.gather(*(client.wait(k, timeout=30) for k in keys))
        replies = await drain_queue(q, settle_s=1.0, until=lambda ms: len(ms) >= 4)
        results_q = await drain_queue(await _results_queue(ch, prefix), settle_s=0.3, until=lambda ms: len(ms) >= 1)
    finally:
        await pub.close()
        await conn.close()
    assert all(r.ok for r in results) and len(results) == 30
    assert w.stats["connection_lost_interactive"] == 0 and w.stats["reconnect_interactive"] == 0
    answered = finals(replies) + finals(results_q)
    assert len(answered) == 5, answered
    for m in answered:
        assert m["error"]["code"] == "invalid_request" and "do not decode" in m["error"]["message"]
    assert sorted(m["id"] or "" for m in answered) == ["", "bad-cid", "bad-ct", "bad-rt", "bad-ts"]
    assert [m["id"] for m in finals(results_q)] == ["bad-rt"]  # its reply_to was unreadable: the results queue
    assert await queue_depth(f"{prefix}.dead") == 0 and await queue_depth(f"{prefix}.interactive") == 0


async def _results_queue(ch, prefix: str):
    return await ch.declare_queue(f"{prefix}.results", passive=True)


async def test_reply_to_naming_the_workers_own_queues_is_refused_to_results(harness, client, prefix):
    w = await harness.start(EchoEngine(step_s=0.002))
    topo = Topology(prefix=prefix)
    hostile = [topo.interactive, topo.batch, topo.dead, topo.dlx, topo.control]
    for i, name in enumerate(hostile):
        await client.publish(
            {"prompt": f"hostile {i}", "max_tokens": 3}, key=f"hostile-{i}", reply_to=name, expect_reply=False
        )
    ok = await client.submit("innocent", max_tokens=3, timeout=20)
    conn, ch, _ = await reply_queue(prefix)
    try:
        got = finals(
            await drain_queue(await _results_queue(ch, prefix), settle_s=0.5, until=lambda ms: len(ms) >= len(hostile))
        )
    finally:
        await conn.close()
    assert ok.ok
    assert sorted(m["id"] for m in got) == [f"hostile-{i}" for i in range(len(hostile))]
    assert all(m["error"]["code"] == "invalid_request" and "reply_to" in m["error"]["message"] for m in got)
    assert w.stats["received"] == len(hostile) + 1  # no reply came back as a job
    assert await queue_depth(f"{prefix}.dead") == 0


async def test_garbage_direct_reply_to_costs_only_itself(harness, client, prefix):
    """On RabbitMQ 3.10 a reply to amq.rabbitmq.reply-to.<garbage> closes the
    publishing connection (541): it must not touch the other replies."""
    w = await harness.start(EchoEngine(step_s=0.002))
    keys, garbage = [], []
    for i in range(30):
        keys.append(await client.publish({"prompt": f"plain {i}", "max_tokens": 4}))
        if i % 10 == 0:
            k = f"garbage-{i}"
            await client.publish(
                {"prompt": "x", "max_tokens": 2}, key=k, reply_to="amq.rabbitmq.reply-to.AAAA.x", expect_reply=False
            )
            garbage.append(k)
    results = await asyncio.gather(*(client.wait(k, timeout=30) for k in keys))
    assert all(r.ok for r in results)
    await wait_until(lambda: w.stats["reply_undeliverable"] >= len(garbage) and not w.runs, timeout=20)
    assert w.stats["reconnect_publish"] == 0 and w.stats["connection_lost_publish"] == 0
    assert await queue_depth(f"{prefix}.interactive") == 0  # acked once each: not retried for ever
    dups = collections.Counter(r.id for r in results)
    assert max(dups.values()) == 1


async def test_a_final_that_is_never_confirmed_is_dead_lettered_not_acked(harness, client, prefix):
    """A reply queue that refuses every publish (length 0, reject-publish):
    the job is requeued, never acked, until x-delivery-limit dead-letters it."""
    w = await harness.start(EchoEngine(step_s=0.002), delivery_limit=2)
    conn, ch, q = await reply_queue(prefix, **{"x-max-length": 0, "x-overflow": "reject-publish"})
    try:
        await client.publish(
            {"prompt": "unanswerable", "max_tokens": 2}, key="k-full", reply_to=q.name, expect_reply=False
        )
        await wait_until(lambda: w.stats["reply_nacked"] >= 2, timeout=30)
        dead = await ch.declare_queue(f"{prefix}.dead", passive=True)
        end = time.monotonic() + 20
        letter = None
        while letter is None and time.monotonic() < end:
            letter = await dead.get(no_ack=True, fail=False)
            await asyncio.sleep(0.05)
    finally:
        await conn.close()
    assert letter is not None and letter.message_id == "k-full"
    assert letter.headers.get("x-first-death-reason") == "delivery_limit"
    assert w.stats["acked"] == 0


async def test_priority_higher_runs_first_end_to_end(harness, client, prefix):
    eng = EchoEngine(step_s=0.001, max_num_seqs=1, interactive_reserved_seqs=0, stalled=True)
    w = await harness.start(eng, batch_prefetch=40)
    fillers = [
        await client.publish({"prompt": f"filler {i}", "max_tokens": 1}, queue="batch", priority=5) for i in range(20)
    ]
    low = await client.publish({"prompt": "low", "max_tokens": 1}, queue="batch", priority=0)
    high = await client.publish({"prompt": "high", "max_tokens": 1}, queue="batch", priority=9)
    body_prio = await client.publish({"prompt": "body", "max_tokens": 1, "priority": 7}, queue="batch")
    await wait_until(lambda: len(w.runs) == 23 and all(j.in_engine for j in w.runs))
    order: list[str] = []
    for k in [*fillers, low, high, body_prio]:
        asyncio.ensure_future(client.wait(k, timeout=20)).add_done_callback(lambda f: order.append(f.result().id))
    await asyncio.sleep(0.05)  # every wait is listening before the first result
    eng.unstall()
    await wait_until(lambda: len(order) == 23, timeout=20)
    names = {high: "high", body_prio: "body", low: "low", **{f: f"f{i}" for i, f in enumerate(fillers)}}
    assert order[:2] == [high, body_prio] and order[-1] == low, [names[k] for k in order]
    assert order[2:-1] == fillers  # equal priority: arrival order


async def test_a_key_reused_with_another_body_is_refused(harness, client):
    await harness.start(EchoEngine(step_s=0.001))
    first = await client.submit("the first document", key="reused", max_tokens=3, timeout=10)
    again = await client.submit("the first document", key="reused", max_tokens=3, timeout=10)
    other = await client.submit("a different document", key="reused", max_tokens=3, timeout=10)
    assert first.ok and again.replayed and again.text == first.text
    assert other.error.code == "idempotency_key_reused" and other.error.retryable is False


async def test_redis_outage_jobs_wait_and_the_worker_recovers(harness, client, prefix, private_redis):
    store = RedisStore(private_redis.url, namespace=prefix, timeout_s=0.5)
    w = await harness.start(EchoEngine(step_s=0.005), store=store, store_retry_max_s=0.5)
    keys = [await client.publish({"prompt": f"doc {i}", "max_tokens": 3}, queue="batch") for i in range(150)]
    results: dict[str, object] = {}
    waits = {k: asyncio.ensure_future(client.wait(k, timeout=90)) for k in keys}
    for k, f in waits.items():
        f.add_done_callback(lambda f, k=k: results.__setitem__(k, f.result()))
    await wait_until(lambda: len(results) >= 20, timeout=30)
    private_redis.kill()
    await asyncio.sleep(3.0)
    during = len(results)
    private_redis.start()
    await asyncio.wait_for(asyncio.gather(*waits.values()), 90)
    assert all(r.ok for r in results.values()) and len(results) == 150
    # The first call to meet the dead store marks the outage; it may be a job's
    # admission (store_unavailable) or a best-effort write (store_write_skipped),
    # and after it no job calls the store until the probe finds it back.
    assert during < 150 and w.store_health.outages >= 1
    await wait_until(lambda: not w.runs, timeout=10)  # the last acks follow the last replies
    assert w.stats["worker_task_failed"] == 0
    # and it keeps serving after the outage
    assert (await client.submit("after the outage", max_tokens=2, timeout=20)).ok


async def test_a_lost_redis_lease_gives_the_job_back_to_its_new_owner(harness, client, prefix, private_redis):
    store = RedisStore(private_redis.url, namespace=prefix)
    other = RedisStore(private_redis.url, namespace=prefix)
    eng = EchoEngine(step_s=0.001, stalled=True)
    w = await harness.start(eng, store=store, claim_lease_s=0.6, claim_poll_s=0.05)
    try:
        key = "leased-" + uuid.uuid4().hex[:6]
        await client.publish({"prompt": "leased job", "max_tokens": 3}, key=key)
        await wait_until(lambda: eng.add_count[key] == 1)
        # another worker takes the key over (our lease was lost, e.g. a pause)
        await other._r.set(f"{prefix}:claim:{key}", "worker-B", px=10_000)
        await wait_until(lambda: w.stats["lease_lost"] == 1, timeout=10)
        await wait_until(lambda: key in eng.aborted, timeout=5)  # the engine thread runs the abort between steps
        await wait_until(lambda: w.stats["held_for_other_worker"] >= 1, timeout=10)  # the redelivery waits for B
        done = {
            "type": "result",
            "id": key,
            "status": "ok",
            "text": "from B",
            "finish_reason": "stop",
            "usage": {"prompt_tokens": 1, "completion_tokens": 1},
            "timings": {},
        }
        await other.put(key, Record(done, [], None))
        r = await client.wait(key, timeout=10)
        assert r.text == "from B" and r.replayed and eng.add_count[key] == 1
    finally:
        eng.unstall()
        await other.close()


async def test_sampled_job_reproduces_its_text_when_run_again(harness, client):
    """No seed given: the seed comes from the key, so a job recomputed after
    a crash (a fresh worker, an empty store) produces the same text."""
    from jaxserve.worker.factory import build_engine

    eng = await asyncio.to_thread(build_engine, "tiny", max_num_seqs=4, max_model_len=128)
    await harness.start(eng)
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9}
    a = await client.submit(**body, key="first-job", timeout=120)
    k = await client.submit(**body, key="the-job", timeout=120)
    await harness.close()
    harness.workers.clear()
    await harness.start(eng)  # the same engine, a fresh worker and store
    k_again = await client.submit(**body, key="the-job", timeout=120)
    a_again = await client.submit(**body, key="first-job", timeout=120)
    assert not k_again.replayed and k_again.text == k.text and a_again.text == a.text
    assert k.text != a.text  # different keys draw different samples


async def test_batch_gives_up_after_idle_timeout_with_a_full_window(prefix, tmp_path):
    conn = await aio_pika.connect(AMQP_URL)
    try:
        await declare_topology(conn, Topology(prefix=prefix))  # queues, but no worker
    finally:
        await conn.close()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(orjson.dumps({"id": f"j{i}", "prompt": "p"}).decode() + "\n" for i in range(10)))
    cmd = [
        sys.executable,
        "-m",
        "jaxserve",
        "batch",
        str(inp),
        "-o",
        str(out),
        "--prefix",
        prefix,
        "--amqp-url",
        AMQP_URL,
        "--max-in-flight",
        "3",
        "--idle-timeout",
        "2",
        "--no-progress",
    ]
    t0 = time.monotonic()
    proc = await asyncio.to_thread(subprocess.run, cmd, cwd=REPO, env=worker_env(), capture_output=True, timeout=60)
    assert proc.returncode == 2, proc.stderr.decode()[-2000:]
    assert time.monotonic() - t0 < 30
    assert '"missing": 10' in proc.stderr.decode()


def test_sigterm_during_warmup_never_consumes(prefix, tmp_path):
    log = tmp_path / "w.log"
    w = start_worker_process(prefix, log, "--engine-arg", "warmup_s=6")
    try:
        # Inside the warm-up (a fixed sleep raced the interpreter's start-up
        # on a loaded machine: SIGTERM came before the handler was installed).
        wait_log(log, "engine_warmup_started")
        t0 = time.monotonic()
        w.send_signal(signal.SIGTERM)
        code = w.wait(20)
        assert code == 0 and time.monotonic() - t0 < 15
    finally:
        if w.poll() is None:
            w.kill()
    text = log.read_text()
    assert "worker_stopped_before_consuming" in text and "worker_consuming" not in text


def _engine_fault_sends_jobs_elsewhere(prefix: str, tmp_path, worker_args: list[str], fault=None) -> str:
    """Six batch jobs to a worker whose engine fails (``fault(worker)``, if
    given, is called once the worker has started a job): it must requeue
    what it holds and exit 1, and a healthy worker then answers every job.
    Returns the failed worker's log."""
    log, log2 = tmp_path / "w.log", tmp_path / "w2.log"
    w = start_worker_process(prefix, log, *worker_args)
    w2 = None
    try:
        wait_log(log, "worker_consuming")

        async def publish_and_wait() -> list:
            from jaxserve.client import AsyncClient

            async with AsyncClient(AMQP_URL, prefix=prefix) as c:
                keys = [await c.publish({"prompt": f"job {i}", "max_tokens": 30}, queue="batch") for i in range(6)]
                if fault is not None:
                    await asyncio.to_thread(wait_log, log, "job_start")
                    fault(w)
                await asyncio.to_thread(w.wait, 30)
                nonlocal w2
                w2 = start_worker_process(prefix, log2)
                results = await asyncio.gather(*(c.wait(k, timeout=60) for k in keys))
                await c.delete_reply_queue()
                return results

        results = asyncio.run(publish_and_wait())
        assert w.returncode == 1, log.read_text()[-3000:]
        assert [r.ok for r in results] == [True] * 6
        text = log.read_text()
        assert "engine_fatal" in text and "job_requeued" in text
        return text
    finally:
        for p in (w, w2):
            if p is not None:
                stop_process(p)


@pytest.mark.parametrize("fault", ["break_after_steps=3", "fail_every_step=true"])
def test_a_broken_engine_stops_the_worker_and_its_jobs_go_elsewhere(prefix, tmp_path, fault):
    """EngineBroken, or every step failing: the worker requeues what it holds
    and exits 1; a healthy worker then serves every job."""
    _engine_fault_sends_jobs_elsewhere(prefix, tmp_path, ["--engine-arg", fault, "--engine-arg", "step_s=0.01"])


def test_a_sigkilled_engine_process_stops_the_worker_and_its_jobs_go_elsewhere(prefix, tmp_path):
    """The worker's engine process SIGKILLed mid-run (the OOM killer, say):
    the worker requeues what it holds and exits 1, its engine process gone;
    a healthy worker then serves every job once."""
    killed = []

    def kill_engine_process(w) -> None:
        [pid] = [int(p) for p in open(f"/proc/{w.pid}/task/{w.pid}/children").read().split()]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    text = _engine_fault_sends_jobs_elsewhere(prefix, tmp_path, ["--engine-arg", "step_s=0.05"], kill_engine_process)
    assert "the engine process exited (exit code -9)" in text
    assert not os.path.exists(f"/proc/{killed[0]}") or open(f"/proc/{killed[0]}/stat").read().split()[2] == "Z"


def test_drain_with_many_jobs_in_flight_is_bounded(prefix, tmp_path):
    log = tmp_path / "w.log"
    w = start_worker_process(
        prefix,
        log,
        "--engine-arg",
        "step_s=0.05",
        "--engine-arg",
        "max_num_seqs=40",
        "--batch-prefetch",
        "40",
        "--drain-timeout",
        "1",
    )
    try:
        wait_log(log, "worker_consuming")

        async def publish() -> list[str]:
            from jaxserve.client import AsyncClient

            async with AsyncClient(AMQP_URL, prefix=prefix) as c:
                return [
                    await c.publish({"prompt": f"long job {i}", "max_tokens": 400}, queue="batch", expect_reply=False)
                    for i in range(40)
                ]

        keys = asyncio.run(publish())
        time.sleep(1.5)  # all 40 in flight
        t0 = time.monotonic()
        w.send_signal(signal.SIGTERM)
        assert w.wait(30) == 0
        took = time.monotonic() - t0
    finally:
        if w.poll() is None:
            w.kill()
    assert took < 1 + 5, took  # --drain-timeout plus a small bound
    assert asyncio.run(queue_depth(f"{prefix}.batch")) == len(keys)  # every held job requeued
    [stopped] = [r for r in _json_lines(log) if r.get("event") == "worker_stopped"]
    assert stopped["requeued"] == 40


# Long generations on the tiny preset: a negative frequency penalty keeps
# most from ending early (its near-flat logits give the end-of-text token
# 1/256 a step), and the penalties' history is part of what a resumed run
# must carry on with.
RESUMED_JOBS = [
    {"prompt": f"Story {i}: once upon a time", "max_tokens": 400, "stream": True, "frequency_penalty": -2.0}
    | ({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "seed": 500 + i})
    for i in range(6)
] + [{"prompt": "A job with logprobs", "max_tokens": 400, "temperature": 0.8, "seed": 9, "logprobs": True}]


@pytest.mark.timeout(900)
def test_a_sigkilled_workers_jobs_continue_from_their_saved_tokens(prefix, tmp_path):
    """Long generations on the real engine, the worker SIGKILLed once every
    job has tokens in the store (or has finished): a second worker on the
    same store finishes every job, each one that was running from its saved
    tokens (its first chunk says how many it did not generate); the texts
    (and logprobs) equal the uninterrupted run's (the same bodies under
    other keys, no fault); the saved tokens are gone with the results; and
    the tokens generated twice are counted: what the dead worker streamed
    past its last save."""
    import json

    from jaxserve.client import AsyncClient
    from jaxserve.worker.store import SqliteStore

    state = tmp_path / "state"
    engine = ["--model", "tiny", "--max-num-seqs", "16", "--max-model-len", "480", "--state-dir", str(state)]
    args = [*engine, "--save-tokens-every", "8", "--save-tokens-interval", "0.5"]
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a = start_worker_process(prefix, log_a, *args, engine=None)
    b = None
    store_path = state / f"store-{prefix}.sqlite3"

    async def scenario() -> dict:
        nonlocal b
        conn, _ch, q = await reply_queue(prefix)
        msgs: list[dict] = []

        async def take(m) -> None:
            msgs.append(orjson.loads(m.body))

        def results() -> dict[str, dict]:
            return {m["id"]: m for m in msgs if m["type"] == "result"}

        await q.consume(take, no_ack=True)
        try:
            await asyncio.to_thread(wait_log, log_a, "worker_consuming", 300)
            async with AsyncClient(AMQP_URL, prefix=prefix) as c:
                keys = [
                    await c.publish(body, key=f"r-{i}", queue="batch", reply_to=q.name, expect_reply=False)
                    for i, body in enumerate(RESUMED_JOBS)
                ]
                store = SqliteStore(store_path)
                saved: dict[str, int] = {}
                done_before: set[str] = set()

                async def every_job_saved_or_done() -> bool:
                    done_before.update(results())
                    for k in keys:
                        saved[k] = sum(len(chunk.token_ids) for chunk in await store.saved_tokens(k))
                    return all(saved[k] >= 16 or k in done_before for k in keys)

                while not await every_job_saved_or_done():
                    await asyncio.sleep(0.02)
                os.kill(a.pid, signal.SIGKILL)
                await asyncio.to_thread(a.wait, 30)
                b = start_worker_process(prefix, log_b, *args, engine=None)
                await asyncio.to_thread(wait_log, log_b, "worker_consuming", 300)
                while len(results()) < len(keys):
                    assert b.poll() is None, log_b.read_text()[-3000:]
                    await asyncio.sleep(0.1)
                finished = [results()[k] for k in keys]
                left = {k: await store.saved_tokens(k) for k in keys}
                refs = [await c.publish(body, key=f"ref-{i}", queue="batch") for i, body in enumerate(RESUMED_JOBS)]
                uninterrupted = [r.to_dict() for r in await asyncio.gather(*(c.wait(k, timeout=300) for k in refs))]
                await c.delete_reply_queue()
                await store.close()
        finally:
            await conn.close()
        return {
            "finished": finished,
            "uninterrupted": uninterrupted,
            "left": left,
            "saved": saved,
            "done_before": done_before,
            "msgs": msgs,
        }

    try:
        out = asyncio.run(scenario())
    finally:
        for p in (a, b):
            if p is not None:
                stop_process(p)
    finished, uninterrupted = out["finished"], out["uninterrupted"]
    assert a.returncode == -signal.SIGKILL
    assert [r["status"] for r in finished] == ["ok"] * len(RESUMED_JOBS), finished
    assert [r["text"] for r in finished] == [r["text"] for r in uninterrupted]
    lp = [t["logprob"] for t in finished[-1]["logprobs"]["content"]]
    assert lp == pytest.approx([t["logprob"] for t in uninterrupted[-1]["logprobs"]["content"]], abs=1e-4)
    assert all(chunks == [] for chunks in out["left"].values())  # gone with the results
    starts = [json.loads(line) for line in log_b.read_text().splitlines() if '"job_start"' in line]
    resumed = {r["key"]: r.get("resumed_tokens", 0) for r in starts if r["key"].startswith("r-")}
    running = [k for k in resumed if k not in out["done_before"]]
    assert len(running) >= 4 and all(resumed[k] >= out["saved"][k] >= 16 for k in running)
    # A streaming job's second run starts at seq 0 with a chunk that carries
    # the saved text and generates only the rest; what its first run
    # streamed past the saved tokens was generated twice.
    recomputed = streamed = 0
    for i, r in enumerate(finished[:6]):
        key = f"r-{i}"
        if key not in running:
            continue
        runs: dict[str, list[dict]] = collections.defaultdict(list)
        for m in out["msgs"]:
            if m["type"] == "chunk" and m["id"] == key:
                runs[m["run"]].append(m)
        assert len(runs) == 2, runs.keys()
        first, second = sorted(runs.values(), key=lambda chunks: "resumed" in chunks[0])
        assert second[0]["seq"] == 0 and second[0]["resumed"] == resumed[key]
        assert "".join(m["text"] for m in second) == r["text"]
        assert sum(m["tokens"] for m in second) - second[0]["resumed"] == r["usage"]["completion_tokens"] - resumed[key]
        streamed += sum(m["tokens"] for m in first)
        recomputed += max(0, sum(m["tokens"] for m in first) - resumed[key])
    assert recomputed < streamed  # without saved tokens, all of it
    print(f"recomputed {recomputed} of the {streamed} tokens the killed worker streamed")
