"""Two gateway replicas on one Redis and one files folder (``--store
redis``): a batch created through one is read, with live counts, through
the other, and cancelled through the other: its runner stops, the work
still out is cancelled on the worker, and every request ends up in exactly
one of the output and error files. And ``completion_window`` is a
deadline: a batch still running when it passes ends ``expired``."""

from __future__ import annotations

import asyncio
import io
import json
import time

import openai
import pytest
import redis

from gateway_support import GatewayProcess, openai_line
from queue_support import EchoEngine

pytestmark = pytest.mark.timeout(180)


def _file(n: int) -> bytes:
    return "\n".join(openai_line(f"q-{i}", f"question {i}", model="echo", max_tokens=8) for i in range(n)).encode()


async def _poll(sdk: openai.OpenAI, batch_id: str, until, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while True:
        batch = await asyncio.to_thread(sdk.batches.retrieve, batch_id)
        if until(batch):
            return batch
        assert time.monotonic() < end, batch
        await asyncio.sleep(0.2)


async def _lines(sdk: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = await asyncio.to_thread(sdk.files.content, file_id)
    return [json.loads(x) for x in content.text.splitlines()]


@pytest.fixture
def redis_namespace(prefix):
    yield prefix
    r = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    keys = list(r.scan_iter(f"{prefix}:gateway:*"))
    if keys:
        r.delete(*keys)


async def test_replicas_share_batches_and_a_cancel_through_either_stops_it(harness, prefix, redis_namespace, tmp_path):
    engine = EchoEngine(max_num_seqs=8, interactive_reserved_seqs=2, step_s=0.05)
    await harness.start(engine)
    shared = ["--store", "redis", "--files-dir", str(tmp_path / "files")]
    a = GatewayProcess(prefix, tmp_path / "state-a", tmp_path / "a.log", *shared)
    b = GatewayProcess(prefix, tmp_path / "state-b", tmp_path / "b.log", *shared)
    await asyncio.gather(asyncio.to_thread(a.start), asyncio.to_thread(b.start))
    try:
        sdk_a = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0)
        sdk_b = openai.OpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0)
        upload = await asyncio.to_thread(sdk_a.files.create, file=("q.jsonl", io.BytesIO(_file(120))), purpose="batch")
        assert (await asyncio.to_thread(sdk_b.files.retrieve, upload.id)).bytes == upload.bytes
        batch = await asyncio.to_thread(
            sdk_a.batches.create, input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        seen = await _poll(sdk_b, batch.id, lambda x: x.request_counts.completed >= 12)  # A runs it, B sees it
        assert seen.status == "in_progress" and seen.request_counts.total == 120
        with pytest.raises(openai.ConflictError) as info:  # a running batch's input stays
            await asyncio.to_thread(sdk_b.files.delete, upload.id)
        assert info.value.code == "file_in_use"
        cancelling = await asyncio.to_thread(sdk_b.batches.cancel, batch.id)
        assert cancelling.status == "cancelling"
        done = await _poll(sdk_a, batch.id, lambda x: x.status in ("cancelled", "completed", "failed", "expired"))
        assert done.status == "cancelled" and done.cancelled_at is not None
        out = await _lines(sdk_b, done.output_file_id)
        err = await _lines(sdk_b, done.error_file_id)
        assert 12 <= len(out) < 120 and len(out) + len(err) == 120
        assert sorted(x["custom_id"] for x in out + err) == sorted(f"q-{i}" for i in range(120))
        assert {x["error"]["code"] for x in err} <= {"batch_cancelled", "cancelled"}
        assert done.request_counts.completed == len(out) and done.request_counts.failed == len(err)
        assert engine.aborted  # jobs the worker held were cancelled, not run to their end
        with pytest.raises(openai.ConflictError):
            await asyncio.to_thread(sdk_b.batches.cancel, batch.id)
        listed = await asyncio.to_thread(sdk_b.batches.list)
        assert [x.id for x in listed.data] == [batch.id]
    finally:
        await asyncio.gather(asyncio.to_thread(a.stop), asyncio.to_thread(b.stop))


async def test_completion_window_is_a_deadline(harness, prefix, tmp_path):
    engine = EchoEngine(max_num_seqs=4, interactive_reserved_seqs=1, step_s=0.05)
    await harness.start(engine)
    gateway = GatewayProcess(prefix, tmp_path / "state", tmp_path / "gateway.log")
    await asyncio.to_thread(gateway.start)
    try:
        sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        upload = await asyncio.to_thread(sdk.files.create, file=("q.jsonl", io.BytesIO(_file(80))), purpose="batch")
        batch = await asyncio.to_thread(
            sdk.batches.create, input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="3s"
        )
        assert batch.expires_at - batch.created_at == 3
        done = await _poll(sdk, batch.id, lambda x: x.status in ("expired", "completed", "failed"), timeout=60)
        assert done.status == "expired" and done.expired_at is not None
        out = await _lines(sdk, done.output_file_id)
        err = await _lines(sdk, done.error_file_id)
        assert len(out) + len(err) == 80 and len(err) > 0
        assert {x["error"]["code"] for x in err} <= {"batch_expired", "expired", "cancelled"}
        assert sorted(x["custom_id"] for x in out + err) == sorted(f"q-{i}" for i in range(80))
    finally:
        await asyncio.to_thread(gateway.stop)
