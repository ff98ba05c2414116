"""``kill -9`` of the gateway in the middle of a 500-line batch, then a
fresh gateway on the same state folder: the batch completes, every
``custom_id`` is answered exactly once, and the worker's engine ran every
job once (its per-key add counts and the worker's job counters), the
republished jobs answered from the workers' idempotency store."""

from __future__ import annotations

import asyncio
import io
import json
import time

import openai
import pytest
from prometheus_client import generate_latest

from gateway_support import GatewayProcess, openai_line
from queue_support import EchoEngine

pytestmark = pytest.mark.timeout(300)

LINES = 500


def _batch_input() -> bytes:
    lines = [
        openai_line(f"doc-{i:03d}", f"document {i} says hello", model="echo", max_tokens=4, chat=False)
        for i in range(LINES)
    ]
    return ("\n".join(lines) + "\n").encode()


def _jobs_total(worker, outcome: str) -> float:
    needle = f'jaxserve_jobs_total{{model_name="echo",outcome="{outcome}",queue="batch"}} '
    for line in generate_latest(worker.served.metrics.registry).decode().splitlines():
        if line.startswith(needle):
            return float(line.split()[-1])
    return 0.0


async def test_gateway_killed_mid_batch_resumes_without_running_anything_twice(harness, prefix, tmp_path):
    engine = EchoEngine(max_num_seqs=8, interactive_reserved_seqs=2, step_s=0.02)
    worker = await harness.start(engine)
    state = tmp_path / "state"
    first = GatewayProcess(prefix, state, tmp_path / "gateway-1.log", "--batch-lease", "3")
    await asyncio.to_thread(first.start)
    sdk = openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    upload = await asyncio.to_thread(sdk.files.create, file=("docs.jsonl", io.BytesIO(_batch_input())), purpose="batch")
    batch = await asyncio.to_thread(
        sdk.batches.create, input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    end = time.monotonic() + 120
    while batch.request_counts.completed < 60:
        assert time.monotonic() < end and batch.status in ("validating", "in_progress"), batch
        await asyncio.sleep(0.05)
        batch = await asyncio.to_thread(sdk.batches.retrieve, batch.id)
    first.kill()  # SIGKILL mid-batch: results keep arriving in the batch's reply queue meanwhile
    at_kill = batch.request_counts.completed
    assert at_kill < LINES
    await asyncio.sleep(1.0)
    second = GatewayProcess(prefix, state, tmp_path / "gateway-2.log", "--batch-lease", "3", port=first.port)
    await asyncio.to_thread(second.start)
    try:
        end = time.monotonic() + 180
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < end, batch
            await asyncio.sleep(0.2)
            batch = await asyncio.to_thread(sdk.batches.retrieve, batch.id)
        assert batch.status == "completed" and batch.error_file_id is None, batch
        assert batch.request_counts.completed == LINES and batch.request_counts.failed == 0
        content = await asyncio.to_thread(sdk.files.content, batch.output_file_id)
        lines = [json.loads(x) for x in content.text.splitlines()]
        ids = [x["custom_id"] for x in lines]
        assert len(ids) == LINES and set(ids) == {f"doc-{i:03d}" for i in range(LINES)}  # each exactly once
        for x in lines:
            assert x["response"]["body"]["choices"][0]["text"].startswith("document ")
        assert any(e.get("event") == "gateway_batch_adopted" for e in second.log_events())
        # the engine ran each job once: republished jobs were answered from the store
        assert len(engine.add_count) == LINES and max(engine.add_count.values()) == 1, engine.add_count.most_common(3)
        await asyncio.sleep(0.5)  # the last acks are counted just after their results went out
        assert _jobs_total(worker, "ok") == LINES
    finally:
        await asyncio.to_thread(second.stop)
