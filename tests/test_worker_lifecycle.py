"""The job lifecycle without a broker: the real Worker and EchoEngine (on its
engine thread), with a fake channel (messages that record their settlement),
a scripted reply publisher and a store whose calls can fail.

These pin the state machine's rules: every delivery of a key is settled
exactly once, a final that cannot be published is requeued (never acked),
a store outage at any await makes the job wait instead of failing it, and a
duplicate arriving while a confirm is pending is answered too.
"""

from __future__ import annotations

import asyncio
import collections
import itertools

import orjson
import pytest

from jaxserve.wire import Result
from jaxserve.worker.lifecycle import Delivery, IllegalTransition, JobState, KeyJob, Settlement
from jaxserve.worker.replies import PublishOutcome
from jaxserve.worker.store import MemoryStore, StoreUnavailable
from jaxserve.worker.worker import Worker, WorkerConfig
from queue_support import FAIL_MARKER, EchoEngine, expected_completion

pytestmark = pytest.mark.timeout(60)

_tags = itertools.count(1)


class FakeMessage:
    """An incoming delivery: AMQP properties plus ack/nack that record what
    happened (and can fail like a closed channel)."""

    def __init__(
        self,
        body: dict | bytes,
        key: str | None,
        *,
        reply_to: str = "replies",
        redelivered: bool = False,
        priority: int | None = None,
        expiration=None,
        headers: dict | None = None,
    ) -> None:
        self.body = body if isinstance(body, bytes) else orjson.dumps(body)
        self.message_id = key
        self.reply_to = reply_to
        self.correlation_id = key
        self.content_type = "application/json"
        self.content_encoding = None
        self.expiration = expiration
        self.timestamp = None
        self.headers = headers or {}
        self.priority = priority
        self.redelivered = redelivered
        self.delivery_tag = next(_tags)
        self.type = self.user_id = self.app_id = self.cluster_id = None
        self.routing_key = "q"
        self.exchange = ""
        self.settlements: list[str] = []
        self.channel_closed = False

    async def ack(self) -> None:
        if self.channel_closed:
            raise RuntimeError("channel closed")
        self.settlements.append("ack")

    async def nack(self, requeue: bool = True) -> None:
        if self.channel_closed:
            raise RuntimeError("channel closed")
        self.settlements.append("requeue" if requeue else "reject")


class FakePublisher:
    """Records every publish; ``script`` gives outcomes in order (then
    CONFIRMED); ``gate``, when set, holds the next final until released."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []
        self.script: collections.deque[PublishOutcome] = collections.deque()
        self.gate: asyncio.Event | None = None
        self.waiting = asyncio.Event()

    async def publish(self, routing_key, body, *, correlation_id, message_id, timeout_s) -> PublishOutcome:
        msg = orjson.loads(body)
        if msg["type"] == "result" and self.gate is not None:
            gate, self.gate = self.gate, None
            self.waiting.set()
            await gate.wait()
        self.sent.append((routing_key, msg))
        return self.script.popleft() if self.script else PublishOutcome.CONFIRMED

    def finals(self) -> list[dict]:
        return [m for _, m in self.sent if m["type"] == "result"]

    async def close(self) -> None:
        pass


class FlakyStore(MemoryStore):
    """MemoryStore whose named methods raise StoreUnavailable ``failures[name]``
    times first (or for ever while ``down`` is set)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: collections.Counter = collections.Counter()
        self.down = False
        self.calls: collections.Counter = collections.Counter()

    def _maybe_fail(self, name: str) -> None:
        self.calls[name] += 1
        if self.down:
            raise StoreUnavailable("store down")
        if self.failures[name] > 0:
            self.failures[name] -= 1
            raise StoreUnavailable(f"{name} failed")

    async def get(self, key):
        self._maybe_fail("get")
        return await super().get(key)

    async def put(self, key, record):
        self._maybe_fail("put")
        return await super().put(key, record)

    async def claim(self, key, owner, lease_s):
        self._maybe_fail("claim")
        return await super().claim(key, owner, lease_s)

    async def is_cancelled(self, key):
        self._maybe_fail("is_cancelled")
        return await super().is_cancelled(key)

    async def mark_cancelled(self, key, ttl_s):
        self._maybe_fail("mark_cancelled")
        return await super().mark_cancelled(key, ttl_s)


