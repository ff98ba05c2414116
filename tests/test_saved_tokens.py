"""Saved tokens (``jaxserve.worker.progress``): a running job's generated
tokens go to the store as they come, and the worker that takes the job
after its worker died continues from them.

Through each store (memory, SQLite, the shared Redis): chunks of several
jobs written at once, read back in order, gone with the stored result.
Through the real Worker without a broker (as ``test_worker_lifecycle.py``):
a job whose first worker stops answering mid-generation is taken by a
second worker on the same store, which hands the saved tokens to its
engine, generates only the rest, streams a first chunk that carries the
saved text (``resumed``), answers the uninterrupted text, and leaves no
saved tokens behind.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from jaxserve.engine.types import PriorOutput
from jaxserve.worker.progress import prior_output
from jaxserve.worker.store import MemoryStore, Record, RedisStore, SqliteStore, TokenChunk
from queue_support import EchoEngine, expected_completion, piece_token
from test_worker_lifecycle import FakeMessage, FlakyStore, _until, deliver, settled, worker  # noqa: F401 - worker: a fixture

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def store(request, tmp_path):
    if request.param == "memory":
        yield MemoryStore()
        return
    if request.param == "sqlite":
        s = SqliteStore(tmp_path / "store.sqlite3")
        yield s
        await s.close()
        return
    s = RedisStore(namespace=f"jaxserve-test-{uuid.uuid4().hex[:8]}")
    try:
        await s.ping()
    except Exception:  # noqa: BLE001 - no Redis on this machine
        pytest.skip("no Redis at 127.0.0.1:6379")
    yield s
    for key in await s._r.keys(f"{s.ns}:*"):
        await s._r.delete(key)
    await s.close()


def _chunk(start: int, ids: list[int], fingerprint: str = "f", model: str = "m", **kw) -> TokenChunk:
    return TokenChunk(start, tuple(ids), fingerprint, model, **kw)


async def test_saved_chunks_come_back_in_order_and_go_with_the_stored_result(store):
    top = (((5, -0.1), (6, -2.0)), ((7, -0.3), (8, -1.5)))
    await store.save_tokens([("a", _chunk(0, [1, 2], logprobs=(-0.1, -0.3), top_logprobs=top)), ("b", _chunk(0, [9]))])
    await store.save_tokens([("a", _chunk(2, [3])), ("b", _chunk(1, [10, 11]))])
    a = await store.saved_tokens("a")
    assert [c.start for c in a] == [0, 2] and a[0].token_ids == (1, 2) and a[0].top_logprobs == top
    assert a[0].logprobs == (-0.1, -0.3) and a[1].logprobs is None
    assert [c.token_ids for c in await store.saved_tokens("b")] == [(9,), (10, 11)]
    await store.put("a", Record({"status": "ok"}, [], "f"))  # a result stored: its saved tokens go
    await store.drop_tokens("b")  # a job answered with an error: its saved tokens go
    assert await store.saved_tokens("a") == [] and await store.saved_tokens("b") == []
    assert await store.saved_tokens("never") == []


def test_chunks_join_into_the_prior_output_of_the_same_job_on_the_same_model():
    chunks = [
        _chunk(0, [1, 2, 3]),
        _chunk(0, [50, 51], fingerprint="another body"),  # a reused key's: never continued
        _chunk(3, [4, 5]),
        _chunk(4, [6, 7]),  # a later run rewrote from position 4
        _chunk(9, [99]),  # past the end: a gap, not joined
        _chunk(0, [60], model="another model"),
    ]
    assert prior_output(chunks, "f", "m", logprobs=False, top=False) == PriorOutput((1, 2, 3, 4, 6, 7))
    assert prior_output(chunks, "f", "other", logprobs=False, top=False) is None
    # a job that asks for logprobs continues only from tokens saved with theirs
    assert prior_output(chunks, "f", "m", logprobs=True, top=False) is None
    with_lp = [_chunk(0, [1, 2], logprobs=(-1.0, -2.0)), _chunk(2, [3], logprobs=(-3.0,))]
    assert prior_output(with_lp, "f", "m", logprobs=True, top=False) == PriorOutput((1, 2, 3), (-1.0, -2.0, -3.0))


JOB = {"prompt": "one two three four five six", "max_tokens": 30, "temperature": 0, "stream": True}


async def test_a_job_whose_worker_died_continues_from_its_saved_tokens(worker):  # noqa: F811 - fixture
    store = FlakyStore()
    first_engine = EchoEngine(step_s=0.02)
    a, a_pub = await worker(
        first_engine, store=store, claim_lease_s=0.3, save_tokens_every=2, save_tokens_interval_s=0.05
    )
    a.spawn(a.saver.run())
    await deliver(a, FakeMessage(JOB, "k"))
    await asyncio.wait_for(_until(lambda: len(store._tokens.get("k", [])) >= 3), 10)
    # The first worker stops answering mid-generation (as a SIGKILLed one
    # would: its delivery unsettled, its claim no longer renewed).
    first_engine.stall()
    await asyncio.sleep(0.1)
    saved = prior_output(
        await store.saved_tokens("k"), a.runs.get("k").job.fingerprint, "echo", logprobs=False, top=False
    )
    assert saved is not None and 0 < len(saved.token_ids) < JOB["max_tokens"]
    streamed_by_a = sum(m.get("tokens", 0) for _, m in a_pub.sent if m["type"] == "chunk")
    await asyncio.sleep(0.3)  # its claim lease runs out

    second_engine = EchoEngine(step_s=0.001)
    b, b_pub = await worker(second_engine, store=store, save_tokens_every=2, save_tokens_interval_s=0.05)
    again = FakeMessage(JOB, "k", redelivered=True)
    await deliver(b, again)
    await settled(b, again)

    text, reason = expected_completion(JOB["prompt"], JOB["max_tokens"])
    [final] = b_pub.finals()
    assert again.settlements == ["ack"] and final["status"] == "ok"
    assert final["text"] == text and final["finish_reason"] == reason  # the uninterrupted run's
    assert final["usage"]["completion_tokens"] == JOB["max_tokens"]
    # the second engine was handed the saved tokens and generated only the rest
    resumed = second_engine.priors["k"]
    assert resumed.token_ids == saved.token_ids == tuple(piece_token(i) for i in range(len(saved.token_ids)))
    chunks = [m for _, m in b_pub.sent if m["type"] == "chunk"]
    generated_by_b = sum(c["tokens"] for c in chunks) - chunks[0]["resumed"]
    assert chunks[0]["seq"] == 0 and chunks[0]["resumed"] == len(saved.token_ids)
    assert generated_by_b == JOB["max_tokens"] - len(saved.token_ids)
    assert "".join(c["text"] for c in chunks) == text  # the new run's chunks are the whole text
    # the work done twice: what the first worker generated past its last save
    recomputed = streamed_by_a - len(saved.token_ids)
    assert 0 <= recomputed < streamed_by_a
    assert b.stats["resumed"] == 1
    assert await store.saved_tokens("k") == []  # gone with the stored result


async def test_a_run_that_goes_back_to_the_broker_saves_its_last_tokens(worker):  # noqa: F811 - fixture
    """A drain (or any requeue while the key is still this worker's) saves
    what was generated since the last save, so the next worker loses
    nothing; tokens of a job answered with an error are dropped."""
    store = FlakyStore()
    engine = EchoEngine(step_s=0.01)
    w, _ = await worker(engine, store=store, save_tokens_every=1000, save_tokens_interval_s=60.0)
    m = FakeMessage(JOB, "k")
    await deliver(w, m)
    await asyncio.wait_for(_until(lambda: "k" in w.runs and w.runs.get("k").progress is not None), 5)
    await asyncio.wait_for(_until(lambda: len(w.runs.get("k").progress.token_ids) >= 4), 5)
    engine.stall()
    await asyncio.sleep(0.05)
    generated = list(w.runs.get("k").progress.token_ids)
    assert await store.saved_tokens("k") == []  # nothing due yet
    await w.runs.get("k").requeue("drain")
    assert m.settlements == ["requeue"]
    [chunk] = await store.saved_tokens("k")
    assert list(chunk.token_ids) == generated

    cancelled = FakeMessage(JOB, "c")
    await deliver(w, cancelled)
    await asyncio.wait_for(_until(lambda: "c" in w.runs and w.runs.get("c").progress is not None), 5)
    await store.save_tokens([("c", _chunk(0, [piece_token(0)], fingerprint=w.runs.get("c").job.fingerprint))])
    await w.control.on_message(FakeMessage({"type": "cancel", "id": "c"}, None))
    await settled(w, cancelled)
    assert await store.saved_tokens("c") == []
