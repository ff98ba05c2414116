"""Queue worker behaviour against the real RabbitMQ (engine: EchoEngine double)."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid

import aio_pika
import orjson
import pytest

from jaxserve.client import JobError, QueueFull, retry_with_backoff
from jaxserve.wire.topology import Topology, TopologyMismatch, declare_topology
from jaxserve.worker.admission import AdmissionConfig
from jaxserve.worker.store import Record, RedisStore
from queue_support import (
    AMQP_URL,
    HELD_FIRST_MARKER,
    EchoEngine,
    expected_completion,
    raw_publish,
    unacked_counts,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


async def _raw_reply_queue(prefix: str):
    """A reply queue we read message by message (order, properties)."""
    conn = await aio_pika.connect(AMQP_URL)
    ch = await conn.channel()
    q = await ch.declare_queue(
        f"{prefix}.reply.raw-{uuid.uuid4().hex[:6]}", auto_delete=False, arguments={"x-expires": 60000}
    )
    return conn, q


async def _collect(q, until, timeout: float = 15.0) -> list:
    msgs: list = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = await q.get(no_ack=True, fail=False)
        if m is None:
            if until(msgs):
                return msgs
            await asyncio.sleep(0.02)
            continue
        msgs.append(m)
        if until(msgs):
            return msgs
    raise AssertionError(f"timed out; got {[orjson.loads(m.body) for m in msgs]}")


def _finals(msgs):
    return [orjson.loads(m.body) for m in msgs if orjson.loads(m.body).get("type") == "result"]


async def test_stream_order_and_reassembly(harness, client, prefix):
    await harness.start(EchoEngine(step_s=0.001))
    prompts = [f"alpha{i} beta gamma delta{i}" for i in range(6)]
    streams = [await client.stream(p, max_tokens=25, timeout=20) for p in prompts]

    async def consume(s):
        return "".join([d async for d in s])

    texts = await asyncio.gather(*(consume(s) for s in streams))
    for p, s, text in zip(prompts, streams, texts):
        want, reason = expected_completion(p, 25)
        assert text == want == s.result.text
        assert s.result.id == s.key and s.result.finish_reason == reason
        assert s.gaps == 0 and s.duplicates == 0
        assert s.result.usage.model_dump(exclude_none=True) == {
            "prompt_tokens": len(p.encode()),
            "completion_tokens": 25,
        }
        assert "ttft_s" in s.result.raw["timings"]


async def test_raw_chunks_in_order_final_carries_key(harness, prefix):
    await harness.start(EchoEngine(step_s=0.001))
    conn, q = await _raw_reply_queue(prefix)
    try:
        key = "k-" + uuid.uuid4().hex
        await raw_publish(
            prefix,
            orjson.dumps({"prompt": "one two three", "max_tokens": 12, "stream": True}),
            message_id=key,
            reply_to=q.name,
            correlation_id="corr-1",
        )
        msgs = await _collect(q, lambda ms: any(orjson.loads(m.body)["type"] == "result" for m in ms))
        bodies = [orjson.loads(m.body) for m in msgs]
        assert all(m.correlation_id == "corr-1" for m in msgs)
        chunks = [b for b in bodies if b["type"] == "chunk"]
        assert [c["seq"] for c in chunks] == list(range(len(chunks)))
        assert bodies[-1]["type"] == "result" and msgs[-1].message_id == key and bodies[-1]["id"] == key
        assert "".join(c["text"] for c in chunks) == bodies[-1]["text"] == expected_completion("one two three", 12)[0]
    finally:
        await conn.close()


async def test_first_token_is_streamed_while_its_text_is_held_back(harness, prefix):
    """Time to first token is the first chunk: a first token whose text the
    detokenizer still holds (part of a UTF-8 character) goes out as an
    empty chunk carrying the token, not with the next decodable text."""
    eng = await harness.start(EchoEngine(step_s=0.001))
    conn, q = await _raw_reply_queue(prefix)
    try:
        key = "held-" + uuid.uuid4().hex
        prompt = f"{HELD_FIRST_MARKER} one two"
        await raw_publish(
            prefix,
            orjson.dumps({"prompt": prompt, "max_tokens": 3, "stream": True}),
            message_id=key,
            reply_to=q.name,
            correlation_id="c",
        )
        # the engine stalls right after the held token: only the first chunk can be out
        first = await _collect(q, lambda ms: len(ms) >= 1)
        assert orjson.loads(first[0].body) | {"run": None} == {
            "type": "chunk",
            "id": key,
            "seq": 0,
            "text": "",
            "run": None,
            "tokens": 1,
        }
        await asyncio.sleep(0.2)
        assert await q.get(no_ack=True, fail=False) is None  # nothing more while stalled
        eng.host.engine.unstall()
        rest = await _collect(q, lambda ms: any(orjson.loads(m.body)["type"] == "result" for m in ms))
        bodies = [orjson.loads(m.body) for m in first + rest]
        chunks = [b for b in bodies if b["type"] == "chunk"]
        assert [c["seq"] for c in chunks] == list(range(len(chunks))) and len(chunks) >= 2
        assert "".join(c["text"] for c in chunks) == bodies[-1]["text"] == expected_completion(prompt, 3)[0]
    finally:
        await conn.close()


async def test_replay_does_not_run_engine(harness, client):
    w = await harness.start()
    r1 = await client.submit("replay me please", max_tokens=8, timeout=10)
    assert r1.ok and not r1.replayed
    r2 = await client.submit("replay me please", max_tokens=8, key=r1.id, timeout=10)
    assert r2.ok and r2.replayed and r2.text == r1.text and r2.id == r1.id
    assert w.host.engine.add_count[r1.id] == 1
    # A duplicate published while the first is still running is fenced.
    w.host.engine.stall()
    key = "dup-" + uuid.uuid4().hex
    await client.publish({"prompt": "dup job", "max_tokens": 4}, key=key)
    await wait_until(lambda: w.host.engine.add_count[key] == 1)
    await client.publish({"prompt": "dup job", "max_tokens": 4}, key=key, correlation_id="second")
    await wait_until(lambda: w.stats["fenced"] >= 1)
    w.host.engine.unstall()
    r = await client.wait(key, timeout=10)
    assert r.ok and w.host.engine.add_count[key] == 1


BAD_JOBS = [
    ("not_json", b"{this is not json", "invalid_request"),
    ("wrong_types", orjson.dumps({"prompt": 5}), "invalid_request"),
    ("wrong_param_type", orjson.dumps({"prompt": "x", "max_tokens": "ten"}), "invalid_request"),
    ("negative_max_tokens", orjson.dumps({"prompt": "x", "max_tokens": -5}), "invalid_request"),
    ("huge_max_tokens", orjson.dumps({"prompt": "x", "max_tokens": 10**12}), "invalid_request"),
    ("bad_temperature", orjson.dumps({"prompt": "x", "temperature": "hot"}), "invalid_request"),
    ("prompt_too_long", orjson.dumps({"prompt": "word " * 200, "max_tokens": 4}), "context_length_exceeded"),
    ("unknown_model", orjson.dumps({"prompt": "x", "model": "gpt-17"}), "unknown_model"),
    ("binary_garbage", bytes(range(256)) * 4, "invalid_request"),
    ("oversized", orjson.dumps({"prompt": "y" * 5000}), "invalid_request"),
    ("array_body", b"[1, 2, 3]", "invalid_request"),
    (
        "both_prompt_and_messages",
        orjson.dumps({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
        "invalid_request",
    ),
    ("bad_stream", orjson.dumps({"prompt": "x", "stream": "yes"}), "invalid_request"),
]


async def test_bad_inputs_get_error_replies_and_worker_keeps_serving(harness, client, prefix):
    w = await harness.start(EchoEngine(max_model_len=512), max_body_bytes=4096)
    conn, q = await _raw_reply_queue(prefix)
    try:
        for name, body, _ in BAD_JOBS:
            await raw_publish(prefix, body, message_id=f"bad-{name}", reply_to=q.name, correlation_id=name)
        await raw_publish(
            prefix, orjson.dumps({"prompt": "x"}), message_id=None, reply_to=q.name, correlation_id="missing_message_id"
        )
        n = len(BAD_JOBS) + 1
        msgs = await _collect(q, lambda ms: len(ms) >= n)
        by_corr = {m.correlation_id: orjson.loads(m.body) for m in msgs}
        for name, _, code in BAD_JOBS:
            res = by_corr[name]
            assert res["type"] == "result" and res["status"] == "error", name
            assert res["error"]["code"] == code, (name, res)
            assert res["id"] == f"bad-{name}" and res["error"]["retryable"] is False
        missing = by_corr["missing_message_id"]
        assert missing["error"]["code"] == "invalid_request" and "message_id" in missing["error"]["message"]
        assert missing["id"] is None
    finally:
        await conn.close()
    r = await client.submit("still serving", max_tokens=3, timeout=10)
    assert r.ok
    assert sum(w.host.engine.add_count.values()) == 1
    # acked, not requeued: both job queues are empty and nothing is unacked
    await wait_until(lambda: w.stats["acked"] >= len(BAD_JOBS) + 2)
    depths = await client.queue_depths()
    assert depths[f"{client.topo.interactive}"]["messages"] == 0
    assert depths[f"{client.topo.dead}"]["messages"] == 0


async def test_bounded_prefetch_with_stalled_engine(harness, client, prefix):
    eng = EchoEngine(max_num_seqs=4, interactive_reserved_seqs=1, stalled=True)
    # The stall keeps 6 interactive jobs in the broker for several seconds;
    # past the default 2 s --target-ttft they would rightly be answered
    # overloaded. This test is about prefetch, so the target is out of reach.
    w = await harness.start(eng, admission=AdmissionConfig(target_ttft_s=300.0))
    assert w.served.prefetch == {"interactive": 4, "batch": 3}
    keys = [await client.publish({"prompt": f"b{i}", "max_tokens": 2}, queue="batch") for i in range(20)]
    keys += [await client.publish({"prompt": f"i{i}", "max_tokens": 2}, queue="interactive") for i in range(10)]
    await wait_until(lambda: len(w.runs) == 7)
    # The broker's view. Ready counts (passive declare) are exact at once;
    # rabbitmqctl's unacked counts are refreshed every few seconds.
    for _ in range(5):
        depths = await client.queue_depths()
        assert depths[f"{prefix}.batch"]["messages"] == 17 and depths[f"{prefix}.interactive"]["messages"] == 6
        await asyncio.sleep(0.1)
    maxima = {f"{prefix}.batch": 0, f"{prefix}.interactive": 0}
    end = time.monotonic() + 15
    while time.monotonic() < end:
        counts = await asyncio.to_thread(unacked_counts, prefix)
        for k in maxima:
            maxima[k] = max(maxima[k], counts.get(k, 0))
        if all(maxima.values()):
            break
        await asyncio.sleep(0.5)
    assert maxima[f"{prefix}.batch"] == 3
    assert maxima[f"{prefix}.interactive"] == 4
    eng.unstall()
    results = await asyncio.gather(*(client.wait(k, timeout=20) for k in keys))
    assert all(r.ok for r in results)
    assert eng.max_running_seen <= 4


async def test_full_queue_raises_queue_full(harness, client, prefix):
    eng = EchoEngine(max_num_seqs=2, interactive_reserved_seqs=1, stalled=True)
    w = await harness.start(eng, interactive_max_length=3)
    published = []
    with pytest.raises(QueueFull) as info:
        for i in range(50):
            published.append(await client.publish({"prompt": f"p{i}", "max_tokens": 2}))
            await asyncio.sleep(0.01)
    assert info.value.queue == f"{prefix}.interactive" and "full" in str(info.value)
    assert 3 <= len(published) <= 2 + 3 + 2  # prefetch + max length (+ quorum overshoot)
    with pytest.raises(QueueFull):
        await retry_with_backoff(lambda: client.publish({"prompt": "again"}), attempts=2, base=0.01)
    eng.unstall()
    key = await retry_with_backoff(lambda: client.publish({"prompt": "after", "max_tokens": 2}), attempts=20, base=0.05)
    assert (await client.wait(key, timeout=10)).ok
    await asyncio.gather(*(client.wait(k, timeout=10) for k in published))
    assert w.stats["done_ok"] >= len(published) + 1


async def test_cancel_running_job_frees_engine(harness, client):
    eng = EchoEngine(step_s=0.02)
    w = await harness.start(eng)
    s = await client.stream("cancel me now please", max_tokens=400, timeout=20)
    got = []
    with pytest.raises(JobError) as info:
        async for d in s:
            got.append(d)
            if len(got) == 3:
                await client.cancel(s.key)
    assert info.value.code == "cancelled" and info.value.result.id == s.key
    assert s.key in eng.aborted
    await wait_until(lambda: not eng.has_unfinished())
    # A cancel that arrives before the job is answered when it is delivered.
    key = "pre-" + uuid.uuid4().hex
    await client.cancel(key)
    await wait_until(lambda: w.stats["cancel_received"] >= 2)
    r = await client.submit("never runs", key=key, timeout=10)
    assert r.error.code == "cancelled" and eng.add_count[key] == 0


async def test_deadlines_before_admission_and_while_waiting(harness, client):
    eng = EchoEngine(stalled=True)
    await harness.start(eng)
    r = await client.submit("late", deadline=time.time() - 1, timeout=10)
    assert r.error.code == "expired" and eng.add_count[r.id] == 0
    t0 = time.monotonic()
    r = await client.submit("waits too long", expiration=0.5, timeout=10)
    assert r.error.code == "expired" and eng.add_count[r.id] == 1
    assert time.monotonic() - t0 < 5
    assert r.id in eng.aborted


async def test_heartbeats_do_not_starve_while_engine_busy(harness, client):
    # Each step burns 0.25 s of CPU in Python on the engine thread.
    eng = EchoEngine(step_s=0.0, busy_step_s=0.25)
    w = await harness.start(eng, heartbeat=1)
    r = await client.submit("busy busy", max_tokens=14, timeout=60)
    assert r.ok and r.usage.completion_tokens == 14
    assert eng.thread_ids and len(eng.thread_ids) == 1  # only the engine thread touched it
    assert w.stats["connection_lost_consume"] == 0 and w.stats["connection_lost_publish"] == 0
    assert w.stats["reconnect_consume"] == 0


async def test_drain_requeues_unfinished_jobs(harness, client, prefix):
    eng = EchoEngine(stalled=True)
    w1 = await harness.start(eng)
    keys = [await client.publish({"prompt": f"drain {i}", "max_tokens": 3}, queue="batch") for i in range(3)]
    await wait_until(lambda: len(w1.runs) == 3)
    await w1.shutdown(drain_timeout=0.3)
    assert w1.stats["requeued"] == 3
    depths = await client.queue_depths()
    assert depths[f"{prefix}.batch"]["messages"] == 3
    w2 = await harness.start(EchoEngine())
    results = await asyncio.gather(*(client.wait(k, timeout=15) for k in keys))
    assert all(r.ok for r in results) and w2.stats["done_ok"] == 3


async def test_a_step_failure_the_engine_cannot_attribute_requeues_and_reruns(harness, client):
    eng = EchoEngine(step_s=0.01)
    w = await harness.start(eng)
    eng.fail_next_step = True
    r = await client.submit("boom", max_tokens=5, timeout=10)
    # not answered with an error it did not earn: given back, run again
    assert r.ok and w.stats["requeued"] == 1 and eng.add_count[r.id] == 2
    assert (await client.submit("fine", max_tokens=2, timeout=10)).ok


async def test_topology_redeclare_is_idempotent_and_mismatch_is_explained(prefix):
    conn = await aio_pika.connect(AMQP_URL)
    try:
        await declare_topology(conn, Topology(prefix=prefix))
        await declare_topology(conn, Topology(prefix=prefix))
        with pytest.raises(TopologyMismatch) as info:
            await declare_topology(conn, Topology(prefix=prefix, delivery_limit=3))
        msg = str(info.value)
        assert "406" in msg and f"{prefix}.interactive" in msg and "--delivery-limit" in msg
    finally:
        await conn.close()


async def test_redis_store_fences_keys_across_workers(harness, client, prefix):
    ns = prefix
    other = RedisStore(namespace=ns)
    eng = EchoEngine()
    w = await harness.start(eng, store=RedisStore(namespace=ns), claim_lease_s=2.0, claim_poll_s=0.05)
    try:
        # another worker holds the key and finishes it: we replay, never run
        key = "shared-" + uuid.uuid4().hex
        assert await other.claim(key, "worker-B", 10.0) is None
        await client.publish({"prompt": "shared job", "max_tokens": 3}, key=key)
        await wait_until(lambda: w.stats["held_for_other_worker"] >= 1)
        done = {
            "type": "result",
            "id": key,
            "status": "ok",
            "text": "from B",
            "finish_reason": "stop",
            "usage": {"prompt_tokens": 1, "completion_tokens": 1},
            "timings": {},
        }
        await other.put(key, Record(done))
        r = await client.wait(key, timeout=10)
        assert r.text == "from B" and r.replayed and eng.add_count[key] == 0
        # a crashed owner's lease runs out: the job then runs here
        key2 = "lease-" + uuid.uuid4().hex
        assert await other.claim(key2, "worker-dead", 0.5) is None
        r2 = await client.submit("orphan job", key=key2, max_tokens=3, timeout=10)
        assert r2.ok and not r2.replayed and eng.add_count[key2] == 1
        assert (await other.get(key2)).result["text"] == r2.text
    finally:
        await other.close()


@pytest.mark.slow
async def test_interactive_first_under_batch_backlog(harness, client, prefix):
    eng = EchoEngine(max_num_seqs=8, interactive_reserved_seqs=2, step_s=0.004)
    w = await harness.start(eng)

    async def ttft() -> float:
        t0 = time.monotonic()
        s = await client.stream("quick question here", max_tokens=6, timeout=30)
        first = None
        async for _ in s:
            if first is None:
                first = time.monotonic() - t0
        return first

    idle = statistics.median([await ttft() for _ in range(5)])
    keys = []
    for i in range(400):
        keys.append(
            await client.publish(
                {"prompt": f"batch job number {i}", "max_tokens": 120}, queue="batch", expect_reply=False
            )
        )
    await wait_until(lambda: eng.max_running_seen >= 6)
    loaded = []
    for _ in range(5):
        depth = (await client.queue_depths())[f"{prefix}.batch"]["messages"]
        assert depth >= 200, depth
        loaded.append(await ttft())
    assert (await client.queue_depths())[f"{prefix}.batch"]["messages"] >= 200
    bound = idle + 0.5  # stated bound: TTFT under a 200+ job backlog within idle + 0.5 s
    assert statistics.median(loaded) <= bound, (idle, loaded)
    assert w.stats["done_ok"] < 200


async def test_readiness_and_liveness_probes(harness, client):
    """/readyz answers 200 only while the worker consumes; /healthz turns 503
    when the engine is hung (busy in one call past the hang timeout)."""
    import socket
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def get(path: str) -> int:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).status
        except urllib.error.HTTPError as exc:
            return exc.code

    eng = EchoEngine(step_s=0.001)
    w = await harness.start(eng, metrics_port=port, engine_hang_timeout_s=1.0)
    assert await asyncio.to_thread(get, "/readyz") == 200 and await asyncio.to_thread(get, "/healthz") == 200
    eng.stall()
    await client.publish({"prompt": "hang here", "max_tokens": 3})
    await wait_until(lambda: w.host.busy_since_mono is not None)
    eng.busy_step_s = 3.0  # one step that holds the engine thread for 3 s
    eng.unstall()
    await asyncio.sleep(2.0)
    assert await asyncio.to_thread(get, "/healthz") == 503
    await w.shutdown(drain_timeout=0.1)
    assert await asyncio.to_thread(get, "/readyz") == 503