@pytest.fixture
async def worker():
    """A Worker with its engine thread running and no AMQP at all."""
    made: list[Worker] = []

    async def make(engine: EchoEngine | None = None, store=None, **cfg) -> tuple[Worker, FakePublisher]:
        cfg.setdefault("store_retry_max_s", 0.02)
        w = Worker(lambda: engine or EchoEngine(step_s=0.001), WorkerConfig(**cfg), store=store or FlakyStore())
        assert await w.start_engine()
        w.connections.publisher = FakePublisher()  # type: ignore[assignment]
        made.append(w)
        return w, w.connections.publisher  # type: ignore[return-value]

    yield make
    for w in made:
        w.state.close()
        await asyncio.to_thread(w.host.stop)


async def deliver(w: Worker, msg: FakeMessage, queue_class: str = "batch") -> asyncio.Task:
    return w.spawn(w.intake.take(msg, queue_class))


async def settled(w: Worker, *msgs: FakeMessage, timeout: float = 10.0) -> None:
    async def check() -> None:
        while not all(m.settlements for m in msgs) or w.runs:
            await asyncio.sleep(0.005)

    await asyncio.wait_for(check(), timeout)


JOB = {"prompt": "alpha beta", "max_tokens": 4, "temperature": 0}


async def test_ok_job_stored_then_published_then_acked(worker):
    w, pub = await worker()
    m = FakeMessage(JOB, "k1")
    await deliver(w, m)
    await settled(w, m)
    assert m.settlements == ["ack"]
    [final] = pub.finals()
    assert final["status"] == "ok" and final["text"] == expected_completion("alpha beta", 4)[0]
    rec = await w.store.get("k1")
    assert rec.result["text"] == final["text"] and rec.delivered == ["replies|k1"] and rec.fingerprint


async def test_duplicate_arriving_while_the_final_awaits_its_confirm_is_answered(worker):
    w, pub = await worker()
    gate = pub.gate = asyncio.Event()
    first, dup = FakeMessage(JOB, "k"), FakeMessage(JOB, "k", reply_to="other")
    await deliver(w, first)
    await asyncio.wait_for(pub.waiting.wait(), 5)
    assert w.runs.get("k").state is JobState.FINISHING
    await deliver(w, dup)
    await asyncio.sleep(0.02)
    assert len(w.runs.get("k").deliveries) == 2
    gate.set()  # the pending confirm arrives
    await settled(w, first, dup)
    assert first.settlements == ["ack"] and dup.settlements == ["ack"]
    finals = pub.finals()
    assert [f["status"] for f in finals] == ["ok", "ok"] and finals[1]["replayed"] is True
    assert [rk for rk, m in pub.sent if m["type"] == "result"] == ["replies", "other"]
    assert w.host.engine.add_count["k"] == 1


@pytest.mark.parametrize("outcome", [PublishOutcome.FAILED, PublishOutcome.NACKED])
async def test_a_final_that_cannot_be_published_is_requeued_and_the_redelivery_replays(worker, outcome):
    w, pub = await worker()
    pub.script.append(outcome)
    m = FakeMessage(JOB, "k")
    await deliver(w, m)
    await settled(w, m)
    assert m.settlements == ["requeue"]  # never acked without a confirmed reply
    again = FakeMessage(JOB, "k", redelivered=True)
    await deliver(w, again)
    await settled(w, again)
    assert again.settlements == ["ack"] and w.host.engine.add_count["k"] == 1
    first, replay = pub.finals()
    assert replay["replayed"] is True and replay["text"] == first["text"]


