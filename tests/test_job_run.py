"""A job's run gives back everything it took, however it ends.

``jaxserve.worker.holdings``: a run registers each resource when it takes
it (claim, engine slot, interactive admission hold, tenant count, deadline
timer, sender) and its ending releases what is still held. These drive the
real Worker (no broker, as ``test_worker_lifecycle.py``) through each way a
running interactive job can end, then check the worker holds nothing for it:
no admission tokens, no claim in the store, no tenant in flight, nothing in
the engine.
"""

from __future__ import annotations

import asyncio

import pytest

from jaxserve.worker.holdings import Ending, Holdings
from jaxserve.worker.lifecycle import JobState
from jaxserve.worker.limits import LimitsConfig, TenantLimit
from jaxserve.worker.replies import PublishOutcome
from queue_support import EchoEngine
from test_worker_lifecycle import FakeMessage, _until, deliver, settled, worker  # noqa: F401 - worker: a fixture

pytestmark = pytest.mark.timeout(60)

JOB = {"prompt": "alpha beta", "max_tokens": 4, "temperature": 0, "tenant": "acme"}
ONE_AT_A_TIME = LimitsConfig(tenants={"acme": TenantLimit(max_in_flight=1)})


async def test_holdings_release_in_order_once_whatever_the_order_taken():
    released: list[str] = []
    h = Holdings()

    async def later(name: str) -> None:
        released.append(name)

    h.take("claim", lambda _e: later("claim"))
    h.take("sender", lambda _e: later("sender"))
    h.take("deadline", lambda _e: released.append("deadline"))
    h.take("admission", lambda _e: released.append("admission"))
    h.release_now("admission")  # a first token ends the hold early
    h.forget("sender")  # ended on its own: nothing to give back
    await h.release(Ending())
    await h.release(Ending())
    assert released == ["admission", "deadline", "claim"]
    assert not any(h.holds(n) for n in Holdings.ORDER)


async def _running(w, eng, key: str = "k") -> FakeMessage:
    m = FakeMessage(JOB, key)
    await deliver(w, m, "interactive")
    await asyncio.wait_for(_until(lambda: key in w.runs and w.runs.get(key).state is JobState.RUNNING), 5)
    await asyncio.wait_for(_until(lambda: len(eng.waiting) == 1), 5)
    run = w.runs.get(key)
    assert run.claimed and run.in_engine and w.admission.held_tokens > 0 and w.limiter._in_flight["acme"]
    return m


def _holds_nothing(w, eng, key: str = "k") -> None:
    assert w.runs.holds_nothing
    assert w.admission.held_tokens == 0
    assert key not in w.store._claims
    assert not w.limiter._in_flight.get("acme")


async def _cancel(w, key):
    await w.control.on_message(FakeMessage({"type": "cancel", "id": key}, None))


async def _drain(w, key):
    await w.runs.get(key).requeue("drain")


async def _step_error(w, key):
    w.on_step_error(RuntimeError("a step failed"))


@pytest.mark.parametrize(
    ("end", "settlement", "code"),
    [(_cancel, "ack", "cancelled"), (_drain, "requeue", None), (_step_error, "requeue", None)],
)
async def test_a_run_ended_while_running_gives_back_everything(worker, end, settlement, code):  # noqa: F811 - fixture
    eng = EchoEngine(step_s=0.001, stalled=True)
    w, pub = await worker(eng, limits=ONE_AT_A_TIME)
    m = await _running(w, eng)
    await end(w, "k")
    await settled(w, m)
    assert m.settlements == [settlement] and "k" in eng.aborted
    assert [f["error"]["code"] for f in pub.finals()] == ([code] if code else [])
    _holds_nothing(w, eng)


async def test_a_finished_run_gives_back_everything_and_the_tenant_runs_again(worker):  # noqa: F811 - fixture
    w, pub = await worker(EchoEngine(step_s=0.001), limits=ONE_AT_A_TIME)
    for key in ("a", "b"):  # in flight one at a time: "b" runs only if "a" gave its place back
        m = FakeMessage(JOB, key)
        await deliver(w, m, "interactive")
        await settled(w, m)
        assert m.settlements == ["ack"]
        _holds_nothing(w, None, key)
    assert [f["status"] for f in pub.finals()] == ["ok", "ok"]


async def test_a_batch_job_over_its_tenant_limit_is_deferred_and_holds_nothing(worker):  # noqa: F811 - fixture
    eng = EchoEngine(step_s=0.001, stalled=True)
    w, pub = await worker(eng, limits=ONE_AT_A_TIME, defer_wait_max_s=0.0)
    republished: list[tuple[str, dict]] = []

    async def publish_message(routing_key, msg, timeout_s):
        republished.append((routing_key, dict(msg.headers)))
        return PublishOutcome.CONFIRMED

    pub.publish_message = publish_message
    first = await _running(w, eng, "a")
    second = FakeMessage(JOB, "b")
    await deliver(w, second, "batch")
    await asyncio.wait_for(_until(lambda: second.settlements), 5)
    assert second.settlements == ["ack"] and w.stats["deferred"] == 1 and pub.finals() == []
    assert [(q, h.get("x-jaxserve-deferred")) for q, h in republished] == [(w.topo.batch, 1)]
    assert "b" not in w.runs and "b" not in w.store._claims and first.settlements == []
    assert w.limiter._in_flight["acme"] == {w.runs.get("a").request_id}  # only the running job counts


async def test_a_deferred_job_whose_republish_fails_goes_back_to_the_broker(worker):  # noqa: F811 - fixture
    eng = EchoEngine(step_s=0.001, stalled=True)
    w, pub = await worker(eng, limits=ONE_AT_A_TIME, defer_wait_max_s=0.0)

    async def publish_message(routing_key, msg, timeout_s):
        raise ConnectionError("the publishing connection is gone")

    pub.publish_message = publish_message
    await _running(w, eng, "a")
    second = FakeMessage(JOB, "b")
    await deliver(w, second, "batch")
    await asyncio.wait_for(_until(lambda: second.settlements), 5)
    assert second.settlements == ["requeue"] and "b" not in w.runs
