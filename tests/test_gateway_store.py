"""The gateway's two homes for files and batches, SQLite and Redis (the
real Redis the workers use), pass the same checks: records round-trip,
listings are per tenant and newest first with OpenAI's ``after`` cursor,
open batches are found for a restart, one owner at a time holds a batch's
lease and another takes it once it runs out, a cancel asked on one replica
is seen by the runner on another."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from jaxserve.gateway.store import GatewayStore, make_store, public

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["sqlite", "redis"])
async def store(request, tmp_path):
    namespace = f"test-{uuid.uuid4().hex[:10]}"
    s = make_store(request.param, state_dir=tmp_path, redis_url="redis://127.0.0.1:6379/0", namespace=namespace)
    yield s
    if request.param == "redis":
        keys = [k async for k in s._r.scan_iter(f"{namespace}:gateway:*")]  # type: ignore[attr-defined]
        if keys:
            await s._r.delete(*keys)  # type: ignore[attr-defined]
    await s.close()


def _batch(bid: str, tenant: str, created: int, status: str = "in_progress") -> dict:
    return {"id": bid, "object": "batch", "status": status, "created_at": created, "_tenant": tenant, "_priority": None}


async def test_files_round_trip_per_tenant(store: GatewayStore):
    for i, tenant in enumerate(["a", "a", "b"]):
        await store.put_file({"id": f"file-{i}", "created_at": 100 + i, "purpose": "batch", "_tenant": tenant})
    got = await store.get_file("file-1")
    assert (
        got is not None
        and got["_tenant"] == "a"
        and public(got)
        == {
            "id": "file-1",
            "created_at": 101,
            "purpose": "batch",
        }
    )
    assert [f["id"] for f in await store.list_files("a", 10)] == ["file-1", "file-0"]
    assert await store.delete_file("file-1") and not await store.delete_file("file-1")
    assert await store.get_file("file-1") is None
    assert [f["id"] for f in await store.list_files("a", 10)] == ["file-0"]


async def test_batches_listing_cursor_and_open_ones(store: GatewayStore):
    for i in range(5):
        await store.put_batch(_batch(f"batch_{i}", "a" if i != 2 else "b", 1000 + i))
    await store.put_batch(_batch("batch_3", "a", 1003, status="completed"))  # an update keeps its place
    assert [b["id"] for b in await store.list_batches("a", 2)] == ["batch_4", "batch_3"]
    assert [b["id"] for b in await store.list_batches("a", 10, after="batch_3")] == ["batch_1", "batch_0"]
    assert [b["id"] for b in await store.list_batches(None, 10)] == [f"batch_{i}" for i in (4, 3, 2, 1, 0)]
    assert [b["id"] for b in await store.open_batches()] == ["batch_0", "batch_1", "batch_2", "batch_4"]
    got = await store.get_batch("batch_3")
    assert got is not None and got["status"] == "completed"


async def test_one_owner_holds_a_lease_until_it_runs_out(store: GatewayStore):
    await store.put_batch(_batch("batch_x", "a", 1))
    assert await store.claim("batch_x", "gw-1", 0.5)
    assert await store.claim("batch_x", "gw-1", 0.5)  # its owner renews it
    assert not await store.claim("batch_x", "gw-2", 0.5)
    await asyncio.sleep(0.7)
    assert await store.claim("batch_x", "gw-2", 5)  # gw-1 stopped renewing: taken over
    assert not await store.claim("batch_x", "gw-1", 5)
    await store.release("batch_x", "gw-1")  # not its owner: nothing happens
    assert not await store.claim("batch_x", "gw-3", 5)
    await store.release("batch_x", "gw-2")
    assert await store.claim("batch_x", "gw-3", 5)


async def test_a_cancel_is_a_flag_apart_from_the_record(store: GatewayStore):
    await store.put_batch(_batch("batch_c", "a", 1))
    assert not await store.cancel_requested("batch_c")
    await store.request_cancel("batch_c")
    await store.put_batch(_batch("batch_c", "a", 1))  # the runner rewrites its record every second
    assert await store.cancel_requested("batch_c")