@pytest.mark.parametrize("outcome", [PublishOutcome.UNROUTABLE, PublishOutcome.REFUSED])
async def test_a_final_whose_destination_cannot_take_it_ends_the_job(worker, outcome):
    w, pub = await worker()
    pub.script.append(outcome)
    m = FakeMessage(JOB, "k")
    await deliver(w, m)
    await settled(w, m)
    assert m.settlements == ["ack"] and w.stats["reply_undeliverable"] == 1
    assert (await w.store.get("k")).result["status"] == "ok"  # a resubmission is answered from the store


@pytest.mark.parametrize("method", ["get", "is_cancelled", "claim", "put"])
async def test_a_store_error_at_any_await_makes_the_job_wait_not_fail(worker, method):
    w, pub = await worker()
    w.store.failures[method] = 5
    m = FakeMessage(JOB, "k")
    await deliver(w, m)
    await settled(w, m)
    assert w.store.calls[method] >= 6
    assert m.settlements == ["ack"]
    [final] = pub.finals()
    assert final["status"] == "ok"
    assert w.stats["store_unavailable"] >= 5


async def test_a_store_outage_holds_the_job_and_drain_requeues_it(worker):
    w, pub = await worker()
    w.store.down = True
    m = FakeMessage(JOB, "k")
    await deliver(w, m)
    await asyncio.wait_for(_until(lambda: "k" in w.runs and w.runs.get("k").state is JobState.HELD), 5)
    await asyncio.sleep(0.05)
    assert w.runs.get("k").state is JobState.HELD and m.settlements == []
    await w.shutdown(drain_timeout=0.05)
    assert m.settlements == ["requeue"] and pub.finals() == []


async def test_store_back_after_an_outage_the_held_job_runs(worker):
    w, pub = await worker()
    w.store.down = True
    m = FakeMessage(JOB, "k")
    await deliver(w, m)
    await asyncio.wait_for(_until(lambda: w.store.calls["get"] >= 3), 5)
    w.store.down = False
    await settled(w, m)
    assert m.settlements == ["ack"] and pub.finals()[0]["status"] == "ok"


async def test_a_key_reused_with_another_body_is_refused(worker):
    w, pub = await worker()
    m = FakeMessage(JOB, "k")
    await deliver(w, m)
    await settled(w, m)
    other = FakeMessage({**JOB, "prompt": "something else"}, "k")
    await deliver(w, other)
    await settled(w, other)
    assert other.settlements == ["ack"]
    assert pub.finals()[-1]["error"]["code"] == "idempotency_key_reused"
    same = FakeMessage({**JOB, "stream": False, "tenant": "t"}, "k")  # same effect: a replay
    await deliver(w, same)
    await settled(w, same)
    assert pub.finals()[-1]["replayed"] is True and w.host.engine.add_count["k"] == 1


async def test_a_duplicate_with_another_body_while_running_is_refused_at_once(worker):
    eng = EchoEngine(step_s=0.001, stalled=True)
    w, pub = await worker(eng)
    m = FakeMessage(JOB, "k")
    await deliver(w, m)
    await asyncio.sleep(0.05)
    other = FakeMessage({**JOB, "max_tokens": 5}, "k")
    await deliver(w, other)
    await asyncio.wait_for(_until(lambda: other.settlements), 5)
    assert other.settlements == ["ack"] and pub.finals()[0]["error"]["code"] == "idempotency_key_reused"
    eng.unstall()
    await settled(w, m)
    assert m.settlements == ["ack"] and pub.finals()[1]["status"] == "ok"


async def test_a_retryable_engine_failure_is_requeued_and_others_finish(worker):
    w, pub = await worker()
    bad = FakeMessage({"prompt": f"x {FAIL_MARKER}", "max_tokens": 3}, "bad")
    goods = [FakeMessage({**JOB, "prompt": f"good {i}"}, f"g{i}") for i in range(5)]
    for m in [goods[0], goods[1], bad, *goods[2:]]:
        await deliver(w, m)
    await settled(w, bad, *goods)
    assert bad.settlements == ["requeue"]  # x-delivery-limit dead-letters it if it keeps failing
    assert all(g.settlements == ["ack"] for g in goods)
    assert sorted(f["id"] for f in pub.finals()) == [f"g{i}" for i in range(5)]
    assert all(f["status"] == "ok" for f in pub.finals())


async def test_requeue_while_a_final_is_publishing_settles_each_delivery_once(worker):
    w, pub = await worker()
    gate = asyncio.Event()
    pub.gate = gate
    m = FakeMessage(JOB, "k")
    await deliver(w, m)
    await asyncio.wait_for(pub.waiting.wait(), 5)
    await w.shutdown(drain_timeout=0.0)
    gate.set()
    await asyncio.sleep(0.05)
    assert m.settlements == ["requeue"]


async def test_a_lost_channel_is_not_acked_twice_and_the_job_leaves(worker):
    w, pub = await worker()
    m = FakeMessage(JOB, "k")
    m.channel_closed = True
    await deliver(w, m)
    await asyncio.wait_for(_until(lambda: not w.runs), 5)
    assert m.settlements == [] and not w.runs


async def _until(pred) -> None:
    while not pred():
        await asyncio.sleep(0.005)


async def test_cancel_acts_locally_while_the_store_is_down(worker):
    eng = EchoEngine(step_s=0.001, stalled=True)
    w, pub = await worker(eng)
    m = FakeMessage(JOB, "k")
    await deliver(w, m)
    await asyncio.wait_for(_until(lambda: len(eng.waiting) == 1), 5)
    w.store.down = True
    cancel = FakeMessage({"type": "cancel", "id": "k"}, None)
    await w.control.on_message(cancel)
    await asyncio.wait_for(_until(lambda: pub.finals()), 5)
    assert pub.finals()[0]["error"]["code"] == "cancelled" and "k" in eng.aborted
    w.store.down = False
    await settled(w, m)
    later = FakeMessage(JOB, "k")  # a resubmission while the store was down still sees the cancel
    w.store.down = False
    await deliver(w, later)
    await settled(w, later)
    assert pub.finals()[-1]["error"]["code"] == "cancelled" and eng.add_count["k"] == 1


async def test_a_lost_lease_gives_the_job_back(worker):
    class LosingStore(FlakyStore):
        async def renew(self, key, owner, lease_s):
            return False

        async def claim(self, key, owner, lease_s):
            self.calls["claim"] += 1
            return None if self.calls["claim"] == 1 else "someone-else"

    eng = EchoEngine(step_s=0.001, stalled=True)
    w, pub = await worker(eng, store=LosingStore(), claim_lease_s=0.3)
    w.spawn(w.control.renew_loop())
    m = FakeMessage(JOB, "k")
    await deliver(w, m)
    await settled(w, m)
    assert m.settlements == ["requeue"] and pub.finals() == [] and "k" in eng.aborted


async def test_higher_priority_runs_earlier_within_its_class(worker):
    eng = EchoEngine(step_s=0.001, max_num_seqs=1, interactive_reserved_seqs=0, stalled=True)
    w, pub = await worker(eng)
    msgs = [FakeMessage({**JOB, "prompt": f"p{p}"}, f"k{p}", priority=p) for p in (0, 5, 9, 1)]
    for m in msgs:
        await deliver(w, m)
    await asyncio.wait_for(_until(lambda: len(eng.waiting) == 4), 10)  # all four in the engine
    eng.unstall()
    await settled(w, *msgs)
    assert [f["id"] for f in pub.finals()] == ["k9", "k5", "k1", "k0"]


def test_delivery_settles_once_and_transitions_are_checked():
    async def go() -> None:
        m = FakeMessage(JOB, "k")
        d = Delivery(m, "batch", "r", "k")
        assert await d.settle(Settlement.ACK) is True
        assert await d.settle(Settlement.REQUEUE) is False
        assert m.settlements == ["ack"]

    asyncio.run(go())
    from jaxserve.wire import JobProperties, parse_job

    job = parse_job(orjson.dumps(JOB), JobProperties(message_id="k"))
    kj = KeyJob("k", job, Delivery(FakeMessage(JOB, "k"), "batch", "r", "k"), 0.0)
    with pytest.raises(IllegalTransition):
        kj.to(JobState.RUNNING)  # RECEIVED -> RUNNING skips admission
    kj.to(JobState.ADMITTING)
    kj.to(JobState.FINISHING)
    kj.to(JobState.SETTLED)
    with pytest.raises(IllegalTransition):
        kj.attach(Delivery(FakeMessage(JOB, "k"), "batch", "r", "k"))
    assert Result.failure("k", "internal", "x").retryable_error


@pytest.mark.parametrize("marked", [True, False])
async def test_killed_between_final_and_ack_the_sqlite_store_answers_the_redelivery(worker, tmp_path, marked):
    """The default store is a file: a worker that dies after publishing a
    sampled job's final but before acking it (here: the ack never reaches
    the broker) leaves the result on disk, and the next worker answers the
    redelivery from it instead of sampling again: silently when the reply
    was recorded as delivered to that destination, else by replaying it."""
    from jaxserve.worker.store import SqliteStore

    class Store(SqliteStore):
        async def mark_delivered(self, key, dest):
            if not marked:
                raise StoreUnavailable("died before recording the delivery")
            await super().mark_delivered(key, dest)

    path = tmp_path / "store.sqlite3"
    body = {"prompt": "a sampled job", "max_tokens": 6, "temperature": 0.9}
    w1, pub1 = await worker(store=Store(path))
    m = FakeMessage(body, "k")
    m.channel_closed = True  # the process dies before its ack
    await deliver(w1, m)
    await asyncio.wait_for(_until(lambda: not w1.runs), 5)
    [first] = pub1.finals()
    assert first["status"] == "ok" and m.settlements == []
    await w1.store.close()

    eng2 = EchoEngine(step_s=0.001)
    w2, pub2 = await worker(eng2, store=SqliteStore(path))  # the restarted worker
    again = FakeMessage(body, "k", redelivered=True)
    await deliver(w2, again)
    await settled(w2, again)
    assert eng2.add_count["k"] == 0 and again.settlements == ["ack"]
    if marked:
        assert pub2.finals() == []  # that destination has its answer already
    else:
        [second] = pub2.finals()
        assert second["text"] == first["text"] and second["replayed"] is True


async def test_sqlite_claims_of_a_dead_process_are_free(tmp_path):
    from jaxserve.worker.store import SqliteStore

    a, b = SqliteStore(tmp_path / "s.sqlite3"), SqliteStore(tmp_path / "s.sqlite3")
    assert await a.claim("k", "worker-a", 30) is None
    assert await b.claim("k", "worker-b", 30) == "worker-a"  # a live owner holds it
    a._db.execute("UPDATE claims SET pid = ?", (2**22 + 12345,))  # no such process
    assert await b.claim("k", "worker-b", 30) is None
    assert await b.renew("k", "worker-b", 30) and not await a.renew("k", "worker-a", 30)
    await a.close()
    await b.close()


async def test_a_delivery_that_cannot_be_read_is_answered_and_acked_once(worker, monkeypatch):
    import jaxserve.worker.intake as wmod

    w, pub = await worker()

    def broken(*a, **k):
        raise RecursionError("pathological body")

    monkeypatch.setattr(wmod, "parse_job", broken)
    m = FakeMessage(JOB, "k")
    await deliver(w, m)
    await asyncio.wait_for(_until(lambda: m.settlements), 5)
    assert m.settlements == ["ack"] and w.stats["unreadable"] == 1
    [final] = pub.finals()
    assert final["error"]["code"] == "invalid_request" and "RecursionError" in final["error"]["message"]
